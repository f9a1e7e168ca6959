//! The tool face's conformance over every store: memory, Redis, Redis Cluster, PostgreSQL.
//! The same scenarios, the same answers, and one effect per operation in the tool double.
#![cfg(feature = "test-util")]

use crate::support::postgres as postgres_support;
use crate::support::redis as redis_support;
use crate::support::redis_cluster as cluster_support;

use std::sync::Arc;

use serde_json::{json, Value};
use tower::{Layer, ServiceExt};
use tower_idempotency::idempotency::{InDoubtOperation, Reconciled};
use tower_idempotency::ledger::{IdempotencyStore, MemoryStore};
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::testing::{ToolDouble, ToolDoubleError, ToolFault};
use tower_idempotency::tool::{
    applied, frozen_arguments, ProviderKeys, ToolCall, ToolError, ToolLayer, ToolOutput, ToolSource,
};
use tower_idempotency::OperationId;

type Store = Arc<dyn IdempotencyStore>;

fn one_attempt() -> RetryPolicy {
    RetryPolicy::builder().max_attempts(1).build().unwrap()
}

fn fresh_op(step: &str) -> OperationId {
    OperationId::new(format!("task-{:016x}", fastrand::u64(..)), step)
}

fn charge(summary: &str) -> Value {
    json!({"order_id": "o-42", "cents": 1999, "summary": summary})
}

fn layer(
    store: &Store,
    provider: ProviderKeys,
) -> ToolLayer<fn(&ToolDoubleError) -> tower_idempotency::tool::Verdict> {
    ToolLayer::builder(store.clone(), "charge_customer", provider)
        .scope("conformance")
        .retry_policy(one_attempt())
        .classify(ToolDouble::classifier())
        .build()
        .unwrap()
}

async fn call(
    layer: &ToolLayer<fn(&ToolDoubleError) -> tower_idempotency::tool::Verdict>,
    sdk: &ToolDouble,
    op: &OperationId,
    args: Value,
) -> Result<ToolOutput<Value>, ToolError<ToolDoubleError>> {
    layer
        .layer(sdk.clone())
        .oneshot(ToolCall::new(op.clone(), args))
        .await
}

/// Every scenario, against `store`.
async fn conformance(store: Store) {
    a_call_runs_once_and_replays(&store).await;
    regenerated_arguments_use_the_frozen_ones(&store).await;
    commit_then_timeout_without_keys_stays_in_doubt(&store).await;
    commit_then_timeout_with_keys_resumes_with_the_frozen_arguments(&store).await;
    a_failure_before_the_effect_is_released(&store).await;
    a_final_answer_is_recorded_and_replayed(&store).await;
    an_in_doubt_call_is_reconciled(&store).await;
    a_panic_after_the_effect_leaves_it_in_doubt(&store).await;
}

async fn a_call_runs_once_and_replays(store: &Store) {
    let (layer, sdk, op) = (
        layer(store, ProviderKeys::Ignored),
        ToolDouble::new(),
        fresh_op("charge"),
    );
    let first = call(&layer, &sdk, &op, charge("charge it")).await.unwrap();
    assert_eq!(first.source(), ToolSource::Called);
    let again = call(&layer, &sdk, &op, charge("charge it")).await.unwrap();
    assert_eq!(again.source(), ToolSource::Replayed);
    assert_eq!(
        again.value(),
        first.value(),
        "the replay is the first receipt"
    );
    assert!(
        again.discarded().is_none(),
        "same arguments: nothing discarded"
    );
    assert_eq!(sdk.effects_of(&op), 1);
}

async fn regenerated_arguments_use_the_frozen_ones(store: &Store) {
    let (layer, sdk, op) = (
        layer(store, ProviderKeys::Ignored),
        ToolDouble::new(),
        fresh_op("charge"),
    );
    call(&layer, &sdk, &op, charge("charge it")).await.unwrap();
    let again = call(&layer, &sdk, &op, charge("bill the customer"))
        .await
        .unwrap();
    assert_eq!(again.source(), ToolSource::Replayed);
    assert_eq!(again.value()["arguments"]["summary"], "charge it");
    assert_eq!(
        again
            .discarded()
            .expect("the caller is told")
            .changed_fields(),
        Some(&["summary".to_owned()][..])
    );
    assert_eq!(sdk.effects_of(&op), 1);
}

async fn commit_then_timeout_without_keys_stays_in_doubt(store: &Store) {
    let (layer, op) = (layer(store, ProviderKeys::Ignored), fresh_op("charge"));
    let sdk = ToolDouble::new().with_faults([ToolFault::CommitThenTimeout]);
    let failed = call(&layer, &sdk, &op, charge("charge it"))
        .await
        .unwrap_err();
    assert!(matches!(failed, ToolError::Tool(ToolDoubleError::TimedOut)));
    let again = call(&layer, &sdk, &op, charge("bill the customer"))
        .await
        .unwrap_err();
    assert!(
        again.idempotency_error().unwrap().is_in_doubt(),
        "{again:?}"
    );
    assert_eq!(
        sdk.effects_of(&op),
        1,
        "a key-less SDK is never called again blindly"
    );
}

async fn commit_then_timeout_with_keys_resumes_with_the_frozen_arguments(store: &Store) {
    let (layer, op) = (layer(store, ProviderKeys::Deduplicates), fresh_op("charge"));
    let sdk = ToolDouble::deduplicating().with_faults([ToolFault::CommitThenTimeout]);
    call(&layer, &sdk, &op, charge("charge it"))
        .await
        .unwrap_err();
    let resumed = call(&layer, &sdk, &op, charge("bill the customer"))
        .await
        .unwrap();
    assert_eq!(resumed.source(), ToolSource::Resumed);
    assert_eq!(resumed.value()["arguments"]["summary"], "charge it");
    assert_eq!(
        resumed.discarded().unwrap().changed_fields(),
        Some(&["summary".to_owned()][..])
    );
    assert_eq!(sdk.calls(), 2, "called again, with the same key");
    assert_eq!(
        sdk.effects_of(&op),
        1,
        "the provider deduplicated on the key"
    );
}

async fn a_failure_before_the_effect_is_released(store: &Store) {
    let (layer, op) = (layer(store, ProviderKeys::Ignored), fresh_op("charge"));
    let sdk = ToolDouble::new().with_faults([ToolFault::FailBefore]);
    let failed = call(&layer, &sdk, &op, charge("charge it"))
        .await
        .unwrap_err();
    assert!(matches!(failed, ToolError::Tool(ToolDoubleError::Refused)));
    let again = call(&layer, &sdk, &op, charge("charge it")).await.unwrap();
    assert_eq!(again.source(), ToolSource::Called, "released: runs as new");
    assert_eq!(sdk.effects_of(&op), 1);
}

async fn a_final_answer_is_recorded_and_replayed(store: &Store) {
    let (layer, op) = (layer(store, ProviderKeys::Ignored), fresh_op("charge"));
    let sdk = ToolDouble::new().with_faults([ToolFault::Decline]);
    let ToolError::Final(first) = call(&layer, &sdk, &op, charge("charge it"))
        .await
        .unwrap_err()
    else {
        panic!("a decline is a final answer");
    };
    let ToolError::Final(again) = call(&layer, &sdk, &op, charge("charge it"))
        .await
        .unwrap_err()
    else {
        panic!("the final answer is replayed");
    };
    assert_eq!(first, again);
    assert_eq!(sdk.calls(), 1, "the replay never calls the tool");
    assert_eq!(sdk.effects_of(&op), 0);
}

async fn an_in_doubt_call_is_reconciled(store: &Store) {
    let op = fresh_op("charge");
    let sdk = ToolDouble::new().with_faults([ToolFault::CommitThenTimeout]);
    let found = sdk.clone();
    let looked_up = op.clone();
    let layer = ToolLayer::builder(store.clone(), "charge_customer", ProviderKeys::Ignored)
        .scope("conformance")
        .retry_policy(one_attempt())
        .classify(ToolDouble::classifier())
        .reconcile(move |operation: InDoubtOperation| {
            let (found, looked_up) = (found.clone(), looked_up.clone());
            async move {
                let args: Value = frozen_arguments(&operation)?;
                assert_eq!(
                    args["summary"], "charge it",
                    "the reconciler sees the frozen arguments"
                );
                let made = found.arguments_of(&looked_up);
                Ok(match made.first() {
                    Some(made) => applied(&json!({"receipt": 1, "arguments": made}))?,
                    None => Reconciled::NotApplied,
                })
            }
        })
        .build()
        .unwrap();
    let tool = layer.layer(sdk.clone());
    tool.clone()
        .oneshot(ToolCall::new(op.clone(), charge("charge it")))
        .await
        .unwrap_err();
    let reconciled = tool
        .clone()
        .oneshot(ToolCall::new(op.clone(), charge("reworded")))
        .await
        .unwrap();
    assert_eq!(reconciled.source(), ToolSource::Reconciled);
    assert_eq!(reconciled.value()["arguments"]["summary"], "charge it");
    let replayed = tool
        .oneshot(ToolCall::new(op.clone(), charge("charge it")))
        .await
        .unwrap();
    assert_eq!(
        replayed.source(),
        ToolSource::Replayed,
        "the reconciled outcome is recorded"
    );
    assert_eq!(sdk.effects_of(&op), 1);
}

async fn a_panic_after_the_effect_leaves_it_in_doubt(store: &Store) {
    let (layer, op) = (layer(store, ProviderKeys::Ignored), fresh_op("charge"));
    let sdk = ToolDouble::new().with_faults([ToolFault::Panic { after_commit: true }]);
    let tool = layer.layer(sdk.clone());
    let first = ToolCall::new(op.clone(), charge("charge it"));
    let panicked = tokio::spawn(tool.oneshot(first)).await;
    assert!(panicked.unwrap_err().is_panic());
    // The dropped lease settles in the background on a store that awaits.
    let mut again = call(&layer, &sdk, &op, charge("charge it")).await;
    for _ in 0..100 {
        match &again {
            Err(ToolError::Idempotency(err)) if err.is_busy() => {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                again = call(&layer, &sdk, &op, charge("charge it")).await;
            }
            _ => break,
        }
    }
    let again = again.unwrap_err();
    assert!(
        again.idempotency_error().unwrap().is_in_doubt(),
        "{again:?}"
    );
    assert_eq!(sdk.effects_of(&op), 1);
}

#[tokio::test]
async fn the_tool_face_conforms_over_the_memory_store() {
    conformance(Arc::new(MemoryStore::new())).await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn the_tool_face_conforms_over_redis() {
    let Some(redis) = redis_support::redis_url().await else {
        return;
    };
    let store = tower_idempotency::ledger::RedisStore::builder(redis.url())
        .prefix(format!("tool-face:{:016x}:", fastrand::u64(..)))
        .connect()
        .await
        .expect("connect to Redis");
    conformance(Arc::new(store)).await;
}

#[cfg(feature = "redis-cluster")]
#[tokio::test]
async fn the_tool_face_conforms_over_redis_cluster() {
    let Some(cluster) = cluster_support::RedisCluster::shared().await else {
        return;
    };
    let store = tower_idempotency::ledger::RedisStore::cluster_builder(cluster.urls())
        .prefix(format!("tool-face:{:016x}:", fastrand::u64(..)))
        .connect()
        .await
        .expect("connect to the cluster");
    conformance(Arc::new(store)).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn the_tool_face_conforms_over_postgres() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let store = tower_idempotency::ledger::PostgresStore::builder(pg.url())
        .schema(postgres_support::fresh_schema())
        .connect()
        .await
        .expect("connect to PostgreSQL");
    store.migrate().await.expect("migrate");
    conformance(Arc::new(store)).await;
}
