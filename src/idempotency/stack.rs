//! One builder for the whole client stack, in the right order.

use std::sync::Arc;
use std::time::Duration;

use tower_layer::Layer;

use super::client::{ClientBuilder, ClientFace, DriftPolicy};
use super::engine::BusyPolicy;
use super::{Idempotency, IdempotencyLayer};
use crate::error::ConfigError;
use crate::ledger::IdempotencyStore;
use crate::phase::ClassifyPhase;
use crate::retry::{FrozenRetry, FrozenRetryLayer, RetryPolicy};

/// Builds the client stack — [`IdempotencyLayer`] outside, [`FrozenRetryLayer`] inside —
/// from one configuration, from [`IdempotencyLayer::client_stack`].
///
/// What both layers need is said once: the body limit and the failure-phase classifier
/// apply to both, and the ledger's lease, retention and protected window are checked
/// against the retry policy really stacked inside. The two layers stay public for stacks
/// composed by hand.
///
/// ```
/// use std::time::Duration;
/// use tower::ServiceBuilder;
/// use tower_idempotency::testing::SideEffectService;
/// use tower_idempotency::{ledger::MemoryStore, retry::RetryPolicy, IdempotencyLayer};
///
/// let stack = IdempotencyLayer::client_stack(MemoryStore::new())
///     .scope("billing-agent")
///     .retry_policy(RetryPolicy::builder().attempt_timeout(Duration::from_secs(2)).build().unwrap())
///     .body_limit(256 * 1024)
///     .build()
///     .unwrap();
/// let client = ServiceBuilder::new().layer(stack).service(SideEffectService::new());
/// # let _ = client;
/// ```
#[derive(Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct ClientStackBuilder {
    client: ClientBuilder,
    policy: RetryPolicy,
    body_limit: Option<usize>,
    classifier: Option<Arc<dyn ClassifyPhase>>,
}

impl IdempotencyLayer<ClientFace> {
    /// Configure the whole client stack over `store`: see [`ClientStackBuilder`].
    pub fn client_stack(store: impl IdempotencyStore) -> ClientStackBuilder {
        ClientStackBuilder {
            client: Self::client_builder(store),
            policy: RetryPolicy::default(),
            body_limit: None,
            classifier: None,
        }
    }
}

impl ClientStackBuilder {
    /// See [`ClientBuilder::scope`].
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.client = self.client.scope(scope);
        self
    }

    /// See [`ClientBuilder::require_key`].
    pub fn require_key(mut self, require: bool) -> Self {
        self.client = self.client.require_key(require);
        self
    }

    /// See [`ClientBuilder::release_on`].
    pub fn release_on(mut self, rule: super::ReleaseOn) -> Self {
        self.client = self.client.release_on(rule);
        self
    }

    /// See [`ClientBuilder::caller_key_scope`].
    pub fn caller_key_scope<F>(mut self, scope: F) -> Self
    where
        F: Fn(&http::request::Parts) -> String + Send + Sync + 'static,
    {
        self.client = self.client.caller_key_scope(scope);
        self
    }

    /// See [`ClientBuilder::caller_keys_unscoped`].
    pub fn caller_keys_unscoped(mut self) -> Self {
        self.client = self.client.caller_keys_unscoped();
        self
    }

    /// See [`ClientBuilder::lease`].
    pub fn lease(mut self, lease: Duration) -> Self {
        self.client = self.client.lease(lease);
        self
    }

    /// See [`ClientBuilder::retention`].
    pub fn retention(mut self, retention: Duration) -> Self {
        self.client = self.client.retention(retention);
        self
    }

    /// See [`ClientBuilder::protected_window`].
    pub fn protected_window(mut self, window: Duration) -> Self {
        self.client = self.client.protected_window(window);
        self
    }

    /// See [`DriftPolicy`].
    pub fn drift_policy(mut self, policy: DriftPolicy) -> Self {
        self.client = self.client.drift_policy(policy);
        self
    }

    /// See [`ClientBuilder::defining_fields`].
    pub fn defining_fields(mut self, fields: crate::fingerprint::PayloadFields) -> Self {
        self.client = self.client.defining_fields(fields);
        self
    }

    /// See [`BusyPolicy`].
    pub fn busy_policy(mut self, policy: BusyPolicy) -> Self {
        self.client = self.client.busy_policy(policy);
        self
    }

    /// See [`ClientBuilder::response_limit`].
    pub fn response_limit(mut self, limit: usize) -> Self {
        self.client = self.client.response_limit(limit);
        self
    }

    /// See [`ClientBuilder::fail_open`].
    pub fn fail_open(mut self, fail_open: bool) -> Self {
        self.client = self.client.fail_open(fail_open);
        self
    }

    /// See [`ClientBuilder::on_outcome`].
    pub fn on_outcome(
        mut self,
        hook: impl Fn(&super::OutcomeEvent<'_>) + Send + Sync + 'static,
    ) -> Self {
        self.client = self.client.on_outcome(hook);
        self
    }

    /// See [`ClientBuilder::provider_deduplicates`].
    pub fn provider_deduplicates(mut self, deduplicates: bool) -> Self {
        self.client = self.client.provider_deduplicates(deduplicates);
        self
    }

    /// See [`ClientBuilder::reconcile`].
    pub fn reconcile(mut self, reconciler: impl super::Reconcile) -> Self {
        self.client = self.client.reconcile(reconciler);
        self
    }

    /// See [`ClientBuilder::reconcile_timeout`].
    pub fn reconcile_timeout(mut self, bound: Duration) -> Self {
        self.client = self.client.reconcile_timeout(bound);
        self
    }

    /// See [`ClientBuilder::reconcile_when_deduplicating`].
    pub fn reconcile_when_deduplicating(mut self, reconcile: bool) -> Self {
        self.client = self.client.reconcile_when_deduplicating(reconcile);
        self
    }

    /// The retry policy of the [`FrozenRetryLayer`] inside (default
    /// [`RetryPolicy::default`]); the ledger's TTLs are checked against its window.
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// The largest request body, for both layers (default 1 MiB).
    pub fn body_limit(mut self, limit: usize) -> Self {
        self.body_limit = Some(limit);
        self
    }

    /// Teach both layers which of your transport's errors are pre-write failures.
    pub fn classify_phase(mut self, classifier: impl ClassifyPhase) -> Self {
        self.classifier = Some(Arc::new(classifier));
        self
    }

    /// Check the settings against each other and build the stack.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{ledger::MemoryStore, retry::RetryPolicy, IdempotencyLayer};
    ///
    /// // Retries for ten minutes, records kept for five: refused.
    /// let err = IdempotencyLayer::client_stack(MemoryStore::new())
    ///     .retry_policy(RetryPolicy::builder().max_elapsed(Duration::from_secs(600)).build().unwrap())
    ///     .retention(Duration::from_secs(300))
    ///     .build()
    ///     .unwrap_err();
    /// assert!(err.to_string().contains("retention"));
    /// ```
    pub fn build(self) -> Result<ClientStack, ConfigError> {
        let mut policy = self.policy;
        let mut client = self.client.retry_policy(&policy);
        if let Some(limit) = self.body_limit {
            policy.body_limit = limit;
            client = client.body_limit(limit);
        }
        if let Some(classifier) = self.classifier {
            policy.phase_classifier = Some(classifier.clone());
            client = client.shared_phase_classifier(classifier);
        }
        Ok(ClientStack {
            idempotency: client.build()?,
            retry: FrozenRetryLayer::new(policy),
        })
    }
}

/// The client stack as one layer: [`IdempotencyLayer`] over [`FrozenRetryLayer`] over the
/// service it wraps ([`ClientStackService`](super::ClientStackService)). Built by
/// [`ClientStackBuilder`].
///
/// The inner service (the transport) takes `Request<Full<Bytes>>`, answers `Response<B>`
/// with `B: Body<Data = Bytes> + Unpin + Send`, and must be `Clone + Send + 'static`.
///
/// ```
/// use tower::Layer;
/// use tower_idempotency::testing::SideEffectService;
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
///
/// let stack = IdempotencyLayer::client_stack(MemoryStore::new()).build().unwrap();
/// let client = stack.layer(SideEffectService::new());
/// # let _ = client;
/// ```
#[derive(Clone, Debug)]
#[must_use = "a layer does nothing until it wraps a service"]
pub struct ClientStack {
    idempotency: IdempotencyLayer<ClientFace>,
    retry: FrozenRetryLayer,
}

impl ClientStack {
    /// The idempotency layer, outside.
    pub fn idempotency(&self) -> &IdempotencyLayer<ClientFace> {
        &self.idempotency
    }

    /// The retry layer, inside.
    pub fn retry(&self) -> &FrozenRetryLayer {
        &self.retry
    }
}

impl<S> Layer<S> for ClientStack {
    type Service = Idempotency<FrozenRetry<S>, ClientFace>;

    fn layer(&self, inner: S) -> Self::Service {
        self.idempotency.layer(self.retry.layer(inner))
    }
}
