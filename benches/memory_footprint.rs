//! Peak memory of a `MemoryStore` capped at 128 MiB after 1M distinct completed operations.
//!
//! ```text
//! cargo bench --bench memory_footprint            # every scenario
//! cargo bench --bench memory_footprint -- client  # one of them
//! ```
//!
//! Each scenario runs in a child process of its own, so that its peak resident set
//! (`VmHWM`) is its own. The baseline is the resident set just before the store is made
//! (runtime, request templates and, for `client_loopback`, the HTTP server already up);
//! the target is growth `<= 1.5 x` the cap.
//!
//! | scenario | operations | what each record holds |
//! |---|---|---|
//! | `client` | 1M through the client stack over a no-op service | a frozen 1 KiB request, a ~40 B response, each its own exact-size allocation |
//! | `server` | 1M through the server layer over a no-op handler | a ~40 B response (the server keeps no request) |
//! | `client_hyper_like` | 1M as `client`, the response body a slice of an 8 KiB read buffer, as hyper hands it out | as `client`; the slice keeps the whole buffer alive |
//! | `client_loopback` | 200k through the client stack over hyper-util to axum on loopback (`MEMORY_LOOPBACK_OPS`) | as `client`, the response straight from hyper |
//!
//! `MEMORY_OPS` sets another number of operations for the in-process scenarios.
//!
//! stdout: one line per scenario,
//! `memory: scenario=<name> ops=<n> cap_mib=128 baseline_mib=<b> peak_mib=<p> growth_mib=<p-b> growth_over_cap=<r> ...`.

mod common;

use std::convert::Infallible;
use std::future::{ready, Ready};
use std::hint::black_box;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Method, Request, Response, StatusCode, Uri};
use http_body::Body;
use http_body_util::Full;
use tower::{Service, ServiceBuilder};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::{FrozenRetryLayer, OperationId};

const CAP: u64 = 128 * 1024 * 1024;
const OPS: u64 = 1_000_000;
const BODY_LEN: usize = 1024;
const SCENARIOS: [&str; 4] = ["client", "server", "client_hyper_like", "client_loopback"];

fn status_kib(field: &str) -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            status
                .lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kib| kib.parse().ok())
        })
        .unwrap_or(0)
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// A request body of its own: 1 KiB of JSON with `i` in it.
fn request_body(i: u64) -> Bytes {
    let mut body = Vec::with_capacity(BODY_LEN);
    body.extend_from_slice(format!(r#"{{"order_id":"order_{i:012}","summary":""#).as_bytes());
    body.resize(BODY_LEN - 2, b'x');
    body.extend_from_slice(br#""}"#);
    Bytes::from(body)
}

fn post(uri: &Uri, i: u64) -> Request<Full<Bytes>> {
    let mut req = Request::new(Full::new(request_body(i)));
    *req.method_mut() = Method::POST;
    *req.uri_mut() = uri.clone();
    req.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    req
}

fn response_text(i: u64) -> String {
    format!(r#"{{"id":"ch_{i:012}","status":"succeeded"}}"#)
}

/// How the no-op services hand out their response body.
#[derive(Clone, Copy, Debug)]
enum ResponseAlloc {
    /// An exact-size allocation of its own.
    Exact,
    /// A slice of a fresh 8 KiB buffer, as hyper's HTTP/1 reader hands out body chunks.
    ReadBuffer,
}

#[derive(Clone, Debug)]
struct Noop {
    alloc: ResponseAlloc,
    next: Arc<AtomicU64>,
}

impl<B> Service<Request<B>> for Noop {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        drop(black_box(req));
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        let text = response_text(i);
        let body = match self.alloc {
            ResponseAlloc::Exact => Bytes::from(text.into_bytes().into_boxed_slice()),
            ResponseAlloc::ReadBuffer => {
                let head = b"HTTP/1.1 201 Created\r\ncontent-type: application/json\r\n\r\n";
                let mut buf = BytesMut::with_capacity(8 * 1024);
                buf.extend_from_slice(head);
                buf.extend_from_slice(text.as_bytes());
                let _head = buf.split_to(head.len());
                buf.split_to(text.len()).freeze()
            }
        };
        let mut response = Response::new(Full::new(body));
        *response.status_mut() = StatusCode::CREATED;
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        ready(Ok(response))
    }
}

async fn drive<S, B>(svc: &mut S, req: Request<Full<Bytes>>)
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>>,
    S::Error: std::fmt::Debug,
    B: Body,
{
    assert_eq!(common::call_once(svc, req).await, StatusCode::CREATED);
}

struct Report {
    ops: u64,
    baseline_kib: u64,
    store: MemoryStore,
    started: Instant,
}

impl Report {
    fn print(self, scenario: &str) {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        rt.block_on(self.store.run_pending_tasks());
        let peak = status_kib("VmHWM:");
        let now = status_kib("VmRSS:");
        let growth = peak.saturating_sub(self.baseline_kib);
        let over_cap = (growth * 1024) as f64 / CAP as f64;
        println!(
            "memory: scenario={scenario} ops={} cap_mib={} baseline_mib={:.1} peak_mib={:.1} growth_mib={:.1} growth_over_cap={over_cap:.2} rss_end_mib={:.1} entries={} weighted_mib={:.1} secs={:.1} target_met={}",
            self.ops,
            CAP >> 20,
            mib(self.baseline_kib),
            mib(peak),
            mib(growth),
            mib(now),
            self.store.entry_count(),
            self.store.weighted_size() as f64 / (1024.0 * 1024.0),
            self.started.elapsed().as_secs_f64(),
            if over_cap <= 1.5 { "yes" } else { "no" },
        );
    }
}

fn in_process(scenario: &str, ops: u64, alloc: ResponseAlloc, server: bool) -> Report {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let uri = Uri::from_static("http://payments.local/charges");
    let noop = Noop {
        alloc,
        next: Arc::new(AtomicU64::new(0)),
    };
    let baseline_kib = status_kib("VmRSS:");
    let store = MemoryStore::builder().max_bytes(CAP).build();
    let started = Instant::now();
    rt.block_on(async {
        if server {
            let mut svc = ServiceBuilder::new()
                .layer(common::server_layer(store.clone()))
                .service(noop);
            for i in 0..ops {
                let mut req = post(&uri, i);
                let key = HeaderValue::from_str(&format!("\"op-{i}\"")).expect("ASCII");
                req.headers_mut().insert("idempotency-key", key);
                drive(&mut svc, req).await;
            }
        } else {
            let mut svc = ServiceBuilder::new()
                .layer(common::client_layer(store.clone()))
                .layer(FrozenRetryLayer::new(RetryPolicy::default()))
                .service(noop);
            for i in 0..ops {
                let mut req = post(&uri, i);
                req.extensions_mut()
                    .insert(OperationId::new(scenario, i.to_string()));
                drive(&mut svc, req).await;
            }
        }
    });
    Report {
        ops,
        baseline_kib,
        store,
        started,
    }
}

fn loopback(ops: u64) -> Report {
    use axum::routing::post as axum_post;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let addr = server_rt.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let app = axum::Router::new().route(
            "/charges",
            axum_post(|body: Bytes| async move {
                let id: u64 = std::str::from_utf8(&body[19..31])
                    .ok()
                    .and_then(|digits| digits.parse().ok())
                    .unwrap_or(0);
                (
                    StatusCode::CREATED,
                    [(CONTENT_TYPE, "application/json")],
                    response_text(id),
                )
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    });
    let uri: Uri = format!("http://{addr}/charges").parse().expect("uri");
    let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    // Warm the connection pool so that its buffers are in the baseline.
    client_rt.block_on(async {
        let mut http = http.clone();
        drive(&mut http, post(&uri, u64::MAX / 2)).await;
    });
    let baseline_kib = status_kib("VmRSS:");
    let store = MemoryStore::builder().max_bytes(CAP).build();
    let started = Instant::now();
    let next = Arc::new(AtomicU64::new(0));
    client_rt.block_on(async {
        let svc = ServiceBuilder::new()
            .layer(common::client_layer(store.clone()))
            .layer(FrozenRetryLayer::new(RetryPolicy::default()))
            .service(http);
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..64 {
            let (mut svc, next, uri) = (svc.clone(), next.clone(), uri.clone());
            tasks.spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= ops {
                        break;
                    }
                    let mut req = post(&uri, i);
                    req.extensions_mut()
                        .insert(OperationId::new("loopback", i.to_string()));
                    drive(&mut svc, req).await;
                }
            });
        }
        while let Some(done) = tasks.join_next().await {
            done.expect("client task");
        }
    });
    client_rt.shutdown_background();
    server_rt.shutdown_background();
    Report {
        ops,
        baseline_kib,
        store,
        started,
    }
}

fn run(scenario: &str) {
    // `MEMORY_OPS`: another number of operations for the in-process scenarios.
    let ops = std::env::var("MEMORY_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(OPS);
    let report = match scenario {
        "client" => in_process(scenario, ops, ResponseAlloc::Exact, false),
        "server" => in_process(scenario, ops, ResponseAlloc::Exact, true),
        "client_hyper_like" => in_process(scenario, ops, ResponseAlloc::ReadBuffer, false),
        "client_loopback" => {
            let ops = std::env::var("MEMORY_LOOPBACK_OPS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(200_000);
            loopback(ops)
        }
        other => panic!("unknown scenario {other}; one of {SCENARIOS:?}"),
    };
    report.print(scenario);
}

fn main() {
    if let Some(scenario) = std::env::args().skip(1).find(|a| a != "--bench") {
        run(&scenario);
        return;
    }
    let me = std::env::current_exe().expect("own path");
    for scenario in SCENARIOS {
        let status = Command::new(&me)
            .arg(scenario)
            .status()
            .expect("run a scenario");
        if !status.success() {
            eprintln!("scenario {scenario} failed: {status}");
        }
    }
}
