//! Side by side on loopback: one axum handler, bare and behind three idempotency layers.
//!
//! ```text
//! cd bench-peers && cargo run --release --ignore-rust-version
//! ```
//!
//! | variant | server |
//! |---|---|
//! | `bare` | the handler alone |
//! | `tower-idempotency` | our server `IdempotencyLayer` at its defaults, as the README wires it: `IdempotencyLayer::server(MemoryStore::new())` (keys scoped by the `Authorization` every request carries) |
//! | `idempotent` | `idempotent` 2: `middleware::IdempotencyLayer` over its `memory::MemoryStore` |
//! | `axum-idempotent` | `axum-idempotent` 0.6: `IdempotentLayer` in `Idempotency-Key` mode, inside ruts' `SessionLayer` (`MokaStore`) and tower-cookies' `CookieManagerLayer` |
//!
//! The handler (`POST /charges`) reads the 1 KiB JSON body, counts its runs, and answers `201`
//! with a small JSON body. The server runs on its own one-thread tokio runtime (thread
//! `pb-server`), the hyper-util client on another (`pb-client`): two cores, one per side.
//!
//! Each round measures every (variant, phase) once, in a rotated order:
//! - `fresh`: a new `Idempotency-Key` per request, 64 requests in flight for a fixed time;
//! - `replay`: the same, with one fixed key (after its first run every request is a replay).
//!
//! For each, requests/s and the server thread's CPU time per request (from
//! `/proc/self/task/<tid>/schedstat`, read at the start and end of the measured window, as
//! `benches/loopback_bench.rs` does). Ratios and deltas compare a variant with `bare` in the
//! same round and phase; the table prints medians over rounds.
//!
//! Then the duplicates probe: per variant, 64 requests with the same key and body, each on a
//! connection of its own, released together; how many times the handler ran, and the status
//! codes seen. Once with an instant handler, once with a handler that takes
//! `PEERS_PROBE_DELAY_MS` (the duplicates then arrive while the first is still running).
//!
//! Settings (environment): `PEERS_ROUNDS` (default 3), `PEERS_SECS` (measured window per
//! phase, default 1.0), `PEERS_CONCURRENCY` (default 64), `PEERS_PROBE_DELAY_MS` (default 100),
//! `PEERS_VARIANTS` (a comma-separated subset of `tower-idempotency`, `idempotent`,
//! `axum-idempotent`; `bare`, the baseline, always runs).
//!
//! stdout: the tables. stderr: progress, per-round samples and the sanity checks.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::State;
use axum::http::header::{CONTENT_TYPE, COOKIE, SET_COOKIE};
use axum::http::{HeaderValue, Method, Request, StatusCode, Uri};
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::runtime::Runtime;

const BODY_LEN: usize = 1024;
const SERVER_THREAD: &str = "pb-server";
const CLIENT_THREAD: &str = "pb-client";
/// The duplicates probe's size (the brief's 64, whatever `PEERS_CONCURRENCY` says).
const PROBE_DUPLICATES: usize = 64;

type HttpClient = Client<HttpConnector, Full<Bytes>>;

struct Settings {
    rounds: usize,
    window: Duration,
    warm_up: Duration,
    concurrency: usize,
    probe_delay: Duration,
    /// The variants to run (`bare`, the baseline, always is).
    kinds: Vec<Kind>,
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
            rounds: env("PEERS_ROUNDS", 3usize).max(1),
            window: Duration::from_secs_f64(env("PEERS_SECS", 1.0f64).max(0.1)),
            warm_up: Duration::from_millis(200),
            concurrency: env("PEERS_CONCURRENCY", 64usize).max(1),
            probe_delay: Duration::from_millis(env("PEERS_PROBE_DELAY_MS", 100u64)),
            kinds: match std::env::var("PEERS_VARIANTS") {
                Ok(only) if !only.trim().is_empty() => {
                    let wanted: Vec<&str> = only.split(',').map(str::trim).collect();
                    KINDS
                        .into_iter()
                        .filter(|k| *k == Kind::Bare || wanted.contains(&k.id()))
                        .collect()
                }
                _ => KINDS.to_vec(),
            },
        }
    }
}

// --- The handler -----------------------------------------------------------------------

/// The handler's state: how often it ran, and how long it takes.
#[derive(Default)]
struct Charges {
    runs: AtomicUsize,
    delay: Duration,
}

async fn charge(
    State(charges): State<Arc<Charges>>,
    body: Bytes,
) -> (
    StatusCode,
    [(axum::http::HeaderName, &'static str); 1],
    &'static str,
) {
    charges.runs.fetch_add(1, Ordering::Relaxed);
    black_box(body.len());
    if !charges.delay.is_zero() {
        tokio::time::sleep(charges.delay).await;
    }
    (
        StatusCode::CREATED,
        [(CONTENT_TYPE, "application/json")],
        r#"{"id":"ch_1","status":"succeeded"}"#,
    )
}

// --- The four servers ------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Bare,
    Ours,
    Idempotent,
    AxumIdempotent,
}

const KINDS: [Kind; 4] = [
    Kind::Bare,
    Kind::Ours,
    Kind::Idempotent,
    Kind::AxumIdempotent,
];

impl Kind {
    /// As `PEERS_VARIANTS` names it.
    fn id(self) -> &'static str {
        match self {
            Kind::Bare => "bare",
            Kind::Ours => "tower-idempotency",
            Kind::Idempotent => "idempotent",
            Kind::AxumIdempotent => "axum-idempotent",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Kind::Bare => "bare",
            Kind::Ours => "tower-idempotency",
            Kind::Idempotent => "idempotent 2.0",
            Kind::AxumIdempotent => "axum-idempotent 0.6",
        }
    }
}

/// The handler's route, without a layer.
fn route(charges: &Arc<Charges>) -> Router {
    Router::new()
        .route("/charges", post(charge))
        .with_state(charges.clone())
}

/// Our server layer with every setting at its default, as the README wires it. Its store
/// protects every record for 70 s within 192 MiB, about 348,000 records: a run of the
/// default length (3 rounds of 1 s fresh phases at tens of thousands of requests a second)
/// stays inside that, so nothing is refused; a much longer run would measure `503
/// ledger-full` answers instead (the sanity checks count them as failures).
fn ours(charges: &Arc<Charges>) -> Router {
    let layer =
        tower_idempotency::IdempotencyLayer::server(tower_idempotency::ledger::MemoryStore::new());
    route(charges).layer(layer)
}

/// `idempotent` 2 as its README's "Using the middleware" section sets it up: the layer over
/// the in-memory store, default settings (key from `idempotency-key`, 60 s processing lease,
/// a day's completed lease, 1 MiB body cap). Unscoped, like ours here: one client.
///
/// Must run inside the server's runtime: the store spawns its actor task there.
fn idempotent(charges: &Arc<Charges>) -> Router {
    let store = idempotent::memory::MemoryStore::builder()
        .try_build()
        .expect("an idempotent MemoryStore");
    route(charges).layer(idempotent::middleware::IdempotencyLayer::new(store))
}

/// `axum-idempotent` 0.6 as its README sets it up: direct-key mode on the `Idempotency-Key`
/// header (required), responses cached for 5 minutes, in the session of the request: the
/// `IdempotentLayer` inside ruts' `SessionLayer` (in-memory `MokaStore`, cookie `session`)
/// inside `CookieManagerLayer`. It caches only for a request that already carries a session,
/// so `POST /session` (outside the idempotent layer) creates one, as an application's login
/// would; clients send its cookie.
fn axum_idempotent(charges: &Arc<Charges>) -> Router {
    use axum_idempotent::{IdempotentLayer, IdempotentOptions};
    use ruts::store::moka::MokaStore;
    use ruts::{CookieOptions, Session, SessionLayer};

    let store = Arc::new(MokaStore::builder().build());
    let options = IdempotentOptions::default()
        .use_idempotency_key_header(Some("Idempotency-Key"), true)
        .expire_after(60 * 5);
    route(charges)
        .layer(IdempotentLayer::<MokaStore>::new(options))
        .route(
            "/session",
            post(|session: Session<MokaStore>| async move {
                let hour = ruts::store::Ttl::new(3600).expect("a valid TTL");
                match session.set("client", &"bench-peers", hour, None).await {
                    Ok(()) => StatusCode::NO_CONTENT,
                    Err(_) => StatusCode::INTERNAL_SERVER_ERROR,
                }
            }),
        )
        .layer(SessionLayer::new(store).with_cookie_options(CookieOptions::build().name("session")))
        .layer(tower_cookies::CookieManagerLayer::new())
}

fn app(kind: Kind, charges: &Arc<Charges>) -> Router {
    match kind {
        Kind::Bare => route(charges),
        Kind::Ours => ours(charges),
        Kind::Idempotent => idempotent(charges),
        Kind::AxumIdempotent => axum_idempotent(charges),
    }
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

/// A server of `kind` on the server runtime, with its handler's state.
struct Server {
    kind: Kind,
    addr: SocketAddr,
    charges: Arc<Charges>,
    /// `axum-idempotent` only: session cookies (`session=<id>`), one per client task.
    cookies: Vec<HeaderValue>,
}

fn start(server_rt: &Runtime, kind: Kind, delay: Duration) -> Server {
    let charges = Arc::new(Charges {
        runs: AtomicUsize::new(0),
        delay,
    });
    let addr = server_rt.block_on(async { serve(app(kind, &charges)).await });
    Server {
        kind,
        addr,
        charges,
        cookies: Vec::new(),
    }
}

/// `POST /session`, and the `session=<id>` pair of the cookie it sets.
async fn new_session(http: &HttpClient, addr: SocketAddr) -> HeaderValue {
    let mut req = Request::new(Full::new(Bytes::new()));
    *req.method_mut() = Method::POST;
    *req.uri_mut() = format!("http://{addr}/session").parse().expect("a URI");
    let response = http.request(req).await.expect("POST /session");
    assert_eq!(response.status(), StatusCode::NO_CONTENT, "POST /session");
    let cookie = response
        .headers()
        .get_all(SET_COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find(|v| v.starts_with("session="))
        .and_then(|v| v.split(';').next())
        .expect("POST /session sets the session cookie")
        .to_owned();
    HeaderValue::from_str(&cookie).expect("a cookie header")
}

// --- Requests --------------------------------------------------------------------------

static NEXT_KEY: AtomicU64 = AtomicU64::new(0);

/// A UUID-sized sf-string, as clients send (the quotes are part of the IETF syntax; the peers
/// take the value as an opaque printable-ASCII key).
fn key_header(n: u64) -> HeaderValue {
    let text = format!("\"00000000-0000-4000-8000-{:012x}\"", n & 0xffff_ffff_ffff);
    HeaderValue::from_str(&text).expect("visible ASCII")
}

fn fresh_key() -> HeaderValue {
    key_header(NEXT_KEY.fetch_add(1, Ordering::Relaxed))
}

fn json_body(len: usize) -> Bytes {
    let head = br#"{"order_id":"order_42","amount_cents":1999,"summary":""#;
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(head);
    out.resize(len - 2, b'x');
    out.extend_from_slice(br#""}"#);
    Bytes::from(out)
}

fn charge_request(
    uri: &Uri,
    body: &Bytes,
    key: HeaderValue,
    cookie: Option<&HeaderValue>,
) -> Request<Full<Bytes>> {
    let mut req = Request::new(Full::new(body.clone()));
    *req.method_mut() = Method::POST;
    *req.uri_mut() = uri.clone();
    let headers = req.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert("idempotency-key", key);
    // The caller's credential: our layer's default scope (the peers ignore it).
    headers.insert(
        axum::http::header::AUTHORIZATION,
        HeaderValue::from_static("Bearer sk_peers"),
    );
    if let Some(cookie) = cookie {
        headers.insert(COOKIE, cookie.clone());
    }
    req
}

// --- One measurement -------------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Fresh,
    Replay,
}

const PHASES: [Phase; 2] = [Phase::Fresh, Phase::Replay];

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Fresh => "fresh",
            Phase::Replay => "replay",
        }
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Sample {
    rps: f64,
    server_cpu_us: f64,
    client_cpu_us: f64,
    /// Answers other than `201` (or failed exchanges) in the window.
    errors: u64,
    /// Handler runs per request in the window.
    runs_per_request: f64,
}

/// CPU time (ns) of this process's threads whose name starts with `prefix`: the first field
/// of `/proc/self/task/<tid>/schedstat` (time spent on the CPU).
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

/// `false` unless the exchange ended in a `201` with its whole body read.
async fn exchange(http: &HttpClient, req: Request<Full<Bytes>>) -> bool {
    match http.request(req).await {
        Ok(response) => {
            let created = response.status() == StatusCode::CREATED;
            created && response.into_body().collect().await.is_ok()
        }
        Err(_) => false,
    }
}

/// `concurrency` tasks send back to back; completions and CPU time count between the end of
/// the warm-up and the deadline.
async fn measure(
    http: HttpClient,
    server: (SocketAddr, Vec<HeaderValue>, Arc<Charges>),
    phase: Phase,
    body: Bytes,
    settings: Arc<Settings>,
) -> Sample {
    let (addr, cookies, charges) = server;
    let uri: Uri = format!("http://{addr}/charges").parse().expect("a URI");
    let replay_key = key_header(u64::MAX);
    let started = Instant::now();
    let window_start = started + settings.warm_up;
    let window_end = window_start + settings.window;
    let done = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..settings.concurrency {
        let http = http.clone();
        let (uri, body) = (uri.clone(), body.clone());
        let cookie = (!cookies.is_empty()).then(|| cookies[i % cookies.len()].clone());
        let replay_key = replay_key.clone();
        let (done, failed) = (done.clone(), failed.clone());
        tasks.spawn(async move {
            loop {
                let key = match phase {
                    Phase::Fresh => fresh_key(),
                    Phase::Replay => replay_key.clone(),
                };
                let ok = exchange(&http, charge_request(&uri, &body, key, cookie.as_ref())).await;
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
    let runs0 = charges.runs.load(Ordering::Relaxed);
    tokio::time::sleep_until(window_end.into()).await;
    let (server1, client1) = (thread_cpu_ns(SERVER_THREAD), thread_cpu_ns(CLIENT_THREAD));
    let runs1 = charges.runs.load(Ordering::Relaxed);
    while tasks.join_next().await.is_some() {}
    let completed = done.load(Ordering::Relaxed).max(1);
    Sample {
        rps: completed as f64 / settings.window.as_secs_f64(),
        server_cpu_us: server1.saturating_sub(server0) as f64 / 1e3 / completed as f64,
        client_cpu_us: client1.saturating_sub(client0) as f64 / 1e3 / completed as f64,
        errors: failed.load(Ordering::Relaxed),
        runs_per_request: (runs1 - runs0) as f64 / completed as f64,
    }
}

// --- The duplicates probe --------------------------------------------------------------

struct Probe {
    handler_runs: usize,
    statuses: BTreeMap<u16, usize>,
    replayed: usize,
    failed: usize,
    /// The status of one more request with the key, sent once all 64 have answered, and
    /// whether it was marked as a replay.
    after: Option<(u16, bool)>,
    handler_runs_after: usize,
}

/// Marked as a replay by one of the three layers' headers.
fn is_replay(headers: &axum::http::HeaderMap) -> bool {
    ["idempotent-replayed", "idempotency-replayed"]
        .iter()
        .any(|name| headers.contains_key(*name))
}

/// One request on a connection of its own (hyper's HTTP/1 handshake), sent at `go`.
async fn probe_one(
    addr: SocketAddr,
    req: Request<Full<Bytes>>,
    go: Arc<tokio::sync::Barrier>,
) -> Option<(u16, bool)> {
    let stream = tokio::net::TcpStream::connect(addr).await.ok();
    let handshake = match stream {
        Some(stream) => {
            let _ = stream.set_nodelay(true);
            hyper::client::conn::http1::handshake(TokioIo::new(stream))
                .await
                .ok()
        }
        None => None,
    };
    // Everyone waits for everyone, connected or not, so the 64 are released together.
    go.wait().await;
    let (mut sender, conn) = handshake?;
    tokio::spawn(conn);
    let response = sender.send_request(req).await.ok()?;
    let status = response.status().as_u16();
    let replayed = is_replay(response.headers());
    response.into_body().collect().await.ok()?;
    Some((status, replayed))
}

async fn probe(server: &Server, http: &HttpClient, body: &Bytes) -> Probe {
    let uri: Uri = format!("http://{}/charges", server.addr)
        .parse()
        .expect("a URI");
    // One client: for axum-idempotent, one session (its cache lives in the session, so
    // duplicates from different sessions would not be duplicates to it).
    let cookie = server.cookies.first();
    let key = fresh_key();
    let go = Arc::new(tokio::sync::Barrier::new(PROBE_DUPLICATES));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..PROBE_DUPLICATES {
        // On a bare connection, hyper sends the URI as given: origin-form and a `Host`
        // header, as the pooled client sends them.
        let mut req = charge_request(
            &"/charges".parse().expect("a URI"),
            body,
            key.clone(),
            cookie,
        );
        req.headers_mut().insert(
            axum::http::header::HOST,
            HeaderValue::from_str(&server.addr.to_string()).expect("a host"),
        );
        tasks.spawn(probe_one(server.addr, req, go.clone()));
    }
    let mut statuses = BTreeMap::new();
    let (mut replayed, mut failed) = (0, 0);
    while let Some(joined) = tasks.join_next().await {
        match joined.ok().flatten() {
            Some((status, was_replay)) => {
                *statuses.entry(status).or_insert(0) += 1;
                replayed += usize::from(was_replay);
            }
            None => failed += 1,
        }
    }
    let handler_runs = server.charges.runs.load(Ordering::Relaxed);
    // A retry after the dust settled: past the handler's delay, so nothing is in flight.
    tokio::time::sleep(server.charges.delay + Duration::from_millis(20)).await;
    let after = match http
        .request(charge_request(&uri, body, key.clone(), cookie))
        .await
    {
        Ok(response) => {
            let status = response.status().as_u16();
            let replayed = is_replay(response.headers());
            let _ = response.into_body().collect().await;
            Some((status, replayed))
        }
        Err(_) => None,
    };
    Probe {
        handler_runs,
        statuses,
        replayed,
        failed,
        after,
        handler_runs_after: server.charges.runs.load(Ordering::Relaxed),
    }
}

// --- Reporting -------------------------------------------------------------------------

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let n = values.len();
    if n == 0 {
        return f64::NAN;
    }
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

fn peak_rss_mib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kib| kib.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib / 1024)
}

fn main() {
    let settings = Arc::new(Settings::from_env());
    let started = Instant::now();
    let server_rt = runtime(SERVER_THREAD);
    let client_rt = runtime(CLIENT_THREAD);
    let body = json_body(BODY_LEN);

    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    let http: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(settings.concurrency * 2)
        .build(connector);

    let mut servers: Vec<Server> = settings
        .kinds
        .iter()
        .map(|&kind| start(&server_rt, kind, Duration::ZERO))
        .collect();
    for server in &mut servers {
        if server.kind == Kind::AxumIdempotent {
            // One session per client task, as 64 clients would hold.
            server.cookies = client_rt.block_on(async {
                let mut cookies = Vec::new();
                for _ in 0..settings.concurrency {
                    cookies.push(new_session(&http, server.addr).await);
                }
                cookies
            });
        }
    }

    eprintln!(
        "bench-peers: {} variants x {} phases x {} rounds; {} in flight, {:?} warm-up + {:?} measured per phase; machine: {} cores, {}",
        servers.len(),
        PHASES.len(),
        settings.rounds,
        settings.concurrency,
        settings.warm_up,
        settings.window,
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpu_model()
    );

    // samples[variant][phase][round]
    let mut samples = vec![vec![Vec::<Sample>::new(); PHASES.len()]; servers.len()];
    let units: Vec<(usize, usize)> = (0..servers.len())
        .flat_map(|v| (0..PHASES.len()).map(move |p| (v, p)))
        .collect();
    for round in 0..settings.rounds {
        for offset in 0..units.len() {
            let (v, p) = units[(round * 3 + offset) % units.len()];
            let server = &servers[v];
            let sample = client_rt.block_on(measure(
                http.clone(),
                (server.addr, server.cookies.clone(), server.charges.clone()),
                PHASES[p],
                body.clone(),
                settings.clone(),
            ));
            eprintln!(
                "round {round} {:<20} {:<6} rps={:>7.0} server_cpu_us={:>6.1} client_cpu_us={:>6.1} handler_runs/req={:.3}{}",
                server.kind.name(),
                PHASES[p].name(),
                sample.rps,
                sample.server_cpu_us,
                sample.client_cpu_us,
                sample.runs_per_request,
                if sample.errors > 0 { format!(" NON-201={}", sample.errors) } else { String::new() }
            );
            samples[v][p].push(sample);
        }
    }
    let measured = started.elapsed();

    // Probes: a fresh server per variant and handler delay, so the counts are the probe's own.
    let delays = [Duration::ZERO, settings.probe_delay];
    let mut probes = Vec::new();
    for &delay in &delays {
        for &kind in &settings.kinds {
            let mut server = start(&server_rt, kind, delay);
            if kind == Kind::AxumIdempotent {
                server.cookies = vec![client_rt.block_on(new_session(&http, server.addr))];
            }
            let result = client_rt.block_on(probe(&server, &http, &body));
            probes.push((delay, kind, result));
        }
    }

    // --- The tables ---
    println!();
    println!(
        "server CPU per request and throughput; medians over {} rounds ({:?} measured per phase, {} in flight, 1 KiB POST)",
        settings.rounds, settings.window, settings.concurrency
    );
    println!();
    println!("| variant | fresh CPU µs/req | fresh Δ vs bare | fresh rps | fresh rps ratio | replay CPU µs/req | replay Δ vs bare | replay rps | replay rps ratio |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let bare = 0;
    for (v, server) in servers.iter().enumerate() {
        let mut cells = Vec::new();
        for (own, base) in samples[v].iter().zip(&samples[bare]) {
            let cpu = median(own.iter().map(|s| s.server_cpu_us).collect());
            let delta = median(
                own.iter()
                    .zip(base)
                    .map(|(s, b)| s.server_cpu_us - b.server_cpu_us)
                    .collect(),
            );
            let rps = median(own.iter().map(|s| s.rps).collect());
            let ratio = median(own.iter().zip(base).map(|(s, b)| s.rps / b.rps).collect());
            if v == bare {
                cells.push(format!("{cpu:.1} | — | {rps:.0} | 1.000"));
            } else {
                cells.push(format!("{cpu:.1} | {delta:+.1} | {rps:.0} | {ratio:.3}"));
            }
        }
        println!("| {} | {} | {} |", server.kind.name(), cells[0], cells[1]);
    }
    println!();
    println!(
        "server CPU µs/req by round (rounds share one server per variant: each store keeps what earlier rounds wrote)"
    );
    println!();
    println!("| variant | fresh | replay |");
    println!("|---|---|---|");
    for (v, server) in servers.iter().enumerate() {
        let by_round = |p: usize| {
            samples[v][p]
                .iter()
                .map(|s| format!("{:.1}", s.server_cpu_us))
                .collect::<Vec<_>>()
                .join(" / ")
        };
        println!(
            "| {} | {} | {} |",
            server.kind.name(),
            by_round(0),
            by_round(1)
        );
    }
    println!();
    println!("sanity (medians): handler runs per request, non-201 answers, client CPU µs/req");
    for (v, server) in servers.iter().enumerate() {
        let line: Vec<String> = PHASES
            .iter()
            .enumerate()
            .map(|(p, phase)| {
                let own = &samples[v][p];
                format!(
                    "{}: runs/req={:.3} non201={} client_cpu_us={:.1}",
                    phase.name(),
                    median(own.iter().map(|s| s.runs_per_request).collect()),
                    own.iter().map(|s| s.errors).sum::<u64>(),
                    median(own.iter().map(|s| s.client_cpu_us).collect()),
                )
            })
            .collect();
        println!("  {:<20} {}", server.kind.name(), line.join("  "));
    }

    println!();
    println!(
        "{PROBE_DUPLICATES} concurrent duplicates (same key, same body, one connection each, released together)"
    );
    println!();
    println!("| variant | handler | handler runs | statuses | marked replayed | then one more | handler runs after it |");
    println!("|---|---|---:|---|---:|---|---:|");
    for (delay, kind, p) in &probes {
        let mut statuses: Vec<String> = p
            .statuses
            .iter()
            .map(|(status, n)| format!("{n}×{status}"))
            .collect();
        if p.failed > 0 {
            statuses.push(format!("{}×no answer", p.failed));
        }
        let after = match p.after {
            Some((status, true)) => format!("{status} (replay)"),
            Some((status, false)) => status.to_string(),
            None => "no answer".into(),
        };
        println!(
            "| {} | {} ms | {} | {} | {} | {} | {} |",
            kind.name(),
            delay.as_millis(),
            p.handler_runs,
            statuses.join(", "),
            p.replayed,
            after,
            p.handler_runs_after
        );
    }
    println!();
    println!(
        "bench-peers: measured in {:.1?}, total {:.1?}; peak RSS {} MiB",
        measured,
        started.elapsed(),
        peak_rss_mib()
    );
    client_rt.shutdown_background();
    server_rt.shutdown_background();
}
