//! Defining fields on the tool face: what the operation is, never discarded. A change
//! there is refused under every policy; a change elsewhere goes on and is named.
#![cfg(feature = "test-util")]

use serde_json::{json, Value};
use tower::{Layer, ServiceExt};
use tower_idempotency::fingerprint::PayloadFields;
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::testing::{ToolDouble, ToolFault};
use tower_idempotency::tool::{ProviderKeys, ToolCall, ToolLayer, ToolSource};
use tower_idempotency::{DriftPolicy, OperationId};

fn op() -> OperationId {
    OperationId::new("task-42", "charge")
}

fn charge(order_id: &str, summary: &str, fulfillment: &str) -> Value {
    json!({"order_id": order_id, "cents": 1999, "summary": summary, "fulfillment_intent_id": fulfillment})
}

fn defining() -> PayloadFields {
    PayloadFields::new(["/order_id", "/cents"]).unwrap()
}

const POLICIES: [Option<DriftPolicy>; 3] = [
    None,
    Some(DriftPolicy::ResendFrozen),
    Some(DriftPolicy::Reject),
];

/// A step identity reused for another order: refused under the default policy and every
/// other, never answered with the first order's receipt.
#[tokio::test]
async fn a_changed_defining_field_is_refused_under_every_policy() {
    for policy in POLICIES {
        let mut builder = ToolLayer::builder(MemoryStore::new(), "charge", ProviderKeys::Ignored)
            .defining_fields(defining());
        if let Some(policy) = policy {
            builder = builder.drift_policy(policy);
        }
        let sdk = ToolDouble::new();
        let tool = builder.build().unwrap().layer(sdk.clone());
        tool.clone()
            .oneshot(ToolCall::new(op(), charge("o-42", "a", "fi_1")))
            .await
            .unwrap();
        let refused = tool
            .oneshot(ToolCall::new(op(), charge("o-43", "a", "fi_1")))
            .await
            .err()
            .unwrap_or_else(|| panic!("{policy:?}: another order got the first's receipt"));
        let drift = refused
            .idempotency_error()
            .and_then(|error| error.drift())
            .unwrap_or_else(|| panic!("{policy:?}: {refused:?}"));
        assert_eq!(drift.changed_fields().unwrap(), ["order_id"], "{policy:?}");
        assert_eq!(sdk.effects(), 1, "{policy:?}");
    }
}

/// The same while the first order is in doubt: the tool is not called again with the
/// first order's arguments on behalf of the second.
#[tokio::test]
async fn a_changed_defining_field_never_resumes_an_in_doubt_operation() {
    let layer = ToolLayer::builder(MemoryStore::new(), "charge", ProviderKeys::Deduplicates)
        .defining_fields(defining())
        .retry_policy(RetryPolicy::builder().max_attempts(1).build().unwrap())
        .classify(ToolDouble::classifier())
        .build()
        .unwrap();
    let sdk = ToolDouble::deduplicating().with_faults([ToolFault::CommitThenTimeout]);
    let tool = layer.layer(sdk.clone());
    tool.clone()
        .oneshot(ToolCall::new(op(), charge("o-42", "a", "fi_1")))
        .await
        .expect_err("charged, the answer lost");
    let refused = tool
        .oneshot(ToolCall::new(op(), charge("o-43", "a", "fi_1")))
        .await
        .expect_err("another order is not this operation");
    assert!(
        refused.idempotency_error().unwrap().is_drift(),
        "{refused:?}"
    );
    assert_eq!(sdk.calls(), 1, "the first order not called again");
}

/// A reworded call under defining fields is a replay, and its output names what was
/// discarded, as the client face does.
#[tokio::test]
async fn the_discarded_fields_are_named() {
    for policy in POLICIES {
        let mut builder = ToolLayer::builder(MemoryStore::new(), "charge", ProviderKeys::Ignored)
            .defining_fields(defining());
        if let Some(policy) = policy {
            builder = builder.drift_policy(policy);
        }
        let sdk = ToolDouble::new();
        let tool = builder.build().unwrap().layer(sdk.clone());
        tool.clone()
            .oneshot(ToolCall::new(op(), charge("o-42", "a", "fi_1")))
            .await
            .unwrap();
        let again = tool
            .oneshot(ToolCall::new(op(), charge("o-42", "b", "fi_2")))
            .await
            .unwrap();
        assert_eq!(again.source(), ToolSource::Replayed, "{policy:?}");
        let discarded = again.discarded().expect("told");
        assert_eq!(
            discarded.changed_fields(),
            Some(&["fulfillment_intent_id".to_owned(), "summary".to_owned()][..]),
            "{policy:?}"
        );
        assert_eq!(sdk.effects(), 1);
    }
}

/// The discarded fields are named on a store that keeps no field digests of completed
/// records too (Redis here): the recorded outcome carries them.
#[cfg(feature = "redis")]
#[tokio::test]
async fn the_discarded_fields_are_named_over_redis() {
    let Some(redis) = crate::support::redis::redis_url().await else {
        return;
    };
    let store = tower_idempotency::ledger::RedisStore::builder(redis.url())
        .prefix(format!("tool-defining:{:016x}:", fastrand::u64(..)))
        .connect()
        .await
        .expect("connect to Redis");
    let sdk = ToolDouble::new();
    let tool = ToolLayer::builder(store, "charge", ProviderKeys::Ignored)
        .defining_fields(defining())
        .build()
        .unwrap()
        .layer(sdk.clone());
    tool.clone()
        .oneshot(ToolCall::new(op(), charge("o-42", "a", "fi_1")))
        .await
        .unwrap();
    let again = tool
        .clone()
        .oneshot(ToolCall::new(op(), charge("o-42", "b", "fi_1")))
        .await
        .unwrap();
    assert_eq!(again.source(), ToolSource::Replayed);
    assert_eq!(
        again.discarded().expect("told").changed_fields(),
        Some(&["summary".to_owned()][..])
    );
    let refused = tool
        .oneshot(ToolCall::new(op(), charge("o-43", "a", "fi_1")))
        .await
        .expect_err("another order");
    assert!(refused.idempotency_error().unwrap().is_drift());
    assert_eq!(sdk.effects(), 1);
}
