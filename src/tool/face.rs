//! [`ToolFace`]: a built tool layer's settings, which every call of it shares. Apart from
//! the layer that holds them, so that the operation they drive does not depend on the layer.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::types::ToolClass;
use crate::idempotency::decision::OutcomeHook;
use crate::idempotency::{BusyPolicy, Ledger, Reconcile};
use crate::provider::ProviderKeys;
use crate::retry::RetryPolicy;
use crate::DriftPolicy;

/// A built tool face: shared by every call of a [`ToolLayer`](super::ToolLayer).
pub(crate) struct ToolFace<C> {
    pub(crate) ledger: Ledger,
    pub(crate) scope: String,
    /// `/tools/{name}`: the frozen call's target, in every fingerprint.
    pub(crate) target: String,
    pub(crate) uri: http::Uri,
    pub(crate) class: ToolClass,
    pub(crate) provider: ProviderKeys,
    pub(crate) drift: DriftPolicy,
    /// The fields that define the operation, if not all of them.
    pub(crate) fields: Option<crate::fingerprint::PayloadFields>,
    pub(crate) busy: BusyPolicy,
    pub(crate) response_limit: usize,
    pub(crate) reconciler: Option<Arc<dyn Reconcile>>,
    pub(crate) reconcile_timeout: Duration,
    pub(crate) retry: Arc<RetryPolicy>,
    pub(crate) classifier: C,
    /// Told what each side-effecting call came to.
    pub(crate) on_outcome: Option<OutcomeHook>,
}

impl<C> fmt::Debug for ToolFace<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolFace")
            .field("ledger", &self.ledger)
            .field("scope", &self.scope)
            .field("target", &self.target)
            .field("class", &self.class)
            .field("provider", &self.provider)
            .field("drift", &self.drift)
            .field("fields", &self.fields)
            .field("busy", &self.busy)
            .field("reconciler", &self.reconciler.is_some())
            .finish_non_exhaustive()
    }
}
