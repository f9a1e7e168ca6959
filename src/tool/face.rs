//! The tool face's builder, layer and service.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use tower_layer::Layer;
use tower_service::Service;

use super::operation::{run, Tower};
use super::settings::ToolFace;
use super::types::{
    ClassifyToolError, MayHaveHappened, ProviderKeys, ToolCall, ToolClass, ToolError, ToolOutput,
};
use crate::client::DEFAULT_RESPONSE_LIMIT;
use crate::error::ConfigError;
use crate::idempotency::{
    BusyPolicy, Ledger, Reconcile, DEFAULT_LEASE, DEFAULT_RECONCILE_TIMEOUT, DEFAULT_RETENTION,
};
use crate::ledger::IdempotencyStore;
use crate::retry::RetryPolicy;
use crate::DriftPolicy;

/// Configures a [`ToolLayer`]; [`build`](Self::build) checks the settings.
///
/// | setting | default |
/// |---|---|
/// | provider deduplicates on the key | **no default**: [`ProviderKeys`] is required |
/// | [class](Self::class) | [`ToolClass::SideEffect`] (through the ledger) |
/// | scope (mixed into every key) | `""` |
/// | regenerated arguments | [`DriftPolicy::ResendFrozen`]: the frozen ones are used, the output says what was discarded |
/// | [fingerprinted fields](Self::fingerprint_fields) | all of them |
/// | tool errors | [`MayHaveHappened`] (in doubt); see [`classify`](Self::classify) |
/// | retries | [`RetryPolicy::default`]: 3 attempts within 30 s, full-jitter backoff, a budget |
/// | lease (renewed by a live owner) | 10 s |
/// | retention | 24 h |
/// | protected window (never evicted) | retry window + lease |
/// | busy operation | wait up to 30 s, then a busy error |
/// | recorded response cap | 1 MiB (larger: returned, kept as a tombstone) |
/// | ledger unavailable | fail closed (the tool is not called) |
/// | reconciler of in-doubt operations | none (asked within 10 s when set) |
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::ledger::MemoryStore;
/// use tower_idempotency::tool::{ProviderKeys, ToolLayer};
/// use tower_idempotency::DriftPolicy;
///
/// let layer = ToolLayer::builder(MemoryStore::new(), "create_refund", ProviderKeys::Deduplicates)
///     .scope("support-agent")
///     .fingerprint_fields(["/order_id", "/amount"])
///     .drift_policy(DriftPolicy::Reject)
///     .lease(Duration::from_secs(30))
///     .build()
///     .unwrap();
/// # let _ = layer;
/// ```
#[must_use = "a builder does nothing until `build` is called"]
pub struct ToolLayerBuilder<C = MayHaveHappened> {
    store: Arc<dyn IdempotencyStore>,
    name: String,
    provider: ProviderKeys,
    scope: String,
    class: ToolClass,
    drift: DriftPolicy,
    fields: Option<Vec<String>>,
    lease: Duration,
    retention: Duration,
    protected: Option<Duration>,
    busy: BusyPolicy,
    response_limit: usize,
    reconciler: Option<Arc<dyn Reconcile>>,
    reconcile_timeout: Duration,
    retry: RetryPolicy,
    classifier: C,
}

impl<C> fmt::Debug for ToolLayerBuilder<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolLayerBuilder")
            .field("name", &self.name)
            .field("provider", &self.provider)
            .field("scope", &self.scope)
            .field("class", &self.class)
            .finish_non_exhaustive()
    }
}

impl<C> ToolLayerBuilder<C> {
    /// Mixed into every key, so two orchestrators (or tenants, or environments) sharing a
    /// ledger never collide on equal task ids.
    ///
    /// See the [builder docs](Self) for an example.
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = scope.into();
        self
    }

    /// What the tool does: only [side effects](ToolClass::SideEffect) go through the ledger.
    ///
    /// See [`ToolClass`] for an example.
    pub fn class(mut self, class: ToolClass) -> Self {
        self.class = class;
        self
    }

    /// What a call whose arguments differ from the frozen ones does:
    /// [`ResendFrozen`](DriftPolicy::ResendFrozen) (the default here) goes on with the
    /// frozen arguments and marks the output ([`ToolOutput::discarded`]);
    /// [`Reject`](DriftPolicy::Reject) refuses with a drift error.
    ///
    /// See the [builder docs](Self) for an example.
    pub fn drift_policy(mut self, policy: DriftPolicy) -> Self {
        self.drift = policy;
        self
    }

    /// Fingerprint only the fields at these JSON pointers (RFC 6901, as `"/order_id"` or
    /// `"/line/0/sku"`): the fields that define the operation. A call differing elsewhere
    /// (a reworded `summary`) is then not drift, even under
    /// [`Reject`](DriftPolicy::Reject); it still runs with the frozen arguments and says
    /// so. An absent field counts as `null`.
    ///
    /// See the [builder docs](Self) for an example.
    pub fn fingerprint_fields<I, P>(mut self, pointers: I) -> Self
    where
        I: IntoIterator<Item = P>,
        P: Into<String>,
    {
        self.fields = Some(pointers.into_iter().map(Into::into).collect());
        self
    }

    /// How long an owner may hold an operation without renewing it (default 10 s; live
    /// owners renew every third of it).
    ///
    /// See the [builder docs](Self) for an example.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long records are kept (default 24 h).
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::{ledger::MemoryStore, tool::{ProviderKeys, ToolLayer}};
    /// let layer = ToolLayer::builder(MemoryStore::new(), "t", ProviderKeys::Ignored)
    ///     .retention(Duration::from_secs(7 * 24 * 3600))
    ///     .build();
    /// assert!(layer.is_ok());
    /// ```
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// How long after its last change a record is never evicted by a store with a memory
    /// budget; at least (and by default) the retry window plus the lease.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::{ledger::MemoryStore, tool::{ProviderKeys, ToolLayer}};
    /// let too_short = ToolLayer::builder(MemoryStore::new(), "t", ProviderKeys::Ignored)
    ///     .protected_window(Duration::from_secs(1))
    ///     .build();
    /// assert!(too_short.is_err());
    /// ```
    pub fn protected_window(mut self, window: Duration) -> Self {
        self.protected = Some(window);
        self
    }

    /// The retries of this face: attempts, backoff, elapsed time, budget and attempt
    /// timeout, as [`FrozenRetryLayer`](crate::FrozenRetryLayer) counts them (its
    /// HTTP classifier does not apply: a tool's errors are classified by
    /// [`classify`](Self::classify)). An error before the effect is retried; one that may
    /// have happened only when the provider [deduplicates](ProviderKeys::Deduplicates); a
    /// final answer never. A [`Verdict::retry_after`](super::Verdict::retry_after) hint
    /// lengthens the wait.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::{ledger::MemoryStore, retry::RetryPolicy, tool::{ProviderKeys, ToolLayer}};
    /// let policy = RetryPolicy::builder()
    ///     .max_attempts(4)
    ///     .attempt_timeout(Duration::from_secs(5))
    ///     .build()
    ///     .unwrap();
    /// let layer = ToolLayer::builder(MemoryStore::new(), "t", ProviderKeys::Deduplicates)
    ///     .retry_policy(policy)
    ///     .build();
    /// assert!(layer.is_ok());
    /// ```
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.retry = policy;
        self
    }

    /// What to do when another caller holds the operation.
    ///
    /// ```
    /// # use tower_idempotency::{ledger::MemoryStore, tool::{ProviderKeys, ToolLayer}, BusyPolicy};
    /// let layer = ToolLayer::builder(MemoryStore::new(), "t", ProviderKeys::Ignored)
    ///     .busy_policy(BusyPolicy::Fail)
    ///     .build();
    /// assert!(layer.is_ok());
    /// ```
    pub fn busy_policy(mut self, policy: BusyPolicy) -> Self {
        self.busy = policy;
        self
    }

    /// The largest recorded response (its JSON); a larger one is returned but kept as a
    /// tombstone, which a replay cannot answer.
    ///
    /// ```
    /// # use tower_idempotency::{ledger::MemoryStore, tool::{ProviderKeys, ToolLayer}};
    /// let layer = ToolLayer::builder(MemoryStore::new(), "t", ProviderKeys::Ignored)
    ///     .response_limit(64 * 1024)
    ///     .build();
    /// assert!(layer.is_ok());
    /// ```
    pub fn response_limit(mut self, limit: usize) -> Self {
        self.response_limit = limit;
        self
    }

    /// Ask `reconciler` before calling an in-doubt operation again (with either
    /// [`ProviderKeys`]): it sees the frozen arguments
    /// ([`frozen_arguments`](super::frozen_arguments)) and the key, and answers what it
    /// found ([`applied`](super::applied)), that the call never happened, or that it
    /// cannot tell (the operation stays in doubt).
    ///
    /// ```
    /// use tower_idempotency::idempotency::{InDoubtOperation, Reconciled};
    /// use tower_idempotency::ledger::MemoryStore;
    /// use tower_idempotency::tool::{ProviderKeys, ToolLayer};
    ///
    /// let layer = ToolLayer::builder(MemoryStore::new(), "charge", ProviderKeys::Ignored)
    ///     .reconcile(|_: InDoubtOperation| async { Ok(Reconciled::NotApplied) })
    ///     .build();
    /// assert!(layer.is_ok());
    /// ```
    pub fn reconcile(mut self, reconciler: impl Reconcile) -> Self {
        self.reconciler = Some(Arc::new(reconciler));
        self
    }

    /// How long the reconciler may take before the operation is left in doubt (default 10 s).
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::{ledger::MemoryStore, tool::{ProviderKeys, ToolLayer}};
    /// let layer = ToolLayer::builder(MemoryStore::new(), "t", ProviderKeys::Ignored)
    ///     .reconcile_timeout(Duration::from_secs(3))
    ///     .build();
    /// assert!(layer.is_ok());
    /// ```
    pub fn reconcile_timeout(mut self, bound: Duration) -> Self {
        self.reconcile_timeout = bound;
        self
    }

    /// Classify the tool's errors by phase (see [`Verdict`](super::Verdict)).
    ///
    /// See [`ClassifyToolError`] for an example.
    pub fn classify<C2>(self, classifier: C2) -> ToolLayerBuilder<C2> {
        ToolLayerBuilder {
            store: self.store,
            name: self.name,
            provider: self.provider,
            scope: self.scope,
            class: self.class,
            drift: self.drift,
            fields: self.fields,
            lease: self.lease,
            retention: self.retention,
            protected: self.protected,
            busy: self.busy,
            response_limit: self.response_limit,
            reconciler: self.reconciler,
            reconcile_timeout: self.reconcile_timeout,
            retry: self.retry,
            classifier,
        }
    }

    /// Check the settings and build the layer.
    ///
    /// Refuses a tool name that is not a URI path segment (letters, digits, `-`, `_`,
    /// `.`), a JSON pointer not starting with `/`, a zero lease or reconcile timeout, and a
    /// retention or protected window shorter than the retry window plus the lease.
    ///
    /// ```
    /// # use tower_idempotency::{ledger::MemoryStore, tool::{ProviderKeys, ToolLayer}};
    /// assert!(ToolLayer::builder(MemoryStore::new(), "send email", ProviderKeys::Ignored).build().is_err());
    /// ```
    pub fn build(self) -> Result<ToolLayer<C>, ConfigError> {
        let valid_name = !self.name.is_empty()
            && self
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if !valid_name {
            return Err(ConfigError::new(format!(
                "the tool name {:?} must be letters, digits, '-', '_' or '.'",
                self.name
            )));
        }
        if let Some(bad) = self
            .fields
            .iter()
            .flatten()
            .find(|pointer| !pointer.starts_with('/'))
        {
            return Err(ConfigError::new(format!(
                "{bad:?} is not a JSON pointer (it must start with '/')"
            )));
        }
        if self.lease.is_zero() {
            return Err(ConfigError::new("the lease must be longer than zero"));
        }
        if self.reconciler.is_some() && self.reconcile_timeout.is_zero() {
            return Err(ConfigError::new(
                "the reconcile timeout must be longer than zero",
            ));
        }
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
        let target = format!("/tools/{}", self.name);
        let uri = target
            .parse()
            .map_err(|_| ConfigError::new("the tool name does not make a URI path"))?;
        let face = ToolFace {
            ledger: Ledger::new(self.store, self.lease, self.retention, protected),
            scope: self.scope,
            target,
            uri,
            class: self.class,
            provider: self.provider,
            drift: self.drift,
            fields: self.fields,
            busy: self.busy,
            response_limit: self.response_limit,
            reconciler: self.reconciler,
            reconcile_timeout: self.reconcile_timeout,
            retry: Arc::new(self.retry),
            classifier: self.classifier,
        };
        Ok(ToolLayer {
            face: Arc::new(face),
        })
    }
}

/// Protects a tool: a [`Layer`] for any `tower::Service<ToolCall<A>>`. See the
/// [module docs](super) for what it does and an example.
///
/// Clones share one face (one ledger handle, one configuration).
///
/// ```
/// use tower::{service_fn, ServiceBuilder, ServiceExt};
/// use tower_idempotency::ledger::MemoryStore;
/// use tower_idempotency::tool::{ProviderKeys, ToolCall, ToolLayer};
/// use tower_idempotency::OperationId;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let layer = ToolLayer::builder(MemoryStore::new(), "page_oncall", ProviderKeys::Ignored).build().unwrap();
/// let page = ServiceBuilder::new().layer(layer).service(service_fn(|call: ToolCall<String>| async move {
///     Ok::<_, std::io::Error>(format!("paged: {}", call.arguments()))
/// }));
/// let out = page.oneshot(ToolCall::new(OperationId::new("incident-9", "page"), "db down".into())).await.unwrap();
/// assert_eq!(out.value(), "paged: db down");
/// # }
/// ```
pub struct ToolLayer<C = MayHaveHappened> {
    pub(crate) face: Arc<ToolFace<C>>,
}

impl<C> Clone for ToolLayer<C> {
    fn clone(&self) -> Self {
        Self {
            face: self.face.clone(),
        }
    }
}

impl<C> fmt::Debug for ToolLayer<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolLayer")
            .field("face", &self.face)
            .finish()
    }
}

impl ToolLayer {
    /// Configure a layer for the tool `name` over `store`, stating whether its provider
    /// deduplicates on the key (see [`ProviderKeys`]).
    ///
    /// See [`ToolLayerBuilder`] for the settings and an example.
    pub fn builder(
        store: impl IdempotencyStore,
        name: impl Into<String>,
        provider: ProviderKeys,
    ) -> ToolLayerBuilder {
        ToolLayerBuilder {
            store: Arc::new(store),
            name: name.into(),
            provider,
            scope: String::new(),
            class: ToolClass::SideEffect,
            drift: DriftPolicy::ResendFrozen,
            fields: None,
            lease: DEFAULT_LEASE,
            retention: DEFAULT_RETENTION,
            protected: None,
            busy: BusyPolicy::Wait(Duration::from_secs(30)),
            response_limit: DEFAULT_RESPONSE_LIMIT,
            reconciler: None,
            reconcile_timeout: DEFAULT_RECONCILE_TIMEOUT,
            retry: RetryPolicy::default(),
            classifier: MayHaveHappened,
        }
    }
}

impl<S, C> Layer<S> for ToolLayer<C> {
    type Service = ToolService<S, C>;

    fn layer(&self, inner: S) -> Self::Service {
        ToolService {
            inner,
            face: self.face.clone(),
        }
    }
}

/// The service of a [`ToolLayer`]: answers a [`ToolCall`] with a [`ToolOutput`].
///
/// See [`ToolLayer`] for an example.
pub struct ToolService<S, C = MayHaveHappened> {
    inner: S,
    face: Arc<ToolFace<C>>,
}

impl<S: Clone, C> Clone for ToolService<S, C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            face: self.face.clone(),
        }
    }
}

impl<S: fmt::Debug, C> fmt::Debug for ToolService<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolService")
            .field("inner", &self.inner)
            .field("face", &self.face)
            .finish()
    }
}

/// The future of a [`ToolService`]: boxed, as it holds the operation's whole ledger
/// conversation and the tool's own future.
pub type ToolFuture<R, E> =
    Pin<Box<dyn Future<Output = Result<ToolOutput<R>, ToolError<E>>> + Send + 'static>>;

impl<S, C, A, R, E> Service<ToolCall<A>> for ToolService<S, C>
where
    S: Service<ToolCall<A>, Response = R, Error = E> + Clone + Send + 'static,
    S::Future: Send,
    C: ClassifyToolError<E>,
    A: Serialize + DeserializeOwned + Send + 'static,
    R: Serialize + DeserializeOwned + Send + 'static,
    E: Send + 'static,
{
    type Response = ToolOutput<R>;
    type Error = ToolError<E>;
    type Future = ToolFuture<R, E>;

    /// Always ready: the tool's own readiness is awaited inside the call, before each
    /// attempt (an operation may call it more than once).
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, call: ToolCall<A>) -> Self::Future {
        let inner = self.inner.clone();
        let face = self.face.clone();
        Box::pin(async move { run(&face, call, &mut Tower(inner)).await })
    }
}
