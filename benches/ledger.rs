//! The ledger's own cost: `begin` + `complete` of a new operation, and the `begin` of a
//! completed one (a replay), against stores holding 1k, 100k and 1M live records.
//!
//! `MemoryStore`: each store is capped at (live records x one record's weight), filled to
//! that many completed records, then measured in its steady state: every new operation
//! evicts the least recently used one, so the store keeps about the same number of records
//! however long the benchmark runs (as a store at its retention does: one record expires
//! per record added). Replays pick completed records at random, so a large store pays its
//! cache misses. Records are server-side ones: no frozen request, a small JSON response.
//!
//! `RedisStore` (feature `redis`): the same against a private `redis-server` on a loopback
//! port (or `REDIS_URL` when set), with 1k and 100k live records (filling 1M over one
//! connection would take most of a minute, and a Redis hash lookup does not depend on the
//! key count). Skipped, with a notice, when `redis-server` is not installed.
//!
//! `moka_ledger`: the same begin+complete and replays against `common/moka_ledger.rs`, the
//! best moka-backed design (outcomes in `moka::sync`, LRU, weighed in bytes), the yardstick
//! `MemoryStore` is measured against.
//!
//! Run: `cargo bench --bench ledger` (add `--features redis` for the Redis half).

#[path = "common/ledger.rs"]
mod ledger_common;
#[path = "common/moka_ledger.rs"]
mod moka_ledger;

use ledger_common::{begin_complete, key, outcome, replay, Picker};

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use tokio::runtime::Runtime;
use tower_idempotency::ledger::MemoryStore;

const SIZES: [u64; 3] = [1_000, 100_000, 1_000_000];
/// Single operations timed one by one after the benchmarks of each size.
const TAIL_OPS: usize = 200_000;

/// Whether criterion runs each benchmark once as a test (`cargo test --benches`, or no
/// `--bench` flag): then only the smallest store is filled, so that the run stays quick.
fn quick() -> bool {
    let args: Vec<String> = std::env::args().collect();
    !args.iter().any(|a| a == "--bench") || args.iter().any(|a| a == "--test")
}

fn sizes() -> &'static [u64] {
    if quick() {
        &SIZES[..1]
    } else {
        &SIZES
    }
}

/// Keys of new operations, never reused (above every prefilled index).
static NEXT_FRESH: AtomicU64 = AtomicU64::new(1 << 40);

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

/// The weight one completed record adds to a `MemoryStore`.
fn record_weight(rt: &Runtime) -> u64 {
    rt.block_on(async {
        let store = MemoryStore::new();
        for i in 0..100 {
            begin_complete(&store, key(i), &outcome()).await;
        }
        store.run_pending_tasks().await;
        store.weighted_size() / store.entry_count()
    })
}

fn memory_store(c: &mut Criterion) {
    let rt = runtime();
    let weight = record_weight(&rt);
    eprintln!("MemoryStore: one completed record weighs {weight} bytes");
    let outcome = outcome();
    let mut group = c.benchmark_group("memory_store");
    for &live in sizes() {
        // 2 % headroom so that filling does not already evict.
        let store = MemoryStore::builder()
            .max_bytes(live * weight * 102 / 100)
            .build();
        let started = Instant::now();
        rt.block_on(async {
            for i in 0..live {
                begin_complete(&store, key(i), &outcome).await;
            }
            store.run_pending_tasks().await;
        });
        eprintln!(
            "MemoryStore: filled {live} records in {:.1?} ({} live, {} MiB weighed)",
            started.elapsed(),
            store.entry_count(),
            store.weighted_size() >> 20
        );

        // Replays first: the next benchmark's new operations evict prefilled records.
        group.bench_with_input(BenchmarkId::new("replay", live), &live, |b, &live| {
            b.to_async(&rt).iter_custom(|iters| {
                let store = store.clone();
                async move {
                    let mut picker = Picker(0x1234_5678_9abc_def1 ^ iters);
                    let start = Instant::now();
                    for _ in 0..iters {
                        replay(&store, key(picker.next(live))).await;
                    }
                    start.elapsed()
                }
            })
        });
        // The same, over 1024 of the records only: what a replay costs when its record is
        // in cache, whatever the store's size.
        group.bench_with_input(BenchmarkId::new("replay_hot", live), &live, |b, &live| {
            b.to_async(&rt).iter_custom(|iters| {
                let store = store.clone();
                async move {
                    let mut picker = Picker(0x1234_5678_9abc_def1 ^ iters);
                    let start = Instant::now();
                    for _ in 0..iters {
                        replay(&store, key(picker.next(live.min(1024)))).await;
                    }
                    start.elapsed()
                }
            })
        });
        group.bench_with_input(BenchmarkId::new("begin_complete", live), &live, |b, _| {
            b.to_async(&rt).iter_custom(|iters| {
                let store = store.clone();
                let outcome = outcome.clone();
                async move {
                    let start = Instant::now();
                    for _ in 0..iters {
                        let fresh = NEXT_FRESH.fetch_add(1, Ordering::Relaxed);
                        begin_complete(&store, key(fresh), &outcome).await;
                    }
                    start.elapsed()
                }
            })
        });
        // Criterion reports means; a store that stalls now and then (a table rebuilt in one
        // go) shows in the tail of single operations.
        let mut single: Vec<Duration> = rt.block_on(async {
            let ops = if quick() { 100 } else { TAIL_OPS };
            let mut times = Vec::with_capacity(ops);
            for _ in 0..ops {
                let fresh = NEXT_FRESH.fetch_add(1, Ordering::Relaxed);
                let start = Instant::now();
                begin_complete(&store, key(fresh), &outcome).await;
                times.push(start.elapsed());
            }
            times
        });
        single.sort_unstable();
        let at = |q: f64| single[((single.len() as f64 * q) as usize).min(single.len() - 1)];
        eprintln!(
            "tail: memory_store/begin_complete/{live} ops={} p50={:.1?} p99={:.1?} p99.9={:.1?} max={:.1?} mean={:.1?}",
            single.len(),
            at(0.5),
            at(0.99),
            at(0.999),
            single[single.len() - 1],
            single.iter().sum::<Duration>() / single.len() as u32,
        );
        rt.block_on(store.run_pending_tasks());
        eprintln!(
            "MemoryStore: {} live records after the benchmarks (cap {live})",
            store.entry_count()
        );
    }
    group.finish();
}

/// The same begin+complete and replay against the best moka-backed ledger
/// (`common/moka_ledger.rs`), the design `MemoryStore` replaced, in the same run.
fn moka_ledger(c: &mut Criterion) {
    let rt = runtime();
    let outcome = outcome();
    let weight = moka_ledger::MokaLedger::weight_of(None, &outcome);
    let mut group = c.benchmark_group("moka_ledger");
    for &live in sizes() {
        let store = moka_ledger::MokaLedger::new(live * weight * 102 / 100);
        rt.block_on(async {
            for i in 0..live {
                begin_complete(&store, key(i), &outcome).await;
            }
        });
        store.run_pending_tasks();
        let store = std::sync::Arc::new(store);
        group.bench_with_input(BenchmarkId::new("replay", live), &live, |b, &live| {
            b.to_async(&rt).iter_custom(|iters| {
                let store = store.clone();
                async move {
                    let mut picker = Picker(0x1234_5678_9abc_def1 ^ iters);
                    let start = Instant::now();
                    for _ in 0..iters {
                        replay(&*store, key(picker.next(live))).await;
                    }
                    start.elapsed()
                }
            })
        });
        group.bench_with_input(BenchmarkId::new("begin_complete", live), &live, |b, _| {
            b.to_async(&rt).iter_custom(|iters| {
                let store = store.clone();
                let outcome = outcome.clone();
                async move {
                    let start = Instant::now();
                    for _ in 0..iters {
                        let fresh = NEXT_FRESH.fetch_add(1, Ordering::Relaxed);
                        begin_complete(&*store, key(fresh), &outcome).await;
                    }
                    start.elapsed()
                }
            })
        });
    }
    group.finish();
}

#[cfg(feature = "redis")]
mod redis_bench {
    use super::*;
    use std::net::{Ipv4Addr, TcpListener};
    use std::process::{Child, Command, Stdio};
    use tower_idempotency::ledger::RedisStore;

    /// A private `redis-server` on a free loopback port, killed on drop.
    pub(super) struct Server {
        child: Option<Child>,
        pub(super) url: String,
    }

    impl Drop for Server {
        fn drop(&mut self) {
            if let Some(child) = &mut self.child {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }

    /// `REDIS_URL` if set, else a private server; `None` (with a notice) when neither.
    pub(super) fn server() -> Option<Server> {
        if let Some(url) = std::env::var("REDIS_URL").ok().filter(|u| !u.is_empty()) {
            return Some(Server { child: None, url });
        }
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| l.local_addr())
            .ok()?
            .port();
        let bin = std::env::var("REDIS_SERVER_BIN").unwrap_or_else(|_| "redis-server".into());
        let child = Command::new(&bin)
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let child = match child {
            Ok(child) => child,
            Err(err) => {
                eprintln!("NOTICE: skipping the RedisStore benchmarks: cannot run {bin}: {err}");
                return None;
            }
        };
        let server = Server {
            child: Some(child),
            url: format!("redis://127.0.0.1:{port}/"),
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_err() {
            if Instant::now() > deadline {
                eprintln!("NOTICE: skipping the RedisStore benchmarks: {bin} did not start");
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(server)
    }

    pub(super) fn redis_store(c: &mut Criterion) {
        let Some(server) = server() else { return };
        let rt = runtime();
        let outcome = outcome();
        let mut group = c.benchmark_group("redis_store");
        let sizes: &[u64] = if quick() { &[1_000] } else { &[1_000, 100_000] };
        for &live in sizes {
            // A fresh prefix per size: the stores never see each other's records.
            let store = rt
                .block_on(
                    RedisStore::builder(server.url.as_str())
                        .prefix(format!("bench:{}:{live}:", std::process::id()))
                        .connect(),
                )
                .expect("connect to redis");
            let started = Instant::now();
            rt.block_on(async {
                // 32 callers at once: the connection multiplexes them, filling goes faster.
                let per_task = live / 32;
                let mut tasks = tokio::task::JoinSet::new();
                for t in 0..32 {
                    let store = store.clone();
                    let outcome = outcome.clone();
                    tasks.spawn(async move {
                        for i in t * per_task..(t + 1) * per_task {
                            begin_complete(&store, key(i), &outcome).await;
                        }
                    });
                }
                while let Some(done) = tasks.join_next().await {
                    done.expect("fill task");
                }
            });
            let filled = live / 32 * 32;
            eprintln!(
                "RedisStore: filled {filled} records in {:.1?}",
                started.elapsed()
            );
            group.bench_with_input(BenchmarkId::new("replay", live), &filled, |b, &n| {
                b.to_async(&rt).iter_custom(|iters| {
                    let store = store.clone();
                    async move {
                        let mut picker = Picker(0x1234_5678_9abc_def1 ^ iters);
                        let start = Instant::now();
                        for _ in 0..iters {
                            replay(&store, key(picker.next(n))).await;
                        }
                        start.elapsed()
                    }
                })
            });
            group.bench_with_input(BenchmarkId::new("begin_complete", live), &live, |b, _| {
                b.to_async(&rt).iter_custom(|iters| {
                    let store = store.clone();
                    let outcome = outcome.clone();
                    async move {
                        let start = Instant::now();
                        for _ in 0..iters {
                            let fresh = NEXT_FRESH.fetch_add(1, Ordering::Relaxed);
                            begin_complete(&store, key(fresh), &outcome).await;
                        }
                        start.elapsed()
                    }
                })
            });
        }
        group.finish();
        drop(server);
    }
}

#[cfg(feature = "redis")]
use redis_bench::redis_store;

#[cfg(not(feature = "redis"))]
fn redis_store(_: &mut Criterion) {
    eprintln!("NOTICE: RedisStore benchmarks need `--features redis`");
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .noise_threshold(0.03);
    targets = memory_store, moka_ledger, redis_store
}
criterion_main!(benches);
