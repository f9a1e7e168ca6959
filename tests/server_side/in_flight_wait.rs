//! The server face's opt-in wait for an in-flight key (`BusyPolicy::Wait`): duplicates wait
//! for the first request's outcome and get its replay, bounded in time and in number.
//!
//! Over real loopback TCP where the behaviour is about concurrent connections; the clock is
//! real there (a paused clock would auto-advance past the waits while sockets are idle), so
//! those tests wait on events, never on sleeps. The time bound is tested in-process on a
//! paused clock.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tower::ServiceExt;
use tower_idempotency::ledger::{
    Begin, BeginRequest, IdempotencyStore, LeaseToken, LedgerKey, MemoryStore, Outcome, Settled,
    StoreFuture,
};
use tower_idempotency::server::{self, problem};
use tower_idempotency::{BusyPolicy, IdempotencyLayer, ServerErrorPolicy};

const DUPLICATES: usize = 64;

/// A `MemoryStore` that counts the waiters listening for a settle, so a test knows every
/// duplicate is waiting before it lets the first request finish.
#[derive(Clone, Debug)]
struct ListenedStore {
    store: MemoryStore,
    listening: Arc<watch::Sender<usize>>,
}

impl ListenedStore {
    fn new() -> Self {
        Self {
            store: MemoryStore::new(),
            listening: Arc::new(watch::Sender::new(0)),
        }
    }

    async fn until_listening(&self, n: usize) {
        let mut listening = self.listening.subscribe();
        within(listening.wait_for(|&l| l >= n)).await.unwrap();
    }
}

impl IdempotencyStore for ListenedStore {
    fn begin(&self, request: BeginRequest) -> StoreFuture<'_, Begin> {
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
    fn notify_settled(&self, key: LedgerKey) -> Option<Settled> {
        let settled = self.store.notify_settled(key);
        self.listening.send_modify(|n| *n += 1);
        settled
    }
}

/// Fail instead of hanging: every wait here is for an event that must come.
async fn within<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(20), f)
        .await
        .expect("timed out waiting for an event that must come")
}

/// `POST /charges` behind the server layer: counts runs, holds every run at a gate until
/// the test opens it, and answers `first_status` on the first run (`201` after).
struct App {
    base: String,
    runs: Arc<AtomicUsize>,
    started: watch::Receiver<usize>,
    gate: Arc<Semaphore>,
}

async fn app(
    store: ListenedStore,
    first_status: StatusCode,
    configure: impl FnOnce(server::Builder) -> server::Builder,
) -> App {
    let runs = Arc::new(AtomicUsize::new(0));
    let (started_tx, started) = watch::channel(0);
    let started_tx = Arc::new(started_tx);
    let gate = Arc::new(Semaphore::new(0));
    let (counted, opened) = (runs.clone(), gate.clone());
    let handler = move || {
        let (runs, gate, started) = (counted.clone(), opened.clone(), started_tx.clone());
        async move {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            started.send_modify(|s| *s += 1);
            gate.acquire().await.unwrap().forget();
            let status = if n == 1 {
                first_status
            } else {
                StatusCode::CREATED
            };
            (status, format!("{{\"charge_id\":\"ch_{n}\"}}"))
        }
    };
    let layer = configure(IdempotencyLayer::server_builder(store).unscoped())
        .build()
        .unwrap();
    let router = Router::new()
        .route("/charges", post(handler))
        .route_layer(layer);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    App {
        base,
        runs,
        started,
        gate,
    }
}

impl App {
    fn charge(&self) -> Request<Full<Bytes>> {
        Request::post(format!("{}/charges", self.base))
            .header("idempotency-key", "\"order-42-charge\"")
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(b"{\"amount_cents\":1999}")))
            .unwrap()
    }

    async fn until_started(&self, n: usize) {
        let mut started = self.started.clone();
        within(started.wait_for(|&s| s >= n)).await.unwrap();
    }

    fn open_gate(&self) {
        self.gate.add_permits(DUPLICATES * 2);
    }
}

struct Answer {
    status: StatusCode,
    replayed: bool,
    retry_after: bool,
    body: Bytes,
    problem: Option<String>,
}

async fn send(req: Request<Full<Bytes>>) -> Answer {
    let client: HyperClient<HttpConnector, Full<Bytes>> =
        HyperClient::builder(TokioExecutor::new()).build_http();
    let response = client.request(req).await.unwrap();
    let status = response.status();
    let replayed = response.headers().get("idempotent-replayed").is_some();
    let retry_after = response.headers().contains_key("retry-after");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let problem = serde_json::from_slice::<serde_json::Value>(&body)
        .ok()
        .and_then(|json| json["type"].as_str().map(str::to_owned));
    Answer {
        status,
        replayed,
        retry_after,
        body,
        problem,
    }
}

/// Start the first request, wait until its handler runs, then send the duplicates.
async fn first_then_duplicates(app: &App) -> (tokio::task::JoinHandle<Answer>, JoinSet<Answer>) {
    let first = tokio::spawn(send(app.charge()));
    app.until_started(1).await;
    let mut duplicates = JoinSet::new();
    for _ in 0..DUPLICATES {
        duplicates.spawn(send(app.charge()));
    }
    (first, duplicates)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_wait_on_64_duplicates_get_the_one_replay() {
    let store = ListenedStore::new();
    let app = app(store.clone(), StatusCode::CREATED, |b| {
        b.busy_policy(BusyPolicy::Wait(Duration::from_secs(60)))
    })
    .await;
    let (first, mut duplicates) = first_then_duplicates(&app).await;

    // Every duplicate found the key in flight and is listening for its outcome.
    store.until_listening(DUPLICATES).await;
    assert!(
        duplicates.try_join_next().is_none(),
        "nobody answered early"
    );
    app.open_gate();

    let first = within(first).await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed);
    let mut replays = 0;
    while let Some(answer) = within(duplicates.join_next()).await {
        let answer = answer.unwrap();
        assert_eq!(answer.status, StatusCode::CREATED);
        assert!(answer.replayed, "a waiter gets the replay");
        assert_eq!(answer.body, first.body, "of the one run");
        replays += 1;
    }
    assert_eq!(replays, DUPLICATES);
    assert_eq!(app.runs.load(Ordering::SeqCst), 1, "one handler run");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_wait_off_64_duplicates_get_409s() {
    let store = ListenedStore::new();
    let app = app(store.clone(), StatusCode::CREATED, |b| b).await;
    let (first, mut duplicates) = first_then_duplicates(&app).await;

    // The gate is still closed: every duplicate is answered while the first one runs.
    let mut conflicts = 0;
    while let Some(answer) = within(duplicates.join_next()).await {
        let answer = answer.unwrap();
        assert_eq!(answer.status, StatusCode::CONFLICT);
        assert_eq!(answer.problem.as_deref(), Some(problem::IN_FLIGHT));
        assert!(answer.retry_after);
        conflicts += 1;
    }
    assert_eq!(conflicts, DUPLICATES);
    assert_eq!(*store.listening.borrow(), 0, "nobody waited");
    app.open_gate();
    assert_eq!(within(first).await.unwrap().status, StatusCode::CREATED);
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_beyond_the_waiter_bound_gets_409_at_once() {
    const BOUND: usize = 8;
    let store = ListenedStore::new();
    let app = app(store.clone(), StatusCode::CREATED, |b| {
        b.busy_policy(BusyPolicy::Wait(Duration::from_secs(60)))
            .max_waiters(BOUND)
    })
    .await;
    let (first, mut duplicates) = first_then_duplicates(&app).await;

    // With the first request still held, everyone past the bound is answered now.
    let mut conflicts = 0;
    while conflicts < DUPLICATES - BOUND {
        let answer = within(duplicates.join_next()).await.unwrap().unwrap();
        assert_eq!(answer.status, StatusCode::CONFLICT);
        assert!(answer.retry_after);
        conflicts += 1;
    }
    store.until_listening(BOUND).await;
    assert!(
        duplicates.try_join_next().is_none(),
        "the waiters still wait"
    );
    app.open_gate();

    let first = within(first).await.unwrap();
    let mut replays = 0;
    while let Some(answer) = within(duplicates.join_next()).await {
        let answer = answer.unwrap();
        assert!(answer.replayed);
        assert_eq!(answer.body, first.body);
        replays += 1;
    }
    assert_eq!(replays, BOUND);
    assert_eq!(app.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_wakes_when_the_owner_releases_the_key_and_runs_it() {
    let store = ListenedStore::new();
    // A lease and a wait far longer than the test's patience: only the settle wakes it.
    let app = app(store.clone(), StatusCode::SERVICE_UNAVAILABLE, |b| {
        b.busy_policy(BusyPolicy::Wait(Duration::from_secs(600)))
            .lease(Duration::from_secs(300))
            .server_error_policy(ServerErrorPolicy::Release)
    })
    .await;
    let first = tokio::spawn(send(app.charge()));
    app.until_started(1).await;
    let waiter = tokio::spawn(send(app.charge()));
    store.until_listening(1).await;
    app.open_gate();

    assert_eq!(
        within(first).await.unwrap().status,
        StatusCode::SERVICE_UNAVAILABLE
    );
    // The released key is the waiter's to run: the next owner, not a replay of the 5xx.
    let waiter = within(waiter).await.unwrap();
    assert_eq!(waiter.status, StatusCode::CREATED);
    assert!(!waiter.replayed);
    assert_eq!(app.runs.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_wakes_when_the_owner_ends_in_doubt() {
    let store = ListenedStore::new();
    let app = app(store.clone(), StatusCode::CREATED, |b| {
        b.busy_policy(BusyPolicy::Wait(Duration::from_secs(600)))
            .lease(Duration::from_secs(300))
            .cancel_on_disconnect(true)
    })
    .await;
    // The first client goes away mid-handler: its key is in doubt at once.
    let first = tokio::spawn(send(app.charge()));
    app.until_started(1).await;
    let waiter = tokio::spawn(send(app.charge()));
    store.until_listening(1).await;
    first.abort();

    let waiter = within(waiter).await.unwrap();
    assert_eq!(waiter.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(waiter.problem.as_deref(), Some(problem::OUTCOME_UNKNOWN));
    assert_eq!(app.runs.load(Ordering::SeqCst), 1, "never run twice");
}

#[tokio::test(start_paused = true)]
async fn past_the_bound_a_waiter_gets_the_409_with_retry_after() {
    let gate = Arc::new(Semaphore::new(0));
    let started = Arc::new(tokio::sync::Notify::new());
    let (held, starting) = (gate.clone(), started.clone());
    let router = Router::new()
        .route(
            "/charges",
            post(move || {
                let (gate, started) = (held.clone(), starting.clone());
                async move {
                    started.notify_one();
                    gate.acquire().await.unwrap().forget();
                    (StatusCode::CREATED, "charged")
                }
            }),
        )
        .route_layer(
            IdempotencyLayer::server_builder(MemoryStore::new())
                .unscoped()
                .busy_policy(BusyPolicy::Wait(Duration::from_secs(2)))
                .build()
                .unwrap(),
        );
    let charge = || {
        Request::post("/charges")
            .header("idempotency-key", "\"k\"")
            .body(axum::body::Body::from("{}"))
            .unwrap()
    };
    let first = tokio::spawn(router.clone().oneshot(charge()));
    started.notified().await;
    let started = tokio::time::Instant::now();
    let duplicate = router.clone().oneshot(charge()).await.unwrap();
    assert_eq!(duplicate.status(), StatusCode::CONFLICT);
    assert!(duplicate.headers().contains_key("retry-after"));
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(2) && waited < Duration::from_secs(3),
        "{waited:?}"
    );
    gate.add_permits(1);
    assert_eq!(first.await.unwrap().unwrap().status(), StatusCode::CREATED);
}
