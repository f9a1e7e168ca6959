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
//! 0. released under `token` (see `abandon` below), whatever the key holds →
//!    [`Answer::Fenced`], nothing changes.
//! 1. absent → a new claim (which ends the key's released tokens, if any): in flight under
//!    `token`, lease `now + lease`, not resumed,
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
//! Every `abandon`, whatever it finds (its own claim, nothing, or a record another caller
//! holds, then answered [`Answer::Fenced`]), also marks the key *released under its token*
//! until one minute after this release (every token released on the key stays marked till
//! then, through any record's coming and going but a new claim's): a late `begin` of the
//! released caller must not claim the key, nor take it over, once that record has left
//! (rule 0).
//! - `mark_in_doubt` → in doubt, retention `max(retention, now + retention)`.
//! - `renew` → lease `now + lease`, no longer held.
//!
//! A model of a store that [holds leases](crate::ledger::IdempotencyStore::hold_lease)
//! ([`Model::holding`]) also answers `hold_lease` and `let_go`; in any other model both
//! change nothing (`hold_lease` answers [`Answer::NotHeld`]):
//! - `hold_lease` by the token of an in-flight record → held: its lease is a whole lease
//!   from every look (rules 5 and 6 and `forget` see it live, with the lease left, at least
//!   a nanosecond: a held lease of zero never reads as over) [`Answer::Held`]; by any other
//!   token → [`Answer::NotHeld`], nothing changes.
//! - `let_go` by the token of a held record → no longer held, lease `now + lease`; anything
//!   else changes nothing. Answered [`Answer::Ok`].
//! - a resume (rule 6) makes the new claim unheld.
//!
//! `forget(key, life, kind, fingerprint, attempts, force)` is not fenced by a token but by
//! what the operator saw: absent → [`Answer::Absent`]; a record of another life of the key
//! (the key's first record is life 1, the record created after it left life 2, …), in
//! another state kind, with another fingerprint or another number of attempts (each claim
//! and resume counts one) → [`Answer::Changed`], nothing changes; in flight with a live lease and not `force` →
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
    Begin, BeginRequest, Expected, Forget, Generation, IdempotencyStore, LeaseToken, LedgerKey,
    Outcome, RecordKind, StoreError, StoredResponse,
};

use crate::FrozenRequest;

mod checker;
mod rules;

pub use checker::{check, try_check, Mismatch};

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
    /// [`IdempotencyStore::hold_lease`].
    Hold {
        /// The record.
        key: Key,
        /// The owner's token.
        token: Token,
    },
    /// [`IdempotencyStore::let_go`].
    LetGo {
        /// The record.
        key: Key,
        /// The owner's token.
        token: Token,
    },
    /// [`IdempotencyStore::forget`], expecting the record as an operator saw it.
    Forget {
        /// The record.
        key: Key,
        /// The life of the key expected (see [`Record::life`]): the checker forgets with the
        /// [`Generation`] the store showed for that life, or with one it never showed.
        life: u32,
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
    /// A write that was applied, or time that passed (and every `let_go`).
    Ok,
    /// `hold_lease` answered `true`: the store holds the lease.
    Held,
    /// `hold_lease` answered `false`.
    NotHeld,
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
        /// The owner holds the lease until it lets go (a whole lease from every look).
        held: bool,
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
    /// Which record of its key this is: 1 for the key's first, one more for each record
    /// created after the one before left (forgotten, released, past its retention).
    pub life: u32,
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
    /// Whether the store holds leases (`hold_lease` can answer `true`).
    holds: bool,
    now: Duration,
    records: BTreeMap<Key, Record>,
    /// How many records each key has had: the last one's [`Record::life`].
    lives: BTreeMap<Key, u32>,
    /// Keys released under some tokens, until a time: see rule 0.
    released: BTreeMap<Key, Released>,
}

/// The tokens a key was released under, and until when they are refused.
#[derive(Clone, Debug)]
struct Released {
    tokens: Vec<Token>,
    until: Duration,
}

/// How long a released token is refused after the key's last release (the stores' minute).
const RELEASED_FOR: Duration = crate::ledger::RELEASED_TOKEN_TTL;
