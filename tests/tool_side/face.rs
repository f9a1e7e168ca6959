//! The tool face's behaviours on the memory store: drift policies, fingerprinted fields,
//! tool classes, fail closed, retries by phase, the key, the function form.
#![cfg(feature = "test-util")]

use crate::support::down;

use std::time::Duration;

use serde_json::{json, Value};
use tower::{Layer, ServiceExt};
use tower_idempotency::fingerprint::PayloadFields;
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::testing::{ToolDouble, ToolDoubleError, ToolFault};
use tower_idempotency::tool::{
    idempotent_call, ProviderKeys, ToolCall, ToolClass, ToolError, ToolLayer, ToolSource, Verdict,
};
use tower_idempotency::{DriftPolicy, OperationId};

fn op() -> OperationId {
    OperationId::new("task-42", "charge")
}

fn charge(summary: &str, fulfillment: &str) -> Value {
    json!({"order_id": "o-42", "cents": 1999, "summary": summary, "fulfillment_intent_id": fulfillment})
}

#[tokio::test]
async fn reject_refuses_regenerated_arguments_and_names_the_fields() {
    let layer = ToolLayer::builder(MemoryStore::new(), "charge", ProviderKeys::Ignored)
        .drift_policy(DriftPolicy::Reject)
        .build()
        .unwrap();
    let sdk = ToolDouble::new();
    let tool = layer.layer(sdk.clone());
    tool.clone()
        .oneshot(ToolCall::new(op(), charge("a", "fi_1")))
        .await
        .unwrap();
    let refused = tool
        .oneshot(ToolCall::new(op(), charge("b", "fi_2")))
        .await
        .unwrap_err();
    let drift = refused
        .idempotency_error()
        .unwrap()
        .drift()
        .expect("a drift error");
    assert_eq!(
        drift.changed_fields().unwrap(),
        ["fulfillment_intent_id", "summary"]
    );
    assert_eq!(sdk.effects(), 1);
}

#[tokio::test]
async fn fingerprinted_fields_make_a_reworded_summary_no_drift() {
    let layer = ToolLayer::builder(MemoryStore::new(), "charge", ProviderKeys::Ignored)
        .drift_policy(DriftPolicy::Reject)
        .defining_fields(PayloadFields::new(["/order_id", "/cents"]).unwrap())
        .build()
        .unwrap();
    let sdk = ToolDouble::new();
    let tool = layer.layer(sdk.clone());
    tool.clone()
        .oneshot(ToolCall::new(op(), charge("a", "fi_1")))
        .await
        .unwrap();
    let replayed = tool
        .clone()
        .oneshot(ToolCall::new(op(), charge("b", "fi_2")))
        .await
        .unwrap();
    assert_eq!(
        replayed.source(),
        ToolSource::Replayed,
        "not drift: same defining fields"
    );
    assert!(
        replayed.discarded().is_some(),
        "yet the caller learns its arguments were not used"
    );
    let mut other_amount = charge("a", "fi_1");
    other_amount["cents"] = json!(2999);
    let refused = tool
        .oneshot(ToolCall::new(op(), other_amount))
        .await
        .unwrap_err();
    assert!(refused.idempotency_error().unwrap().is_drift());
    assert_eq!(sdk.effects(), 1);
}

#[tokio::test]
async fn field_order_and_whitespace_are_never_drift() {
    let layer = ToolLayer::builder(MemoryStore::new(), "charge", ProviderKeys::Ignored)
        .drift_policy(DriftPolicy::Reject)
        .build()
        .unwrap();
    let tool = layer.layer(ToolDouble::new());
    let first: Value = serde_json::from_str(r#"{"b": 1, "a": [1, 2]}"#).unwrap();
    let second: Value = serde_json::from_str("{\n  \"a\":[1,2],\"b\":1\n}").unwrap();
    tool.clone()
        .oneshot(ToolCall::new(op(), first))
        .await
        .unwrap();
    let again = tool.oneshot(ToolCall::new(op(), second)).await.unwrap();
    assert_eq!(again.source(), ToolSource::Replayed);
    assert!(again.discarded().is_none());
}

/// The arguments as one run's code typed them and as a resumed run parsed the model's JSON:
/// a struct (fields out of order, a float, a map with integer keys, a string needing
/// escapes) and a `Value` of the same content, reordered and spaced. They freeze to the same
/// bytes, so under `Reject` the second is a replay, not drift; a changed value still is.
#[tokio::test]
async fn typed_and_parsed_arguments_of_one_call_freeze_alike() {
    #[derive(serde::Serialize, serde::Deserialize)]
    struct Charge {
        summary: String,
        cents: f64,
        order_id: String,
        lines: std::collections::BTreeMap<u32, String>,
    }
    let layer = ToolLayer::builder(MemoryStore::new(), "charge", ProviderKeys::Ignored)
        .drift_policy(DriftPolicy::Reject)
        .build()
        .unwrap();
    let effects = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = |effects: std::sync::Arc<std::sync::atomic::AtomicUsize>| {
        move |_: Value, _| {
            effects.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            async { Ok::<_, std::io::Error>(json!({"receipt": "r-1"})) }
        }
    };
    let typed = Charge {
        summary: "charge \"o-42\"\n".into(),
        cents: 19.9,
        order_id: "o-42".into(),
        lines: [(2, "b".into()), (10, "a".into())].into(),
    };
    let first = idempotent_call(&layer, op(), typed, |_: Charge, _| {
        effects.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        async { Ok::<_, std::io::Error>(json!({"receipt": "r-1"})) }
    })
    .await
    .unwrap();
    assert_eq!(first.source(), ToolSource::Called);
    let parsed: Value = serde_json::from_str(
        r#"{ "lines": {"10": "a", "2": "b"}, "order_id": "o-42",
             "cents": 19.90, "summary": "charge \"o-42\"\n" }"#,
    )
    .unwrap();
    let again = idempotent_call(&layer, op(), parsed, count(effects.clone()))
        .await
        .unwrap();
    assert_eq!(again.source(), ToolSource::Replayed);
    assert!(again.discarded().is_none());
    let changed = json!({"lines": {"10": "a", "2": "b"}, "order_id": "o-42", "cents": 20.0, "summary": "charge \"o-42\"\n"});
    let refused = idempotent_call(&layer, op(), changed, count(effects.clone())).await;
    assert!(matches!(refused, Err(ToolError::Idempotency(err)) if err.is_drift()));
    assert_eq!(
        effects.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "one effect in all"
    );
}

#[tokio::test]
async fn reads_pass_straight_through() {
    let layer = ToolLayer::builder(MemoryStore::new(), "lookup", ProviderKeys::Ignored)
        .class(ToolClass::Read)
        .build()
        .unwrap();
    let sdk = ToolDouble::new();
    let tool = layer.layer(sdk.clone());
    for _ in 0..2 {
        let out = tool
            .clone()
            .oneshot(ToolCall::new(op(), json!({"q": 1})))
            .await
            .unwrap();
        assert_eq!(out.source(), ToolSource::PassedThrough);
    }
    assert_eq!(sdk.effects(), 2, "a read is never replayed");
}

#[tokio::test]
async fn an_unavailable_ledger_fails_closed() {
    let layer = ToolLayer::builder(down::DownStore, "charge", ProviderKeys::Ignored)
        .build()
        .unwrap();
    let sdk = ToolDouble::new();
    let refused = layer
        .layer(sdk.clone())
        .oneshot(ToolCall::new(op(), charge("a", "fi_1")))
        .await
        .unwrap_err();
    assert!(refused.idempotency_error().unwrap().is_store());
    assert_eq!(sdk.calls(), 0, "the tool is not called");
}

#[tokio::test(start_paused = true)]
async fn failures_before_the_effect_are_retried_and_may_have_happened_only_with_keys() {
    let policy = || {
        RetryPolicy::builder()
            .max_attempts(3)
            .no_budget()
            .build()
            .unwrap()
    };
    // Before the effect: retried inside the call, with the provider's hint honoured.
    let layer = ToolLayer::builder(MemoryStore::new(), "charge", ProviderKeys::Ignored)
        .retry_policy(policy())
        .classify(|error: &ToolDoubleError| match error {
            ToolDoubleError::Refused => {
                Verdict::before_effect().retry_after(Duration::from_secs(2))
            }
            _ => Verdict::may_have_happened(),
        })
        .build()
        .unwrap();
    let sdk = ToolDouble::new().with_faults([ToolFault::FailBefore]);
    let started = tokio::time::Instant::now();
    let out = layer
        .layer(sdk.clone())
        .oneshot(ToolCall::new(op(), json!(1)))
        .await
        .unwrap();
    assert_eq!(
        (out.source(), sdk.calls(), sdk.effects()),
        (ToolSource::Called, 2, 1)
    );
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "the hint is a floor"
    );

    // May have happened, key-less SDK: never retried.
    let layer = ToolLayer::builder(MemoryStore::new(), "charge", ProviderKeys::Ignored)
        .retry_policy(policy())
        .classify(ToolDouble::classifier())
        .build()
        .unwrap();
    let sdk = ToolDouble::new().with_faults([ToolFault::CommitThenTimeout]);
    layer
        .layer(sdk.clone())
        .oneshot(ToolCall::new(op(), json!(1)))
        .await
        .unwrap_err();
    assert_eq!(sdk.calls(), 1);

    // May have happened, deduplicating provider: retried with the same key.
    let layer = ToolLayer::builder(MemoryStore::new(), "charge", ProviderKeys::Deduplicates)
        .retry_policy(policy())
        .classify(ToolDouble::classifier())
        .build()
        .unwrap();
    let sdk = ToolDouble::deduplicating().with_faults([ToolFault::CommitThenTimeout]);
    let out = layer
        .layer(sdk.clone())
        .oneshot(ToolCall::new(op(), json!(1)))
        .await
        .unwrap();
    assert_eq!(
        (out.source(), sdk.calls(), sdk.effects()),
        (ToolSource::Called, 2, 1)
    );
}

#[tokio::test(start_paused = true)]
async fn a_hung_call_is_left_in_doubt_and_a_live_owner_keeps_its_lease() {
    let layer = ToolLayer::builder(MemoryStore::new(), "charge", ProviderKeys::Ignored)
        .lease(Duration::from_secs(1))
        .busy_policy(tower_idempotency::BusyPolicy::Fail)
        .build()
        .unwrap();
    let sdk = ToolDouble::new().with_faults([ToolFault::Hang { after_commit: true }]);
    let tool = layer.layer(sdk.clone());
    let hung = tokio::spawn(tool.clone().oneshot(ToolCall::new(op(), json!(1))));
    // Many leases later the owner is alive (renewing): the operation is busy, not resumed.
    tokio::time::sleep(Duration::from_secs(10)).await;
    let busy = tool
        .clone()
        .oneshot(ToolCall::new(op(), json!(1)))
        .await
        .unwrap_err();
    assert!(busy.idempotency_error().unwrap().is_busy(), "{busy:?}");
    hung.abort();
    let _ = hung.await;
    let in_doubt = tool
        .oneshot(ToolCall::new(op(), json!(1)))
        .await
        .unwrap_err();
    assert!(
        in_doubt.idempotency_error().unwrap().is_in_doubt(),
        "{in_doubt:?}"
    );
    assert_eq!(sdk.effects(), 1);
}

#[tokio::test]
async fn the_key_reaches_the_tool_and_is_the_derived_one() {
    let layer = ToolLayer::builder(MemoryStore::new(), "email", ProviderKeys::Deduplicates)
        .scope("tenant-a")
        .build()
        .unwrap();
    let out = idempotent_call(
        &layer,
        op(),
        json!({"to": "a@b"}),
        |args: Value, key| async move {
            Ok::<_, ToolDoubleError>(json!({"key": key.to_hex(), "args": args}))
        },
    )
    .await
    .unwrap();
    assert_eq!(out.value()["key"], op().key("tenant-a").to_hex());
}

/// A layer of one attempt a call, `op()` left in doubt on it: its first call (of
/// `charge("a", "fi_1")`, through the function form) timed out.
async fn in_doubt_after_a_timeout() -> ToolLayer {
    let layer = ToolLayer::builder(MemoryStore::new(), "charge", ProviderKeys::Deduplicates)
        .retry_policy(RetryPolicy::builder().max_attempts(1).build().unwrap())
        .build()
        .unwrap();
    let first: Result<_, ToolError<&str>> =
        idempotent_call(&layer, op(), charge("a", "fi_1"), |_: Value, _| async {
            Err::<Value, _>("timed out")
        })
        .await;
    assert!(matches!(first, Err(ToolError::Tool("timed out"))));
    layer
}

#[tokio::test]
async fn the_function_form_uses_the_frozen_arguments_on_a_resume() {
    let layer = in_doubt_after_a_timeout().await;
    let resumed = idempotent_call(
        &layer,
        op(),
        charge("b", "fi_2"),
        |args: Value, _| async move { Ok::<_, &str>(args) },
    )
    .await
    .unwrap();
    assert_eq!(resumed.source(), ToolSource::Resumed);
    assert_eq!(
        resumed.value(),
        &charge("a", "fi_1"),
        "thawed frozen arguments, not regenerated ones"
    );
    assert_eq!(
        resumed.discarded().unwrap().changed_fields().unwrap(),
        ["fulfillment_intent_id", "summary"]
    );
}

#[test]
fn the_builder_refuses_bad_names_and_pointers() {
    assert!(
        ToolLayer::builder(MemoryStore::new(), "a/b", ProviderKeys::Ignored)
            .build()
            .is_err()
    );
    assert!(PayloadFields::new(["order_id"]).is_err());
}

/// A warning is heard by the test listening for it even when another thread, listening to
/// nothing, reaches the warning's callsite first: `tracing` caches one interest per callsite
/// for every thread, and a cache filled on a thread without a subscriber must not silence the
/// callsite for the thread that listens.
#[tokio::test]
async fn a_discarded_call_warns_though_an_unlistened_thread_reached_the_warning_first() {
    let (logs, _default) = crate::support::capture::warnings();
    let discard_once = || async {
        let tool = ToolLayer::builder(MemoryStore::new(), "charge", ProviderKeys::Ignored)
            .build()
            .unwrap()
            .layer(ToolDouble::new());
        tool.clone()
            .oneshot(ToolCall::new(op(), charge("a", "fi_1")))
            .await
            .unwrap();
        let again = tool
            .oneshot(ToolCall::new(op(), charge("b", "fi_2")))
            .await
            .unwrap();
        assert!(again.discarded().is_some());
    };
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(discard_once())
    })
    .join()
    .unwrap();
    assert!(
        logs.text().is_empty(),
        "another thread's warning is not ours"
    );

    discard_once().await;
    let warned = logs
        .text()
        .lines()
        .filter(|line| line.contains("WARN") && line.contains("these discarded"))
        .count();
    assert_eq!(warned, 1, "{}", logs.text());
}

/// A call whose arguments are discarded is told in the log as a warning, once, whichever way
/// the difference is found: the field digests of a completed operation, the frozen arguments
/// of an operation in doubt it resumes, or the arguments' digest on a replay whose defining
/// fields agree.
#[tokio::test]
async fn each_call_whose_arguments_are_discarded_warns_once() {
    let (logs, _default) = crate::support::capture::warnings();
    let warned = || {
        logs.text()
            .lines()
            .filter(|line| line.contains("WARN") && line.contains("these discarded"))
            .count()
    };
    let completed = ToolLayer::builder(MemoryStore::new(), "charge", ProviderKeys::Ignored)
        .build()
        .unwrap()
        .layer(ToolDouble::new());
    completed
        .clone()
        .oneshot(ToolCall::new(op(), charge("a", "fi_1")))
        .await
        .unwrap();
    assert_eq!(warned(), 0, "the first call discards nothing");
    let again = completed
        .oneshot(ToolCall::new(op(), charge("b", "fi_2")))
        .await
        .unwrap();
    assert!(again.discarded().is_some());
    assert_eq!(warned(), 1, "a completed operation: {}", logs.text());

    let defining = ToolLayer::builder(MemoryStore::new(), "charge", ProviderKeys::Ignored)
        .defining_fields(PayloadFields::new(["/order_id", "/cents"]).unwrap())
        .build()
        .unwrap()
        .layer(ToolDouble::new());
    defining
        .clone()
        .oneshot(ToolCall::new(op(), charge("a", "fi_1")))
        .await
        .unwrap();
    let replayed = defining
        .oneshot(ToolCall::new(op(), charge("b", "fi_2")))
        .await
        .unwrap();
    assert!(replayed.discarded().is_some());
    assert_eq!(warned(), 2, "same defining fields: {}", logs.text());

    let in_doubt = in_doubt_after_a_timeout().await;
    let resumed = idempotent_call(
        &in_doubt,
        op(),
        charge("b", "fi_2"),
        |args: Value, _| async move { Ok::<_, &str>(args) },
    )
    .await
    .unwrap();
    assert_eq!(resumed.source(), ToolSource::Resumed);
    assert!(resumed.discarded().is_some());
    assert_eq!(
        warned(),
        3,
        "an operation in doubt, resumed: {}",
        logs.text()
    );
}

/// An `f32` argument freezes as the number its JSON holds: a typed call (`19.9_f32`) and
/// the same call parsed from its JSON are one operation, a replay under `Reject`.
#[tokio::test]
async fn an_f32_argument_and_its_json_are_one_operation() {
    #[derive(serde::Serialize, serde::Deserialize)]
    struct Refund {
        order_id: String,
        amount: f32,
    }
    let layer = ToolLayer::builder(MemoryStore::new(), "refund", ProviderKeys::Ignored)
        .drift_policy(DriftPolicy::Reject)
        .build()
        .unwrap();
    let sdk = ToolDouble::new();
    let typed = Refund {
        order_id: "o-42".into(),
        amount: 19.9,
    };
    let json: Value = serde_json::from_str(&serde_json::to_string(&typed).unwrap()).unwrap();
    layer
        .layer(sdk.clone())
        .oneshot(ToolCall::new(op(), typed))
        .await
        .unwrap();
    let again = layer
        .layer(sdk.clone())
        .oneshot(ToolCall::new(op(), json))
        .await
        .expect("the same call, not drift");
    assert_eq!(again.source(), ToolSource::Replayed);
    assert!(again.discarded().is_none());
    assert_eq!(sdk.effects(), 1);
}

/// A tool call left in doubt, resolved as applied by an operator with the tool's result
/// (a `200` whose body is the result as JSON, as the console's form says), is replayed on
/// the next call: the tool is not called again.
#[tokio::test]
async fn a_tool_call_resolved_as_applied_replays_the_operators_result() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use tower_idempotency::ledger::{
        Expected, Outcome, RecordKind, Records, Resolve, StoredResponse,
    };

    let store = Arc::new(MemoryStore::new());
    let layer = ToolLayer::builder(store.clone(), "charge", ProviderKeys::Deduplicates)
        .retry_policy(RetryPolicy::builder().max_attempts(1).build().unwrap())
        .build()
        .unwrap();
    let first: Result<_, ToolError<&str>> =
        idempotent_call(&layer, op(), charge("a", "fi_1"), |_: Value, _| async {
            Err::<Value, _>("timed out")
        })
        .await;
    assert!(matches!(first, Err(ToolError::Tool("timed out"))));

    let records = Records::new(store);
    let key = records.operation_key(&op());
    let view = records.inspect(key).await.unwrap().expect("left in doubt");
    assert_eq!(RecordKind::of(&view.state), RecordKind::InDoubt);
    // What the record is of: the tool, and the step that called it.
    let origin = view.origin.clone().expect("an origin");
    assert!(origin.is_tool("charge"), "{origin:?}");
    assert_eq!(origin.operation(), Some(op()));
    let result = json!({"charge_id": "ch_1", "status": "succeeded"});
    let mut headers = http::HeaderMap::new();
    headers.insert("content-type", "application/json".parse().unwrap());
    let receipt = Outcome::Response(StoredResponse::new(
        http::StatusCode::OK,
        http::Version::HTTP_11,
        headers,
        result.to_string().into(),
    ));
    assert_eq!(
        records
            .resolve(key, Expected::of(&view), receipt)
            .await
            .unwrap(),
        Resolve::Resolved
    );

    let calls = Arc::new(AtomicUsize::new(0));
    let replayed = idempotent_call(&layer, op(), charge("a", "fi_1"), {
        let calls = calls.clone();
        move |_: Value, _| {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Ok::<Value, &str>(json!({"charged": "again"})) }
        }
    })
    .await
    .unwrap();
    assert_eq!(replayed.source(), ToolSource::Replayed);
    assert_eq!(replayed.value(), &result);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        0,
        "the tool is not called again"
    );
}
