//! The in-process ledger on `moka`.

use std::sync::Arc;
use std::time::Duration;

use moka::future::Cache;
use moka::ops::compute::Op;
use moka::policy::EvictionPolicy;
use moka::Expiry;
use tokio::time::Instant;

use super::{
    Begin, BeginRequest, IdempotencyStore, LeaseToken, LedgerKey, Outcome, StoreError, StoreFuture,
};
use crate::fingerprint::Fingerprint;
use crate::frozen::FrozenRequest;

/// The default byte budget of a [`MemoryStore`]: 64 MiB.
const DEFAULT_MAX_BYTES: u64 = 64 * 1024 * 1024;

/// The embedded ledger: a byte-weighed `moka` cache in this process.
///
/// - **Atomic**: every transition runs inside moka's per-key `and_compute_with`, so two
///   callers racing on one key are serialised; there is no check-then-set.
/// - **Byte-weighed**: each record weighs its key, its bookkeeping, its frozen request and
///   its recorded response; the cache holds at most [`max_bytes`](MemoryStoreBuilder::max_bytes)
///   (64 MiB by default) and evicts least-recently-used records beyond it. LRU rather than
///   moka's default TinyLFU on purpose: TinyLFU may refuse to admit a brand-new record, and a
///   refused claim would let a concurrent caller claim the same operation again.
/// - **Two clocks of expiry**: leases and retention are checked against
///   [`tokio::time::Instant`] on every access (so they follow a paused test clock), and moka
///   drops each record when its retention ends to reclaim the memory.
///
/// Size the cap for your retention: an evicted record is a forgotten operation. Use
/// [`RedisStore`](crate::ledger) when several processes share operations or an orchestrator
/// must resume after a crash.
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
    cache: Cache<LedgerKey, Arc<Record>>,
}

/// Builds a [`MemoryStore`].
#[derive(Clone, Debug)]
pub struct MemoryStoreBuilder {
    max_bytes: u64,
}

impl MemoryStoreBuilder {
    /// The byte budget for all records (default 64 MiB).
    pub fn max_bytes(mut self, max_bytes: u64) -> Self {
        self.max_bytes = max_bytes;
        self
    }

    /// Build the store.
    pub fn build(self) -> MemoryStore {
        let cache = Cache::builder()
            .max_capacity(self.max_bytes)
            .weigher(|_key: &LedgerKey, record: &Arc<Record>| record.weight())
            .eviction_policy(EvictionPolicy::lru())
            .expire_after(RetentionExpiry)
            .build();
        MemoryStore { cache }
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

    /// The bytes the store's records weigh now (after [`run_pending_tasks`](Self::run_pending_tasks),
    /// exactly; otherwise as of moka's last housekeeping).
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
        self.cache.weighted_size()
    }

    /// The number of records (as of moka's last housekeeping).
    pub fn entry_count(&self) -> u64 {
        self.cache.entry_count()
    }

    /// Run moka's pending housekeeping (evictions, expirations) now.
    pub async fn run_pending_tasks(&self) {
        self.cache.run_pending_tasks().await;
    }

    /// Apply `transition` to the live record of `key` atomically, returning its answer.
    async fn transition<T>(
        &self,
        key: LedgerKey,
        transition: impl FnOnce(Option<&Record>, Instant) -> (Op<Arc<Record>>, T),
    ) -> T {
        let mut answer = None;
        let now = Instant::now();
        self.cache
            .entry(key)
            .and_compute_with(|entry| {
                // A record past its retention is gone, whether or not moka has reaped it.
                let live = entry
                    .map(|entry| entry.into_value())
                    .filter(|record| record.retain_until > now);
                let (op, result) = transition(live.as_deref(), now);
                answer = Some(result);
                std::future::ready(op)
            })
            .await;
        answer.expect("and_compute_with always runs its closure")
    }
}

/// One ledger record.
#[derive(Debug)]
struct Record {
    fingerprint: Fingerprint,
    frozen: Option<FrozenRequest>,
    state: State,
    /// Whether any attempt of this operation may have reached the server; once true, the
    /// record can only be resumed or completed, never released.
    may_have_sent: bool,
    retention: Duration,
    retain_until: Instant,
}

#[derive(Debug)]
enum State {
    InFlight {
        token: LeaseToken,
        lease_until: Instant,
    },
    InDoubt,
    Completed(Outcome),
}

impl Record {
    fn weight(&self) -> u32 {
        let frozen = self.frozen.as_ref().map_or(0, FrozenRequest::weight);
        let outcome = match &self.state {
            State::Completed(outcome) => outcome.weight(),
            _ => 0,
        };
        let total =
            std::mem::size_of::<LedgerKey>() + std::mem::size_of::<Self>() + frozen + outcome;
        u32::try_from(total).unwrap_or(u32::MAX)
    }

    fn with_state(
        &self,
        state: State,
        may_have_sent: bool,
        retention: Duration,
        now: Instant,
    ) -> Arc<Self> {
        Arc::new(Self {
            fingerprint: self.fingerprint,
            frozen: self.frozen.clone(),
            state,
            may_have_sent,
            retention,
            retain_until: now + retention,
        })
    }

    fn owned_by(&self, token: LeaseToken) -> bool {
        matches!(self.state, State::InFlight { token: owner, .. } if owner == token)
    }
}

/// moka's own expiry: drop a record's memory when its retention ends.
struct RetentionExpiry;

impl Expiry<LedgerKey, Arc<Record>> for RetentionExpiry {
    fn expire_after_create(
        &self,
        _: &LedgerKey,
        record: &Arc<Record>,
        _: std::time::Instant,
    ) -> Option<Duration> {
        Some(record.retention)
    }

    fn expire_after_update(
        &self,
        _: &LedgerKey,
        record: &Arc<Record>,
        _: std::time::Instant,
        _: Option<Duration>,
    ) -> Option<Duration> {
        Some(record.retention)
    }
}

fn decide_begin(
    current: Option<&Record>,
    request: BeginRequest,
    now: Instant,
) -> (Op<Arc<Record>>, Begin) {
    let Some(record) = current else {
        let token = LeaseToken::generate();
        let record = Record {
            fingerprint: request.fingerprint,
            frozen: request.frozen,
            state: State::InFlight {
                token,
                lease_until: now + request.lease,
            },
            may_have_sent: false,
            retention: request.retention,
            retain_until: now + request.retention,
        };
        return (Op::Put(Arc::new(record)), Begin::Acquired { token });
    };
    if record.fingerprint != request.fingerprint {
        let drift = Begin::Drift {
            stored: record.fingerprint,
            frozen: record.frozen.clone(),
        };
        return (Op::Nop, drift);
    }
    match &record.state {
        State::InFlight { lease_until, .. } if *lease_until > now => (
            Op::Nop,
            Begin::Busy {
                retry_after: *lease_until - now,
            },
        ),
        // An expired lease is in doubt: the owner may have sent and died. Hand the operation
        // to this caller under a new token, with the bytes first frozen.
        State::InFlight { .. } | State::InDoubt => {
            let token = LeaseToken::generate();
            let lease_until = now + request.lease;
            let next = record.with_state(
                State::InFlight { token, lease_until },
                true,
                request.retention,
                now,
            );
            let frozen = record.frozen.clone();
            (Op::Put(next), Begin::Resume { token, frozen })
        }
        State::Completed(outcome) => (Op::Nop, Begin::Replay(outcome.clone())),
    }
}

impl IdempotencyStore for MemoryStore {
    fn begin(&self, request: BeginRequest) -> StoreFuture<'_, Begin> {
        Box::pin(async move {
            let key = request.key;
            Ok(self
                .transition(key, |current, now| decide_begin(current, request, now))
                .await)
        })
    }

    fn complete(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        outcome: Outcome,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            self.transition(key, |current, now| match current {
                Some(record) if record.owned_by(token) => {
                    let may_have_sent = record.may_have_sent;
                    (
                        Op::Put(record.with_state(
                            State::Completed(outcome),
                            may_have_sent,
                            retention,
                            now,
                        )),
                        Ok(()),
                    )
                }
                _ => (Op::Nop, Err(StoreError::fenced())),
            })
            .await
        })
    }

    fn abandon(&self, key: LedgerKey, token: LeaseToken) -> StoreFuture<'_, ()> {
        Box::pin(async move {
            self.transition(key, |current, now| match current {
                // An earlier attempt may have been sent: releasing would let the next caller
                // send new bytes. Keep it in doubt so the next caller resumes instead.
                Some(record) if record.owned_by(token) && record.may_have_sent => {
                    let retention = record.retention;
                    (
                        Op::Put(record.with_state(State::InDoubt, true, retention, now)),
                        Ok(()),
                    )
                }
                Some(record) if record.owned_by(token) => (Op::Remove, Ok(())),
                _ => (Op::Nop, Err(StoreError::fenced())),
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
            self.transition(key, |current, now| match current {
                Some(record) if record.owned_by(token) => (
                    Op::Put(record.with_state(State::InDoubt, true, retention, now)),
                    Ok(()),
                ),
                _ => (Op::Nop, Err(StoreError::fenced())),
            })
            .await
        })
    }
}
