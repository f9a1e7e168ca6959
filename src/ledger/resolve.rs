//! Resolving an operation in doubt as applied: an operator records the outcome the
//! provider shows, fenced by what they saw of the record.

use std::time::Duration;

use super::{Expected, LedgerKey, RecordState, RecordView, StoreError};

/// What [`IdempotencyStore::resolve`](super::IdempotencyStore::resolve) did.
///
/// ```
/// # use tower_idempotency::ledger::Resolve;
/// assert!(Resolve::Resolved.is_resolved());
/// assert!(!Resolve::NotInDoubt.is_resolved());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Resolve {
    /// The record was as expected and is completed with the operator's outcome: the next
    /// request with its key (and the same payload) replays it.
    Resolved,
    /// There is no record (never made, forgotten or released, or past its retention).
    /// Nothing changed.
    Absent,
    /// The record is not as expected any more (it moved on since it was looked at, or is
    /// another life of its key). Nothing changed: look again.
    Changed,
    /// The record is in flight and its owner's lease still runs for `lease_left`. Nothing
    /// changed: wait for the owner, or [force](Expected::force) it.
    Live {
        /// How long the owner's lease still runs (a whole lease while it is held).
        lease_left: Duration,
    },
    /// The record is completed already, as it was seen: it has an outcome of its own,
    /// which an operator's never replaces. Nothing changed.
    NotInDoubt,
}

impl Resolve {
    /// Whether the record was completed with the operator's outcome.
    pub fn is_resolved(&self) -> bool {
        matches!(self, Self::Resolved)
    }

    /// `resolved`, `absent`, `changed`, `live` or `not_in_doubt`: the name in logs and
    /// metrics.
    pub(crate) fn as_str(&self) -> &'static str {
        match self {
            Self::Resolved => "resolved",
            Self::Absent => "absent",
            Self::Changed => "changed",
            Self::Live { .. } => "live",
            Self::NotInDoubt => "not_in_doubt",
        }
    }
}

impl Expected {
    /// What [`resolve`](super::IdempotencyStore::resolve) must do to the record `current`
    /// (`None`: absent), seen atomically with the write: for stores that read the record
    /// and complete it under one lock or in one transaction.
    ///
    /// The record must be the one seen, as for [`judge`](Self::judge) (same generation,
    /// kind, fingerprint and attempts), and open: in doubt, or in flight under a lease that
    /// ran out (or a live one, when [forced](Self::force)). A completed record is never
    /// resolved over.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::ledger::{Expected, Generation, RecordState, RecordView, Resolve};
    /// # use tower_idempotency::fingerprint::Fingerprint;
    /// # let fp = Fingerprint::of(&http::Method::POST, "/charges", b"{}");
    /// let in_doubt = |life| RecordView::new(RecordState::InDoubt, fp, 2,
    ///     Generation::from_u64(life), Duration::from_secs(60), Duration::from_secs(3600));
    /// let look = Expected::of(&in_doubt(7));
    /// assert_eq!(look.judge_resolve(Some(&in_doubt(7))), Resolve::Resolved);
    /// assert_eq!(look.judge_resolve(None), Resolve::Absent);
    /// // Another life of the key, alike in all else: not the record seen.
    /// assert_eq!(look.judge_resolve(Some(&in_doubt(8))), Resolve::Changed);
    /// ```
    pub fn judge_resolve(&self, current: Option<&RecordView>) -> Resolve {
        let Some(current) = current else {
            return Resolve::Absent;
        };
        // Identity first, as for a forget: a record that moved on is `Changed` whatever
        // state it is in now, because the look no longer describes it.
        if !self.describes(current) {
            return Resolve::Changed;
        }
        match current.state {
            RecordState::Completed { .. } => Resolve::NotInDoubt,
            RecordState::InFlight { lease_left, .. } if !lease_left.is_zero() && !self.force => {
                Resolve::Live { lease_left }
            }
            _ => Resolve::Resolved,
        }
    }
}

/// Log, and with feature `metrics` count, one resolve by `store` (`memory`, `redis`,
/// `postgres`): the operator's word on an effect must leave a trace.
pub(crate) fn report(
    store: &'static str,
    key: &LedgerKey,
    expected: &Expected,
    status: http::StatusCode,
    answer: &Result<Resolve, StoreError>,
) {
    let state = expected.kind.as_str();
    let status = status.as_u16();
    // A resolve is a `WARN`: from now on the operation replays an outcome nobody's call
    // returned, and it is the first place to look when a replay surprises someone.
    let result = match answer {
        Ok(Resolve::Resolved) => {
            tracing::warn!(
                store,
                key = %key.to_hex(),
                state,
                attempts = expected.attempts,
                generation = %expected.generation,
                forced = expected.force,
                status,
                "a ledger record was resolved as applied on purpose: the next request with its \
                 key replays the outcome an operator recorded"
            );
            "resolved"
        }
        Ok(refused) => {
            tracing::info!(
                store,
                key = %key.to_hex(),
                state,
                attempts = expected.attempts,
                generation = %expected.generation,
                result = refused.as_str(),
                "a ledger record was not resolved: it is not as expected, or not open"
            );
            refused.as_str()
        }
        Err(err) => {
            tracing::info!(store, key = %key.to_hex(), state, %err, "could not resolve a ledger record");
            "error"
        }
    };
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "idempotency_ledger_resolve_total",
        "store" => store,
        "state" => state,
        "result" => result
    )
    .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = result;
}
