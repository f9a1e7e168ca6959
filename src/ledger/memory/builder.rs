//! [`MemoryStoreBuilder`]: the byte budget and the scopes' share of it.

use tokio::time::Instant;

use super::eviction::EvictionIndex;
use super::record::SCOPE_BUCKETS;
use super::shared::{Gauges, Inner, Shard, SHARDS};
use super::store::MemoryStore;
use super::sync::{Arc, AtomicU64, Mutex};

/// The default byte budget of a [`MemoryStore`]: 192 MiB. With the layers' default protected
/// windows it keeps up with ~5,000 new server operations a second (~570 bytes a record with
/// a 50-byte response, lease + 1 min) or ~8,000 client ones (~600 bytes with a 1 KiB
/// request, retry window + lease, 40 s), so each face's target rate (2,000 and 1,000 a
/// second) keeps 40 % and 12 % of it protected: room for responses of several hundred
/// bytes (a server record weighs its response) below the warning's 80 % mark.
const DEFAULT_MAX_BYTES: u64 = 192 * 1024 * 1024;

/// The default share of the budget one scope may hold once the store is under pressure.
const DEFAULT_SCOPE_SHARE: f64 = 0.25;

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
    /// The defaults: 192 MiB, a quarter of it per scope under pressure.
    pub(super) fn new() -> Self {
        Self {
            max_bytes: DEFAULT_MAX_BYTES,
            scope_share: DEFAULT_SCOPE_SHARE,
        }
    }

    /// The byte budget for every record the store holds (default 192 MiB).
    pub fn max_bytes(mut self, max_bytes: u64) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// The share of the budget one scope (a tenant, a principal: [`BeginRequest::scope`](crate::ledger::BeginRequest::scope))
    /// may hold once protected records (open ones, and completed ones inside their
    /// protected window) reach 80 % of the budget (default 0.25). From then on, judged on
    /// the bytes held at that moment:
    ///
    /// - a new claim that would take its scope past its share is refused (a
    ///   [full](crate::ledger::StoreError::is_full) error: the layers answer 503 and send
    ///   nothing);
    /// - a completion whose outcome would take its scope past its share is still recorded
    ///   as done, as a tombstone (its status, not its body: never run again, but a replay
    ///   answers [`replay_unavailable`](crate::Error::is_replay_unavailable)), in the room
    ///   its claim already held. An effect that happened is never forgotten; its bytes are
    ///   what a scope past its share gives up, since a tenant's open operations, each small
    ///   as a claim, could otherwise fill the store as they complete.
    ///
    /// So one tenant's flood cannot turn every other tenant's requests into refusals: the
    /// rest of the budget goes to the scopes under their share. Below the mark nothing is
    /// capped (a lone tenant may fill the store up to it), and claims without a scope (the
    /// client face, an [unscoped](crate::server::Builder::unscoped) server) are never
    /// judged. `1.0` turns shares off.
    ///
    /// The cost: a store with one scope (a service called by one principal) refuses it
    /// once its protected records reach the mark, not when the budget is full.
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
        MemoryStoreBuilder::new()
    }
}
