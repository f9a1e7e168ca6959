//! The lease guard: an owned lease, settled exactly once, or settled on drop.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::task::Context;

use tokio::time::Instant;

use crate::ledger::{LeaseToken, LedgerKey, Outcome, StoreError};

use super::observe::{observe, start};
use super::settle::{InPlace, Settle, Settling, Unsettled};
use super::{is_ambiguous, Ledger};

/// An owned lease. Settle it with exactly one of `complete`, `abandon`, `mark_in_doubt`.
///
/// A settle is finished even if its caller is dropped halfway through the store call: the
/// guard keeps what it was asked to do and completes it in a background task. Dropped
/// before any settle (the caller went away, or a panic unwound through it), it marks the
/// operation in doubt the same way once anything may have been sent (the request may be on
/// the wire, or the handler may have done part of its work), and releases it when nothing
/// was (a guard from [`Ledger::hold_unsent`] not yet [sending](LeaseGuard::sending)). So a cancelled or panicking request never leaves its key in
/// flight until the lease runs out.
pub(crate) struct LeaseGuard {
    pub(super) ledger: Ledger,
    pub(super) key: LedgerKey,
    pub(super) token: LeaseToken,
    /// The settle under way, if any: what a drop must finish.
    pub(super) pending: Option<Settle>,
    pub(super) done: bool,
    /// Whether anything may have been sent under the lease: what a drop without a settle
    /// under way does (leave the operation in doubt, or release it).
    pub(super) sent: bool,
    /// Whether the store [holds the lease](crate::ledger::IdempotencyStore::hold_lease)
    /// for this guard, which must then [let go](crate::ledger::IdempotencyStore::let_go) of
    /// it if it goes without settling. (Atomic: renewals read the guard by reference.)
    pub(super) held: AtomicBool,
}

impl LeaseGuard {
    /// Record `outcome`, retrying a lost write inside the lease.
    pub(crate) fn complete(self, outcome: Outcome) -> Settling {
        self.settle(Settle::Complete(outcome))
    }

    /// [`complete`](Self::complete) in place, when the store answers at once and its answer
    /// was not lost; else what is left to do, by the waiting and retrying path.
    pub(crate) fn complete_in_place(mut self, outcome: Outcome) -> InPlace {
        let unsettled = |lease, outcome, lost| Unsettled {
            lease,
            outcome,
            lost,
        };
        if !self.ledger.may_answer_in_place() {
            return InPlace::Later(unsettled(self, outcome, None));
        }
        let started = start();
        let call = (self.ledger.store).complete(
            self.key,
            self.token,
            outcome.clone(),
            self.ledger.retention,
        );
        let Some(result) = self.ledger.take_in_place(call) else {
            return InPlace::Later(unsettled(self, outcome, None));
        };
        observe("complete", started, &result);
        match result {
            Err(err) if is_ambiguous(&err) => InPlace::Later(unsettled(self, outcome, Some(err))),
            result => {
                self.done = true;
                self.settled(&result);
                InPlace::Done(result)
            }
        }
    }

    /// Release the operation: nothing of it was sent.
    pub(crate) fn abandon(self) -> Settling {
        self.settle(Settle::Abandon)
    }

    /// Leave the operation in doubt: its bytes may have left.
    pub(crate) fn mark_in_doubt(self) -> Settling {
        self.settle(Settle::MarkInDoubt)
    }

    /// From here on, the request may leave: a drop leaves the operation in doubt rather
    /// than releasing it. Called before the inner service is called, never after.
    pub(crate) fn sending(&mut self) {
        self.sent = true;
    }

    /// Between attempts: whether what was sent so far may have taken effect. An attempt
    /// proven refused before the effect leaves nothing, so a drop while the next one waits
    /// (its backoff, its readiness) releases the operation; one that may have happened
    /// keeps a drop leaving it in doubt.
    pub(crate) fn between_attempts(&mut self, may_have_happened: bool) {
        self.sent = may_have_happened;
    }

    /// A lease the store holds for this guard, let go of: it ends a lease from now. The
    /// store is asked only if it holds one (never on the settled path: a settle ends it).
    fn let_go(&self) {
        if self.held.swap(false, Relaxed) {
            self.ledger
                .store
                .let_go(self.key, self.token, self.ledger.lease);
        }
    }

    /// Hand the lease on unsettled, to whoever goes on with the operation under the same
    /// token (a reconciled operation found not applied is sent by the usual path, which
    /// holds its own guard).
    pub(crate) fn hand_on(mut self) -> LeaseToken {
        self.done = true;
        self.token
    }

    /// Boxed: settling by this path is rare on the request path (a failure, a `5xx` to
    /// release, a store that awaits), and held in place its retrying state would weigh on
    /// every request's future, which is moved whole as it is built.
    fn settle(self, settle: Settle) -> Settling {
        Box::pin(self.settle_after(settle, None))
    }

    /// `settle`; `lost`: the lost answer of a first try already made (see
    /// [`Ledger::apply`]).
    pub(super) async fn settle_after(
        mut self,
        settle: Settle,
        lost: Option<StoreError>,
    ) -> Result<(), StoreError> {
        self.pending = Some(settle.clone());
        // An owner holding the outcome keeps trying to record it for as long as its lease
        // would last: a write lost to a store restart is retried, not given up at once.
        let deadline = Instant::now() + self.ledger.lease;
        let result = self
            .ledger
            .apply(self.key, self.token, &settle, deadline, lost)
            .await;
        self.done = true;
        self.settled(&result);
        result
    }

    /// A settle applied ends the store's hold with the state it replaced: nothing is left
    /// to let go.
    fn settled(&mut self, result: &Result<(), StoreError>) {
        if result.is_ok() {
            *self.held.get_mut() = false;
        }
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        // A lease the store holds for this guard is let go first, whatever follows: it then
        // ends a lease from now, as a renewed one would have, even if the settle below
        // fails or never finishes. (Settled, nothing is held; handed on, the next guard
        // holds or renews it anew.)
        self.let_go();
        if self.done {
            return;
        }
        // Without a runtime (a runtime shutting down), the lease expiring is the fallback:
        // the record then reads as in doubt all the same.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        // Nothing sent yet (the owner went away between its claim and its call): release,
        // so the next run sends it rather than finding it in doubt. The store never
        // releases an operation an earlier attempt may have sent (a resumed claim goes
        // back to doubt), so this is safe whatever came before.
        let unsettled = if self.sent {
            Settle::MarkInDoubt
        } else {
            Settle::Abandon
        };
        let settle = self.pending.take().unwrap_or(unsettled);
        let (ledger, key, token) = (self.ledger.clone(), self.key, self.token);
        let mut settling = Box::pin(async move {
            let deadline = Instant::now() + ledger.lease;
            if let Err(err) = ledger.apply(key, token, &settle, deadline, None).await {
                tracing::warn!(%err, ?settle, "could not settle a dropped lease; it will expire into doubt");
            }
        });
        // A store that answers at once (`MemoryStore`) settles here and now, so the very next
        // request already sees the key settled; one that must wait finishes in a task. Not
        // while a panic unwinds: nothing that could panic again runs then.
        if !std::thread::panicking() {
            let mut cx = Context::from_waker(std::task::Waker::noop());
            if settling.as_mut().poll(&mut cx).is_ready() {
                return;
            }
        }
        runtime.spawn(settling);
    }
}
