//! The ledger engine both faces of the layer share: claiming, waiting, holding and settling
//! a lease.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use crate::ledger::{BeginRequest, IdempotencyStore, LedgerKey, StoreError};

/// The default lease: how long an owner may hold an operation in flight without renewing
/// it. Live owners keep it (a store in their process holds it until they let go; others
/// are renewed every third of the lease), so the lease only bounds how long a **dead**
/// owner's operation stays busy before the next caller may resume it.
pub(crate) const DEFAULT_LEASE: Duration = Duration::from_secs(10);
/// The default retention of ledger records.
pub(crate) const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

/// The longest lease, retention, protected window or busy wait the layers work with: about
/// 139 years (2^42 ms). A longer setting ("keep forever": `Duration::MAX`) saturates to it
/// rather than being refused. It is far beyond any real use, yet every clock can add it to
/// the present (`Instant + Duration::MAX` panics, on every request) and every store can
/// hold it: Redis `PX` and PostgreSQL intervals are clamped to the same bound.
pub(crate) const LONGEST: Duration = Duration::from_millis(1 << 42);

/// The first pause between two `begin`s while waiting for a busy operation on a store that
/// cannot notify ([`IdempotencyStore::notify_settled`] answers `None`); it doubles up to
/// [`MAX_BUSY_POLL`]. A store that notifies wakes its waiters when the owner settles.
const FIRST_BUSY_POLL: Duration = Duration::from_millis(5);
const MAX_BUSY_POLL: Duration = Duration::from_millis(250);

/// How often a store call whose answer was lost (a timeout, a dropped connection) is asked
/// again, and the first pause between two tries (doubling, capped at [`MAX_STORE_RETRY`]).
const BEGIN_TRIES: u32 = 3;
const FIRST_STORE_RETRY: Duration = Duration::from_millis(25);
const MAX_STORE_RETRY: Duration = Duration::from_secs(1);
/// Settles and renewals are retried at least this many times per lease once their pause
/// stops doubling: a store that comes back before the lease ends is then written to within
/// a tenth of a lease, while the lease still holds, rather than up to a whole
/// [`MAX_STORE_RETRY`] later, when a short lease may have run out into doubt.
const RETRIES_PER_LEASE: u32 = 10;
/// How long a claim nobody will use (its `begin` reply was lost) is retried in the background
/// before it is left to read as in doubt.
const RELEASE_PATIENCE: Duration = Duration::from_secs(10 * 60);
/// At most this many such releases run at once per layer: during a long ledger outage every
/// refused request would otherwise leave a task behind. Past it, the claim (if it exists)
/// reads as in doubt once its lease runs out, which is never a second run.
const MAX_PENDING_RELEASES: usize = 256;

/// What to do when another caller holds the operation in flight.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::BusyPolicy;
///
/// let patient = BusyPolicy::Wait(Duration::from_secs(30));
/// # let _ = (patient, BusyPolicy::Fail);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BusyPolicy {
    /// Wait up to this long for the owner to finish, then replay its outcome (or resume, if
    /// it failed); still busy after that, fail with a busy error.
    Wait(Duration),
    /// Fail at once with a busy error carrying the owner's remaining lease.
    Fail,
}

/// The store and its timings, shared by every request of a layer: a handle, so that each
/// lease guard holds one pointer (one reference count) rather than a copy of the settings.
#[derive(Clone)]
pub(crate) struct Ledger(Arc<LedgerState>);

/// What a [`Ledger`] handle points to.
pub(crate) struct LedgerState {
    pub(crate) store: Arc<dyn IdempotencyStore>,
    pub(crate) lease: Duration,
    pub(crate) retention: Duration,
    /// How long after its last transition a record must never be evicted.
    pub(crate) protected: Duration,
    /// What the layer's requests learn of the store as they go.
    shared: Shared,
    /// How many requests may wait for busy operations at once, if bounded.
    pub(crate) waiters: Option<WaiterLimit>,
    /// The store keeps a completed request's field digests, which a face recording an
    /// outcome then gathers for it ([`request_for_fields`](Self::request_for_fields)).
    keeps_request_fields: bool,
}

impl std::ops::Deref for Ledger {
    type Target = LedgerState;

    fn deref(&self) -> &LedgerState {
        &self.0
    }
}

/// What every request of a layer shares about its store.
#[derive(Debug, Default)]
struct Shared {
    /// Background releases of unused claims under way (see [`MAX_PENDING_RELEASES`]).
    pending_releases: std::sync::atomic::AtomicUsize,
    /// Set once the store answered with a future to await: its calls then go straight to
    /// the waiting and retrying path, rather than each making a future that is dropped
    /// unpolled (see [`Ledger::begin_in_place`]).
    awaits: std::sync::atomic::AtomicBool,
}

impl fmt::Debug for Ledger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ledger")
            .field("store", &self.store)
            .field("lease", &self.lease)
            .field("retention", &self.retention)
            .field("protected", &self.protected)
            .finish()
    }
}

/// A store error after which the store may or may not have applied the call.
fn is_ambiguous(err: &StoreError) -> bool {
    err.is_timeout() || err.is_unavailable()
}

impl LedgerState {
    /// `request`, when a face recording its outcome is to gather its field digests for the
    /// record: the store keeps them
    /// ([`IdempotencyStore::keeps_request_fields`](crate::ledger::IdempotencyStore::keeps_request_fields)).
    pub(crate) fn request_for_fields<'a>(
        &self,
        request: &'a crate::FrozenRequest,
    ) -> Option<&'a crate::FrozenRequest> {
        self.keeps_request_fields.then_some(request)
    }
}

impl Ledger {
    pub(crate) fn new(
        store: Arc<dyn IdempotencyStore>,
        lease: Duration,
        retention: Duration,
        protected: Duration,
    ) -> Self {
        Self::with_waiters(store, lease, retention, protected, None)
    }

    /// [`new`](Self::new), with at most `max` requests waiting for busy operations at once.
    pub(crate) fn with_max_waiters(
        store: Arc<dyn IdempotencyStore>,
        lease: Duration,
        retention: Duration,
        protected: Duration,
        max: usize,
    ) -> Self {
        Self::with_waiters(
            store,
            lease,
            retention,
            protected,
            Some(WaiterLimit::new(max)),
        )
    }

    fn with_waiters(
        store: Arc<dyn IdempotencyStore>,
        lease: Duration,
        retention: Duration,
        protected: Duration,
        waiters: Option<WaiterLimit>,
    ) -> Self {
        // Saturated here, where every duration a store or a clock is handed comes from, so
        // that no setting a builder accepted can overflow an `Instant` or a store's TTL.
        let (lease, retention) = (lease.min(LONGEST), retention.min(LONGEST));
        Self(Arc::new(LedgerState {
            keeps_request_fields: store.keeps_request_fields(),
            store,
            lease,
            retention,
            protected: protected.min(retention),
            shared: Shared::default(),
            waiters,
        }))
    }

    /// The longest pause between two tries of a settle or a renewal: a tenth of the lease,
    /// within [`FIRST_STORE_RETRY`] and [`MAX_STORE_RETRY`].
    fn max_retry_pause(&self) -> Duration {
        (self.lease / RETRIES_PER_LEASE).clamp(FIRST_STORE_RETRY, MAX_STORE_RETRY)
    }

    #[inline]
    pub(crate) fn request(
        &self,
        key: LedgerKey,
        fingerprint: crate::fingerprint::Fingerprint,
    ) -> BeginRequest {
        BeginRequest::new(key, fingerprint, self.lease, self.retention)
            .with_protected_window(self.protected)
    }
}

mod begin;
mod lease;
mod observe;
mod renewal;
mod settle;
mod waiters;

pub(crate) use lease::LeaseGuard;
pub(crate) use renewal::Renewal;
pub(crate) use settle::{InPlace, Settling};
pub(crate) use waiters::WaiterLimit;
