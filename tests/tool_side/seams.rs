//! The tool face where it meets the tool and its neighbours: an attempt and the next, the
//! tool's readiness and its call, one tool and another under one `OperationId`, the answer
//! and the record's cap.
#![cfg(feature = "test-util")]

use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use serde_json::{json, Value};
use tower::{Layer, Service, ServiceExt};
use tower_idempotency::fingerprint::RequestPart;
use tower_idempotency::ledger::{IdempotencyStore, MemoryStore};
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::testing::{ToolDouble, ToolDoubleError, ToolFault};
use tower_idempotency::tool::{
    ProviderKeys, ToolCall, ToolError, ToolLayer, ToolOutput, ToolSource, Verdict,
};
use tower_idempotency::OperationId;

fn op() -> OperationId {
    OperationId::new("task-7", "settle")
}

fn charge(summary: &str) -> Value {
    json!({"order_id": "o-7", "cents": 1999, "summary": summary})
}

/// One call of the operation [`op`] with `arguments`, through `tool`.
async fn call<S>(
    tool: &S,
    arguments: Value,
) -> Result<ToolOutput<Value>, ToolError<ToolDoubleError>>
where
    S: Service<ToolCall<Value>, Response = ToolOutput<Value>, Error = ToolError<ToolDoubleError>>
        + Clone,
{
    tool.clone().oneshot(ToolCall::new(op(), arguments)).await
}

fn attempts(max: u32) -> RetryPolicy {
    RetryPolicy::builder()
        .max_attempts(max)
        .backoff(Duration::from_millis(10), Duration::from_millis(10))
        .no_budget()
        .build()
        .unwrap()
}

/// A charge tool on a fresh store whose provider deduplicates, `max` attempts a call.
fn deduplicated_charge(max: u32) -> ToolLayer<fn(&ToolDoubleError) -> Verdict> {
    ToolLayer::builder(MemoryStore::new(), "charge", ProviderKeys::Deduplicates)
        .retry_policy(attempts(max))
        .classify(ToolDouble::classifier())
        .build()
        .unwrap()
}

/// `out` is the operation first called with `charge("first")`, resumed with those
/// arguments for a caller whose own were regenerated, its one effect made once.
fn assert_resumed_with_the_first(out: &ToolOutput<Value>, sdk: &ToolDouble) {
    assert_eq!(out.source(), ToolSource::Resumed);
    assert!(out.discarded().is_some(), "the caller is told");
    assert_eq!(out.value()["arguments"], charge("first"));
    assert_eq!(sdk.effects_of(&op()), 1);
    let calls = sdk.calls_of(&op());
    assert!(
        calls.iter().all(|called| *called == charge("first")),
        "every call carried the frozen arguments: {calls:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_retry_refused_before_the_effect_leaves_an_earlier_attempt_in_doubt() {
    // The provider commits and the answer is lost; the retry, with the same key, is
    // refused before it reaches the provider (a rate limit in front of it).
    let layer = deduplicated_charge(2);
    let sdk = ToolDouble::deduplicating()
        .with_faults([ToolFault::CommitThenTimeout, ToolFault::FailBefore]);
    let tool = layer.layer(sdk.clone());
    let failed = call(&tool, charge("first")).await.unwrap_err();
    assert!(
        matches!(failed, ToolError::Tool(ToolDoubleError::Refused)),
        "{failed:?}"
    );

    // The agent runs the step again and the model words it anew: the operation is
    // resumed with the arguments first frozen, never claimed anew with these.
    let resumed = call(&tool, charge("regenerated")).await.unwrap();
    assert_resumed_with_the_first(&resumed, &sdk);
}

#[tokio::test]
async fn another_tools_completed_outcome_is_refused_not_answered() {
    let store: Arc<dyn IdempotencyStore> = Arc::new(MemoryStore::new());
    let refund = ToolLayer::builder(store.clone(), "refund", ProviderKeys::Ignored)
        .build()
        .unwrap();
    let charge_layer = ToolLayer::builder(store, "charge", ProviderKeys::Ignored)
        .build()
        .unwrap();
    let (refunds, charges) = (ToolDouble::new(), ToolDouble::new());
    call(
        &refund.layer(refunds.clone()),
        json!({"order_id": "o-1", "cents": 500}),
    )
    .await
    .unwrap();

    // The same step's id reused for another tool: not the refund's receipt as the
    // charge's success, whatever the drift policy.
    let refused = call(
        &charge_layer.layer(charges.clone()),
        json!({"order_id": "o-2", "cents": 700}),
    )
    .await
    .unwrap_err();
    let drift = refused.idempotency_error().and_then(|err| err.drift());
    let parts: Vec<_> = drift.expect("a drift error").differing_parts().collect();
    assert!(parts.contains(&RequestPart::Target), "{parts:?}");
    assert_eq!(charges.calls(), 0);
    assert_eq!(refunds.effects(), 1);
}

#[tokio::test(start_paused = true)]
async fn another_tools_frozen_arguments_are_never_sent_to_this_tool() {
    let store: Arc<dyn IdempotencyStore> = Arc::new(MemoryStore::new());
    let layer = |name: &str| {
        ToolLayer::builder(store.clone(), name, ProviderKeys::Deduplicates)
            .retry_policy(attempts(1))
            .classify(ToolDouble::classifier())
            .build()
            .unwrap()
    };
    let refunds = ToolDouble::deduplicating().with_faults([ToolFault::CommitThenTimeout]);
    let charges = ToolDouble::deduplicating();
    let in_doubt = call(
        &layer("refund").layer(refunds.clone()),
        json!({"order_id": "o-1", "cents": 500}),
    )
    .await;
    assert!(in_doubt.is_err());

    let refused = call(
        &layer("charge").layer(charges.clone()),
        json!({"order_id": "o-2", "cents": 700}),
    )
    .await
    .unwrap_err();
    assert!(
        refused.idempotency_error().unwrap().is_drift(),
        "{refused:?}"
    );
    assert_eq!(
        charges.calls(),
        0,
        "the refund's arguments went to the charge tool"
    );
    // The refund's own retry still finds its operation in doubt and resumes it.
    let resumed = call(
        &layer("refund").layer(refunds.clone()),
        json!({"order_id": "o-1", "cents": 500}),
    )
    .await
    .unwrap();
    assert_eq!(resumed.source(), ToolSource::Resumed);
    assert_eq!(refunds.effects(), 1);
}

/// What a [`Gate`]'s readiness says.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Readiness {
    Ready,
    /// Not ready (a full pool): pending until opened.
    Waiting,
    /// Load shed: an error from `poll_ready`.
    Shed,
}

/// A tool whose readiness the test decides, over a [`ToolDouble`].
#[derive(Clone)]
struct Gate {
    readiness: Arc<Mutex<Readiness>>,
    inner: ToolDouble,
}

impl Gate {
    fn new(inner: ToolDouble, readiness: Readiness) -> Self {
        Self {
            readiness: Arc::new(Mutex::new(readiness)),
            inner,
        }
    }

    fn set(&self, readiness: Readiness) {
        *self.readiness.lock().unwrap() = readiness;
    }
}

impl Service<ToolCall<Value>> for Gate {
    type Response = Value;
    type Error = ToolDoubleError;
    type Future = <ToolDouble as Service<ToolCall<Value>>>::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        match *self.readiness.lock().unwrap() {
            Readiness::Ready => Service::<ToolCall<Value>>::poll_ready(&mut self.inner, cx),
            // No waker kept: a caller waiting here is woken by its own deadline alone,
            // which is all these tests need.
            Readiness::Waiting => Poll::Pending,
            Readiness::Shed => Poll::Ready(Err(ToolDoubleError::Refused)),
        }
    }

    fn call(&mut self, call: ToolCall<Value>) -> Self::Future {
        self.inner.call(call)
    }
}

#[tokio::test(start_paused = true)]
async fn a_caller_that_gives_up_while_the_tool_is_not_ready_leaves_nothing_in_doubt() {
    let layer = ToolLayer::builder(MemoryStore::new(), "charge", ProviderKeys::Ignored)
        .build()
        .unwrap();
    let sdk = ToolDouble::new();
    let gate = Gate::new(sdk.clone(), Readiness::Waiting);
    let tool = layer.layer(gate.clone());
    let gave_up = tokio::time::timeout(Duration::from_secs(1), call(&tool, charge("first"))).await;
    assert!(gave_up.is_err());
    assert_eq!(sdk.calls(), 0);

    // Nothing was sent: the operation is free to run, and runs once.
    gate.set(Readiness::Ready);
    let out = call(&tool, charge("first")).await.unwrap();
    assert_eq!(out.source(), ToolSource::Called);
    assert_eq!(sdk.effects(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_readiness_error_is_before_the_effect() {
    let layer = ToolLayer::builder(MemoryStore::new(), "charge", ProviderKeys::Ignored)
        .retry_policy(attempts(1))
        .build()
        .unwrap();
    let sdk = ToolDouble::new();
    let gate = Gate::new(sdk.clone(), Readiness::Shed);
    let tool = layer.layer(gate.clone());
    let shed = call(&tool, charge("first")).await.unwrap_err();
    assert!(
        matches!(shed, ToolError::Tool(ToolDoubleError::Refused)),
        "{shed:?}"
    );

    // Released, not in doubt: a key-less provider's operation may run.
    gate.set(Readiness::Ready);
    let out = call(&tool, charge("first")).await.unwrap();
    assert_eq!(
        (out.source(), sdk.calls(), sdk.effects()),
        (ToolSource::Called, 1, 1)
    );
}

#[tokio::test(start_paused = true)]
async fn a_readiness_error_after_an_attempt_that_may_have_happened_leaves_it_in_doubt() {
    let layer = deduplicated_charge(2);
    let sdk = ToolDouble::deduplicating().with_faults([ToolFault::CommitThenTimeout]);
    let gate = Gate::new(sdk.clone(), Readiness::Ready);
    let tool = layer.layer(gate.clone());
    // The first attempt commits and times out; the retry's pool then sheds it.
    let first = tokio::spawn({
        let tool = tool.clone();
        async move { call(&tool, charge("first")).await }
    });
    while sdk.calls() == 0 {
        tokio::task::yield_now().await;
    }
    gate.set(Readiness::Shed);
    assert!(first.await.unwrap().is_err());

    gate.set(Readiness::Ready);
    let resumed = call(&tool, charge("regenerated")).await.unwrap();
    assert_resumed_with_the_first(&resumed, &sdk);
}

#[tokio::test]
async fn a_response_over_the_cap_is_returned_and_kept_as_a_tombstone() {
    let layer = ToolLayer::builder(MemoryStore::new(), "export", ProviderKeys::Ignored)
        .response_limit(256)
        .build()
        .unwrap();
    let sdk = ToolDouble::new();
    let tool = layer.layer(sdk.clone());
    // The double's receipt repeats the arguments: well over the cap.
    let big = json!({"rows": "x".repeat(4096)});
    let out = call(&tool, big.clone()).await.unwrap();
    assert_eq!(
        out.value()["arguments"],
        big,
        "the caller gets the whole answer"
    );

    // The record is a tombstone: a replay cannot answer, and the tool is not run again.
    let again = call(&tool, big).await.unwrap_err();
    assert!(
        again.idempotency_error().unwrap().is_replay_unavailable(),
        "{again:?}"
    );
    assert_eq!((sdk.calls(), sdk.effects()), (1, 1));
}

/// The first attempt is refused before the effect, the retry waits on the tool's readiness,
/// and the caller gives up there: nothing took effect, so the operation is released, not
/// left in doubt (a key-less provider's operation could then never run).
#[tokio::test(start_paused = true)]
async fn a_caller_that_gives_up_on_a_retry_after_a_refusal_leaves_nothing_in_doubt() {
    let layer = ToolLayer::builder(MemoryStore::new(), "charge", ProviderKeys::Ignored)
        .retry_policy(attempts(2))
        .classify(ToolDouble::classifier())
        .build()
        .unwrap();
    let sdk = ToolDouble::new().with_faults([ToolFault::FailBefore]);
    let gate = Gate::new(sdk.clone(), Readiness::Ready);
    let tool = layer.layer(gate.clone());
    let first = tokio::spawn({
        let tool = tool.clone();
        async move { call(&tool, charge("first")).await }
    });
    while sdk.calls() == 0 {
        tokio::task::yield_now().await;
    }
    gate.set(Readiness::Waiting);
    tokio::time::sleep(Duration::from_secs(1)).await;
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());
    assert_eq!(sdk.effects(), 0);

    gate.set(Readiness::Ready);
    let out = call(&tool, charge("first")).await.unwrap();
    assert_eq!((out.source(), sdk.effects()), (ToolSource::Called, 1));
}

/// A tower `Policy` that retries every failure of a tool call, cloning the call whole.
#[derive(Clone)]
struct RetryEveryFailure;

impl<R, E> tower::retry::Policy<ToolCall<Value>, R, E> for RetryEveryFailure {
    type Future = std::future::Ready<()>;

    fn retry(
        &mut self,
        _: &mut ToolCall<Value>,
        result: &mut Result<R, E>,
    ) -> Option<Self::Future> {
        result.is_err().then(|| std::future::ready(()))
    }

    fn clone_request(&mut self, call: &ToolCall<Value>) -> Option<ToolCall<Value>> {
        Some(call.clone())
    }
}

/// `tower::retry` between the tool layer and the tool would call a side effect again,
/// blind to the ledger: the layer reads it in the tool's type and refuses the call before
/// anything is claimed or called, naming it. A read passes through it.
#[tokio::test]
async fn tower_retry_between_the_tool_layer_and_the_tool_is_refused_by_its_type() {
    let sdk = ToolDouble::new().with_faults([ToolFault::CommitThenTimeout]);
    let store = MemoryStore::new();
    let retried = tower::retry::Retry::new(RetryEveryFailure, sdk.clone());
    let tool = ToolLayer::builder(store.clone(), "settle", ProviderKeys::Ignored)
        .build()
        .unwrap()
        .layer(retried.clone());

    let refused = call(&tool, charge("first")).await.unwrap_err();
    match &refused {
        ToolError::Idempotency(ours) => {
            assert!(ours.is_retry_inside(), "{ours}");
            assert!(ours.to_string().contains("tower::retry"), "{ours}");
        }
        other => panic!("not refused as a retry inside: {other:?}"),
    }
    assert_eq!(sdk.calls(), 0, "the tool was called");
    assert_eq!(store.entry_count(), 0, "claimed");

    let read = ToolLayer::builder(store, "lookup", ProviderKeys::Ignored)
        .class(tower_idempotency::tool::ToolClass::Read)
        .build()
        .unwrap()
        .layer(retried);
    sdk.clear_faults();
    assert!(
        call(&read, charge("look")).await.is_ok(),
        "a read is refused"
    );
}
