//! The orchestrator's side: a tool called once per operation, the key and the frozen
//! arguments on every re-issue; a server without the capability treated as ignoring keys;
//! annotations failing closed.

use std::sync::atomic::Ordering;
use std::time::Duration;

use serde_json::json;
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::mcp::{CallerScope, McpClient, ToolGuard};
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::tool::ToolSource;
use tower_idempotency::{OperationId, ProviderKeys};

use super::harness::{duplex, http_client, is_replay, serve_http, text, Billing, Effects};

fn args(value: serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
    value.as_object().cloned().unwrap()
}

fn guard() -> ToolGuard {
    ToolGuard::builder(
        MemoryStore::new(),
        CallerScope::function(|_| Some("orchestrator".to_owned())),
    )
    .build()
    .unwrap()
}

/// Attempts cut off after 100 ms: a stream that stays silent is dropped.
fn impatient() -> RetryPolicy {
    RetryPolicy::builder()
        .max_attempts(5)
        .attempt_timeout(Duration::from_millis(100))
        .build()
        .unwrap()
}

/// Open the gate once the first charge is made and its first attempt was dropped.
fn release_after_the_drop(effects: &Effects) {
    let effects = effects.clone();
    tokio::spawn(async move {
        effects.started(1).await;
        tokio::time::sleep(Duration::from_millis(250)).await;
        effects.release(1);
    });
}

#[tokio::test]
async fn a_dropped_attempt_is_reissued_with_its_key_and_frozen_arguments_and_runs_once() {
    let effects = Effects::gated();
    let guard = guard();
    let served = effects.clone();
    let (addr, _server) = serve_http(move || Billing::new(&guard, served.clone())).await;
    let session = http_client(addr).await;
    let client = McpClient::builder(MemoryStore::new(), session.peer().clone())
        .scope("billing-agent")
        .tool_settings(|tool| tool.retry_policy(impatient()))
        .build()
        .unwrap();
    assert_eq!(
        client.provider_keys(),
        ProviderKeys::Deduplicates,
        "the server advertised keys"
    );
    release_after_the_drop(&effects);
    let op = OperationId::new("task-7", "charge");
    let charged = client
        .call(
            op,
            "charge",
            args(json!({"order_id": "o-42", "cents": 1999})),
        )
        .await
        .unwrap();
    assert_eq!(effects.charges(), 1, "one effect for the operation");
    assert_eq!(text(charged.value()), "ch_o-42_1", "the first run's answer");
    assert!(
        is_replay(charged.value()),
        "the server replayed the first run to the re-issue"
    );
}

#[tokio::test]
async fn a_regenerated_step_resends_the_frozen_arguments_under_the_same_key() {
    let effects = Effects::default();
    let guard = guard();
    let served = effects.clone();
    let (addr, _server) = serve_http(move || Billing::new(&guard, served.clone())).await;
    let ledger = MemoryStore::new();
    let session = http_client(addr).await;
    let client = McpClient::builder(ledger.clone(), session.peer().clone())
        .build()
        .unwrap();
    let op = OperationId::new("task-7", "charge");
    let first = client
        .call(
            op.clone(),
            "charge",
            args(json!({"order_id": "o-42", "cents": 1999})),
        )
        .await
        .unwrap();
    // The orchestrator crashed and a new process (same ledger) re-ran the step, whose
    // model regenerated the amount: the first call's outcome, and what was discarded.
    let session = http_client(addr).await;
    let rerun = McpClient::builder(ledger, session.peer().clone())
        .build()
        .unwrap();
    let again = rerun
        .call(
            op,
            "charge",
            args(json!({"order_id": "o-42", "cents": 2999})),
        )
        .await
        .unwrap();
    assert_eq!(text(again.value()), text(first.value()));
    assert_eq!(
        again.discarded().unwrap().changed_fields(),
        Some(&["cents".to_owned()][..])
    );
    assert_eq!(effects.charges(), 1);
}

#[tokio::test]
async fn without_the_capability_a_dropped_attempt_is_in_doubt_never_resent_blind() {
    let effects = Effects::gated();
    let served = effects.clone();
    let (addr, _server) = serve_http(move || Billing::bare(served.clone())).await;
    let session = http_client(addr).await;
    let client = McpClient::builder(MemoryStore::new(), session.peer().clone())
        .tool_settings(|tool| tool.retry_policy(impatient()))
        .build()
        .unwrap();
    assert_eq!(client.provider_keys(), ProviderKeys::Ignored);
    let op = OperationId::new("task-7", "charge");
    let charge = args(json!({"order_id": "o-42", "cents": 1999}));
    let in_doubt = client
        .call(op.clone(), "charge", charge.clone())
        .await
        .unwrap_err();
    assert!(
        in_doubt
            .idempotency_error()
            .is_some_and(|e| e.is_in_doubt()),
        "{in_doubt:?}"
    );
    effects.release(1);
    // Asked again, it is still in doubt: the server cannot deduplicate, so a resend
    // could charge twice; it is reported, for a reconciler or an operator.
    let still = client.call(op, "charge", charge).await.unwrap_err();
    assert!(
        still.idempotency_error().is_some_and(|e| e.is_in_doubt()),
        "{still:?}"
    );
    assert_eq!(effects.started.load(Ordering::SeqCst), 1, "sent once");
}

#[tokio::test]
async fn annotations_fail_closed() {
    let effects = Effects::default();
    let session = duplex(Billing::new(&guard(), effects.clone())).await;
    let op = |step: &str| OperationId::new("task-7", step);
    let order = || args(json!({"order_id": "o-42"}));

    // Untrusted: readOnlyHint is the server's claim only; the read goes through the ledger.
    let untrusted = McpClient::builder(MemoryStore::new(), session.peer().clone())
        .build()
        .unwrap();
    untrusted.call(op("look"), "lookup", order()).await.unwrap();
    let replayed = untrusted.call(op("look"), "lookup", order()).await.unwrap();
    assert_eq!(replayed.source(), ToolSource::Replayed);
    assert_eq!(effects.lookups.load(Ordering::SeqCst), 1);

    // Trusted: a read-only tool passes straight through.
    let trusted = McpClient::builder(MemoryStore::new(), session.peer().clone())
        .trusted(true)
        .build()
        .unwrap();
    let read = trusted.call(op("look"), "lookup", order()).await.unwrap();
    assert_eq!(read.source(), ToolSource::PassedThrough);

    // idempotentHint alone is not enough, even trusted: once per operation.
    trusted.call(op("label"), "label", order()).await.unwrap();
    let again = trusted.call(op("label"), "label", order()).await.unwrap();
    assert_eq!(again.source(), ToolSource::Replayed);
    assert_eq!(effects.labels.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn two_tools_under_one_operation_have_two_keys() {
    let effects = Effects::default();
    let session = duplex(Billing::new(&guard(), effects.clone())).await;
    let client = McpClient::builder(MemoryStore::new(), session.peer().clone())
        .build()
        .unwrap();
    let op = OperationId::new("task-7", "step");
    let order = args(json!({"order_id": "o-42"}));
    client
        .call(op.clone(), "label", order.clone())
        .await
        .unwrap();
    // Not a drift on the server: the key is derived from the operation and the tool.
    let looked = client.call(op, "lookup", order).await.unwrap();
    assert_eq!(text(looked.value()), "order o-42");
}
