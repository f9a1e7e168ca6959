//! What every clone of a [`MemoryStore`](super::MemoryStore) shares, and the locks that guard it.

use std::collections::HashMap;

use tokio::time::Instant;

use super::eviction::EvictionIndex;
use super::record::Record;
use super::released::Released;
use super::sync::{AtomicU64, Mutex, MutexGuard, Ordering, PoisonError};
use crate::ledger::{DigestState, LedgerKey};

/// Shards of the record map: enough that unrelated keys rarely share a lock on a many-core
/// machine, few enough to stay small.
pub(super) const SHARDS: usize = 64;

/// What every clone of a store shares. See the module docs for what each lock protects
/// and why the atomics need no stronger ordering than `Relaxed`.
pub(super) struct Inner {
    /// The records, by shard: each mutex guards every transition of its keys.
    pub(super) shards: Box<[Mutex<Shard>]>,
    /// Bytes held by every record, open or completed.
    pub(super) used: AtomicU64,
    pub(super) max_bytes: u64,
    /// Completed records by the end of their protected window: the eviction order. Taken
    /// inside a shard's lock, never the other way around.
    pub(super) evictable: Mutex<EvictionIndex>,
    /// Hands out the sequence numbers that tell two lives of one key apart: each claim's
    /// record takes the next as its generation.
    pub(super) next_seq: AtomicU64,
    /// The weight of the latest new claim (at most a sixteenth of the budget): the room a
    /// completion that evicts anyway leaves for the next one (see `complete_now`).
    pub(super) last_claim: AtomicU64,
    pub(super) evictions: AtomicU64,
    pub(super) refused: AtomicU64,
    /// What the times below count from.
    pub(super) epoch: Instant,
    /// No open record's retention ends before this (µs since `epoch`; a lower bound): a
    /// claim that finds no room sweeps every shard for open records past their retention
    /// only once this has passed, so a flood of refused claims never sweeps at all.
    pub(super) open_expiry_floor: AtomicU64,
    /// Bytes of the completed records held (the rest of `used` is open records).
    pub(super) completed_bytes: AtomicU64,
    /// When a claim next looks at the pressure (µs since `epoch`).
    pub(super) next_pressure_check: AtomicU64,
    /// When the store last warned of pressure, and of refusals (µs since `epoch`; `0`:
    /// never).
    pub(super) warned_pressure: AtomicU64,
    pub(super) warned_refusal: AtomicU64,
    /// Bytes held by each scope's records (see [`SCOPE_BUCKETS`](super::record::SCOPE_BUCKETS)).
    pub(super) scope_bytes: Box<[AtomicU64]>,
    /// What one scope may hold (see `MemoryStoreBuilder::scope_share`) once protected
    /// records reach the high-water mark.
    pub(super) scope_share: u64,
    /// The protected window of the latest claim, in µs: the window the sustainable rate
    /// in a warning is worked out for.
    pub(super) last_window_us: AtomicU64,
    /// One generation counter per shard, bumped when a record of the shard settles while
    /// someone listens: waiters for a busy key wake when its owner is done instead of
    /// polling. Per shard, not per key, so listening allocates nothing per key; a settle of
    /// a neighbour wakes a waiter for nothing, and it asks `begin` again.
    pub(super) settled: Box<[tokio::sync::watch::Sender<u64>]>,
    pub(super) gauges: Gauges,
}

/// With feature `metrics`, the gauges of what the store holds: handles taken once, so a
/// change costs the recorder's atomic add, never a registry lookup on the hot path.
#[cfg(feature = "metrics")]
pub(super) struct Gauges {
    bytes: metrics::Gauge,
    records: metrics::Gauge,
    protected: metrics::Gauge,
}

#[cfg(feature = "metrics")]
impl Gauges {
    pub(super) fn new() -> Self {
        Self {
            bytes: metrics::gauge!("idempotency_store_bytes", "store" => "memory"),
            records: metrics::gauge!("idempotency_store_records", "store" => "memory"),
            protected: metrics::gauge!("idempotency_store_protected_ratio", "store" => "memory"),
        }
    }

    /// The share of the budget protected records hold, as last looked at.
    pub(super) fn protected(&self, ratio: f64) {
        self.protected.set(ratio);
    }

    /// A record of `weight` bytes came in.
    pub(super) fn added(&self, weight: u64) {
        self.bytes.increment(weight as f64);
        self.records.increment(1.0);
    }

    /// A record of `weight` bytes left.
    pub(super) fn removed(&self, weight: u64) {
        self.bytes.decrement(weight as f64);
        self.records.decrement(1.0);
    }

    /// A record held stayed, `old` bytes then, `new` now.
    pub(super) fn reweighed(&self, old: u64, new: u64) {
        self.bytes.increment(new as f64 - old as f64);
    }

    /// The store went with `bytes` in `records` records, `open` of them in flight or in
    /// doubt: stores add up in one series, so a store that goes takes its share out, and
    /// the doubt it forgot is counted.
    pub(super) fn dropped(&self, bytes: u64, records: u64, open: u64) {
        self.bytes.decrement(bytes as f64);
        self.records.decrement(records as f64);
        if open > 0 {
            metrics::counter!("idempotency_store_open_records_dropped_total", "store" => "memory")
                .increment(open);
        }
    }
}

/// Without feature `metrics`, nothing to keep.
#[cfg(not(feature = "metrics"))]
pub(super) struct Gauges;

#[cfg(not(feature = "metrics"))]
impl Gauges {
    pub(super) fn new() -> Self {
        Self
    }

    pub(super) fn added(&self, _: u64) {}

    pub(super) fn removed(&self, _: u64) {}

    pub(super) fn reweighed(&self, _: u64, _: u64) {}

    pub(super) fn dropped(&self, _: u64, _: u64, _: u64) {}

    pub(super) fn protected(&self, _: f64) {}
}

impl Drop for Inner {
    fn drop(&mut self) {
        let (records, open) = self.count_records();
        if open > 0 {
            // The store was the only memory of these operations' doubt: the next run of
            // each, against a new store, sends it as if for the first time. A store made
            // per call (rather than once, cloned into each layer) does this on every call.
            tracing::warn!(
                open,
                "a MemoryStore was dropped holding operations in flight or in doubt: their \
                 doubt is forgotten, and a later run of each sends it again; make the store \
                 once and clone it into each layer (or use Redis or PostgreSQL to outlive the \
                 process)"
            );
        }
        self.gauges
            .dropped(self.used.load(Ordering::Relaxed), records, open);
    }
}

impl Inner {
    /// How many records the store holds, and how many of them are open (in flight or in
    /// doubt).
    fn count_records(&self) -> (u64, u64) {
        self.shards.iter().fold((0, 0), |(records, open), shard| {
            let shard = shard.lock().unwrap_or_else(PoisonError::into_inner);
            let open_here = shard
                .records
                .values()
                .filter(|record| !matches!(record.state, super::record::State::Completed { .. }))
                .count();
            (
                records + shard.records.len() as u64,
                open + open_here as u64,
            )
        })
    }
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("max_bytes", &self.max_bytes)
            .field("used", &self.used.load(Ordering::Relaxed))
            .field("evictions", &self.evictions.load(Ordering::Relaxed))
            .field("refused", &self.refused.load(Ordering::Relaxed))
            .finish()
    }
}

/// One shard: its records, and the tokens its keys were released under.
#[derive(Default)]
pub(super) struct Shard {
    /// The records, boxed: a map keeps a share of its slots empty (an eighth to over half,
    /// as it grows by doubling), and an empty slot of a key and a pointer costs 40 bytes
    /// where one of a key and a whole record would cost 200.
    pub(super) records: HashMap<LedgerKey, Box<Record>, DigestState>,
    /// Released tokens of its keys (see [`Released`]). Behind the same lock
    /// as the records: a `begin` reads them and claims in one step, and an `abandon`
    /// releases and marks in one step, so no `begin` slips between the two.
    pub(super) released: Released,
}

/// Keys are uniform hashes: their first byte spreads them over the shards.
pub(super) fn shard_index(key: &LedgerKey) -> usize {
    usize::from(key.as_bytes()[0]) % SHARDS
}

/// A poisoned lock only means another caller panicked mid-transition; every transition
/// works out what can fail before it writes (a record in one assignment, or in place once
/// nothing can fail), so the map is still consistent.
pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
