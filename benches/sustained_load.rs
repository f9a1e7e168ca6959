//! A paced, open-loop run of fresh operations through each face with **every setting at its
//! default**, as the README wires them: does the default `MemoryStore` keep up indefinitely?
//!
//! ```text
//! cargo bench --bench sustained_load                     # both faces, side by side
//! cargo bench --bench sustained_load -- server           # one face
//! cargo bench --bench sustained_load -- both --secs 60   # a shorter run
//! ```
//!
//! - `server`: `IdempotencyLayer::server(MemoryStore::new())` over a handler answering `201`
//!   with a ~50-byte JSON body; every request a new `Idempotency-Key`, a 1 KiB JSON body and
//!   one of eight `Authorization` principals (the default scope), at `--server-rate` (default
//!   2,000/s).
//! - `client`: `IdempotencyLayer::client_builder(MemoryStore::new()).provider_deduplicates(true).key_header(KeyHeader::ietf()).build_stack()` over a transport answering
//!   the same; every request a new `OperationId` and a 1 KiB JSON body, at `--client-rate`
//!   (default 1,000/s).
//!
//! Open loop: a pacer sends its batch every 10 ms whatever the earlier requests are doing
//! (each request runs as a task of its own), as independent callers do. Each face runs on a
//! current-thread runtime in a thread of its own, so the thread's CPU time is the face's.
//! By default each face runs for twice its protected window plus 20 s, so that every record
//! of the first window has passed its protection while the load goes on.
//!
//! stdout, every 10 s per face: `sustained: face=<f> t=<s> sent=<n> ok=<n> refused=<n>
//! other=<n> records=<n> bytes=<n> bytes_per_record=<n> cpu_us_per_req=<x>
//! max_latency_ms=<x>` (counts over the 10 s; records and bytes are the store's at the end
//! of it), then one `sustained: face=<f> summary ...` line with the totals and whether the
//! face refused anything (`sustained=yes` when it did not).

use std::convert::Infallible;
use std::future::{ready, Ready};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_TYPE};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use tokio::time::{Instant, MissedTickBehavior};
use tower::{Layer, Service, ServiceExt};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::{IdempotencyLayer, KeyHeader, OperationId};

const BODY_LEN: usize = 1024;
const REPORT_EVERY: Duration = Duration::from_secs(10);
const TICK: Duration = Duration::from_millis(10);

/// A 1 KiB JSON request body with `i` in it.
fn request_body(i: u64) -> Bytes {
    let mut body = Vec::with_capacity(BODY_LEN);
    body.extend_from_slice(format!(r#"{{"order_id":"order_{i:012}","summary":""#).as_bytes());
    body.resize(BODY_LEN - 2, b'x');
    body.extend_from_slice(br#""}"#);
    Bytes::from(body)
}

/// The handler, or the transport: `201` and ~50 bytes of JSON.
#[derive(Clone, Default)]
struct Created(Arc<AtomicU64>);

impl<B> Service<Request<B>> for Created {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: Request<B>) -> Self::Future {
        let i = self.0.fetch_add(1, Ordering::Relaxed);
        let text = format!(r#"{{"id":"ch_{i:012}","status":"succeeded","amount":1}}"#);
        let mut response = Response::new(Full::new(Bytes::from(text)));
        *response.status_mut() = StatusCode::CREATED;
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        ready(Ok(response))
    }
}

/// What one 10-second window saw.
#[derive(Default)]
struct Counts {
    sent: AtomicU64,
    ok: AtomicU64,
    refused: AtomicU64,
    other: AtomicU64,
    max_latency_us: AtomicU64,
}

impl Counts {
    fn take(&self) -> [u64; 5] {
        [
            self.sent.swap(0, Ordering::Relaxed),
            self.ok.swap(0, Ordering::Relaxed),
            self.refused.swap(0, Ordering::Relaxed),
            self.other.swap(0, Ordering::Relaxed),
            self.max_latency_us.swap(0, Ordering::Relaxed),
        ]
    }
}

/// This thread's CPU time (user + system), from `/proc/thread-self/stat`, in µs.
fn thread_cpu_us() -> u64 {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
    // Fields after the command name (which may hold spaces), from field 3 on.
    let rest = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<u64> = rest
        .split_whitespace()
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    // utime and stime are fields 14 and 15: 11 and 12 here. Clock ticks of 10 ms.
    let ticks = fields.get(11).copied().unwrap_or(0) + fields.get(12).copied().unwrap_or(0);
    ticks * 10_000
}

struct Face {
    name: &'static str,
    rate: u64,
    secs: u64,
}

/// Send `face.rate` fresh operations a second through `svc` for `face.secs`, reporting
/// every 10 s.
async fn run<S, B>(
    face: Face,
    store: MemoryStore,
    svc: S,
    make: impl Fn(u64) -> Request<Full<Bytes>>,
) where
    S: Service<Request<Full<Bytes>>, Response = Response<B>> + Clone + 'static,
    S::Error: Into<tower_idempotency::BoxError>,
    S::Future: 'static,
    B: Body + 'static,
{
    let counts = Arc::new(Counts::default());
    let per_tick = face.rate * TICK.as_millis() as u64 / 1000;
    let mut ticks = tokio::time::interval(TICK);
    // Open loop: ticks missed while the thread was busy are sent at once, as callers
    // would not have waited either.
    ticks.set_missed_tick_behavior(MissedTickBehavior::Burst);
    let start = Instant::now();
    let mut next_report = start + REPORT_EVERY;
    let mut cpu_at = thread_cpu_us();
    let (mut sent_total, mut ok_total, mut refused_total, mut other_total) = (0, 0, 0, 0);
    let mut first_refusal: Option<f64> = None;
    let mut i = 0u64;
    let mut peak_bytes = 0u64;
    while start.elapsed() < Duration::from_secs(face.secs) {
        ticks.tick().await;
        for _ in 0..per_tick {
            let request = make(i);
            i += 1;
            counts.sent.fetch_add(1, Ordering::Relaxed);
            let (svc, counts) = (svc.clone(), counts.clone());
            tokio::task::spawn_local(async move {
                let sent = Instant::now();
                // The server face answers a refusal `503 ledger-full`; the client face fails
                // the call with `Error::is_ledger_full`.
                let counter = match svc.oneshot(request).await {
                    Ok(response) => {
                        let status = response.status();
                        let _ = response.into_body().collect().await;
                        match status.as_u16() {
                            200..=299 => &counts.ok,
                            503 => &counts.refused,
                            _ => &counts.other,
                        }
                    }
                    Err(err) => {
                        let err: tower_idempotency::BoxError = err.into();
                        match err.downcast_ref::<tower_idempotency::Error>() {
                            Some(err) if err.is_ledger_full() => &counts.refused,
                            _ => &counts.other,
                        }
                    }
                };
                let latency = sent.elapsed().as_micros() as u64;
                counts.max_latency_us.fetch_max(latency, Ordering::Relaxed);
                counter.fetch_add(1, Ordering::Relaxed);
            });
        }
        if Instant::now() >= next_report {
            next_report += REPORT_EVERY;
            let [sent, ok, refused, other, max_latency_us] = counts.take();
            let cpu = thread_cpu_us();
            let cpu_per_req = (cpu - cpu_at) as f64 / sent.max(1) as f64;
            cpu_at = cpu;
            let (records, bytes) = (store.entry_count(), store.weighted_size());
            peak_bytes = peak_bytes.max(bytes);
            (sent_total, ok_total, refused_total, other_total) = (
                sent_total + sent,
                ok_total + ok,
                refused_total + refused,
                other_total + other,
            );
            let t = start.elapsed().as_secs_f64();
            if refused > 0 && first_refusal.is_none() {
                first_refusal = Some(t);
            }
            println!(
                "sustained: face={} t={t:.0} sent={sent} ok={ok} refused={refused} other={other} records={records} bytes={bytes} bytes_per_record={} cpu_us_per_req={cpu_per_req:.1} max_latency_ms={:.1}",
                face.name,
                bytes / records.max(1),
                max_latency_us as f64 / 1000.0,
            );
        }
    }
    println!(
        "sustained: face={} summary rate={} secs={} sent={sent_total} ok={ok_total} refused={refused_total} other={other_total} first_refusal_s={} peak_bytes={peak_bytes} max_bytes={} sustained={}",
        face.name,
        face.rate,
        face.secs,
        first_refusal.map_or("-".to_owned(), |t| format!("{t:.0}")),
        store.max_bytes(),
        if refused_total == 0 && other_total == 0 { "yes" } else { "no" },
    );
}

/// The builders' default lease (10 s, documented on `client::Builder::lease` and
/// `server::Builder::lease`); the load runs long enough to see records age past it.
const DEFAULT_LEASE: Duration = Duration::from_secs(10);

fn server(rate: u64, secs: Option<u64>) {
    // The server builder's default protected window: the lease plus a minute.
    let window = DEFAULT_LEASE + Duration::from_secs(60);
    let face = Face {
        name: "server",
        rate,
        secs: secs.unwrap_or(2 * window.as_secs() + 20),
    };
    let principals: Vec<HeaderValue> = (0..8)
        .map(|n| HeaderValue::from_str(&format!("Bearer principal-{n}")).expect("ASCII"))
        .collect();
    let store = MemoryStore::new();
    let svc = IdempotencyLayer::server(store.clone()).layer(Created::default());
    let make = move |i: u64| {
        let mut req = Request::new(Full::new(request_body(i)));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = "/charges".parse().expect("a path");
        let headers = req.headers_mut();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert(AUTHORIZATION, principals[(i % 8) as usize].clone());
        let key = HeaderValue::from_str(&format!("\"op-{i}\"")).expect("ASCII");
        headers.insert("idempotency-key", key);
        req
    };
    on_own_runtime(run(face, store, svc, make));
}

fn client(rate: u64, secs: Option<u64>) {
    let window = RetryPolicy::default().retry_window() + DEFAULT_LEASE;
    let face = Face {
        name: "client",
        rate,
        secs: secs.unwrap_or(2 * window.as_secs() + 20),
    };
    let store = MemoryStore::new();
    let stack = IdempotencyLayer::client_builder(store.clone())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .build_stack()
        .expect("the defaults are valid");
    let svc = stack.layer(Created::default());
    let make = |i: u64| {
        let mut req = Request::new(Full::new(request_body(i)));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = "http://payments.local/charges".parse().expect("a URI");
        req.headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        req.extensions_mut()
            .insert(OperationId::new("sustained", i.to_string()));
        req
    };
    on_own_runtime(run(face, store, svc, make));
}

fn on_own_runtime(run: impl std::future::Future<Output = ()>) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    tokio::task::LocalSet::new().block_on(&rt, run);
}

fn main() {
    let mut args = std::env::args().skip(1).filter(|a| a != "--bench");
    let (mut which, mut secs) = ("both".to_owned(), None);
    let (mut server_rate, mut client_rate) = (2000, 1000);
    while let Some(arg) = args.next() {
        let mut value = || args.next().and_then(|v| v.parse().ok()).expect("a number");
        match arg.as_str() {
            "--secs" => secs = Some(value()),
            "--server-rate" => server_rate = value(),
            "--client-rate" => client_rate = value(),
            face => which = face.to_owned(),
        }
    }
    let faces: Vec<std::thread::JoinHandle<()>> = match which.as_str() {
        "server" => vec![std::thread::spawn(move || server(server_rate, secs))],
        "client" => vec![std::thread::spawn(move || client(client_rate, secs))],
        "both" => vec![
            std::thread::spawn(move || server(server_rate, secs)),
            std::thread::spawn(move || client(client_rate, secs)),
        ],
        other => panic!("unknown face {other}: server, client or both"),
    };
    for face in faces {
        face.join().expect("a face panicked");
    }
}
