//! Keyless calls are counted in `idempotency_mcp_keyless_calls_total`, by tool.
#![cfg(feature = "metrics")]

use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use serde_json::json;
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::mcp::{CallerScope, ToolGuard};

use super::harness::{call, duplex, Billing, Effects};

#[test]
fn keyless_calls_are_counted_by_tool() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let guard = ToolGuard::builder(MemoryStore::new(), CallerScope::single_client("o"))
                .build()
                .unwrap();
            let client = duplex(Billing::new(&guard, Effects::default())).await;
            let charge = json!({"order_id": "o-42", "cents": 1999});
            client
                .call_tool(call("charge", charge.clone(), None))
                .await
                .unwrap();
            client
                .call_tool(call("charge", charge.clone(), None))
                .await
                .unwrap();
            // A keyed call is not counted.
            client
                .call_tool(call("charge", charge, Some("k-1")))
                .await
                .unwrap();
        })
    });
    let counted: Vec<_> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| key.key().name() == "idempotency_mcp_keyless_calls_total")
        .map(|(key, _, _, value)| {
            let labels: Vec<_> = key
                .key()
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            (labels, value)
        })
        .collect();
    assert_eq!(
        counted,
        vec![(
            vec![("tool".to_owned(), "charge".to_owned())],
            DebugValue::Counter(2)
        )]
    );
}
