//! The byte budget: counting records in and out of it, and making room by eviction.

use tokio::time::Instant;

use super::record::{Record, Stamp, State};
use super::shared::{lock, Shard};
use super::store::MemoryStore;
use super::sync::Ordering;
use crate::ledger::LedgerKey;

/// Whether making room may sweep every shard for open records past their retention.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Sweep {
    /// When the eviction index has nothing left to evict.
    IfNeeded,
    /// Never: the eviction index alone.
    Never,
}

impl MemoryStore {
    /// Drop every record past its retention, in every shard, and learn when the first open
    /// record left will end.
    pub(super) fn sweep_all(&self, now: Instant) {
        // Claims meanwhile lower the floor on their own; a record this sweep keeps lowers it
        // here, so no open record is left above it.
        self.inner
            .open_expiry_floor
            .store(u64::MAX, Ordering::Relaxed);
        for shard in self.inner.shards.iter() {
            let mut shard = lock(shard);
            self.sweep(&mut shard, now);
            let first_end = shard
                .records
                .values()
                .filter(|record| !matches!(record.state, State::Completed { .. }))
                .map(|record| record.retain_until)
                .min();
            if let Some(end) = first_end {
                self.inner
                    .open_expiry_floor
                    .fetch_min(end.micros(), Ordering::Relaxed);
            }
        }
    }

    /// Drop a shard's records whose retention ended.
    pub(super) fn sweep(&self, shard: &mut Shard, now: Instant) {
        let now = self.stamp(now);
        let expired: Vec<LedgerKey> = shard
            .records
            .iter()
            .filter(|(_, record)| record.retain_until <= now)
            .map(|(key, _)| *key)
            .collect();
        for key in expired {
            self.remove(shard, &key);
        }
    }

    /// Take `key`'s record out of the map and the budget.
    pub(super) fn remove(&self, shard: &mut Shard, key: &LedgerKey) -> Option<Box<Record>> {
        let record = shard.records.remove(key)?;
        self.forget(&record);
        Some(record)
    }

    /// The budget, gauges and eviction order of a record taken out of its shard.
    pub(super) fn forget(&self, record: &Record) {
        self.inner.used.fetch_sub(record.weight, Ordering::Relaxed);
        self.inner.gauges.removed(record.weight);
        self.scoped(record.bucket(), record.weight, 0);
        if let Some((protect_until, seq)) = record.eviction_place() {
            self.inner
                .completed_bytes
                .fetch_sub(record.weight, Ordering::Relaxed);
            lock(&self.inner.evictable).remove((protect_until, seq));
        }
    }

    /// Put `record` in the map, replacing `key`'s, if the budget has room for the
    /// difference; hand it back (`Some`) otherwise.
    #[must_use]
    pub(super) fn insert_if_room(
        &self,
        shard: &mut Shard,
        key: LedgerKey,
        record: Box<Record>,
    ) -> Option<Box<Record>> {
        let old = shard.records.get(&key).map_or(0, |old| old.weight);
        if !self.reweigh(old, record.weight) {
            return Some(record);
        }
        if let Some((protect_until, seq)) = record.eviction_place() {
            self.inner
                .completed_bytes
                .fetch_add(record.weight, Ordering::Relaxed);
            lock(&self.inner.evictable).insert((protect_until, seq), key, record.weight);
        }
        let (weight, scope) = (record.weight, record.bucket());
        self.scoped(scope, 0, weight);
        match shard.records.insert(key, record) {
            Some(old) => {
                self.inner.gauges.reweighed(old.weight, weight);
                self.scoped(old.bucket(), old.weight, 0);
                if let Some((protect_until, seq)) = old.eviction_place() {
                    self.inner
                        .completed_bytes
                        .fetch_sub(old.weight, Ordering::Relaxed);
                    lock(&self.inner.evictable).remove((protect_until, seq));
                }
            }
            None => self.inner.gauges.added(weight),
        }
        None
    }

    /// Count a record going from `old` to `new` bytes against the budget, if it has room
    /// for the difference (`false`, counting nothing, if not).
    pub(super) fn reweigh(&self, old: u64, new: u64) -> bool {
        if new <= old {
            self.inner.used.fetch_sub(old - new, Ordering::Relaxed);
            return true;
        }
        let grow = new - old;
        self.inner
            .used
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |used| {
                (used + grow <= self.inner.max_bytes).then_some(used + grow)
            })
            .is_ok()
    }

    /// Whether `needed` bytes are free now.
    pub(super) fn has_room(&self, needed: u64) -> bool {
        self.inner.used.load(Ordering::Relaxed) + needed <= self.inner.max_bytes
    }

    /// Evict completed records past their protected window (and any record past its
    /// retention met on the way) until `needed` bytes are free; `false` if they cannot be.
    ///
    /// Takes no shard lock while holding the eviction index's, and is called with no shard
    /// lock held, so locks are only ever taken shard first. `at` must be `now` as a stamp
    /// (`self.stamp(now)`): every caller has made it already.
    pub(super) fn make_room(&self, needed: u64, now: Instant, at: Stamp) -> bool {
        self.evict_until(needed, now, at, Sweep::IfNeeded)
    }

    /// [`make_room`](Self::make_room), sweeping for open records past their retention only
    /// under [`Sweep::IfNeeded`].
    pub(super) fn evict_until(&self, needed: u64, now: Instant, at: Stamp, sweep: Sweep) -> bool {
        debug_assert_eq!(at, self.stamp(now), "`at` is `now` as a stamp");
        if needed > self.inner.max_bytes {
            // No eviction makes room for more than the whole budget: evict nothing for it.
            return false;
        }
        let mut swept = sweep == Sweep::Never;
        loop {
            if self.has_room(needed) {
                return true;
            }
            // Looked at, not taken out: the entry leaves the order only with its record
            // (below, under the shard's lock). Were it taken out first, a caller preempted
            // between the two would hide from every other caller the room it is about to
            // make, and they would refuse for want of it.
            let front = lock(&self.inner.evictable).first_ended_by(at);
            let Some((place, key)) = front else {
                if swept {
                    return false;
                }
                // Nothing left to evict: open records past their retention (abandoned in
                // doubt) are the only other bytes that may go, and only once the first of
                // them may have ended. Then a full sweep, which learns when the next one
                // ends: a store full of protected records refuses without sweeping again
                // (a flood of new keys costs each a refusal, not a walk of every record).
                swept = true;
                if self.micros(now) >= self.inner.open_expiry_floor.load(Ordering::Relaxed) {
                    self.sweep_all(now);
                }
                continue;
            };
            // A record and its entry change together under the record's shard lock: if this
            // life of the key is gone (another caller evicted it, or it was claimed anew),
            // so is its entry, and the next look finds the next one.
            let mut shard = lock(self.shard(&key));
            if shard.records.get(&key).is_some_and(|record| {
                record
                    .eviction_place()
                    .is_some_and(|(_, seq)| seq == place.1)
            }) {
                let record = self
                    .remove(&mut shard, &key)
                    .expect("checked under the lock");
                if record.retain_until > at {
                    self.inner.evictions.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}
