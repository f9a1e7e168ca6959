//! A record, in whichever state, and what it weighs.

use std::time::Duration;

use crate::fingerprint::Fingerprint;
use crate::ledger::{
    BeginRequest, FieldDigests, Generation, LeaseToken, LedgerKey, Origin, Outcome, RecordKind,
    RecordState, RecordView, RequestFields,
};
use crate::FrozenRequest;

/// What a record costs besides its own fields and the requests and responses it holds: its
/// map slot (a key and a pointer) at the map's load factor, its eviction-index entry and the
/// allocator's rounding of its box (a recorded response weighs its own allocations:
/// `StoredResponse::weight`). Calibrated with `benches/memory_footprint.rs`: with it, a
/// million small server records grow the process by about the budget (a map emptier than
/// there, just past a doubling, costs up to ~50 bytes a record more).
pub(super) const PER_RECORD_OVERHEAD: u64 = 128;

/// Kept free in every open record's weight, so that completing it can always fall back to
/// a tombstone without needing a byte more than the claim already holds.
pub(super) const TOMBSTONE_RESERVE: u64 = 16;

/// A point in a record's life, in nanoseconds since its store's epoch: 8 bytes where an
/// `Instant` takes 16, and a record holds four. Adding a duration saturates: a retention of
/// more than five centuries is kept as long as the process lives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct Stamp(pub(super) u64);

impl Stamp {
    /// The time from `earlier` to this, or zero.
    pub(super) fn since(self, earlier: Stamp) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }

    pub(super) fn micros(self) -> u64 {
        self.0 / 1_000
    }
}

impl std::ops::Add<Duration> for Stamp {
    type Output = Stamp;

    fn add(self, duration: Duration) -> Stamp {
        let nanos = u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX);
        Stamp(self.0.saturating_add(nanos))
    }
}

/// A record, in whichever state. Boxed in its shard, in an allocation of 160 bytes: keep it
/// there (its box grows by 16 bytes past each multiple of 16, less the allocator's 8). A
/// larger one takes glibc's costlier allocation path: kept inline, the [`Origin`] cost a
/// fresh operation ~0.9k instructions more than out of line.
///
/// Laid out in this order (`repr(C)`, no padding but the tail's): a list reads every
/// record's place, retention, scope and state, one cache miss each at a million records,
/// so they come first, within the record's first line or two.
#[derive(Debug)]
#[repr(C)]
pub(super) struct Record {
    /// Which life of its key this is: the store's sequence number at the claim that
    /// created it, kept through every transition (an operator's look names it, so a look
    /// at an earlier life never forgets this one). Unique in the store, so it also tells
    /// completed records apart in the eviction index, and orders a list.
    pub(super) generation: u64,
    /// When the record's retention ends.
    pub(super) retain_until: Stamp,
    /// The digest of the scope the key belongs to ([`scope_id`](crate::ledger::scope_id),
    /// `0`: none): a list finds a scope's records by it, and the scope's bytes are counted
    /// in its [`bucket`](Self::bucket).
    pub(super) scope: u64,
    pub(super) state: State,
    /// When the operation was first claimed.
    pub(super) created: Stamp,
    /// When the record last changed state: claimed, resumed, marked in doubt, completed (a
    /// renewal or a hold is no change of state). A list shows how long ago.
    pub(super) touched: Stamp,
    /// Bytes counted against the budget.
    pub(super) weight: u64,
    /// What is kept of the request.
    pub(super) kept: Kept,
    pub(super) fingerprint: Fingerprint,
    /// What the record is of, as its claim named it ([`BeginRequest::named_origin`]): out
    /// of line, so that the record keeps its 160-byte allocation, the origin taking one of
    /// 64 (its operation's ids shared with the face's [`OperationId`](crate::OperationId)).
    pub(super) origin: Option<Box<Origin>>,
    /// Ownership handed out: the first claim and each resume.
    pub(super) attempts: u32,
    /// How long a completion of this record stays protected from eviction, in ms rounded
    /// up ([`protection`](Self::protection)): four bytes beside `attempts`, where eight
    /// would take the room the origin's pointer has.
    pub(super) protected_ms: u32,
}

#[derive(Debug)]
pub(super) enum State {
    /// An owner holds the lease. `resumed`: ownership came from a resume, so an earlier
    /// attempt may have been sent and the record can never be released.
    InFlight {
        token: HeldToken,
        /// When the lease ends; while `held`, the lease's length (in ns since the epoch's
        /// start: a length), since a held lease has no end: see [`lease_end`].
        lease_until: Stamp,
        resumed: bool,
        /// The owner holds the lease until it lets go
        /// ([`hold_lease`](crate::ledger::IdempotencyStore::hold_lease)), instead of
        /// renewing it.
        held: bool,
    },
    /// An attempt may have been sent; the next claim resumes.
    InDoubt,
    /// Done; replayed until its retention ends. Never evicted before `protect_until`.
    Completed {
        outcome: Outcome,
        protect_until: Stamp,
    },
}

/// When an in-flight lease ends, seen at `now`: `lease_until` (its claim's or its last
/// renewal's end), or a whole lease from `now` while its owner holds it (`lease_until` is
/// then the lease's length).
pub(super) fn lease_end(lease_until: Stamp, held: bool, now: Stamp) -> Stamp {
    if held {
        Stamp(now.0.saturating_add(lease_until.0))
    } else {
        lease_until
    }
}

/// A lease's length as a held lease keeps it (see [`State::InFlight`]): at least a
/// nanosecond, so that a held lease never shows as over, whatever length it was given (a
/// lease of zero, which only a caller of the store itself can ask for, would otherwise end
/// the moment it is held and let a second caller take over a live owner).
pub(super) fn held_length(lease: Duration) -> Stamp {
    Stamp(u64::try_from(lease.as_nanos()).unwrap_or(u64::MAX).max(1))
}

impl State {
    pub(super) fn is_owned_by(&self, owner: LeaseToken) -> bool {
        matches!(self, Self::InFlight { token, .. } if *token == HeldToken::from(owner))
    }
}

const _: () = assert!(std::mem::size_of::<Record>() <= 152);

/// A protection window as a record keeps it: in milliseconds, rounded up, and `u32::MAX`
/// (about 49 days or more) for the whole retention. Never shorter than asked: a longer
/// protection can only fill the store sooner, and a full store refuses new operations; a
/// shorter one could evict a completion a retry still needs.
fn protection_ms(window: Duration) -> u32 {
    let ms = window.as_nanos().div_ceil(1_000_000);
    u32::try_from(ms).unwrap_or(u32::MAX)
}

/// A [`LeaseToken`] as a record holds it: two words, aligned as words (a `u128` is aligned
/// to 16 bytes, which would pad every record to a multiple of 16).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct HeldToken([u64; 2]);

impl From<LeaseToken> for HeldToken {
    fn from(token: LeaseToken) -> Self {
        let value = token.as_u128();
        Self([(value >> 64) as u64, value as u64])
    }
}

impl From<HeldToken> for LeaseToken {
    fn from(HeldToken([high, low]): HeldToken) -> Self {
        LeaseToken::from_u128(u128::from(high) << 64 | u128::from(low))
    }
}

impl Record {
    /// Where a completed record stands in the eviction index: the end of its protection
    /// and its generation (which tells this life of the key from a later one). Open
    /// records are not in it.
    pub(super) fn eviction_place(&self) -> Option<(Stamp, u64)> {
        match self.state {
            State::Completed { protect_until, .. } => Some((protect_until, self.generation)),
            _ => None,
        }
    }

    /// The bucket of the scope's bytes this record counts in (`0`: no scope).
    pub(super) fn bucket(&self) -> u16 {
        scope_bucket(self.scope)
    }

    /// What kind of record this is, as its view would say.
    pub(super) fn kind(&self) -> RecordKind {
        match self.state {
            State::InFlight { .. } => RecordKind::InFlight,
            State::InDoubt => RecordKind::InDoubt,
            State::Completed { .. } => RecordKind::Completed,
        }
    }

    /// How long a completion of this record stays protected from eviction (at most its
    /// retention: see [`protection_ms`]).
    pub(super) fn protection(&self) -> Duration {
        match self.protected_ms {
            u32::MAX => Duration::MAX,
            ms => Duration::from_millis(u64::from(ms)),
        }
    }

    /// Whether `token`'s lease holds this record at `now` (a record past its retention is
    /// gone, whatever it still holds).
    pub(super) fn is_owned(&self, token: LeaseToken, now: Stamp) -> bool {
        self.retain_until > now && self.state.is_owned_by(token)
    }

    /// A new life of `request`'s key, claimed at `now`: its `generation` is the store's
    /// next sequence number.
    pub(super) fn claim(request: &BeginRequest, now: Stamp, generation: u64) -> Box<Self> {
        let mut record = Box::new(Self {
            fingerprint: request.fingerprint,
            kept: request.frozen.clone().map_or(Kept::Nothing, Kept::Frozen),
            state: State::InFlight {
                token: request.token.into(),
                lease_until: now + request.lease,
                resumed: false,
                held: false,
            },
            retain_until: now + request.retention,
            protected_ms: protection_ms(request.protected_window()),
            weight: 0,
            created: now,
            touched: now,
            generation,
            attempts: 1,
            scope: request.scope,
            origin: request.named_origin().map(Box::new),
        });
        record.weight = record.measure();
        record
    }

    /// This (open) record, completed with `outcome`, keeping nothing of its request but
    /// that there was one (see [`Kept::Unnamed`]): for a tombstone, which takes this
    /// record's place (its origin moves to it).
    pub(super) fn completed(&mut self, outcome: Outcome, retention: Duration, now: Stamp) -> Self {
        let kept = match self.kept {
            Kept::Frozen(_) => Kept::Unnamed,
            _ => Kept::Nothing,
        };
        let mut done = Self {
            fingerprint: self.fingerprint,
            kept,
            state: State::Completed {
                outcome,
                protect_until: now + self.protection().min(retention),
            },
            retain_until: now + retention,
            protected_ms: self.protected_ms,
            weight: 0,
            created: self.created,
            touched: now,
            generation: self.generation,
            attempts: self.attempts,
            scope: self.scope,
            origin: self.origin.take(),
        };
        done.weight = done.measure();
        done
    }

    /// This (open) record's weight once completed with an outcome of `outcome_weight`,
    /// keeping `kept` of its request: its frozen request gives way to `kept`, and the reserve
    /// it kept for a tombstone to the outcome.
    pub(super) fn completed_weight(&self, outcome_weight: u64, kept: &Kept) -> u64 {
        self.weight - self.open_kept_weight() + kept.weight() - TOMBSTONE_RESERVE + outcome_weight
    }

    /// What this open record's [`Kept`] weighs, from its weight (see
    /// [`measure`](Self::measure)) rather than measured again.
    pub(super) fn open_kept_weight(&self) -> u64 {
        debug_assert!(!matches!(self.state, State::Completed { .. }));
        debug_assert_eq!(
            self.weight - self.fixed_weight() - TOMBSTONE_RESERVE,
            self.kept.weight()
        );
        self.weight - self.fixed_weight() - TOMBSTONE_RESERVE
    }

    /// What every record weighs besides its origin and what it keeps of its request and its
    /// outcome.
    pub(super) const FIXED_WEIGHT: u64 = PER_RECORD_OVERHEAD
        + (std::mem::size_of::<LedgerKey>() + std::mem::size_of::<Self>()) as u64;

    /// What this record weighs besides what it keeps of its request and its outcome: the
    /// [fixed weight](Self::FIXED_WEIGHT) and its origin's.
    fn fixed_weight(&self) -> u64 {
        Self::FIXED_WEIGHT + self.origin.as_deref().map_or(0, Origin::weight)
    }

    /// The most completing an open record with an outcome of `outcome_weight` adds to the
    /// budget ([`completed_weight`](Self::completed_weight) less the open weight: what is
    /// kept of the request never outweighs the frozen request), known before the record is
    /// looked up.
    pub(super) fn completion_growth(outcome_weight: u64) -> u64 {
        outcome_weight.saturating_sub(TOMBSTONE_RESERVE)
    }

    /// The digests of the top-level fields of this completed record's request, wherever
    /// they are kept (see [`Kept`]); [unnamed](FieldDigests::unnamed) ones for a request
    /// whose fields cannot be named.
    pub(super) fn field_digests(&self) -> Option<FieldDigests> {
        match (&self.kept, &self.state) {
            (Kept::Fields(fields), _) => Some(fields.clone()),
            (Kept::Unnamed, _) => Some(FieldDigests::unnamed()),
            (Kept::InOutcome, State::Completed { outcome, .. }) => match outcome {
                Outcome::Response(response) => match response.request_fields() {
                    RequestFields::Entries(entries) => Some(FieldDigests::from_entries(entries)),
                    _ => None,
                },
                Outcome::Tombstone { .. } => None,
            },
            _ => None,
        }
    }

    /// The record as [`inspect`](crate::ledger::IdempotencyStore::inspect) shows it at
    /// `now`.
    pub(super) fn view(&self, now: Stamp) -> RecordView {
        let state = match &self.state {
            State::InFlight {
                lease_until,
                resumed,
                held,
                ..
            } => RecordState::InFlight {
                lease_left: lease_end(*lease_until, *held, now).since(now),
                may_have_been_sent: *resumed,
            },
            State::InDoubt => RecordState::InDoubt,
            State::Completed { outcome, .. } => RecordState::Completed {
                status: outcome_status(outcome),
            },
        };
        RecordView::new(
            state,
            self.fingerprint,
            self.attempts,
            Generation::from_u64(self.generation),
            now.since(self.created),
            self.retain_until.since(now),
        )
        .with_touched(now.since(self.touched))
        .with_scope(self.scope)
        .with_origin(self.origin.as_deref().cloned())
    }

    pub(super) fn measure(&self) -> u64 {
        let kept = self.kept.weight();
        let state = match &self.state {
            State::Completed { outcome, .. } => outcome.weight() as u64,
            _ => TOMBSTONE_RESERVE,
        };
        self.fixed_weight() + kept + state
    }
}

/// What a record keeps of its request.
#[derive(Debug)]
pub(super) enum Kept {
    /// The frozen request, while the operation is open: resent on resume, shown when a
    /// later request drifts.
    Frozen(FrozenRequest),
    /// Once it is completed, nothing will be resent: the digests of its body's top-level
    /// JSON fields, to name the fields a later request changed.
    Fields(FieldDigests),
    /// Once it is completed, as [`Fields`](Self::Fields), the digests held in the recorded
    /// response's own buffer, where the face that recorded it put them
    /// ([`StoredResponse::request_fields`](crate::ledger::StoredResponse)): weighed with
    /// the response.
    InOutcome,
    /// Once it is completed, that it was made with a request whose fields cannot be named
    /// (a body that is no JSON object, digests that would outweigh it, a tombstone's):
    /// nothing but the fact, which weighs nothing. A regenerated request is then told it
    /// drifted from a request the face may continue with (by the fingerprints, as when a
    /// store keeps the whole request: [`Begin::DriftFields`](crate::ledger::Begin) with
    /// [unnamed](FieldDigests::unnamed) digests), not from none.
    Unnamed,
    /// Nothing (a request made without one: the server face's).
    Nothing,
}

impl Kept {
    pub(super) fn frozen(&self) -> Option<FrozenRequest> {
        match self {
            Self::Frozen(frozen) => Some(frozen.clone()),
            _ => None,
        }
    }

    pub(super) fn weight(&self) -> u64 {
        match self {
            Self::Frozen(frozen) => frozen.weight() as u64,
            Self::Fields(fields) => fields.weight() as u64,
            Self::InOutcome | Self::Unnamed | Self::Nothing => 0,
        }
    }

    /// What a completed record keeps of this (which weighs `weight`) once `outcome` is
    /// recorded: the field digests of a frozen request, if its body is a JSON object and
    /// they weigh less than the request (they always do but for bodies of many tiny fields);
    /// else [`Unnamed`](Self::Unnamed), never nothing: a record that had a request keeps
    /// the fact. Digests the outcome carries are kept where they are; others are made here.
    pub(super) fn completed(&self, weight: u64, outcome: &Outcome) -> Self {
        let Self::Frozen(frozen) = self else {
            return Self::Nothing;
        };
        let made = || {
            FieldDigests::of(frozen.body())
                .filter(|fields| fields.weight() as u64 <= weight)
                .map_or(Self::Unnamed, Self::Fields)
        };
        let Outcome::Response(response) = outcome else {
            return made();
        };
        match response.request_fields() {
            RequestFields::Entries(entries)
                if FieldDigests::weight_of(entries.len()) as u64 <= weight =>
            {
                Self::InOutcome
            }
            RequestFields::Entries(_) | RequestFields::NoFields => Self::Unnamed,
            RequestFields::Ungathered => made(),
        }
    }
}

/// Buckets of per-scope bytes: scopes are counted by their id modulo this (bucket `0` is
/// no scope), so a store keeps a fixed 8 KiB of counters however many scopes it sees.
pub(super) const SCOPE_BUCKETS: u64 = 1024;

/// The bucket a scope's bytes are counted in: `0` for no scope, never `0` for one.
pub(super) fn scope_bucket(scope: u64) -> u16 {
    if scope == 0 {
        0
    } else {
        (scope % (SCOPE_BUCKETS - 1) + 1) as u16
    }
}

/// The status a settled record answers with.
pub(super) fn outcome_status(outcome: &Outcome) -> http::StatusCode {
    match outcome {
        Outcome::Response(response) => response.status(),
        Outcome::Tombstone { status } => *status,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_protection_window_is_kept_never_shorter_than_asked() {
        assert_eq!(protection_ms(Duration::ZERO), 0);
        assert_eq!(protection_ms(Duration::from_nanos(1)), 1);
        assert_eq!(protection_ms(Duration::from_micros(1_500)), 2);
        assert_eq!(protection_ms(Duration::from_secs(70)), 70_000);
        // Past what four bytes of milliseconds hold: the whole retention.
        assert_eq!(protection_ms(Duration::from_secs(60 * 24 * 3600)), u32::MAX);
    }
}
