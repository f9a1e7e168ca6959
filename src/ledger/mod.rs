//! The ledger: one state machine every store implements.
//!
//! A record per scoped key holds the request's [`Fingerprint`], a state, the client's
//! [`FrozenRequest`], the outcome, and a lease (owner token and expiry).
//!
//! | state | meaning | what [`begin`](IdempotencyStore::begin) answers the next caller |
//! |---|---|---|
//! | absent | never seen, or released after a proven pre-write failure | [`Begin::Acquired`] |
//! | in flight | an owner holds a live lease and may be sending | [`Begin::Busy`] |
//! | in doubt | an attempt failed after its bytes may have left, or the owner's lease expired | [`Begin::Resume`] with the **stored** frozen request |
//! | completed | outcome recorded | [`Begin::Replay`] |
//! | any, fingerprint differs | the caller regenerated the payload | [`Begin::Drift`] ([`Begin::DriftFields`] for a completed one whose store kept only its fields) |
//!
//! A `begin` that is a [probe](BeginRequest::probe) is answered [`Begin::InDoubt`] where a
//! claim would be answered [`Begin::Resume`], and changes nothing.
//!
//! The rules that make it correct, which every implementation must keep (the conformance
//! suite and the reference model in `tower_idempotency::testing`, feature `test-util`,
//! check them):
//!
//! - **`begin` is one atomic step.** Two callers racing on one key never both acquire it.
//! - **`begin` is idempotent for its caller.** The caller brings the token it will own the
//!   operation under ([`BeginRequest::token`]); a `begin` whose reply was lost can be sent
//!   again with the same token and answers the same claim again ([`Begin::Acquired`] or
//!   [`Begin::Resume`]) instead of [`Begin::Busy`], so no claim is left that nobody holds.
//! - **A release outlasts a late claim.** A `begin` whose answer was lost may still be on
//!   its way (queued in the store's connection, held up by a frozen server) when its caller
//!   gives up and releases the claim it may have made. So every [`abandon`], whatever it
//!   finds (its token's claim, no record, or a record another caller holds), leaves the key
//!   *released under that token* for one minute: a `begin` carrying a released token is
//!   refused as [fenced](StoreError::is_fenced) and changes nothing, whatever the key holds,
//!   so the late `begin` cannot make a claim nobody owns (one that would expire into doubt),
//!   nor take over an operation in doubt, not even once the record another caller held at
//!   the release has left (released, forgotten). The marker is no record:
//!   [`inspect`](IdempotencyStore::inspect) shows nothing of it, `forget` leaves it, a
//!   `begin` under any other token finds the key as its record says, and the first new
//!   claim of the key under another token ends the marker. A key released under several
//!   tokens remembers each, until a minute after its last release; `abandon` answers as
//!   before (fenced when it released no claim of its token). A `begin` held up for longer
//!   than that minute is beyond the marker: its claim expires into doubt (never a second
//!   run).
//! - **Fencing.** [`complete`], [`abandon`], [`mark_in_doubt`] and [`renew`] carry the
//!   owner's [`LeaseToken`], and a write whose token is not the record's current one is
//!   refused with a [fenced](StoreError::is_fenced) error, never applied.
//! - **Two TTLs.** The lease (short) bounds how long an owner may hold an operation in
//!   flight without renewing it (or, on a store that holds leases, after it lets go);
//!   retention (long, 24 h by default) bounds how long any
//!   record is kept. An expired lease never means "run it again": it means *in doubt*, and
//!   the next `begin` resumes with the frozen bytes under a new token.
//! - **A live owner keeps its lease.** An owner still working calls [`renew`] (fenced), so a
//!   lease can be short (a dead owner's operation is resumable within seconds) without a
//!   slow live owner ever being overtaken. A store in the owner's own process may instead
//!   [hold the lease](IdempotencyStore::hold_lease) until the owner
//!   [lets go](IdempotencyStore::let_go) of it: the owner is there to say when it leaves,
//!   so nothing needs renewing.
//! - **The frozen request is stored at `begin`**, before any byte is sent, so a caller that
//!   crashes and comes back resends the original bytes.
//! - **"May have been sent" is sticky.** `abandon` releases an operation only if no attempt
//!   of it may have been sent; once one may have (it was resumed or marked in doubt), the
//!   record can only be resumed or completed, never released.
//! - **A probe changes nothing.** A `begin` that will not take an in-doubt operation over
//!   ([`BeginRequest::probe`]) is answered [`Begin::InDoubt`] and leaves the record — its
//!   owner, its attempts and its retention — exactly as it was.
//! - **Bounded, and never silently forgetful.** A store with a memory budget counts every
//!   record against it, open or completed. A record inside its *protected window*
//!   ([`BeginRequest::protected`], measured from its last transition) is never evicted;
//!   when the budget is full of protected records, `begin` refuses new claims with a
//!   [full](StoreError::is_full) error (fail closed) rather than forget one.
//!
//! [`complete`]: IdempotencyStore::complete
//! [`abandon`]: IdempotencyStore::abandon
//! [`mark_in_doubt`]: IdempotencyStore::mark_in_doubt
//! [`renew`]: IdempotencyStore::renew
//!
//! # Forgetting a record on purpose
//!
//! A record that should not be there (a recorded `401` the caller can never get past, an
//! operation in doubt that an operator reconciled by hand) need not wait out its retention:
//! [`IdempotencyStore::forget`] removes it, but only if it is still as an
//! [`inspect`](IdempotencyStore::inspect) showed it ([`Expected`]): the same life of its
//! key (its [`Generation`]), in the same state, and never from under a live owner unless
//! forced. [`Records`], from a built layer's `records()`, finds a record
//! by the keys that layer derives (an [`OperationId`](crate::OperationId), or a request
//! head). See [`Records`].
//!
//! # Resolving an operation in doubt as applied
//!
//! An operation in doubt whose effect an operator has seen happen (the provider's dashboard
//! shows the charge) need not be sent again: [`IdempotencyStore::resolve`] completes its
//! record with the outcome the operator supplies (the provider's receipt), without the
//! owner's token, fenced like a forget by what an `inspect` showed ([`Expected`], judged by
//! [`Expected::judge_resolve`]): the same life, still open (in doubt, or in flight under a
//! lease that ran out, or a live one when forced), never a record completed already. The
//! record keeps its fingerprint and request, so the caller's next run with the same
//! payload replays the receipt ([`Begin::Replay`]) and one with another payload drifts, as
//! from any completed record. [`Records::resolve`] is the operator's way to it, with the
//! layer's retention; the console's *resolve as applied* is the same from a browser.
//!
//! # Bring your own store
//!
//! [`IdempotencyStore`] is object safe: the layers hold stores as
//! `Arc<dyn IdempotencyStore>`, so one ledger serves any number of layers and a custom
//! store (Postgres, DynamoDB…) plugs in without generics leaking into service types. Its
//! methods return a [`StoreFuture`]: either an answer already computed, which costs no
//! allocation, or a boxed future. A store that answers without awaiting anything (as
//! [`MemoryStore`] does) returns `StoreFuture::ready(answer)`; one that awaits (a network
//! round trip) returns `StoreFuture::new(async move { ... })`, one small allocation per
//! ledger call, noise next to the round trip.

mod doubt;
pub(crate) mod error;
mod forget;
mod future;
mod generation;
pub(crate) mod list;
mod memory;
mod origin;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
mod record;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;
mod resolve;

pub use doubt::{DoubtSummary, MOST_COUNTED};
pub use error::StoreError;
pub(crate) use forget::report as report_forget;
pub use forget::{Expected, Forget, RecordKind, Records};
pub use future::StoreFuture;
pub use generation::Generation;
pub use list::{
    CursorError, ListCursor, ListOrder, ListPage, ListQuery, ListedRecord, DEFAULT_PAGE, MAX_PAGE,
};
pub use memory::{MemoryStore, MemoryStoreBuilder};
pub use origin::{Origin, OriginFace};
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use postgres::builder::PostgresStoreBuilder;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use postgres::store::PostgresStore;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use postgres::transaction::PostgresTransaction;
pub(crate) use record::DigestState;
pub(crate) use record::{entries_size, BlockWriter, HeaderBlock, REQUEST_DIGEST_SIZE};
pub use record::{FieldDigests, LeaseToken, LedgerKey, Outcome, StoredResponse};
pub(crate) use record::{GatheredFields, RequestFields};
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use redis::builder::RedisStoreBuilder;
#[cfg(feature = "redis-cluster")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis-cluster")))]
pub use redis::cluster::RedisClusterBuilder;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use redis::store::RedisStore;
pub(crate) use resolve::report as report_resolve;
pub use resolve::Resolve;

use std::fmt;
use std::future::Future;
use std::pin::Pin;

use std::time::Duration;

use crate::fingerprint::Fingerprint;
use crate::FrozenRequest;

/// How long a key stays *released under a token* after an `abandon` (see "A release
/// outlasts a late claim" in the module docs): far longer than a `begin` is ever held up
/// in a live store, short enough that the markers cost nothing lasting.
pub(crate) const RELEASED_TOKEN_TTL: Duration = Duration::from_secs(60);

/// What [`IdempotencyStore::notify_settled`] returns: completes when the record it watches
/// may have left *in flight*.
pub type Settled = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// A ledger implementing the protocol in the [module docs](crate::ledger).
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::ledger::{Begin, BeginRequest, IdempotencyStore, LedgerKey, MemoryStore, Outcome, StoredResponse};
/// use tower_idempotency::fingerprint::Fingerprint;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
/// let store = MemoryStore::new();
/// let key = LedgerKey::from_bytes([7; 32]);
/// let fp = Fingerprint::of(&http::Method::POST, "/charges", b"{}");
/// let request = BeginRequest::new(key, fp, Duration::from_secs(30), Duration::from_secs(3600));
///
/// let Begin::Acquired { token } = store.begin(request.clone()).await? else { unreachable!() };
/// let outcome = Outcome::Response(StoredResponse::new(
///     http::StatusCode::CREATED, http::Version::HTTP_11, http::HeaderMap::new(), "ok".into()));
/// store.complete(key, token, outcome, Duration::from_secs(3600)).await?;
///
/// assert!(matches!(store.begin(request).await?, Begin::Replay(_)));
/// # Ok(())
/// # }
/// ```
pub trait IdempotencyStore: Send + Sync + fmt::Debug + 'static {
    /// Atomically claim, resume, replay or refuse the operation `request.key`.
    fn begin(&self, request: BeginRequest) -> StoreFuture<'_, Begin>;

    /// Record the outcome of an operation held under `token`; kept for `retention`.
    fn complete(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        outcome: Outcome,
        retention: Duration,
    ) -> StoreFuture<'_, ()>;

    /// Release an operation held under `token` after a failure proven to happen before the
    /// request was written. If an earlier attempt may have been sent, the record becomes in
    /// doubt instead of absent. Whatever it finds (even another caller's record, when it is
    /// answered fenced), an `abandon` leaves the key released under `token` for a minute: a
    /// late `begin` under `token` is then refused as fenced instead of claiming the key or
    /// taking it over (see the module docs).
    fn abandon(&self, key: LedgerKey, token: LeaseToken) -> StoreFuture<'_, ()>;

    /// Mark an operation held under `token` in doubt: its bytes may have reached the server.
    /// The next `begin` answers [`Begin::Resume`].
    fn mark_in_doubt(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        retention: Duration,
    ) -> StoreFuture<'_, ()>;

    /// Extend the lease of an operation held under `token` to `lease` from now: its owner is
    /// alive and still working. Fenced like every other write; a lease that ran out but was
    /// not taken over yet may still be renewed by its owner.
    fn renew(&self, key: LedgerKey, token: LeaseToken, lease: Duration) -> StoreFuture<'_, ()>;

    /// Hold the lease of an operation held under `token` until its owner
    /// [lets go](Self::let_go) of it, without renewals: answer `true` if the store does (its
    /// owner then never [renews](Self::renew) it), `false` (the default) if it does not (the
    /// owner renews it every third of a lease as it works).
    ///
    /// For a store in the owner's own process ([`MemoryStore`] holds): the owner is there to
    /// say when it leaves. While held, the operation is in flight with the whole `lease` left
    /// at every look ([`Begin::Busy`] to others, not forgotten unless forced). The owner's
    /// guard ends the hold as it goes: settling the operation (complete, release, in doubt)
    /// replaces it, and a guard that goes without settling (handed on, or unable to) lets go,
    /// so the lease ends a lease later, as if it had been renewed until then. A store that
    /// holds costs a slow call no timer, no store call and no allocation per renewal.
    ///
    /// An owner that never goes (a future leaked rather than dropped) holds its operation
    /// busy until the record's retention ends: fail closed. It answers at once: it is called
    /// from the owner's poll, the moment its work first waits. A `token` that does not hold
    /// the record (it was taken over, or settled) is answered `false`; the owner's renewal
    /// then finds it fenced.
    ///
    /// The record's retention bounds a hold as it bounds everything in the record: once it
    /// ends the record is gone, held or not, and the next caller claims the key anew (a
    /// resumed operation keeps the retention of its first claim). Leases are seconds and
    /// retentions hours at the defaults.
    ///
    /// Implement both this and [`let_go`](Self::let_go), or neither: a store that holds
    /// without letting go would keep every lease an owner left unsettled until its
    /// retention ends. `let_go` may be called while a panic unwinds: it must not panic. A
    /// store of your own that wraps another forwards both to keep the inner store's hold;
    /// one that forwards neither is renewed on a timer, as any store that does not hold.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::ledger::{Begin, BeginRequest, IdempotencyStore, LedgerKey, MemoryStore};
    /// use tower_idempotency::fingerprint::Fingerprint;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
    /// tokio::time::pause();
    /// let store = MemoryStore::new();
    /// let key = LedgerKey::from_bytes([5; 32]);
    /// let fp = Fingerprint::of(&http::Method::POST, "/charges", b"{}");
    /// let lease = Duration::from_secs(10);
    /// // Each caller brings its own token.
    /// let request = || BeginRequest::new(key, fp, lease, Duration::from_secs(3600));
    /// let Begin::Acquired { token } = store.begin(request()).await? else { unreachable!() };
    ///
    /// assert!(store.hold_lease(key, token, lease));
    /// tokio::time::advance(lease * 5).await;
    /// // Five leases later, not one renewal: the owner still holds it.
    /// assert!(matches!(store.begin(request()).await?, Begin::Busy { .. }));
    ///
    /// // The owner goes without settling: a lease later, the next caller resumes it.
    /// store.let_go(key, token, lease);
    /// assert!(matches!(store.begin(request()).await?, Begin::Busy { .. }));
    /// tokio::time::advance(lease).await;
    /// assert!(matches!(store.begin(request()).await?, Begin::Resume { .. }));
    /// # Ok(())
    /// # }
    /// ```
    fn hold_lease(&self, key: LedgerKey, token: LeaseToken, lease: Duration) -> bool {
        let _ = (key, token, lease);
        false
    }

    /// The owner of a lease [held](Self::hold_lease) under `token` goes away without
    /// settling its operation: the lease ends `lease` from now, as if it had been renewed
    /// until now, and the operation then reads as in doubt. Nothing when `token` no longer
    /// holds the record (it was settled, or taken over). The default does nothing: a store
    /// that does not hold leases has nothing to let go.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::ledger::{Begin, BeginRequest, IdempotencyStore, LedgerKey, MemoryStore, Outcome};
    /// use tower_idempotency::fingerprint::Fingerprint;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
    /// let store = MemoryStore::new();
    /// let key = LedgerKey::from_bytes([6; 32]);
    /// let fp = Fingerprint::of(&http::Method::POST, "/charges", b"{}");
    /// let (lease, retention) = (Duration::from_secs(10), Duration::from_secs(3600));
    /// let Begin::Acquired { token } = store.begin(BeginRequest::new(key, fp, lease, retention)).await?
    /// else { unreachable!() };
    /// assert!(store.hold_lease(key, token, lease));
    /// store.complete(key, token, Outcome::Tombstone { status: http::StatusCode::OK }, retention).await?;
    /// // Settled: there is no hold left to let go, and nothing changes.
    /// store.let_go(key, token, lease);
    /// assert!(matches!(store.begin(BeginRequest::new(key, fp, lease, retention)).await?, Begin::Replay(_)));
    /// # Ok(())
    /// # }
    /// ```
    fn let_go(&self, key: LedgerKey, token: LeaseToken, lease: Duration) {
        let _ = (key, token, lease);
    }

    /// Whether this store keeps, of a completed operation, the digests of its request's
    /// top-level JSON fields ([`FieldDigests`]), to name the fields a later request changed
    /// ([`Begin::DriftFields`]). For such a store the client and tool faces gather them
    /// themselves, outside the store, and hand them in with the outcome, in the record's own
    /// buffer:
    /// the store then neither scans the request's body while it holds its lock nor makes an
    /// allocation for them. [`MemoryStore`] answers `true`; the default, `false`, spares
    /// every other store the work.
    ///
    /// A wrapper that forwards its calls to a store answers as the store does.
    ///
    /// ```
    /// use tower_idempotency::ledger::{IdempotencyStore, MemoryStore};
    ///
    /// assert!(MemoryStore::new().keeps_request_fields());
    /// // Shared, as layers share one store, it still does.
    /// assert!(std::sync::Arc::new(MemoryStore::new()).keeps_request_fields());
    /// ```
    fn keeps_request_fields(&self) -> bool {
        false
    }

    /// A read-only look at the record of `key`, for tests and operators: `None` when there is
    /// none (or it is past its retention). Changes nothing, not even an eviction order.
    /// A store of your own answers it with [`RecordView::new`], and shows each life of a key
    /// its own [`Generation`]: [`forget`](Self::forget) is judged by it.
    ///
    /// The default answers an [unavailable](StoreError::is_unavailable) error: a store that
    /// cannot be inspected says so.
    fn inspect(&self, key: LedgerKey) -> StoreFuture<'_, Option<RecordView>> {
        let _ = key;
        // An error, never `Ok(None)`: "no record" is an answer an operator acts on (a key
        // free to use, nothing to forget), and a store that cannot look must not give it.
        StoreFuture::ready(Err(StoreError::unavailable(
            "this store cannot be inspected",
        )))
    }

    /// A page of the records that pass `query`'s filters, in its order, after its cursor:
    /// for operators, to find the operations left in doubt, or stuck in flight, without
    /// knowing their keys. Changes nothing, as [`inspect`](Self::inspect) does not; each
    /// record is shown as `inspect` would show it, with its scope's digest and when it was
    /// last touched where the store keeps them.
    ///
    /// A store bounds the work of one page (no scan of every key for one page): it may
    /// answer fewer records than the query's limit with a cursor to go on from; only a page
    /// without one ends the list. Following the cursors lists each record that stayed put
    /// meanwhile exactly once. [`ListPage::from_candidates`] and [`ListQuery::matches`] do
    /// the ordering and filtering for a store that gathers its candidates itself.
    ///
    /// The default answers an [unavailable](StoreError::is_unavailable) error: a store that
    /// cannot list says so, never "nothing listed".
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::ledger::{Begin, BeginRequest, IdempotencyStore, LedgerKey, ListQuery, MemoryStore, RecordKind};
    /// use tower_idempotency::fingerprint::Fingerprint;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
    /// let store = MemoryStore::new();
    /// let key = LedgerKey::from_bytes([8; 32]);
    /// let fp = Fingerprint::of(&http::Method::POST, "/charges", b"{}");
    /// let request = BeginRequest::new(key, fp, Duration::from_secs(10), Duration::from_secs(3600));
    /// let Begin::Acquired { token } = store.begin(request).await? else { unreachable!() };
    /// store.mark_in_doubt(key, token, Duration::from_secs(3600)).await?;
    ///
    /// let page = store.list(ListQuery::new().kind(RecordKind::InDoubt)).await?;
    /// assert_eq!(page.records.len(), 1);
    /// assert_eq!(page.records[0].key, key);
    /// assert!(page.next.is_none());
    /// # Ok(())
    /// # }
    /// ```
    fn list(&self, query: ListQuery) -> StoreFuture<'_, ListPage> {
        let _ = query;
        StoreFuture::ready(Err(StoreError::unavailable(
            "this store cannot list its records",
        )))
    }

    /// Listen for the next settle of `key`'s record: a future that completes once a
    /// [`complete`](Self::complete), [`abandon`](Self::abandon) or
    /// [`mark_in_doubt`](Self::mark_in_doubt) of it has applied **after this call** (it is
    /// subscribed when returned, not when first polled), so a caller that subscribes and
    /// then finds the operation [busy](Begin::Busy) cannot miss its end. It may also
    /// complete early (another key's settle, a reconnect): waiters ask `begin` again when
    /// woken, so a spurious wake costs one `begin`, never a wrong answer. A lease that runs
    /// out need not be notified, but a [held](Self::hold_lease) lease that its owner
    /// [lets go](Self::let_go) of should be: a waiter that found the owner keeping its lease
    /// look after look waits longer and longer between looks (twice the last nap each
    /// time), so a lease that runs out unannounced is noticed at most about as late as the
    /// time already waited. [`MemoryStore`] announces every way a held lease ends.
    ///
    /// The default answers `None`, "this store cannot notify": waiters then poll `begin`
    /// with a backoff (5 ms doubling to 250 ms). [`MemoryStore`] notifies in-process;
    /// [`RedisStore`](crate::ledger::redis) polls.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::ledger::{Begin, BeginRequest, IdempotencyStore, LedgerKey, MemoryStore, Outcome};
    /// use tower_idempotency::fingerprint::Fingerprint;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
    /// let store = MemoryStore::new();
    /// let key = LedgerKey::from_bytes([9; 32]);
    /// let fp = Fingerprint::of(&http::Method::POST, "/charges", b"{}");
    /// let Begin::Acquired { token } =
    ///     store.begin(BeginRequest::new(key, fp, Duration::from_secs(10), Duration::from_secs(60))).await?
    /// else { unreachable!() };
    ///
    /// let settled = store.notify_settled(key).expect("the memory store notifies");
    /// store.complete(key, token, Outcome::Tombstone { status: http::StatusCode::OK }, Duration::from_secs(60)).await?;
    /// settled.await; // already completed: the settle came after the subscription
    /// # Ok(())
    /// # }
    /// ```
    fn notify_settled(&self, key: LedgerKey) -> Option<Settled> {
        let _ = key;
        None
    }

    /// Remove the record of `key` on an operator's word, **only if it is still as
    /// `expected`** (the generation, state, fingerprint and attempts an
    /// [`inspect`](Self::inspect) showed; see [`Expected`]), in one atomic step: a record
    /// that moved on since, or was created again (another [`Generation`]), is
    /// answered [`Forget::Changed`], an operation in flight under a live lease
    /// [`Forget::Live`] unless [forced](Expected::force), and neither is touched. A
    /// forgotten record is gone at once, whatever its state: the next `begin` of its key is
    /// [`Begin::Acquired`], and its owner's writes (if it had one) are fenced. The built-in
    /// stores log and count each call (see [`Records`], the operator's handle).
    ///
    /// The default answers an [unavailable](StoreError::is_unavailable) error and changes
    /// nothing: a store that cannot forget safely says so.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::ledger::{Begin, BeginRequest, Expected, Forget, IdempotencyStore, LedgerKey, MemoryStore};
    /// use tower_idempotency::fingerprint::Fingerprint;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
    /// let store = MemoryStore::new();
    /// let key = LedgerKey::from_bytes([4; 32]);
    /// let fp = Fingerprint::of(&http::Method::POST, "/charges", b"{}");
    /// let request = BeginRequest::new(key, fp, Duration::from_secs(10), Duration::from_secs(3600));
    /// let Begin::Acquired { token } = store.begin(request.clone()).await? else { unreachable!() };
    /// store.mark_in_doubt(key, token, Duration::from_secs(3600)).await?;
    ///
    /// // In doubt; checked by hand, the effect never happened: forget it.
    /// let view = store.inspect(key).await?.expect("a record");
    /// assert_eq!(store.forget(key, Expected::of(&view)).await?, Forget::Forgotten);
    /// assert!(matches!(store.begin(request).await?, Begin::Acquired { .. }));
    /// // The old look no longer matches the new claim.
    /// assert_eq!(store.forget(key, Expected::of(&view)).await?, Forget::Changed);
    /// # Ok(())
    /// # }
    /// ```
    fn forget(&self, key: LedgerKey, expected: Expected) -> StoreFuture<'_, Forget> {
        let _ = (key, expected);
        // Not `Absent` nor `Changed`: either would tell the operator something about the
        // record this store never looked at.
        StoreFuture::ready(Err(StoreError::unavailable(
            "this store cannot forget records",
        )))
    }

    /// Complete the record of `key` with `outcome` on an operator's word (the provider
    /// shows the effect happened: *resolved as applied*), kept for `retention` from now,
    /// **only if it is still as `expected`** and open, in one atomic step, without the
    /// owner's token.
    ///
    /// Judged as [`Expected::judge_resolve`] says: a record that moved on since the look,
    /// or was created again (another [`Generation`]), is answered [`Resolve::Changed`]; one
    /// completed already [`Resolve::NotInDoubt`] (its own outcome is never replaced); one in
    /// flight under a live lease [`Resolve::Live`] unless [forced](Expected::force) (the
    /// owner's later writes are then fenced, and its own outcome is lost); and none of them
    /// is touched. A resolved record is completed as if its owner had completed it: its
    /// fingerprint and what the store keeps of its request stay, so the next `begin` with
    /// the same payload is [`Begin::Replay`] of `outcome` and one with another payload is a
    /// drift, as for any completed record; it is listed as completed, and waiters are woken
    /// as by a [`complete`](Self::complete). The built-in stores log and count each call
    /// (see [`Records::resolve`]).
    ///
    /// The default answers an [unavailable](StoreError::is_unavailable) error and changes
    /// nothing: a store that cannot resolve safely says so, never "resolved".
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::ledger::{Begin, BeginRequest, Expected, IdempotencyStore, LedgerKey, MemoryStore, Outcome, Resolve, StoredResponse};
    /// use tower_idempotency::fingerprint::Fingerprint;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
    /// let store = MemoryStore::new();
    /// let key = LedgerKey::from_bytes([2; 32]);
    /// let fp = Fingerprint::of(&http::Method::POST, "/charges", b"{}");
    /// let (lease, retention) = (Duration::from_secs(10), Duration::from_secs(3600));
    /// let request = BeginRequest::new(key, fp, lease, retention);
    /// let Begin::Acquired { token } = store.begin(request.clone()).await? else { unreachable!() };
    /// store.mark_in_doubt(key, token, retention).await?;
    ///
    /// // In doubt; the provider's dashboard shows the charge: record its receipt.
    /// let view = store.inspect(key).await?.expect("a record");
    /// let receipt = Outcome::Response(StoredResponse::new(
    ///     http::StatusCode::CREATED, http::Version::HTTP_11, http::HeaderMap::new(),
    ///     r#"{"id":"ch_1"}"#.into()));
    /// assert_eq!(store.resolve(key, Expected::of(&view), receipt, retention).await?, Resolve::Resolved);
    /// let Begin::Replay(Outcome::Response(replayed)) = store.begin(request).await? else { unreachable!() };
    /// assert_eq!(replayed.body(), r#"{"id":"ch_1"}"#);
    /// // The old look no longer matches the completed record.
    /// let again = Outcome::Tombstone { status: http::StatusCode::OK };
    /// assert_eq!(store.resolve(key, Expected::of(&view), again, retention).await?, Resolve::Changed);
    /// # Ok(())
    /// # }
    /// ```
    fn resolve(
        &self,
        key: LedgerKey,
        expected: Expected,
        outcome: Outcome,
        retention: Duration,
    ) -> StoreFuture<'_, Resolve> {
        let _ = (key, expected, outcome, retention);
        // Never `Resolved`, nor a refusal: either would tell the operator something about a
        // record this store never looked at.
        StoreFuture::ready(Err(StoreError::unavailable(
            "this store cannot resolve records",
        )))
    }
}

/// What [`IdempotencyStore::inspect`] shows of a record.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::ledger::{Begin, BeginRequest, IdempotencyStore, LedgerKey, MemoryStore, RecordState};
/// use tower_idempotency::fingerprint::Fingerprint;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
/// let store = MemoryStore::new();
/// let key = LedgerKey::from_bytes([3; 32]);
/// let fp = Fingerprint::of(&http::Method::POST, "/charges", b"{}");
/// store.begin(BeginRequest::new(key, fp, Duration::from_secs(10), Duration::from_secs(3600))).await?;
/// let view = store.inspect(key).await?.expect("a record");
/// assert!(matches!(view.state, RecordState::InFlight { .. }));
/// assert_eq!(view.attempts, 1);
/// assert_eq!(view.fingerprint, fp);
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordView {
    /// Where the operation stands.
    pub state: RecordState,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// How many times ownership was handed out: the first claim and each resume.
    pub attempts: u32,
    /// Which life of its key this record is: unchanged through the record's transitions,
    /// new when the key's record is created again (see [`Generation`]).
    pub generation: Generation,
    /// How long ago the operation was first claimed.
    pub age: Duration,
    /// How long the record is still kept.
    pub retention_left: Duration,
    /// How long ago the record last changed state (claimed, resumed, marked in doubt,
    /// completed): its age, for a store that does not keep it.
    pub touched: Duration,
    /// The digest of the scope (tenant, principal) its key belongs to ([`scope_id`]); `0`
    /// for none, and for a store that does not keep it.
    pub scope: u64,
    /// What the record is of (the step that made it, what it acts on), as its claim said
    /// ([`BeginRequest::with_origin`]); `None` for a record written before origins were
    /// kept, a claim that named none, and a store that does not keep it.
    pub origin: Option<Origin>,
    /// The request as first frozen, while the operation is open: what a resume resends and
    /// what an operator checks with the provider before resolving. Answered by
    /// [`inspect`](IdempotencyStore::inspect) on the built-in stores for a record *in
    /// flight* or *in doubt* made with one (the client and tool faces keep it; the server
    /// face keeps none); `None` for a completed record (nothing will be resent), in
    /// [`list`](IdempotencyStore::list) pages (kept small), and from a store that does not
    /// show it: showing it is optional.
    pub request: Option<FrozenRequest>,
}

impl RecordView {
    /// A view of a record, for a store's [`inspect`](IdempotencyStore::inspect): in
    /// `state`, with the request's `fingerprint`, `attempts` ownerships handed out, of life
    /// `generation`, first claimed `age` ago and kept for `retention_left` more.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::ledger::{Expected, Generation, RecordKind, RecordState, RecordView};
    /// # use tower_idempotency::fingerprint::Fingerprint;
    /// # let fingerprint = Fingerprint::of(&http::Method::POST, "/charges", b"{}");
    ///
    /// let view = RecordView::new(
    ///     RecordState::Completed { status: http::StatusCode::CREATED },
    ///     fingerprint,
    ///     1,
    ///     Generation::from_u64(7),
    ///     Duration::from_secs(3),
    ///     Duration::from_secs(86_397),
    /// );
    /// assert_eq!(Expected::of(&view).generation, Generation::from_u64(7));
    /// assert_eq!(Expected::of(&view).kind, RecordKind::Completed);
    /// ```
    pub fn new(
        state: RecordState,
        fingerprint: Fingerprint,
        attempts: u32,
        generation: Generation,
        age: Duration,
        retention_left: Duration,
    ) -> Self {
        Self {
            state,
            fingerprint,
            attempts,
            generation,
            age,
            retention_left,
            touched: age,
            scope: 0,
            origin: None,
            request: None,
        }
    }

    /// The view, last changed `touched` ago (no longer ago than its age).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::ledger::{Generation, RecordState, RecordView};
    /// # let fingerprint = tower_idempotency::fingerprint::Fingerprint::of(&http::Method::POST, "/charges", b"{}");
    /// let view = RecordView::new(RecordState::InDoubt, fingerprint, 2, Generation::from_u64(1),
    ///     Duration::from_secs(90), Duration::from_secs(3600))
    ///     .with_touched(Duration::from_secs(30));
    /// assert_eq!(view.touched, Duration::from_secs(30));
    /// ```
    pub fn with_touched(mut self, touched: Duration) -> Self {
        self.touched = touched.min(self.age);
        self
    }

    /// The view, of a record in the scope of digest `scope` ([`scope_id`]).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::ledger::{scope_id, Generation, RecordState, RecordView};
    /// # let fingerprint = tower_idempotency::fingerprint::Fingerprint::of(&http::Method::POST, "/charges", b"{}");
    /// let view = RecordView::new(RecordState::InDoubt, fingerprint, 1, Generation::from_u64(1),
    ///     Duration::ZERO, Duration::from_secs(3600))
    ///     .with_scope(scope_id("tenant-a"));
    /// assert_eq!(view.scope, scope_id("tenant-a"));
    /// ```
    pub fn with_scope(mut self, scope: u64) -> Self {
        self.scope = scope;
        self
    }

    /// The view, of a record made by `origin` (`None`: not known).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::ledger::{Generation, Origin, RecordState, RecordView};
    /// # let fingerprint = tower_idempotency::fingerprint::Fingerprint::of(&http::Method::POST, "/charges", b"{}");
    /// let view = RecordView::new(RecordState::InDoubt, fingerprint, 1, Generation::from_u64(1),
    ///     Duration::ZERO, Duration::from_secs(3600))
    ///     .with_origin(Some(Origin::tool("refund")));
    /// assert_eq!(view.origin.unwrap().target(), "refund");
    /// ```
    pub fn with_origin(mut self, origin: Option<Origin>) -> Self {
        self.origin = origin;
        self
    }

    /// The view, showing the record's frozen request (see
    /// [`request`](Self#structfield.request)): `None` leaves it unshown.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::ledger::{Generation, RecordState, RecordView};
    /// use tower_idempotency::FrozenRequest;
    ///
    /// let frozen = FrozenRequest::from_parts(
    ///     http::Method::POST,
    ///     "http://payments.local/charges".parse().unwrap(),
    ///     http::Version::HTTP_11,
    ///     http::HeaderMap::new(),
    ///     bytes::Bytes::from_static(b"{\"amount\":4200}"),
    /// );
    /// let view = RecordView::new(RecordState::InDoubt, frozen.fingerprint(), 1,
    ///     Generation::from_u64(1), Duration::ZERO, Duration::from_secs(3600))
    ///     .with_request(Some(frozen.clone()));
    /// assert_eq!(view.request, Some(frozen));
    /// ```
    pub fn with_request(mut self, request: Option<FrozenRequest>) -> Self {
        self.request = request;
        self
    }
}

/// The state shown by a [`RecordView`].
///
/// ```
/// # use tower_idempotency::ledger::RecordState;
/// let state = RecordState::Completed { status: http::StatusCode::CREATED };
/// assert!(matches!(state, RecordState::Completed { .. }));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum RecordState {
    /// An owner holds the lease, for `lease_left` more (a [held](IdempotencyStore::hold_lease)
    /// lease shows a whole lease at every look: it runs until its owner lets go; zero: it
    /// ran out and the next
    /// `begin` resumes).
    InFlight {
        /// How long the owner's lease still runs (a whole lease while it is held).
        lease_left: Duration,
        /// Whether an earlier attempt may have been sent (the claim came from a resume).
        may_have_been_sent: bool,
    },
    /// An attempt may have been sent; the next `begin` resumes.
    InDoubt,
    /// Done, with this recorded status (a tombstone's too).
    Completed {
        /// The recorded status.
        status: http::StatusCode,
    },
}

/// A shared store is a store: layers built from one `Arc` share one ledger.
impl<T: IdempotencyStore + ?Sized> IdempotencyStore for std::sync::Arc<T> {
    fn begin(&self, request: BeginRequest) -> StoreFuture<'_, Begin> {
        (**self).begin(request)
    }

    fn complete(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        outcome: Outcome,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        (**self).complete(key, token, outcome, retention)
    }

    fn abandon(&self, key: LedgerKey, token: LeaseToken) -> StoreFuture<'_, ()> {
        (**self).abandon(key, token)
    }

    fn mark_in_doubt(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        (**self).mark_in_doubt(key, token, retention)
    }

    fn renew(&self, key: LedgerKey, token: LeaseToken, lease: Duration) -> StoreFuture<'_, ()> {
        (**self).renew(key, token, lease)
    }

    fn hold_lease(&self, key: LedgerKey, token: LeaseToken, lease: Duration) -> bool {
        (**self).hold_lease(key, token, lease)
    }

    fn let_go(&self, key: LedgerKey, token: LeaseToken, lease: Duration) {
        (**self).let_go(key, token, lease)
    }

    fn keeps_request_fields(&self) -> bool {
        (**self).keeps_request_fields()
    }

    fn inspect(&self, key: LedgerKey) -> StoreFuture<'_, Option<RecordView>> {
        (**self).inspect(key)
    }

    fn list(&self, query: ListQuery) -> StoreFuture<'_, ListPage> {
        (**self).list(query)
    }

    fn notify_settled(&self, key: LedgerKey) -> Option<Settled> {
        (**self).notify_settled(key)
    }

    fn forget(&self, key: LedgerKey, expected: Expected) -> StoreFuture<'_, Forget> {
        (**self).forget(key, expected)
    }

    fn resolve(
        &self,
        key: LedgerKey,
        expected: Expected,
        outcome: Outcome,
        retention: Duration,
    ) -> StoreFuture<'_, Resolve> {
        (**self).resolve(key, expected, outcome, retention)
    }
}

/// What [`IdempotencyStore::begin`] is asked.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::ledger::{BeginRequest, LedgerKey};
/// use tower_idempotency::fingerprint::Fingerprint;
///
/// let fp = Fingerprint::of(&http::Method::POST, "/charges", b"{}");
/// let request = BeginRequest::new(LedgerKey::from_bytes([1; 32]), fp, Duration::from_secs(10), Duration::from_secs(3600))
///     .with_protected_window(Duration::from_secs(120));
/// // A retried `begin` (its reply was lost) sends the same token, and recognises its claim.
/// let retried = request.clone();
/// assert_eq!(retried.token, request.token);
/// ```
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct BeginRequest {
    /// The scoped ledger key.
    pub key: LedgerKey,
    /// The request's fingerprint; a stored record with another one answers [`Begin::Drift`].
    pub fingerprint: Fingerprint,
    /// The frozen request to keep with a new claim (client side); `None` on the server.
    pub frozen: Option<FrozenRequest>,
    /// The token the caller will own the operation under if `begin` hands it out. Sending
    /// the same request again (same token) after a lost reply answers the same claim.
    pub token: LeaseToken,
    /// How long the new owner may hold the operation in flight before renewing.
    pub lease: Duration,
    /// How long to keep the record.
    pub retention: Duration,
    /// How long after its last transition the record must never be evicted, whatever the
    /// memory pressure (at least the callers' retry window plus the lease). Clamped to the
    /// retention.
    pub protected: Duration,
    /// `false` for a probe: an in-doubt operation is answered [`Begin::InDoubt`] and left
    /// untouched, instead of being handed to this caller with [`Begin::Resume`].
    pub take_over: bool,
    /// A short id of the scope (tenant, principal) the key belongs to, `0` for none (see
    /// [`BeginRequest::with_scope`]): a store with a memory budget keeps one scope from
    /// taking every other scope's room.
    pub scope: u64,
    /// What the operation is of (see [`BeginRequest::with_origin`]): kept by the claim that
    /// creates the record, for operators; `None` for none of its own (a store keeps
    /// [`named_origin`](Self::named_origin), which then reads it from the frozen request).
    pub origin: Option<Origin>,
}

impl BeginRequest {
    /// A request under a fresh token, without a frozen request (see
    /// [`BeginRequest::with_frozen`]), protected for its whole retention.
    #[inline]
    pub fn new(
        key: LedgerKey,
        fingerprint: Fingerprint,
        lease: Duration,
        retention: Duration,
    ) -> Self {
        Self {
            key,
            fingerprint,
            frozen: None,
            // Made here, once, and carried by every clone: a `begin` sent again after a lost
            // reply is a clone, so it brings this token and the store recognises its claim.
            token: LeaseToken::generate(),
            lease,
            retention,
            // The safe default: nothing may be evicted that the caller did not say it may.
            protected: retention,
            take_over: true,
            scope: 0,
            origin: None,
        }
    }

    /// Keep `frozen` with the record, so a resumed operation resends these bytes.
    #[inline]
    pub fn with_frozen(mut self, frozen: FrozenRequest) -> Self {
        self.frozen = Some(frozen);
        self
    }

    /// Own the operation under `token` (e.g. one kept across a crash).
    #[inline]
    pub fn with_token(mut self, token: LeaseToken) -> Self {
        self.token = token;
        self
    }

    /// The record's protected window (default: its whole retention).
    #[inline]
    pub fn with_protected_window(mut self, protected: Duration) -> Self {
        self.protected = protected.min(self.retention);
        self
    }

    /// The key belongs to `scope` (a tenant or principal; `""`: every caller's): a store
    /// with a memory budget gives each scope a fair share of it (see
    /// [`MemoryStoreBuilder::scope_share`]). The server face sets its scope on every
    /// request.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::ledger::{BeginRequest, LedgerKey};
    /// # let fp = tower_idempotency::fingerprint::Fingerprint::of(&http::Method::POST, "/", b"");
    /// let key = LedgerKey::server("tenant-a", "k1");
    /// let request = BeginRequest::new(key, fp, Duration::from_secs(10), Duration::from_secs(60))
    ///     .with_scope("tenant-a");
    /// assert_ne!(request.scope, 0);
    /// assert_eq!(request.with_scope("").scope, 0);
    /// ```
    pub fn with_scope(self, scope: &str) -> Self {
        self.with_scope_id(scope_id(scope))
    }

    /// [`with_scope`](Self::with_scope) by the scope's id ([`scope_id`]).
    pub(crate) fn with_scope_id(mut self, scope: u64) -> Self {
        self.scope = scope;
        self
    }

    /// The operation is of `origin` (the step that made it, what it acts on): the record a
    /// claim creates keeps it, for an operator to tell records apart
    /// ([`RecordView::origin`], [`ListQuery::target`]); a resume or a replay leaves the
    /// record's own. The server and tool faces name theirs; the client face's is its frozen
    /// request's (see [`named_origin`](Self::named_origin)).
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::ledger::{BeginRequest, LedgerKey, Origin};
    /// # let fp = tower_idempotency::fingerprint::Fingerprint::of(&http::Method::POST, "/", b"");
    /// use tower_idempotency::OperationId;
    ///
    /// let op = OperationId::new("task-42", "step-3");
    /// let request = BeginRequest::new(LedgerKey::from_bytes([1; 32]), fp, Duration::from_secs(10), Duration::from_secs(60))
    ///     .with_origin(Origin::tool("refund").with_operation(&op));
    /// assert_eq!(request.origin.unwrap().task_id(), Some("task-42"));
    /// ```
    #[inline]
    pub fn with_origin(mut self, origin: Origin) -> Self {
        self.origin = Some(origin);
        self
    }

    /// What the record a claim creates is of, as a store keeps it: the
    /// [origin](Self::with_origin) the claim names, or else its [frozen
    /// request](Self::with_frozen)'s (`METHOD scheme://host/path`, and the
    /// [`OperationId`](crate::OperationId) its key was derived from, if it was); `None` for
    /// neither. Read by the claim that creates a record, which is when a store keeps it: the
    /// client face names no origin of its own, so that a claim answered from a record never
    /// builds one.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::ledger::{BeginRequest, LedgerKey, Origin, OriginFace};
    /// # use tower_idempotency::FrozenRequest;
    /// let frozen = FrozenRequest::from_parts(
    ///     http::Method::POST,
    ///     "https://payments.example/v1/charges?x=1".parse().unwrap(),
    ///     http::Version::HTTP_11,
    ///     http::HeaderMap::new(),
    ///     bytes::Bytes::from_static(b"{}"),
    /// );
    /// let claim = BeginRequest::new(LedgerKey::from_bytes([1; 32]), frozen.fingerprint(),
    ///     Duration::from_secs(10), Duration::from_secs(60))
    ///     .with_frozen(frozen);
    /// let origin = claim.named_origin().unwrap();
    /// assert_eq!(origin.face(), OriginFace::Client);
    /// assert_eq!(origin.target(), "POST https://payments.example/v1/charges");
    ///
    /// let claim = claim.with_origin(Origin::tool("refund"));
    /// assert_eq!(claim.named_origin().unwrap().target(), "refund");
    /// ```
    pub fn named_origin(&self) -> Option<Origin> {
        match (&self.origin, &self.frozen) {
            (Some(origin), _) => Some(origin.clone()),
            (None, Some(frozen)) => Some(Origin::of_frozen(frozen)),
            (None, None) => None,
        }
    }

    /// Make this `begin` a probe: it never takes an in-doubt operation over.
    #[inline]
    pub fn probe(mut self) -> Self {
        self.take_over = false;
        self
    }

    /// The protected window, never longer than the retention.
    pub fn protected_window(&self) -> Duration {
        self.protected.min(self.retention)
    }
}

/// The digest of a scope, as [`BeginRequest::scope`] carries it and [`RecordView::scope`]
/// shows it: `0` for `""`, else a 64-bit FNV-1a hash of its bytes that is never `0`.
///
/// Stable across releases, processes and machines: a store that keeps it (to list one
/// scope's records, see [`ListQuery::scope`]) finds it again after a restart. Two scopes may
/// share a digest (and then a share of a store's room, and a list): it sizes shares and
/// narrows lists, it never tells records apart (the [`LedgerKey`] does).
///
/// ```
/// use tower_idempotency::ledger::scope_id;
///
/// assert_eq!(scope_id(""), 0);
/// assert_ne!(scope_id("tenant-a"), scope_id("tenant-b"));
/// assert_eq!(scope_id("tenant-a"), 0xc2ef_8128_e3eb_9efb);
/// ```
pub fn scope_id(scope: &str) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    if scope.is_empty() {
        return 0;
    }
    let hash = scope.bytes().fold(OFFSET, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(PRIME)
    });
    // The low bit set keeps a named scope off `0`, which means "no scope".
    hash | 1
}

/// The answer of [`IdempotencyStore::begin`].
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Begin {
    /// The caller now owns the operation; send the request.
    Acquired {
        /// The owner's fencing token.
        token: LeaseToken,
    },
    /// Another owner holds a live lease.
    Busy {
        /// How long that lease still runs (a whole lease while it is
        /// [held](IdempotencyStore::hold_lease): the owner may finish any moment).
        retry_after: Duration,
    },
    /// A previous attempt may have been sent (it failed after writing, or its owner's lease
    /// expired). The caller now owns the operation and must resend the **stored** request.
    Resume {
        /// The new owner's fencing token.
        token: LeaseToken,
        /// The request as first frozen (`None` when the record was made without one).
        frozen: Option<FrozenRequest>,
    },
    /// The operation completed; here is its outcome.
    Replay(Outcome),
    /// The operation is in doubt (an attempt may have been sent, or its owner's lease ran
    /// out) and this `begin` was a [probe](BeginRequest::probe): nothing was changed.
    InDoubt,
    /// The record holds a different fingerprint: the payload changed under the same key.
    Drift {
        /// The fingerprint on record.
        stored: Fingerprint,
        /// The request as first frozen, when stored (used to name changed fields and to
        /// resend the original bytes under the `ResendFrozen` drift policy).
        frozen: Option<FrozenRequest>,
    },
    /// The record holds a different fingerprint, and of the request first sent only the
    /// digests of its top-level JSON fields: a completed operation, in a store that keeps no
    /// more of a request nobody will resend ([`MemoryStore`]). Answered as
    /// [`Drift`](Self::Drift) with the first request is; the fields name what changed (none,
    /// when the first body was no JSON object: [`FieldDigests::changed_fields`] is `None`).
    DriftFields {
        /// The fingerprint on record.
        stored: Fingerprint,
        /// The top-level fields of the request first sent.
        fields: FieldDigests,
    },
}

#[cfg(test)]
mod tests;
