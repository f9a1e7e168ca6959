//! The server `IdempotencyLayer`: over real loopback TCP against axum where the behaviour is
//! about the wire, in-process on a paused clock where it is about time.
//!
//! Nothing here sleeps to wait: tests wait on what they are waiting for (a handler started,
//! the ledger settled a lease), through `watch` channels the test doubles publish.

use crate::support::axum_server;
use crate::support::down;

use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::header::{
    CACHE_CONTROL, CONTENT_TYPE, DATE, ETAG, LOCATION, SET_COOKIE, WWW_AUTHENTICATE,
};
use http::{HeaderMap, HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body::Frame;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tower::ServiceExt;
use tower_http::catch_panic::CatchPanicLayer;
use tower_idempotency::digest::BodyDigest;
use tower_idempotency::ledger::{
    Begin, BeginRequest, IdempotencyStore, LeaseToken, LedgerKey, MemoryStore, Outcome, StoreError,
    StoreFuture,
};
use tower_idempotency::server::{self, problem};
use tower_idempotency::{IdempotencyLayer, InDoubtPolicy, ServerErrorPolicy};

use axum_server::Charge;

// ---------------------------------------------------------------------------------------
// Test doubles
// ---------------------------------------------------------------------------------------

/// How often each ledger operation completed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Calls {
    begin: usize,
    complete: usize,
    abandon: usize,
    mark_in_doubt: usize,
}

/// A `MemoryStore` that counts its calls (published on a `watch` channel, so tests can wait
/// for one) and can be switched off.
#[derive(Clone, Debug)]
struct CountingStore {
    store: MemoryStore,
    calls: Arc<watch::Sender<Calls>>,
    down: Arc<AtomicBool>,
    recorded: Arc<std::sync::Mutex<Vec<Outcome>>>,
}

impl CountingStore {
    fn new() -> Self {
        Self {
            store: MemoryStore::new(),
            calls: Arc::new(watch::Sender::new(Calls::default())),
            down: Arc::default(),
            recorded: Arc::default(),
        }
    }

    /// Every outcome written by `complete`.
    fn recorded(&self) -> Vec<Outcome> {
        self.recorded.lock().unwrap().clone()
    }

    fn calls(&self) -> Calls {
        *self.calls.borrow()
    }

    async fn until(&self, done: impl Fn(&Calls) -> bool) {
        let mut calls = self.calls.subscribe();
        within(calls.wait_for(|c| done(c)))
            .await
            .expect("the sender lives in self");
    }

    fn take_down(&self) {
        self.down.store(true, Ordering::SeqCst);
    }

    fn count(&self, call: impl FnOnce(&mut Calls)) {
        self.calls.send_modify(call);
    }
}

impl IdempotencyStore for CountingStore {
    fn begin(&self, request: BeginRequest) -> StoreFuture<'_, Begin> {
        StoreFuture::new(async move {
            self.count(|c| c.begin += 1);
            if self.down.load(Ordering::SeqCst) {
                return Err(StoreError::unavailable("injected outage"));
            }
            self.store.begin(request).await
        })
    }

    fn complete(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        outcome: Outcome,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        StoreFuture::new(async move {
            self.recorded.lock().unwrap().push(outcome.clone());
            let done = self.store.complete(key, token, outcome, retention).await;
            self.count(|c| c.complete += 1);
            done
        })
    }

    fn abandon(&self, key: LedgerKey, token: LeaseToken) -> StoreFuture<'_, ()> {
        StoreFuture::new(async move {
            let done = self.store.abandon(key, token).await;
            self.count(|c| c.abandon += 1);
            done
        })
    }

    fn mark_in_doubt(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        StoreFuture::new(async move {
            let done = self.store.mark_in_doubt(key, token, retention).await;
            self.count(|c| c.mark_in_doubt += 1);
            done
        })
    }

    fn renew(&self, key: LedgerKey, token: LeaseToken, lease: Duration) -> StoreFuture<'_, ()> {
        self.store.renew(key, token, lease)
    }
}

/// Waits are on events, not on time; this bound only turns a regression that would hang
/// into a failure. (On a paused clock it elapses only when nothing else can run.)
async fn within<F: std::future::Future>(event: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(30), event)
        .await
        .expect("the awaited event never happened")
}

/// What the test handlers did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Runs {
    started: usize,
    finished: usize,
    /// Handler futures dropped before they finished.
    cancelled: usize,
    /// Request futures the server dropped before they answered (seen outside our layer).
    requests_dropped: usize,
}

/// The test handlers' shared state: counts, and a gate `/slow` waits at.
#[derive(Clone)]
struct Probe {
    runs: Arc<watch::Sender<Runs>>,
    gate: Arc<Semaphore>,
}

impl Probe {
    fn new() -> Self {
        Self {
            runs: Arc::new(watch::Sender::new(Runs::default())),
            gate: Arc::new(Semaphore::new(0)),
        }
    }

    fn runs(&self) -> Runs {
        *self.runs.borrow()
    }

    async fn until(&self, done: impl Fn(&Runs) -> bool) {
        let mut runs = self.runs.subscribe();
        within(runs.wait_for(|r| done(r)))
            .await
            .expect("the sender lives in self");
    }

    /// Let `n` waiting (or future) `/slow` handlers through.
    fn open_gate(&self, n: usize) {
        self.gate.add_permits(n);
    }

    /// Count a start; the returned guard counts the finish, or a cancellation if dropped
    /// before `finish`.
    fn start(&self) -> Running {
        let mut number = 0;
        self.runs.send_modify(|r| {
            r.started += 1;
            number = r.started;
        });
        Running {
            probe: self.clone(),
            number,
            finished: false,
        }
    }
}

struct Running {
    probe: Probe,
    number: usize,
    finished: bool,
}

impl Running {
    fn finish(mut self) -> usize {
        self.finished = true;
        self.probe.runs.send_modify(|r| r.finished += 1);
        self.number
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if !self.finished {
            self.probe.runs.send_modify(|r| r.cancelled += 1);
        }
    }
}

const OLD_DATE: &str = "Sat, 01 Jan 2000 00:00:00 GMT";
const BIG: usize = 4096;

/// `POST /effect`: 201 with a binary body (every byte value, the request body, the run
/// number) and headers of every kind, replayable or not. `GET /effect` reads.
async fn effect(State(probe): State<Probe>, body: Bytes) -> Response<Body> {
    let number = probe.start().finish();
    let mut payload: Vec<u8> = (0..=255u8).collect();
    payload.extend_from_slice(&body);
    payload.push(number as u8);
    Response::builder()
        .status(StatusCode::CREATED)
        .header(CONTENT_TYPE, "application/octet-stream")
        .header(LOCATION, format!("/effects/{number}"))
        .header(ETAG, "\"v1\"")
        .header(CACHE_CONTROL, "no-store")
        .header(SET_COOKIE, "session=first-callers-secret")
        .header(WWW_AUTHENTICATE, "Bearer realm=\"first\"")
        .header(DATE, OLD_DATE)
        .header("x-internal", "1")
        .body(Body::from(payload))
        .unwrap()
}

/// `POST /forged`: 201, setting the layer's own headers as a handler might (copied from an
/// upstream response, say) — values that are not the layer's to answer with.
async fn forged(State(probe): State<Probe>) -> Response<Body> {
    let number = probe.start().finish();
    Response::builder()
        .status(StatusCode::CREATED)
        .header(CONTENT_TYPE, "text/plain")
        .header("idempotent-request-digest", "sha-256=:Zm9yZ2Vk:")
        .header("idempotent-replayed", "false")
        .body(Body::from(format!("forged {number}")))
        .unwrap()
}

async fn read(State(probe): State<Probe>) -> &'static str {
    probe.start().finish();
    "read"
}

async fn fail(State(probe): State<Probe>) -> (StatusCode, String) {
    let number = probe.start().finish();
    (StatusCode::INTERNAL_SERVER_ERROR, format!("boom {number}"))
}

async fn panics(State(probe): State<Probe>) -> &'static str {
    let _running = probe.start();
    panic!("the handler panicked");
}

async fn slow(State(probe): State<Probe>) -> (StatusCode, String) {
    let running = probe.start();
    probe
        .gate
        .acquire()
        .await
        .expect("the gate is never closed")
        .forget();
    let number = running.finish();
    (StatusCode::CREATED, format!("slow {number}"))
}

async fn big(State(probe): State<Probe>) -> (StatusCode, Vec<u8>) {
    let number = probe.start().finish();
    let mut body = vec![b'x'; BIG];
    body[BIG - 1] = number as u8;
    (StatusCode::CREATED, body)
}

/// Outermost middleware: notices when the server drops a request's future (the client hung
/// up), which is the moment our layer's future is dropped too.
async fn notice_dropped_requests(
    State(probe): State<Probe>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    struct Pending(Option<Probe>);
    impl Drop for Pending {
        fn drop(&mut self) {
            if let Some(probe) = self.0.take() {
                probe.runs.send_modify(|r| r.requests_dropped += 1);
            }
        }
    }
    let mut pending = Pending(Some(probe));
    let response = next.run(req).await;
    pending.0 = None;
    response
}

fn routes(probe: Probe) -> Router {
    Router::new()
        .route("/effect", post(effect).get(read))
        .route("/fail", post(fail))
        .route("/panic", post(panics))
        .route("/slow", post(slow))
        .route("/big", post(big))
        .route("/forged", post(forged))
        .with_state(probe)
}

// ---------------------------------------------------------------------------------------
// Wiring: a served app, a client, answers
// ---------------------------------------------------------------------------------------

type TestBody = BoxBody<Bytes, Infallible>;

fn full(bytes: impl Into<Bytes>) -> TestBody {
    Full::new(bytes.into()).boxed()
}

/// A body that arrives in chunks and announces no length (sent `Transfer-Encoding: chunked`).
struct Chunked(VecDeque<Bytes>);

impl http_body::Body for Chunked {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.0.pop_front().map(|chunk| Ok(Frame::data(chunk))))
    }
}

async fn serve(app: Router) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

fn client() -> Client<HttpConnector, TestBody> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// A response, read whole.
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    async fn read<B>(response: Response<B>) -> Self
    where
        B: http_body::Body,
        B::Error: std::fmt::Debug,
    {
        let (parts, body) = response.into_parts();
        Self {
            status: parts.status,
            headers: parts.headers,
            body: body.collect().await.unwrap().to_bytes(),
        }
    }

    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// The problem body's `type`, checking it is one.
    fn problem(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        let json = self.json();
        assert_eq!(json["status"], self.status.as_u16(), "{json}");
        json["type"].as_str().unwrap().to_owned()
    }

    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|err| panic!("{err}: {:?}", self.body))
    }
}

/// An app behind the layer, served on an ephemeral port.
struct Fixture {
    addr: SocketAddr,
    ledger: CountingStore,
    probe: Probe,
    client: Client<HttpConnector, TestBody>,
}

impl Fixture {
    /// `Router::layer`, as most users would add it.
    async fn start(configure: impl FnOnce(server::Builder) -> server::Builder) -> Self {
        Self::start_with(configure, |routes, layer, _| routes.layer(layer)).await
    }

    /// tower-http's `CatchPanicLayer` inside ours: a panic reaches us as a 500.
    async fn start_catching_panics(
        configure: impl FnOnce(server::Builder) -> server::Builder,
    ) -> Self {
        Self::start_with(configure, |routes, layer, _| {
            routes.layer(CatchPanicLayer::new()).layer(layer)
        })
        .await
    }

    async fn start_with(
        configure: impl FnOnce(server::Builder) -> server::Builder,
        assemble: impl FnOnce(
            Router,
            IdempotencyLayer<tower_idempotency::server::ServerFace>,
            &CountingStore,
        ) -> Router,
    ) -> Self {
        let ledger = CountingStore::new();
        let probe = Probe::new();
        let layer = configure(IdempotencyLayer::server_builder(ledger.clone()))
            .build()
            .unwrap();
        let app = assemble(routes(probe.clone()), layer, &ledger).layer(
            axum::middleware::from_fn_with_state(probe.clone(), notice_dropped_requests),
        );
        let addr = serve(app).await;
        Self {
            addr,
            ledger,
            probe,
            client: client(),
        }
    }

    /// A `POST` from the test's one caller (its credentials scope its keys).
    fn post(&self, path: &str) -> http::request::Builder {
        Request::post(format!("http://{}{path}", self.addr)).header("authorization", "Bearer test")
    }

    fn keyed(&self, path: &str, key: &str) -> http::request::Builder {
        self.post(path)
            .header("idempotency-key", format!("\"{key}\""))
    }

    async fn send(&self, req: Request<TestBody>) -> Answer {
        Answer::read(self.client.request(req).await.unwrap()).await
    }
}

// ---------------------------------------------------------------------------------------
// The demo service
// ---------------------------------------------------------------------------------------

const ORDER_42: &str = r#"{"order_id":"order-42","amount_cents":1999}"#;

fn charge(addr: SocketAddr, tenant: &str, key: &str, body: &'static str) -> Request<TestBody> {
    Request::post(format!("http://{addr}/charges"))
        .header("authorization", tenant)
        .header("idempotency-key", format!("\"{key}\""))
        .header("content-type", "application/json")
        .body(full(body))
        .unwrap()
}

async fn charges_of(
    client: &Client<HttpConnector, TestBody>,
    addr: SocketAddr,
    tenant: &str,
    order: &str,
) -> Vec<Charge> {
    let req = Request::get(format!("http://{addr}/charges?order_id={order}"))
        .header("authorization", tenant)
        .body(full(""))
        .unwrap();
    let answer = Answer::read(client.request(req).await.unwrap()).await;
    assert_eq!(answer.status, StatusCode::OK, "{answer:?}");
    serde_json::from_slice(&answer.body).unwrap()
}

async fn demo() -> SocketAddr {
    serve(axum_server::app(
        MemoryStore::new(),
        Duration::from_millis(20),
    ))
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_duplicates_make_one_charge() {
    let addr = demo().await;
    let client = client();
    let mut requests = JoinSet::new();
    for _ in 0..64 {
        let client = client.clone();
        requests.spawn(async move {
            let response = client.request(charge(addr, "tenant-a", "order-42-charge", ORDER_42));
            Answer::read(response.await.unwrap()).await
        });
    }
    let answers = requests.join_all().await;
    eprintln!(
        "409: {}, replayed: {}",
        answers
            .iter()
            .filter(|a| a.status == StatusCode::CONFLICT)
            .count(),
        answers.iter().filter(|a| a.replayed()).count()
    );

    let fresh: Vec<&Answer> = answers
        .iter()
        .filter(|a| a.status == StatusCode::CREATED && !a.replayed())
        .collect();
    assert_eq!(fresh.len(), 1, "exactly one request ran the handler");
    let charged: Charge = serde_json::from_slice(&fresh[0].body).unwrap();
    for answer in &answers {
        match answer.status {
            StatusCode::CREATED => {
                assert_eq!(answer.body, fresh[0].body, "replays are the same charge")
            }
            StatusCode::CONFLICT => {
                assert_eq!(answer.problem(), problem::IN_FLIGHT);
                assert!(answer.header("retry-after").is_some());
            }
            other => panic!("unexpected {other}: {answer:?}"),
        }
    }
    assert_eq!(
        charges_of(&client, addr, "tenant-a", "order-42").await,
        vec![charged]
    );
}

#[tokio::test]
async fn two_tenants_with_the_same_key_and_body_each_get_their_own_charge() {
    let addr = demo().await;
    let client = client();
    let mut charged = Vec::new();
    for tenant in ["tenant-a", "tenant-b"] {
        let answer = Answer::read(
            client
                .request(charge(addr, tenant, "k-1", ORDER_42))
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(answer.status, StatusCode::CREATED);
        assert!(!answer.replayed(), "another tenant's key is a fresh key");
        charged.push(serde_json::from_slice::<Charge>(&answer.body).unwrap());
    }
    assert_ne!(charged[0].charge_id, charged[1].charge_id);
    assert_eq!(
        charges_of(&client, addr, "tenant-a", "order-42").await,
        vec![charged[0].clone()]
    );
    assert_eq!(
        charges_of(&client, addr, "tenant-b", "order-42").await,
        vec![charged[1].clone()]
    );
}

#[tokio::test]
async fn the_demo_refuses_strangers_and_malformed_json() {
    let addr = demo().await;
    let client = client();
    let anonymous = Request::post(format!("http://{addr}/charges"))
        .header("idempotency-key", "\"k\"")
        .body(full(ORDER_42))
        .unwrap();
    let answer = Answer::read(client.request(anonymous).await.unwrap()).await;
    assert_eq!(answer.status, StatusCode::UNAUTHORIZED);

    let malformed = charge(addr, "tenant-a", "k-bad", r#"{"order_id": "#);
    let answer = Answer::read(client.request(malformed).await.unwrap()).await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert_ne!(
        answer.header("content-type"),
        Some("application/problem+json"),
        "the handler's own 400"
    );
    assert!(charges_of(&client, addr, "tenant-a", "order-42")
        .await
        .is_empty());
}

// ---------------------------------------------------------------------------------------
// axum's own answers
// ---------------------------------------------------------------------------------------

/// A request from `tenant`, with an optional key, read whole.
async fn send_to(
    client: &Client<HttpConnector, TestBody>,
    method: http::Method,
    uri: String,
    key: Option<&str>,
) -> Answer {
    let mut req = Request::builder()
        .method(method)
        .uri(uri)
        .header("authorization", "tenant-a")
        .header("content-type", "application/json");
    if let Some(key) = key {
        req = req.header("idempotency-key", format!("\"{key}\""));
    }
    Answer::read(
        client
            .request(req.body(full(ORDER_42)).unwrap())
            .await
            .unwrap(),
    )
    .await
}

/// axum's `405` (a method the route does not serve) and `404` (an unknown path) for the
/// requests of `ledger`'s app: never a problem body, never a ledger call, never a replay.
async fn assert_axum_answers_untouched(addr: SocketAddr, ledger: &CountingStore) {
    let client = client();
    let charges = format!("http://{addr}/charges");

    let keyless = send_to(&client, http::Method::PATCH, charges.clone(), None).await;
    assert_eq!(
        keyless.status,
        StatusCode::METHOD_NOT_ALLOWED,
        "{keyless:?}"
    );
    assert_ne!(
        keyless.header("content-type"),
        Some("application/problem+json")
    );

    for _ in 0..2 {
        let keyed = send_to(
            &client,
            http::Method::PATCH,
            charges.clone(),
            Some("k-patch"),
        )
        .await;
        assert_eq!(keyed.status, StatusCode::METHOD_NOT_ALLOWED, "{keyed:?}");
        assert!(
            !keyed.replayed(),
            "a 405 is never recorded, so never replayed"
        );
    }

    let unknown = format!("http://{addr}/refunds");
    let nowhere = send_to(
        &client,
        http::Method::POST,
        unknown.clone(),
        Some("k-refund"),
    )
    .await;
    assert_eq!(nowhere.status, StatusCode::NOT_FOUND, "{nowhere:?}");
    let keyless = send_to(&client, http::Method::POST, unknown, None).await;
    assert_eq!(keyless.status, StatusCode::NOT_FOUND, "{keyless:?}");

    assert_eq!(
        ledger.calls(),
        Calls::default(),
        "axum's answers never reach the ledger"
    );
    assert!(ledger.recorded().is_empty());

    // The route's own method still goes through the ledger.
    let charged = send_to(&client, http::Method::POST, charges.clone(), Some("k-post")).await;
    assert_eq!(charged.status, StatusCode::CREATED, "{charged:?}");
    let again = send_to(&client, http::Method::POST, charges, Some("k-post")).await;
    assert!(again.replayed());
    assert_eq!(ledger.calls().begin, 2);
}

#[tokio::test]
async fn the_demo_leaves_axums_405_and_404_untouched() {
    let ledger = CountingStore::new();
    let addr = serve(axum_server::app(ledger.clone(), Duration::from_millis(1))).await;
    assert_axum_answers_untouched(addr, &ledger).await;
}

#[tokio::test]
async fn the_readme_wiring_leaves_axums_405_and_404_untouched() {
    async fn charge() -> (StatusCode, &'static str) {
        (StatusCode::CREATED, r#"{"charge_id":"ch_1"}"#)
    }
    let ledger = CountingStore::new();
    // As the README wires it: the layer on the method router, around `POST` alone.
    let app = Router::new().route(
        "/charges",
        post(charge).route_layer(IdempotencyLayer::server(ledger.clone())),
    );
    assert_axum_answers_untouched(serve(app).await, &ledger).await;
}

// ---------------------------------------------------------------------------------------
// Refusals before the ledger
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn bad_inputs_are_refused_before_the_handler_and_the_ledger() {
    let app = Fixture::start(|b| b.body_limit(1024)).await;
    let over_limit = vec![b'a'; 3000];
    let chunks = || {
        Chunked(
            [vec![b'a'; 1000], vec![b'b'; 1000], vec![b'c'; 1000]]
                .map(Bytes::from)
                .into(),
        )
    };

    struct Case {
        name: &'static str,
        request: Request<TestBody>,
        status: StatusCode,
        problem: &'static str,
        reason: Option<&'static str>,
    }
    let key = |value: &[u8]| HeaderValue::from_bytes(value).unwrap();
    let cases = [
        Case {
            name: "missing key",
            request: app.post("/effect").body(full("{}")).unwrap(),
            status: StatusCode::BAD_REQUEST,
            problem: problem::KEY_MISSING,
            reason: None,
        },
        Case {
            name: "empty key",
            request: app
                .post("/effect")
                .header("idempotency-key", key(b"\"\""))
                .body(full("{}"))
                .unwrap(),
            status: StatusCode::BAD_REQUEST,
            problem: problem::KEY_INVALID,
            reason: Some("empty"),
        },
        Case {
            name: "256-character key",
            request: app
                .post("/effect")
                .header("idempotency-key", key("k".repeat(256).as_bytes()))
                .body(full("{}"))
                .unwrap(),
            status: StatusCode::BAD_REQUEST,
            problem: problem::KEY_INVALID,
            reason: Some("too-long"),
        },
        Case {
            name: "non-visible-ASCII key",
            request: app
                .post("/effect")
                .header("idempotency-key", key("\"café\"".as_bytes()))
                .body(full("{}"))
                .unwrap(),
            status: StatusCode::BAD_REQUEST,
            problem: problem::KEY_INVALID,
            reason: Some("invalid-character"),
        },
        Case {
            name: "control character in the key",
            request: app
                .post("/effect")
                .header("idempotency-key", key(b"a\tb"))
                .body(full("{}"))
                .unwrap(),
            status: StatusCode::BAD_REQUEST,
            problem: problem::KEY_INVALID,
            reason: Some("invalid-character"),
        },
        Case {
            name: "bad sf-string",
            request: app
                .post("/effect")
                .header("idempotency-key", key(b"\"abc"))
                .body(full("{}"))
                .unwrap(),
            status: StatusCode::BAD_REQUEST,
            problem: problem::KEY_INVALID,
            reason: Some("bad-sf-string"),
        },
        Case {
            name: "two Idempotency-Key headers",
            request: app
                .post("/effect")
                .header("idempotency-key", key(b"\"a\""))
                .header("idempotency-key", key(b"\"b\""))
                .body(full("{}"))
                .unwrap(),
            status: StatusCode::BAD_REQUEST,
            problem: problem::KEY_INVALID,
            reason: Some("repeated"),
        },
        Case {
            name: "body over the limit, declared by Content-Length",
            request: app
                .keyed("/effect", "big-declared")
                .body(full(over_limit.clone()))
                .unwrap(),
            status: StatusCode::PAYLOAD_TOO_LARGE,
            problem: problem::BODY_TOO_LARGE,
            reason: None,
        },
        Case {
            name: "body over the limit, chunked",
            request: app
                .keyed("/effect", "big-chunked")
                .body(BoxBody::new(chunks()))
                .unwrap(),
            status: StatusCode::PAYLOAD_TOO_LARGE,
            problem: problem::BODY_TOO_LARGE,
            reason: None,
        },
    ];

    for case in cases {
        let answer = app.send(case.request).await;
        assert_eq!(answer.status, case.status, "{}: {answer:?}", case.name);
        assert_eq!(answer.problem(), case.problem, "{}", case.name);
        if let Some(reason) = case.reason {
            assert_eq!(answer.json()["reason"], reason, "{}", case.name);
        }
        if case.status == StatusCode::PAYLOAD_TOO_LARGE {
            assert_eq!(answer.json()["limit"], 1024, "{}", case.name);
        }
        assert_eq!(
            app.probe.runs().started,
            0,
            "{}: the handler ran",
            case.name
        );
        assert_eq!(
            app.ledger.calls(),
            Calls::default(),
            "{}: the ledger was touched",
            case.name
        );
    }
    app.ledger.store.run_pending_tasks().await;
    assert_eq!(app.ledger.store.entry_count(), 0);
}

#[tokio::test]
async fn reads_and_keyless_requests_in_optional_mode_pass_straight_through() {
    let app = Fixture::start(|b| b.require_key(false)).await;
    let read = Request::get(format!("http://{}/effect", app.addr))
        .body(full(""))
        .unwrap();
    let answer = app.send(read).await;
    assert_eq!(
        (answer.status, &answer.body[..]),
        (StatusCode::OK, &b"read"[..])
    );

    let keyless = app.post("/effect").body(full("{}")).unwrap();
    assert_eq!(app.send(keyless).await.status, StatusCode::CREATED);
    let keyless = app.post("/effect").body(full("{}")).unwrap();
    let again = app.send(keyless).await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(!again.replayed());

    // A malformed key is refused even when keys are optional.
    let malformed = app
        .post("/effect")
        .header("idempotency-key", "\"")
        .body(full("{}"))
        .unwrap();
    assert_eq!(app.send(malformed).await.problem(), problem::KEY_INVALID);

    assert_eq!(app.probe.runs().started, 3);
    assert_eq!(app.ledger.calls(), Calls::default());
}

// ---------------------------------------------------------------------------------------
// In flight, reuse, scopes, outages
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn a_key_in_flight_gets_409_with_retry_after_then_the_replay() {
    let app = Arc::new(Fixture::start(|b| b).await);
    let first = tokio::spawn({
        let app = app.clone();
        async move {
            app.send(app.keyed("/slow", "k").body(full("{}")).unwrap())
                .await
        }
    });
    app.probe.until(|r| r.started == 1).await;

    let busy = app
        .send(app.keyed("/slow", "k").body(full("{}")).unwrap())
        .await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert_eq!(busy.problem(), problem::IN_FLIGHT);
    assert_eq!(busy.header("retry-after"), Some("1"));

    app.probe.open_gate(1);
    let first = first.await.unwrap();
    assert_eq!(
        (first.status, &first.body[..]),
        (StatusCode::CREATED, &b"slow 1"[..])
    );
    let replay = app
        .send(app.keyed("/slow", "k").body(full("{}")).unwrap())
        .await;
    assert!(replay.replayed());
    assert_eq!((replay.status, replay.body), (first.status, first.body));
    assert_eq!(app.probe.runs().started, 1);
}

#[tokio::test]
async fn the_same_key_with_a_different_body_gets_422() {
    let app = Fixture::start(|b| b).await;
    let first = app
        .send(
            app.keyed("/effect", "k")
                .body(full(r#"{"amount":1}"#))
                .unwrap(),
        )
        .await;
    assert_eq!(first.status, StatusCode::CREATED);

    let reused = app
        .send(
            app.keyed("/effect", "k")
                .body(full(r#"{"amount":2}"#))
                .unwrap(),
        )
        .await;
    assert_eq!(reused.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(reused.problem(), problem::PAYLOAD_MISMATCH);
    assert!(!reused.replayed());
    assert_eq!(app.probe.runs().started, 1);
}

/// The `422` says what differs: the same JSON reformatted is the body; the same body to
/// another target is the target; another method is the method (with the rest).
#[tokio::test]
async fn a_422_names_the_part_of_the_request_that_differs() {
    let app =
        Fixture::start(|b| b.side_effect_methods([http::Method::POST, http::Method::PATCH])).await;
    let first = app
        .send(
            app.keyed("/effect", "k")
                .body(full(r#"{"amount":1,"currency":"eur"}"#))
                .unwrap(),
        )
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let differs = |answer: &Answer| {
        assert_eq!(
            answer.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{answer:?}"
        );
        assert_eq!(answer.problem(), problem::PAYLOAD_MISMATCH);
        (
            answer.json()["differs"].clone(),
            answer.json()["detail"].clone(),
        )
    };

    let reformatted = app
        .send(
            app.keyed("/effect", "k")
                .body(full("{ \"amount\": 1, \"currency\": \"eur\" }"))
                .unwrap(),
        )
        .await;
    let (parts, detail) = differs(&reformatted);
    assert_eq!(parts, serde_json::json!(["body"]));
    assert!(
        detail.as_str().unwrap().contains("another body"),
        "{detail}"
    );

    let elsewhere = app
        .send(
            app.keyed("/effect?attempt=2", "k")
                .body(full(r#"{"amount":1,"currency":"eur"}"#))
                .unwrap(),
        )
        .await;
    assert_eq!(differs(&elsewhere).0, serde_json::json!(["target"]));

    let patched = app
        .send(
            app.keyed("/effect?attempt=2", "k")
                .method(http::Method::PATCH)
                .body(full("{}"))
                .unwrap(),
        )
        .await;
    let (parts, detail) = differs(&patched);
    assert_eq!(parts, serde_json::json!(["method", "target", "body"]));
    assert!(
        detail
            .as_str()
            .unwrap()
            .contains("another method, target and body"),
        "{detail}"
    );
    assert_eq!(app.probe.runs().started, 1);
}

#[tokio::test]
async fn another_scopes_key_behaves_exactly_like_an_unused_key() {
    let app = Arc::new(Fixture::start(|b| b).await);
    let send_as = |tenant: &'static str, body: &'static str| {
        let app = app.clone();
        async move {
            let req = app
                .keyed("/slow", "shared")
                .header("authorization", tenant)
                .body(full(body))
                .unwrap();
            app.send(req).await
        }
    };
    // Tenant A holds the key in flight; tenant B, same key, another body: no 409, no 422.
    let a = tokio::spawn(send_as("Bearer a", r#"{"n":1}"#));
    app.probe.until(|r| r.started == 1).await;
    let b = tokio::spawn(send_as("Bearer b", r#"{"n":2}"#));
    app.probe.until(|r| r.started == 2).await;
    app.probe.open_gate(2);
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    assert_eq!(
        (a.status, b.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(!a.replayed() && !b.replayed());
    assert_ne!(a.body, b.body);
    // Each tenant replays its own.
    assert_eq!(send_as("Bearer b", r#"{"n":2}"#).await.body, b.body);
    assert_eq!(send_as("Bearer a", r#"{"n":1}"#).await.body, a.body);
}

#[tokio::test]
async fn a_ledger_outage_fails_closed_with_503_and_runs_nothing() {
    let app = Fixture::start(|b| b).await;
    app.ledger.take_down();
    let answer = app
        .send(app.keyed("/effect", "k").body(full("{}")).unwrap())
        .await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.problem(), problem::LEDGER_UNAVAILABLE);
    assert_eq!(answer.header("retry-after"), Some("1"));
    assert!(answer.header("idempotency-fail-open").is_none());
    assert_eq!(app.probe.runs().started, 0, "no side effect");
    let calls = app.ledger.calls();
    // A `begin` without an answer is asked again (it may have applied), then given up.
    assert_eq!(
        (calls.begin, calls.complete, calls.mark_in_doubt),
        (3, 0, 0),
        "{calls:?}"
    );
}

#[tokio::test]
async fn fail_open_runs_the_handler_unprotected_and_says_so() {
    let app = Fixture::start(|b| b.fail_open(true)).await;
    app.ledger.take_down();
    let answer = app
        .send(app.keyed("/effect", "k").body(full("{}")).unwrap())
        .await;
    assert_eq!(answer.status, StatusCode::CREATED);
    assert_eq!(answer.header("idempotency-fail-open"), Some("true"));
    assert_eq!(app.probe.runs().started, 1);
}

// ---------------------------------------------------------------------------------------
// Replay
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn a_replay_is_byte_identical_and_keeps_only_allow_listed_headers() {
    let app = Fixture::start(|b| b).await;
    let payload = Bytes::from_static(b"\x00\xff\x80binary\r\n");
    let first = app
        .send(
            app.keyed("/effect", "k")
                .body(full(payload.clone()))
                .unwrap(),
        )
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    // The first caller gets every header the handler set.
    assert_eq!(
        first.header("set-cookie"),
        Some("session=first-callers-secret")
    );
    assert_eq!(first.header("date"), Some(OLD_DATE));
    assert_eq!(first.header("x-internal"), Some("1"));

    let replay = app
        .send(
            app.keyed("/effect", "k")
                .body(full(payload.clone()))
                .unwrap(),
        )
        .await;
    assert!(replay.replayed());
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(replay.body, first.body, "byte-identical");
    assert_eq!(replay.body.len(), 256 + payload.len() + 1);
    for allowed in ["content-type", "location", "etag", "cache-control"] {
        assert_eq!(replay.header(allowed), first.header(allowed), "{allowed}");
    }
    for never in ["set-cookie", "www-authenticate", "x-internal"] {
        assert_eq!(replay.header(never), None, "{never} was replayed");
    }
    assert_ne!(
        replay.header("date"),
        Some(OLD_DATE),
        "the first response's Date was replayed"
    );
    assert_eq!(app.probe.runs().started, 1);

    // What is not replayed is not stored either: the first caller's cookie never reaches
    // the ledger. The request's digest is, so replays can name the request they answer; the
    // replay mark is not (every replay adds its own).
    let [Outcome::Response(stored)] = &app.ledger.recorded()[..] else {
        panic!("one recorded response expected")
    };
    let headers = stored.headers();
    let mut names: Vec<&str> = headers.keys().map(|name| name.as_str()).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "cache-control",
            "content-type",
            "etag",
            "idempotent-request-digest",
            "location"
        ]
    );
}

/// A handler that sets `Idempotent-Request-Digest` and `Idempotent-Replayed` itself: its
/// first caller gets its answer untouched, and every replay carries the digest of the
/// request it answers and one `Idempotent-Replayed: true`. Composed as users do: a
/// panic-catching layer between the handler and ours, two tenants sending the same key.
#[tokio::test]
async fn a_replay_carries_the_requests_digest_whatever_the_handler_set() {
    let app = Fixture::start_catching_panics(|b| b).await;
    let send = |tenant: &str, body: &'static str| {
        Request::post(format!("http://{}/forged", app.addr))
            .header("authorization", format!("Bearer {tenant}"))
            .header("idempotency-key", "\"k\"")
            .body(full(body))
            .unwrap()
    };
    for (tenant, body) in [("tenant-a", "{\"a\":1}"), ("tenant-b", "{\"b\":2}")] {
        let first = app.send(send(tenant, body)).await;
        assert_eq!(first.status, StatusCode::CREATED);
        assert_eq!(
            first.header("idempotent-request-digest"),
            Some("sha-256=:Zm9yZ2Vk:"),
            "the first caller gets the handler's answer as it was"
        );
        let replay = app.send(send(tenant, body)).await;
        assert_eq!(replay.status, StatusCode::CREATED);
        assert_eq!(replay.body, first.body);
        let digests: Vec<_> = replay
            .headers
            .get_all("idempotent-request-digest")
            .iter()
            .collect();
        let expected = BodyDigest::of(body.as_bytes()).header_value();
        assert_eq!(digests, [&expected], "{tenant}: the request's digest, once");
        let marks: Vec<_> = replay
            .headers
            .get_all("idempotent-replayed")
            .iter()
            .collect();
        assert_eq!(marks, ["true"], "{tenant}: one mark");
    }
    assert_eq!(app.probe.runs().started, 2, "one run per tenant");
}

#[tokio::test]
async fn replicas_sharing_a_ledger_each_replay_what_their_own_allow_list_allows() {
    // Two replicas behind one load balancer, one store, rolled out with different
    // allow-lists: the wider one records `x-internal`, the other must not replay it.
    let store = MemoryStore::new();
    let probe = Probe::new();
    let replica = |builder: server::Builder| {
        let layer = builder.build().unwrap();
        serve(routes(probe.clone()).layer(layer))
    };
    let wider = replica(
        IdempotencyLayer::server_builder(store.clone()).replay_headers([
            CONTENT_TYPE,
            LOCATION,
            HeaderName::from_static("x-internal"),
        ]),
    )
    .await;
    let default = replica(IdempotencyLayer::server_builder(store.clone())).await;
    let client = client();
    let send = |addr: SocketAddr| {
        let req = Request::post(format!("http://{addr}/effect"))
            .header("authorization", "Bearer test")
            .header("idempotency-key", "\"shared\"")
            .body(full("charge"))
            .unwrap();
        let client = client.clone();
        async move { Answer::read(client.request(req).await.unwrap()).await }
    };

    let first = send(wider).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    let on_wider = send(wider).await;
    let on_default = send(default).await;
    assert_eq!(probe.runs().started, 1, "one run across both replicas");
    for replay in [&on_wider, &on_default] {
        assert!(replay.replayed());
        assert_eq!(replay.body, first.body);
        assert_eq!(replay.header("location"), first.header("location"));
        assert!(replay.header("idempotent-request-digest").is_some());
    }
    assert_eq!(on_wider.header("x-internal"), Some("1"));
    assert_eq!(
        on_default.header("x-internal"),
        None,
        "replayed past its allow-list"
    );
    assert_eq!(
        on_default.header("etag"),
        None,
        "not in the wider replica's list either"
    );
}

#[tokio::test]
async fn a_response_over_the_cap_reaches_the_first_caller_whole_and_then_410() {
    let app = Fixture::start(|b| b.response_limit(1024)).await;
    let first = app
        .send(app.keyed("/big", "k").body(full("{}")).unwrap())
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body.len(), BIG, "not truncated");
    assert!(first.body[..BIG - 1].iter().all(|&b| b == b'x'));

    let retry = app
        .send(app.keyed("/big", "k").body(full("{}")).unwrap())
        .await;
    assert_eq!(retry.status, StatusCode::GONE);
    assert_eq!(retry.problem(), problem::RESPONSE_NOT_RECORDED);
    assert_eq!(retry.json()["original_status"], 201);
    assert_eq!(app.probe.runs().started, 1, "never run again");
}

// ---------------------------------------------------------------------------------------
// Handler failures: 5xx, panics, disconnects
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn a_5xx_is_recorded_and_replayed_by_default() {
    let app = Fixture::start(|b| b).await;
    let first = app
        .send(app.keyed("/fail", "k").body(full("{}")).unwrap())
        .await;
    assert_eq!(
        (first.status, &first.body[..]),
        (StatusCode::INTERNAL_SERVER_ERROR, &b"boom 1"[..])
    );
    let retry = app
        .send(app.keyed("/fail", "k").body(full("{}")).unwrap())
        .await;
    assert!(retry.replayed());
    assert_eq!((retry.status, retry.body), (first.status, first.body));
    assert_eq!(app.probe.runs().started, 1);
}

#[tokio::test]
async fn a_released_5xx_runs_the_handler_again() {
    let app = Fixture::start(|b| b.server_error_policy(ServerErrorPolicy::Release)).await;
    let first = app
        .send(app.keyed("/fail", "k").body(full("{}")).unwrap())
        .await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    let retry = app
        .send(app.keyed("/fail", "k").body(full("{}")).unwrap())
        .await;
    assert!(!retry.replayed());
    assert_eq!(
        (retry.status, &retry.body[..]),
        (StatusCode::INTERNAL_SERVER_ERROR, &b"boom 2"[..])
    );
    assert_eq!(app.probe.runs().started, 2);
    assert_eq!(app.ledger.calls().abandon, 2);
}

#[tokio::test]
async fn a_panic_caught_inside_is_a_recorded_500_not_a_stuck_key() {
    let app = Fixture::start_catching_panics(|b| b).await;
    let first = app
        .send(app.keyed("/panic", "k").body(full("{}")).unwrap())
        .await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    let retry = app
        .send(app.keyed("/panic", "k").body(full("{}")).unwrap())
        .await;
    assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(
        retry.replayed(),
        "recorded like any 5xx (the default policy)"
    );
    assert_eq!(app.probe.runs().started, 1);
}

/// tower-http's `CatchPanicLayer` outside ours, around the whole router: the `500` it makes
/// of a panic is made after the key is in doubt (its handler sees the ledger's count of
/// keys marked so far), so a retry sent the moment it arrives is answered
/// `outcome-unknown`, never `409` as if the handler were still running.
#[tokio::test]
async fn a_panic_caught_outside_the_layer_is_in_doubt_before_its_500() {
    // What the ledger had marked in doubt when each `500` was made.
    let marked_by_then = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = marked_by_then.clone();
    let app = Fixture::start_with(
        |b| b,
        move |routes, layer, ledger| {
            let ledger = ledger.clone();
            let on_panic = move |_: Box<dyn std::any::Any + Send>| {
                seen.lock().unwrap().push(ledger.calls().mark_in_doubt);
                let mut response = Response::new(Full::new(Bytes::from_static(b"caught")));
                *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
                response
            };
            routes.layer(layer).layer(CatchPanicLayer::custom(on_panic))
        },
    )
    .await;
    for n in 0..12 {
        let key = format!("k{n}");
        let first = app
            .send(app.keyed("/panic", &key).body(full("{}")).unwrap())
            .await;
        assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
        let retry = app
            .send(app.keyed("/panic", &key).body(full("{}")).unwrap())
            .await;
        assert_eq!(
            (retry.status, retry.problem()),
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                problem::OUTCOME_UNKNOWN.to_owned()
            ),
            "key {key}"
        );
    }
    assert_eq!(app.probe.runs().started, 12, "at most once each");
    assert_eq!(
        *marked_by_then.lock().unwrap(),
        (1..=12).collect::<Vec<_>>()
    );
}

#[tokio::test]
async fn an_uncaught_panic_puts_the_key_in_doubt_at_once() {
    let app = Fixture::start(|b| b).await;
    let lost = app
        .client
        .request(app.keyed("/panic", "k").body(full("{}")).unwrap())
        .await;
    assert!(
        lost.is_err(),
        "the connection closes without a response: {lost:?}"
    );
    // Not in flight until the lease (60 s) runs out: in doubt now.
    app.ledger.until(|c| c.mark_in_doubt == 1).await;
    let retry = app
        .send(app.keyed("/panic", "k").body(full("{}")).unwrap())
        .await;
    assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(retry.problem(), problem::OUTCOME_UNKNOWN);
    assert_eq!(app.probe.runs().started, 1, "at most once");
}

#[tokio::test]
async fn an_uncaught_panic_runs_again_under_run_again() {
    let app = Fixture::start(|b| b.in_doubt_policy(InDoubtPolicy::RunAgain)).await;
    assert!(app
        .client
        .request(app.keyed("/panic", "k").body(full("{}")).unwrap())
        .await
        .is_err());
    app.ledger.until(|c| c.mark_in_doubt == 1).await;
    assert!(app
        .client
        .request(app.keyed("/panic", "k").body(full("{}")).unwrap())
        .await
        .is_err());
    assert_eq!(app.probe.runs().started, 2, "at least once");
}

/// Send a keyed request by hand, wait for its handler to start, hang up, and wait until
/// the server has dropped the request's future.
async fn hang_up_mid_handler(app: &Fixture, key: &str) {
    let mut stream = TcpStream::connect(app.addr).await.unwrap();
    let request = format!(
        "POST /slow HTTP/1.1\r\nhost: test\r\nauthorization: Bearer test\r\nidempotency-key: \"{key}\"\r\ncontent-length: 2\r\n\r\n{{}}"
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    app.probe.until(|r| r.started == 1).await;
    drop(stream);
    app.probe.until(|r| r.requests_dropped == 1).await;
}

#[tokio::test]
async fn a_client_hanging_up_lets_the_handler_finish_and_its_retry_replays() {
    let app = Fixture::start(|b| b).await;
    hang_up_mid_handler(&app, "k").await;
    app.probe.open_gate(1);
    app.ledger.until(|c| c.complete == 1).await;
    assert_eq!(
        app.probe.runs(),
        Runs {
            started: 1,
            finished: 1,
            cancelled: 0,
            requests_dropped: 1
        },
        "the handler finished after its request was dropped"
    );

    let retry = app
        .send(app.keyed("/slow", "k").body(full("{}")).unwrap())
        .await;
    assert!(retry.replayed());
    assert_eq!(
        (retry.status, &retry.body[..]),
        (StatusCode::CREATED, &b"slow 1"[..])
    );
}

#[tokio::test]
async fn a_client_hanging_up_cancels_the_handler_when_asked_and_the_key_is_in_doubt() {
    let app = Fixture::start(|b| b.cancel_on_disconnect(true)).await;
    hang_up_mid_handler(&app, "k").await;
    app.ledger.until(|c| c.mark_in_doubt == 1).await;
    assert_eq!(
        app.probe.runs(),
        Runs {
            started: 1,
            finished: 0,
            cancelled: 1,
            requests_dropped: 1
        },
        "the handler was dropped with its request"
    );

    app.probe.open_gate(1);
    let retry = app
        .send(app.keyed("/slow", "k").body(full("{}")).unwrap())
        .await;
    assert_eq!(retry.problem(), problem::OUTCOME_UNKNOWN);
    assert_eq!(app.probe.runs().started, 1);
}

// ---------------------------------------------------------------------------------------
// In-process, on a paused clock: dropped futures and expired leases
// ---------------------------------------------------------------------------------------

struct InProcess {
    app: Router,
    ledger: CountingStore,
    probe: Probe,
}

impl InProcess {
    fn new(configure: impl FnOnce(server::Builder) -> server::Builder) -> Self {
        let ledger = CountingStore::new();
        let probe = Probe::new();
        let layer = configure(IdempotencyLayer::server_builder(ledger.clone()))
            .build()
            .unwrap();
        Self {
            app: routes(probe.clone()).layer(layer),
            ledger,
            probe,
        }
    }

    fn call(&self, path: &str) -> impl std::future::Future<Output = Answer> + Send + 'static {
        let req = Request::post(path)
            .header("authorization", "Bearer test")
            .header("idempotency-key", "\"k\"")
            .body(Body::from("{}"))
            .unwrap();
        let app = self.app.clone();
        async move { Answer::read(app.oneshot(req).await.unwrap()).await }
    }
}

#[tokio::test(start_paused = true)]
async fn a_dropped_request_future_leaves_the_handler_running_by_default() {
    let server = InProcess::new(|b| b);
    let first = tokio::spawn(server.call("/slow"));
    server.probe.until(|r| r.started == 1).await;
    first.abort();
    assert!(first.await.unwrap_err().is_cancelled());

    server.probe.open_gate(1);
    server.ledger.until(|c| c.complete == 1).await;
    assert_eq!(
        server.probe.runs(),
        Runs {
            started: 1,
            finished: 1,
            ..Runs::default()
        }
    );
    let retry = server.call("/slow").await;
    assert!(retry.replayed());
    assert_eq!(&retry.body[..], b"slow 1");
}

#[tokio::test(start_paused = true)]
async fn a_dropped_request_future_cancels_the_handler_when_asked() {
    let server = InProcess::new(|b| b.cancel_on_disconnect(true));
    let first = tokio::spawn(server.call("/slow"));
    server.probe.until(|r| r.started == 1).await;
    first.abort();
    let _ = first.await;

    // The guard settles the lease at once; nothing waits for the 60 s lease.
    server.ledger.until(|c| c.mark_in_doubt == 1).await;
    assert_eq!(
        server.probe.runs(),
        Runs {
            started: 1,
            cancelled: 1,
            ..Runs::default()
        }
    );
    assert_eq!(
        server.call("/slow").await.problem(),
        problem::OUTCOME_UNKNOWN
    );
}

/// Claim the in-process server's key `k` for `POST /slow {}` straight in its ledger, as a
/// replica that then died mid-handler would have: nobody renews this lease.
async fn claim_as_a_replica_that_died(server: &InProcess, lease: Duration) {
    let key = LedgerKey::server("t", "k");
    let fingerprint =
        tower_idempotency::fingerprint::Fingerprint::of(&http::Method::POST, "/slow", b"{}");
    let request = BeginRequest::new(key, fingerprint, lease, Duration::from_secs(24 * 3600));
    assert!(matches!(
        server.ledger.begin(request).await.unwrap(),
        Begin::Acquired { .. }
    ));
}

#[tokio::test(start_paused = true)]
async fn a_key_whose_owner_died_is_an_unknown_outcome_by_default() {
    let server = InProcess::new(|b| b.scope(|_| "t".to_owned()).lease(Duration::from_secs(10)));
    claim_as_a_replica_that_died(&server, Duration::from_secs(10)).await;

    // Before the lease ends: in flight.
    tokio::time::advance(Duration::from_secs(9)).await;
    assert_eq!(server.call("/slow").await.problem(), problem::IN_FLIGHT);
    // After: the owner is taken for dead, and the handler is not run again.
    tokio::time::advance(Duration::from_secs(2)).await;
    let unknown = server.call("/slow").await;
    assert_eq!(unknown.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(unknown.problem(), problem::OUTCOME_UNKNOWN);
    assert_eq!(
        server.call("/slow").await.problem(),
        problem::OUTCOME_UNKNOWN
    );
    assert_eq!(server.probe.runs().started, 0);
}

#[tokio::test(start_paused = true)]
async fn a_key_whose_owner_died_runs_the_handler_again_under_run_again() {
    let server = InProcess::new(|b| {
        b.scope(|_| "t".to_owned())
            .lease(Duration::from_secs(10))
            .in_doubt_policy(InDoubtPolicy::RunAgain)
    });
    claim_as_a_replica_that_died(&server, Duration::from_secs(10)).await;
    tokio::time::advance(Duration::from_secs(11)).await;

    server.probe.open_gate(1);
    let again = server.call("/slow").await;
    assert_eq!(
        (again.status, again.replayed()),
        (StatusCode::CREATED, false)
    );
    let replay = server.call("/slow").await;
    assert!(replay.replayed());
    assert_eq!(replay.body, again.body);
    assert_eq!(server.probe.runs().started, 1);
}

#[tokio::test(start_paused = true)]
async fn a_slow_live_handler_keeps_its_lease_and_is_never_overtaken() {
    // Defect 14: one slow owner must not lose its lease to a duplicate, whatever the policy.
    for policy in [InDoubtPolicy::OutcomeUnknown, InDoubtPolicy::RunAgain] {
        let server = InProcess::new(|b| b.lease(Duration::from_secs(3)).in_doubt_policy(policy));
        let first = tokio::spawn(server.call("/slow"));
        server.probe.until(|r| r.started == 1).await;
        // Ten leases' worth of time, a second at a time: the owner renews as it goes.
        for _ in 0..30 {
            tokio::time::advance(Duration::from_secs(1)).await;
        }
        assert_eq!(
            server.call("/slow").await.problem(),
            problem::IN_FLIGHT,
            "{policy:?}: a live owner was taken for dead"
        );
        server.probe.open_gate(1);
        let first = first.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED);
        let replay = server.call("/slow").await;
        assert!(
            replay.replayed(),
            "{policy:?}: the slow owner's outcome was lost"
        );
        assert_eq!(replay.body, first.body);
        assert_eq!(server.probe.runs().started, 1, "{policy:?}");
    }
}

#[tokio::test]
async fn the_handler_gets_the_key_in_its_extensions_on_its_first_run_and_when_failing_open() {
    // A handler passes the key on to its own downstream calls: it must find it, as sent,
    // whether it runs first or runs unprotected because the ledger is away (fail open).
    let echo = tower::service_fn(|req: Request<_>| async move {
        let key = req
            .extensions()
            .get::<tower_idempotency::HeaderKey>()
            .map(|key| key.as_str().to_owned())
            .unwrap_or_default();
        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(key))))
    });
    let request = |key: &'static str| {
        Request::post("/charges")
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    };
    let body = |response: Response<_>| async move {
        let response: Response<tower_idempotency::idempotency::ResponseBody<_>> = response;
        response.into_body().collect().await.unwrap().to_bytes()
    };
    let layer = IdempotencyLayer::server_builder(MemoryStore::new())
        .unscoped()
        .build()
        .unwrap();
    let service = tower::Layer::layer(&layer, echo);
    let first = service
        .clone()
        .oneshot(request("\"order-42\""))
        .await
        .unwrap();
    assert_eq!(body(first).await, "order-42");
    let replay = service
        .clone()
        .oneshot(request("\"order-42\""))
        .await
        .unwrap();
    assert_eq!(replay.headers()["idempotent-replayed"], "true");
    assert_eq!(
        body(replay).await,
        "order-42",
        "the recorded answer, replayed"
    );

    let away = IdempotencyLayer::server_builder(down::DownStore)
        .unscoped()
        .fail_open(true)
        .build()
        .unwrap();
    let unprotected = tower::Layer::layer(&away, echo)
        .oneshot(request("order-43"))
        .await
        .unwrap();
    assert_eq!(unprotected.headers()["idempotency-fail-open"], "true");
    assert_eq!(body(unprotected).await, "order-43");
}
