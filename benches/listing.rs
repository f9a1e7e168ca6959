//! What listing costs a `MemoryStore` of a million records, and what it costs the claims
//! made meanwhile.
//!
//! The store holds 1M server records (no frozen request, a small JSON response): 1 % in
//! doubt, the rest completed, under a budget large enough that nothing is evicted. Timed by
//! criterion:
//!
//! | benchmark | what one iteration is |
//! |---|---|
//! | `listing/newest_first/1000000` | a page of 100 of every record, newest first |
//! | `listing/in_doubt/1000000` | a page of 100 of the in-doubt records (10,000 of them), newest first |
//! | `listing/in_doubt_next_page/1000000` | the page after that one |
//!
//! Then, outside criterion, the claims a listing may hold up: one thread makes new claims
//! back to back (`begin` + `complete` of a new key, each timed) while another lists pages
//! of both kinds, one after the other, for a few seconds; and the same claims with no
//! listing, as the baseline (a claim on a busy machine waits now and then whatever the
//! store does), and beside a thread that spins without taking a lock (the CPU a listing
//! takes from the claims, without its locks). Printed as `claims while listing: ...`,
//! `claims beside a spinning thread: ...` and `claims alone: ...`, with the
//! longest single claim (`max`), how many took over 1 ms and 5 ms, and the longest page
//! (`page max`). On a busy machine a thread is preempted now and then for milliseconds,
//! lock or no lock: so each claim also reads its thread's context switches before and
//! after (Linux, `getrusage(RUSAGE_THREAD)`). A claim whose involuntary count grew was
//! preempted; one whose voluntary count grew blocked (it slept on a lock's futex, as it
//! does behind a listing's chunk). Of the claims over 5 ms the line counts the `preempted`,
//! the `blocked` (and not preempted) and the rest (`neither`), and gives the longest claim
//! that was not preempted (`longest unpreempted`): what the locks cost, preemption aside. Each page is also run 10 times alone, printed
//! as `page ...` with its CPU time (Linux: the thread's own, from `/proc`), which other
//! processes do not inflate, and its fastest wall time.
//!
//! Run: `cargo bench --bench listing` (release). `cargo test --benches` runs it once on
//! 20,000 records (two pages of in-doubt ones).
//!
//! `cargo bench --bench listing -- pages [QUERY] [PAGES]` skips criterion and the claims:
//! it fills the store, then lists `PAGES` pages (default 10) of each query (or of `QUERY`
//! alone: `newest_first`, `newest_first_next_page`, `oldest_first`, `in_doubt`,
//! `in_doubt_next_page`, `in_doubt_deep`, the tenth page of in-doubt ones), printing each
//! query's CPU time a page. Under callgrind, with
//! `--collect-atstart=no --toggle-collect='*listed_pages*'`, it counts the instructions of the
//! pages alone (divide by `PAGES`): deterministic, where times are not.

// Shared with the ledger bench: this one claims its records its own way.
#[path = "common/ledger.rs"]
#[allow(dead_code)]
mod ledger_common;

use ledger_common::{fingerprint, key, outcome, LEASE, RETENTION};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion};
use tokio::runtime::Runtime;
use tower_idempotency::ledger::{
    Begin, BeginRequest, IdempotencyStore, LedgerKey, ListPage, ListQuery, MemoryStore, Outcome,
    RecordKind,
};

const RECORDS: u64 = 1_000_000;
/// One record in this many is in doubt.
const IN_DOUBT_EVERY: u64 = 100;
const PAGE: usize = 100;
/// How long the claims of the contention run go on, with listing and without.
const CONTENTION_RUN: Duration = Duration::from_secs(4);

/// Whether criterion runs each benchmark once as a test (`cargo test --benches`, or no
/// `--bench` flag): then a small store, so that the run stays quick.
fn quick() -> bool {
    let args: Vec<String> = std::env::args().collect();
    !args.iter().any(|a| a == "--bench") || args.iter().any(|a| a == "--test")
}

fn records() -> u64 {
    if quick() {
        RECORDS / 50
    } else {
        RECORDS
    }
}

/// The key of a claim made while listing: random, as a digest is. Not the next of a
/// sequence: [`key`] picks a record's shard by the index's low byte, so claims of
/// consecutive indexes would walk the shards in the listing's own order, and fall in step
/// behind it, each waiting out a chunk.
fn fresh_key() -> LedgerKey {
    let mut bytes = [0u8; 32];
    fastrand::fill(&mut bytes);
    LedgerKey::from_bytes(bytes)
}

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

fn request(key: LedgerKey) -> BeginRequest {
    BeginRequest::new(key, fingerprint(), LEASE, RETENTION)
}

async fn claim(store: &MemoryStore, key: LedgerKey) -> tower_idempotency::ledger::LeaseToken {
    match store.begin(request(key)).await.expect("begin") {
        Begin::Acquired { token } => token,
        other => panic!("a fresh key must be acquired, got {other:?}"),
    }
}

/// `records` records, one in [`IN_DOUBT_EVERY`] in doubt, the rest completed.
async fn filled_store(records: u64, outcome: &Outcome) -> MemoryStore {
    // Far more than a million records weigh: nothing is evicted, nothing refused.
    let store = MemoryStore::builder().max_bytes(8 << 30).build();
    for i in 0..records {
        let token = claim(&store, key(i)).await;
        if i % IN_DOUBT_EVERY == 0 {
            store
                .mark_in_doubt(key(i), token, RETENTION)
                .await
                .expect("mark in doubt");
        } else {
            store
                .complete(key(i), token, outcome.clone(), RETENTION)
                .await
                .expect("complete");
        }
    }
    store
}

fn newest_first() -> ListQuery {
    ListQuery::new().limit(PAGE)
}

fn in_doubt() -> ListQuery {
    ListQuery::new().kind(RecordKind::InDoubt).limit(PAGE)
}

fn full_page(store: &MemoryStore, rt: &Runtime, query: ListQuery) -> ListPage {
    let page = rt.block_on(store.list(query)).expect("list");
    assert_eq!(page.records.len(), PAGE, "a full page");
    page
}

fn listing(c: &mut Criterion) {
    let rt = runtime();
    let records = records();
    let outcome = outcome();
    let started = Instant::now();
    let store = rt.block_on(filled_store(records, &outcome));
    eprintln!(
        "listing: filled {} records in {:.1?} ({} MiB weighed)",
        store.entry_count(),
        started.elapsed(),
        store.weighted_size() >> 20
    );
    let first = full_page(&store, &rt, in_doubt());
    let next = in_doubt().after(first.next.expect("more in-doubt records"));

    let mut group = c.benchmark_group("listing");
    group.bench_with_input(
        BenchmarkId::new("newest_first", records),
        &records,
        |b, _| b.iter(|| full_page(&store, &rt, newest_first())),
    );
    group.bench_with_input(BenchmarkId::new("in_doubt", records), &records, |b, _| {
        b.iter(|| full_page(&store, &rt, in_doubt()))
    });
    group.bench_with_input(
        BenchmarkId::new("in_doubt_next_page", records),
        &records,
        |b, _| b.iter(|| full_page(&store, &rt, next.clone())),
    );
    group.finish();
    for (name, query) in [
        ("newest_first", newest_first()),
        ("in_doubt", in_doubt()),
        ("in_doubt_next_page", next),
    ] {
        page_cost(&store, &rt, name, query);
    }

    let run = if quick() {
        Duration::from_millis(200)
    } else {
        CONTENTION_RUN
    };
    let (claims, pages) = claims_while(&store, &outcome, run, Beside::Listing);
    report("claims while listing", &claims, Some(&pages));
    let (claims, _) = claims_while(&store, &outcome, run, Beside::Spinning);
    report("claims beside a spinning thread", &claims, None);
    let (claims, _) = claims_while(&store, &outcome, run, Beside::Nothing);
    report("claims alone", &claims, None);
}

/// What a page costs this thread in CPU time, besides its wall time: on a busy machine the
/// wall time counts whatever else ran meanwhile.
fn page_cost(store: &MemoryStore, rt: &Runtime, name: &str, query: ListQuery) {
    const PAGES: u32 = 10;
    let (mut fastest, cpu_before) = (Duration::MAX, thread_cpu_time());
    for _ in 0..PAGES {
        let start = Instant::now();
        full_page(store, rt, query.clone());
        fastest = fastest.min(start.elapsed());
    }
    let cpu = thread_cpu_time()
        .zip(cpu_before)
        .map_or("unknown".to_owned(), |(after, before)| {
            format!("{:.1?}", (after - before) / PAGES)
        });
    eprintln!("page {name}: cpu {cpu} a page, fastest wall {fastest:.1?}");
}

/// The CPU time this thread has run so far, from Linux's scheduler statistics; `None`
/// elsewhere.
fn thread_cpu_time() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let nanos = stat.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(nanos))
}

/// What this thread does while the claims run.
#[derive(Clone, Copy, PartialEq)]
enum Beside {
    /// Lists pages one after the other.
    Listing,
    /// Spins without a lock: the CPU a listing takes from the claims, without its locks.
    Spinning,
    /// Sleeps.
    Nothing,
}

/// One claim (`begin` + `complete`) of the contention run.
#[derive(Clone, Copy)]
struct Claim {
    took: Duration,
    /// Its thread switched out of its own accord meanwhile: it slept, on a lock's futex.
    blocked: bool,
    /// Its thread was switched out by the scheduler meanwhile.
    preempted: bool,
}

/// This thread's context switches so far, voluntary and involuntary (Linux:
/// `getrusage(RUSAGE_THREAD)`); `None` elsewhere.
#[cfg(target_os = "linux")]
fn context_switches() -> Option<(libc::c_long, libc::c_long)> {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `usage` is a valid, writable `rusage`; getrusage only writes it.
    let status = unsafe { libc::getrusage(libc::RUSAGE_THREAD, usage.as_mut_ptr()) };
    if status != 0 {
        return None;
    }
    // SAFETY: getrusage succeeded, so it wrote the whole struct (zeroed before anyway).
    let usage = unsafe { usage.assume_init() };
    Some((usage.ru_nvcsw, usage.ru_nivcsw))
}

#[cfg(not(target_os = "linux"))]
fn context_switches() -> Option<(i64, i64)> {
    None
}

/// New claims (`begin` + `complete`), each timed, on a thread of their own for `run`,
/// while this thread does `beside`: the claims and the pages' times.
fn claims_while(
    store: &MemoryStore,
    outcome: &Outcome,
    run: Duration,
    beside: Beside,
) -> (Vec<Claim>, Vec<Duration>) {
    let done = Arc::new(AtomicBool::new(false));
    let claimer = {
        let (store, outcome, done) = (store.clone(), outcome.clone(), done.clone());
        std::thread::spawn(move || {
            let rt = runtime();
            let mut claims = Vec::new();
            while !done.load(Ordering::Relaxed) {
                let fresh = fresh_key();
                let switches = context_switches();
                let start = Instant::now();
                rt.block_on(async {
                    let token = claim(&store, fresh).await;
                    store
                        .complete(fresh, token, outcome.clone(), RETENTION)
                        .await
                        .expect("complete");
                });
                let took = start.elapsed();
                let (voluntary, involuntary) = context_switches()
                    .zip(switches)
                    .map_or((false, false), |(after, before)| {
                        (after.0 > before.0, after.1 > before.1)
                    });
                claims.push(Claim {
                    took,
                    blocked: voluntary,
                    preempted: involuntary,
                });
            }
            claims
        })
    };
    let rt = runtime();
    let mut pages = Vec::new();
    let switches = context_switches();
    let started = Instant::now();
    while started.elapsed() < run {
        match beside {
            Beside::Listing => {
                for query in [newest_first(), in_doubt()] {
                    let start = Instant::now();
                    full_page(store, &rt, query);
                    pages.push(start.elapsed());
                }
            }
            Beside::Spinning => {
                let until = Instant::now() + Duration::from_millis(10);
                while Instant::now() < until {
                    std::hint::spin_loop();
                }
            }
            Beside::Nothing => std::thread::sleep(Duration::from_millis(10)),
        }
    }
    done.store(true, Ordering::Relaxed);
    if let Some((after, before)) = context_switches().zip(switches) {
        // Preempted while it lists, this thread most likely holds a shard's lock: a claim
        // on that shard then waits out the preemption, blocked.
        eprintln!(
            "  this thread ({}): preempted {} times, blocked {} times",
            match beside {
                Beside::Listing => "listing",
                Beside::Spinning => "spinning",
                Beside::Nothing => "sleeping",
            },
            after.1 - before.1,
            after.0 - before.0
        );
    }
    (claimer.join().expect("the claiming thread"), pages)
}

fn report(what: &str, claims: &[Claim], pages: Option<&[Duration]>) {
    let mut times: Vec<Duration> = claims.iter().map(|claim| claim.took).collect();
    times.sort_unstable();
    let at = |q: f64| times[((times.len() as f64 * q) as usize).min(times.len() - 1)];
    let pages = pages.map_or(String::new(), |pages| {
        format!(
            " pages={} page max={:.1?}",
            pages.len(),
            pages.iter().max().copied().unwrap_or_default()
        )
    });
    let over = |limit: Duration| times.iter().filter(|took| **took > limit).count();
    let slow: Vec<&Claim> = claims
        .iter()
        .filter(|claim| claim.took > Duration::from_millis(5))
        .collect();
    let preempted = slow.iter().filter(|claim| claim.preempted).count();
    let blocked = slow
        .iter()
        .filter(|claim| claim.blocked && !claim.preempted)
        .count();
    let unpreempted = claims
        .iter()
        .filter(|claim| !claim.preempted)
        .map(|claim| claim.took)
        .max()
        .unwrap_or_default();
    eprintln!(
        "{what}: claims={} p50={:.1?} p99={:.1?} p99.9={:.1?} max={:.1?} over 1 ms={} \
         over 5 ms={} (preempted {preempted}, blocked {blocked}, neither {}) \
         longest unpreempted={unpreempted:.1?}{pages}",
        times.len(),
        at(0.5),
        at(0.99),
        at(0.999),
        times[times.len() - 1],
        over(Duration::from_millis(1)),
        slow.len(),
        slow.len() - preempted - blocked,
    );
}

/// `pages [QUERY] [PAGES]`: fill the store and list pages, nothing else (see the module
/// docs).
fn pages_only(args: &[String]) {
    let rt = runtime();
    let outcome = outcome();
    let store = rt.block_on(filled_store(RECORDS, &outcome));
    let only = args.first().filter(|arg| arg.parse::<u32>().is_err());
    let pages: u32 = args.iter().find_map(|arg| arg.parse().ok()).unwrap_or(10);
    for (name, query) in queries(&store, &rt) {
        if only.is_none_or(|only| *only == name) {
            let cpu_before = thread_cpu_time();
            listed_pages(&store, &rt, &query, pages);
            let cpu = thread_cpu_time()
                .zip(cpu_before)
                .map_or("unknown".to_owned(), |(after, before)| {
                    format!("{:.1?}", (after - before) / pages)
                });
            eprintln!("pages {name}: {pages} pages, cpu {cpu} a page");
        }
    }
}

/// `pages` pages of `query`: what callgrind counts (`--toggle-collect='*listed_pages*'`).
#[inline(never)]
fn listed_pages(store: &MemoryStore, rt: &Runtime, query: &ListQuery, pages: u32) {
    for _ in 0..pages {
        std::hint::black_box(full_page(store, rt, query.clone()));
    }
}

/// Every query `pages` knows, by name: the later pages go on from the pages before them.
fn queries(store: &MemoryStore, rt: &Runtime) -> Vec<(&'static str, ListQuery)> {
    let after = |query: ListQuery, pages: usize| {
        let mut next = query.clone();
        for _ in 0..pages {
            let page = full_page(store, rt, next.clone());
            next = query.clone().after(page.next.expect("another page"));
        }
        next
    };
    vec![
        ("newest_first", newest_first()),
        ("newest_first_next_page", after(newest_first(), 1)),
        ("oldest_first", newest_first().oldest_first()),
        ("in_doubt", in_doubt()),
        ("in_doubt_next_page", after(in_doubt(), 1)),
        ("in_doubt_deep", after(in_doubt(), 9)),
    ]
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let Some(at) = args.iter().position(|arg| arg == "pages") {
        let rest: Vec<String> = args[at + 1..]
            .iter()
            .filter(|arg| !arg.starts_with("--"))
            .cloned()
            .collect();
        pages_only(&rest);
        return;
    }
    let mut criterion = Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    listing(&mut criterion);
    criterion.final_summary();
}
