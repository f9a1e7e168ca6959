//! End-to-end cost of the layers over real HTTP on loopback.
//!
//! ```text
//! cargo bench --bench loopback_bench
//! REDIS_URL=redis://127.0.0.1:6379/ cargo bench --features redis --bench loopback_bench
//! ```
//! use tower_idempotency::KeyHeader;
//!
//! axum servers and a hyper-util client in one process, each side on its own tokio runtime
//! with one worker thread (two cores: one per side, as if they were two machines). Every
//! request is `POST /charges` with a 1 KiB JSON body; the handler reads the body and
//! answers `201` with a small JSON body.
//!
//! | variant | client | server |
//! |---|---|---|
//! | `client_bare` | hyper-util | bare axum |
//! | `client_frozen_retry` | `FrozenRetryLayer` over hyper-util | bare axum |
//! | `client_stack` | the client stack as the README builds it (`client_builder(MemoryStore).provider_deduplicates(true).key_header(KeyHeader::ietf()).build_stack()`: `IdempotencyLayer` over `FrozenRetryLayer` as one service), a new `OperationId` per request | bare axum |
//! | `client_stack_copied` | diagnostic: `IdempotencyLayer` over `FrozenRetryLayer` stacked by hand with a layer in between that copies response bodies out of hyper's read buffer before they are recorded | bare axum |
//! | `client_floor` | yardstick: the least a client layer keeping the ledger's promise does (`benches/common/floor.rs`, its own `MemoryStore`) over hyper-util, a new `OperationId` per request | bare axum |
//! | `server_bare` | hyper-util, a new `Idempotency-Key` per request | bare axum |
//! | `server_layer` | the same | axum with the server `IdempotencyLayer` (`MemoryStore`) |
//! | `server_layer_replay` | the same, one fixed key (every request is a replay) | axum with the server layer |
//! | `client_stack_redis`, `server_layer_redis` | as above, `RedisStore` (only with `REDIS_URL` and `--features redis`) | |
//!
//! The `MemoryStore`s are filled to their cap with completed operations before the first
//! round, and the layers run with a 50 ms protected window (`common::BENCH_PROTECTION`), so
//! the layers are measured in the steady state of a long-running process where every new
//! operation evicts an old one: this measures eviction itself, at a rate (tens of
//! thousands of fresh operations a second) above what the default budget protects
//! (`LOOPBACK_EMPTY_STORES=1` starts them empty instead).
//!
//! `LOOPBACK_DEFAULTS=1` measures **every setting at its default** instead, as the README
//! wires the layers: `IdempotencyLayer::client(MemoryStore::new(), ProviderKeys::Deduplicates, KeyHeader::ietf())` and
//! `IdempotencyLayer::server(MemoryStore::new())` (caller keys scoped by `Authorization`,
//! which every request of every variant then carries), the stores starting empty. Each
//! throughput phase then lasts 0.5 s unless `LOOPBACK_SECS` says otherwise, so that a run
//! of the default length stays inside the default budget up to ~100,000 fresh operations a
//! second per variant: nothing is refused or evicted. A variant whose requests failed (a
//! store full at a faster host's rate refuses new operations, as it should) is named in a
//! warning at the end: its figures count the refusals.
//!
//! Each round runs every variant once, in a rotated order: first a sequential phase (one
//! request at a time: p50/p99 latency), then a throughput phase (64 requests in flight for
//! a fixed time, after a short warm-up). Ratios compare a variant with its baseline
//! (`client_bare` for client variants, `server_bare` for server ones) in the same round; the
//! median over rounds is printed, so a noisy neighbour slowing one round does not skew the
//! result.
//!
//! stdout: one line per variant, then a summary:
//!
//! ```text
//! variant=<name> rps=<n> p50_us=<x> p99_us=<y> ratio_rps=<r>
//! summary: client_stack ratio_rps=<r> server_layer ratio_rps=<r>
//! ```
//!
//! stderr: progress and diagnostics: per round and variant, then per variant the median
//! p50 ratio, the CPU time per request of the server and client threads (from
//! `/proc/self/task/*/schedstat`; on loopback the kernel's delivery of a segment is charged
//! to the sender) and their ratios to the baseline, and the peak RSS.
//!
//! Settings (environment): `LOOPBACK_ROUNDS` (default 5), `LOOPBACK_SECS` (throughput
//! phase per variant and round, default 1.0, or 0.5 at the defaults), `LOOPBACK_SEQ` (sequential requests per
//! variant and round, default 500), `LOOPBACK_CONCURRENCY` (default 64),
//! `LOOPBACK_VARIANTS` (a comma-separated subset, with their baselines; prefix `=` for
//! exactly that subset), `LOOPBACK_TOPOLOGY=shared` (one two-worker runtime for both sides).

mod common;

use common::{json_body, key_header};

use std::future::Future;
use std::hint::black_box;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::header::CONTENT_TYPE;
use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, Uri};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::runtime::Runtime;
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::{IdempotencyStore, MemoryStore};
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::ProviderKeys;
use tower_idempotency::{FrozenRetryLayer, KeyHeader, OperationId};

const BODY_LEN: usize = 1024;
const SERVER_THREAD: &str = "lb-server";
const CLIENT_THREAD: &str = "lb-client";

type HttpClient = Client<HttpConnector, Full<Bytes>>;

struct Settings {
    rounds: usize,
    throughput_for: Duration,
    warm_up: Duration,
    sequential: usize,
    concurrency: usize,
}

impl Settings {
    fn from_env() -> Self {
        fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
            std::env::var(name)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(default)
        }
        Self {
            rounds: env("LOOPBACK_ROUNDS", 5usize).max(1),
            // At the defaults the stores keep every record for its protected window: a
            // shorter phase keeps a run inside their budget (see the module docs).
            throughput_for: Duration::from_secs_f64(env(
                "LOOPBACK_SECS",
                if at_defaults() { 0.5 } else { 1.0 },
            )),
            warm_up: Duration::from_millis(150),
            sequential: env("LOOPBACK_SEQ", 500usize).max(10),
            concurrency: env("LOOPBACK_CONCURRENCY", 64usize).max(1),
        }
    }
}

// --- Requests --------------------------------------------------------------------------

/// Distinct operation ids and keys for fresh requests, across every variant and round.
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// What a variant puts on its requests beyond the common `POST` with a 1 KiB body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Marking {
    /// Nothing.
    Plain,
    /// A new `OperationId` (the client layer derives the key).
    FreshOperation,
    /// A new `Idempotency-Key` header.
    FreshKey,
    /// The same `Idempotency-Key` header every time.
    FixedKey,
}

#[derive(Clone)]
struct Template {
    uri: Uri,
    body: Bytes,
    marking: Marking,
}

/// Whether the layers run with every setting at its default (`LOOPBACK_DEFAULTS=1`).
fn at_defaults() -> bool {
    // Read once: every request asks, and an environment lookup per request would be the
    // bench's own cost in every variant.
    static AT_DEFAULTS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AT_DEFAULTS.get_or_init(|| std::env::var("LOOPBACK_DEFAULTS").is_ok_and(|v| v == "1"))
}

/// The client layer of the `client_stack_copied` variant (stacked by hand, a layer in between).
fn client_layer(
    store: impl IdempotencyStore,
) -> tower_idempotency::IdempotencyLayer<tower_idempotency::client::ClientFace> {
    if at_defaults() {
        tower_idempotency::IdempotencyLayer::client(
            store,
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        )
    } else {
        common::client_layer(store)
    }
}

/// The client stack of the `client_stack` variant, as the README builds it (`build_stack()`).
fn client_stack(store: impl IdempotencyStore) -> tower_idempotency::client::ClientStack {
    if at_defaults() {
        tower_idempotency::IdempotencyLayer::client_builder(store)
            .provider_deduplicates(true)
            .key_header(KeyHeader::ietf())
            .build_stack()
            .expect("the defaults are valid")
    } else {
        common::client_stack(store)
    }
}

impl Template {
    fn new(addr: SocketAddr, body: &Bytes, marking: Marking) -> Self {
        Self {
            uri: format!("http://{addr}/charges").parse().expect("a URI"),
            body: body.clone(),
            marking,
        }
    }

    fn request(&self) -> Request<Full<Bytes>> {
        let mut req = Request::new(Full::new(self.body.clone()));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = self.uri.clone();
        req.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        if at_defaults() {
            // The default server scope: the caller's credential.
            req.headers_mut().insert(
                http::header::AUTHORIZATION,
                HeaderValue::from_static("Bearer sk_loopback"),
            );
        }
        match self.marking {
            Marking::Plain => {}
            Marking::FreshOperation => {
                req.extensions_mut()
                    .insert(OperationId::new("loopback", next_id().to_string()));
            }
            Marking::FreshKey => {
                req.headers_mut()
                    .insert("idempotency-key", key_header(next_id()));
            }
            Marking::FixedKey => {
                req.headers_mut()
                    .insert("idempotency-key", key_header(u64::MAX));
            }
        }
        req
    }
}

/// A response body whose data frames are copied into allocations of their own.
///
/// Diagnostic only (variant `client_stack_copied`): hyper hands out body chunks as slices of
/// its connection's read buffer, and a recorded response keeps that whole buffer alive,
/// so the connection allocates a new one for the next response. Copying the (small) body
/// before the client layer records it shows what that costs.
struct Copied<B>(B);

impl<B> Body for Copied<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, B::Error>>> {
        std::pin::Pin::new(&mut self.0)
            .poll_frame(cx)
            .map(|frame| frame.map(|f| f.map(|f| f.map_data(|d| Bytes::copy_from_slice(&d)))))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.0.size_hint()
    }
}

// --- Stores in their steady state ----------------------------------------------------

/// What a prefilled record looks like.
#[derive(Clone, Copy)]
enum RecordKind {
    /// Client side: a frozen 1 KiB request, and a response body sliced from an 8 KiB
    /// buffer, as hyper hands response bodies to the client layer.
    Client,
    /// Server side: no frozen request, a small response of its own.
    Server,
}

/// Fill `store` with completed operations until it weighs its default cap (64 MiB), so that
/// the measurement runs in the steady state of a long-running process: every new operation
/// evicts an old one, and memory is recycled rather than freshly faulted in. Returns how many
/// records it took.
async fn fill_to_cap(store: &MemoryStore, kind: RecordKind) -> u64 {
    use tower_idempotency::ledger::{Begin, BeginRequest, LedgerKey, Outcome, StoredResponse};
    const CAP: u64 = 64 * 1024 * 1024;
    const LEASE: Duration = Duration::from_secs(60);
    const RETENTION: Duration = Duration::from_secs(24 * 3600);
    let uri: Uri = "http://127.0.0.1/charges".parse().expect("uri");
    let mut filled = 0u64;
    // moka keeps the weight at or under the cap: 98 % of it is full.
    while store.weighted_size() < CAP / 50 * 49 && filled < 2_000_000 {
        for _ in 0..10_000 {
            let mut key = [0xf1; 32];
            key[..8].copy_from_slice(&filled.to_le_bytes());
            key[8..16].copy_from_slice(&filled.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
            let key = LedgerKey::from_bytes(key);
            let mut body = json_body(BODY_LEN).to_vec();
            body[..8].copy_from_slice(&filled.to_le_bytes());
            let frozen = tower_idempotency::FrozenRequest::from_parts(
                Method::POST,
                uri.clone(),
                http::Version::HTTP_11,
                http::HeaderMap::new(),
                Bytes::from(body),
            );
            let text = format!(r#"{{"id":"ch_{filled}","status":"succeeded"}}"#);
            let (request, response_body) = match kind {
                RecordKind::Client => {
                    let mut buf = bytes::BytesMut::with_capacity(8 * 1024);
                    buf.extend_from_slice(text.as_bytes());
                    let request = BeginRequest::new(key, frozen.fingerprint(), LEASE, RETENTION)
                        .with_protected_window(Duration::ZERO)
                        .with_frozen(frozen);
                    (request, buf.split().freeze())
                }
                RecordKind::Server => (
                    BeginRequest::new(key, frozen.fingerprint(), LEASE, RETENTION)
                        .with_protected_window(Duration::ZERO),
                    Bytes::from(text.into_bytes()),
                ),
            };
            let mut headers = http::HeaderMap::new();
            headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
            let outcome = Outcome::Response(StoredResponse::new(
                StatusCode::CREATED,
                http::Version::HTTP_11,
                headers,
                response_body,
            ));
            if let Ok(Begin::Acquired { token }) = store.begin(request).await {
                let _ = store.complete(key, token, outcome, RETENTION).await;
            }
            filled += 1;
        }
        store.run_pending_tasks().await;
    }
    filled
}

// --- Servers ---------------------------------------------------------------------------

async fn charge(
    body: Bytes,
) -> (
    StatusCode,
    [(http::HeaderName, &'static str); 1],
    &'static str,
) {
    black_box(body.len());
    (
        StatusCode::CREATED,
        [(CONTENT_TYPE, "application/json")],
        r#"{"id":"ch_1","status":"succeeded"}"#,
    )
}

fn bare_app() -> Router {
    Router::new().route("/charges", post(charge))
}

fn layered_app(store: impl IdempotencyStore) -> Router {
    let layer = if at_defaults() {
        tower_idempotency::IdempotencyLayer::server(store)
    } else {
        common::server_layer(store)
    };
    Router::new().route("/charges", post(charge)).layer(layer)
}

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind a loopback port");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(async move {
        axum::serve(listener, app).await.expect("serve");
    });
    addr
}

// --- One measurement -------------------------------------------------------------------

#[derive(Clone, Copy, Debug, Default)]
struct Sample {
    rps: f64,
    p50_us: f64,
    p99_us: f64,
    server_cpu_us: f64,
    client_cpu_us: f64,
    errors: u64,
}

/// Send `req` through `svc`, read the whole response; `false` unless it was a `201`.
async fn exchange<S, B>(svc: &mut S, req: Request<Full<Bytes>>) -> bool
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>>,
    S::Error: std::fmt::Display,
    B: Body,
{
    let response = match svc.ready().await {
        Ok(ready) => ready.call(req).await,
        Err(err) => Err(err),
    };
    match response {
        Ok(response) => {
            let created = response.status() == StatusCode::CREATED;
            let read = response.into_body().collect().await.is_ok();
            created && read
        }
        Err(err) => {
            eprintln!("request failed: {err}");
            false
        }
    }
}

/// CPU time (ns) of this process's threads whose name starts with `prefix`.
fn thread_cpu_ns(prefix: &str) -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|task| {
            let comm = std::fs::read_to_string(task.path().join("comm")).ok()?;
            if !comm.starts_with(prefix) {
                return None;
            }
            let stat = std::fs::read_to_string(task.path().join("schedstat")).ok()?;
            stat.split_whitespace().next()?.parse::<u64>().ok()
        })
        .sum()
}

async fn measure<S, B>(svc: S, template: Template, settings: Arc<Settings>) -> Sample
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Display + Send,
    B: Body + Send,
    B::Data: Send,
    B::Error: Send,
{
    let mut errors = 0;

    // Sequential: latency.
    let mut one = svc.clone();
    for _ in 0..settings.sequential / 10 {
        exchange(&mut one, template.request()).await;
    }
    let mut latencies = Vec::with_capacity(settings.sequential);
    for _ in 0..settings.sequential {
        let req = template.request();
        let start = Instant::now();
        if !exchange(&mut one, req).await {
            errors += 1;
        }
        latencies.push(start.elapsed());
    }
    latencies.sort_unstable();
    let percentile = |p: f64| {
        let index = ((latencies.len() as f64 * p).ceil() as usize).clamp(1, latencies.len()) - 1;
        latencies[index].as_secs_f64() * 1e6
    };

    // Concurrent: throughput. Completions count between the end of the warm-up and the
    // deadline; CPU time is read over the same window.
    let started = Instant::now();
    let window_start = started + settings.warm_up;
    let window_end = window_start + settings.throughput_for;
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..settings.concurrency {
        let mut svc = svc.clone();
        let template = template.clone();
        let (done, failed) = (done.clone(), failed.clone());
        tasks.spawn(async move {
            loop {
                let ok = exchange(&mut svc, template.request()).await;
                let now = Instant::now();
                if now >= window_end {
                    break;
                }
                if now >= window_start {
                    done.fetch_add(1, Ordering::Relaxed);
                    if !ok {
                        failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        });
    }
    tokio::time::sleep_until(window_start.into()).await;
    let (server0, client0) = (thread_cpu_ns(SERVER_THREAD), thread_cpu_ns(CLIENT_THREAD));
    tokio::time::sleep_until(window_end.into()).await;
    let (server1, client1) = (thread_cpu_ns(SERVER_THREAD), thread_cpu_ns(CLIENT_THREAD));
    while tasks.join_next().await.is_some() {}
    let completed = done.load(Ordering::Relaxed).max(1);
    errors += failed.load(Ordering::Relaxed);
    Sample {
        rps: completed as f64 / settings.throughput_for.as_secs_f64(),
        p50_us: percentile(0.50),
        p99_us: percentile(0.99),
        server_cpu_us: (server1 - server0) as f64 / 1e3 / completed as f64,
        client_cpu_us: (client1 - client0) as f64 / 1e3 / completed as f64,
        errors,
    }
}

// --- Variants --------------------------------------------------------------------------

type Measurement = std::pin::Pin<Box<dyn Future<Output = Sample> + Send>>;
type Runner = Box<dyn Fn(Arc<Settings>) -> Measurement>;

struct Variant {
    name: &'static str,
    /// This variant's baseline.
    baseline_name: &'static str,
    /// Index of the baseline in the variant list.
    baseline: usize,
    run: Runner,
    samples: Vec<Sample>,
}

fn variant<S, B>(name: &'static str, baseline: &'static str, svc: S, template: Template) -> Variant
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Display + Send,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Send,
{
    Variant {
        name,
        baseline_name: baseline,
        baseline: usize::MAX,
        run: Box::new(move |settings| Box::pin(measure(svc.clone(), template.clone(), settings))),
        samples: Vec::new(),
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n % 2 == 1 {
        values[n / 2]
    } else {
        (values[n / 2 - 1] + values[n / 2]) / 2.0
    }
}

fn runtime(name: &'static str) -> Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name(name)
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

#[cfg(feature = "redis")]
async fn redis_stores(url: &str) -> Option<(impl IdempotencyStore, impl IdempotencyStore)> {
    use tower_idempotency::ledger::RedisStore;
    let prefix = format!("loopback-bench:{}:{}:", std::process::id(), fastrand_seed());
    let connect = |side: &str| {
        RedisStore::builder(url)
            .prefix(format!("{prefix}{side}:"))
            .connect()
    };
    match (connect("client").await, connect("server").await) {
        (Ok(client), Ok(server)) => Some((client, server)),
        (Err(err), _) | (_, Err(err)) => {
            eprintln!("NOTICE: REDIS_URL is set but Redis is unusable ({err}); skipping the Redis variants");
            None
        }
    }
}

#[cfg(feature = "redis")]
fn fastrand_seed() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

fn main() {
    let settings = Arc::new(Settings::from_env());
    let started = Instant::now();
    // `LOOPBACK_TOPOLOGY=shared`: one runtime with two workers for both sides (CPU time
    // per side is then not reported) instead of one worker per side.
    let shared = std::env::var("LOOPBACK_TOPOLOGY").is_ok_and(|t| t == "shared");
    let (server_rt, client_rt) = if shared {
        let both = Arc::new(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("lb-shared")
                .enable_all()
                .build()
                .expect("a tokio runtime"),
        );
        (both.clone(), both)
    } else {
        (
            Arc::new(runtime(SERVER_THREAD)),
            Arc::new(runtime(CLIENT_THREAD)),
        )
    };
    let body = json_body(BODY_LEN);
    let redis_url = std::env::var("REDIS_URL").ok().filter(|u| !u.is_empty());

    #[cfg(feature = "redis")]
    let redis = redis_url
        .as_deref()
        .and_then(|url| server_rt.block_on(redis_stores(url)));
    #[cfg(not(feature = "redis"))]
    if redis_url.is_some() {
        eprintln!("NOTICE: REDIS_URL is set but this build lacks `--features redis`; skipping the Redis variants");
    }

    // Both MemoryStores start full (see `fill_to_cap`); `LOOPBACK_EMPTY_STORES=1` starts
    // them empty instead (the first minute of a process).
    let server_store = MemoryStore::new();
    let client_store = MemoryStore::new();
    let client_copied_store = MemoryStore::new();
    let client_floor_store = MemoryStore::new();
    if !at_defaults() && std::env::var("LOOPBACK_EMPTY_STORES").map_or(true, |v| v != "1") {
        let filling = Instant::now();
        // Each store is filled on the worker thread that will use it, not on this one: a
        // record allocated here lives in this thread's malloc arena, and evicting it later
        // from a worker frees it across arenas while that worker's own arena keeps growing
        // for the new records (an `mprotect` per request, charged to the layers).
        let on_worker = |rt: &Runtime, store: &MemoryStore, kind| {
            let store = store.clone();
            rt.block_on(rt.spawn(async move { fill_to_cap(&store, kind).await }))
                .expect("filling a store")
        };
        let s = on_worker(&server_rt, &server_store, RecordKind::Server);
        let c = on_worker(&client_rt, &client_store, RecordKind::Client);
        let cc = on_worker(&client_rt, &client_copied_store, RecordKind::Client);
        let cf = on_worker(&client_rt, &client_floor_store, RecordKind::Client);
        eprintln!(
            "loopback_bench: stores filled to their cap in {:.1?} (server {s}, client {c}, client_copied {cc}, client_floor {cf} records)",
            filling.elapsed()
        );
    }
    let (bare_addr, layer_addr) = server_rt.block_on(async {
        (
            serve(bare_app()).await,
            serve(layered_app(server_store.clone())).await,
        )
    });
    #[cfg(feature = "redis")]
    let (redis, redis_addr) = match redis {
        Some((client_store, server_store)) => {
            let addr = server_rt.block_on(serve(layered_app(server_store)));
            (Some(client_store), Some(addr))
        }
        None => (None, None),
    };

    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let http: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(settings.concurrency * 2)
        .build(connector);
    let retry = || FrozenRetryLayer::new(RetryPolicy::default());

    let mut variants = vec![
        variant(
            "client_bare",
            "client_bare",
            http.clone(),
            Template::new(bare_addr, &body, Marking::Plain),
        ),
        variant(
            "client_frozen_retry",
            "client_bare",
            ServiceBuilder::new().layer(retry()).service(http.clone()),
            Template::new(bare_addr, &body, Marking::Plain),
        ),
        variant(
            "client_stack",
            "client_bare",
            ServiceBuilder::new()
                .layer(client_stack(client_store.clone()))
                .service(http.clone()),
            Template::new(bare_addr, &body, Marking::FreshOperation),
        ),
        variant(
            "client_stack_copied",
            "client_bare",
            ServiceBuilder::new()
                .layer(client_layer(client_copied_store.clone()))
                .layer(retry())
                .map_response(|r: Response<hyper::body::Incoming>| r.map(Copied))
                .service(http.clone()),
            Template::new(bare_addr, &body, Marking::FreshOperation),
        ),
        variant(
            "client_floor",
            "client_bare",
            common::floor::FloorService {
                inner: http.clone(),
                store: client_floor_store.clone(),
            },
            Template::new(bare_addr, &body, Marking::FreshOperation),
        ),
        variant(
            "server_bare",
            "server_bare",
            http.clone(),
            Template::new(bare_addr, &body, Marking::FreshKey),
        ),
        variant(
            "server_layer",
            "server_bare",
            http.clone(),
            Template::new(layer_addr, &body, Marking::FreshKey),
        ),
        variant(
            "server_layer_replay",
            "server_bare",
            http.clone(),
            Template::new(layer_addr, &body, Marking::FixedKey),
        ),
    ];
    #[cfg(feature = "redis")]
    if let (Some(store), Some(addr)) = (redis, redis_addr) {
        variants.push(variant(
            "client_stack_redis",
            "client_bare",
            ServiceBuilder::new()
                .layer(client_layer(store))
                .layer(retry())
                .service(http.clone()),
            Template::new(bare_addr, &body, Marking::FreshOperation),
        ));
        variants.push(variant(
            "server_layer_redis",
            "server_bare",
            http.clone(),
            Template::new(addr, &body, Marking::FreshKey),
        ));
    }

    // `LOOPBACK_VARIANTS=a,b`: only these and their baselines; `=a,b`: only these (their
    // ratios are then to themselves), e.g. to profile one.
    if let Ok(only) = std::env::var("LOOPBACK_VARIANTS") {
        let strict = only.starts_with('=');
        let wanted: Vec<&str> = only
            .trim_start_matches('=')
            .split(',')
            .map(str::trim)
            .collect();
        let baselines: Vec<&str> = variants
            .iter()
            .filter(|v| wanted.contains(&v.name))
            .map(|v| v.baseline_name)
            .collect();
        variants.retain(|v| wanted.contains(&v.name) || (!strict && baselines.contains(&v.name)));
    }
    for i in 0..variants.len() {
        let baseline = variants[i].baseline_name;
        variants[i].baseline = variants
            .iter()
            .position(|v| v.name == baseline)
            .unwrap_or(i);
    }
    eprintln!(
        "loopback_bench: {} variants x {} rounds; sequential {} requests, then {} in flight for {:?}; machine: {} cores, {}",
        variants.len(),
        settings.rounds,
        settings.sequential,
        settings.concurrency,
        settings.throughput_for,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpu_model()
    );
    for round in 0..settings.rounds {
        let n = variants.len();
        for offset in 0..n {
            let index = (round + offset) % n;
            let sample = client_rt.block_on((variants[index].run)(settings.clone()));
            eprintln!(
                "round {round} {:<20} rps={:>7.0} p50_us={:>6.1} p99_us={:>6.1} server_cpu_us={:>5.1} client_cpu_us={:>5.1}{}",
                variants[index].name,
                sample.rps,
                sample.p50_us,
                sample.p99_us,
                sample.server_cpu_us,
                sample.client_cpu_us,
                if sample.errors > 0 { format!(" ERRORS={}", sample.errors) } else { String::new() }
            );
            variants[index].samples.push(sample);
        }
    }

    let ratio = |v: &Variant, f: fn(&Sample) -> f64| {
        let base = &variants[v.baseline].samples;
        median(
            v.samples
                .iter()
                .zip(base)
                .map(|(s, b)| f(s) / f(b))
                .collect(),
        )
    };
    let mut summary = (f64::NAN, f64::NAN);
    for v in &variants {
        let rps = median(v.samples.iter().map(|s| s.rps).collect());
        let p50 = median(v.samples.iter().map(|s| s.p50_us).collect());
        let p99 = median(v.samples.iter().map(|s| s.p99_us).collect());
        let ratio_rps = ratio(v, |s| s.rps);
        println!(
            "variant={} rps={rps:.0} p50_us={p50:.1} p99_us={p99:.1} ratio_rps={ratio_rps:.3}",
            v.name
        );
        eprintln!(
            "detail: variant={} ratio_p50={:.3} server_cpu_us={:.1} client_cpu_us={:.1} cpu_ratio_server={:.3} cpu_ratio_client={:.3} errors={}",
            v.name,
            ratio(v, |s| s.p50_us),
            median(v.samples.iter().map(|s| s.server_cpu_us).collect()),
            median(v.samples.iter().map(|s| s.client_cpu_us).collect()),
            ratio(v, |s| s.server_cpu_us),
            ratio(v, |s| s.client_cpu_us),
            v.samples.iter().map(|s| s.errors).sum::<u64>()
        );
        match v.name {
            "client_stack" => summary.0 = ratio_rps,
            "server_layer" => summary.1 = ratio_rps,
            _ => {}
        }
    }
    println!(
        "summary: client_stack ratio_rps={:.3} server_layer ratio_rps={:.3}",
        summary.0, summary.1
    );
    for v in &variants {
        let failed: u64 = v.samples.iter().map(|s| s.errors).sum();
        if failed > 0 {
            eprintln!(
                "WARNING: {} had {failed} failed requests: its figures count them (a store at \
                 its defaults refuses new operations once full; run shorter with LOOPBACK_SECS \
                 or LOOPBACK_ROUNDS)",
                v.name
            );
        }
    }
    eprintln!(
        "loopback_bench: done in {:.1?}; peak RSS {} MiB",
        started.elapsed(),
        peak_rss_kib() / 1024
    );
    for rt in [client_rt, server_rt] {
        if let Ok(rt) = Arc::try_unwrap(rt) {
            rt.shutdown_background();
        }
    }
}

/// `VmHWM`: the peak resident set of this process.
fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kib| kib.parse().ok())
        })
        .unwrap_or(0)
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".into())
}
