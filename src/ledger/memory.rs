//! The in-process ledger: open operations in a sharded map, outcomes in `moka`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use moka::future::Cache;
use moka::policy::EvictionPolicy;
use moka::Expiry;
use tokio::sync::Mutex;
use tokio::time::Instant;

use super::{
    Begin, BeginRequest, DigestState, IdempotencyStore, LeaseToken, LedgerKey, Outcome, StoreError,
    StoreFuture,
};
use crate::fingerprint::Fingerprint;
use crate::frozen::FrozenRequest;

/// The default byte budget of a [`MemoryStore`]: 64 MiB.
const DEFAULT_MAX_BYTES: u64 = 64 * 1024 * 1024;

/// Shards of the open-operation map: enough that unrelated keys rarely share a lock on a
/// many-core machine, few enough to stay small.
const SHARDS: usize = 64;

/// The embedded ledger, in this process.
///
/// Records live in one of two places, by state:
///
/// - **Open operations** (in flight or in doubt) sit in a sharded map and are **never
///   evicted**: they are exactly the records whose loss would let a second caller send the
///   same operation (an in-flight claim forgotten) or lose the bytes a resume must resend
///   (an in-doubt record forgotten). They leave when they complete, when they are released
///   after a pre-write failure, or when their retention ends.
/// - **Completed operations** sit in a `moka` cache weighed in bytes (key, bookkeeping,
///   frozen request and recorded response), holding at most
///   [`max_bytes`](MemoryStoreBuilder::max_bytes) (64 MiB by default) and evicting the
///   least recently used beyond it. LRU rather than moka's default TinyLFU on purpose:
///   TinyLFU may refuse to admit a new outcome at all. A completed record heavier than the
///   whole budget is kept as a tombstone (status only), so it answers "done, not
///   replayable" instead of being dropped on arrival.
///
/// Every transition of a key runs under its shard's lock, from the first read to the last
/// write (moka calls included), so `begin` is one atomic step: two callers racing on a key
/// never both acquire it. The lock is per shard, held for a map lookup and at most one
/// moka operation.
///
/// Leases and retention are checked against [`tokio::time::Instant`] on every access (so
/// they follow a paused test clock); moka also drops each outcome when its retention ends,
/// to reclaim the memory.
///
/// Size the budget for your retention: an evicted outcome is a forgotten operation, and a
/// forgotten operation runs again. Use `RedisStore` (feature `redis`) when several
/// processes share operations or an orchestrator must resume after a crash.
///
/// Keeping open claims out of moka is also the fast path: a claim is a map insert under
/// an uncontended lock instead of a moka write (moka's housekeeping makes each write cost
/// microseconds), and a fresh operation writes to moka once, when it completes.
///
/// # Example
///
/// ```
/// use tower_idempotency::ledger::MemoryStore;
///
/// let store = MemoryStore::builder().max_bytes(16 * 1024 * 1024).build();
/// # let _ = store;
/// ```
#[derive(Clone, Debug)]
pub struct MemoryStore {
    inner: Arc<Inner>,
}

struct Inner {
    open: Box<[Mutex<OpenShard>]>,
    open_bytes: AtomicU64,
    completed: Cache<LedgerKey, Arc<Completed>, DigestState>,
    max_bytes: u64,
}

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryStore")
            .field("max_bytes", &self.max_bytes)
            .field("completed", &self.completed.entry_count())
            .field("open_bytes", &self.open_bytes.load(Ordering::Relaxed))
            .finish()
    }
}

/// Builds a [`MemoryStore`].
#[derive(Clone, Debug)]
pub struct MemoryStoreBuilder {
    max_bytes: u64,
}

impl MemoryStoreBuilder {
    /// The byte budget for completed records (default 64 MiB).
    pub fn max_bytes(mut self, max_bytes: u64) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// Build the store.
    pub fn build(self) -> MemoryStore {
        let completed = Cache::builder()
            .max_capacity(self.max_bytes)
            .weigher(|_key: &LedgerKey, record: &Arc<Completed>| record.weight)
            .eviction_policy(EvictionPolicy::lru())
            .expire_after(RetentionExpiry)
            .build_with_hasher(DigestState::default());
        let open = (0..SHARDS)
            .map(|_| Mutex::new(OpenShard::default()))
            .collect();
        MemoryStore {
            inner: Arc::new(Inner {
                open,
                open_bytes: AtomicU64::new(0),
                completed,
                max_bytes: self.max_bytes,
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
    /// A store with the default 64 MiB budget.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// Configure a store.
    pub fn builder() -> MemoryStoreBuilder {
        MemoryStoreBuilder {
            max_bytes: DEFAULT_MAX_BYTES,
        }
    }

    /// The bytes the store's records weigh now: open operations exactly, completed ones as of
    /// moka's last housekeeping (exactly, after [`run_pending_tasks`](Self::run_pending_tasks)).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let store = tower_idempotency::ledger::MemoryStore::new();
    /// store.run_pending_tasks().await;
    /// assert_eq!(store.weighted_size(), 0);
    /// # }
    /// ```
    pub fn weighted_size(&self) -> u64 {
        self.inner.completed.weighted_size() + self.inner.open_bytes.load(Ordering::Relaxed)
    }

    /// The number of records: completed ones as of moka's last housekeeping, plus open ones.
    pub fn entry_count(&self) -> u64 {
        let open: usize = self
            .inner
            .open
            .iter()
            .map(|shard| shard.try_lock().map_or(0, |map| map.len()))
            .sum();
        self.inner.completed.entry_count() + open as u64
    }

    /// Run moka's pending housekeeping (evictions, expirations) now, and drop open
    /// operations past their retention.
    pub async fn run_pending_tasks(&self) {
        self.inner.completed.run_pending_tasks().await;
        let now = Instant::now();
        for shard in self.inner.open.iter() {
            let mut open = shard.lock().await;
            self.sweep(&mut open, now);
        }
    }

    fn shard(&self, key: &LedgerKey) -> &Mutex<OpenShard> {
        // Ledger keys are SHA-256 digests: any of their bytes is already uniform.
        &self.inner.open[usize::from(key.as_bytes()[0]) % SHARDS]
    }

    /// Drop open operations whose retention ended.
    fn sweep(&self, open: &mut OpenShard, now: Instant) {
        open.retain(|_, record| {
            let keep = record.retain_until > now;
            if !keep {
                self.forget_open_bytes(record);
            }
            keep
        });
    }

    fn insert_open(&self, open: &mut OpenShard, key: LedgerKey, record: Open) {
        self.inner
            .open_bytes
            .fetch_add(record.weight(), Ordering::Relaxed);
        if let Some(old) = open.insert(key, record) {
            self.forget_open_bytes(&old);
        }
        // Amortised cleanup: open operations past their retention (abandoned in-doubt
        // records) are dropped whenever a shard doubles.
        if open.len() >= 64 && open.len().is_power_of_two() {
            self.sweep(open, Instant::now());
        }
    }

    fn remove_open(&self, open: &mut OpenShard, key: &LedgerKey) -> Option<Open> {
        let record = open.remove(key)?;
        self.forget_open_bytes(&record);
        Some(record)
    }

    fn forget_open_bytes(&self, record: &Open) {
        self.inner
            .open_bytes
            .fetch_sub(record.weight(), Ordering::Relaxed);
    }

    /// The live completed record of `key`, if any.
    async fn completed(&self, key: &LedgerKey, now: Instant) -> Option<Arc<Completed>> {
        self.inner
            .completed
            .get(key)
            .await
            .filter(|record| record.retain_until > now)
    }

    async fn begin_locked(&self, request: BeginRequest) -> Begin {
        let now = Instant::now();
        let mut open = self.shard(&request.key).lock().await;
        let live = open
            .get(&request.key)
            .filter(|record| record.retain_until > now)
            .map(Open::clone_shallow);
        if let Some(record) = live {
            return self.begin_on_open(&mut open, record, request, now);
        }
        if let Some(done) = self.completed(&request.key, now).await {
            return if done.fingerprint == request.fingerprint {
                Begin::Replay(done.outcome.clone())
            } else {
                Begin::Drift {
                    stored: done.fingerprint,
                    frozen: done.frozen.clone(),
                }
            };
        }
        let token = LeaseToken::generate();
        let record = Open {
            fingerprint: request.fingerprint,
            frozen: request.frozen,
            token: Some(token),
            lease_until: now + request.lease,
            may_have_sent: false,
            retention: request.retention,
            retain_until: now + request.retention,
        };
        self.insert_open(&mut open, request.key, record);
        Begin::Acquired { token }
    }

    fn begin_on_open(
        &self,
        open: &mut OpenShard,
        record: Open,
        request: BeginRequest,
        now: Instant,
    ) -> Begin {
        if record.fingerprint != request.fingerprint {
            return Begin::Drift {
                stored: record.fingerprint,
                frozen: record.frozen,
            };
        }
        if record.token.is_some() && record.lease_until > now {
            return Begin::Busy {
                retry_after: record.lease_until - now,
            };
        }
        // In doubt, or in flight under an expired lease (the owner may have sent and died):
        // hand the operation to this caller under a new token, with the bytes first frozen.
        let token = LeaseToken::generate();
        let frozen = record.frozen.clone();
        let resumed = Open {
            token: Some(token),
            lease_until: now + request.lease,
            may_have_sent: true,
            retention: request.retention,
            retain_until: now + request.retention,
            ..record
        };
        self.insert_open(open, request.key, resumed);
        Begin::Resume { token, frozen }
    }

    /// Run `settle` on the open record of `key` owned by `token`, or refuse as fenced.
    async fn settle(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        settle: impl FnOnce(&Self, &mut OpenShard, Open, Instant) -> Settled,
    ) -> Result<(), StoreError> {
        let now = Instant::now();
        let mut open = self.shard(&key).lock().await;
        let owned = open
            .get(&key)
            .is_some_and(|record| record.token == Some(token) && record.retain_until > now);
        if !owned {
            return Err(StoreError::fenced());
        }
        let record = self
            .remove_open(&mut open, &key)
            .expect("checked under the same lock");
        match settle(self, &mut open, record, now) {
            Settled::Done => {}
            Settled::Complete(done) => {
                // Inserted while the shard is still locked: no `begin` of this key can run
                // between the open record leaving and the outcome arriving.
                self.inner.completed.insert(key, Arc::new(done)).await;
            }
        }
        Ok(())
    }
}

/// One shard of the open operations.
type OpenShard = HashMap<LedgerKey, Open, DigestState>;

enum Settled {
    Done,
    Complete(Completed),
}

/// An operation in flight (`token` set) or in doubt (`token` empty).
#[derive(Debug)]
struct Open {
    fingerprint: Fingerprint,
    frozen: Option<FrozenRequest>,
    token: Option<LeaseToken>,
    lease_until: Instant,
    /// Whether any attempt of this operation may have reached the server; once true, the
    /// record can only be resumed or completed, never released.
    may_have_sent: bool,
    retention: Duration,
    retain_until: Instant,
}

impl Open {
    fn weight(&self) -> u64 {
        let frozen = self.frozen.as_ref().map_or(0, FrozenRequest::weight);
        (std::mem::size_of::<LedgerKey>() + std::mem::size_of::<Self>() + frozen) as u64
    }

    fn clone_shallow(&self) -> Self {
        Self {
            fingerprint: self.fingerprint,
            frozen: self.frozen.clone(),
            token: self.token,
            lease_until: self.lease_until,
            may_have_sent: self.may_have_sent,
            retention: self.retention,
            retain_until: self.retain_until,
        }
    }
}

/// A completed operation.
#[derive(Debug)]
struct Completed {
    fingerprint: Fingerprint,
    /// Kept to name the fields that changed when a later request drifts.
    frozen: Option<FrozenRequest>,
    outcome: Outcome,
    retention: Duration,
    retain_until: Instant,
    weight: u32,
}

impl Completed {
    fn new(
        open: Open,
        outcome: Outcome,
        retention: Duration,
        now: Instant,
        max_bytes: u64,
    ) -> Self {
        let mut done = Self {
            fingerprint: open.fingerprint,
            frozen: open.frozen,
            outcome,
            retention,
            retain_until: now + retention,
            weight: 0,
        };
        done.weight = done.measure();
        if u64::from(done.weight) > max_bytes {
            // Heavier than the whole budget: moka would drop it on arrival and the
            // operation would be forgotten. Keep the fact that it is done instead.
            let status = match &done.outcome {
                Outcome::Response(response) => response.status(),
                Outcome::Tombstone { status } => *status,
            };
            done.frozen = None;
            done.outcome = Outcome::Tombstone { status };
            done.weight = done.measure();
        }
        done
    }

    fn measure(&self) -> u32 {
        // What moka spends per entry besides the value (its node, deque and timer entries,
        // the key's `Arc`): about 280 bytes in 7 allocations, measured.
        const MOKA_ENTRY: usize = 320;
        let frozen = self.frozen.as_ref().map_or(0, FrozenRequest::weight);
        let total = MOKA_ENTRY
            + std::mem::size_of::<LedgerKey>()
            + std::mem::size_of::<Self>()
            + frozen
            + self.outcome.weight();
        u32::try_from(total).unwrap_or(u32::MAX)
    }
}

/// moka's own expiry: drop an outcome's memory when its retention ends.
struct RetentionExpiry;

impl Expiry<LedgerKey, Arc<Completed>> for RetentionExpiry {
    fn expire_after_create(
        &self,
        _: &LedgerKey,
        record: &Arc<Completed>,
        _: std::time::Instant,
    ) -> Option<Duration> {
        Some(record.retention)
    }

    fn expire_after_update(
        &self,
        _: &LedgerKey,
        record: &Arc<Completed>,
        _: std::time::Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        Some(record.retention)
    }
}

impl IdempotencyStore for MemoryStore {
    fn begin(&self, request: BeginRequest) -> StoreFuture<'_, Begin> {
        Box::pin(async move { Ok(self.begin_locked(request).await) })
    }

    fn complete(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        outcome: Outcome,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            let max_bytes = self.inner.max_bytes;
            self.settle(key, token, move |_, _, record, now| {
                Settled::Complete(Completed::new(record, outcome, retention, now, max_bytes))
            })
            .await
        })
    }

    fn abandon(&self, key: LedgerKey, token: LeaseToken) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            self.settle(key, token, |store, open, record, _| {
                // An earlier attempt may have been sent: releasing would let the next caller
                // send new bytes. Keep it in doubt so the next caller resumes instead.
                if record.may_have_sent {
                    let in_doubt = Open {
                        token: None,
                        ..record
                    };
                    store.insert_open(open, key, in_doubt);
                }
                Settled::Done
            })
            .await
        })
    }

    fn mark_in_doubt(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            self.settle(key, token, |store, open, record, now| {
                let in_doubt = Open {
                    token: None,
                    may_have_sent: true,
                    retention,
                    retain_until: now + retention,
                    ..record
                };
                store.insert_open(open, key, in_doubt);
                Settled::Done
            })
            .await
        })
    }
}
