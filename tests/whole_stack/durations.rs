//! Every duration a builder accepts serves requests: no setting panics one.
//!
//! "Keep forever" (`Duration::MAX`) and its neighbours saturate to what the clock and the
//! stores can hold; the properties below try them, and ordinary values, on every duration
//! setting of the client builder, the client stack builder (with its retry policy) and the
//! server builder, and serve keyed requests — fresh, replayed and concurrent duplicates —
//! through each configuration the builder accepts.
#![cfg(feature = "test-util")]

use crate::support::down;
use crate::support::redis as redis_support;

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use proptest::prelude::*;
use tokio::sync::Notify;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::fingerprint::Fingerprint;
use tower_idempotency::ledger::{
    Begin, BeginRequest, IdempotencyStore, LeaseToken, LedgerKey, MemoryStore, Outcome, RedisStore,
    Settled, StoreFuture,
};
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::testing::{Fault, SideEffectService};
use tower_idempotency::{BusyPolicy, IdempotencyLayer, KeyHeader, OperationId};

/// About 139 years: the longest duration the layers work with.
const LONGEST: Duration = Duration::from_millis(1 << 42);

/// Durations from the edges that overflow (`Duration::MAX`, `u64::MAX` seconds, just past
/// the layers' ceiling) and from everyday use, and now and then any duration at all.
fn duration() -> impl Strategy<Value = Duration> {
    let edges = vec![
        Duration::ZERO,
        Duration::from_nanos(1),
        Duration::from_millis(1),
        Duration::from_secs(1),
        Duration::from_secs(10),
        Duration::from_secs(30),
        Duration::from_secs(60 * 60),
        Duration::from_secs(24 * 60 * 60),
        Duration::from_secs(100 * 365 * 24 * 60 * 60),
        LONGEST,
        LONGEST + Duration::from_millis(1),
        Duration::from_secs(u64::MAX / 2),
        Duration::from_secs(u64::MAX),
        Duration::MAX,
    ];
    prop_oneof![
        6 => proptest::sample::select(edges),
        2 => (0u64..10_000_000).prop_map(Duration::from_millis),
        1 => (any::<u64>(), 0u32..1_000_000_000).prop_map(|(s, n)| Duration::new(s, n)),
    ]
}

fn busy_policy() -> impl Strategy<Value = BusyPolicy> {
    prop_oneof![
        Just(BusyPolicy::Fail),
        duration().prop_map(BusyPolicy::Wait)
    ]
}

/// A runtime on a paused clock: waits of a century pass at once, and deterministically.
fn paused_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap()
}

fn keyed_post(op: &OperationId) -> Request<Full<Bytes>> {
    let mut req = Request::post("http://orders.local/orders")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(br#"{"sku":"SKU-4471"}"#)))
        .unwrap();
    req.extensions_mut().insert(op.clone());
    req
}

/// Client settings that are durations (and the busy policy, which holds one).
#[derive(Clone, Debug)]
struct ClientDurations {
    lease: Duration,
    retention: Duration,
    protected: Option<Duration>,
    retry_window: Duration,
    busy: BusyPolicy,
    reconcile_timeout: Duration,
}

fn client_durations() -> impl Strategy<Value = ClientDurations> {
    (
        duration(),
        duration(),
        proptest::option::of(duration()),
        duration(),
        busy_policy(),
        duration(),
    )
        .prop_map(
            |(lease, retention, protected, retry_window, busy, reconcile_timeout)| {
                ClientDurations {
                    lease,
                    retention,
                    protected,
                    retry_window,
                    busy,
                    reconcile_timeout,
                }
            },
        )
}

/// Serve one operation through `client` three times: fresh, a concurrent duplicate while
/// the first is in flight (busy: waits or fails per the policy), and a replay after.
async fn serve_client<S, B>(
    client: S,
    provider: &SideEffectService,
    lease: Duration,
) -> Result<(), TestCaseError>
where
    S: tower::Service<
            Request<Full<Bytes>>,
            Response = Response<B>,
            Error = tower_idempotency::Error,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Send + 'static + std::fmt::Debug,
{
    let op = OperationId::new("task-forever", "charge");
    // The first attempt takes a while, so the duplicate finds it in flight.
    provider.push_fault(Fault::Latency(Duration::from_millis(50)));
    let first = tokio::spawn(client.clone().oneshot(keyed_post(&op)));
    tokio::task::yield_now().await;
    let duplicate = tokio::spawn(client.clone().oneshot(keyed_post(&op)));
    let first = first.await.expect("the first request does not panic");
    let duplicate = duplicate.await.expect("the duplicate does not panic");
    prop_assert!(first.is_ok(), "{first:?}");
    prop_assert!(first.unwrap().status().is_success());
    // A lease shorter than its renewal (a millisecond at least) lapses while the first
    // attempt is out: the duplicate then resumes the operation, resending its frozen bytes,
    // and gets whatever the provider answers that. Otherwise it waits for the replay, or is
    // told the operation is busy.
    if lease >= Duration::from_secs(1) {
        match duplicate {
            Ok(response) => prop_assert!(response.status().is_success()),
            Err(err) => prop_assert!(err.is_busy(), "{err:?}"),
        }
    }
    let replay = client.oneshot(keyed_post(&op)).await;
    prop_assert!(replay.is_ok(), "{replay:?}");
    prop_assert_eq!(
        provider.effects(),
        1,
        "one effect, however long the settings"
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// `IdempotencyLayer::client_builder`: whatever it accepts serves keyed requests.
    #[test]
    fn every_client_configuration_the_builder_accepts_serves_requests(d in client_durations()) {
        let mut builder = IdempotencyLayer::client_builder(MemoryStore::new()).provider_deduplicates(true).key_header(KeyHeader::ietf())
            .lease(d.lease)
            .retention(d.retention)
            .retry_policy(tower_idempotency::retry::RetryPolicy::builder().max_elapsed(d.retry_window).build().unwrap())
            .busy_policy(d.busy)
            .reconcile_timeout(d.reconcile_timeout);
        if let Some(window) = d.protected {
            builder = builder.protected_window(window);
        }
        let Ok(layer) = builder.build() else {
            return Ok(());
        };
        let provider = SideEffectService::new();
        let client = ServiceBuilder::new().layer(layer).service(provider.clone());
        paused_runtime().block_on(serve_client(client, &provider, d.lease))?;
    }
}

/// Retry policy settings that are durations; `None` when the policy builder refuses them.
fn retry_policy() -> impl Strategy<Value = Option<RetryPolicy>> {
    (
        duration(),
        duration(),
        duration(),
        proptest::option::of(duration()),
    )
        .prop_map(|(base, cap, max_elapsed, attempt_timeout)| {
            let mut builder = RetryPolicy::builder()
                .backoff(base, cap)
                .max_elapsed(max_elapsed);
            if let Some(timeout) = attempt_timeout {
                builder = builder.attempt_timeout(timeout);
            }
            builder.build().ok()
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// `client::Builder::build_stack`: whatever it accepts, with whatever retry policy,
    /// serves keyed requests, through a retried `503` too.
    #[test]
    fn every_client_stack_the_builder_accepts_serves_requests(
        d in client_durations(),
        policy in retry_policy(),
    ) {
        let Some(policy) = policy else {
            return Ok(());
        };
        serve_client_stack(d, policy)?;
    }
}

/// Serve one operation through a client stack built with `d` and `policy` (if the builder
/// accepts them): a retried `503` then a slow attempt, a duplicate while it is in flight,
/// and a later request. None panics, and the operation's effect happens at most once.
fn serve_client_stack(d: ClientDurations, policy: RetryPolicy) -> Result<(), TestCaseError> {
    let mut builder = IdempotencyLayer::client_builder(MemoryStore::new())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .lease(d.lease)
        .retention(d.retention)
        .busy_policy(d.busy)
        .reconcile_timeout(d.reconcile_timeout)
        .retry_policy(policy);
    if let Some(window) = d.protected {
        builder = builder.protected_window(window);
    }
    let Ok(stack) = builder.build_stack() else {
        return Ok(());
    };
    let provider = SideEffectService::new();
    let client = ServiceBuilder::new().layer(stack).service(provider.clone());
    paused_runtime().block_on(async {
        let op = OperationId::new("task-forever", "charge");
        // A retryable answer first (the backoff and the deadline are worked out), then
        // a slow attempt, so the duplicate finds the operation in flight.
        provider.push_fault(Fault::ServerError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            commit: false,
        });
        provider.push_fault(Fault::Latency(Duration::from_millis(50)));
        let first = tokio::spawn(client.clone().oneshot(keyed_post(&op)));
        tokio::task::yield_now().await;
        let duplicate = tokio::spawn(client.clone().oneshot(keyed_post(&op)));
        // Whatever the settings make of them (a replay, a busy or in-doubt error), the
        // requests are answered: none panics.
        let _ = first.await.expect("the first request does not panic");
        let _ = duplicate.await.expect("the duplicate does not panic");
        let _ = tokio::spawn(client.oneshot(keyed_post(&op)))
            .await
            .expect("a later request does not panic");
        prop_assert!(provider.effects() <= 1);
        Ok(())
    })
}

/// A case the property above found "hanging": the first request holds its lease through a
/// retry pause of centuries, and the duplicate waits up to the layers' longest wait. The
/// duplicate looked again at every lease's end, 30 s of a paused clock at a time: some 146
/// million `begin`s, hours of CPU. A watchdog thread fails it rather than hang.
#[test]
fn a_duplicate_waiting_centuries_on_a_live_owner_is_answered() {
    let d = ClientDurations {
        lease: Duration::from_secs(30),
        retention: Duration::MAX,
        protected: Some(Duration::new(15_672_943_538_413_584_903, 486_859_541)),
        retry_window: Duration::from_secs(30),
        busy: BusyPolicy::Wait(Duration::new(10_399_624_377_450_320_532, 462_877_357)),
        reconcile_timeout: Duration::MAX,
    };
    let policy = RetryPolicy::builder()
        .backoff(
            Duration::from_secs(u64::MAX / 2),
            Duration::from_secs(u64::MAX),
        )
        .max_elapsed(Duration::from_secs(u64::MAX / 2))
        .build()
        .unwrap();
    within_a_minute(move || serve_client_stack(d, policy).unwrap());
}

/// Run `test` on its own thread, failing if it has not finished within a minute of real
/// time: a waiter that loops on a paused clock never lets a tokio timeout fire.
fn within_a_minute(test: impl FnOnce() + Send + 'static) {
    let (done, finished) = std::sync::mpsc::channel();
    let runner = std::thread::spawn(move || {
        test();
        let _ = done.send(());
    });
    match finished.recv_timeout(Duration::from_secs(60)) {
        Ok(()) => runner.join().unwrap(),
        // The test panicked: its panic is the failure.
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            std::panic::resume_unwind(runner.join().unwrap_err())
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("still running after a minute: a waiter loops on the paused clock")
        }
    }
}

/// A `MemoryStore` that counts the `begin`s of the first key it is asked about (the
/// operation under test), and remembers that key.
#[derive(Clone, Debug, Default)]
struct CountedBegins {
    store: MemoryStore,
    watched: Arc<std::sync::OnceLock<LedgerKey>>,
    begins: Arc<AtomicUsize>,
}

impl CountedBegins {
    fn begins(&self) -> usize {
        self.begins.load(Ordering::SeqCst)
    }

    fn watched(&self) -> LedgerKey {
        *self.watched.get().expect("the operation has begun")
    }
}

impl IdempotencyStore for CountedBegins {
    fn begin(&self, request: BeginRequest) -> StoreFuture<'_, Begin> {
        if *self.watched.get_or_init(|| request.key) == request.key {
            self.begins.fetch_add(1, Ordering::SeqCst);
        }
        self.store.begin(request)
    }
    fn complete(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        outcome: Outcome,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        self.store.complete(key, token, outcome, retention)
    }
    fn abandon(&self, key: LedgerKey, token: LeaseToken) -> StoreFuture<'_, ()> {
        self.store.abandon(key, token)
    }
    fn mark_in_doubt(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        self.store.mark_in_doubt(key, token, retention)
    }
    fn renew(&self, key: LedgerKey, token: LeaseToken, lease: Duration) -> StoreFuture<'_, ()> {
        self.store.renew(key, token, lease)
    }
    fn hold_lease(&self, key: LedgerKey, token: LeaseToken, lease: Duration) -> bool {
        self.store.hold_lease(key, token, lease)
    }
    fn let_go(&self, key: LedgerKey, token: LeaseToken, lease: Duration) {
        self.store.let_go(key, token, lease);
    }
    fn keeps_request_fields(&self) -> bool {
        self.store.keeps_request_fields()
    }
    fn notify_settled(&self, key: LedgerKey) -> Option<Settled> {
        self.store.notify_settled(key)
    }
}

/// A client whose first request holds its lease for `owner_runs` (the provider is that
/// slow), and a duplicate of it sent once the first is in flight, waiting per `busy`.
async fn duplicate_of_a_slow_owner(
    store: &CountedBegins,
    lease: Duration,
    owner_runs: Duration,
    busy: BusyPolicy,
) -> (
    SideEffectService,
    tokio::task::JoinHandle<
        Result<Response<impl Send + std::fmt::Debug>, tower_idempotency::Error>,
    >,
    tokio::task::JoinHandle<
        Result<Response<impl Send + std::fmt::Debug>, tower_idempotency::Error>,
    >,
) {
    let provider = SideEffectService::new();
    let client = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(store.clone())
                .provider_deduplicates(true)
                .key_header(KeyHeader::ietf())
                .lease(lease)
                // Longer than any wait here: a record past its retention is claimed anew.
                .retention(Duration::from_secs(30 * 24 * 60 * 60))
                .busy_policy(busy)
                .build()
                .unwrap(),
        )
        .service(provider.clone());
    let op = OperationId::new("task-forever", "charge");
    provider.push_fault(Fault::Latency(owner_runs));
    let first = tokio::spawn(client.clone().oneshot(keyed_post(&op)));
    tokio::task::yield_now().await;
    let duplicate = tokio::spawn(client.oneshot(keyed_post(&op)));
    (provider, first, duplicate)
}

/// A duplicate waiting a day on an owner that holds its 30 s lease all along looks at the
/// key a few times, not once a lease (2,880 times), and is answered busy at its bound.
#[tokio::test(start_paused = true)]
async fn a_duplicate_waiting_on_a_live_owner_looks_again_less_and_less_often() {
    let store = CountedBegins::default();
    let day = Duration::from_secs(24 * 60 * 60);
    let (provider, first, duplicate) = duplicate_of_a_slow_owner(
        &store,
        Duration::from_secs(30),
        2 * day,
        BusyPolicy::Wait(day),
    )
    .await;
    let started = tokio::time::Instant::now();
    let duplicate = duplicate.await.unwrap();
    let err = duplicate.unwrap_err();
    assert!(err.is_busy(), "{err:?}");
    assert!(started.elapsed() >= day, "it waited its whole bound");
    // The first's claim, the duplicate's first look, and one per doubling nap.
    assert!(store.begins() <= 20, "{} begins in a day", store.begins());
    assert!(first.await.unwrap().unwrap().status().is_success());
    assert_eq!(provider.effects(), 1);
}

/// Once the owner goes away, a waiter that had stopped looking at every lease's end is
/// told at once, and is answered then, not after its long nap.
#[tokio::test(start_paused = true)]
async fn a_waiter_learns_at_once_that_the_owner_went_away() {
    let store = CountedBegins::default();
    let lease = Duration::from_secs(30);
    let hour = Duration::from_secs(60 * 60);
    let (provider, first, duplicate) =
        duplicate_of_a_slow_owner(&store, lease, 100 * hour, BusyPolicy::Wait(10 * hour)).await;
    // An hour on: the duplicate's naps are some 30 minutes long by now.
    tokio::time::sleep(hour).await;
    first.abort();
    let _ = first.await;
    let gone = tokio::time::Instant::now();
    let _ = duplicate.await.unwrap();
    assert!(
        gone.elapsed() <= lease + Duration::from_secs(1),
        "answered {:?} after the owner went away",
        gone.elapsed()
    );
    assert!(provider.effects() <= 1);
}

/// An owner letting go of a held lease (it went without settling) is announced like a
/// settle: its waiters, who stopped looking at every lease's end since a held lease never
/// runs down, look again and wait for the lease's real end.
#[tokio::test(start_paused = true)]
async fn letting_go_of_a_held_lease_wakes_listeners() {
    let store = MemoryStore::new();
    let key = LedgerKey::from_bytes([7; 32]);
    let fingerprint = Fingerprint::of(&http::Method::POST, "/charges", b"{}");
    let lease = Duration::from_secs(30);
    let request = BeginRequest::new(key, fingerprint, lease, Duration::from_secs(3600));
    let Begin::Acquired { token } = store.begin(request).await.unwrap() else {
        panic!("a fresh key is acquired");
    };
    assert!(store.hold_lease(key, token, lease));
    let settled = store
        .notify_settled(key)
        .expect("the memory store notifies");
    store.let_go(key, token, lease);
    tokio::time::timeout(Duration::from_millis(1), settled)
        .await
        .expect("letting go woke the listener");
}

/// Settles of other keys of the waiter's shard, over and over while the clock stands still,
/// wake the waiter a few times, then it pauses (as a polling waiter does) rather than look
/// at its key once per settle.
#[tokio::test(start_paused = true)]
async fn settles_of_other_keys_at_one_instant_do_not_keep_a_waiter_looking() {
    let store = CountedBegins::default();
    let hour = Duration::from_secs(60 * 60);
    let (provider, first, duplicate) = duplicate_of_a_slow_owner(
        &store,
        Duration::from_secs(30),
        hour,
        BusyPolicy::Wait(2 * hour),
    )
    .await;
    // Let the duplicate find the key busy and listen.
    for _ in 0..10 {
        tokio::task::yield_now().await;
    }
    let waiting = store.begins();
    // Keys of the watched key's shard (the store shards by the first byte), claimed and
    // completed a thousand times without the clock moving.
    let shard = store.watched().as_bytes()[0];
    let fingerprint = Fingerprint::of(&http::Method::POST, "/other", b"{}");
    for i in 0..1000u32 {
        let mut bytes = [shard; 32];
        bytes[1..5].copy_from_slice(&i.to_be_bytes());
        let key = LedgerKey::from_bytes(bytes);
        let request = BeginRequest::new(key, fingerprint, hour, hour);
        let Begin::Acquired { token } = store.begin(request).await.unwrap() else {
            panic!("a fresh key is acquired");
        };
        let done = Outcome::Tombstone {
            status: StatusCode::OK,
        };
        store.complete(key, token, done, hour).await.unwrap();
        tokio::task::yield_now().await;
    }
    let looks = store.begins() - waiting;
    assert!(looks <= 20, "{looks} looks for 1000 settles of other keys");
    // The first request then completes, and the duplicate gets its replay.
    assert!(first.await.unwrap().unwrap().status().is_success());
    assert!(duplicate.await.unwrap().unwrap().status().is_success());
    assert_eq!(provider.effects(), 1);
}

/// Server settings that are durations (and the busy policy, which holds one).
#[derive(Clone, Debug)]
struct ServerDurations {
    lease: Duration,
    retention: Duration,
    protected: Duration,
    busy: BusyPolicy,
    retry_after: Duration,
}

fn server_durations() -> impl Strategy<Value = ServerDurations> {
    (
        duration(),
        duration(),
        duration(),
        busy_policy(),
        duration(),
    )
        .prop_map(
            |(lease, retention, protected, busy, retry_after)| ServerDurations {
                lease,
                retention,
                protected,
                busy,
                retry_after,
            },
        )
}

fn server_builder<St: tower_idempotency::ledger::IdempotencyStore>(
    store: St,
    d: &ServerDurations,
) -> tower_idempotency::server::Builder {
    IdempotencyLayer::server_builder(store)
        .unscoped()
        .lease(d.lease)
        .retention(d.retention)
        .protected_window(d.protected)
        .busy_policy(d.busy)
        .retry_after(d.retry_after)
}

fn keyed_request() -> Request<Full<Bytes>> {
    Request::post("http://orders.local/orders")
        .header("idempotency-key", "\"order-42\"")
        .body(Full::new(Bytes::from_static(br#"{"sku":"SKU-4471"}"#)))
        .unwrap()
}

/// A `Retry-After` in whole seconds, as the server sends it.
fn retry_after_secs<B>(response: &Response<B>) -> Option<u64> {
    response
        .headers()
        .get(http::header::RETRY_AFTER)
        .map(|value| value.to_str().unwrap().parse().unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// `IdempotencyLayer::server_builder`: whatever it accepts serves keyed requests —
    /// fresh, a duplicate in flight (`409` or a wait), a replay — and answers `503` with a
    /// `Retry-After` when the ledger is down.
    #[test]
    fn every_server_configuration_the_builder_accepts_serves_requests(d in server_durations()) {
        let Ok(layer) = server_builder(MemoryStore::new(), &d).build() else {
            return Ok(());
        };
        let started = Arc::new(Notify::new());
        let handler = {
            let started = started.clone();
            tower::service_fn(move |_req: Request<_>| {
                let started = started.clone();
                async move {
                    started.notify_one();
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    let mut response = Response::new(Full::new(Bytes::from_static(b"created")));
                    *response.status_mut() = StatusCode::CREATED;
                    Ok::<_, Infallible>(response)
                }
            })
        };
        let server = ServiceBuilder::new().layer(layer).service(handler.clone());
        paused_runtime().block_on(async {
            let mut first = tokio::spawn(server.clone().oneshot(keyed_request()));
            // The duplicate goes once the handler runs: unless the first request ended
            // before (it panicked), which fails the case rather than waiting for ever.
            tokio::select! {
                () = started.notified() => {}
                ended = &mut first => prop_assert!(false, "the first request ended early: {ended:?}"),
            }
            let duplicate = server.clone().oneshot(keyed_request()).await.unwrap();
            // A lease shorter than its renewal (a millisecond at least) lapses while the
            // handler runs: the duplicate then finds the key in doubt, and says so (`500`
            // outcome-unknown). Otherwise it waits for the replay, or gets `409`.
            let lease_holds = d.lease >= Duration::from_secs(1);
            match duplicate.status() {
                StatusCode::CREATED => {}
                StatusCode::CONFLICT => prop_assert!(retry_after_secs(&duplicate).is_some()),
                StatusCode::INTERNAL_SERVER_ERROR if !lease_holds => {}
                other => prop_assert!(false, "the duplicate got {other}"),
            }
            let first = first.await.expect("the first request does not panic").unwrap();
            prop_assert_eq!(first.status(), StatusCode::CREATED);
            let replay = server.oneshot(keyed_request()).await.unwrap();
            if lease_holds {
                prop_assert_eq!(replay.status(), StatusCode::CREATED);
                let body = replay.into_body().collect().await.unwrap().to_bytes();
                prop_assert_eq!(&body[..], b"created");
            }

            // The same settings over a ledger that is down: 503, with the Retry-After set.
            let down = server_builder(down::DownStore, &d).build().unwrap();
            let refused = ServiceBuilder::new()
                .layer(down)
                .service(handler)
                .oneshot(keyed_request())
                .await
                .unwrap();
            prop_assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
            prop_assert!(retry_after_secs(&refused).is_some());
            Ok(())
        })?;
    }
}

/// Redis holds "keep forever" too: the TTLs it is handed are ones `PX` takes, and store
/// timeouts of `Duration::MAX` bound nothing rather than overflow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_keeps_a_record_forever_with_unbounded_timeouts() {
    let Some(redis) = redis_support::RedisServer::spawn().await else {
        return;
    };
    let store = RedisStore::builder(redis.url())
        .prefix("forever:")
        .operation_timeout(Duration::MAX)
        .connection_timeout(Duration::MAX)
        .response_timeout(Duration::MAX)
        .connect()
        .await
        .unwrap();
    let store = Arc::new(store);
    let provider = SideEffectService::new();
    let client = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(store.clone())
                .provider_deduplicates(true)
                .key_header(KeyHeader::ietf())
                .lease(Duration::MAX)
                .retention(Duration::MAX)
                .busy_policy(BusyPolicy::Wait(Duration::MAX))
                .build()
                .unwrap(),
        )
        .service(provider.clone());
    let op = OperationId::new("task-forever", "charge");
    for _ in 0..2 {
        let response = client.clone().oneshot(keyed_post(&op)).await.unwrap();
        assert!(response.status().is_success());
    }
    assert_eq!(provider.effects(), 1);

    let server = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::server_builder(store)
                .unscoped()
                .retention(Duration::MAX)
                .protected_window(Duration::MAX)
                .retry_after(Duration::MAX)
                .build()
                .unwrap(),
        )
        .service_fn(|_req: Request<_>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
        });
    for _ in 0..2 {
        let response = server.clone().oneshot(keyed_request()).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
}
