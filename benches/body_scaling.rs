//! How the layers' cost grows with the body: 0 B, 1 KiB, 64 KiB, 1 MiB.
//!
//! The cost should grow linearly, with a slope of one SHA-256 pass over the body (the
//! fingerprint) and nothing else: the body is buffered once as `Bytes`, every attempt gets a
//! reference-counted clone, nothing copies it again.
//!
//! | variant | what |
//! |---|---|
//! | `sha256` | `Fingerprint::of` alone: the slope to expect |
//! | `bare` | the no-op service |
//! | `tower_retry_clone` | buffer the body, `tower::retry` cloning the request per attempt |
//! | `frozen_retry` | `FrozenRetryLayer` |
//! | `frozen_retry_chunked` | `FrozenRetryLayer`, the body arriving in 16 KiB chunks (as from a socket) |
//! | `stack_fresh` | client `IdempotencyLayer` over `FrozenRetryLayer`, a new operation per call |
//! | `server_fresh` | server `IdempotencyLayer`, a new key per call, the handler reads the body |
//!
//! This benchmark counts allocations (a counting global allocator): before measuring each
//! variant it prints, on stderr, the bytes allocated per call next to the body size, which
//! shows whether anything copied the body (`alloc_bytes >= body`) or not.
//!
//! Run: `cargo bench --bench body_scaling` (about two minutes).

mod common;

use common::{handler, next_id, runtime, BufferBody, CloneAttempts, Noop};

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::hint::black_box;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use http::header::CONTENT_TYPE;
use http::{HeaderValue, Method, Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use tokio::runtime::Runtime;
use tower::retry::RetryLayer;
use tower::{Service, ServiceBuilder};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::{fingerprint::Fingerprint, FrozenRetryLayer, OperationId};

// --- Counting allocations ----------------------------------------------------------------

struct Counting;

static ALLOCATED: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only counts bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: the caller's contract is the system allocator's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // A growing realloc may copy: count the whole new size.
        ALLOCATED.fetch_add(new_size as u64, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

// --- Requests and services ---------------------------------------------------------------

const SIZES: [usize; 4] = [0, 1024, 64 * 1024, 1024 * 1024];
const CHUNK: usize = 16 * 1024;

fn body_of(len: usize) -> Bytes {
    Bytes::from((0..len).map(|i| b'a' + (i % 26) as u8).collect::<Vec<u8>>())
}

fn post<B>(body: B) -> Request<B> {
    let mut req = Request::new(body);
    *req.method_mut() = Method::POST;
    *req.uri_mut() = Uri::from_static("http://payments.local/charges");
    req.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    req
}

/// A body delivered in `CHUNK`-sized frames (zero-copy slices of one buffer).
struct Chunks(VecDeque<Bytes>);

impl Chunks {
    fn of(body: &Bytes) -> Self {
        let mut chunks = VecDeque::new();
        let mut at = 0;
        while at < body.len() {
            let end = (at + CHUNK).min(body.len());
            chunks.push_back(body.slice(at..end));
            at = end;
        }
        Self(chunks)
    }
}

impl Body for Chunks {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.0.pop_front().map(|chunk| Ok(Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        // As a socket body without Content-Length: nothing known in advance.
        SizeHint::default()
    }
}

// --- Driving -----------------------------------------------------------------------------

/// Bytes allocated per call, averaged over a few calls after a warm-up.
fn allocated_per_call<S, B, ResBody, M>(rt: &Runtime, svc: &S, make: &M) -> u64
where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone,
    S::Error: std::fmt::Debug,
    ResBody: Body,
    M: Fn() -> Request<B>,
{
    const CALLS: u64 = 20;
    let mut svc = svc.clone();
    rt.block_on(async {
        for _ in 0..3 {
            common::call_once(&mut svc, make()).await;
        }
        let before = ALLOCATED.load(Ordering::Relaxed);
        for _ in 0..CALLS {
            common::call_once(&mut svc, make()).await;
        }
        (ALLOCATED.load(Ordering::Relaxed) - before) / CALLS
    })
}

fn bench<S, B, ResBody, M>(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    rt: &Runtime,
    name: &str,
    size: usize,
    svc: S,
    make: M,
) where
    S: Service<Request<B>, Response = Response<ResBody>> + Clone,
    S::Error: std::fmt::Debug,
    ResBody: Body,
    M: Fn() -> Request<B> + Clone,
{
    let per_call = allocated_per_call(rt, &svc, &make);
    eprintln!("alloc: variant={name} body={size} alloc_bytes_per_call={per_call}");
    group.bench_with_input(BenchmarkId::new(name, size), &size, |b, _| {
        b.to_async(rt).iter_custom(|iters| {
            let mut svc = svc.clone();
            let make = make.clone();
            async move {
                let start = Instant::now();
                for _ in 0..iters {
                    common::call_once(&mut svc, make()).await;
                }
                start.elapsed()
            }
        })
    });
}

fn body_scaling(c: &mut Criterion) {
    let rt = runtime();
    let mut group = c.benchmark_group("body_scaling");
    for size in SIZES {
        let body = body_of(size);

        group.bench_with_input(BenchmarkId::new("sha256", size), &body, |b, body| {
            b.iter(|| Fingerprint::of(&Method::POST, "/charges", black_box(body)))
        });

        let plain = {
            let body = body.clone();
            move || post(Full::new(body.clone()))
        };
        let chunked = {
            let body = body.clone();
            move || post(Chunks::of(&body))
        };
        let fresh_operation = {
            let body = body.clone();
            move || {
                let mut req = post(Full::new(body.clone()));
                req.extensions_mut()
                    .insert(OperationId::new("bench", next_id().to_string()));
                req
            }
        };
        let fresh_key = {
            let body = body.clone();
            move || {
                let mut req = post(Full::new(body.clone()));
                let key = format!("\"bench-{}\"", next_id());
                req.headers_mut().insert(
                    "idempotency-key",
                    HeaderValue::from_str(&key).expect("visible ASCII"),
                );
                req
            }
        };

        bench(&mut group, &rt, "bare", size, Noop, plain.clone());
        let hand_written = ServiceBuilder::new()
            .layer_fn(|inner| BufferBody { inner })
            .layer(RetryLayer::new(CloneAttempts(3)))
            .service(Noop);
        bench(
            &mut group,
            &rt,
            "tower_retry_clone",
            size,
            hand_written,
            plain.clone(),
        );
        let frozen = ServiceBuilder::new()
            .layer(FrozenRetryLayer::new(RetryPolicy::default()))
            .service(Noop);
        bench(&mut group, &rt, "frozen_retry", size, frozen.clone(), plain);
        bench(
            &mut group,
            &rt,
            "frozen_retry_chunked",
            size,
            frozen,
            chunked,
        );
        let stack = ServiceBuilder::new()
            .layer(common::client_layer(MemoryStore::new()))
            .layer(FrozenRetryLayer::new(RetryPolicy::default()))
            .service(Noop);
        bench(&mut group, &rt, "stack_fresh", size, stack, fresh_operation);
        let server = ServiceBuilder::new()
            .layer(common::server_layer(MemoryStore::new()))
            .service(handler());
        bench(&mut group, &rt, "server_fresh", size, server, fresh_key);
    }
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(15)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_millis(1500))
        .noise_threshold(0.03);
    targets = body_scaling
}
criterion_main!(benches);
