//! The ledger engine both faces of the layer share: claiming, waiting, and settling a lease.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::ledger::{
    Begin, BeginRequest, IdempotencyStore, LeaseToken, LedgerKey, Outcome, StoreError,
};

/// The default lease: how long one owner may hold an operation in flight.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(60);
/// The default retention of ledger records.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

/// The first pause between two `begin`s while waiting for a busy operation; it doubles up to
/// [`MAX_BUSY_POLL`]. Stores are not asked to notify waiters, so any store works.
const FIRST_BUSY_POLL: Duration = Duration::from_millis(5);
const MAX_BUSY_POLL: Duration = Duration::from_millis(250);

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

/// The store and the two TTLs, shared by every request of a layer.
#[derive(Clone)]
pub(crate) struct Ledger {
    pub(crate) store: Arc<dyn IdempotencyStore>,
    pub(crate) lease: Duration,
    pub(crate) retention: Duration,
}

impl fmt::Debug for Ledger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ledger")
            .field("store", &self.store)
            .field("lease", &self.lease)
            .field("retention", &self.retention)
            .finish()
    }
}

impl Ledger {
    pub(crate) fn request(&self, key: LedgerKey, fingerprint: crate::Fingerprint) -> BeginRequest {
        BeginRequest::new(key, fingerprint, self.lease, self.retention)
    }

    /// `begin`, waiting per `busy` while another owner holds the operation.
    pub(crate) async fn begin(
        &self,
        request: BeginRequest,
        busy: BusyPolicy,
    ) -> Result<Begin, StoreError> {
        let give_up_at = match busy {
            BusyPolicy::Wait(limit) => Instant::now() + limit,
            BusyPolicy::Fail => Instant::now(),
        };
        let mut pause = FIRST_BUSY_POLL;
        loop {
            let answer = self.store.begin(request.clone()).await?;
            let Begin::Busy { retry_after } = answer else {
                return Ok(answer);
            };
            let now = Instant::now();
            if now >= give_up_at {
                return Ok(answer);
            }
            // Never sleep past the owner's lease (it turns in doubt then) or our own limit.
            let nap = pause
                .min(retry_after.max(Duration::from_millis(1)))
                .min(give_up_at - now);
            tokio::time::sleep(nap).await;
            pause = (pause * 2).min(MAX_BUSY_POLL);
        }
    }

    /// Hold the lease of `key` under `token`; settle it with the guard's methods.
    pub(crate) fn hold(&self, key: LedgerKey, token: LeaseToken, on_drop: OnDrop) -> LeaseGuard {
        LeaseGuard {
            ledger: self.clone(),
            key,
            token,
            on_drop,
            settled: false,
        }
    }
}

/// What a [`LeaseGuard`] does when it is dropped unsettled: the request future was dropped
/// (the caller went away) or a panic unwound through it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OnDrop {
    /// The request may have been sent: the record goes in doubt at once, rather than
    /// waiting out the lease.
    MarkInDoubt,
    /// The work is known not to have taken effect: release the key.
    #[allow(dead_code)] // the server face releases keys of handlers that never started
    Abandon,
}

/// An owned lease. Settle it with exactly one of `complete`, `abandon`, `mark_in_doubt`;
/// dropped unsettled, it settles itself per its [`OnDrop`] in a background task, so a
/// cancelled or panicking request never leaves its key in flight until the lease runs out.
pub(crate) struct LeaseGuard {
    ledger: Ledger,
    key: LedgerKey,
    token: LeaseToken,
    on_drop: OnDrop,
    settled: bool,
}

impl LeaseGuard {
    pub(crate) async fn complete(mut self, outcome: Outcome) -> Result<(), StoreError> {
        self.settled = true;
        let ledger = &self.ledger;
        ledger
            .store
            .complete(self.key, self.token, outcome, ledger.retention)
            .await
    }

    pub(crate) async fn abandon(mut self) -> Result<(), StoreError> {
        self.settled = true;
        self.ledger.store.abandon(self.key, self.token).await
    }

    pub(crate) async fn mark_in_doubt(mut self) -> Result<(), StoreError> {
        self.settled = true;
        let ledger = &self.ledger;
        ledger
            .store
            .mark_in_doubt(self.key, self.token, ledger.retention)
            .await
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        // Without a runtime (a runtime shutting down), the lease expiring is the fallback:
        // the record then reads as in doubt all the same.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (store, key, token, retention) = (
            self.ledger.store.clone(),
            self.key,
            self.token,
            self.ledger.retention,
        );
        let on_drop = self.on_drop;
        runtime.spawn(async move {
            let settled = match on_drop {
                OnDrop::MarkInDoubt => store.mark_in_doubt(key, token, retention).await,
                OnDrop::Abandon => store.abandon(key, token).await,
            };
            if let Err(err) = settled {
                tracing::warn!(%err, ?on_drop, "could not settle an abandoned lease; it will expire");
            }
        });
    }
}
