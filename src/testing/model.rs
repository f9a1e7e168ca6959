//! A reference model of the ledger protocol, and a checker that holds any store to it.
//!
//! [`Model`] is the protocol of the [ledger docs](crate::ledger) written as plainly as
//! possible: a map from abstract keys to records, no I/O, no clock but a number it is told
//! to move. Each [`Op`] (a `begin`, a settling write, or time passing) is answered with the
//! [`Answer`] the protocol prescribes. [`check`] (or [`try_check`]) runs a sequence of ops
//! against a real [`IdempotencyStore`] and the model side by side and fails at the first
//! answer they disagree on, naming the op, its index and both answers. Drive it from a
//! property test with random op sequences to search for sequences a store gets wrong.
//!
//! # What the model keeps
//!
//! Keys ([`Key`]), fingerprints ([`Fp`]), tokens ([`Token`]) and outcomes ([`OutcomeId`]) are
//! small abstract values; the checker maps each to a real [`LedgerKey`], [`FrozenRequest`]
//! (and its [`Fingerprint`]), [`LeaseToken`] and [`StoredResponse`]. A token stands for one
//! owner's claim: the test decides which tokens an owner brings, e.g. the same one again
//! to retry a `begin` whose reply was lost, or never again once that owner "crashed".
//!
//! Per key the model keeps a [`Record`] (or nothing: absent): the fingerprint it was first
//! claimed with, its retention deadline, and its [`State`] — in flight (owner token, lease
//! deadline, and whether the claim came from a resume), in doubt, or completed (outcome).
//!
//! # The rules, as the model applies them
//!
//! Time is a [`Duration`] since the model was made. A lease or retention deadline `d` has
//! passed once `now >= d`. A record whose retention deadline has passed is absent.
//!
//! `begin(key, fp, token, take_over)`:
//! 0. absent, and released under `token` (see `abandon` below) → [`Answer::Fenced`],
//!    nothing changes.
//! 1. absent → a new claim (which ends the key's released tokens, if any): in flight under `token`, lease `now + lease`, not resumed,
//!    retention `now + retention`, fingerprint `fp`. [`Answer::Acquired`].
//! 2. a record with another fingerprint → [`Answer::Drift`] (whatever its state).
//! 3. completed → [`Answer::Replay`] of its outcome.
//! 4. in flight under this same `token` (a retried `begin`, whether or not its lease ran
//!    out, probe or not) → the same claim again, unchanged: [`Answer::Acquired`], or
//!    [`Answer::Resume`] if the claim was a resume.
//! 5. in flight under another token with a live lease → [`Answer::Busy`] with the time the
//!    lease still runs.
//! 6. in doubt, or in flight under an expired lease: a probe (`take_over: false`) →
//!    [`Answer::InDoubt`], nothing changes; otherwise → in flight under `token`, lease
//!    `now + lease`, *resumed*, retention unchanged. [`Answer::Resume`].
//!
//! The writes succeed only for the token of an in-flight record (expired lease or not); any
//! other write — a stranger's, a stale owner's, one on an absent, in-doubt or completed
//! record — is [`Answer::Fenced`] and changes nothing:
//! - `complete` → completed with the outcome, retention `now + retention`.
//! - `abandon` → absent if the claim was never resumed; in doubt (retention unchanged) if
//!   it was, since an earlier attempt may have been sent.
//!
//! An `abandon` that releases its claim, or that finds the key absent (then answered
//! [`Answer::Fenced`]), also marks the key *released under its token* until one minute
//! after this release (every token released on the key stays marked till then): a late
//! `begin` of the released caller must not claim the key (rule 0).
//! - `mark_in_doubt` → in doubt, retention `max(retention, now + retention)`.
//! - `renew` → lease `now + lease`.
//!
//! `forget(key, kind, fingerprint, attempts, force)` is not fenced by a token but by what
//! the operator saw: absent → [`Answer::Absent`]; a record in another state kind, with
//! another fingerprint or another number of attempts (each claim and resume counts one) →
//! [`Answer::Changed`], nothing changes; in flight with a live lease and not `force` →
//! [`Answer::Live`] with the time the lease still runs, nothing changes; otherwise the
//! record is removed (absent, whatever its state) → [`Answer::Forgotten`].
//!
//! # What is compared
//!
//! Only what the protocol fixes: the answer's variant; the token handed out; the outcome a
//! replay returns (its status and body bytes); the fingerprint a drift reports and the
//! frozen request a drift or resume carries (by fingerprint). A [`Answer::Busy`] matches any
//! `retry_after` up to the lease, since a store with its own clock cannot be exact.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use tower_idempotency::ledger::MemoryStore;
//! use tower_idempotency::testing::model::{check, Answer, Fp, Key, Model, Op, OutcomeId, Token};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! let lease = Duration::from_secs(10);
//! let retention = Duration::from_secs(3600);
//! let (key, fingerprint) = (Key(0), Fp(0));
//! let (alice, bob) = (Token(1), Token(2));
//! let ops = [
//!     Op::Begin { key, fingerprint, token: alice, take_over: true },
//!     // Alice crashes; her lease runs out and Bob takes the operation over.
//!     Op::Advance(lease + Duration::from_secs(1)),
//!     Op::Begin { key, fingerprint, token: bob, take_over: true },
//!     Op::Complete { key, token: alice, outcome: OutcomeId(1) },
//!     Op::Complete { key, token: bob, outcome: OutcomeId(2) },
//!     Op::Begin { key, fingerprint, token: Token(3), take_over: true },
//! ];
//!
//! // The model on its own says what the protocol answers…
//! let mut model = Model::new(lease, retention);
//! let answers: Vec<Answer> = ops.iter().map(|op| model.apply(op)).collect();
//! assert_eq!(answers, [
//!     Answer::Acquired { token: alice },
//!     Answer::Ok,
//!     Answer::Resume { token: bob, frozen: fingerprint },
//!     Answer::Fenced,
//!     Answer::Ok,
//!     Answer::Replay(OutcomeId(2)),
//! ]);
//!
//! // …and `check` holds a store to it, moving the store's time with the given function.
//! check(&MemoryStore::new(), Model::new(lease, retention), &ops, tokio::time::advance).await;
//! # }
//! ```
//!
//! Stores with their own clock (Redis) advance with real sleeps instead
//! (`|by| tokio::time::sleep(by)`); keep every lease far from the moments the test looks at
//! it, so the time the calls themselves take never matters.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode, Version};

use crate::fingerprint::Fingerprint;
use crate::ledger::{
    Begin, BeginRequest, Expected, Forget, IdempotencyStore, LeaseToken, LedgerKey, Outcome,
    RecordKind, StoreError, StoredResponse,
};
use crate::FrozenRequest;

/// An abstract ledger key; the checker maps each to a fresh random [`LedgerKey`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(pub u8);

/// An abstract request payload; the checker maps each to a distinct [`FrozenRequest`]
/// (and so a distinct [`Fingerprint`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fp(pub u8);

/// An abstract owner token; the checker maps each to a distinct [`LeaseToken`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Token(pub u32);

/// An abstract outcome; the checker maps each to a distinct [`StoredResponse`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OutcomeId(pub u8);

/// One step of a sequence: a store call, or time passing.
///
/// Leases and retentions are the [`Model`]'s: every `begin` and `renew` asks for
/// [`Model::lease`], every `begin`, `complete` and `mark_in_doubt` for
/// [`Model::retention`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// [`IdempotencyStore::begin`] with the frozen request of `fingerprint`, under `token`;
    /// a probe when `take_over` is `false`.
    Begin {
        /// The record.
        key: Key,
        /// The request's payload.
        fingerprint: Fp,
        /// The token the caller would own the operation under.
        token: Token,
        /// `false` for a [probe](BeginRequest::probe).
        take_over: bool,
    },
    /// [`IdempotencyStore::complete`] with `outcome`.
    Complete {
        /// The record.
        key: Key,
        /// The writer's token.
        token: Token,
        /// What to record.
        outcome: OutcomeId,
    },
    /// [`IdempotencyStore::abandon`].
    Abandon {
        /// The record.
        key: Key,
        /// The writer's token.
        token: Token,
    },
    /// [`IdempotencyStore::mark_in_doubt`].
    MarkInDoubt {
        /// The record.
        key: Key,
        /// The writer's token.
        token: Token,
    },
    /// [`IdempotencyStore::renew`].
    Renew {
        /// The record.
        key: Key,
        /// The writer's token.
        token: Token,
    },
    /// [`IdempotencyStore::forget`], expecting the record as an operator saw it.
    Forget {
        /// The record.
        key: Key,
        /// The state kind expected.
        kind: RecordKind,
        /// The payload expected.
        fingerprint: Fp,
        /// The attempts expected.
        attempts: u32,
        /// Remove an in-flight record even under a live lease.
        force: bool,
    },
    /// Let this much time pass.
    Advance(Duration),
}

/// What the protocol answers an [`Op`] (and, in a [`Mismatch`], what a store answered).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// [`Begin::Acquired`] under `token`.
    Acquired {
        /// The new owner's token.
        token: Token,
    },
    /// [`Begin::Busy`]. A store's answer matches the model's with any `retry_after` up to
    /// the lease.
    Busy {
        /// How long the owner's lease still runs.
        retry_after: Duration,
    },
    /// [`Begin::Resume`] under `token`, with the frozen request first stored.
    Resume {
        /// The new owner's token.
        token: Token,
        /// The payload of the frozen request handed back.
        frozen: Fp,
    },
    /// [`Begin::InDoubt`]: a probe of an in-doubt operation.
    InDoubt,
    /// [`Begin::Replay`] of this outcome.
    Replay(OutcomeId),
    /// [`Begin::Drift`]: the record holds another payload (and its frozen request).
    Drift {
        /// The payload on record.
        stored: Fp,
    },
    /// A write that was applied, or time that passed.
    Ok,
    /// A write refused as [fenced](StoreError::is_fenced), having changed nothing.
    Fenced,
    /// [`Forget::Forgotten`]: the record was removed.
    Forgotten,
    /// [`Forget::Absent`]: there was no record.
    Absent,
    /// [`Forget::Changed`]: the record is not as expected; nothing changed.
    Changed,
    /// [`Forget::Live`]: in flight under a live lease; nothing changed. A store's answer
    /// matches the model's with any `lease_left` up to the lease.
    Live {
        /// How long the owner's lease still runs.
        lease_left: Duration,
    },
}

/// The state of a record the [`Model`] holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    /// An owner holds (or held, if the lease ran out and nobody took over) the operation.
    InFlight {
        /// The owner's token.
        token: Token,
        /// When the lease ends (model time).
        lease_until: Duration,
        /// Ownership came from a resume: an earlier attempt may have been sent, so the
        /// record can never be released.
        resumed: bool,
    },
    /// An attempt may have been sent; the next claim resumes.
    InDoubt,
    /// Done, with this outcome.
    Completed(OutcomeId),
}

/// A record the [`Model`] holds for a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Record {
    /// The payload the record was first claimed with.
    pub fingerprint: Fp,
    /// Where the operation stands.
    pub state: State,
    /// When the record is forgotten (model time).
    pub retain_until: Duration,
    /// Ownership handed out: the first claim and each resume.
    pub attempts: u32,
}

/// The reference model: the ledger protocol for abstract keys, on a clock it is told to move.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::testing::model::{Answer, Fp, Key, Model, Op, Token};
///
/// let mut model = Model::new(Duration::from_secs(10), Duration::from_secs(60));
/// let begin = |token| Op::Begin { key: Key(0), fingerprint: Fp(0), token, take_over: false };
/// assert_eq!(model.apply(&begin(Token(1))), Answer::Acquired { token: Token(1) });
/// // A probe never takes over, even once the owner's lease ran out.
/// model.apply(&Op::Advance(Duration::from_secs(10)));
/// assert_eq!(model.apply(&begin(Token(2))), Answer::InDoubt);
/// // The owner's own retry still finds its claim.
/// assert_eq!(model.apply(&begin(Token(1))), Answer::Acquired { token: Token(1) });
/// ```
#[derive(Clone, Debug)]
pub struct Model {
    lease: Duration,
    retention: Duration,
    now: Duration,
    records: BTreeMap<Key, Record>,
    /// Keys without a record released under some tokens, until a time: see rule 0.
    released: BTreeMap<Key, Released>,
}

/// The tokens an absent key was released under, and until when they are refused.
#[derive(Clone, Debug)]
struct Released {
    tokens: Vec<Token>,
    until: Duration,
}

/// How long a released token is refused after the key's last release (the stores' minute).
const RELEASED_FOR: Duration = crate::ledger::RELEASED_TOKEN_TTL;

impl Model {
    /// An empty ledger at time zero, whose ops ask for `lease` and `retention`.
    pub fn new(lease: Duration, retention: Duration) -> Self {
        Self {
            lease,
            retention,
            now: Duration::ZERO,
            records: BTreeMap::new(),
            released: BTreeMap::new(),
        }
    }

    /// The lease every `begin` and `renew` asks for.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The retention every `begin`, `complete` and `mark_in_doubt` asks for.
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// How much time has passed since the model was made.
    pub fn now(&self) -> Duration {
        self.now
    }

    /// The record held for `key`, if any (`None`: absent, or past its retention).
    pub fn record(&self, key: Key) -> Option<&Record> {
        self.records
            .get(&key)
            .filter(|record| record.retain_until > self.now)
    }

    /// Apply `op` and say what the protocol answers it.
    pub fn apply(&mut self, op: &Op) -> Answer {
        match *op {
            Op::Advance(by) => {
                self.now += by;
                Answer::Ok
            }
            Op::Begin {
                key,
                fingerprint,
                token,
                take_over,
            } => self.begin(key, fingerprint, token, take_over),
            Op::Complete {
                key,
                token,
                outcome,
            } => {
                let now = self.now;
                let retention = self.retention;
                let Some(record) = self.owned(key, token) else {
                    return Answer::Fenced;
                };
                record.state = State::Completed(outcome);
                record.retain_until = now + retention;
                Answer::Ok
            }
            Op::Abandon { key, token } => {
                let Some(record) = self.owned(key, token) else {
                    // Nothing of this token's to release; its `begin` may still be on its
                    // way, and must not claim the key when it arrives.
                    if self.record(key).is_none() {
                        self.release(key, token);
                    }
                    return Answer::Fenced;
                };
                if let State::InFlight { resumed: true, .. } = record.state {
                    record.state = State::InDoubt;
                } else {
                    self.records.remove(&key);
                    self.release(key, token);
                }
                Answer::Ok
            }
            Op::MarkInDoubt { key, token } => {
                let now = self.now;
                let retention = self.retention;
                let Some(record) = self.owned(key, token) else {
                    return Answer::Fenced;
                };
                record.state = State::InDoubt;
                record.retain_until = record.retain_until.max(now + retention);
                Answer::Ok
            }
            Op::Forget {
                key,
                kind,
                fingerprint,
                attempts,
                force,
            } => self.forget(key, kind, fingerprint, attempts, force),
            Op::Renew { key, token } => {
                let lease_until = self.now + self.lease;
                let Some(record) = self.owned(key, token) else {
                    return Answer::Fenced;
                };
                if let State::InFlight {
                    lease_until: lease, ..
                } = &mut record.state
                {
                    *lease = lease_until;
                }
                Answer::Ok
            }
        }
    }

    fn begin(&mut self, key: Key, fingerprint: Fp, token: Token, take_over: bool) -> Answer {
        self.forget_if_expired(key);
        let now = self.now;
        let lease = self.lease;
        let Some(record) = self.records.get_mut(&key) else {
            if self.is_released(key, token) {
                return Answer::Fenced;
            }
            self.released.remove(&key);
            self.records.insert(
                key,
                Record {
                    fingerprint,
                    state: State::InFlight {
                        token,
                        lease_until: now + lease,
                        resumed: false,
                    },
                    retain_until: now + self.retention,
                    attempts: 1,
                },
            );
            return Answer::Acquired { token };
        };
        if record.fingerprint != fingerprint {
            return Answer::Drift {
                stored: record.fingerprint,
            };
        }
        match record.state {
            State::Completed(outcome) => Answer::Replay(outcome),
            State::InFlight {
                token: owner,
                resumed,
                ..
            } if owner == token => {
                if resumed {
                    Answer::Resume {
                        token,
                        frozen: record.fingerprint,
                    }
                } else {
                    Answer::Acquired { token }
                }
            }
            State::InFlight { lease_until, .. } if lease_until > now => Answer::Busy {
                retry_after: lease_until - now,
            },
            _ if !take_over => Answer::InDoubt,
            _ => {
                record.state = State::InFlight {
                    token,
                    lease_until: now + lease,
                    resumed: true,
                };
                record.attempts += 1;
                Answer::Resume {
                    token,
                    frozen: record.fingerprint,
                }
            }
        }
    }

    fn forget(
        &mut self,
        key: Key,
        kind: RecordKind,
        fingerprint: Fp,
        attempts: u32,
        force: bool,
    ) -> Answer {
        self.forget_if_expired(key);
        let Some(record) = self.records.get(&key) else {
            return Answer::Absent;
        };
        let current = match record.state {
            State::InFlight { .. } => RecordKind::InFlight,
            State::InDoubt => RecordKind::InDoubt,
            State::Completed(_) => RecordKind::Completed,
        };
        if current != kind || record.fingerprint != fingerprint || record.attempts != attempts {
            return Answer::Changed;
        }
        match record.state {
            State::InFlight { lease_until, .. } if lease_until > self.now && !force => {
                Answer::Live {
                    lease_left: lease_until - self.now,
                }
            }
            _ => {
                self.records.remove(&key);
                Answer::Forgotten
            }
        }
    }

    /// Mark the absent `key` released under `token` (rule 0), every token it was released
    /// under until a minute from now.
    fn release(&mut self, key: Key, token: Token) {
        let until = self.now + RELEASED_FOR;
        let now = self.now;
        let released = self.released.entry(key).or_insert(Released {
            tokens: Vec::new(),
            until,
        });
        if released.until <= now {
            released.tokens.clear();
        }
        released.until = until;
        if !released.tokens.contains(&token) {
            released.tokens.push(token);
        }
    }

    /// Whether the absent `key` is released under `token` now.
    fn is_released(&self, key: Key, token: Token) -> bool {
        self.released
            .get(&key)
            .is_some_and(|released| released.until > self.now && released.tokens.contains(&token))
    }

    /// The record of `key`, if `token` owns it (in flight under that token).
    fn owned(&mut self, key: Key, token: Token) -> Option<&mut Record> {
        self.forget_if_expired(key);
        self.records.get_mut(&key).filter(
            |record| matches!(record.state, State::InFlight { token: owner, .. } if owner == token),
        )
    }

    fn forget_if_expired(&mut self, key: Key) {
        if self
            .records
            .get(&key)
            .is_some_and(|record| record.retain_until <= self.now)
        {
            self.records.remove(&key);
        }
    }
}

/// The first answer a store gave that the [`Model`] did not, from [`try_check`].
#[derive(Clone, Debug)]
pub struct Mismatch {
    /// The index of the op in the sequence.
    pub index: usize,
    /// The op.
    pub op: Op,
    /// What the model answered.
    pub expected: Answer,
    /// What the store answered, in the model's terms; `Err` describes an answer that has
    /// none (a store error other than fenced, an unknown token, a missing frozen request…).
    pub actual: Result<Answer, String>,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "op #{} {:?}: the model answers {:?}, the store answered ",
            self.index, self.op, self.expected
        )?;
        match &self.actual {
            Ok(answer) => write!(f, "{answer:?}"),
            Err(other) => f.write_str(other),
        }
    }
}

impl std::error::Error for Mismatch {}

/// Run `ops` against `store` and a fresh `model`, panicking at the first disagreement with
/// the op's index, the op and both answers. See [`try_check`].
pub async fn check<A, F>(store: &dyn IdempotencyStore, model: Model, ops: &[Op], advance: A)
where
    A: FnMut(Duration) -> F,
    F: Future<Output = ()>,
{
    if let Err(mismatch) = try_check(store, model, ops, advance).await {
        panic!("the store disagrees with the reference model: {mismatch}");
    }
}

/// Run `ops` against `store` and `model` side by side; the first disagreement is the error.
///
/// `model` must be fresh ([`Model::new`]): every key starts absent, on keys the checker
/// makes up (random [`LedgerKey`]s), so a shared backend's other data does not matter.
/// `advance` moves the store's clock for each [`Op::Advance`]: `tokio::time::advance` for a
/// store on tokio's paused clock, a real sleep for one with its own clock. On success the
/// model is handed back, in the state the store should be in.
pub async fn try_check<A, F>(
    store: &dyn IdempotencyStore,
    mut model: Model,
    ops: &[Op],
    mut advance: A,
) -> Result<Model, Mismatch>
where
    A: FnMut(Duration) -> F,
    F: Future<Output = ()>,
{
    assert!(
        model.records.is_empty() && model.now.is_zero(),
        "try_check needs a fresh Model"
    );
    let mut world = World::default();
    for (index, op) in ops.iter().enumerate() {
        let expected = model.apply(op);
        let actual = world.run(store, &model, op, &mut advance).await;
        let agree = match (&expected, &actual) {
            (Answer::Busy { .. }, Ok(Answer::Busy { retry_after })) => *retry_after <= model.lease,
            (Answer::Live { .. }, Ok(Answer::Live { lease_left })) => *lease_left <= model.lease,
            (expected, Ok(actual)) => expected == actual,
            (_, Err(_)) => false,
        };
        if !agree {
            return Err(Mismatch {
                index,
                op: op.clone(),
                expected,
                actual,
            });
        }
    }
    Ok(model)
}

/// The real values the abstract ones stand for, made on first use.
#[derive(Default)]
struct World {
    keys: HashMap<Key, LedgerKey>,
    tokens: HashMap<Token, LeaseToken>,
    token_names: HashMap<LeaseToken, Token>,
    requests: HashMap<Fp, FrozenRequest>,
    fingerprints: HashMap<Fingerprint, Fp>,
}

impl World {
    async fn run<A, F>(
        &mut self,
        store: &dyn IdempotencyStore,
        model: &Model,
        op: &Op,
        advance: &mut A,
    ) -> Result<Answer, String>
    where
        A: FnMut(Duration) -> F,
        F: Future<Output = ()>,
    {
        match *op {
            Op::Advance(by) => {
                advance(by).await;
                Ok(Answer::Ok)
            }
            Op::Begin {
                key,
                fingerprint,
                token,
                take_over,
            } => {
                let frozen = self.request(fingerprint);
                let mut request = BeginRequest::new(
                    self.key(key),
                    frozen.fingerprint(),
                    model.lease,
                    model.retention,
                )
                .with_frozen(frozen)
                .with_token(self.token(token));
                if !take_over {
                    request = request.probe();
                }
                match store.begin(request).await {
                    Ok(begin) => self.name_begin(begin),
                    Err(err) if err.is_fenced() => Ok(Answer::Fenced),
                    Err(err) => Err(format!("Err({err}) from begin")),
                }
            }
            Op::Complete {
                key,
                token,
                outcome,
            } => {
                let outcome = Outcome::Response(StoredResponse::new(
                    StatusCode::CREATED,
                    Version::HTTP_11,
                    HeaderMap::new(),
                    Bytes::from(format!("outcome-{}", outcome.0)),
                ));
                let written = store
                    .complete(self.key(key), self.token(token), outcome, model.retention)
                    .await;
                name_write(written)
            }
            Op::Abandon { key, token } => {
                name_write(store.abandon(self.key(key), self.token(token)).await)
            }
            Op::MarkInDoubt { key, token } => {
                let written = store
                    .mark_in_doubt(self.key(key), self.token(token), model.retention)
                    .await;
                name_write(written)
            }
            Op::Forget {
                key,
                kind,
                fingerprint,
                attempts,
                force,
            } => {
                let mut expected =
                    Expected::new(kind, self.request(fingerprint).fingerprint(), attempts);
                if force {
                    expected = expected.force();
                }
                match store.forget(self.key(key), expected).await {
                    Ok(Forget::Forgotten) => Ok(Answer::Forgotten),
                    Ok(Forget::Absent) => Ok(Answer::Absent),
                    Ok(Forget::Changed) => Ok(Answer::Changed),
                    Ok(Forget::Live { lease_left }) => Ok(Answer::Live { lease_left }),
                    Err(err) => Err(format!("Err({err}) from forget")),
                }
            }
            Op::Renew { key, token } => {
                let written = store
                    .renew(self.key(key), self.token(token), model.lease)
                    .await;
                name_write(written)
            }
        }
    }

    fn key(&mut self, key: Key) -> LedgerKey {
        *self.keys.entry(key).or_insert_with(|| {
            let mut bytes = [0u8; 32];
            fastrand::fill(&mut bytes);
            LedgerKey::from_bytes(bytes)
        })
    }

    fn token(&mut self, token: Token) -> LeaseToken {
        if let Some(real) = self.tokens.get(&token) {
            return *real;
        }
        let real = loop {
            let real = LeaseToken::generate();
            if !self.token_names.contains_key(&real) {
                break real;
            }
        };
        self.tokens.insert(token, real);
        self.token_names.insert(real, token);
        real
    }

    fn request(&mut self, fp: Fp) -> FrozenRequest {
        if let Some(frozen) = self.requests.get(&fp) {
            return frozen.clone();
        }
        let frozen = FrozenRequest::from_parts(
            Method::POST,
            "http://provider.local/model".parse().expect("static URI"),
            Version::HTTP_11,
            HeaderMap::new(),
            Bytes::from(format!("{{\"payload\":{}}}", fp.0)),
        );
        self.fingerprints.insert(frozen.fingerprint(), fp);
        self.requests.insert(fp, frozen.clone());
        frozen
    }

    fn name_token(&self, token: LeaseToken) -> Result<Token, String> {
        self.token_names
            .get(&token)
            .copied()
            .ok_or_else(|| format!("a token the test never sent ({token:?})"))
    }

    fn name_fingerprint(&self, fingerprint: Fingerprint) -> Result<Fp, String> {
        self.fingerprints
            .get(&fingerprint)
            .copied()
            .ok_or_else(|| format!("a fingerprint the test never sent ({fingerprint:?})"))
    }

    /// The payload of a frozen request a store handed back (`what` names the answer).
    fn name_frozen(&self, frozen: Option<FrozenRequest>, what: &str) -> Result<Fp, String> {
        let frozen = frozen.ok_or_else(|| format!("{what} without the stored frozen request"))?;
        let fp = self.name_fingerprint(frozen.fingerprint())?;
        if frozen.body() != self.requests[&fp].body() {
            return Err(format!("{what} with altered frozen bytes ({frozen:?})"));
        }
        Ok(fp)
    }

    fn name_begin(&self, begin: Begin) -> Result<Answer, String> {
        Ok(match begin {
            Begin::Acquired { token } => Answer::Acquired {
                token: self.name_token(token)?,
            },
            Begin::Busy { retry_after } => Answer::Busy { retry_after },
            Begin::Resume { token, frozen } => Answer::Resume {
                token: self.name_token(token)?,
                frozen: self.name_frozen(frozen, "Resume")?,
            },
            Begin::InDoubt => Answer::InDoubt,
            Begin::Replay(Outcome::Response(response)) => {
                let id = std::str::from_utf8(&response.body())
                    .ok()
                    .and_then(|body| body.strip_prefix("outcome-"))
                    .and_then(|id| id.parse().ok())
                    .filter(|_| response.status() == StatusCode::CREATED);
                match id {
                    Some(id) => Answer::Replay(OutcomeId(id)),
                    None => {
                        return Err(format!(
                            "Replay of an outcome never recorded ({response:?}, body {:?})",
                            response.body()
                        ))
                    }
                }
            }
            Begin::Replay(tombstone @ Outcome::Tombstone { .. }) => {
                return Err(format!(
                    "Replay({tombstone:?}) where a whole response was recorded"
                ))
            }
            Begin::Drift { stored, frozen } => {
                let stored = self.name_fingerprint(stored)?;
                let frozen = self.name_frozen(frozen, "Drift")?;
                if frozen != stored {
                    return Err(format!(
                        "Drift reporting {stored:?} on record but the frozen request of {frozen:?}"
                    ));
                }
                Answer::Drift { stored }
            }
            // A store that keeps only the fields of a completed operation's request: they
            // must be those of the payload on record.
            Begin::DriftFields { stored, fields } => {
                let stored = self.name_fingerprint(stored)?;
                let unchanged = fields.changed_fields(self.requests[&stored].body());
                if unchanged.as_deref() != Some(&[][..]) {
                    return Err(format!(
                        "DriftFields reporting {stored:?} on record but the fields of another \
                         payload ({fields:?}: {unchanged:?})"
                    ));
                }
                Answer::Drift { stored }
            }
        })
    }
}

fn name_write(written: Result<(), StoreError>) -> Result<Answer, String> {
    match written {
        Ok(()) => Ok(Answer::Ok),
        Err(err) if err.is_fenced() => Ok(Answer::Fenced),
        Err(err) => Err(format!("Err({err})")),
    }
}

impl fmt::Debug for World {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("World")
            .field("keys", &self.keys)
            .field("tokens", &self.tokens)
            .finish_non_exhaustive()
    }
}
