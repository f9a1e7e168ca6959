//! Model-based tests: random sequences of ledger calls, owner crashes and clock advances,
//! run against each store and the reference model (`testing::model`) side by side.
//!
//! Each test draws `Vec<Step>`s (owners acting on a couple of keys), turns them into model
//! ops and checks the store agrees with the model on every answer. On failure it prints
//! the minimal failing sequence (after shrinking) and the seed: rerun with
//! `PROPTEST_RNG_SEED=<seed>` to reproduce it. `PROPTEST_CASES` overrides the case counts.
//!
//! - `MemoryStore` runs on tokio's paused clock, so leases and retention are exact.
//! - `RedisStore` (feature `redis`) runs against a real `redis-server` (see
//!   `support/redis.rs`; skipped with a notice without one, unless `REQUIRE_REDIS=1`).
//!   Redis judges leases by its own clock, so the test sleeps for real: a short lease, a
//!   few sleeps past it per case, and no retention expiry.
//! - `RedisStore` over Redis Cluster (feature `redis-cluster`) runs the same way against a
//!   local cluster of three primaries (see `support/redis_cluster.rs`); the two keys of a
//!   case land on any of them.
//! - `PostgresStore` (feature `postgres`) runs against a real PostgreSQL the test starts
//!   (see `support/postgres.rs`; skipped with a notice without one, unless
//!   `REQUIRE_POSTGRES=1`), each case in a schema of its own. PostgreSQL judges leases by
//!   its own clock too: the same real-time plan as Redis.
#![cfg(feature = "test-util")]

#[cfg(feature = "redis")]
use crate::support::redis as redis_support;

#[cfg(feature = "redis-cluster")]
use crate::support::redis_cluster as cluster_support;

#[cfg(feature = "postgres")]
use crate::support::postgres as postgres_support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed, TestCaseError, TestError, TestRunner};
use tower_idempotency::ledger::{MemoryStore, RecordKind};
use tower_idempotency::testing::model::{
    try_check, Answer, Fp, Key, Model, Op, OutcomeId, State, Token,
};

/// Callers; each holds its own tokens.
const OWNERS: u8 = 3;
/// Keys the callers share.
const KEYS: u8 = 2;

/// What a test case does, from the callers' point of view. Turned into model ops by
/// [`Plan::ops`], which decides the tokens.
#[derive(Clone, Copy, Debug)]
enum Step {
    /// `owner` begins on `key`, with a fresh token or the one it sent last on that key (a
    /// retry after a lost reply), as a probe or not, with the key's usual payload or another.
    Begin {
        owner: u8,
        key: u8,
        fresh: bool,
        probe: bool,
        drifted: bool,
    },
    /// `by` completes `key` (see [`writer`] for the token).
    Complete {
        by: Writer,
        key: u8,
        outcome: u8,
    },
    Abandon {
        by: Writer,
        key: u8,
    },
    MarkInDoubt {
        by: Writer,
        key: u8,
    },
    Renew {
        by: Writer,
        key: u8,
    },
    /// `by` asks the store to hold its lease on `key` (a store that holds leases says yes
    /// to the owning token).
    Hold {
        by: Writer,
        key: u8,
    },
    /// `by` lets go of its held lease on `key`.
    LetGo {
        by: Writer,
        key: u8,
    },
    /// An operator forgets `key`'s record as the model shows it now, or as a stale look
    /// showed it (one attempt earlier), or as a look at the key's record before this one
    /// showed it (`earlier_life`: alike in all but its generation), forcing a live lease or
    /// not.
    Forget {
        key: u8,
        stale: bool,
        earlier_life: bool,
        force: bool,
    },
    /// Time passes.
    Wait(Wait),
    /// `owner` crashes: every token it had is forgotten and never used again.
    Crash {
        owner: u8,
    },
}

/// Who writes.
#[derive(Clone, Copy, Debug)]
enum Writer {
    /// Whichever owner holds the key's claim now (if a live owner does; else `Owner(0)`).
    Holder,
    /// This owner, with whatever token it has for the key: maybe one that was taken over
    /// or settled since, or none (a stranger's token).
    Owner(u8),
}

#[derive(Clone, Copy, Debug)]
enum Wait {
    WithinLease,
    PastLease,
    PastRetention,
}

/// The durations of one store's tests.
#[derive(Clone, Copy, Debug)]
struct Plan {
    lease: Duration,
    retention: Duration,
    within_lease: Duration,
    past_lease: Duration,
    /// `None`: retention never expires in this store's test.
    past_retention: Option<Duration>,
    /// How many `PastLease` waits a case may make (the rest are dropped).
    max_past_lease: usize,
    /// Whether the store holds leases (`hold_lease`).
    holds: bool,
}

impl Plan {
    fn model(&self) -> Model {
        let model = Model::new(self.lease, self.retention);
        if self.holds {
            model.holding()
        } else {
            model
        }
    }

    /// The model ops `steps` stand for. Each owner keeps, per key, the token it sent last
    /// (`begin` retries reuse it) and the token it last got ownership under (its writes
    /// use it); a scratch model tells which `begin`s handed ownership out.
    fn ops(&self, steps: &[Step]) -> Vec<Op> {
        let mut model = self.model();
        let mut next_token = 0u32;
        let mut new_token = || {
            next_token += 1;
            Token(next_token)
        };
        let mut sent: HashMap<(u8, u8), Token> = HashMap::new();
        let mut held: HashMap<(u8, u8), Token> = HashMap::new();
        let mut past_lease = 0;
        let mut ops = Vec::with_capacity(steps.len());
        for step in steps {
            let op = match *step {
                Step::Begin {
                    owner,
                    key,
                    fresh,
                    probe,
                    drifted,
                } => {
                    let token = match sent.get(&(owner, key)) {
                        Some(token) if !fresh => *token,
                        _ => new_token(),
                    };
                    sent.insert((owner, key), token);
                    Op::Begin {
                        key: Key(key),
                        fingerprint: Fp(key * 2 + u8::from(drifted)),
                        token,
                        take_over: !probe,
                    }
                }
                Step::Complete { by, key, outcome } => Op::Complete {
                    key: Key(key),
                    token: writer(&model, &held, &sent, by, key, &mut new_token),
                    outcome: OutcomeId(outcome),
                },
                Step::Abandon { by, key } => Op::Abandon {
                    key: Key(key),
                    token: writer(&model, &held, &sent, by, key, &mut new_token),
                },
                Step::MarkInDoubt { by, key } => Op::MarkInDoubt {
                    key: Key(key),
                    token: writer(&model, &held, &sent, by, key, &mut new_token),
                },
                Step::Renew { by, key } => Op::Renew {
                    key: Key(key),
                    token: writer(&model, &held, &sent, by, key, &mut new_token),
                },
                Step::Hold { by, key } => Op::Hold {
                    key: Key(key),
                    token: writer(&model, &held, &sent, by, key, &mut new_token),
                },
                Step::LetGo { by, key } => Op::LetGo {
                    key: Key(key),
                    token: writer(&model, &held, &sent, by, key, &mut new_token),
                },
                Step::Forget {
                    key,
                    stale,
                    earlier_life,
                    force,
                } => {
                    let (life, kind, fingerprint, attempts) = match model.record(Key(key)) {
                        Some(record) => (
                            record.life - u32::from(earlier_life),
                            match record.state {
                                State::InFlight { .. } => RecordKind::InFlight,
                                State::InDoubt => RecordKind::InDoubt,
                                State::Completed(_) => RecordKind::Completed,
                            },
                            record.fingerprint,
                            record.attempts,
                        ),
                        None => (1, RecordKind::InFlight, Fp(key * 2), 1),
                    };
                    Op::Forget {
                        key: Key(key),
                        life,
                        kind,
                        fingerprint,
                        attempts: if stale {
                            attempts.saturating_sub(1)
                        } else {
                            attempts
                        },
                        force,
                    }
                }
                Step::Wait(Wait::WithinLease) => Op::Advance(self.within_lease),
                Step::Wait(Wait::PastLease) => {
                    if past_lease == self.max_past_lease {
                        continue;
                    }
                    past_lease += 1;
                    Op::Advance(self.past_lease)
                }
                Step::Wait(Wait::PastRetention) => match self.past_retention {
                    Some(by) => Op::Advance(by),
                    None => continue,
                },
                Step::Crash { owner } => {
                    sent.retain(|(who, _), _| *who != owner);
                    held.retain(|(who, _), _| *who != owner);
                    continue;
                }
            };
            if let (Op::Begin { key, token, .. }, Answer::Acquired { .. } | Answer::Resume { .. }) =
                (&op, model.apply(&op))
            {
                let owner = match step {
                    Step::Begin { owner, .. } => *owner,
                    _ => unreachable!("only a begin hands ownership out"),
                };
                held.insert((owner, key.0), *token);
            }
            ops.push(op);
        }
        ops
    }
}

/// The token `by` writes to `key` with. The holder: the token that owns the key's
/// in-flight record in the model, if an owner that did not crash holds it. An owner: the
/// token it got ownership of `key` under, else the one it last sent for `key`, else a
/// stranger's that never owned anything.
fn writer(
    model: &Model,
    held: &HashMap<(u8, u8), Token>,
    sent: &HashMap<(u8, u8), Token>,
    by: Writer,
    key: u8,
    new_token: &mut impl FnMut() -> Token,
) -> Token {
    let owner = match by {
        Writer::Holder => {
            let holder = match model.record(Key(key)).map(|record| record.state) {
                Some(State::InFlight { token, .. }) => Some(token),
                _ => None,
            };
            if let Some(token) = holder.filter(|token| held.values().any(|held| held == token)) {
                return token;
            }
            0
        }
        Writer::Owner(owner) => owner,
    };
    held.get(&(owner, key))
        .or_else(|| sent.get(&(owner, key)))
        .copied()
        .unwrap_or_else(new_token)
}

fn steps(max_len: usize, retention_waits: bool) -> impl Strategy<Value = Vec<Step>> {
    let owner = 0..OWNERS;
    let key = 0..KEYS;
    let begin = (
        owner.clone(),
        key.clone(),
        any::<bool>(),
        prop::bool::weighted(0.25),
        prop::bool::weighted(0.15),
    )
        .prop_map(|(owner, key, fresh, probe, drifted)| Step::Begin {
            owner,
            key,
            fresh,
            probe,
            drifted,
        });
    let by = prop_oneof![
        2 => Just(Writer::Holder),
        1 => owner.clone().prop_map(Writer::Owner),
    ];
    let complete = (by.clone(), key.clone(), 0..4u8)
        .prop_map(|(by, key, outcome)| Step::Complete { by, key, outcome });
    let abandon = (by.clone(), key.clone()).prop_map(|(by, key)| Step::Abandon { by, key });
    let mark = (by.clone(), key.clone()).prop_map(|(by, key)| Step::MarkInDoubt { by, key });
    let renew = (by.clone(), key.clone()).prop_map(|(by, key)| Step::Renew { by, key });
    let hold = (by.clone(), key.clone()).prop_map(|(by, key)| Step::Hold { by, key });
    let let_go = (by, key.clone()).prop_map(|(by, key)| Step::LetGo { by, key });
    let forget = (
        key,
        prop::bool::weighted(0.3),
        prop::bool::weighted(0.3),
        any::<bool>(),
    )
        .prop_map(|(key, stale, earlier_life, force)| Step::Forget {
            key,
            stale,
            earlier_life,
            force,
        });
    let wait = prop_oneof![
        3 => Just(Wait::WithinLease),
        3 => Just(Wait::PastLease),
        u32::from(retention_waits) => Just(Wait::PastRetention),
    ]
    .prop_map(Step::Wait);
    let crash = owner.prop_map(|owner| Step::Crash { owner });
    let step = prop_oneof![
        6 => begin,
        3 => complete,
        2 => abandon,
        2 => mark,
        2 => renew,
        2 => hold,
        1 => let_go,
        1 => forget,
        3 => wait,
        1 => crash,
    ];
    prop::collection::vec(step, 1..=max_len)
}

/// Run `case` on `default_cases` drawn sequences (or `PROPTEST_CASES`), with a seed that is
/// printed, and taken from `PROPTEST_RNG_SEED` when set.
fn run_property(
    name: &str,
    default_cases: u32,
    strategy: impl Strategy<Value = Vec<Step>>,
    plan: Plan,
    case: impl Fn(&[Op]) -> Result<(), TestCaseError>,
) {
    // `Config::default()` reads the PROPTEST_* variables.
    let defaults = Config::default();
    let cases = match std::env::var("PROPTEST_CASES") {
        Ok(_) => defaults.cases,
        Err(_) => default_cases,
    };
    let seed = match defaults.rng_seed {
        RngSeed::Fixed(seed) => seed,
        RngSeed::Random => fastrand::u64(..),
    };
    let config = Config {
        cases,
        rng_seed: RngSeed::Fixed(seed),
        // The seed is printed instead: no regression files in the source tree.
        failure_persistence: None,
        ..defaults
    };
    let started = Instant::now();
    let mut runner = TestRunner::new(config);
    let result = runner.run(&strategy, |steps| case(&plan.ops(&steps)));
    let elapsed = started.elapsed();
    match result {
        Ok(()) => eprintln!("{name}: {cases} cases passed in {elapsed:.2?} (seed {seed})"),
        Err(TestError::Fail(why, steps)) => panic!(
            "{name}: the store disagrees with the model (seed {seed}; rerun with \
             PROPTEST_RNG_SEED={seed}).\n{why}\n\n{}",
            listing(&plan, &steps)
        ),
        Err(TestError::Abort(why)) => {
            panic!("{name}: aborted (seed {seed}; rerun with PROPTEST_RNG_SEED={seed}): {why}")
        }
    }
}

/// The minimal failing steps, and the model ops they became with the model's answers.
fn listing(plan: &Plan, steps: &[Step]) -> String {
    let mut out = String::from("minimal failing steps:\n");
    for (index, step) in steps.iter().enumerate() {
        out += &format!("  {index:>2}: {step:?}\n");
    }
    out += "as model ops, with the model's answers:\n";
    let mut model = plan.model();
    for (index, op) in plan.ops(steps).iter().enumerate() {
        out += &format!("  #{index:>2}: {op:?} => {:?}\n", model.apply(op));
    }
    out
}

const MEMORY: Plan = Plan {
    lease: Duration::from_secs(10),
    retention: Duration::from_secs(60),
    within_lease: Duration::from_secs(3),
    past_lease: Duration::from_secs(15),
    past_retention: Some(Duration::from_secs(61)),
    max_past_lease: usize::MAX,
    holds: true,
};

#[test]
fn memory_store_follows_the_model() {
    run_property("MemoryStore", 256, steps(48, true), MEMORY, |ops| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            tokio::time::pause();
            // Far more room than any case needs: nothing is ever evicted.
            let store = MemoryStore::builder().max_bytes(1 << 30).build();
            try_check(&store, MEMORY.model(), ops, tokio::time::advance)
                .await
                .map(drop)
                .map_err(|mismatch| TestCaseError::fail(mismatch.to_string()))
        })
    });
}

/// Redis and PostgreSQL judge leases by their own (real) clock: sleep past a short lease,
/// never within it.
#[cfg(any(feature = "redis", feature = "postgres"))]
const REAL_TIME: Plan = Plan {
    lease: Duration::from_millis(300),
    retention: Duration::from_secs(600),
    within_lease: Duration::ZERO,
    past_lease: Duration::from_millis(450),
    past_retention: None,
    max_past_lease: 2,
    holds: false,
};

/// How far real time may run ahead of the model's before a case's timing is unreliable: a
/// lease set that late could still be live when the model says it ran out.
#[cfg(any(feature = "redis", feature = "postgres"))]
const MAX_LAG: Duration = Duration::from_millis(100);

#[cfg(feature = "redis")]
#[test]
fn redis_store_follows_the_model() {
    use tower_idempotency::ledger::RedisStore;

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let Some(redis) = runtime.block_on(redis_support::redis_url()) else {
        return;
    };
    let url = redis.url().to_owned();
    run_property("RedisStore", 16, steps(40, false), REAL_TIME, |ops| {
        runtime.block_on(async {
            let store = RedisStore::builder(url.as_str())
                .prefix(format!("model-test:{:016x}:", fastrand::u64(..)))
                .connect()
                .await
                .expect("connect to redis");
            check_in_real_time(&store, ops).await
        })
    });
    drop(redis);
}

#[cfg(feature = "redis-cluster")]
#[test]
fn redis_cluster_store_follows_the_model() {
    use tower_idempotency::ledger::RedisStore;

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let Some(cluster) = runtime.block_on(cluster_support::RedisCluster::spawn(3, 0)) else {
        return;
    };
    let urls = cluster.urls();
    run_property(
        "RedisStore over Redis Cluster",
        16,
        steps(40, false),
        REAL_TIME,
        |ops| {
            runtime.block_on(async {
                let store = RedisStore::cluster_builder(urls.iter().cloned())
                    .prefix(format!("model-test:{:016x}:", fastrand::u64(..)))
                    .connect()
                    .await
                    .expect("connect to the cluster");
                check_in_real_time(&store, ops).await
            })
        },
    );
    drop(cluster);
}

/// Check `ops` against a store whose clock is real time (Redis, PostgreSQL).
#[cfg(any(feature = "redis", feature = "postgres"))]
async fn check_in_real_time(
    store: &dyn tower_idempotency::ledger::IdempotencyStore,
    ops: &[Op],
) -> Result<(), TestCaseError> {
    use std::cell::Cell;
    // Real time should equal the model's: each advance sleeps until the model's
    // time, absorbing the time the calls took; `lag` records how far real time
    // had run ahead of the model's, at worst, while the calls ran.
    let start = tokio::time::Instant::now();
    let model_time = Cell::new(Duration::ZERO);
    let lag = Cell::new(Duration::ZERO);
    let note_lag = || {
        let behind =
            tokio::time::Instant::now().saturating_duration_since(start + model_time.get());
        lag.set(lag.get().max(behind));
    };
    let advance = |by: Duration| {
        note_lag();
        model_time.set(model_time.get() + by);
        tokio::time::sleep_until(start + model_time.get())
    };
    let checked = try_check(store, REAL_TIME.model(), ops, advance).await;
    note_lag();
    match checked {
        Ok(_) => Ok(()),
        Err(mismatch) if lag.get() > MAX_LAG => Err(TestCaseError::reject(format!(
            "real time ran {:?} ahead of the model's (the machine is too slow for a \
                     {:?} lease); not judging: {mismatch}",
            lag.get(),
            REAL_TIME.lease
        ))),
        Err(mismatch) => Err(TestCaseError::fail(mismatch.to_string())),
    }
}

#[cfg(feature = "postgres")]
#[test]
fn postgres_store_follows_the_model() {
    use tower_idempotency::ledger::PostgresStore;

    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let Some(pg) = runtime.block_on(postgres_support::postgres_url()) else {
        return;
    };
    let url = pg.url().to_owned();
    run_property("PostgresStore", 16, steps(40, false), REAL_TIME, |ops| {
        runtime.block_on(async {
            let store = PostgresStore::builder(url.as_str())
                .schema(postgres_support::fresh_schema())
                .pool_size(2)
                .sweep_every(None)
                .connect()
                .await
                .expect("connect to PostgreSQL");
            store.migrate().await.expect("migrate");
            check_in_real_time(&store, ops).await
        })
    });
    drop(pg);
}
