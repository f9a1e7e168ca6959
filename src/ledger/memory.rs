//! The in-process ledger: every record in a sharded map, under one byte budget.

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::time::Duration;

use tokio::time::Instant;

use super::{
    Begin, BeginRequest, DigestState, FieldDigests, IdempotencyStore, LeaseToken, LedgerKey,
    Outcome, StoreError, StoreFuture,
};
use crate::fingerprint::Fingerprint;
use crate::frozen::FrozenRequest;

mod eviction;
#[cfg(all(test, tower_idempotency_loom))]
mod model_check;
mod released;
mod sync;

use eviction::EvictionIndex;
use released::Released;
use sync::{Arc, AtomicU64, Mutex, MutexGuard, Ordering, PoisonError};

/// The default byte budget of a [`MemoryStore`]: 192 MiB. With the layers' default protected
/// windows it keeps up with ~5,000 new server operations a second (~570 bytes a record with
/// a 50-byte response, lease + 1 min) or ~8,000 client ones (~600 bytes with a 1 KiB
/// request, retry window + lease, 40 s), so each face's target rate (2,000 and 1,000 a
/// second) keeps 40 % and 12 % of it protected: room for responses of several hundred
/// bytes (a server record weighs its response) below the warning's 80 % mark.
const DEFAULT_MAX_BYTES: u64 = 192 * 1024 * 1024;

/// Shards of the record map: enough that unrelated keys rarely share a lock on a many-core
/// machine, few enough to stay small.
const SHARDS: usize = 64;

/// What a record costs besides its own fields and the requests and responses it holds: its
/// map slot (a key and a pointer) at the map's load factor, its eviction-index entry and the
/// allocator's rounding of its box (a recorded response weighs its own allocations:
/// `StoredResponse::weight`). Calibrated with `examples/memory_footprint.rs`: with it, a
/// million small server records grow the process by about the budget (a map emptier than
/// there, just past a doubling, costs up to ~50 bytes a record more).
const PER_RECORD_OVERHEAD: u64 = 128;

/// Whether making room may sweep every shard for open records past their retention.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Sweep {
    /// When the eviction index has nothing left to evict.
    IfNeeded,
    /// Never: the eviction index alone.
    Never,
}

/// The share of the budget that protected records (open, or completed inside their
/// protected window) may hold before the store warns that it is nearing refusals.
const HIGH_WATER_PERCENT: u64 = 80;

/// How often, at most, a claim looks at how much of the budget is protected (in µs since the
/// store's epoch): a binary search in the eviction order, under its lock.
const PRESSURE_CHECK_EVERY_US: u64 = 1_000_000;

/// How often, at most, the store warns of pressure, and of refusals (µs).
const WARN_EVERY_US: u64 = 30_000_000;

/// Buckets of per-scope bytes: scopes are counted by their id modulo this (bucket `0` is
/// no scope), so a store keeps a fixed 8 KiB of counters however many scopes it sees.
const SCOPE_BUCKETS: u64 = 1024;

/// The default share of the budget one scope may hold once the store is under pressure.
const DEFAULT_SCOPE_SHARE: f64 = 0.25;

/// Kept free in every open record's weight, so that completing it can always fall back to
/// a tombstone without needing a byte more than the claim already holds.
const TOMBSTONE_RESERVE: u64 = 16;

/// A point in a record's life, in nanoseconds since its store's epoch: 8 bytes where an
/// `Instant` takes 16, and a record holds four. Adding a duration saturates: a retention of
/// more than five centuries is kept as long as the process lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Stamp(u64);

impl Stamp {
    /// The time from `earlier` to this, or zero.
    fn since(self, earlier: Stamp) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }

    fn micros(self) -> u64 {
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

/// The embedded ledger, in this process.
///
/// Every record — in flight, in doubt or completed — sits in one sharded map and counts
/// against one byte budget, [`max_bytes`](MemoryStoreBuilder::max_bytes) (192 MiB by
/// default): its key, its bookkeeping, its frozen request while the operation is open (once
/// it is completed, only a digest of each top-level JSON field of its body, enough to name
/// what a later request changed: [`Begin::DriftFields`]) and its recorded response.
/// [`weighted_size`](MemoryStore::weighted_size) is that count, exactly, at every moment.
///
/// The budget is kept without ever forgetting an operation that may still be retried:
///
/// - **Open operations** (in flight or in doubt) are never evicted: forgetting one would
///   let a second caller send the same operation, or lose the bytes a resume must resend.
///   They leave when they complete, when they are released after a pre-write failure, or
///   when their retention ends.
/// - **Completed operations inside their protected window** (the
///   [`BeginRequest::protected`] window the layers set: at least their retry window plus
///   the lease, measured from completion) are never evicted either.
/// - **Completed operations past their protected window** but inside their retention may
///   be evicted to make room, those whose window ended first going first; each eviction is
///   counted ([`evictions`](MemoryStore::evictions)).
/// - When the budget is full of records it must keep, `begin` **refuses new claims** with
///   a [full](StoreError::is_full) error and a warning (the layers fail closed: nothing is
///   sent), instead of forgetting an operation. Completing an operation never fails for
///   room: an outcome that does not fit is kept as a tombstone (status only), in the room
///   its claim already held.
///
/// Every transition of a key runs under its shard's lock, from the first read to the last
/// write, so `begin` is one atomic step: two callers racing on a key never both acquire
/// it. Nothing is awaited under a lock: every operation completes on its first poll.
///
/// Leases and retention are checked against [`tokio::time::Instant`] on every access (so
/// they follow a paused test clock). Records past their retention are dropped when next
/// touched, when their room is needed, and by
/// [`run_pending_tasks`](MemoryStore::run_pending_tasks).
///
/// With feature `metrics`, the store reports what it holds as two gauges labelled
/// `store = "memory"`: `idempotency_store_bytes` (the [weighted size](Self::weighted_size))
/// and `idempotency_store_records` (the [records](Self::entry_count)). They move by each
/// change, through handles taken when the store is built, so keeping them costs an atomic
/// add per insert or removal and no lookup: install your recorder **before** building the
/// store. Several stores in one process add up in the same series, and a dropped store
/// takes its share out.
///
/// Size the budget for your rate times the protected window. Use `RedisStore` (feature
/// `redis`) when several processes share operations or an orchestrator must resume after
/// a crash.
///
/// # Example
///
/// ```
/// use tower_idempotency::ledger::MemoryStore;
///
/// let store = MemoryStore::builder().max_bytes(16 * 1024 * 1024).build();
/// assert_eq!(store.weighted_size(), 0);
/// ```
#[derive(Clone, Debug)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    shards: Box<[Mutex<Shard>]>,
    /// Bytes held by every record, open or completed.
    used: AtomicU64,
    max_bytes: u64,
    /// Completed records by the end of their protected window: the eviction order.
    evictable: Mutex<EvictionIndex>,
    /// Hands out the sequence numbers that tell two lives of one key apart.
    next_seq: AtomicU64,
    /// The weight of the latest new claim (at most a sixteenth of the budget): the room a
    /// completion that evicts anyway leaves for the next one (see `complete_now`).
    last_claim: AtomicU64,
    evictions: AtomicU64,
    refused: AtomicU64,
    /// What the times below count from.
    epoch: Instant,
    /// No open record's retention ends before this (µs since `epoch`; a lower bound): a
    /// claim that finds no room sweeps every shard for open records past their retention
    /// only once this has passed, so a flood of refused claims never sweeps at all.
    open_expiry_floor: AtomicU64,
    /// Bytes of the completed records held (the rest of `used` is open records).
    completed_bytes: AtomicU64,
    /// When a claim next looks at the pressure (µs since `epoch`).
    next_pressure_check: AtomicU64,
    /// When the store last warned of pressure, and of refusals (µs since `epoch`; `0`:
    /// never).
    warned_pressure: AtomicU64,
    warned_refusal: AtomicU64,
    /// Bytes held by each scope's records (see [`SCOPE_BUCKETS`]).
    scope_bytes: Box<[AtomicU64]>,
    /// What one scope may hold (see `MemoryStoreBuilder::scope_share`) once protected
    /// records pass the high-water mark.
    scope_share: u64,
    /// Whether protected records held past the high-water mark at the last look.
    pressed: std::sync::atomic::AtomicBool,
    /// The protected window of the latest claim, in µs: the window the sustainable rate
    /// in a warning is worked out for.
    last_window_us: AtomicU64,
    /// One generation counter per shard, bumped when a record of the shard settles while
    /// someone listens: waiters for a busy key wake when its owner is done instead of
    /// polling. Per shard, not per key, so listening allocates nothing per key; a settle of
    /// a neighbour wakes a waiter for nothing, and it asks `begin` again.
    settled: Box<[tokio::sync::watch::Sender<u64>]>,
    gauges: Gauges,
}

/// With feature `metrics`, the gauges of what the store holds: handles taken once, so a
/// change costs the recorder's atomic add, never a registry lookup on the hot path.
#[cfg(feature = "metrics")]
struct Gauges {
    bytes: metrics::Gauge,
    records: metrics::Gauge,
    protected: metrics::Gauge,
}

#[cfg(feature = "metrics")]
impl Gauges {
    fn new() -> Self {
        Self {
            bytes: metrics::gauge!("idempotency_store_bytes", "store" => "memory"),
            records: metrics::gauge!("idempotency_store_records", "store" => "memory"),
            protected: metrics::gauge!("idempotency_store_protected_ratio", "store" => "memory"),
        }
    }

    /// The share of the budget protected records hold, as last looked at.
    fn protected(&self, ratio: f64) {
        self.protected.set(ratio);
    }

    /// A record of `weight` bytes came in.
    fn added(&self, weight: u64) {
        self.bytes.increment(weight as f64);
        self.records.increment(1.0);
    }

    /// A record of `weight` bytes left.
    fn removed(&self, weight: u64) {
        self.bytes.decrement(weight as f64);
        self.records.decrement(1.0);
    }

    /// A record held stayed, `old` bytes then, `new` now.
    fn reweighed(&self, old: u64, new: u64) {
        self.bytes.increment(new as f64 - old as f64);
    }
}

/// Without feature `metrics`, nothing to keep.
#[cfg(not(feature = "metrics"))]
struct Gauges;

#[cfg(not(feature = "metrics"))]
impl Gauges {
    fn new() -> Self {
        Self
    }

    fn added(&self, _: u64) {}

    fn removed(&self, _: u64) {}

    fn reweighed(&self, _: u64, _: u64) {}

    fn protected(&self, _: f64) {}
}

#[cfg(feature = "metrics")]
impl Drop for Inner {
    fn drop(&mut self) {
        // Stores add up in one series: a store that goes takes its share out.
        let records: u64 = self
            .shards
            .iter_mut()
            .map(|shard| {
                let shard = shard
                    .get_mut()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                shard.records.len() as u64
            })
            .sum();
        self.gauges.bytes.decrement(*self.used.get_mut() as f64);
        self.gauges.records.decrement(records as f64);
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

/// Builds a [`MemoryStore`].
///
/// ```
/// use tower_idempotency::ledger::MemoryStore;
///
/// let store = MemoryStore::builder().max_bytes(8 << 20).build();
/// # let _ = store;
/// ```
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct MemoryStoreBuilder {
    max_bytes: u64,
    scope_share: f64,
}

impl MemoryStoreBuilder {
    /// The byte budget for every record the store holds (default 192 MiB).
    pub fn max_bytes(mut self, max_bytes: u64) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// The share of the budget one scope (a tenant, a principal: [`BeginRequest::scope`])
    /// may hold once protected records pass 80 % of the budget (default 0.25): from then
    /// on a new claim of a scope over its share is refused, and the rest of the budget goes
    /// to the scopes under theirs, so one tenant's flood cannot turn every other tenant's
    /// requests into refusals. Below the mark, and for claims without a scope (the client
    /// face, an [unscoped](crate::idempotency::ServerBuilder::unscoped) server), nothing
    /// changes. `1.0` turns shares off.
    ///
    /// The cost: a store with one scope (a service called by one principal) refuses it
    /// once its protected records pass the mark, not when the budget is full.
    ///
    /// ```
    /// use tower_idempotency::ledger::MemoryStore;
    ///
    /// let store = MemoryStore::builder().scope_share(0.5).build();
    /// # let _ = store;
    /// ```
    pub fn scope_share(mut self, share: f64) -> Self {
        self.scope_share = share.clamp(0.0, 1.0);
        self
    }

    /// Build the store.
    pub fn build(self) -> MemoryStore {
        let shards = (0..SHARDS).map(|_| Mutex::new(Shard::default())).collect();
        MemoryStore {
            inner: Arc::new(Inner {
                shards,
                used: AtomicU64::new(0),
                max_bytes: self.max_bytes,
                evictable: Mutex::new(EvictionIndex::default()),
                next_seq: AtomicU64::new(0),
                last_claim: AtomicU64::new(0),
                evictions: AtomicU64::new(0),
                refused: AtomicU64::new(0),
                epoch: Instant::now(),
                open_expiry_floor: AtomicU64::new(u64::MAX),
                completed_bytes: AtomicU64::new(0),
                next_pressure_check: AtomicU64::new(0),
                warned_pressure: AtomicU64::new(0),
                warned_refusal: AtomicU64::new(0),
                last_window_us: AtomicU64::new(0),
                scope_bytes: (0..SCOPE_BUCKETS).map(|_| AtomicU64::new(0)).collect(),
                scope_share: (self.max_bytes as f64 * self.scope_share) as u64,
                pressed: std::sync::atomic::AtomicBool::new(false),
                settled: (0..SHARDS)
                    .map(|_| tokio::sync::watch::Sender::new(0))
                    .collect(),
                gauges: Gauges::new(),
            }),
        }
    }
}

impl Default for MemoryStore {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStore {
    /// A store with the default 192 MiB budget.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// Configure a store.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            max_bytes: DEFAULT_MAX_BYTES,
            scope_share: DEFAULT_SCOPE_SHARE,
        }
    }

    /// The bytes every record held now weighs, open and completed alike; never above the
    /// budget.
    ///
    /// ```
    /// let store = tower_idempotency::ledger::MemoryStore::new();
    /// assert_eq!(store.weighted_size(), 0);
    /// ```
    pub fn weighted_size(&self) -> u64 {
        self.inner.used.load(Ordering::Relaxed)
    }

    /// The byte budget.
    pub fn max_bytes(&self) -> u64 {
        self.inner.max_bytes
    }

    /// The number of records held now (including any past their retention not yet dropped).
    pub fn entry_count(&self) -> u64 {
        self.inner
            .shards
            .iter()
            .map(|s| lock(s).records.len() as u64)
            .sum()
    }

    /// How many completed records were evicted past their protected window to make room.
    pub fn evictions(&self) -> u64 {
        self.inner.evictions.load(Ordering::Relaxed)
    }

    /// How many claims were refused because the budget was full of records to keep.
    pub fn refused_claims(&self) -> u64 {
        self.inner.refused.load(Ordering::Relaxed)
    }

    /// Drop every record past its retention now.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let store = tower_idempotency::ledger::MemoryStore::new();
    /// store.run_pending_tasks().await;
    /// assert_eq!(store.entry_count(), 0);
    /// # }
    /// ```
    pub async fn run_pending_tasks(&self) {
        self.sweep_all(Instant::now());
    }

    /// The bytes of the records the store may not evict now (open ones, and completed ones
    /// inside their protected window): what a new claim cannot make room from. Estimated
    /// for the completed records, from their count and their mean weight.
    ///
    /// When it passes 80 % of the budget the store warns (at most every 30 s) with the rate
    /// of new operations it can sustain, and with feature `metrics` it is reported, as a
    /// share of the budget, in the gauge `idempotency_store_protected_ratio` (looked at no
    /// more than once a second, by the claims).
    ///
    /// ```
    /// let store = tower_idempotency::ledger::MemoryStore::new();
    /// assert_eq!(store.protected_bytes(), 0);
    /// ```
    pub fn protected_bytes(&self) -> u64 {
        self.protected_bytes_at(Instant::now())
    }

    fn protected_bytes_at(&self, now: Instant) -> u64 {
        // Read the completed bytes first: a record completing meanwhile moves bytes from
        // open to completed, which only makes this estimate err towards protected.
        let completed = self.inner.completed_bytes.load(Ordering::Relaxed);
        let used = self.inner.used.load(Ordering::Relaxed);
        let (held, ended) = lock(&self.inner.evictable).ended_by(now);
        let open = used.saturating_sub(completed);
        let inside = if held == 0 {
            0
        } else {
            (u128::from(completed) * (held - ended) as u128 / held as u128) as u64
        };
        (open + inside).min(used)
    }

    /// A record of scope bucket `scope` went from `old` to `new` bytes.
    fn scoped(&self, scope: u16, old: u64, new: u64) {
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

    /// Whether a new claim of `weight` bytes in scope bucket `scope` is over its share while
    /// the store is under pressure (then it is refused, leaving the room to other scopes).
    fn over_share(&self, scope: u16, weight: u64) -> bool {
        scope != 0
            && self.inner.pressed.load(Ordering::Relaxed)
            && self.inner.scope_bytes[usize::from(scope)].load(Ordering::Relaxed) + weight
                > self.inner.scope_share
    }

    /// µs from the store's epoch to `at`.
    fn micros(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.inner.epoch).as_micros() as u64
    }

    /// `at` as records hold it.
    fn stamp(&self, at: Instant) -> Stamp {
        let nanos = at.saturating_duration_since(self.inner.epoch).as_nanos();
        Stamp(u64::try_from(nanos).unwrap_or(u64::MAX))
    }

    /// A record's `stamp` as an instant (for the eviction order).
    fn instant(&self, stamp: Stamp) -> Instant {
        self.inner.epoch + Duration::from_nanos(stamp.0)
    }

    /// Whether to warn now, at most once every [`WARN_EVERY_US`] per kind of warning.
    fn may_warn(&self, last: &AtomicU64, at: u64) -> bool {
        let before = last.load(Ordering::Relaxed);
        if before != 0 && at < before + WARN_EVERY_US {
            return false;
        }
        last.compare_exchange(before, at.max(1), Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }

    /// At most once a second (the first claim to find it due): how much of the budget is
    /// protected, into the gauge, and a warning past the high-water mark.
    fn check_pressure(&self, now: Instant) {
        let at = self.micros(now);
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
        let pressed = protected * 100 >= max * HIGH_WATER_PERCENT;
        self.inner.pressed.store(pressed, Ordering::Relaxed);
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

    /// Drop every record past its retention, in every shard, and learn when the first open
    /// record left will end.
    fn sweep_all(&self, now: Instant) {
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

    /// Wake whoever listens for a settle in `key`'s shard. Called after the shard lock is
    /// released: a listener subscribed before its `begin` took that lock, so the lock orders
    /// its subscription before this check and it is never missed.
    fn announce_settled(&self, key: &LedgerKey) {
        let settled = &self.inner.settled[shard_index(key)];
        // Nobody listening (the common case): a single atomic load.
        if settled.receiver_count() > 0 {
            settled.send_modify(|generation| *generation = generation.wrapping_add(1));
        }
    }

    fn shard(&self, key: &LedgerKey) -> &Mutex<Shard> {
        &self.inner.shards[shard_index(key)]
    }

    /// Drop a shard's records whose retention ended.
    fn sweep(&self, shard: &mut Shard, now: Instant) {
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
    fn remove(&self, shard: &mut Shard, key: &LedgerKey) -> Option<Box<Record>> {
        let record = shard.records.remove(key)?;
        self.forget(&record);
        Some(record)
    }

    /// The budget, gauges and eviction order of a record taken out of its shard.
    fn forget(&self, record: &Record) {
        self.inner.used.fetch_sub(record.weight, Ordering::Relaxed);
        self.inner.gauges.removed(record.weight);
        self.scoped(record.scope, record.weight, 0);
        if let State::Completed { protect_until, .. } = record.state {
            self.inner
                .completed_bytes
                .fetch_sub(record.weight, Ordering::Relaxed);
            lock(&self.inner.evictable).remove((self.instant(protect_until), record.seq));
        }
    }

    /// Put `record` in the map, replacing `key`'s, if the budget has room for the
    /// difference; hand it back (`Some`) otherwise.
    #[must_use]
    fn insert_if_room(
        &self,
        shard: &mut Shard,
        key: LedgerKey,
        record: Box<Record>,
    ) -> Option<Box<Record>> {
        let old = shard.records.get(&key).map_or(0, |old| old.weight);
        if !self.reweigh(old, record.weight) {
            return Some(record);
        }
        if let State::Completed { protect_until, .. } = record.state {
            self.inner
                .completed_bytes
                .fetch_add(record.weight, Ordering::Relaxed);
            lock(&self.inner.evictable).insert((self.instant(protect_until), record.seq), key);
        }
        let (weight, scope) = (record.weight, record.scope);
        self.scoped(scope, 0, weight);
        match shard.records.insert(key, record) {
            Some(old) => {
                self.inner.gauges.reweighed(old.weight, weight);
                self.scoped(old.scope, old.weight, 0);
                if let State::Completed { protect_until, .. } = old.state {
                    self.inner
                        .completed_bytes
                        .fetch_sub(old.weight, Ordering::Relaxed);
                    lock(&self.inner.evictable).remove((self.instant(protect_until), old.seq));
                }
            }
            None => self.inner.gauges.added(weight),
        }
        None
    }

    /// Count a record going from `old` to `new` bytes against the budget, if it has room
    /// for the difference (`false`, counting nothing, if not).
    fn reweigh(&self, old: u64, new: u64) -> bool {
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
    fn has_room(&self, needed: u64) -> bool {
        self.inner.used.load(Ordering::Relaxed) + needed <= self.inner.max_bytes
    }

    /// Evict completed records past their protected window (and any record past its
    /// retention met on the way) until `needed` bytes are free; `false` if they cannot be.
    ///
    /// Takes no shard lock while holding the eviction index's, and is called with no shard
    /// lock held, so locks are only ever taken shard first.
    fn make_room(&self, needed: u64, now: Instant) -> bool {
        self.evict_until(needed, now, Sweep::IfNeeded)
    }

    /// [`make_room`](Self::make_room), sweeping for open records past their retention only
    /// under [`Sweep::IfNeeded`].
    fn evict_until(&self, needed: u64, now: Instant, sweep: Sweep) -> bool {
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
            let front = lock(&self.inner.evictable).first_ended_by(now);
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
            if shard
                .records
                .get(&key)
                .is_some_and(|record| record.seq == place.1)
            {
                let record = self
                    .remove(&mut shard, &key)
                    .expect("checked under the lock");
                if record.retain_until > self.stamp(now) {
                    self.inner.evictions.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    fn seq(&self) -> u64 {
        self.inner.next_seq.fetch_add(1, Ordering::Relaxed)
    }

    fn begin_now(&self, request: BeginRequest) -> Result<Begin, StoreError> {
        let now = Instant::now();
        let at = self.stamp(now);
        let mut shard = lock(self.shard(&request.key));
        if self.refuses_released(&shard, &request, at) {
            return Err(StoreError::fenced());
        }
        // One lookup for the common answers: a new claim, or what the record says.
        let record = match shard.records.entry(request.key) {
            Entry::Occupied(entry) if entry.get().retain_until > at => {
                return Ok(self.begin_on_existing(entry.into_mut(), request, at));
            }
            Entry::Occupied(entry) => {
                // Past its retention: gone, and claimed anew.
                let expired = entry.remove();
                self.forget(&expired);
                let record = Record::claim(&request, at, self.seq());
                if self.over_share(record.scope, record.weight) {
                    drop(shard);
                    return Err(self.refuse(now));
                }
                let weight = record.weight;
                match self.insert_if_room(&mut shard, request.key, record) {
                    None => {
                        shard.released.end(&request.key);
                        drop(shard);
                        self.claimed(weight, &request, now);
                        return Ok(acquired(&request));
                    }
                    Some(record) => record,
                }
            }
            Entry::Vacant(entry) => {
                // Absent: a new claim, if the budget has room for it and its scope is not
                // over its share of a store under pressure.
                let record = Record::claim(&request, at, self.seq());
                if self.over_share(record.scope, record.weight) {
                    drop(shard);
                    return Err(self.refuse(now));
                }
                match self.claim_vacant(entry, record) {
                    None => {
                        shard.released.end(&request.key);
                        drop(shard);
                        self.note_claim(&request, now);
                        return Ok(acquired(&request));
                    }
                    Some(record) => record,
                }
            }
        };
        // No room: evict what may be evicted, then try again.
        let needed = record.weight;
        drop(shard);
        if self.make_room(needed, now) {
            let mut shard = lock(self.shard(&request.key));
            // Released while this claim made room: refused as it would have been at first.
            if self.refuses_released(&shard, &request, self.stamp(now)) {
                return Err(StoreError::fenced());
            }
            match shard.records.entry(request.key) {
                Entry::Occupied(_) => {
                    // Someone claimed it meanwhile: answer as that record says.
                    drop(shard);
                    return self.begin_now(request);
                }
                Entry::Vacant(entry) => {
                    if self.claim_vacant(entry, record).is_none() {
                        shard.released.end(&request.key);
                        drop(shard);
                        self.note_claim(&request, now);
                        return Ok(acquired(&request));
                    }
                }
            }
        }
        Err(self.refuse(now))
    }

    /// Whether `request` is the late `begin` of a caller that released its token on a key
    /// that still has no record (one past its retention is none): it must claim nothing.
    fn refuses_released(&self, shard: &Shard, request: &BeginRequest, at: Stamp) -> bool {
        shard.released.refuses(&request.key, request.token, at)
            && !shard
                .records
                .get(&request.key)
                .is_some_and(|record| record.retain_until > at)
    }

    /// Refuse a claim for room: count it, warn (at most every 30 s) and say when room
    /// frees up, from the front of the eviction order alone (no sweep, no shard lock).
    fn refuse(&self, now: Instant) -> StoreError {
        // Refused claims look at the pressure too (when due): were every claim refused for
        // its share, nothing else would ever see the pressure pass.
        self.check_pressure(now);
        let refused = self.inner.refused.fetch_add(1, Ordering::Relaxed) + 1;
        let first_end = lock(&self.inner.evictable).first_end();
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

    /// Put a new claim in `entry`'s place (one lookup: a claim holds no outcome, so it is
    /// never in the eviction index) if the budget has room for it; hand it back if not.
    #[must_use]
    fn claim_vacant(
        &self,
        entry: std::collections::hash_map::VacantEntry<'_, LedgerKey, Box<Record>>,
        record: Box<Record>,
    ) -> Option<Box<Record>> {
        debug_assert!(matches!(record.state, State::InFlight { .. }));
        if !self.reweigh(0, record.weight) {
            return Some(record);
        }
        self.inner.last_claim.store(
            record.weight.min(self.inner.max_bytes / 16),
            Ordering::Relaxed,
        );
        self.inner.gauges.added(record.weight);
        self.scoped(record.scope, 0, record.weight);
        entry.insert(record);
        None
    }

    /// A claim of `weight` bytes was taken: the room a completion that evicts leaves for
    /// the next one (see `complete_now`), never more than a sixteenth of the budget, so an
    /// outsized claim cannot make completions empty the eviction index.
    fn claimed(&self, weight: u64, request: &BeginRequest, now: Instant) {
        let headroom = weight.min(self.inner.max_bytes / 16);
        self.inner.last_claim.store(headroom, Ordering::Relaxed);
        self.note_claim(request, now);
    }

    /// What every new claim tells the store, after its shard lock is released: when the
    /// open record may end (for the sweep's floor), its protected window (for the pressure
    /// warning), and a look at the pressure when one is due.
    fn note_claim(&self, request: &BeginRequest, now: Instant) {
        let ends = self.micros(now + request.retention);
        self.inner
            .open_expiry_floor
            .fetch_min(ends, Ordering::Relaxed);
        let window = request.protected_window().as_micros() as u64;
        if self.inner.last_window_us.load(Ordering::Relaxed) != window {
            self.inner.last_window_us.store(window, Ordering::Relaxed);
        }
        self.check_pressure(now);
    }

    fn begin_on_existing(&self, record: &mut Record, request: BeginRequest, now: Stamp) -> Begin {
        if record.fingerprint != request.fingerprint {
            return match &record.kept {
                Kept::Fields(fields) => Begin::DriftFields {
                    stored: record.fingerprint,
                    fields: fields.clone(),
                },
                kept => Begin::Drift {
                    stored: record.fingerprint,
                    frozen: kept.frozen(),
                },
            };
        }
        match &mut record.state {
            State::Completed { outcome, .. } => Begin::Replay(outcome.clone()),
            // Our own claim, asked again after a lost reply: the same answer.
            State::InFlight { token, resumed, .. } if *token == request.token.into() => {
                if *resumed {
                    Begin::Resume {
                        token: (*token).into(),
                        frozen: record.kept.frozen(),
                    }
                } else {
                    acquired(&request)
                }
            }
            State::InFlight { lease_until, .. } if *lease_until > now => Begin::Busy {
                retry_after: lease_until.since(now),
            },
            // In doubt, or in flight under an expired lease (the owner may have sent and
            // died). A probe is told so and changes nothing.
            _ if !request.take_over => Begin::InDoubt,
            state => {
                // Hand the operation over under the caller's token, with the bytes first
                // frozen. Its retention is not extended: only a completion starts a new life.
                *state = State::InFlight {
                    token: request.token.into(),
                    lease_until: now + request.lease,
                    resumed: true,
                };
                record.attempts += 1;
                Begin::Resume {
                    token: request.token,
                    frozen: record.kept.frozen(),
                }
            }
        }
    }

    /// The shard of `key`, locked, when `token`'s lease holds its record at `now` (for a
    /// settlement that may remove the record or put another in its place); else fenced.
    fn owned_shard(
        &self,
        key: &LedgerKey,
        token: LeaseToken,
        now: Instant,
    ) -> Result<MutexGuard<'_, Shard>, StoreError> {
        let shard = lock(self.shard(key));
        if shard
            .records
            .get(key)
            .is_some_and(|record| record.is_owned(token, self.stamp(now)))
        {
            Ok(shard)
        } else {
            Err(StoreError::fenced())
        }
    }

    /// Run `settle` on the open record of `key` owned by `token` at `now`, or refuse as
    /// fenced: for a change to the record alone, looked up once to check the lease and to
    /// change it.
    fn settle_record<T>(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        now: Instant,
        settle: impl FnOnce(&Self, &mut Record, Instant) -> T,
    ) -> Result<T, StoreError> {
        let mut shard = lock(self.shard(&key));
        match shard.records.get_mut(&key) {
            Some(record) if record.is_owned(token, self.stamp(now)) => {
                Ok(settle(self, record, now))
            }
            _ => Err(StoreError::fenced()),
        }
    }

    fn complete_now(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        mut outcome: Outcome,
        retention: Duration,
    ) -> Result<(), StoreError> {
        let now = Instant::now();
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
            room = self.evict_until(growth + headroom, now, Sweep::Never)
                || self.has_room(growth)
                || self.make_room(growth, now);
        }
        if room {
            let left_out = self.settle_record(key, token, now, |store, open, now| {
                store.complete_in_place(open, key, (outcome, weight), retention, now)
            })?;
            let Err((left, needed)) = left_out else {
                return Ok(());
            };
            // Other claims took the room meanwhile: evict once more.
            outcome = left;
            room = self.make_room(needed, Instant::now());
        }
        // No room for the whole outcome: settle for less.
        let now = Instant::now();
        let mut shard = self.owned_shard(&key, token, now)?;
        let open = shard.records.get_mut(&key).expect("owned");
        let outcome = if room {
            match self.complete_in_place(open, key, (outcome, weight), retention, now) {
                Ok(()) => return Ok(()),
                Err((outcome, _)) => outcome,
            }
        } else {
            outcome
        };
        let whole = open.completed(outcome, retention, self.stamp(now), self.seq());
        self.complete_as_tombstone(&mut shard, key, Box::new(whole));
        Ok(())
    }

    /// Complete the open `record` of `key` with `outcome` where it stands, if the budget
    /// has room for the outcome's bytes; else hand the outcome back with the bytes missing.
    fn complete_in_place(
        &self,
        record: &mut Record,
        key: LedgerKey,
        (outcome, outcome_weight): (Outcome, u64),
        retention: Duration,
        now: Instant,
    ) -> Result<(), (Outcome, u64)> {
        // What can fail (an instant out of range panics) comes before anything is written,
        // so a panic leaves the record, the budget and the eviction order as they were.
        let at = self.stamp(now);
        let protect_until = at + Duration::from_nanos(record.protected).min(retention);
        let retain_until = at + retention;
        let kept = record.kept.completed(record.open_kept_weight());
        let weight = record.completed_weight(outcome_weight, &kept);
        if !self.reweigh(record.weight, weight) {
            return Err((outcome, weight - record.weight));
        }
        self.inner.gauges.reweighed(record.weight, weight);
        self.scoped(record.scope, record.weight, weight);
        self.inner
            .completed_bytes
            .fetch_add(weight, Ordering::Relaxed);
        let seq = self.seq();
        // An open record is not in the eviction order: only its completion enters it.
        lock(&self.inner.evictable).insert((self.instant(protect_until), seq), key);
        record.state = State::Completed {
            outcome,
            protect_until,
        };
        record.retain_until = retain_until;
        record.seq = seq;
        record.weight = weight;
        record.kept = kept;
        Ok(())
    }

    /// Keep the fact that an operation is done when its outcome does not fit: a tombstone
    /// is never heavier than the claim it replaces (see [`TOMBSTONE_RESERVE`]).
    fn complete_as_tombstone(&self, shard: &mut Shard, key: LedgerKey, mut done: Box<Record>) {
        tracing::warn!(
            max_bytes = self.inner.max_bytes,
            "the memory ledger has no room for an outcome; keeping a tombstone (the operation \
             is done, but cannot be replayed)"
        );
        done.kept = Kept::Nothing;
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

/// The bucket a scope's bytes are counted in: `0` for no scope, never `0` for one.
fn scope_bucket(scope: u64) -> u16 {
    if scope == 0 {
        0
    } else {
        (scope % (SCOPE_BUCKETS - 1) + 1) as u16
    }
}

/// Keys are uniform hashes: their first byte spreads them over the shards.
fn shard_index(key: &LedgerKey) -> usize {
    usize::from(key.as_bytes()[0]) % SHARDS
}

fn acquired(request: &BeginRequest) -> Begin {
    Begin::Acquired {
        token: request.token,
    }
}

fn outcome_status(outcome: &Outcome) -> http::StatusCode {
    match outcome {
        Outcome::Response(response) => response.status(),
        Outcome::Tombstone { status } => *status,
    }
}

/// A poisoned lock only means another caller panicked mid-transition; every transition
/// works out what can fail before it writes (a record in one assignment, or in place once
/// nothing can fail), so the map is still consistent.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One shard: its records, and the tokens its keys without a record were released under.
#[derive(Default)]
struct Shard {
    /// The records, boxed: a map keeps a share of its slots empty (an eighth to over half,
    /// as it grows by doubling), and an empty slot of a key and a pointer costs 40 bytes
    /// where one of a key and a whole record would cost 200.
    records: HashMap<LedgerKey, Box<Record>, DigestState>,
    /// Released tokens of keys without a record (see [`Released`]). Behind the same lock
    /// as the records: a `begin` reads them and claims in one step, and an `abandon`
    /// releases and marks in one step, so no `begin` slips between the two.
    released: Released,
}

/// A record, in whichever state. Boxed in its shard, in an allocation of 144 bytes: keep it
/// there (its box grows by 16 bytes past each multiple of 16, less the allocator's 8).
#[derive(Debug)]
struct Record {
    fingerprint: Fingerprint,
    /// What is kept of the request.
    kept: Kept,
    state: State,
    /// When the record's retention ends.
    retain_until: Stamp,
    /// How long a completion of this record stays protected from eviction, in ns.
    protected: u64,
    /// Tells this life of the key from a later one (in the eviction index).
    seq: u64,
    /// Bytes counted against the budget.
    weight: u64,
    /// When the operation was first claimed.
    created: Stamp,
    /// Ownership handed out: the first claim and each resume.
    attempts: u32,
    /// The bucket of the scope's bytes this record counts in (`0`: no scope).
    scope: u16,
}

#[derive(Debug)]
enum State {
    /// An owner holds the lease. `resumed`: ownership came from a resume, so an earlier
    /// attempt may have been sent and the record can never be released.
    InFlight {
        token: HeldToken,
        lease_until: Stamp,
        resumed: bool,
    },
    /// An attempt may have been sent; the next claim resumes.
    InDoubt,
    /// Done; replayed until its retention ends. Never evicted before `protect_until`.
    Completed {
        outcome: Outcome,
        protect_until: Stamp,
    },
}

impl State {
    fn is_owned_by(&self, owner: LeaseToken) -> bool {
        matches!(self, Self::InFlight { token, .. } if *token == HeldToken::from(owner))
    }
}

const _: () = assert!(std::mem::size_of::<Record>() <= 136);

/// A [`LeaseToken`] as a record holds it: two words, aligned as words (a `u128` is aligned
/// to 16 bytes, which would pad every record to a multiple of 16).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct HeldToken([u64; 2]);

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
    /// Whether `token`'s lease holds this record at `now` (a record past its retention is
    /// gone, whatever it still holds).
    fn is_owned(&self, token: LeaseToken, now: Stamp) -> bool {
        self.retain_until > now && self.state.is_owned_by(token)
    }

    fn claim(request: &BeginRequest, now: Stamp, seq: u64) -> Box<Self> {
        let mut record = Box::new(Self {
            fingerprint: request.fingerprint,
            kept: request.frozen.clone().map_or(Kept::Nothing, Kept::Frozen),
            state: State::InFlight {
                token: request.token.into(),
                lease_until: now + request.lease,
                resumed: false,
            },
            retain_until: now + request.retention,
            protected: u64::try_from(request.protected_window().as_nanos()).unwrap_or(u64::MAX),
            seq,
            weight: 0,
            created: now,
            attempts: 1,
            scope: scope_bucket(request.scope),
        });
        record.weight = record.measure();
        record
    }

    /// This (open) record, completed with `outcome`, keeping nothing of its request.
    fn completed(&self, outcome: Outcome, retention: Duration, now: Stamp, seq: u64) -> Self {
        let mut done = Self {
            fingerprint: self.fingerprint,
            kept: Kept::Nothing,
            state: State::Completed {
                outcome,
                protect_until: now + Duration::from_nanos(self.protected).min(retention),
            },
            retain_until: now + retention,
            protected: self.protected,
            seq,
            weight: 0,
            created: self.created,
            attempts: self.attempts,
            scope: self.scope,
        };
        done.weight = done.measure();
        done
    }

    /// This (open) record's weight once completed with an outcome of `outcome_weight`,
    /// keeping `kept` of its request: its frozen request gives way to `kept`, and the reserve
    /// it kept for a tombstone to the outcome.
    fn completed_weight(&self, outcome_weight: u64, kept: &Kept) -> u64 {
        self.weight - self.open_kept_weight() + kept.weight() - TOMBSTONE_RESERVE + outcome_weight
    }

    /// What this open record's [`Kept`] weighs, from its weight (see
    /// [`measure`](Self::measure)) rather than measured again.
    fn open_kept_weight(&self) -> u64 {
        debug_assert!(!matches!(self.state, State::Completed { .. }));
        debug_assert_eq!(
            self.weight - Self::FIXED_WEIGHT - TOMBSTONE_RESERVE,
            self.kept.weight()
        );
        self.weight - Self::FIXED_WEIGHT - TOMBSTONE_RESERVE
    }

    /// What every record weighs besides what it keeps of its request and its outcome.
    const FIXED_WEIGHT: u64 = PER_RECORD_OVERHEAD
        + (std::mem::size_of::<LedgerKey>() + std::mem::size_of::<Self>()) as u64;

    /// The most completing an open record with an outcome of `outcome_weight` adds to the
    /// budget ([`completed_weight`](Self::completed_weight) less the open weight: what is
    /// kept of the request never outweighs the frozen request), known before the record is
    /// looked up.
    fn completion_growth(outcome_weight: u64) -> u64 {
        outcome_weight.saturating_sub(TOMBSTONE_RESERVE)
    }

    fn view(&self, now: Stamp) -> super::RecordView {
        let state = match &self.state {
            State::InFlight {
                lease_until,
                resumed,
                ..
            } => super::RecordState::InFlight {
                lease_left: lease_until.since(now),
                may_have_been_sent: *resumed,
            },
            State::InDoubt => super::RecordState::InDoubt,
            State::Completed { outcome, .. } => super::RecordState::Completed {
                status: outcome_status(outcome),
            },
        };
        super::RecordView {
            state,
            fingerprint: self.fingerprint,
            attempts: self.attempts,
            age: now.since(self.created),
            retention_left: self.retain_until.since(now),
        }
    }

    fn measure(&self) -> u64 {
        let kept = self.kept.weight();
        let state = match &self.state {
            State::Completed { outcome, .. } => outcome.weight() as u64,
            _ => TOMBSTONE_RESERVE,
        };
        Self::FIXED_WEIGHT + kept + state
    }
}

/// What a record keeps of its request.
#[derive(Debug)]
enum Kept {
    /// The frozen request, while the operation is open: resent on resume, shown when a
    /// later request drifts.
    Frozen(FrozenRequest),
    /// Once it is completed, nothing will be resent: the digests of its body's top-level
    /// JSON fields, to name the fields a later request changed.
    Fields(FieldDigests),
    /// Nothing (a request made without one, a body that is no JSON object, a tombstone).
    Nothing,
}

impl Kept {
    fn frozen(&self) -> Option<FrozenRequest> {
        match self {
            Self::Frozen(frozen) => Some(frozen.clone()),
            _ => None,
        }
    }

    fn weight(&self) -> u64 {
        match self {
            Self::Frozen(frozen) => frozen.weight() as u64,
            Self::Fields(fields) => fields.weight() as u64,
            Self::Nothing => 0,
        }
    }

    /// What a completed record keeps of this (which weighs `weight`): the field digests of
    /// a frozen request, if its body is a JSON object and they weigh less than the request
    /// (they always do but for bodies of many tiny fields, which then name no fields in a
    /// drift report).
    fn completed(&self, weight: u64) -> Self {
        let Self::Frozen(frozen) = self else {
            return Self::Nothing;
        };
        FieldDigests::of(frozen.body())
            .filter(|fields| fields.weight() as u64 <= weight)
            .map_or(Self::Nothing, Self::Fields)
    }
}

impl IdempotencyStore for MemoryStore {
    fn begin(&self, request: BeginRequest) -> StoreFuture<'_, Begin> {
        let answer = self.begin_now(request);
        StoreFuture::ready(answer)
    }

    fn complete(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        outcome: Outcome,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        let completed = self.complete_now(key, token, outcome, retention);
        if completed.is_ok() {
            self.announce_settled(&key);
        }
        StoreFuture::ready(completed)
    }

    fn abandon(&self, key: LedgerKey, token: LeaseToken) -> StoreFuture<'_, ()> {
        let at = self.stamp(Instant::now());
        let mut shard = lock(self.shard(&key));
        let settled = match shard.records.get_mut(&key) {
            Some(record) if record.is_owned(token, at) => {
                match record.state {
                    // No attempt can have left: forget it, the next caller starts afresh.
                    // The token stays released: a retried `begin` of it still on its way
                    // must not claim the key again.
                    State::InFlight { resumed: false, .. } => {
                        self.remove(&mut shard, &key);
                        shard.released.release(key, token, at);
                    }
                    // An earlier attempt may have been sent: releasing would let the next
                    // caller send new bytes. Keep it in doubt so the next caller resumes.
                    _ => record.state = State::InDoubt,
                }
                Ok(())
            }
            // Another caller's record: nothing of this token's to release.
            Some(record) if record.retain_until > at => Err(StoreError::fenced()),
            // No record (none, or one past its retention): this token's `begin` may still
            // be on its way; it must find the key released when it comes.
            _ => {
                shard.released.release(key, token, at);
                Err(StoreError::fenced())
            }
        };
        drop(shard);
        if settled.is_ok() {
            self.announce_settled(&key);
        }
        StoreFuture::ready(settled)
    }

    fn mark_in_doubt(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        let settled = self.settle_record(key, token, Instant::now(), |store, record, now| {
            record.state = State::InDoubt;
            // A real attempt failed: keep the record at least `retention` from now.
            record.retain_until = record.retain_until.max(store.stamp(now) + retention);
        });
        if settled.is_ok() {
            self.announce_settled(&key);
        }
        StoreFuture::ready(settled)
    }

    fn notify_settled(&self, key: LedgerKey) -> Option<super::Settled> {
        // Subscribing marks the current generation seen: only a later settle wakes it.
        let mut settled = self.inner.settled[shard_index(&key)].subscribe();
        Some(Box::pin(async move {
            // An error means the store is gone: nothing will settle, waking is right.
            let _ = settled.changed().await;
        }))
    }

    fn inspect(&self, key: LedgerKey) -> StoreFuture<'_, Option<super::RecordView>> {
        let now = self.stamp(Instant::now());
        let shard = lock(self.shard(&key));
        let view = shard
            .records
            .get(&key)
            .filter(|record| record.retain_until > now)
            .map(|record| record.view(now));
        StoreFuture::ready(Ok(view))
    }

    fn renew(&self, key: LedgerKey, token: LeaseToken, lease: Duration) -> StoreFuture<'_, ()> {
        let settled = self.settle_record(key, token, Instant::now(), |store, record, now| {
            if let State::InFlight { lease_until, .. } = &mut record.state {
                *lease_until = store.stamp(now) + lease;
            }
        });
        StoreFuture::ready(settled)
    }

    // An operator forgetting one record (see `ledger::forget`). The record is judged and
    // removed under its shard's lock, so nothing can move it in between; removal is the
    // same as a retention's end (budget, gauges and eviction order follow), and it wakes
    // waiters like a settle, since the key is free now.
    fn forget(&self, key: LedgerKey, expected: super::Expected) -> StoreFuture<'_, super::Forget> {
        let now = self.stamp(Instant::now());
        let answer = {
            let mut shard = lock(self.shard(&key));
            let current = shard
                .records
                .get(&key)
                .filter(|record| record.retain_until > now)
                .map(|record| record.view(now));
            let answer = expected.judge(current.as_ref());
            if answer.is_forgotten() {
                self.remove(&mut shard, &key);
            }
            answer
        };
        if answer.is_forgotten() {
            self.announce_settled(&key);
        }
        let answer = Ok(answer);
        super::report_forget("memory", &key, &expected, &answer);
        StoreFuture::ready(answer)
    }
}
