//! Pressure: how much of the budget is protected, the warnings before refusals, the refusals
//! themselves, and each scope's fair share once the store is under pressure.
//!
//! A scope's share is judged on a current reading, by every claim and every completion
//! that would take the scope past it: a flag refreshed now and then lets one tenant fill
//! the whole budget between two looks. The reading costs nothing on the common path: a
//! scope within its share, or a store whose bytes held (protected or not) are below the
//! mark, is let through on one or two atomic loads; only a scope past its share in a full
//! store looks at the protected bytes themselves.

use std::time::Duration;

use tokio::time::Instant;

use super::record::Stamp;
use super::shared::lock;
use super::store::MemoryStore;
use super::sync::{AtomicU64, Ordering};
use crate::ledger::StoreError;

/// The share of the budget that protected records (open, or completed inside their
/// protected window) may hold before the store warns that it is nearing refusals.
pub(super) const HIGH_WATER_PERCENT: u64 = 80;

/// How often, at most, a claim reports how much of the budget is protected (the gauge, the
/// warning), in µs. The shares never wait for it: they read the pressure when they judge.
pub(super) const PRESSURE_CHECK_EVERY_US: u64 = 1_000_000;

/// How often, at most, the store warns of pressure, and of refusals (µs).
pub(super) const WARN_EVERY_US: u64 = 30_000_000;

impl MemoryStore {
    /// The bytes of open records and of completed ones inside their protected window.
    pub(super) fn protected_bytes_at(&self, now: Instant) -> u64 {
        self.protected_bytes_by(self.stamp(now))
    }

    /// [`protected_bytes_at`](Self::protected_bytes_at) a stamp.
    pub(super) fn protected_bytes_by(&self, at: Stamp) -> u64 {
        // Read the completed bytes first: a record completing meanwhile moves bytes from
        // open to completed, which only makes this err towards protected.
        let completed = self.inner.completed_bytes.load(Ordering::Relaxed);
        let used = self.inner.used.load(Ordering::Relaxed);
        let inside = lock(&self.inner.evictable).protected_bytes_after(at);
        let open = used.saturating_sub(completed);
        (open + inside).min(used)
    }

    /// Whether protected bytes, with `adding` more, reach the high-water mark at `at`.
    fn pressed_with(&self, adding: u64, at: Stamp) -> bool {
        let mark = self.high_water_mark();
        // Protected bytes are some of the bytes held: below the mark by those, no look at
        // the eviction order is needed (a store that is not full never takes its lock).
        if self.inner.used.load(Ordering::Relaxed) + adding < mark {
            return false;
        }
        self.protected_bytes_by(at) + adding >= mark
    }

    /// [`HIGH_WATER_PERCENT`] of the budget, in bytes.
    fn high_water_mark(&self) -> u64 {
        (u128::from(self.inner.max_bytes) * u128::from(HIGH_WATER_PERCENT) / 100) as u64
    }

    /// A record of scope bucket `scope` went from `old` to `new` bytes.
    pub(super) fn scoped(&self, scope: u16, old: u64, new: u64) {
        if scope == 0 {
            return;
        }
        let bytes = &self.inner.scope_bytes[usize::from(scope)];
        if new >= old {
            bytes.fetch_add(new - old, Ordering::Relaxed);
        } else {
            bytes.fetch_sub(old - new, Ordering::Relaxed);
        }
    }

    /// Whether `adding` bytes in scope bucket `scope` (a new claim's, or what a completion
    /// adds to its claim) take the scope past its share while protected records, with
    /// them, reach the mark at `at`: read now, not at the last look.
    ///
    /// A claim over its share is refused, leaving the room to other scopes; a completion
    /// over its share keeps the fact that it is done, not its outcome's bytes (see
    /// `complete_now`): either way one scope never takes more of a store under pressure
    /// than it held when the pressure began.
    pub(super) fn over_share(&self, scope: u16, adding: u64, at: Stamp) -> bool {
        scope != 0
            && adding > 0
            && self.inner.scope_bytes[usize::from(scope)].load(Ordering::Relaxed) + adding
                > self.inner.scope_share
            && self.pressed_with(adding, at)
    }

    /// Whether to warn now, at most once every [`WARN_EVERY_US`] per kind of warning.
    pub(super) fn may_warn(&self, last: &AtomicU64, at: u64) -> bool {
        let before = last.load(Ordering::Relaxed);
        if before != 0 && at < before + WARN_EVERY_US {
            return false;
        }
        last.compare_exchange(before, at.max(1), Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }

    /// At most once a second (the first claim to find it due): how much of the budget is
    /// protected, into the gauge, and a warning past the high-water mark. The shares do not
    /// depend on it (see [`over_share`](Self::over_share)).
    /// `at`: `now` in the store's microseconds.
    pub(super) fn check_pressure(&self, now: Instant, at: u64) {
        let due = self.inner.next_pressure_check.load(Ordering::Relaxed);
        if at < due
            || self
                .inner
                .next_pressure_check
                .compare_exchange(
                    due,
                    at + PRESSURE_CHECK_EVERY_US,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                )
                .is_err()
        {
            return;
        }
        let max = self.inner.max_bytes.max(1);
        let protected = self.protected_bytes_at(now);
        self.inner.gauges.protected(protected as f64 / max as f64);
        let pressed = protected >= self.high_water_mark();
        if !pressed || !self.may_warn(&self.inner.warned_pressure, at) {
            return;
        }
        // Rare (at most every 30 s): counting the records locks every shard in turn.
        let records = self.entry_count().max(1);
        let per_record = (self.weighted_size() / records).max(1);
        let window = Duration::from_micros(self.inner.last_window_us.load(Ordering::Relaxed));
        let sustainable = max as f64 / per_record as f64 / window.as_secs_f64().max(0.001);
        tracing::warn!(
            max_bytes = max,
            protected_bytes = protected,
            bytes_per_record = per_record,
            protected_window_secs = window.as_secs_f64(),
            sustainable_per_sec = sustainable as u64,
            "the memory ledger's protected records hold {}% of its budget: at {per_record} bytes \
             a record and a {:.0} s protected window it sustains about {:.0} new operations a \
             second, and refuses new ones past that (raise max_bytes, shorten the protected \
             window, or move to a shared store)",
            protected * 100 / max,
            window.as_secs_f64(),
            sustainable,
        );
    }

    /// Refuse a claim heavier than the whole budget (the client face's record holds the
    /// frozen request, so a body limit above the budget makes one), if this is one. Told
    /// apart from a full store: no eviction and no wait makes room for it, so a
    /// `Retry-After` would only send the caller back to the same refusal. Counted with the
    /// other refusals, and warned every time: each is a setting to fix, not a load to ride
    /// out.
    pub(super) fn never_fits(&self, weight: u64) -> Option<StoreError> {
        if weight <= self.inner.max_bytes {
            return None;
        }
        self.inner.refused.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            weight,
            max_bytes = self.inner.max_bytes,
            "an operation is heavier than the memory ledger's whole budget and can never be \
             kept; refusing it (raise max_bytes above the layers' body limit, or lower the \
             body limit)"
        );
        Some(StoreError::never_fits())
    }

    /// Refuse a claim for room: count it, warn (at most every 30 s) and say when room
    /// frees up, from the front of the eviction order alone (no sweep, no shard lock).
    pub(super) fn refuse(&self, now: Instant) -> StoreError {
        // Refused claims report the pressure too (when due): were every claim refused, the
        // gauge would otherwise stay where it was when the refusals began.
        self.check_pressure(now, self.micros(now));
        let refused = self.inner.refused.fetch_add(1, Ordering::Relaxed) + 1;
        let first_end = lock(&self.inner.evictable)
            .first_end()
            .map(|end| self.instant(end));
        if self.may_warn(&self.inner.warned_refusal, self.micros(now)) {
            tracing::warn!(
                max_bytes = self.inner.max_bytes,
                used = self.weighted_size(),
                refused,
                "the memory ledger is full of records inside their protected window; refusing \
                 new operations (raise max_bytes, shorten the protected window, or move to a \
                 shared store)"
            );
        }
        match first_end {
            // The first completed record to leave its protected window makes room then; an
            // open one leaves when it completes or ends, which nothing here can tell.
            Some(end) if end > now => StoreError::full_until(end - now),
            _ => StoreError::full(),
        }
    }
}
