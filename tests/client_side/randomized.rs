//! Whole-stack randomized fault tests: random provider behaviour per attempt, random crashes
//! and resumes, regenerated payloads and a layer in between, over both stores and both
//! faces, with the invariants checked after every case.
//!
//! Client face: the provider (the testing kit's `SideEffectService`) takes one random fault
//! per call — commit then time out, commit then `503`, `503` without committing, refuse at
//! connect, slow — and the orchestrator runs each operation several times, sometimes with a
//! regenerated payload, sometimes crashing mid-operation (its future is leaked: nothing of
//! it settles, as when a process dies). Invariants:
//!
//! - at most one effect per operation, whether or not the provider deduplicates on keys;
//! - the provider never receives anything but the bytes first frozen for the operation,
//!   with the middle layer's header;
//! - no caller sees a `201` for an effect that did not commit;
//! - the store stays within its budget;
//! - once the provider is healthy and the dead owners' leases have run out, every operation
//!   completes (exactly once) or, against a provider that ignores keys, is reported in doubt.
//!
//! Server face: random tenants, keys and bodies against a handler that commits then fails,
//! fails without committing, panics after committing or is slow, with clients hanging up.
//! Invariants: at most one commit per (tenant, key); a `201` only for a committed run, and
//! every replay is that run's response; one tenant never sees another's.
//!
//! Case counts are bounded for CI; `PROPTEST_CASES` raises them. A failure prints the
//! shrunk case and proptest's seed.
#![cfg(feature = "test-util")]

#[cfg(feature = "redis")]
use crate::support::redis as redis_support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{HeaderValue, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use proptest::prelude::*;
use tower::Layer;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::{IdempotencyStore, MemoryStore};
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::testing::{crash_after, Fault, SideEffectService};
use tower_idempotency::{
    BusyPolicy, Error, FrozenRetryLayer, IdempotencyLayer, KeyHeader, OperationId,
};

fn cases(default: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(default);
    ProptestConfig {
        cases,
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// One provider behaviour, for one call.
#[derive(Clone, Debug)]
enum Behaviour {
    Healthy,
    CommitThenTimeout,
    CommitThen503,
    Unavailable,
    Refused,
    /// `409` "key in use" without `Retry-After`: told by its body alone.
    KeyInUse,
    Slow(u64),
}

impl Behaviour {
    fn fault(&self) -> Fault {
        match self {
            Self::Healthy => Fault::Latency(Duration::ZERO),
            Self::CommitThenTimeout => Fault::CommitThenTimeout,
            Self::CommitThen503 => Fault::ServerError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                commit: true,
            },
            Self::Unavailable => Fault::ServerError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                commit: false,
            },
            Self::Refused => Fault::RefuseBeforeSend,
            Self::KeyInUse => Fault::KeyInUse,
            Self::Slow(ms) => Fault::Latency(Duration::from_millis(*ms)),
        }
    }
}

fn behaviour() -> impl Strategy<Value = Behaviour> {
    prop_oneof![
        3 => Just(Behaviour::Healthy),
        2 => Just(Behaviour::CommitThenTimeout),
        2 => Just(Behaviour::CommitThen503),
        2 => Just(Behaviour::Unavailable),
        2 => Just(Behaviour::Refused),
        2 => Just(Behaviour::KeyInUse),
        1 => (50u64..600).prop_map(Behaviour::Slow),
    ]
}

/// One run of an operation by the orchestrator.
#[derive(Clone, Debug)]
struct Run {
    op: usize,
    /// The agent re-ran its step and produced new bytes.
    regenerated: bool,
    /// The process dies this long into the run (ms): nothing of it settles.
    crash_after: Option<u64>,
    /// Time passing before this run (ms).
    pause: u64,
}

fn run() -> impl Strategy<Value = Run> {
    (
        0usize..3,
        prop::bool::weighted(0.3),
        prop::option::weighted(0.25, 0u64..1500),
        prop_oneof![3 => Just(0u64), 1 => 0u64..4000],
    )
        .prop_map(|(op, regenerated, crash_after, pause)| Run {
            op,
            regenerated,
            crash_after,
            pause,
        })
}

#[derive(Clone, Debug)]
struct ClientCase {
    provider_deduplicates: bool,
    /// The stack as `build_stack()` builds it (one service), or the two layers stacked by
    /// hand with a layer in between (the frozen request handed on through the extensions).
    built: bool,
    /// `DriftPolicy::ResendFrozen` set explicitly, or the default for an `OperationId`.
    resend_frozen: bool,
    behaviours: Vec<Behaviour>,
    runs: Vec<Run>,
}

fn client_case() -> impl Strategy<Value = ClientCase> {
    (
        prop::bool::weighted(0.7),
        prop::bool::ANY,
        prop::bool::ANY,
        prop::collection::vec(behaviour(), 0..14),
        prop::collection::vec(run(), 1..10),
    )
        .prop_map(
            |(provider_deduplicates, built, resend_frozen, behaviours, runs)| ClientCase {
                provider_deduplicates,
                built,
                resend_frozen,
                behaviours,
                runs,
            },
        )
}

fn op_id(op: usize) -> OperationId {
    OperationId::new("randomized", format!("step-{op}"))
}

fn payload(op: usize, regenerated: bool) -> Bytes {
    Bytes::from(format!(
        "{{\"op\":{op},\"summary\":\"{}\"}}",
        if regenerated { "reworded" } else { "first" }
    ))
}

const CHARGES: &str = "http://payments.local/charges";
const REFUNDS: &str = "http://payments.local/refunds";

const LEASE: Duration = Duration::from_secs(2);

const BUDGET: u64 = 4 * 1024 * 1024;

async fn client_case_holds(
    case: ClientCase,
    store: Arc<dyn IdempotencyStore>,
    memory: Option<MemoryStore>,
) {
    let provider = SideEffectService::builder()
        .honour_keys(case.provider_deduplicates)
        .faults(case.behaviours.iter().map(Behaviour::fault))
        .build();
    let policy = RetryPolicy::builder()
        .max_attempts(3)
        .backoff(Duration::from_millis(10), Duration::from_millis(100))
        .attempt_timeout(Duration::from_millis(400))
        .no_budget()
        .build()
        .unwrap();
    let mut builder = IdempotencyLayer::client_builder(store)
        .lease(LEASE)
        .retry_policy(policy.clone())
        .busy_policy(BusyPolicy::Wait(Duration::from_secs(5)))
        .provider_deduplicates(case.provider_deduplicates)
        .key_header(KeyHeader::ietf());
    if case.resend_frozen {
        builder = builder.drift_policy(tower_idempotency::DriftPolicy::ResendFrozen);
    }
    if case.built {
        let client = builder.build_stack().unwrap().layer(provider.clone());
        return case_holds_through(case, client, provider, memory).await;
    }
    let client = ServiceBuilder::new()
        .layer(builder.build().unwrap())
        .map_request(|mut req: Request<Full<Bytes>>| {
            req.headers_mut()
                .insert("x-middle", HeaderValue::from_static("kept"));
            req
        })
        .layer(FrozenRetryLayer::new(policy))
        .service(provider.clone());
    case_holds_through(case, client, provider, memory).await;
}

/// The invariants of `case`, run through `client` over `provider`.
async fn case_holds_through<S, RB>(
    case: ClientCase,
    client: S,
    provider: SideEffectService,
    memory: Option<MemoryStore>,
) where
    S: tower::Service<Request<Full<Bytes>>, Response = http::Response<RB>, Error = Error>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    let send_to = |target: &'static str, op: usize, regenerated: bool| {
        let mut req = Request::post(target)
            .header("content-type", "application/json")
            .body(Full::new(payload(op, regenerated)))
            .unwrap();
        req.extensions_mut().insert(op_id(op));
        client.clone().oneshot(req)
    };
    let send = |op: usize, regenerated: bool| send_to(CHARGES, op, regenerated);

    // Each operation's first run's payload.
    let mut first_payload: HashMap<usize, bool> = HashMap::new();
    let mut saw_created: HashMap<usize, bool> = HashMap::new();
    for run in &case.runs {
        tokio::time::sleep(Duration::from_millis(run.pause)).await;
        first_payload.entry(run.op).or_insert(run.regenerated);
        // A crash leaks the run's future: nothing of it settles, as when a process dies.
        let outcome = match run.crash_after {
            Some(ms) => crash_after(send(run.op, run.regenerated), Duration::from_millis(ms)).await,
            None => Some(send(run.op, run.regenerated).await),
        };
        if let Some(Ok(res)) = outcome {
            if res.status() == StatusCode::CREATED {
                saw_created.insert(run.op, true);
            }
        }
        if let Some(memory) = &memory {
            assert!(memory.weighted_size() <= BUDGET);
        }
    }

    // The provider recovers; dead owners' leases run out.
    provider.clear_faults();
    tokio::time::sleep(LEASE + Duration::from_millis(500)).await;
    for (&op, &regenerated) in &first_payload {
        let key = op_id(op).key("").to_hex();
        // The operation's bytes are those of its first run, unless that run was released
        // before anything left (or crashed before its claim): then a later run's.
        let mut outcome = send(op, regenerated).await;
        if outcome.as_ref().is_err_and(|err| err.is_drift()) {
            outcome = send(op, !regenerated).await;
        }
        match outcome {
            Ok(res) => {
                assert_eq!(res.status(), StatusCode::CREATED, "op {op}: {case:?}");
                assert_eq!(provider.effects_for_key(&key), 1, "op {op}: exactly once");
            }
            Err(err) => {
                // Only a provider that ignores keys may leave an operation to reconcile.
                assert!(
                    !case.provider_deduplicates && err.is_unreconciled(),
                    "op {op} did not complete: {err:?}"
                );
            }
        }
        assert!(provider.effects_for_key(&key) <= 1, "op {op} charged twice");
        if saw_created.contains_key(&op) {
            assert_eq!(
                provider.effects_for_key(&key),
                1,
                "op {op}: a 201 without an effect"
            );
        }
        // Whatever reached the provider under this key is one and the same request.
        let attempts: Vec<_> = provider
            .attempts()
            .into_iter()
            .filter(|a| a.key() == Some(&key))
            .collect();
        // The operation's identity sent to another target: refused, whatever the policy
        // and whatever the operation came to; neither answered nor resent.
        let elsewhere = send_to(REFUNDS, op, regenerated).await;
        assert!(
            elsewhere.as_ref().is_err_and(|err| err.is_drift()),
            "op {op}: another target was answered: {case:?}"
        );
        let resent = provider
            .attempts()
            .into_iter()
            .filter(|a| a.key() == Some(&key))
            .count();
        assert_eq!(
            resent,
            attempts.len(),
            "op {op}: sent again for another target"
        );
        for attempt in &attempts {
            assert_eq!(attempt.uri().path(), "/charges", "op {op}");
            assert_eq!(
                attempt.body(),
                attempts[0].body(),
                "op {op}: other bytes were sent"
            );
            if !case.built {
                assert_eq!(attempt.headers()["x-middle"], "kept", "op {op}");
            }
        }
    }
}

proptest! {
    #![proptest_config(cases(48))]

    #[test]
    fn client_stack_on_a_memory_store_is_exactly_once_under_random_faults(case in client_case()) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        runtime.block_on(async {
            let store = MemoryStore::builder().max_bytes(BUDGET).build();
            client_case_holds(case, Arc::new(store.clone()), Some(store)).await;
        });
    }
}

#[cfg(feature = "redis")]
proptest! {
    #![proptest_config(cases(5))]

    #[test]
    fn client_stack_on_redis_is_exactly_once_under_random_faults(case in client_case()) {
        redis_support::on_redis("randomized", |store| client_case_holds(case, store, None));
    }
}

// ---------------------------------------------------------------------------------------
// The server face
// ---------------------------------------------------------------------------------------

/// What the handler does on one run.
#[derive(Clone, Debug)]
enum Handling {
    Commit,
    CommitThen500,
    Unavailable,
    CommitThenPanic,
    SlowCommit(u64),
}

fn handling() -> impl Strategy<Value = Handling> {
    prop_oneof![
        4 => Just(Handling::Commit),
        1 => Just(Handling::CommitThen500),
        1 => Just(Handling::Unavailable),
        1 => Just(Handling::CommitThenPanic),
        2 => (100u64..3000).prop_map(Handling::SlowCommit),
    ]
}

#[derive(Clone, Debug)]
struct Call {
    tenant: usize,
    key: usize,
    body: usize,
    /// The client hangs up this long into the call (ms).
    hang_up: Option<u64>,
    pause: u64,
}

fn call() -> impl Strategy<Value = Call> {
    (
        0usize..2,
        0usize..3,
        prop_oneof![4 => Just(0usize), 1 => Just(1usize)],
        prop::option::weighted(0.2, 0u64..2000),
        prop_oneof![3 => Just(0u64), 1 => 0u64..5000],
    )
        .prop_map(|(tenant, key, body, hang_up, pause)| Call {
            tenant,
            key,
            body,
            hang_up,
            pause,
        })
}

#[derive(Default)]
struct Handler {
    /// Every duration of the case is divided by this (a store on the real clock runs the
    /// same case faster).
    slowdown_divisor: u64,
    plan: Mutex<Vec<Handling>>,
    /// Commits per (tenant, key), and the body each commit answered.
    commits: Mutex<HashMap<(String, String), Vec<String>>>,
}

async fn handle(State(handler): State<Arc<Handler>>, headers: HeaderMap) -> (StatusCode, String) {
    let tenant = headers["x-tenant"].to_str().unwrap().to_owned();
    let key = headers["idempotency-key"].to_str().unwrap().to_owned();
    let how = handler
        .plan
        .lock()
        .unwrap()
        .pop()
        .unwrap_or(Handling::Commit);
    let commit = |handler: &Handler| {
        let mut commits = handler.commits.lock().unwrap();
        let runs = commits.entry((tenant.clone(), key.clone())).or_default();
        let body = format!(
            "{{\"tenant\":\"{tenant}\",\"key\":{key},\"run\":{}}}",
            runs.len() + 1
        );
        runs.push(body.clone());
        body
    };
    match how {
        Handling::Commit => (StatusCode::CREATED, commit(&handler)),
        Handling::CommitThen500 => {
            commit(&handler);
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                "{\"error\":\"after commit\"}".into(),
            )
        }
        Handling::Unavailable => (
            StatusCode::SERVICE_UNAVAILABLE,
            "{\"error\":\"busy\"}".into(),
        ),
        Handling::CommitThenPanic => {
            commit(&handler);
            panic!("the handler died after committing");
        }
        Handling::SlowCommit(ms) => {
            tokio::time::sleep(Duration::from_millis(ms / handler.slowdown_divisor)).await;
            (StatusCode::CREATED, commit(&handler))
        }
    }
}

proptest! {
    #![proptest_config(cases(48))]

    #[test]
    fn server_face_is_at_most_once_and_never_mixes_tenants(
        plan in prop::collection::vec(handling(), 0..12),
        calls in prop::collection::vec(call(), 1..16),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        runtime.block_on(async {
            let store = MemoryStore::builder().max_bytes(BUDGET).build();
            server_case_holds(plan, calls, Arc::new(store.clone()), 1).await;
            assert!(store.weighted_size() <= BUDGET);
        });
    }
}

#[cfg(feature = "redis")]
proptest! {
    #![proptest_config(cases(4))]

    #[test]
    fn server_face_on_redis_is_at_most_once_and_never_mixes_tenants(
        plan in prop::collection::vec(handling(), 0..12),
        calls in prop::collection::vec(call(), 1..16),
    ) {
        // Redis judges leases by its own clock: the same case, ten times faster.
        redis_support::on_redis("randomized", |store| server_case_holds(plan, calls, store, 10));
    }
}

async fn server_case_holds(
    plan: Vec<Handling>,
    calls: Vec<Call>,
    store: Arc<dyn IdempotencyStore>,
    slowdown_divisor: u64,
) {
    let ms = |ms: u64| Duration::from_millis(ms / slowdown_divisor);
    let handler = Arc::new(Handler {
        slowdown_divisor,
        plan: Mutex::new(plan.into_iter().rev().collect()),
        commits: Mutex::default(),
    });
    let lease = LEASE / slowdown_divisor as u32;
    let layer = IdempotencyLayer::server_builder(store)
        .scope(|parts| parts.headers["x-tenant"].to_str().unwrap_or("").to_owned())
        .lease(lease)
        .build()
        .unwrap();
    // A panic unwinds through our layer (the key goes in doubt) and is caught outside it.
    let app = Router::new()
        .route("/charges", post(handle))
        .route_layer(layer)
        .layer(tower_http::catch_panic::CatchPanicLayer::new())
        .with_state(handler.clone());

    let mut first_body: HashMap<(usize, usize), usize> = HashMap::new();
    let mut created: Vec<((usize, usize), String, bool)> = Vec::new();
    let mut in_flight = Vec::new();
    for call in &calls {
        tokio::time::sleep(ms(call.pause)).await;
        first_body
            .entry((call.tenant, call.key))
            .or_insert(call.body);
        let req = Request::post("/charges")
            .header("x-tenant", format!("tenant-{}", call.tenant))
            .header("idempotency-key", format!("\"key-{}\"", call.key))
            .body(Body::from(format!("{{\"body\":{}}}", call.body)))
            .unwrap();
        let app = app.clone();
        let slot = (call.tenant, call.key);
        let hang_up = call.hang_up.map(ms);
        in_flight.push(tokio::spawn(async move {
            let answer = async {
                let res = app.oneshot(req).await.unwrap();
                let status = res.status();
                let replayed = res.headers().contains_key("idempotent-replayed");
                let body = res.into_body().collect().await.unwrap().to_bytes();
                (status, replayed, String::from_utf8(body.to_vec()).unwrap())
            };
            match hang_up {
                Some(after) => tokio::time::timeout(after, answer).await.ok(),
                None => Some(answer.await),
            }
            .map(|answer| (slot, answer))
        }));
        // Some calls overlap, most follow one another.
        if call.key != 0 {
            for task in in_flight.drain(..) {
                if let Some((slot, (status, replayed, body))) = task.await.unwrap() {
                    if status == StatusCode::CREATED {
                        created.push((slot, body, replayed));
                    }
                }
            }
        }
    }
    for task in in_flight.drain(..) {
        if let Some((slot, (status, replayed, body))) = task.await.unwrap() {
            if status == StatusCode::CREATED {
                created.push((slot, body, replayed));
            }
        }
    }
    // Every handler has finished and every dead owner's lease has run out: no key may still
    // be in flight.
    tokio::time::sleep(ms(10_000)).await;
    for &(tenant, key) in first_body.keys() {
        let req = Request::post("/charges")
            .header("x-tenant", format!("tenant-{tenant}"))
            .header("idempotency-key", format!("\"key-{key}\""))
            .body(Body::from(format!(
                "{{\"body\":{}}}",
                first_body[&(tenant, key)]
            )))
            .unwrap();
        let res = app.clone().oneshot(req).await.unwrap();
        assert_ne!(
            res.status(),
            StatusCode::CONFLICT,
            "tenant {tenant} key {key} is still in flight after every lease ran out"
        );
    }

    let commits = handler.commits.lock().unwrap();
    for ((tenant, key), runs) in commits.iter() {
        assert!(
            runs.len() <= 1,
            "{tenant} {key} committed {} times",
            runs.len()
        );
    }
    for ((tenant, key), body, replayed) in &created {
        let runs = commits
            .get(&(format!("tenant-{tenant}"), format!("\"key-{key}\"")))
            .unwrap_or_else(|| panic!("a 201 for tenant {tenant} key {key} without a commit"));
        assert_eq!(
            body, &runs[0],
            "replayed {replayed}: not its own run's response"
        );
        assert!(body.contains(&format!("\"tenant\":\"tenant-{tenant}\"")));
    }
}
