//! The leases a simulated crash lets go of ([`crash_after`](super::crash_after)).

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::ledger::{IdempotencyStore, LeaseToken, LedgerKey};

tokio::task_local! {
    /// The held leases of the operation `crash_after` is running.
    static HELD: Domain;
}

/// A lease a store holds for an owner of the operation: what letting go of it takes.
type Held = (Arc<dyn IdempotencyStore>, LedgerKey, LeaseToken, Duration);

/// The leases held while one operation ran.
#[derive(Clone, Default)]
pub(crate) struct Domain(Arc<Mutex<Vec<Held>>>);

impl Domain {
    /// Run `operation` in this domain.
    pub(crate) fn scope<F: std::future::Future>(
        &self,
        operation: F,
    ) -> impl std::future::Future<Output = F::Output> {
        HELD.scope(self.clone(), operation)
    }

    /// The process running the operation died: its owners are gone, though nothing of
    /// theirs was dropped, so every lease held for them is let go (one already settled is
    /// not held any more, and is left as it is).
    pub(crate) fn crash(&self) {
        for (store, key, token, lease) in std::mem::take(&mut *self.held()) {
            store.let_go(key, token, lease);
        }
    }

    /// The leases noted, even if a thread panicked holding the list (a push is whole).
    fn held(&self) -> MutexGuard<'_, Vec<Held>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Note a lease `store` holds for the operation running, if `crash_after` runs it.
pub(crate) fn enlist(
    store: &Arc<dyn IdempotencyStore>,
    key: LedgerKey,
    token: LeaseToken,
    lease: Duration,
) {
    let _ = HELD.try_with(|domain| domain.held().push((Arc::clone(store), key, token, lease)));
}
