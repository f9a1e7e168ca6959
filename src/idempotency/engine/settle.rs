//! Settling a lease: completing, abandoning or marking it in doubt, retried while the
//! store's answer is lost and the lease still holds.

use std::future::Future;
use std::pin::Pin;

use tokio::time::Instant;

use crate::ledger::{LeaseToken, LedgerKey, Outcome, StoreError};

use super::observe::{observe, start};
use super::{is_ambiguous, LeaseGuard, Ledger, FIRST_STORE_RETRY};

impl Ledger {
    /// One store call for `settle`, observed.
    pub(super) async fn settle_once(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        settle: &Settle,
    ) -> Result<(), StoreError> {
        let started = start();
        let result = match settle {
            Settle::Complete(outcome) => {
                self.store
                    .complete(key, token, outcome.clone(), self.retention)
                    .await
            }
            Settle::Abandon => self.store.abandon(key, token).await,
            Settle::MarkInDoubt => self.store.mark_in_doubt(key, token, self.retention).await,
        };
        observe(settle.call(), started, &result);
        result
    }

    /// Apply `settle` under `token`, asking again while the store's answer is lost or the
    /// store is away, until `deadline` (the last try is made at the deadline, not a pause
    /// before it). A `fenced` answer after a lost one most likely means the lost one applied
    /// (the record left our hands through our own write).
    ///
    /// The pause between tries doubles up to a tenth of the lease: an owner whose handler
    /// finished records its outcome as soon as the store is back, while its lease still
    /// holds, instead of sleeping past the lease's end and letting the key read as in doubt.
    ///
    /// `lost`: the lost answer of a first try already made (in place).
    pub(super) async fn apply(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        settle: &Settle,
        deadline: Instant,
        lost: Option<StoreError>,
    ) -> Result<(), StoreError> {
        let mut pause = FIRST_STORE_RETRY;
        let max_pause = self.max_retry_pause();
        let mut lost_one = false;
        // The lost answer stands for the first try's.
        let mut lost = lost.map(Err);
        loop {
            let result = match lost.take() {
                Some(lost) => lost,
                None => self.settle_once(key, token, settle).await,
            };
            let now = Instant::now();
            match result {
                Ok(()) => return Ok(()),
                // Fenced means the record no longer holds our token. After one of our own
                // calls was lost, the likeliest writer is that call: it applied and moved
                // the record on. Reporting a failure here would make the caller treat a
                // recorded outcome as unrecorded.
                Err(err) if err.is_fenced() && lost_one => {
                    tracing::debug!(
                        ?settle,
                        "fenced after a lost answer: the earlier call applied"
                    );
                    return Ok(());
                }
                Err(err) if is_ambiguous(&err) && now < deadline => {
                    lost_one = true;
                    tracing::debug!(%err, ?settle, "settling failed; trying again");
                    tokio::time::sleep(pause.min(deadline - now)).await;
                    pause = (pause * 2).min(max_pause);
                }
                Err(err) => return Err(err),
            }
        }
    }
}

/// How a lease is settled.
#[derive(Clone, Debug)]
pub(super) enum Settle {
    Complete(Outcome),
    Abandon,
    MarkInDoubt,
}

impl Settle {
    /// The store call, as metrics name it.
    fn call(&self) -> &'static str {
        match self {
            Self::Complete(_) => "complete",
            Self::Abandon => "abandon",
            Self::MarkInDoubt => "mark_in_doubt",
        }
    }
}

/// A lease being settled by the engine's waiting and retrying path ([`LeaseGuard::complete`],
/// [`abandon`](LeaseGuard::abandon), [`mark_in_doubt`](LeaseGuard::mark_in_doubt)).
pub(crate) type Settling = Pin<Box<dyn Future<Output = Result<(), StoreError>> + Send>>;

/// What [`LeaseGuard::complete_in_place`] did.
pub(crate) enum InPlace {
    /// The store answered at once: the lease is settled, with this result.
    Done(Result<(), StoreError>),
    /// Still to do, by the waiting and retrying path.
    Later(Unsettled),
}

/// A completion [`LeaseGuard::complete_in_place`] could not make: the store awaits, or its
/// answer was lost.
pub(crate) struct Unsettled {
    pub(super) lease: LeaseGuard,
    pub(super) outcome: Outcome,
    /// The in-place call's answer, when it was lost.
    pub(super) lost: Option<StoreError>,
}

impl Unsettled {
    /// Record the outcome as [`LeaseGuard::complete`] does, knowing what the in-place call
    /// left.
    pub(crate) async fn complete(self) -> Result<(), StoreError> {
        let Self {
            lease,
            outcome,
            lost,
        } = self;
        lease.settle_after(Settle::Complete(outcome), lost).await
    }
}
