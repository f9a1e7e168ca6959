//! [`MemoryStore`]: the ledger protocol on the shards, and what the store tells of itself.

use std::time::Duration;

use tokio::time::Instant;

use super::record::{held_length, Stamp, State};
use super::settle::Completer;
use super::shared::{lock, shard_index, Inner, Shard};
use super::sync::{Arc, Mutex, Ordering};
use crate::ledger::{
    Begin, BeginRequest, Expected, Forget, IdempotencyStore, LeaseToken, LedgerKey, ListPage,
    ListQuery, Outcome, RecordView, Resolve, Settled, StoreError, StoreFuture,
};

/// The embedded ledger, in this process.
///
/// Every record — in flight, in doubt or completed — sits in one sharded map and counts
/// against one byte budget, [`max_bytes`](super::MemoryStoreBuilder::max_bytes) (192 MiB by
/// default): its key, its bookkeeping, its frozen request while the operation is open (once
/// it is completed, only a digest of each top-level JSON field of its body, enough to name
/// what a later request changed: [`Begin::DriftFields`]; of a body that is no JSON object,
/// only the fact that there was one) and its recorded response. A regenerated request is
/// judged as on a store that keeps the whole request: the same answer from every store.
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
///   its claim already held, as is one that would take its scope past its
///   [share](super::MemoryStoreBuilder::scope_share) of a store under pressure.
///
/// Every transition of a key runs under its shard's lock, from the first read to the last
/// write, so `begin` is one atomic step: two callers racing on a key never both acquire
/// it. Nothing is awaited under a lock: every operation completes on its first poll.
///
/// A lease is held until its owner lets go of it ([`hold_lease`](IdempotencyStore::hold_lease)):
/// the layers' owners live in this process and say when they leave, so a slow call never
/// needs its lease renewed (no timer, no store call). An owner that goes away settles its
/// record as it goes; one that goes without settling (handed on, or dropped outside any
/// runtime) lets go, and its lease ends a lease later, into doubt. A leaked owner (a future
/// forgotten rather than dropped) holds its operation busy until the record's retention
/// ends: fail closed. Retention bounds a live owner too: past it the record is gone and the
/// key is claimed anew. A store of your own wrapping this one forwards both `hold_lease`
/// and `let_go` to keep the hold (forwarding neither, its owners renew on a timer).
///
/// Leases and retention are checked against [`tokio::time::Instant`] on every access (so
/// they follow a paused test clock). Records past their retention are dropped when next
/// touched, when their room is needed, and by
/// [`run_pending_tasks`](MemoryStore::run_pending_tasks).
///
/// A page of [`list`](IdempotencyStore::list) looks through every record (they are kept by
/// key, not in a list's order), on the calling thread: at a million records a page takes
/// some 35 ms, holding each shard's lock for well under a millisecond at a time, so claims
/// go on meanwhile (`benches/listing.rs`). An operator's look, not one for every request.
///
/// With feature `metrics`, the store reports what it holds as two gauges labelled
/// `store = "memory"`: `idempotency_store_bytes` (the [weighted size](Self::weighted_size))
/// and `idempotency_store_records` (the [records](Self::entry_count)). They move by each
/// change, through handles taken when the store is built, so keeping them costs an atomic
/// add per insert or removal and no lookup: install your recorder **before** building the
/// store. Several stores in one process add up in the same series, and a dropped store
/// takes its share out.
///
/// # Sizing
///
/// Size the budget for your rate of new operations times the protected window times a
/// record's weight: what the default budget sustains is budget ÷ bytes ÷ window. The
/// layers' default windows are the lease + 1 min on the server face (70 s) and the retry
/// window + the lease on the client face (40 s), long enough for a client's 30 s of
/// retries. Typical completed records at the defaults (`BENCHMARKS.md` has the runs):
///
/// | completed record | bytes | window | the default 192 MiB sustains |
/// |---|---|---|---|
/// | server, ~50-byte response | 653 | 70 s | ~4,400 new operations a second (one scope ~3,500: shares start at 80 %) |
/// | client, 1 KiB JSON request, an `OperationId` of 13 bytes | 657 | 40 s | ~7,600 new operations a second |
///
/// Past what it sustains, the store fails closed: a new operation is refused before it
/// starts ([`Error::is_ledger_full`](crate::Error::is_ledger_full), with
/// [`retry_after`](crate::Error::retry_after) saying when room frees up; `503 ledger-full`
/// on the server face), and nothing runs twice. A longer window does not make a resume
/// after a crash possible: the records die with the process. Use `RedisStore` (feature
/// `redis`) or `PostgresStore` (feature `postgres`) when several processes share
/// operations or an orchestrator must resume after a crash.
///
/// The store is its own map rather than a cache such as moka because a cache may evict a
/// record inside its protected window, and an operation forgotten there runs twice.
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
    pub(super) inner: Arc<Inner>,
}

impl MemoryStore {
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
    /// inside their protected window): what a new claim cannot make room from. Completed
    /// records count the bytes they weighed when they completed.
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
        let completed = self.complete_now(key, Completer::Owner(token), outcome, retention);
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
                    State::InFlight { resumed: false, .. } => {
                        self.remove(&mut shard, &key);
                    }
                    // An earlier attempt may have been sent: releasing would let the next
                    // caller send new bytes. Keep it in doubt so the next caller resumes.
                    _ => {
                        record.state = State::InDoubt;
                        record.touched = at;
                    }
                }
                Ok(())
            }
            // Nothing of this token's to release: no record, or another caller's.
            _ => Err(StoreError::fenced()),
        };
        // Whatever it found, the token stays released: a `begin` of it may still be on its
        // way (a retry of one whose answer was lost), and must claim nothing when it comes,
        // even once the record another caller holds now has left.
        shard.released.release(key, token, at);
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
        let settled = self.settle_record(key, token, Instant::now(), |_, record, _, at| {
            record.state = State::InDoubt;
            record.touched = at;
            // A real attempt failed: keep the record at least `retention` from now.
            record.retain_until = record.retain_until.max(at + retention);
        });
        if settled.is_ok() {
            self.announce_settled(&key);
        }
        StoreFuture::ready(settled)
    }

    fn notify_settled(&self, key: LedgerKey) -> Option<Settled> {
        // Subscribing marks the current generation seen: only a later settle wakes it.
        let mut settled = self.inner.settled[shard_index(&key)].subscribe();
        Some(Box::pin(async move {
            // An error means the store is gone: nothing will settle, waking is right.
            let _ = settled.changed().await;
        }))
    }

    fn inspect(&self, key: LedgerKey) -> StoreFuture<'_, Option<RecordView>> {
        let now = self.stamp(Instant::now());
        let shard = lock(self.shard(&key));
        let view = shard
            .records
            .get(&key)
            .filter(|record| record.retain_until > now)
            // The frozen request is kept only while the operation is open (a completed
            // record keeps the digests of its fields): a reference count, not a copy.
            .map(|record| record.view(now).with_request(record.kept.frozen()));
        StoreFuture::ready(Ok(view))
    }

    fn list(&self, query: ListQuery) -> StoreFuture<'_, ListPage> {
        StoreFuture::ready(Ok(self.list_now(&query)))
    }

    fn renew(&self, key: LedgerKey, token: LeaseToken, lease: Duration) -> StoreFuture<'_, ()> {
        let settled = self.settle_record(key, token, Instant::now(), |_, record, _, at| {
            if let State::InFlight {
                lease_until, held, ..
            } = &mut record.state
            {
                // A renewal ends a hold: the owner renews from here on.
                *lease_until = at + lease;
                *held = false;
            }
        });
        StoreFuture::ready(settled)
    }

    // The owner is in this process, to say when it leaves: nothing needs renewing.
    fn hold_lease(&self, key: LedgerKey, token: LeaseToken, lease: Duration) -> bool {
        self.settle_record(
            key,
            token,
            Instant::now(),
            |_, record, _, _| match &mut record.state {
                State::InFlight {
                    lease_until, held, ..
                } => {
                    *lease_until = held_length(lease);
                    *held = true;
                    true
                }
                _ => false,
            },
        )
        .unwrap_or(false)
    }

    fn let_go(&self, key: LedgerKey, token: LeaseToken, lease: Duration) {
        // Fenced when the token no longer holds the record: nothing to let go then.
        let let_go = self.settle_record(key, token, Instant::now(), |_, record, _, at| {
            let State::InFlight {
                lease_until, held, ..
            } = &mut record.state
            else {
                return false;
            };
            let was_held = std::mem::take(held);
            if was_held {
                *lease_until = at + lease;
            }
            was_held
        });
        // Announced like a settle: a held lease shows a whole lease left at every look, so
        // waiters stop waking at its end once they see it kept (see `Ledger::begin`); told
        // it now runs down, they look again and wait for its real end.
        if matches!(let_go, Ok(true)) {
            self.announce_settled(&key);
        }
    }

    fn keeps_request_fields(&self) -> bool {
        true
    }

    // An operator forgetting one record (see `ledger::forget`). The record is judged and
    // removed under its shard's lock, so nothing can move it in between; removal is the
    // same as a retention's end (budget, gauges and eviction order follow), and it wakes
    // waiters like a settle, since the key is free now.
    fn forget(&self, key: LedgerKey, expected: Expected) -> StoreFuture<'_, Forget> {
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
        crate::ledger::report_forget("memory", &key, &expected, &answer);
        StoreFuture::ready(answer)
    }

    // An operator resolving one record as applied (see `ledger::resolve`): completed as its
    // owner would complete it, judged by the look under each lock it writes under, and
    // announced as a completion is (a waiter replays it at once).
    fn resolve(
        &self,
        key: LedgerKey,
        expected: Expected,
        outcome: Outcome,
        retention: Duration,
    ) -> StoreFuture<'_, Resolve> {
        let status = outcome.status();
        let answer = self.resolve_now(key, expected, outcome, retention);
        if matches!(answer, Ok(Resolve::Resolved)) {
            self.announce_settled(&key);
        }
        crate::ledger::report_resolve("memory", &key, &expected, status, &answer);
        StoreFuture::ready(answer)
    }
}

/// Clocks, shards and wake-ups, over the shared state.
impl MemoryStore {
    /// µs from the store's epoch to `at`.
    pub(super) fn micros(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.inner.epoch).as_micros() as u64
    }

    /// `at` as records hold it.
    pub(super) fn stamp(&self, at: Instant) -> Stamp {
        let nanos = at.saturating_duration_since(self.inner.epoch).as_nanos();
        Stamp(u64::try_from(nanos).unwrap_or(u64::MAX))
    }

    /// A record's `stamp` as an instant (for when a refusal says room frees up).
    pub(super) fn instant(&self, stamp: Stamp) -> Instant {
        self.inner.epoch + Duration::from_nanos(stamp.0)
    }

    pub(super) fn seq(&self) -> u64 {
        self.inner.next_seq.fetch_add(1, Ordering::Relaxed)
    }

    pub(super) fn shard(&self, key: &LedgerKey) -> &Mutex<Shard> {
        &self.inner.shards[shard_index(key)]
    }

    /// Wake whoever listens for a settle in `key`'s shard. Called after the shard lock is
    /// released: a listener subscribed before its `begin` took that lock, so the lock orders
    /// its subscription before this check and it is never missed.
    pub(super) fn announce_settled(&self, key: &LedgerKey) {
        let settled = &self.inner.settled[shard_index(key)];
        // Nobody listening (the common case): a single atomic load.
        if settled.receiver_count() > 0 {
            settled.send_modify(|generation| *generation = generation.wrapping_add(1));
        }
    }
}
