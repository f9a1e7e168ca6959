//! Settling an operation under its owner's token: completing it, or refusing a stale owner.

use std::time::Duration;

use tokio::time::Instant;

use super::budget::Sweep;
use super::record::{outcome_status, Record, Stamp, State};
use super::shared::{lock, Shard};
use super::store::MemoryStore;
use super::sync::{MutexGuard, Ordering};
use crate::ledger::{Expected, LeaseToken, LedgerKey, Outcome, Resolve, StoreError};

/// Why [`complete_in_place`](MemoryStore::complete_in_place) left an outcome out.
pub(super) enum Unkept {
    /// The budget has no room for it: the outcome, and the bytes missing.
    NoRoom(Outcome, u64),
    /// Its scope would pass its share of a store under pressure.
    OverShare(Outcome),
}

/// Why a completion kept a tombstone instead of its outcome.
#[derive(Clone, Copy)]
pub(super) enum Tombstoned {
    NoRoom,
    OverShare,
}

/// Who completes a record: its owner, by the token its lease is under, or an operator
/// resolving it as applied, by the look they took.
#[derive(Clone, Copy, Debug)]
pub(super) enum Completer {
    Owner(LeaseToken),
    Operator(Expected),
}

impl Completer {
    /// Whether this completer may complete `record` at `at`: the owner while its lease
    /// holds it, an operator while it is still the open record they saw.
    fn may_complete(&self, record: &Record, at: Stamp) -> bool {
        match self {
            Self::Owner(token) => record.is_owned(*token, at),
            Self::Operator(expected) => {
                record.retain_until > at
                    && expected.judge_resolve(Some(&record.view(at))).is_resolved()
            }
        }
    }
}

impl MemoryStore {
    /// The shard of `key`, locked, when `by` may complete its record at `now` (for a
    /// settlement that may remove the record or put another in its place); else fenced.
    pub(super) fn completable_shard(
        &self,
        key: &LedgerKey,
        by: Completer,
        now: Instant,
    ) -> Result<MutexGuard<'_, Shard>, StoreError> {
        let shard = lock(self.shard(key));
        if shard
            .records
            .get(key)
            .is_some_and(|record| by.may_complete(record, self.stamp(now)))
        {
            Ok(shard)
        } else {
            Err(StoreError::fenced())
        }
    }

    /// An operator's resolve of `key` as applied (see `IdempotencyStore::resolve`): judged
    /// under the shard's lock, then completed as its owner would complete it (room, shares
    /// and tombstones alike), each step re-judging the record under the lock it writes
    /// under, so nothing can move it in between unseen.
    pub(super) fn resolve_now(
        &self,
        key: LedgerKey,
        expected: Expected,
        outcome: Outcome,
        retention: Duration,
    ) -> Result<Resolve, StoreError> {
        let judged = self.judge_resolve(&key, &expected);
        if !judged.is_resolved() {
            return Ok(judged);
        }
        match self.complete_now(key, Completer::Operator(expected), outcome, retention) {
            Ok(()) => Ok(Resolve::Resolved),
            // It moved on between the judgement and the write: say how it stands now.
            Err(err) if err.is_fenced() => Ok(match self.judge_resolve(&key, &expected) {
                Resolve::Resolved => Resolve::Changed,
                refused => refused,
            }),
            Err(err) => Err(err),
        }
    }

    /// What a resolve of `key` as `expected` would do now.
    fn judge_resolve(&self, key: &LedgerKey, expected: &Expected) -> Resolve {
        let now = self.stamp(Instant::now());
        let shard = lock(self.shard(key));
        let current = shard
            .records
            .get(key)
            .filter(|record| record.retain_until > now)
            .map(|record| record.view(now));
        expected.judge_resolve(current.as_ref())
    }

    /// Run `settle` on the open record of `key` owned by `token` at `now`, or refuse as
    /// fenced: for a change to the record alone, looked up once to check the lease and to
    /// change it. `settle` is handed `now` as an instant and as a stamp, worked out once.
    pub(super) fn settle_record<T>(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        now: Instant,
        settle: impl FnOnce(&Self, &mut Record, Instant, Stamp) -> T,
    ) -> Result<T, StoreError> {
        self.settle_record_at(key, token, now, self.stamp(now), settle)
    }

    /// [`settle_record`](Self::settle_record) for a caller that has made `now`'s stamp
    /// already: `at` must be `self.stamp(now)`.
    pub(super) fn settle_record_at<T>(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        now: Instant,
        at: Stamp,
        settle: impl FnOnce(&Self, &mut Record, Instant, Stamp) -> T,
    ) -> Result<T, StoreError> {
        debug_assert_eq!(at, self.stamp(now), "`at` is `now` as a stamp");
        let mut shard = lock(self.shard(&key));
        match shard.records.get_mut(&key) {
            Some(record) if record.is_owned(token, at) => Ok(settle(self, record, now, at)),
            _ => Err(StoreError::fenced()),
        }
    }

    /// Complete `key`'s record with `outcome`, kept `retention`, if `by` may: fenced
    /// otherwise.
    pub(super) fn complete_now(
        &self,
        key: LedgerKey,
        by: Completer,
        mut outcome: Outcome,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let now = Instant::now();
        let at = self.stamp(now);
        let weight = outcome.weight() as u64;
        // The outcome takes the place of the reserve its claim kept, which in a store at
        // its cap (the steady state of a long-running process) needs room the claim did
        // not: make it first, so that the record is settled under one lock, not refused
        // and settled again. (Were the lease lost meanwhile, what this evicted was past
        // its protected window: evictable anyway.)
        let growth = Record::completion_growth(weight);
        let mut room = self.has_room(growth);
        // At the cap every new operation evicts a record. A completion that evicts also
        // makes the room the next claim will need (as large as the latest), so that claims
        // find room where they look first and the evicting happens here, under no shard
        // lock: a claim that has to evict looks its key up twice and moves its record.
        // Best effort, from the eviction index alone: a store full of protected records
        // must not sweep every shard on every completion for room nobody asked for yet.
        let headroom = self.inner.last_claim.load(Ordering::Relaxed);
        if !self.has_room(growth + headroom) {
            room = self.evict_until(growth + headroom, now, at, Sweep::Never)
                || self.has_room(growth)
                || self.make_room(growth, now, at);
        }
        if room {
            let left_out = {
                let mut shard = self.completable_shard(&key, by, now)?;
                let open = shard.records.get_mut(&key).expect("completable");
                self.complete_in_place(open, key, (outcome, weight), retention, at)
            };
            match left_out {
                Ok(()) => return Ok(()),
                Err(Unkept::OverShare(left)) => {
                    return self.complete_past_share(key, by, left, retention);
                }
                Err(Unkept::NoRoom(left, needed)) => {
                    // Other claims took the room meanwhile: evict once more.
                    outcome = left;
                    let now = Instant::now();
                    room = self.make_room(needed, now, self.stamp(now));
                }
            }
        }
        // No room for the whole outcome: settle for less.
        let now = Instant::now();
        let mut shard = self.completable_shard(&key, by, now)?;
        let open = shard.records.get_mut(&key).expect("completable");
        let (outcome, why) = if room {
            match self.complete_in_place(open, key, (outcome, weight), retention, self.stamp(now)) {
                Ok(()) => return Ok(()),
                Err(Unkept::NoRoom(outcome, _)) => (outcome, Tombstoned::NoRoom),
                Err(Unkept::OverShare(outcome)) => (outcome, Tombstoned::OverShare),
            }
        } else {
            (outcome, Tombstoned::NoRoom)
        };
        let whole = open.completed(outcome, retention, self.stamp(now));
        self.complete_as_tombstone(&mut shard, key, Box::new(whole), why);
        Ok(())
    }

    /// Complete `key` as a tombstone: its outcome would take its scope past its share of a
    /// store under pressure.
    fn complete_past_share(
        &self,
        key: LedgerKey,
        by: Completer,
        outcome: Outcome,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let now = Instant::now();
        let mut shard = self.completable_shard(&key, by, now)?;
        let open = shard.records.get_mut(&key).expect("completable");
        let done = open.completed(outcome, retention, self.stamp(now));
        self.complete_as_tombstone(&mut shard, key, Box::new(done), Tombstoned::OverShare);
        Ok(())
    }

    /// Complete the open `record` of `key` with `outcome` where it stands, if the budget
    /// has room for the outcome's bytes and its scope may take them; else hand the outcome
    /// back, saying why.
    pub(super) fn complete_in_place(
        &self,
        record: &mut Record,
        key: LedgerKey,
        (outcome, outcome_weight): (Outcome, u64),
        retention: Duration,
        at: Stamp,
    ) -> Result<(), Unkept> {
        // What can fail (an instant out of range panics) comes before anything is written,
        // so a panic leaves the record, the budget and the eviction order as they were.
        let protect_until = at + record.protection().min(retention);
        let retain_until = at + retention;
        let kept = record.kept.completed(record.open_kept_weight(), &outcome);
        let weight = record.completed_weight(outcome_weight, &kept);
        // Judged before the bytes are taken, on the reading of this moment: were the
        // completion judged only by the claims after it, a scope's open operations could
        // fill the store as they complete, however small their claims were.
        if self.over_share(record.bucket(), weight.saturating_sub(record.weight), at) {
            return Err(Unkept::OverShare(outcome));
        }
        if !self.reweigh(record.weight, weight) {
            return Err(Unkept::NoRoom(outcome, weight - record.weight));
        }
        self.inner.gauges.reweighed(record.weight, weight);
        self.scoped(record.bucket(), record.weight, weight);
        self.inner
            .completed_bytes
            .fetch_add(weight, Ordering::Relaxed);
        // An open record is not in the eviction order: only its completion enters it.
        lock(&self.inner.evictable).insert((protect_until, record.generation), key, weight);
        record.state = State::Completed {
            outcome,
            protect_until,
        };
        record.retain_until = retain_until;
        record.touched = at;
        record.weight = weight;
        record.kept = kept;
        Ok(())
    }

    /// Keep the fact that an operation is done when its outcome does not fit: a tombstone
    /// is never heavier than the claim it replaces (see [`TOMBSTONE_RESERVE`]).
    pub(super) fn complete_as_tombstone(
        &self,
        shard: &mut Shard,
        key: LedgerKey,
        mut done: Box<Record>,
        why: Tombstoned,
    ) {
        crate::idempotency::decision::raise_in_store(crate::idempotency::Signal::OutcomeDiscarded);
        match why {
            Tombstoned::NoRoom => tracing::warn!(
                max_bytes = self.inner.max_bytes,
                "the memory ledger has no room for an outcome; keeping a tombstone (the \
                 operation is done, but cannot be replayed)"
            ),
            // A flood completes many at once: warned of as refusals are, every 30 s.
            Tombstoned::OverShare => {
                let at = self.micros(Instant::now());
                if self.may_warn(&self.inner.warned_refusal, at) {
                    tracing::warn!(
                        max_bytes = self.inner.max_bytes,
                        scope_share = self.inner.scope_share,
                        "the memory ledger's protected records are past the high-water mark \
                         and an outcome would take its scope past its share; keeping a \
                         tombstone (the operation is done, but cannot be replayed)"
                    );
                }
            }
        }
        if let State::Completed { outcome, .. } = &mut done.state {
            *outcome = Outcome::Tombstone {
                status: outcome_status(outcome),
            };
        }
        done.weight = done.measure();
        if self.insert_if_room(shard, key, done).is_some() {
            unreachable!("a tombstone never outweighs the claim it replaces");
        }
    }
}
