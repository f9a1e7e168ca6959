//! The settings the client and tool faces share: how the ledger holds one operation, what
//! a duplicate does meanwhile, how its attempts are retried and who is asked about it in
//! doubt. Both builders keep one [`OperationSettings`], so the two faces check the same
//! rules with the same words.

use std::sync::Arc;
use std::time::Duration;

use super::engine::{BusyPolicy, Ledger, DEFAULT_LEASE, DEFAULT_RETENTION};
use super::reconcile::{Reconcile, DEFAULT_RECONCILE_TIMEOUT};
use crate::ledger::IdempotencyStore;
use crate::retry::RetryPolicy;
use crate::ConfigError;

/// The default cap on a recorded response (1 MiB).
const DEFAULT_RESPONSE_LIMIT: usize = 1024 * 1024;

/// The client and tool faces' shared settings, with their defaults until a builder method
/// replaces one.
#[derive(Debug)]
pub(crate) struct OperationSettings {
    pub(crate) store: Arc<dyn IdempotencyStore>,
    pub(crate) lease: Duration,
    pub(crate) retention: Duration,
    /// Unset: the retry window plus the lease, the least that keeps a retried operation.
    pub(crate) protected: Option<Duration>,
    pub(crate) busy: BusyPolicy,
    pub(crate) response_limit: usize,
    pub(crate) retry: RetryPolicy,
    pub(crate) reconciler: Option<Arc<dyn Reconcile>>,
    pub(crate) reconcile_timeout: Duration,
}

impl OperationSettings {
    /// The defaults over `store`: a 10 s lease, 24 h retention, a 30 s wait for a busy
    /// operation, a 1 MiB record cap, the default retry policy, no reconciler.
    pub(crate) fn new(store: Arc<dyn IdempotencyStore>) -> Self {
        Self {
            store,
            lease: DEFAULT_LEASE,
            retention: DEFAULT_RETENTION,
            protected: None,
            busy: BusyPolicy::Wait(Duration::from_secs(30)),
            response_limit: DEFAULT_RESPONSE_LIMIT,
            retry: RetryPolicy::default(),
            reconciler: None,
            reconcile_timeout: DEFAULT_RECONCILE_TIMEOUT,
        }
    }

    /// Check the settings against each other and open the ledger they describe.
    ///
    /// A record must outlive every retry of its operation: the retention and the protected
    /// window are refused when shorter than the retry window plus the lease (the last
    /// attempt may start at the deadline and hold its lease to the end), because a record
    /// that vanished, or was evicted, while a retry could still come would let that retry
    /// run the side effect again.
    pub(crate) fn ledger(&self) -> Result<Ledger, ConfigError> {
        if self.lease.is_zero() {
            return Err(ConfigError::new("the lease must be longer than zero"));
        }
        if self.reconciler.is_some() && self.reconcile_timeout.is_zero() {
            return Err(ConfigError::new(
                "the reconcile timeout must be longer than zero",
            ));
        }
        // Saturating: durations are unbounded here and saturate when the ledger takes them.
        let must_keep = self.retry.retry_window().saturating_add(self.lease);
        if self.retention < must_keep {
            return Err(ConfigError::new(format!(
                "the retention ({:?}) must be at least the retry window plus the lease ({must_keep:?})",
                self.retention
            )));
        }
        let protected = self.protected.unwrap_or(must_keep);
        if protected < must_keep {
            return Err(ConfigError::new(format!(
                "the protected window ({protected:?}) must be at least the retry window plus the lease ({must_keep:?})"
            )));
        }
        Ok(Ledger::new(
            self.store.clone(),
            self.lease,
            self.retention,
            protected,
        ))
    }
}
