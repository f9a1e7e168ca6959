//! The client face's configuration, as built, and the warnings it gives once.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::Extensions;

use crate::fingerprint::PayloadFields;
use crate::frozen::{FrozenRequest, Handoff, RetriedOutside};
use crate::idempotency::decision::{count_signal, Face, OutcomeHook, Signal, Track};
use crate::idempotency::engine::{BusyPolicy, Ledger};
use crate::idempotency::reconcile::Reconcile;
use crate::idempotency::scope::Scope;
use crate::key::KeyHeader;
use crate::phase::ClassifyPhase;
use crate::Error;

use super::policy::DriftPolicy;
use super::release::ReleaseOn;

/// The client face's configuration (see [`Builder`](super::Builder)).
#[derive(Debug)]
pub struct ClientFace {
    pub(super) ledger: Ledger,
    pub(super) scope: String,
    pub(super) caller_keys: Scope,
    pub(super) require_key: bool,
    pub(super) release_on: ReleaseOn,
    /// Unset: per who named the operation (see `drift_policy_for`).
    pub(super) drift: Option<DriftPolicy>,
    pub(super) defining_fields: Option<PayloadFields>,
    pub(super) busy: BusyPolicy,
    pub(super) body_limit: usize,
    pub(super) response_limit: usize,
    pub(super) fail_open: bool,
    /// The header the key travels under, and its form.
    pub(crate) key_header: KeyHeader,
    pub(super) provider_deduplicates: bool,
    pub(super) phase_classifier: Option<Arc<dyn ClassifyPhase>>,
    pub(super) reconciler: Option<Arc<dyn Reconcile>>,
    pub(super) reconcile_timeout: Duration,
    pub(super) reconcile_when_deduplicating: bool,
    /// The retry window the builder checked the TTLs against.
    pub(super) retry_window: Duration,
    /// Whether the mismatch with the real retry policy was already reported.
    pub(super) warned_window: std::sync::atomic::AtomicBool,
    /// Whether an unprotected side effect was already reported.
    pub(super) warned_unprotected: std::sync::atomic::AtomicBool,
    pub(super) on_outcome: Option<OutcomeHook>,
}

impl fmt::Debug for dyn ClassifyPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClassifyPhase")
    }
}

impl ClientFace {
    /// Whether an `on_outcome` hook wants to hear of each operation (and its duration).
    #[cfg_attr(not(feature = "reqwest-middleware"), allow(dead_code))]
    pub(crate) fn on_outcome_set(&self) -> bool {
        self.on_outcome.is_some()
    }

    /// A side effect without an `OperationId` or a key passed through, unprotected: the retry
    /// layer inside will not resend it once it may have left, but a caller's own retry runs
    /// it again. Visible in every response (`ResponseSource::Unprotected`), a `DEBUG` event
    /// and the [`Unkeyed`](Signal::Unkeyed) signal's count, and once as a warning.
    pub(super) fn report_unprotected(&self, frozen: &FrozenRequest) {
        use std::sync::atomic::Ordering::Relaxed;
        // No track to raise it on: the request never reached the ledger.
        count_signal(Face::Client, Signal::Unkeyed);
        tracing::debug!(method = %frozen.method(), uri = %frozen.uri(), "side effect sent without an OperationId or Idempotency-Key: unprotected");
        if !self.warned_unprotected.swap(true, Relaxed) {
            tracing::warn!(
                method = %frozen.method(),
                uri = %frozen.uri(),
                "a side-effecting request passed through unprotected (no OperationId, no \
                 Idempotency-Key) because the layer was built with require_key(false); \
                 insert an OperationId to protect it"
            );
        }
    }

    /// A `FrozenRetryLayer` **outside** this layer marks the requests it retries: each of its
    /// attempts would then consult the ledger on its own, so its retry after an attempt that
    /// may have arrived is judged by a retry layer that knows nothing of the provider's keys
    /// or the operation's doubt. Refused before the ledger is consulted, so nothing is sent
    /// and nothing is recorded; the error names the fix.
    pub(super) fn check_layer_order(&self, extensions: &Extensions) -> Result<(), Error> {
        match extensions.get::<RetriedOutside>() {
            Some(RetriedOutside) => Err(Error::retry_outside()),
            None => Ok(()),
        }
    }

    /// The builder checked the TTLs against `retry_window`; the retry layer inside reports
    /// its real one. A longer real window can outlive the protected window or the retention
    /// (a record could be evicted or expire while its operation still retries): raise
    /// [`RetryWindowExceeded`](Signal::RetryWindowExceeded) on the operation's `track`,
    /// and say so once, naming the fix.
    pub(super) fn check_real_retry_window(&self, track: &Track, handoff: &Handoff) {
        use std::sync::atomic::Ordering::Relaxed;
        let Some(real) = handoff.retry_window() else {
            return;
        };
        if real <= self.retry_window {
            return;
        }
        track.signal(Signal::RetryWindowExceeded);
        if self.warned_window.swap(true, Relaxed) {
            return;
        }
        tracing::warn!(
            configured = ?self.retry_window,
            real = ?real,
            "the retry policy inside retries longer than the idempotency layer was told: \
             build the layer with `.retry_policy(policy)` so its protected window and \
             retention cover the real retry window"
        );
    }
}
