//! Whole-stack randomized faults through the tool face, as `randomized.rs` does for HTTP:
//! random tool faults (commit then time out, fail before, decline, panic, hang; one per
//! attempt), crashes
//! (a run abandoned without a destructor) and resumes, regenerated arguments on every run,
//! two tenants sharing one ledger and the same task ids, a deduplicating provider and a
//! key-less one (reconciled). Invariant: the double counts at most one effect per
//! operation at every step, exactly one once a clean run finishes it, made with the
//! arguments the output reports, every call after it with those arguments, and a replay
//! equals the first answer; with the order declared a defining field, another order under
//! the operation's identity is refused, nothing called.
//!
//! Over `MemoryStore` on tokio's paused clock; over `RedisStore` in real time, every
//! duration ten times shorter, since Redis judges leases by its own clock.
#![cfg(feature = "test-util")]

#[cfg(feature = "redis")]
use crate::support::redis as redis_support;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use proptest::prelude::*;
use serde_json::{json, Value};
use tower::{Layer, ServiceExt};
use tower_idempotency::idempotency::{InDoubtOperation, Reconciled};
use tower_idempotency::ledger::{IdempotencyStore, MemoryStore};
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::testing::{crash_after, ToolDouble, ToolDoubleError, ToolFault};
use tower_idempotency::tool::{
    applied, ProviderKeys, ToolCall, ToolError, ToolLayer, ToolOutput, Verdict,
};
use tower_idempotency::OperationId;

#[derive(Clone, Debug)]
enum Run {
    /// The faults of the run's attempts, in order (a retry meets the second).
    Faults(Vec<ToolFault>),
    Crash(u64),
    Clean,
}

fn fault() -> impl Strategy<Value = ToolFault> {
    prop_oneof![
        Just(ToolFault::CommitThenTimeout),
        Just(ToolFault::FailBefore),
        Just(ToolFault::Decline),
        any::<bool>().prop_map(|after_commit| ToolFault::Panic { after_commit }),
        any::<bool>().prop_map(|after_commit| ToolFault::Hang { after_commit }),
    ]
}

fn run() -> impl Strategy<Value = Run> {
    prop_oneof![
        Just(Run::Clean),
        // One fault, or one per attempt: a provider that commits then times out, then
        // refuses the retry, is a seam of its own.
        prop::collection::vec(fault(), 1..3).prop_map(Run::Faults),
        (0_u64..1500).prop_map(Run::Crash),
    ]
}

type Classifier = fn(&ToolDoubleError) -> Verdict;

struct Tenant {
    layer: ToolLayer<Classifier>,
    sdk: ToolDouble,
}

/// How a tenant's provider treats keys.
#[derive(Clone, Copy, Debug)]
enum Provider {
    /// Runs each key once.
    Deduplicating,
    /// Ignores keys; in-doubt operations are reconciled by looking the effect up.
    KeyLessReconciled,
    /// Ignores keys, and nothing can look an effect up: in doubt is where it ends.
    KeyLess,
}

fn provider() -> impl Strategy<Value = Provider> {
    prop_oneof![
        Just(Provider::Deduplicating),
        Just(Provider::KeyLessReconciled),
        Just(Provider::KeyLess),
    ]
}

/// The case's durations: `ms(n)` is `n` milliseconds on the paused clock, `n / divisor` in
/// real time.
#[derive(Clone, Copy)]
struct Pace {
    divisor: u64,
}

impl Pace {
    fn ms(self, ms: u64) -> Duration {
        Duration::from_millis(ms / self.divisor)
    }
}

fn tenant(
    store: &Arc<dyn IdempotencyStore>,
    scope: &str,
    kind: Provider,
    pace: Pace,
    defining: bool,
) -> Tenant {
    let deduplicates = matches!(kind, Provider::Deduplicating);
    let sdk = if deduplicates {
        ToolDouble::deduplicating()
    } else {
        ToolDouble::new()
    };
    let provider = if deduplicates {
        ProviderKeys::Deduplicates
    } else {
        ProviderKeys::Ignored
    };
    let found = sdk.clone();
    let policy = RetryPolicy::builder()
        .max_attempts(2)
        .no_budget()
        .attempt_timeout(pace.ms(500))
        .build()
        .unwrap();
    let mut builder = ToolLayer::builder(store.clone(), "charge_customer", provider)
        .scope(scope)
        .lease(pace.ms(1000))
        .retry_policy(policy)
        .classify(ToolDouble::classifier() as Classifier);
    if defining {
        builder = builder.defining_fields(
            tower_idempotency::fingerprint::PayloadFields::new(["/task", "/order_id", "/cents"])
                .unwrap(),
        );
    }
    if matches!(kind, Provider::KeyLessReconciled) {
        // A key-less SDK finishes an in-doubt operation only through its provider's lookup.
        builder = builder.reconcile(move |operation: InDoubtOperation| {
            let found = found.clone();
            async move {
                let args: Value = tower_idempotency::tool::frozen_arguments(&operation)?;
                let op = OperationId::new(args["task"].as_str().unwrap(), "charge");
                Ok(match found.arguments_of(&op).first() {
                    Some(made) => applied(&json!({"receipt": "found", "arguments": made}))?,
                    None => Reconciled::NotApplied,
                })
            }
        });
    }
    Tenant {
        layer: builder.build().unwrap(),
        sdk,
    }
}

/// The step's identity reused for another order: another operation's call.
fn another_order(task: &str) -> Value {
    let mut call = regenerated(task, 101);
    call["order_id"] = json!(format!("o-{task}-other"));
    call
}

/// The model regenerates the call on every run: a new summary, a new intent id.
fn regenerated(task: &str, run: usize) -> Value {
    json!({
        "task": task,
        "order_id": format!("o-{task}"),
        "cents": 1999,
        "summary": format!("charge the customer (run {run})"),
        "fulfillment_intent_id": format!("fi_{run}"),
    })
}

async fn one_run(
    tenant: &Tenant,
    op: &OperationId,
    args: Value,
    run: &Run,
    pace: Pace,
) -> Option<Result<ToolOutput<Value>, ToolError<ToolDoubleError>>> {
    let tool = tenant.layer.layer(tenant.sdk.clone());
    let call = ToolCall::new(op.clone(), args);
    match run {
        Run::Faults(faults) => {
            for fault in faults {
                tenant.sdk.push_fault(fault.clone());
            }
            // Panics surface as a join error; hangs end with the attempt timeout.
            let joined = tokio::spawn(tool.oneshot(call)).await;
            // A fault left unused (the call never reached the tool) is not carried over.
            tenant.sdk.clear_faults();
            joined.ok()
        }
        Run::Crash(after) => crash_after(tool.oneshot(call), pace.ms(*after)).await,
        Run::Clean => Some(tool.oneshot(call).await),
    }
}

/// Once a call of `op` made its effect, every later call of it carries the arguments that
/// effect was made with: a retry or a resume resends the frozen arguments, and an operation
/// that may have happened is never released to be claimed anew with regenerated ones.
/// (Calls before it may carry others: a run whose every attempt was refused before the
/// effect releases the operation, and the next run freezes its own.)
fn assert_frozen_once_effective(sdk: &ToolDouble, op: &OperationId, run: &Run) {
    let Some(made) = sdk.arguments_of(op).into_iter().next() else {
        return;
    };
    let calls = sdk.calls_of(op);
    let first = calls.iter().position(|called| *called == made).unwrap();
    for called in &calls[first..] {
        assert_eq!(
            called, &made,
            "{op:?} called with other arguments than its effect's after {run:?}"
        );
    }
}

enum Finished {
    Answered(ToolOutput<Value>),
    Declined,
    InDoubt,
}

/// Run `case` over a fresh `MemoryStore` on tokio's paused clock.
fn on_memory<F: Future<Output = ()>>(case: impl FnOnce(Arc<dyn IdempotencyStore>) -> F) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    rt.block_on(case(Arc::new(MemoryStore::new())));
}

async fn check(
    tasks: usize,
    runs: Vec<Vec<Run>>,
    (a, b): (Provider, Provider),
    defining: bool,
    store: Arc<dyn IdempotencyStore>,
    pace: Pace,
) {
    let tenants = [
        tenant(&store, "tenant-a", a, pace, defining),
        tenant(&store, "tenant-b", b, pace, defining),
    ];
    let kinds = [a, b];
    for task in 0..tasks {
        let task_id = format!("task-{task}");
        let op = OperationId::new(task_id.clone(), "charge");
        for (t, tenant) in tenants.iter().enumerate() {
            let script = &runs[(task + t) % runs.len()];
            let mut declined = false;
            for (i, run) in script.iter().enumerate() {
                let out = one_run(tenant, &op, regenerated(&task_id, i), run, pace).await;
                if let Some(Err(ToolError::Final(_))) = out {
                    declined = true;
                }
                assert!(
                    tenant.sdk.effects_of(&op) <= 1,
                    "two effects for {op:?} after {run:?}"
                );
                assert_frozen_once_effective(&tenant.sdk, &op, run);
                // Past any lease a crashed owner held.
                tokio::time::sleep(pace.ms(2000)).await;
            }
            // Finish it: clean runs until it answers (an in-doubt key-less operation
            // is reconciled by these).
            let finished = loop {
                match one_run(tenant, &op, regenerated(&task_id, 99), &Run::Clean, pace).await {
                    Some(Ok(out)) => break Finished::Answered(out),
                    Some(Err(ToolError::Final(_))) => break Finished::Declined,
                    // Key-less and nothing to ask: never called again blindly.
                    Some(Err(ToolError::Idempotency(err)))
                        if err.is_in_doubt() && matches!(kinds[t], Provider::KeyLess) =>
                    {
                        break Finished::InDoubt
                    }
                    Some(Err(ToolError::Idempotency(err))) if err.is_busy() => {
                        tokio::time::sleep(pace.ms(2000)).await;
                    }
                    other => panic!("{op:?} did not finish: {other:?}"),
                }
            };
            let effects = tenant.sdk.effects_of(&op);
            // Whatever the operation came to, another order under its identity is refused
            // under the default policy when the order is a defining field: never answered
            // with this order's outcome, never called.
            if defining {
                let calls = tenant.sdk.calls_of(&op).len();
                let other = one_run(tenant, &op, another_order(&task_id), &Run::Clean, pace).await;
                assert!(
                    matches!(&other, Some(Err(ToolError::Idempotency(err))) if err.is_drift()),
                    "{op:?}: another order was not refused: {other:?}"
                );
                assert_eq!(
                    tenant.sdk.calls_of(&op).len(),
                    calls,
                    "{op:?}: nothing called"
                );
            }
            match finished {
                Finished::InDoubt => assert!(effects <= 1),
                Finished::Answered(out) => {
                    assert_eq!(effects, 1, "exactly one effect for {op:?}");
                    let made = &tenant.sdk.arguments_of(&op)[0];
                    assert_eq!(
                        &out.value()["arguments"],
                        made,
                        "the output is the effect's"
                    );
                    let replay =
                        one_run(tenant, &op, regenerated(&task_id, 100), &Run::Clean, pace)
                            .await
                            .unwrap()
                            .unwrap();
                    assert_eq!(replay.value()["arguments"], out.value()["arguments"]);
                    assert!(replay.discarded().is_some(), "the caller is told");
                }
                Finished::Declined => {
                    assert!(declined, "only a decline is a final answer");
                    assert_eq!(effects, 0);
                }
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn effects_are_exactly_once_per_operation(
        tasks in 1_usize..4,
        runs in prop::collection::vec(prop::collection::vec(run(), 0..4), 1..4),
        a in provider(),
        b in provider(),
        defining in any::<bool>(),
    ) {
        on_memory(|store| check(tasks, runs, (a, b), defining, store, Pace { divisor: 1 }));
    }
}

#[cfg(feature = "redis")]
proptest! {
    #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]

    #[test]
    fn over_redis_effects_are_exactly_once_per_operation(
        tasks in 1_usize..3,
        runs in prop::collection::vec(prop::collection::vec(run(), 0..4), 1..3),
        a in provider(),
        b in provider(),
        defining in any::<bool>(),
    ) {
        // Redis judges leases by its own clock: the same case, ten times faster.
        redis_support::on_redis("tool-randomized", |store| {
            check(tasks, runs, (a, b), defining, store, Pace { divisor: 10 })
        });
    }
}
