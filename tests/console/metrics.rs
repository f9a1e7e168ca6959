//! Each action counts one in `idempotency_console_actions_total`, by action and result,
//! with no identity in its labels.
#![cfg(feature = "metrics")]

use http::StatusCode;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::MetricKind;
use serde_json::json;
use tower_idempotency::ledger::LedgerKey;

use super::harness::{api_record, console_over_store, in_doubt};

#[test]
fn actions_are_counted_by_action_and_result_without_identities() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let key = LedgerKey::from_bytes([9; 32]);
            let (console, store) = console_over_store().await;
            in_doubt(&store, key, "").await;
            let look = console
                .get_as("alice", "act", &api_record(&key))
                .await
                .json()["look"]
                .clone();
            let body = json!({"expected": look, "reason": "INC-1"});
            let resolve = format!("{}/resolve-not-applied", api_record(&key));
            let forbidden = console.post_json("bob", "read", &resolve, &body).await;
            assert_eq!(forbidden.status, StatusCode::FORBIDDEN);
            let done = console.post_json("alice", "act", &resolve, &body).await;
            assert_eq!(done.status, StatusCode::OK);
            let forget = format!("{}/forget", api_record(&key));
            let absent = console.post_json("alice", "act", &forget, &body).await;
            assert_eq!(absent.status, StatusCode::NOT_FOUND);
        })
    });

    let mut counted = Vec::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let (kind, key) = key.into_parts();
        if key.name() != "idempotency_console_actions_total" {
            continue;
        }
        let (MetricKind::Counter, DebugValue::Counter(n)) = (kind, value) else {
            panic!("a counter");
        };
        let labels: Vec<String> = key
            .labels()
            .map(|label| format!("{}={}", label.key(), label.value()))
            .collect();
        counted.push((labels.join(","), n));
    }
    counted.sort();
    assert_eq!(
        counted,
        [
            ("action=forget,result=absent".to_owned(), 1),
            ("action=resolve_not_applied,result=forbidden".to_owned(), 1),
            ("action=resolve_not_applied,result=forgotten".to_owned(), 1),
        ]
    );
}

/// A resolve as applied counts one by its result in the console's counter, and one in the
/// ledger's own `idempotency_ledger_resolve_total`, by store, expected state and result.
#[test]
fn a_resolve_as_applied_is_counted_by_the_console_and_the_ledger() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let key = LedgerKey::from_bytes([10; 32]);
            let (console, store) = console_over_store().await;
            in_doubt(&store, key, "").await;
            let look = console
                .get_as("alice", "act", &api_record(&key))
                .await
                .json()["look"]
                .clone();
            let body = json!({"expected": look, "reason": "INC-2",
                "outcome": {"status": 201, "body": "ch_1"}});
            let resolve = format!("{}/resolve-applied", api_record(&key));
            let done = console.post_json("alice", "act", &resolve, &body).await;
            assert_eq!(done.status, StatusCode::OK, "{}", done.body);
            let again = console.post_json("alice", "act", &resolve, &body).await;
            assert_eq!(again.status, StatusCode::CONFLICT, "{}", again.body);
        })
    });

    let mut counted = Vec::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let (_, key) = key.into_parts();
        if !matches!(
            key.name(),
            "idempotency_console_actions_total" | "idempotency_ledger_resolve_total"
        ) {
            continue;
        }
        let DebugValue::Counter(n) = value else {
            panic!("a counter");
        };
        let labels: Vec<String> = key
            .labels()
            .map(|label| format!("{}={}", label.key(), label.value()))
            .collect();
        counted.push((format!("{} {}", key.name(), labels.join(",")), n));
    }
    counted.sort();
    assert_eq!(
        counted,
        [
            (
                "idempotency_console_actions_total action=resolve_applied,result=changed"
                    .to_owned(),
                1
            ),
            (
                "idempotency_console_actions_total action=resolve_applied,result=resolved"
                    .to_owned(),
                1
            ),
            (
                "idempotency_ledger_resolve_total store=memory,state=in_doubt,result=changed"
                    .to_owned(),
                1
            ),
            (
                "idempotency_ledger_resolve_total store=memory,state=in_doubt,result=resolved"
                    .to_owned(),
                1
            ),
        ]
    );
}

/// A reconcile now counts one by its result, as every action does: here, refused on a
/// console without a reconciler.
#[test]
fn a_reconcile_now_is_counted_by_its_result() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let key = LedgerKey::from_bytes([11; 32]);
            let (console, store) = console_over_store().await;
            in_doubt(&store, key, "").await;
            let look = console
                .get_as("alice", "act", &api_record(&key))
                .await
                .json()["look"]
                .clone();
            let body = json!({"expected": look, "reason": "INC-1"});
            let reconcile = format!("{}/reconcile-now", api_record(&key));
            let refused = console.post_json("alice", "act", &reconcile, &body).await;
            assert_eq!(refused.status, StatusCode::UNPROCESSABLE_ENTITY);
        })
    });
    let counted: Vec<_> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter(|(key, ..)| key.key().name() == "idempotency_console_actions_total")
        .map(|(key, _, _, value)| {
            let labels: Vec<String> = key
                .key()
                .labels()
                .map(|label| format!("{}={}", label.key(), label.value()))
                .collect();
            (labels.join(","), value)
        })
        .collect();
    assert_eq!(
        counted,
        [(
            "action=reconcile_now,result=no_reconciler".to_owned(),
            DebugValue::Counter(1)
        )]
    );
}
