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

/// The leases held while one operation ran, and the domain of the `crash_after` around
/// it, if there is one: a lease is noted in every enclosing domain, so a crash of an outer
/// operation lets go of what the operations inside it held.
#[derive(Clone)]
pub(crate) struct Domain {
    held: Arc<Mutex<Vec<Held>>>,
    outer: Option<Box<Domain>>,
}

impl Domain {
    /// A domain for an operation run inside the current one, if any.
    pub(crate) fn nested() -> Self {
        Self {
            held: Arc::default(),
            outer: HELD.try_with(|outer| Box::new(outer.clone())).ok(),
        }
    }

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
        // Taken out first: a store's `let_go` runs without the list locked.
        let held = std::mem::take(&mut *self.held());
        for (store, key, token, lease) in held {
            store.let_go(key, token, lease);
        }
    }

    /// Note `lease` here and in every enclosing domain.
    fn note(&self, lease: &Held) {
        let mut domain = Some(self);
        while let Some(this) = domain {
            this.held().push(lease.clone());
            domain = this.outer.as_deref();
        }
    }

    /// The leases noted, even if a thread panicked holding the list (a push is whole).
    fn held(&self) -> MutexGuard<'_, Vec<Held>> {
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Note a lease `store` holds for the operation running, if `crash_after` runs it.
pub(crate) fn enlist(
    store: &Arc<dyn IdempotencyStore>,
    key: LedgerKey,
    token: LeaseToken,
    lease: Duration,
) {
    let _ = HELD.try_with(|domain| domain.note(&(Arc::clone(store), key, token, lease)));
}
