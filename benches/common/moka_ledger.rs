//! The best moka-backed ledger we know how to build, as a yardstick for `MemoryStore`.
//!
//! `MemoryStore` keeps every record in its own sharded map with an eviction index. The
//! design it replaced kept completed outcomes in moka; this is that design with every
//! improvement profiling found, so the two can be measured side by side in one run
//! (`op_cost moka_*`, `benches/ledger.rs`):
//!
//! - open operations (in flight, in doubt) in a sharded map under `std` mutexes, never in
//!   moka (a claim is a map insert, not a cache write);
//! - completed outcomes in a `moka::sync::Cache` (no async wrapper), weighed in bytes like
//!   `MemoryStore`'s records, LRU (TinyLFU may refuse to admit a new outcome at all), no
//!   per-entry expiry (retention is checked on every read instead), and `contains_key`
//!   before `get`, so a fresh key costs no miss bookkeeping.
//!
//! What it cannot do, and why `MemoryStore` no longer uses moka: moka evicts by its own
//! policy when the weighed size passes the cap. It can neither be told that an outcome is
//! inside its protected window (evicting it lets a retry still in its window run the
//! operation again) nor refuse a new entry when everything it holds must be kept; and open
//! records live outside its budget. Every operation here is otherwise the protocol's, so its
//! hot paths cost what a moka-backed store's would.
#![allow(dead_code)] // each user (op_cost, the ledger bench) uses its own part of it

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use moka::policy::EvictionPolicy;
use moka::sync::Cache;
use tokio::time::Instant;
use tower_idempotency::ledger::{
    Begin, BeginRequest, IdempotencyStore, LeaseToken, LedgerKey, Outcome, StoreError, StoreFuture,
};
use tower_idempotency::{fingerprint::Fingerprint, FrozenRequest};

const SHARDS: usize = 64;

/// Bookkeeping a completed entry costs besides its bodies: moka's per-entry node, its
/// deque links and the `Arc`, as `MemoryStore` counts its own (about 480 bytes).
const PER_ENTRY_OVERHEAD: u64 = 480;

/// Ledger keys are SHA-256 digests: their first eight bytes are already a uniform hash.
#[derive(Clone, Copy, Default)]
pub struct DigestHash;

impl BuildHasher for DigestHash {
    type Hasher = DigestHasher;
    fn build_hasher(&self) -> DigestHasher {
        DigestHasher(0)
    }
}

#[derive(Default)]
pub struct DigestHasher(u64);

impl Hasher for DigestHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = (self.0.rotate_left(5) ^ u64::from_le_bytes(word))
                .wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }
}

struct Open {
    fingerprint: Fingerprint,
    frozen: Option<FrozenRequest>,
    token: LeaseToken,
    /// `None` while in doubt.
    lease_until: Option<Instant>,
    resumed: bool,
    retain_until: Instant,
}

struct Done {
    fingerprint: Fingerprint,
    frozen: Option<FrozenRequest>,
    outcome: Outcome,
    retain_until: Instant,
    weight: u32,
}

/// Open operations in a sharded map, completed ones in moka (see the module docs).
pub struct MokaLedger {
    open: Box<[Mutex<HashMap<LedgerKey, Open, DigestHash>>]>,
    done: Cache<LedgerKey, Arc<Done>, DigestHash>,
}

impl std::fmt::Debug for MokaLedger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MokaLedger")
            .field("done", &self.done.entry_count())
            .finish_non_exhaustive()
    }
}

impl MokaLedger {
    pub fn new(max_bytes: u64) -> Self {
        let done = Cache::builder()
            .max_capacity(max_bytes)
            .weigher(|_: &LedgerKey, done: &Arc<Done>| done.weight)
            .eviction_policy(EvictionPolicy::lru())
            .build_with_hasher(DigestHash);
        let open = (0..SHARDS)
            .map(|_| Mutex::new(HashMap::with_hasher(DigestHash)))
            .collect();
        Self { open, done }
    }

    /// Completed entries held (after `run_pending_tasks`).
    pub fn entry_count(&self) -> u64 {
        self.done.entry_count()
    }

    pub fn run_pending_tasks(&self) {
        self.done.run_pending_tasks();
    }

    /// The weight `MemoryStore` would give the same completed record.
    pub fn weight_of(frozen: Option<&FrozenRequest>, outcome: &Outcome) -> u64 {
        PER_ENTRY_OVERHEAD
            + (std::mem::size_of::<LedgerKey>() + std::mem::size_of::<Done>()) as u64
            + frozen.map_or(0, FrozenRequest::weight) as u64
            + outcome.weight() as u64
    }

    fn shard(
        &self,
        key: &LedgerKey,
    ) -> std::sync::MutexGuard<'_, HashMap<LedgerKey, Open, DigestHash>> {
        self.open[usize::from(key.as_bytes()[0]) % SHARDS]
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn begin_now(&self, request: BeginRequest) -> Begin {
        let now = Instant::now();
        let mut open = self.shard(&request.key);
        if let Some(record) = open.get_mut(&request.key) {
            if record.retain_until > now {
                return begin_on_open(record, request, now);
            }
            open.remove(&request.key);
        }
        if self.done.contains_key(&request.key) {
            if let Some(done) = self.done.get(&request.key) {
                if done.retain_until > now {
                    return if done.fingerprint == request.fingerprint {
                        Begin::Replay(done.outcome.clone())
                    } else {
                        Begin::Drift {
                            stored: done.fingerprint,
                            frozen: done.frozen.clone(),
                        }
                    };
                }
                self.done.invalidate(&request.key);
            }
        }
        open.insert(
            request.key,
            Open {
                fingerprint: request.fingerprint,
                frozen: request.frozen,
                token: request.token,
                lease_until: Some(now + request.lease),
                resumed: false,
                retain_until: now + request.retention,
            },
        );
        Begin::Acquired {
            token: request.token,
        }
    }

    fn settle(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        settle: impl FnOnce(&mut HashMap<LedgerKey, Open, DigestHash>, Instant),
    ) -> Result<(), StoreError> {
        let now = Instant::now();
        let mut open = self.shard(&key);
        let owned = open.get(&key).is_some_and(|record| {
            record.retain_until > now && record.lease_until.is_some() && record.token == token
        });
        if !owned {
            return Err(StoreError::fenced());
        }
        settle(&mut open, now);
        Ok(())
    }
}

fn begin_on_open(record: &mut Open, request: BeginRequest, now: Instant) -> Begin {
    if record.fingerprint != request.fingerprint {
        return Begin::Drift {
            stored: record.fingerprint,
            frozen: record.frozen.clone(),
        };
    }
    match record.lease_until {
        Some(_) if record.token == request.token && !record.resumed => Begin::Acquired {
            token: request.token,
        },
        Some(_) if record.token == request.token => Begin::Resume {
            token: request.token,
            frozen: record.frozen.clone(),
        },
        Some(until) if until > now => Begin::Busy {
            retry_after: until - now,
        },
        _ if !request.take_over => Begin::InDoubt,
        _ => {
            record.token = request.token;
            record.lease_until = Some(now + request.lease);
            record.resumed = true;
            Begin::Resume {
                token: request.token,
                frozen: record.frozen.clone(),
            }
        }
    }
}

impl IdempotencyStore for MokaLedger {
    fn begin(&self, request: BeginRequest) -> StoreFuture<'_, Begin> {
        StoreFuture::ready(Ok(self.begin_now(request)))
    }

    fn complete(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        outcome: Outcome,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        let result = self.settle(key, token, |open, now| {
            let record = open.remove(&key).expect("checked under the same lock");
            let weight = Self::weight_of(record.frozen.as_ref(), &outcome);
            let done = Done {
                fingerprint: record.fingerprint,
                frozen: record.frozen,
                outcome,
                retain_until: now + retention,
                weight: u32::try_from(weight).unwrap_or(u32::MAX),
            };
            // Under the shard lock, so no `begin` of this key sees it absent in between.
            self.done.insert(key, Arc::new(done));
        });
        StoreFuture::ready(result)
    }

    fn abandon(&self, key: LedgerKey, token: LeaseToken) -> StoreFuture<'_, ()> {
        let result = self.settle(key, token, |open, _| {
            let record = open.get_mut(&key).expect("checked under the same lock");
            if record.resumed {
                record.lease_until = None;
            } else {
                open.remove(&key);
            }
        });
        StoreFuture::ready(result)
    }

    fn mark_in_doubt(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        let result = self.settle(key, token, |open, now| {
            let record = open.get_mut(&key).expect("checked under the same lock");
            record.lease_until = None;
            record.retain_until = record.retain_until.min(now + retention);
        });
        StoreFuture::ready(result)
    }

    fn renew(&self, key: LedgerKey, token: LeaseToken, lease: Duration) -> StoreFuture<'_, ()> {
        let result = self.settle(key, token, |open, now| {
            let record = open.get_mut(&key).expect("checked under the same lock");
            record.lease_until = Some(now + lease);
        });
        StoreFuture::ready(result)
    }
}
