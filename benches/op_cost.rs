//! Deterministic per-operation cost: one named variant, run N times and nothing else, so
//! that callgrind can count its instructions, and a counting allocator for allocations.
//!
//! ```text
//! cargo bench --bench op_cost -- list  # the variants, one a line (built in release)
//! op_cost list                        # the variants, one a line
//! op_cost <variant> <N>               # set the variant up, then run N operations
//! op_cost <variant> 0                 # the setup alone
//! op_cost allocs [N]                  # allocations per operation of every variant (native)
//! scripts/op_cost.sh                  # all of it under callgrind, as a table
//! ```
//!
//! Every variant mirrors what `benches/layers.rs` and `benches/ledger.rs` time (and shares
//! `benches/common`): the layer variants send `POST /charges` with two headers and a 1 KiB
//! body shared by reference count, call the service once and read the response body.
//!
//! | variant | what one operation is |
//! |---|---|
//! | `bare` | the no-op service |
//! | `bare_op` | the no-op service, handed the client variants' requests (a new `OperationId` in each): their baseline, so the caller's own `OperationId` is not counted as the layer's |
//! | `tower_retry_clone` | buffer the body, `tower::retry` with a policy cloning the request per attempt |
//! | `tower_retry_clone_full` | `tower_retry_clone`'s policy straight over the `Full<Bytes>` requests, no buffering: the least a retry can do, and only for a body that is already cloneable bytes |
//! | `frozen_retry` | `FrozenRetryLayer` (default policy) |
//! | `frozen_retry_no_budget` | `FrozenRetryLayer`, the default policy without its retry budget (which `tower_retry_clone`'s policy does not keep either) |
//! | `stack_read` | the client stack as the README builds it (`build_stack()`, its store empty) handed `bare`'s requests as `GET`s: a read, outside the ledger (frozen for its retries, never claimed) |
//! | `client_fresh` / `client_replay` | client `IdempotencyLayer`, a new `OperationId` per call / always the same one (replayed) |
//! | `stack_fresh` / `stack_replay` | the client stack as the README builds it (`client_builder(..).provider_deduplicates(true).key_header(KeyHeader::ietf()).build_stack()`: `IdempotencyLayer` over `FrozenRetryLayer` as one service), the same two ways |
//! | `stack_by_hand_fresh` | `IdempotencyLayer` over `FrozenRetryLayer` stacked with `ServiceBuilder` (the frozen request handed on through the extensions), a new `OperationId` per call |
//! | `client_floor` / `client_floor_replay` | a yardstick, not the crate's code path: the least a client layer keeping the ledger's promise does for a new operation / a replay, written straight against the crate's public parts (`benches/common/floor.rs`) |
//! | `stack_floor` | `client_floor` over the hand-written `tower::retry` of `tower_retry_clone` |
//! | `stack_floor_defaults` | `stack_floor` with its store below its cap, as `stack_fresh_defaults`'s is: nothing evicted, so a record's allocations are new memory in both |
//! | `server_bare` | the no-op handler (it reads the body), a new `Idempotency-Key` per call |
//! | `server_fresh` / `server_replay` | server `IdempotencyLayer` over the handler, a new key per call / always the same key |
//! | `server_fresh_defaults` | a new key per call through the server layer with every setting at its default but `unscoped()` (the bench's requests carry no `Authorization`) and the store below its cap: nothing evicted, nothing shortened |
//! | `server_bare_digest` / `server_fresh_digest` / `server_replay_digest` | `server_bare`, `server_fresh` and `server_replay` with each request carrying its body's `Content-Digest`, as the client stack sends every keyed request (checked against the body by the layer) |
//! | `server_refused` | server `IdempotencyLayer` (default protected window) over a 16 MiB store full of protected records: a new key per call, each refused `503 ledger-full` |
//! | `store_begin_complete_{1k,100k,1m}` | `begin` + `complete` of a new operation in a `MemoryStore` at that many live records |
//! | `store_replay_{1k,100k,1m}` | `begin` of a completed operation picked at random in such a store |
//! | `moka_begin_complete_{1k,100k,1m}` / `moka_replay_{1k,100k,1m}` | the same against `benches/common/moka_ledger.rs`, the best moka-backed ledger (the yardstick `MemoryStore` is measured against) |
//! | `sha256_1kib` | one SHA-256 of the 1 KiB body (`sha2`), to price SHA separately |
//! | `field_digests_1kib` | the field digests `MemoryStore` keeps of the 1 KiB body (`FieldDigests::of`), the largest part of a record's cost |
//! | `tool_bare` | a no-op tool (`Service<ToolCall<_>>`) called with typed arguments (four fields, ~1 KiB as JSON, built per call) and a new `OperationId`: the tool face's baseline |
//! | `client_fresh_defaults` / `stack_fresh_defaults` | a new operation per call through the layer (`IdempotencyLayer::client(MemoryStore::new(), ProviderKeys::Deduplicates, KeyHeader::ietf())`) / the stack (`client_builder(MemoryStore::new()).provider_deduplicates(true).key_header(KeyHeader::ietf()).build_stack()`) with **every setting at its default** and the store below its cap, as a user's runs: nothing evicted, nothing shortened |
//! | `tool_fresh_defaults` | the same through the tool face (`ToolLayer::builder(MemoryStore::new(), "charge", ProviderKeys::Ignored).build()`) |
//! | `bare_op_waiting` | `bare_op` with a transport that is pending once before it answers, as one over a network is (`common::Waiting`): the baseline of the `_waiting` variants |
//! | `stack_fresh_waiting` / `client_floor_waiting` / `stack_floor_waiting` | `stack_fresh`, `client_floor` and `stack_floor` over that transport: what a second poll of every layer, and whatever it arms while a call is on the wire (the default store holds the lease: no renewal timer), add |
//! | `stack_fresh_defaults_waiting` | `stack_fresh_defaults` over that transport: the same with every setting at its default (a 10 s lease, renewed every third of it) |
//! | `tool_fresh` / `tool_replay` | the tool face (`ToolLayer`, a key-less provider, the default retry policy with no retry window so the benches' protected window applies) over that tool, a new `OperationId` per call / always the same one |
//!
//! Setup happens before the measured loop: building the stack, filling its store and warming
//! up. The layers' stores (`MemoryStore::new()`, at its default budget) are filled through the measured
//! service itself until they are at their cap and evicting, then left 60 ms so that every
//! prefilled record is past the benches' 50 ms protected window: each new operation of the
//! loop then evicts one old record, the steady state the benches reach after their first
//! seconds. The ledger stores are built and filled as `benches/ledger.rs` does (a cap of
//! live records x one record's weight, plus 2 %); `begin_complete` ones are then fed new
//! operations until they evict, so that every measured operation evicts one record. Replays
//! are checked to be replays, and every operation to answer `201`, outside the loop.
//!
//! Instructions: the loop is bracketed by callgrind's start/stop-instrumentation client
//! requests (x86-64; no-ops outside valgrind), so `valgrind --tool=callgrind
//! --instr-atstart=no` runs the setup at valgrind's lowest slowdown and counts only the loop.
//! The cost of one operation is `(Ir(N2) - Ir(N1)) / (N2 - N1)` over two runs, which
//! cancels whatever the setup and the loop's first steps cost (the same holds with
//! `--instr-atstart=yes`, only slower).
//!
//! Allocations: the global allocator wraps `System` and counts every `alloc`,
//! `alloc_zeroed` and `realloc` (each one allocation, the bytes asked for) with relaxed
//! atomics; `dealloc` is not counted. The counts are read around the measured loop. The
//! counting runs under callgrind too: a few instructions per allocation, in every variant.
//!
//! stdout of a run: `variant=<v> ops=<n> allocs=<a> bytes=<b> allocs_per_op=<x>
//! bytes_per_op=<y> evictions=<e> refused=<r>` (the last two from the variant's store, over
//! the loop; `-` without one).

mod common;

use common::floor::{Floor, FloorService};
use common::ledger::{begin_complete, key, outcome, replay, Picker};
use common::moka_ledger::MokaLedger;
use common::{handler, json_body, runtime, BufferBody, CloneAttempts, Noop, Template, Waiting};

use std::alloc::{GlobalAlloc, Layout, System};
use std::hint::black_box;
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use sha2::{Digest, Sha256};
use tower::retry::RetryLayer;
use tower::{Layer, Service, ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::{FieldDigests, MemoryStore, Outcome};
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::tool::{ProviderKeys, ToolCall, ToolLayer, ToolSource};
use tower_idempotency::{
    FrozenRetryLayer, IdempotencyLayer, KeyHeader, OperationId, ResponseSource,
};

const BODY_LEN: usize = 1024;

/// Every variant, in the order the table prints them.
const VARIANTS: &[&str] = &[
    "bare",
    "bare_op",
    "tower_retry_clone",
    "tower_retry_clone_full",
    "frozen_retry",
    "frozen_retry_no_budget",
    "stack_read",
    "client_fresh",
    "client_replay",
    "stack_fresh",
    "stack_replay",
    "stack_by_hand_fresh",
    "client_fresh_defaults",
    "stack_fresh_defaults",
    "client_floor",
    "client_floor_replay",
    "stack_floor",
    "stack_floor_defaults",
    "server_bare",
    "server_fresh",
    "server_replay",
    "server_refused",
    "server_fresh_defaults",
    "server_bare_digest",
    "server_fresh_digest",
    "server_replay_digest",
    "store_begin_complete_1k",
    "store_begin_complete_100k",
    "store_begin_complete_1m",
    "store_replay_1k",
    "store_replay_100k",
    "store_replay_1m",
    "moka_begin_complete_1k",
    "moka_begin_complete_100k",
    "moka_begin_complete_1m",
    "moka_replay_1k",
    "moka_replay_100k",
    "moka_replay_1m",
    "sha256_1kib",
    "field_digests_1kib",
    "tool_bare",
    "tool_fresh",
    "tool_replay",
    "tool_fresh_defaults",
    "bare_op_waiting",
    "stack_fresh_waiting",
    "stack_fresh_defaults_waiting",
    "client_floor_waiting",
    "stack_floor_waiting",
];

// --- Counting allocations -------------------------------------------------------------

static ALLOCS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

struct Counting;

// SAFETY: every call is forwarded to `System` unchanged; counting has no effect on memory.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCS.fetch_add(1, Ordering::Relaxed);
        BYTES.fetch_add(new_size as u64, Ordering::Relaxed);
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

// --- Callgrind client requests ---------------------------------------------------------

/// `VG_USERREQ_TOOL_BASE('C', 'T')` from valgrind's `callgrind.h`.
const CALLGRIND_BASE: u64 = (b'C' as u64) << 24 | (b'T' as u64) << 16;
const CALLGRIND_START_INSTRUMENTATION: u64 = CALLGRIND_BASE + 4;
const CALLGRIND_STOP_INSTRUMENTATION: u64 = CALLGRIND_BASE + 5;
/// `VG_USERREQ__RUNNING_ON_VALGRIND` from `valgrind.h`.
const RUNNING_ON_VALGRIND: u64 = 0x1001;

/// A valgrind client request (`VALGRIND_DO_CLIENT_REQUEST_EXPR` of `valgrind.h`): outside
/// valgrind the magic sequence does nothing (the four rotations add up to 128 bits) and
/// `0` comes back.
#[cfg(target_arch = "x86_64")]
fn client_request(request: u64) -> u64 {
    let args: [u64; 6] = [request, 0, 0, 0, 0, 0];
    let mut result: u64 = 0;
    // SAFETY: the sequence leaves every register as it found it except `rdx` (the result,
    // declared) and the flags (clobbered by default); valgrind only reads `args`.
    unsafe {
        std::arch::asm!(
            "rol rdi, 3",
            "rol rdi, 13",
            "rol rdi, 61",
            "rol rdi, 51",
            "xchg rbx, rbx",
            inout("rdx") result,
            in("rax") args.as_ptr(),
            inout("rdi") 0u64 => _,
            options(nostack),
        );
    }
    result
}

#[cfg(not(target_arch = "x86_64"))]
fn client_request(_request: u64) -> u64 {
    0
}

// --- The measured window --------------------------------------------------------------

/// What the measured loop did.
#[derive(Clone, Copy, Debug, Default)]
struct Counts {
    allocs: u64,
    bytes: u64,
}

/// Counters at the start of the measured loop; instrumentation on from here.
struct Window(Counts);

impl Window {
    #[inline(never)]
    fn open() -> Self {
        let start = Counts {
            allocs: ALLOCS.load(Ordering::Relaxed),
            bytes: BYTES.load(Ordering::Relaxed),
        };
        client_request(CALLGRIND_START_INSTRUMENTATION);
        Window(start)
    }

    #[inline(never)]
    fn close(self) -> Counts {
        client_request(CALLGRIND_STOP_INSTRUMENTATION);
        Counts {
            allocs: ALLOCS.load(Ordering::Relaxed) - self.0.allocs,
            bytes: BYTES.load(Ordering::Relaxed) - self.0.bytes,
        }
    }
}

/// What a variant reports besides its counts: its store's evictions and refused claims over
/// the loop.
#[derive(Clone, Copy, Debug, Default)]
struct StoreDelta {
    evictions: u64,
    refused: u64,
}

struct StoreWatch {
    store: MemoryStore,
    evictions: u64,
    refused: u64,
}

impl StoreWatch {
    fn new(store: &MemoryStore) -> Self {
        Self {
            store: store.clone(),
            evictions: store.evictions(),
            refused: store.refused_claims(),
        }
    }

    fn delta(&self) -> StoreDelta {
        StoreDelta {
            evictions: self.store.evictions() - self.evictions,
            refused: self.store.refused_claims() - self.refused,
        }
    }
}

// --- The request every layer variant sends (as benches/layers.rs) ----------------------

// --- Driving a service ---------------------------------------------------------------

/// The measured loop of the layer variants: `n` calls, each with a request from `make` and
/// its response body read, as `benches/layers.rs` times them.
async fn drive<S, ResBody>(svc: &mut S, make: &impl Fn() -> Request<Full<Bytes>>, n: u64)
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
    S::Error: std::fmt::Debug,
    ResBody: Body,
{
    for _ in 0..n {
        common::call_once(svc, make()).await;
    }
}

/// What a checked call answered.
struct Answer {
    status: StatusCode,
    replayed: bool,
}

/// One call outside the loop, its answer checked: `201` and its body read.
async fn checked_call<S, ResBody>(svc: &mut S, req: Request<Full<Bytes>>) -> Answer
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
    S::Error: std::fmt::Debug,
    ResBody: Body,
    ResBody::Error: std::fmt::Debug,
{
    let response = svc
        .ready()
        .await
        .expect("ready")
        .call(req)
        .await
        .expect("call");
    let replayed = response.extensions().get::<ResponseSource>() == Some(&ResponseSource::Replayed)
        || response
            .headers()
            .get("idempotent-replayed")
            .map(|v| v.as_bytes())
            == Some(b"true");
    let status = response.status();
    response.into_body().collect().await.expect("response body");
    assert_eq!(status, StatusCode::CREATED, "a variant must answer 201");
    Answer { status, replayed }
}

/// Warm up: `count` checked calls.
async fn warm<S, ResBody>(svc: &mut S, make: &impl Fn() -> Request<Full<Bytes>>, count: u64)
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
    S::Error: std::fmt::Debug,
    ResBody: Body,
    ResBody::Error: std::fmt::Debug,
{
    for _ in 0..count {
        black_box(checked_call(svc, make()).await.status);
    }
}

/// Fill `store` through `svc` with new operations until it is at its cap and has evicted
/// `settle` records, then wait out the benches' protected window, so that the loop evicts
/// one old record per new operation.
async fn fill_to_cap<S, ResBody>(
    svc: &mut S,
    store: &MemoryStore,
    make_fresh: &impl Fn() -> Request<Full<Bytes>>,
) where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
    S::Error: std::fmt::Debug,
    ResBody: Body,
    ResBody::Error: std::fmt::Debug,
{
    const SETTLE: u64 = 1_000;
    while store.evictions() < SETTLE {
        let answer = checked_call(svc, make_fresh()).await;
        assert!(!answer.replayed, "a new operation must not be a replay");
    }
    assert_eq!(store.refused_claims(), 0, "the fill was refused room");
    std::thread::sleep(common::BENCH_PROTECTION + Duration::from_millis(10));
}

/// Send new operations until the store, full of records inside their protected window,
/// refuses them; then a few more refusals to warm the refusing path.
async fn fill_until_refused<S, ResBody>(
    svc: &mut S,
    store: &MemoryStore,
    make_fresh: &impl Fn() -> Request<Full<Bytes>>,
) where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
    S::Error: std::fmt::Debug,
    ResBody: Body,
    ResBody::Error: std::fmt::Debug,
{
    while store.refused_claims() < 100 {
        let status = common::call_once(svc, make_fresh()).await;
        assert!(
            status == StatusCode::CREATED || status == StatusCode::SERVICE_UNAVAILABLE,
            "{status}"
        );
    }
    assert_eq!(store.evictions(), 0, "a protected record was evicted");
}

/// Which request a layer variant sends, and how its setup prepares the store.
enum Plan {
    /// No store: warm up, then the same request shape every call.
    Plain,
    /// A new operation per call: fill the store to its cap first.
    Fresh,
    /// The same operation every call: fill the store, record the operation, check replays.
    Replay,
    /// A new operation per call into a store full of protected records: every one refused.
    Refused,
    /// A new operation per call, at the defaults: the store is not filled, nothing is
    /// evicted (the steady state of a store below its cap).
    FreshAtDefaults,
}

async fn service_variant<S, ResBody>(
    mut svc: S,
    store: Option<&MemoryStore>,
    plan: Plan,
    make_fresh: impl Fn() -> Request<Full<Bytes>>,
    make_fixed: impl Fn() -> Request<Full<Bytes>>,
    n: u64,
) -> (Counts, Option<StoreDelta>)
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
    S::Error: std::fmt::Debug,
    ResBody: Body,
    ResBody::Error: std::fmt::Debug,
{
    match (store, &plan) {
        (Some(store), Plan::Refused) => fill_until_refused(&mut svc, store, &make_fresh).await,
        (Some(_), Plan::FreshAtDefaults) => warm(&mut svc, &make_fresh, 1_000).await,
        (Some(store), _) => fill_to_cap(&mut svc, store, &make_fresh).await,
        (None, _) => {}
    }
    let counts;
    match plan {
        Plan::Plain => {
            warm(&mut svc, &make_fresh, 1_000).await;
            let window = Window::open();
            drive(&mut svc, &make_fresh, n).await;
            counts = window.close();
        }
        Plan::Fresh => {
            let watch = StoreWatch::new(store.expect("a store"));
            let window = Window::open();
            drive(&mut svc, &make_fresh, n).await;
            counts = window.close();
            let delta = watch.delta();
            assert_eq!(delta.refused, 0, "new operations were refused room");
            assert!(
                delta.evictions >= n,
                "every new operation must evict a record ({} for {n})",
                delta.evictions
            );
            assert!(!checked_call(&mut svc, make_fresh()).await.replayed);
            return (counts, Some(delta));
        }
        Plan::FreshAtDefaults => {
            let watch = StoreWatch::new(store.expect("a store"));
            let window = Window::open();
            drive(&mut svc, &make_fresh, n).await;
            counts = window.close();
            let delta = watch.delta();
            assert_eq!(delta.refused, 0, "new operations were refused room");
            assert_eq!(delta.evictions, 0, "a store below its cap evicts nothing");
            return (counts, Some(delta));
        }
        Plan::Refused => {
            let watch = StoreWatch::new(store.expect("a store"));
            let window = Window::open();
            drive(&mut svc, &make_fresh, n).await;
            counts = window.close();
            let delta = watch.delta();
            assert_eq!(delta.refused, n, "every new operation is refused");
            assert_eq!(delta.evictions, 0, "nothing protected was evicted");
            return (counts, Some(delta));
        }
        Plan::Replay => {
            let first = checked_call(&mut svc, make_fixed()).await;
            assert!(
                !first.replayed,
                "the first call of the fixed operation runs"
            );
            for _ in 0..100 {
                assert!(checked_call(&mut svc, make_fixed()).await.replayed);
            }
            let watch = StoreWatch::new(store.expect("a store"));
            let window = Window::open();
            drive(&mut svc, &make_fixed, n).await;
            counts = window.close();
            assert!(
                checked_call(&mut svc, make_fixed()).await.replayed,
                "still a replay after the loop"
            );
            return (counts, Some(watch.delta()));
        }
    }
    (counts, None)
}

// --- The ledger alone (as benches/ledger.rs) -------------------------------------------

/// Keys of new operations, never reused (above every prefilled index).
static NEXT_FRESH: AtomicU64 = AtomicU64::new(1 << 40);

async fn record_weight() -> u64 {
    let store = MemoryStore::new();
    for i in 0..100 {
        begin_complete(&store, key(i), &outcome()).await;
    }
    store.run_pending_tasks().await;
    store.weighted_size() / store.entry_count()
}

/// `live` completed records in a store capped at their weight plus 2 %, as the ledger bench
/// builds it.
async fn filled_store(live: u64, outcome: &Outcome) -> MemoryStore {
    let weight = record_weight().await;
    let store = MemoryStore::builder()
        .max_bytes(live * weight * 102 / 100)
        .build();
    for i in 0..live {
        begin_complete(&store, key(i), outcome).await;
    }
    store.run_pending_tasks().await;
    assert_eq!(store.entry_count(), live, "the fill must not evict");
    store
}

async fn store_begin_complete(live: u64, n: u64) -> (Counts, Option<StoreDelta>) {
    let outcome = outcome();
    let store = filled_store(live, &outcome).await;
    // Past the 2 % headroom: from here on every new operation evicts one record.
    while store.evictions() < 100 {
        let fresh = NEXT_FRESH.fetch_add(1, Ordering::Relaxed);
        begin_complete(&store, key(fresh), &outcome).await;
    }
    let watch = StoreWatch::new(&store);
    let window = Window::open();
    for _ in 0..n {
        let fresh = NEXT_FRESH.fetch_add(1, Ordering::Relaxed);
        begin_complete(&store, key(fresh), &outcome).await;
    }
    let counts = window.close();
    let delta = watch.delta();
    assert_eq!(delta.refused, 0);
    assert!(delta.evictions >= n, "every new operation must evict");
    (counts, Some(delta))
}

async fn store_replay(live: u64, n: u64) -> (Counts, Option<StoreDelta>) {
    let store = filled_store(live, &outcome()).await;
    let mut warm_picker = Picker(0x0fed_cba9_8765_4321);
    for _ in 0..1_000 {
        replay(&store, key(warm_picker.next(live))).await;
    }
    // A fixed seed: the longer run's picks start with the shorter run's.
    let mut picker = Picker(0x1234_5678_9abc_def1);
    let watch = StoreWatch::new(&store);
    let window = Window::open();
    for _ in 0..n {
        replay(&store, key(picker.next(live))).await;
    }
    let counts = window.close();
    (counts, Some(watch.delta()))
}

/// `live` completed records in a moka ledger capped at their weight plus 2 %.
async fn filled_moka(live: u64, outcome: &Outcome) -> MokaLedger {
    let weight = MokaLedger::weight_of(None, outcome);
    let store = MokaLedger::new(live * weight * 102 / 100);
    for i in 0..live {
        begin_complete(&store, key(i), outcome).await;
    }
    store.run_pending_tasks();
    assert_eq!(store.entry_count(), live, "the fill must not evict");
    store
}

async fn moka_begin_complete(live: u64, n: u64) -> Counts {
    let outcome = outcome();
    let store = filled_moka(live, &outcome).await;
    // Past the 2 % headroom, so that every measured operation makes moka evict one.
    for _ in 0..live / 50 + 100 {
        let fresh = NEXT_FRESH.fetch_add(1, Ordering::Relaxed);
        begin_complete(&store, key(fresh), &outcome).await;
    }
    store.run_pending_tasks();
    let window = Window::open();
    for _ in 0..n {
        let fresh = NEXT_FRESH.fetch_add(1, Ordering::Relaxed);
        begin_complete(&store, key(fresh), &outcome).await;
    }
    let counts = window.close();
    store.run_pending_tasks();
    assert!(store.entry_count() <= live * 102 / 100, "moka must evict");
    counts
}

async fn moka_replay(live: u64, n: u64) -> Counts {
    let store = filled_moka(live, &outcome()).await;
    let mut warm_picker = Picker(0x0fed_cba9_8765_4321);
    for _ in 0..1_000 {
        replay(&store, key(warm_picker.next(live))).await;
    }
    let mut picker = Picker(0x1234_5678_9abc_def1);
    let window = Window::open();
    for _ in 0..n {
        replay(&store, key(picker.next(live))).await;
    }
    window.close()
}

fn sha256_1kib(n: u64) -> Counts {
    on_the_body(n, |body| {
        black_box(Sha256::digest(body));
    })
}

fn field_digests_1kib(n: u64) -> Counts {
    on_the_body(n, |body| {
        black_box(FieldDigests::of(body));
    })
}

/// `work` on the 1 KiB body, warmed up, then counted `n` times.
fn on_the_body(n: u64, work: impl Fn(&[u8])) -> Counts {
    let body = json_body(BODY_LEN);
    for _ in 0..1_000 {
        work(black_box(&body[..]));
    }
    let window = Window::open();
    for _ in 0..n {
        work(black_box(&body[..]));
    }
    window.close()
}

// --- The floor: the least a client layer does ------------------------------------------

/// `client_floor`, `client_floor_replay`, `stack_floor`: the floor over `inner`, its store
/// filled to its cap as the layer variants' are, then `n` operations made by `make` (new
/// ones, or with `replay` one operation recorded first and replayed).
async fn floor_variant<S>(
    inner: S,
    make: impl Fn() -> Request<Full<Bytes>>,
    fill: impl Fn() -> Request<Full<Bytes>>,
    replay: bool,
    n: u64,
) -> (Counts, Option<StoreDelta>)
where
    S: Service<Request<Full<Bytes>>, Response = Response<Full<Bytes>>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug,
{
    floor_in(inner, make, Some(fill), replay, n).await
}

/// `floor_variant`, its store filled to its cap by `fill`, or with `None` left below it as
/// the `_defaults` variants' stores are (`stack_floor_defaults`).
async fn floor_in<S>(
    inner: S,
    make: impl Fn() -> Request<Full<Bytes>>,
    fill: Option<impl Fn() -> Request<Full<Bytes>>>,
    replay: bool,
    n: u64,
) -> (Counts, Option<StoreDelta>)
where
    S: Service<Request<Full<Bytes>>, Response = Response<Full<Bytes>>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug,
{
    let store = MemoryStore::new();
    let at_cap = fill.is_some();
    if let Some(fill) = fill {
        let mut filler = FloorService {
            inner: inner.clone(),
            store: store.clone(),
        };
        fill_to_cap(&mut filler, &store, &fill).await;
    }
    let mut floor = Floor::new(inner, store.clone());
    if replay {
        floor.call(make()).await;
        floor.call(make()).await;
        assert_eq!(
            floor.replays, 1,
            "the second call of an operation is a replay"
        );
    }
    let (replays, watch) = (floor.replays, StoreWatch::new(&store));
    let window = Window::open();
    for _ in 0..n {
        let response = floor.call(make()).await;
        black_box(response.into_body().collect().await.is_ok());
    }
    let counts = window.close();
    let delta = watch.delta();
    assert_eq!(delta.refused, 0, "new operations were refused room");
    if replay {
        assert_eq!(floor.replays - replays, n, "every call must be a replay");
    } else {
        assert_eq!(floor.replays, replays, "no call may be a replay");
        if at_cap {
            assert!(
                delta.evictions >= n,
                "every new operation must evict a record"
            );
        } else {
            assert_eq!(
                delta.evictions, 0,
                "below its cap, the store evicts nothing"
            );
        }
    }
    (counts, Some(delta))
}

// --- Variants --------------------------------------------------------------------------

/// `inner` behind the hand-written `tower::retry` of `tower_retry_clone` (the stack floor's).
fn clone_retry<S: Clone>(inner: S) -> tower::retry::Retry<CloneAttempts, S> {
    ServiceBuilder::new()
        .layer(RetryLayer::new(CloneAttempts(3)))
        .service(inner)
}

/// The server layer over the bench handler with every setting at its default but
/// `unscoped()` (the bench's requests carry no `Authorization`), over `store`.
fn server_at_defaults(
    store: &MemoryStore,
) -> impl Service<
    Request<Full<Bytes>>,
    Response = Response<impl Body<Data = Bytes, Error: std::fmt::Debug>>,
    Error: std::fmt::Debug,
> {
    let layer = IdempotencyLayer::server_builder(store.clone())
        .unscoped()
        .build()
        .expect("the defaults are valid");
    ServiceBuilder::new().layer(layer).service(handler())
}

/// A new operation per call through the stack as `build_stack()` makes it with every
/// setting at its default, over `transport`.
async fn stack_at_defaults<S>(
    transport: S,
    fresh_op: impl Fn() -> Request<Full<Bytes>>,
    n: u64,
) -> (Counts, Option<StoreDelta>)
where
    S: Service<
            Request<Full<Bytes>>,
            Response = Response<Full<Bytes>>,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send,
{
    let store = MemoryStore::new();
    let stack = IdempotencyLayer::client_builder(store.clone())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .build_stack()
        .expect("the defaults are valid");
    let svc = ServiceBuilder::new().layer(stack).service(transport);
    service_variant(
        svc,
        Some(&store),
        Plan::FreshAtDefaults,
        &fresh_op,
        &fresh_op,
        n,
    )
    .await
}

fn live_records(suffix: &str) -> u64 {
    match suffix {
        "1k" => 1_000,
        "100k" => 100_000,
        "1m" => 1_000_000,
        other => panic!("unknown store size {other:?} (1k, 100k or 1m)"),
    }
}

fn run(variant: &str, n: u64) -> (Counts, Option<StoreDelta>) {
    let rt = runtime();
    let t = Template::new(BODY_LEN);
    let fresh_op = || t.fresh_operation();
    let fixed_op = || t.fixed_operation();
    let plain = || t.request();
    let read = || {
        let mut req = t.request();
        *req.method_mut() = http::Method::GET;
        req
    };
    rt.block_on(async {
        match variant {
            "bare" => service_variant(Noop, None, Plan::Plain, plain, plain, n).await,
            // The client layer's baseline: the bare service handed the same requests, each
            // with a fresh `OperationId` (the caller's to make, whatever it calls).
            "bare_op" => service_variant(Noop, None, Plan::Plain, fresh_op, fresh_op, n).await,
            "tower_retry_clone" => {
                let svc = ServiceBuilder::new()
                    .layer_fn(|inner| BufferBody { inner })
                    .layer(RetryLayer::new(CloneAttempts(3)))
                    .service(Noop);
                service_variant(svc, None, Plan::Plain, plain, plain, n).await
            }
            "tower_retry_clone_full" => {
                let svc = clone_retry(Noop);
                service_variant(svc, None, Plan::Plain, plain, plain, n).await
            }
            "frozen_retry" => {
                let svc = ServiceBuilder::new()
                    .layer(FrozenRetryLayer::new(RetryPolicy::default()))
                    .service(Noop);
                service_variant(svc, None, Plan::Plain, plain, plain, n).await
            }
            "frozen_retry_no_budget" => {
                let policy = RetryPolicy::builder()
                    .no_budget()
                    .build()
                    .expect("the default policy without a budget is valid");
                let svc = ServiceBuilder::new()
                    .layer(FrozenRetryLayer::new(policy))
                    .service(Noop);
                service_variant(svc, None, Plan::Plain, plain, plain, n).await
            }
            "stack_read" => {
                let svc = ServiceBuilder::new()
                    .layer(common::client_stack(MemoryStore::new()))
                    .service(Noop);
                service_variant(svc, None, Plan::Plain, read, read, n).await
            }
            "client_fresh" | "client_replay" => {
                let store = MemoryStore::new();
                let svc = ServiceBuilder::new()
                    .layer(common::client_layer(store.clone()))
                    .service(Noop);
                let plan = if variant == "client_fresh" {
                    Plan::Fresh
                } else {
                    Plan::Replay
                };
                service_variant(svc, Some(&store), plan, fresh_op, fixed_op, n).await
            }
            "stack_fresh" | "stack_replay" => {
                let store = MemoryStore::new();
                let svc = ServiceBuilder::new()
                    .layer(common::client_stack(store.clone()))
                    .service(Noop);
                let plan = if variant == "stack_fresh" {
                    Plan::Fresh
                } else {
                    Plan::Replay
                };
                service_variant(svc, Some(&store), plan, fresh_op, fixed_op, n).await
            }
            "stack_by_hand_fresh" => {
                let store = MemoryStore::new();
                let svc = ServiceBuilder::new()
                    .layer(common::client_layer(store.clone()))
                    .layer(FrozenRetryLayer::new(RetryPolicy::default()))
                    .service(Noop);
                service_variant(svc, Some(&store), Plan::Fresh, fresh_op, fixed_op, n).await
            }
            "client_fresh_defaults" => {
                let store = MemoryStore::new();
                let svc = ServiceBuilder::new()
                    .layer(IdempotencyLayer::client(
                        store.clone(),
                        ProviderKeys::Deduplicates,
                        KeyHeader::ietf(),
                    ))
                    .service(Noop);
                let plan = Plan::FreshAtDefaults;
                service_variant(svc, Some(&store), plan, fresh_op, fresh_op, n).await
            }
            "stack_fresh_defaults" => stack_at_defaults(Noop, fresh_op, n).await,
            "bare_op_waiting" => {
                service_variant(Waiting, None, Plan::Plain, fresh_op, fresh_op, n).await
            }
            "stack_fresh_waiting" => {
                let store = MemoryStore::new();
                let svc = ServiceBuilder::new()
                    .layer(common::client_stack(store.clone()))
                    .service(Waiting);
                service_variant(svc, Some(&store), Plan::Fresh, fresh_op, fixed_op, n).await
            }
            "stack_fresh_defaults_waiting" => stack_at_defaults(Waiting, fresh_op, n).await,
            "client_floor_waiting" => floor_variant(Waiting, fresh_op, fresh_op, false, n).await,
            "stack_floor_waiting" => {
                floor_variant(clone_retry(Waiting), fresh_op, fresh_op, false, n).await
            }
            "client_floor" => floor_variant(Noop, fresh_op, fresh_op, false, n).await,
            "client_floor_replay" => floor_variant(Noop, fixed_op, fresh_op, true, n).await,
            "stack_floor" => floor_variant(clone_retry(Noop), fresh_op, fresh_op, false, n).await,
            "stack_floor_defaults" => {
                let no_fill: Option<fn() -> Request<Full<Bytes>>> = None;
                floor_in(clone_retry(Noop), fresh_op, no_fill, false, n).await
            }
            "server_bare" => {
                let fresh_key = || t.fresh_key();
                service_variant(handler(), None, Plan::Plain, fresh_key, fresh_key, n).await
            }
            "server_fresh" | "server_replay" | "server_fresh_digest" | "server_replay_digest" => {
                let store = MemoryStore::new();
                let svc = ServiceBuilder::new()
                    .layer(common::server_layer(store.clone()))
                    .service(handler());
                let plan = if variant.starts_with("server_fresh") {
                    Plan::Fresh
                } else {
                    Plan::Replay
                };
                if variant.ends_with("_digest") {
                    let fresh_key = || t.fresh_key_with_digest();
                    let fixed_key = || t.fixed_key_with_digest();
                    service_variant(svc, Some(&store), plan, fresh_key, fixed_key, n).await
                } else {
                    let fresh_key = || t.fresh_key();
                    let fixed_key = || t.fixed_key();
                    service_variant(svc, Some(&store), plan, fresh_key, fixed_key, n).await
                }
            }
            "server_fresh_defaults" => {
                let store = MemoryStore::new();
                let fresh_key = || t.fresh_key();
                let (svc, plan) = (server_at_defaults(&store), Plan::FreshAtDefaults);
                service_variant(svc, Some(&store), plan, fresh_key, fresh_key, n).await
            }
            "server_bare_digest" => {
                let fresh_key = || t.fresh_key_with_digest();
                service_variant(handler(), None, Plan::Plain, fresh_key, fresh_key, n).await
            }
            "server_refused" => {
                // The default protected window: nothing the fill records may be evicted.
                let store = MemoryStore::builder().max_bytes(16 << 20).build();
                let svc = server_at_defaults(&store);
                let fresh_key = || t.fresh_key();
                service_variant(svc, Some(&store), Plan::Refused, fresh_key, fresh_key, n).await
            }
            "sha256_1kib" => (sha256_1kib(n), None),
            "field_digests_1kib" => (field_digests_1kib(n), None),
            "tool_bare" | "tool_fresh" | "tool_replay" | "tool_fresh_defaults" => {
                tool_variant(variant, n).await
            }
            other => {
                if let Some(size) = other.strip_prefix("store_begin_complete_") {
                    store_begin_complete(live_records(size), n).await
                } else if let Some(size) = other.strip_prefix("store_replay_") {
                    store_replay(live_records(size), n).await
                } else if let Some(size) = other.strip_prefix("moka_begin_complete_") {
                    (moka_begin_complete(live_records(size), n).await, None)
                } else if let Some(size) = other.strip_prefix("moka_replay_") {
                    (moka_replay(live_records(size), n).await, None)
                } else {
                    panic!("unknown variant {other:?}; `op_cost list` names them")
                }
            }
        }
    })
}

// --- The tool face ----------------------------------------------------------------------

/// A tool call's arguments, about as large as the HTTP variants' body once JSON.
#[derive(Clone, serde::Serialize, serde::Deserialize)]
struct ChargeArgs {
    order_id: String,
    amount_cents: u64,
    currency: String,
    summary: String,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Receipt {
    id: u64,
    captured: bool,
}

/// The no-op tool.
#[derive(Clone, Copy)]
struct NoopTool;

impl Service<ToolCall<ChargeArgs>> for NoopTool {
    type Response = Receipt;
    type Error = std::convert::Infallible;
    type Future = std::future::Ready<Result<Receipt, Self::Error>>;

    fn poll_ready(
        &mut self,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, call: ToolCall<ChargeArgs>) -> Self::Future {
        black_box(&call);
        std::future::ready(Ok(Receipt {
            id: 1,
            captured: true,
        }))
    }
}

async fn call_tool<S>(svc: &mut S, call: ToolCall<ChargeArgs>) -> S::Response
where
    S: Service<ToolCall<ChargeArgs>>,
    S::Error: std::fmt::Debug,
{
    svc.ready()
        .await
        .expect("ready")
        .call(call)
        .await
        .expect("call")
}

async fn tool_variant(variant: &str, n: u64) -> (Counts, Option<StoreDelta>) {
    let summary = "x".repeat(960);
    let args = || ChargeArgs {
        order_id: "order_42".to_owned(),
        amount_cents: 1999,
        currency: "eur".to_owned(),
        summary: summary.clone(),
    };
    let next = AtomicU64::new(0);
    let fresh = || {
        let step = next.fetch_add(1, Ordering::Relaxed).to_string();
        ToolCall::new(OperationId::new("bench-task", step), args())
    };
    let fixed = || ToolCall::new(OperationId::new("bench-task", "replayed-step"), args());
    if variant == "tool_bare" {
        let mut svc = NoopTool;
        for _ in 0..1_000 {
            black_box(call_tool(&mut svc, fresh()).await);
        }
        let window = Window::open();
        for _ in 0..n {
            black_box(call_tool(&mut svc, fresh()).await);
        }
        return (window.close(), None);
    }
    if variant == "tool_fresh_defaults" {
        let store = MemoryStore::new();
        let layer = ToolLayer::builder(store.clone(), "charge", ProviderKeys::Ignored)
            .build()
            .expect("the defaults are valid");
        let mut svc = layer.layer(NoopTool);
        for _ in 0..1_000 {
            black_box(call_tool(&mut svc, fresh()).await);
        }
        let watch = StoreWatch::new(&store);
        let window = Window::open();
        for _ in 0..n {
            black_box(call_tool(&mut svc, fresh()).await);
        }
        let counts = window.close();
        let delta = watch.delta();
        assert_eq!(delta.refused, 0, "new operations were refused room");
        assert_eq!(delta.evictions, 0, "a store below its cap evicts nothing");
        return (counts, Some(delta));
    }
    let store = MemoryStore::new();
    let policy = RetryPolicy::builder()
        .max_elapsed(Duration::ZERO)
        .build()
        .expect("valid policy");
    let layer = ToolLayer::builder(store.clone(), "charge", ProviderKeys::Ignored)
        .lease(common::BENCH_PROTECTION)
        .retry_policy(policy)
        .protected_window(common::BENCH_PROTECTION)
        .build()
        .expect("valid bench settings");
    let mut svc = layer.layer(NoopTool);
    const SETTLE: u64 = 1_000;
    while store.evictions() < SETTLE {
        assert_eq!(
            call_tool(&mut svc, fresh()).await.source(),
            ToolSource::Called
        );
    }
    assert_eq!(store.refused_claims(), 0, "the fill was refused room");
    std::thread::sleep(common::BENCH_PROTECTION + Duration::from_millis(10));
    if variant == "tool_fresh" {
        let watch = StoreWatch::new(&store);
        let window = Window::open();
        for _ in 0..n {
            black_box(call_tool(&mut svc, fresh()).await);
        }
        let counts = window.close();
        let delta = watch.delta();
        assert_eq!(delta.refused, 0, "new operations were refused room");
        assert!(
            delta.evictions >= n,
            "every new operation must evict a record"
        );
        return (counts, Some(delta));
    }
    assert_eq!(
        call_tool(&mut svc, fixed()).await.source(),
        ToolSource::Called
    );
    for _ in 0..100 {
        assert_eq!(
            call_tool(&mut svc, fixed()).await.source(),
            ToolSource::Replayed
        );
    }
    let watch = StoreWatch::new(&store);
    let window = Window::open();
    for _ in 0..n {
        black_box(call_tool(&mut svc, fixed()).await);
    }
    let counts = window.close();
    assert_eq!(
        call_tool(&mut svc, fixed()).await.source(),
        ToolSource::Replayed
    );
    (counts, Some(watch.delta()))
}

fn report(variant: &str, n: u64, counts: Counts, delta: Option<StoreDelta>) {
    let per_op = |x: u64| {
        if n == 0 {
            0.0
        } else {
            x as f64 / n as f64
        }
    };
    let (evictions, refused) = match delta {
        Some(d) => (d.evictions.to_string(), d.refused.to_string()),
        None => ("-".to_owned(), "-".to_owned()),
    };
    println!(
        "variant={variant} ops={n} allocs={} bytes={} allocs_per_op={:.3} bytes_per_op={:.1} evictions={evictions} refused={refused}",
        counts.allocs,
        counts.bytes,
        per_op(counts.allocs),
        per_op(counts.bytes),
    );
}

fn usage() -> ! {
    eprintln!("usage: op_cost list | op_cost <variant> <N> | op_cost allocs [N [variant...]]");
    std::process::exit(2)
}

fn check_variant(variant: &str) {
    if !VARIANTS.contains(&variant) {
        eprintln!("unknown variant {variant:?}; `op_cost list` names them");
        usage();
    }
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    match args.as_slice() {
        ["list"] => {
            for v in VARIANTS {
                println!("{v}");
            }
        }
        ["allocs", rest @ ..] => {
            // Natively, each variant in a process of its own (its report line is the answer).
            assert!(
                client_request(RUNNING_ON_VALGRIND) == 0,
                "run `allocs` natively, not under valgrind"
            );
            let n = rest.first().copied().unwrap_or("10000");
            n.parse::<u64>().unwrap_or_else(|_| usage());
            let variants = if rest.len() > 1 { &rest[1..] } else { VARIANTS };
            let me = std::env::current_exe().expect("own path");
            for &variant in variants {
                check_variant(variant);
                let status = Command::new(&me)
                    .args([variant, n])
                    .status()
                    .expect("run a variant");
                assert!(status.success(), "variant {variant} failed: {status}");
            }
        }
        [variant, n] => {
            check_variant(variant);
            let n: u64 = n.parse().unwrap_or_else(|_| usage());
            let (counts, delta) = run(variant, n);
            report(variant, n, counts, delta);
            // Skip tearing a million-record store down: nothing is left to measure.
            std::process::exit(0);
        }
        _ => usage(),
    }
}
