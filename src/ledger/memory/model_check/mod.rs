//! Every interleaving of the memory store's concurrent calls, checked with loom.
//!
//! Built only with `RUSTFLAGS="--cfg tower_idempotency_loom"` (see `.ci/run`): the store's
//! locks and atomics are then loom's (`sync.rs`), and each scenario below runs once per
//! interleaving of them, up to loom's partial-order reduction (interleavings that only
//! reorder independent steps are run once). Two or three threads call `begin`, `complete`,
//! `abandon`, `mark_in_doubt`, `renew`, `hold_lease` and `let_go` on one or two keys, wait
//! for a settle with `notify_settled`, or fight over a full budget; after every schedule:
//!
//! - **one owner, fencing**: the answers every thread got are those of the reference model
//!   (`testing::model`) run in *some* order of the calls that keeps each thread's own order
//!   (each call is atomic), followed by the final reads: a write by a token that lost the
//!   operation is refused as fenced and never shows in a replay, no two callers ever
//!   hold one key, and an owner whose lease is held is never overtaken;
//! - **no lost wake-up**: a waiter that subscribed before finding the operation busy is
//!   woken by its settle (a waiter left asleep is a deadlock loom reports), and finds the
//!   operation no longer busy;
//! - **budget**: the bytes counted equal the sum of the records' weights, never above the
//!   budget, and the eviction order holds exactly the completed records;
//! - **eviction**: a record in flight or inside its protected window is never evicted.
//!
//! Time does not move in these scenarios. The store reads `tokio::time::Instant`, which
//! without a runtime is the real clock: every lease, retention and protected window is
//! either zero (over as soon as it starts, or once let go if held, whatever the clock says
//! next) or hours long (never over while a scenario runs), so the real clock never changes
//! an answer and every schedule is deterministic, as loom needs.
//!
//! Each test prints how many schedules it explored: 61,244 in all across its twenty-five
//! runs (two claims sharing one eviction 31,734; eviction sparing open and protected
//! records 19,889, every schedule with up to two preemptions; two claims racing for one
//! eviction 7,599; racing claims 1,590; the take-over, hold, let-go and wake-up races 12 to
//! 51 each), in under two minutes on a 2-core CI machine.

use std::sync::atomic::AtomicUsize;

use std::sync::Arc as StdArc;

use std::task::{Context, Wake, Waker};

use std::time::Duration;

use bytes::Bytes;

use http::{HeaderMap, Method, StatusCode, Version};

use super::shared::lock;

use super::sync::Ordering;

use super::MemoryStore;

use crate::ledger::{
    Begin, BeginRequest, IdempotencyStore, LeaseToken, LedgerKey, Outcome, RecordState, StoreError,
    StoreFuture, StoredResponse,
};

use crate::testing::model::{Answer, Fp, Key, Model, Op, OutcomeId, Token};

use crate::FrozenRequest;

mod claims;
mod eviction;
mod holds;
mod wakeups;

/// A lease that is over as soon as it starts: its owner can be taken over at once.
const EXPIRED: Duration = Duration::ZERO;

/// A lease or retention that never ends while a scenario runs.
const LONG: Duration = Duration::from_secs(3600);

/// How far the real clock may move while one schedule runs.
const CLOCK_SLACK: Duration = Duration::from_secs(60);

/// The real key of an abstract one: `Key(n)` lands in shard `n % 64`, so `Key(0)` and
/// `Key(64)` share a shard (and its settle notifications).
fn ledger_key(key: Key) -> LedgerKey {
    LedgerKey::from_bytes([key.0; 32])
}

fn lease_token(token: Token) -> LeaseToken {
    LeaseToken::from_u128(u128::from(token.0))
}

fn frozen(fp: Fp) -> FrozenRequest {
    FrozenRequest::from_parts(
        Method::POST,
        "http://provider.local/charges".parse().expect("static URI"),
        Version::HTTP_11,
        HeaderMap::new(),
        Bytes::from(format!("{{\"payload\":{}}}", fp.0)),
    )
}

fn outcome(id: OutcomeId) -> Outcome {
    Outcome::Response(StoredResponse::new(
        StatusCode::CREATED,
        Version::HTTP_11,
        HeaderMap::new(),
        Bytes::from(format!("outcome-{}", id.0)),
    ))
}

/// The memory store answers every call on its first poll.
fn ready<T>(mut future: StoreFuture<'_, T>) -> Result<T, StoreError> {
    future
        .take_ready()
        .expect("the memory store answers without awaiting")
}

fn request(key: Key, token: Token, lease: Duration) -> BeginRequest {
    let frozen = frozen(Fp(0));
    BeginRequest::new(ledger_key(key), frozen.fingerprint(), lease, LONG)
        .with_frozen(frozen)
        .with_token(lease_token(token))
}

/// `op` on the store, its answer in the model's terms.
fn run(store: &MemoryStore, lease: Duration, op: &Op) -> Answer {
    let write = |written: Result<(), StoreError>| match written {
        Ok(()) => Answer::Ok,
        Err(err) if err.is_fenced() => Answer::Fenced,
        Err(err) => panic!("{op:?} failed: {err}"),
    };
    match *op {
        Op::Begin {
            key,
            fingerprint,
            token,
            take_over,
        } => {
            assert_eq!(fingerprint, Fp(0), "the scenarios use one payload");
            let mut request = request(key, token, lease);
            if !take_over {
                request = request.probe();
            }
            let begin = ready(store.begin(request)).unwrap_or_else(|err| panic!("{op:?}: {err}"));
            name_begin(begin)
        }
        Op::Complete {
            key,
            token,
            outcome: id,
        } => write(ready(store.complete(
            ledger_key(key),
            lease_token(token),
            outcome(id),
            LONG,
        ))),
        Op::Abandon { key, token } => {
            write(ready(store.abandon(ledger_key(key), lease_token(token))))
        }
        Op::MarkInDoubt { key, token } => write(ready(store.mark_in_doubt(
            ledger_key(key),
            lease_token(token),
            LONG,
        ))),
        Op::Renew { key, token } => write(ready(store.renew(
            ledger_key(key),
            lease_token(token),
            lease,
        ))),
        Op::Hold { key, token } => {
            if store.hold_lease(ledger_key(key), lease_token(token), lease) {
                Answer::Held
            } else {
                Answer::NotHeld
            }
        }
        Op::LetGo { key, token } => {
            store.let_go(ledger_key(key), lease_token(token), lease);
            Answer::Ok
        }
        Op::Advance(_) => unreachable!("time does not move in these scenarios"),
        // An operator's forget is checked by the conformance suite and the model-based
        // tests; no scenario here races one.
        Op::Forget { .. } => unreachable!("no scenario forgets a record"),
    }
}

fn name_begin(begin: Begin) -> Answer {
    let token = |token: LeaseToken| Token(u32::try_from(token.as_u128()).expect("a test token"));
    let frozen = |frozen: Option<FrozenRequest>| {
        let frozen = frozen.expect("the frozen request handed back");
        assert_eq!(
            frozen.body(),
            self::frozen(Fp(0)).body(),
            "frozen bytes altered"
        );
        Fp(0)
    };
    match begin {
        Begin::Acquired { token: t } => Answer::Acquired { token: token(t) },
        Begin::Busy { retry_after } => Answer::Busy { retry_after },
        Begin::Resume {
            token: t,
            frozen: f,
        } => Answer::Resume {
            token: token(t),
            frozen: frozen(f),
        },
        Begin::InDoubt => Answer::InDoubt,
        Begin::Replay(Outcome::Response(response)) => {
            let body = String::from_utf8(response.body().to_vec()).expect("utf-8 outcome");
            let id = body
                .strip_prefix("outcome-")
                .and_then(|id| id.parse().ok())
                .unwrap_or_else(|| panic!("a replay of an outcome never recorded: {body}"));
            Answer::Replay(OutcomeId(id))
        }
        Begin::Replay(tombstone) => {
            panic!("a tombstone where the whole outcome fits: {tombstone:?}")
        }
        Begin::Drift { .. } | Begin::DriftFields { .. } => {
            panic!("a drift where every call sends the same payload")
        }
    }
}

/// One caller: the calls it made and the answers it got, in its order.
struct Caller {
    store: MemoryStore,
    lease: Duration,
    history: Vec<(Op, Answer)>,
}

impl Caller {
    fn new(store: &MemoryStore, lease: Duration) -> Self {
        Self {
            store: store.clone(),
            lease,
            history: Vec::new(),
        }
    }

    fn call(&mut self, op: Op) -> Answer {
        let answer = run(&self.store, self.lease, &op);
        self.history.push((op, answer.clone()));
        answer
    }

    fn begin(&mut self, key: Key, token: Token) -> Answer {
        self.call(Op::Begin {
            key,
            fingerprint: Fp(0),
            token,
            take_over: true,
        })
    }

    fn probe(&mut self, key: Key, token: Token) -> Answer {
        self.call(Op::Begin {
            key,
            fingerprint: Fp(0),
            token,
            take_over: false,
        })
    }

    fn settle(&mut self, settle: Settle, key: Key, token: Token, id: OutcomeId) -> Answer {
        self.call(match settle {
            Settle::Complete => Op::Complete {
                key,
                token,
                outcome: id,
            },
            Settle::Abandon => Op::Abandon { key, token },
            Settle::MarkInDoubt => Op::MarkInDoubt { key, token },
            Settle::Renew => Op::Renew { key, token },
        })
    }
}

/// The writes an owner makes.
#[derive(Clone, Copy, Debug)]
enum Settle {
    Complete,
    Abandon,
    MarkInDoubt,
    Renew,
}

fn owns(answer: &Answer) -> bool {
    matches!(answer, Answer::Acquired { .. } | Answer::Resume { .. })
}

/// Panics unless the answers are those of the model run in some order of the threads'
/// calls that keeps each thread's own order (each call is atomic), after `before` and
/// followed by `after`.
fn assert_linearizable(
    lease: Duration,
    before: &[(Op, Answer)],
    threads: &[Vec<(Op, Answer)>],
    after: &[(Op, Answer)],
) {
    let mut model = Model::new(lease, LONG).holding();
    assert!(
        agree_in_order(&mut model, before),
        "the setup disagrees with the model: {before:?}"
    );
    let mut next = vec![0; threads.len()];
    assert!(
        some_order_agrees(&model, threads, &mut next, after),
        "no order of the calls gives these answers in the reference model\n\
         setup: {before:?}\nthreads: {threads:#?}\nthen: {after:?}"
    );
}

fn agrees(expected: &Answer, actual: &Answer, lease: Duration) -> bool {
    match (expected, actual) {
        // Up to the lease, give or take the time the scenario ran: the store reads its clock
        // before it takes the shard's lock, so a caller that read it before the owner
        // claimed (and was preempted) is told a little *more* than the lease.
        (Answer::Busy { .. }, Answer::Busy { retry_after }) => *retry_after <= lease + CLOCK_SLACK,
        (expected, actual) => expected == actual,
    }
}

fn agree_in_order(model: &mut Model, calls: &[(Op, Answer)]) -> bool {
    calls
        .iter()
        .all(|(op, actual)| agrees(&model.apply(op), actual, model.lease()))
}

fn some_order_agrees(
    model: &Model,
    threads: &[Vec<(Op, Answer)>],
    next: &mut [usize],
    after: &[(Op, Answer)],
) -> bool {
    let mut all_done = true;
    for thread in 0..threads.len() {
        let Some((op, actual)) = threads[thread].get(next[thread]) else {
            continue;
        };
        all_done = false;
        let mut model = model.clone();
        if !agrees(&model.apply(op), actual, model.lease()) {
            continue;
        }
        next[thread] += 1;
        let agreed = some_order_agrees(&model, threads, next, after);
        next[thread] -= 1;
        if agreed {
            return true;
        }
    }
    all_done && agree_in_order(&mut model.clone(), after)
}

/// The budget's books after a schedule: the bytes counted are the records' weights, within
/// the budget, and the eviction order holds exactly the completed records.
fn assert_books_balance(store: &MemoryStore) {
    let inner = &store.inner;
    let mut weights = 0;
    let mut completed = Vec::new();
    for shard in inner.shards.iter() {
        for (key, record) in lock(shard).records.iter() {
            weights += record.weight;
            if let Some((_, seq)) = record.eviction_place() {
                completed.push((*key, seq));
            }
        }
    }
    let used = inner.used.load(Ordering::Relaxed);
    assert_eq!(used, weights, "bytes counted against the records' weights");
    assert!(
        used <= inner.max_bytes,
        "{used} bytes over a budget of {}",
        inner.max_bytes
    );
    let mut ordered = Vec::new();
    let end_of_time = super::record::Stamp(u64::MAX);
    let mut index = lock(&inner.evictable);
    while let Some(entry) = index.pop_ended_by(end_of_time) {
        ordered.push(entry);
    }
    completed.sort();
    ordered.sort();
    assert_eq!(
        ordered, completed,
        "the eviction order against the completed records"
    );
}

/// On a store where every lease is [`EXPIRED`]: `setup` makes its calls (on `Key(0)`), then
/// `owner` runs while a rival claims `Key(0)` under `Token(2)` and completes it if it owns
/// it; a final read, and the answers checked against the model in some order of the two
/// threads' calls, which it returns (the owner's first).
fn race_a_rival(
    setup: impl FnOnce(&mut Caller),
    owner: impl FnOnce(&mut Caller) + Send + 'static,
) -> Vec<Vec<(Op, Answer)>> {
    let store = MemoryStore::new();
    let mut before = Caller::new(&store, EXPIRED);
    setup(&mut before);
    let owner = spawn(Caller::new(&store, EXPIRED), owner);
    let rival = spawn(Caller::new(&store, EXPIRED), |caller| {
        if owns(&caller.begin(Key(0), Token(2))) {
            caller.settle(Settle::Complete, Key(0), Token(2), OutcomeId(2));
        }
    });
    let threads = join(vec![owner, rival]);
    let mut reader = Caller::new(&store, EXPIRED);
    reader.probe(Key(0), Token(9));
    assert_linearizable(EXPIRED, &before.history, &threads, &reader.history);
    assert_books_balance(&store);
    threads
}

/// A waker loom can see: woken, it releases the waiting thread; a waiter never woken is a
/// deadlock loom reports. Cloning and dropping it touch nothing of loom's, since tokio's
/// watch channel clones and drops wakers under its own (`std`) locks.
struct Wakeup(loom::sync::Notify);

impl Wake for Wakeup {
    fn wake(self: StdArc<Self>) {
        self.0.notify();
    }

    fn wake_by_ref(self: &StdArc<Self>) {
        self.0.notify();
    }
}

/// Block this thread until `settled` completes.
fn wait(mut settled: crate::ledger::Settled) {
    let wakeup = StdArc::new(Wakeup(loom::sync::Notify::new()));
    let waker = Waker::from(wakeup.clone());
    let mut cx = Context::from_waker(&waker);
    while settled.as_mut().poll(&mut cx).is_pending() {
        wakeup.0.wait();
    }
}

/// Run `scenario` under every schedule loom tells apart (up to `preemptions` preemptions
/// per schedule, if bounded) and print how many that was.
fn explore(name: &str, preemptions: Option<usize>, scenario: impl Fn() + Send + Sync + 'static) {
    let schedules = StdArc::new(AtomicUsize::new(0));
    let counted = schedules.clone();
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = preemptions;
    builder.check(move || {
        counted.fetch_add(1, Ordering::Relaxed);
        scenario();
    });
    let schedules = schedules.load(Ordering::Relaxed);
    let bound = preemptions.map_or_else(
        || "every schedule".to_owned(),
        |bound| format!("every schedule with up to {bound} preemptions"),
    );
    eprintln!("model_check {name}: {schedules} schedules explored ({bound})");
}

fn spawn(
    mut caller: Caller,
    script: impl FnOnce(&mut Caller) + Send + 'static,
) -> loom::thread::JoinHandle<Vec<(Op, Answer)>> {
    loom::thread::spawn(move || {
        script(&mut caller);
        caller.history
    })
}

fn join(threads: Vec<loom::thread::JoinHandle<Vec<(Op, Answer)>>>) -> Vec<Vec<(Op, Answer)>> {
    threads
        .into_iter()
        .map(|thread| thread.join().expect("a caller panicked"))
        .collect()
}
