//! What each layer costs per call, over a no-op inner service and a 1 KiB POST body.
//!
//! Every variant builds its request the same way (method, URI, two headers, a 1 KiB
//! `Bytes` body shared by reference count), calls the service once and reads the response
//! body, so the differences between variants are the layers' own work:
//!
//! | variant | stack |
//! |---|---|
//! | `bare` | the no-op service |
//! | `tower_retry_clone` | the hand-written way: buffer the body, `tower::retry` with a policy cloning the request per attempt |
//! | `frozen_retry` | `FrozenRetryLayer` (default policy: budget, backoff) |
//! | `frozen_retry_no_budget` | `FrozenRetryLayer` without the retry budget |
//! | `client_fresh` | client `IdempotencyLayer` (`MemoryStore`), a new `OperationId` per call |
//! | `client_replay` | client `IdempotencyLayer`, the same `OperationId` every call (replayed) |
//! | `stack_fresh` | the client stack as the README builds it (`build_stack()`: `IdempotencyLayer` over `FrozenRetryLayer` as one service), a new `OperationId` per call |
//! | `server_bare` | the no-op handler (it reads the body), with an `Idempotency-Key` header |
//! | `server_fresh` | server `IdempotencyLayer` (`MemoryStore`), a new key per call |
//! | `server_replay` | server `IdempotencyLayer`, the same key every call (replayed) |
//!
//! The stores are `MemoryStore::new()` (64 MiB): the fresh variants fill theirs within the
//! first seconds, so most of their samples run with the store evicting one record per new
//! operation, as a long-running process does.
//!
//! `components` prices pieces of the hot path alone (fingerprint, freeze, rebuilding an
//! attempt from the frozen request); `key_derivation` what a fresh client call adds before
//! the ledger: building the `OperationId` from a counter, deriving its key, its header value.
//!
//! Run: `cargo bench --bench layers` (about a minute).

mod common;

use common::{handler, next_id, runtime, BufferBody, CloneAttempts, Noop, Template};

use std::hint::black_box;
use std::time::{Duration, Instant};

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, Criterion};
use http::{Method, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use tokio::runtime::Runtime;
use tower::retry::RetryLayer;
use tower::{Service, ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::{fingerprint::Fingerprint, FrozenRequest, FrozenRetryLayer, OperationId};

const BODY_LEN: usize = 1024;

// --- Driving a service ---------------------------------------------------------------

/// Time `iters` calls of `svc`, each with a request from `make` and its body read.
async fn drive<S, ResBody>(
    svc: &mut S,
    make: impl Fn() -> Request<Full<Bytes>>,
    iters: u64,
) -> Duration
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
    S::Error: std::fmt::Debug,
    ResBody: Body,
{
    let start = Instant::now();
    for _ in 0..iters {
        let req = make();
        let response = svc
            .ready()
            .await
            .expect("ready")
            .call(req)
            .await
            .expect("call");
        black_box(response.into_body().collect().await.is_ok());
    }
    start.elapsed()
}

fn bench_service<S, ResBody, M>(
    c: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    rt: &Runtime,
    name: &str,
    svc: S,
    make: M,
) where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>> + Clone,
    S::Error: std::fmt::Debug,
    ResBody: Body,
    M: Fn() -> Request<Full<Bytes>> + Clone,
{
    c.bench_function(name, |b| {
        b.to_async(rt).iter_custom(|iters| {
            let mut svc = svc.clone();
            let make = make.clone();
            async move { drive(&mut svc, make, iters).await }
        })
    });
}

fn layers(c: &mut Criterion) {
    let rt = runtime();
    let template = Template::new(BODY_LEN);
    let mut group = c.benchmark_group("layers_1KiB");

    let t = template.clone();
    bench_service(&mut group, &rt, "bare", Noop, move || t.request());

    let hand_written = ServiceBuilder::new()
        .layer_fn(|inner| BufferBody { inner })
        .layer(RetryLayer::new(CloneAttempts(3)))
        .service(Noop);
    let t = template.clone();
    bench_service(
        &mut group,
        &rt,
        "tower_retry_clone",
        hand_written,
        move || t.request(),
    );

    let frozen = ServiceBuilder::new()
        .layer(FrozenRetryLayer::new(RetryPolicy::default()))
        .service(Noop);
    let t = template.clone();
    bench_service(&mut group, &rt, "frozen_retry", frozen, move || t.request());

    let frozen = ServiceBuilder::new()
        .layer(FrozenRetryLayer::new(
            RetryPolicy::builder().no_budget().build().expect("policy"),
        ))
        .service(Noop);
    let t = template.clone();
    bench_service(
        &mut group,
        &rt,
        "frozen_retry_no_budget",
        frozen,
        move || t.request(),
    );

    let client = ServiceBuilder::new()
        .layer(common::client_layer(MemoryStore::new()))
        .service(Noop);
    let t = template.clone();
    bench_service(&mut group, &rt, "client_fresh", client.clone(), move || {
        t.fresh_operation()
    });
    let t = template.clone();
    bench_service(&mut group, &rt, "client_replay", client, move || {
        t.fixed_operation()
    });

    // As the README builds it: `build_stack()`.
    let stack = ServiceBuilder::new()
        .layer(common::client_stack(MemoryStore::new()))
        .service(Noop);
    let t = template.clone();
    bench_service(&mut group, &rt, "stack_fresh", stack, move || {
        t.fresh_operation()
    });

    let t = template.clone();
    bench_service(&mut group, &rt, "server_bare", handler(), move || {
        t.fresh_key()
    });

    let server = ServiceBuilder::new()
        .layer(common::server_layer(MemoryStore::new()))
        .service(handler());
    let t = template.clone();
    bench_service(&mut group, &rt, "server_fresh", server.clone(), move || {
        t.fresh_key()
    });
    let t = template.clone();
    bench_service(&mut group, &rt, "server_replay", server, move || {
        t.fixed_key()
    });
    group.finish();
}

/// The pieces of the hot path, alone.
fn components(c: &mut Criterion) {
    let rt = runtime();
    let template = Template::new(BODY_LEN);
    let mut group = c.benchmark_group("components");
    group.bench_function("fingerprint_1KiB", |b| {
        b.iter(|| Fingerprint::of(&Method::POST, "/charges", black_box(&template.body)))
    });
    group.bench_function("freeze_1KiB", |b| {
        b.to_async(&rt).iter(|| {
            let req = template.request();
            async move { FrozenRequest::freeze(req, 1 << 20).await.expect("freeze") }
        })
    });
    let rt2 = runtime();
    let (frozen, _) = rt2
        .block_on(FrozenRequest::freeze(template.request(), 1 << 20))
        .expect("freeze");
    group.bench_function("rebuild_attempt", |b| b.iter(|| frozen.to_request()));
    group.bench_function("build_request", |b| b.iter(|| template.request()));
    group.finish();
}

fn key_derivation(c: &mut Criterion) {
    let mut group = c.benchmark_group("key_derivation");
    group.bench_function("operation_id_from_counter", |b| {
        b.iter(|| OperationId::new("bench-task", next_id().to_string()))
    });
    let op = OperationId::new("bench-task", "12345678");
    group.bench_function("derive_key", |b| b.iter(|| black_box(&op).key("")));
    let key = op.key("");
    group.bench_function("header_value", |b| {
        b.iter(|| black_box(&key).header_value())
    });
    group.bench_function("all_three", |b| {
        b.iter(|| {
            OperationId::new("bench-task", next_id().to_string())
                .key("")
                .header_value()
        })
    });
    group.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(30)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .noise_threshold(0.03);
    targets = layers, components, key_derivation
}
criterion_main!(benches);
