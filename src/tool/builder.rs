//! [`Builder`]: a tool layer's settings, checked once by `build`.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::face::ToolFace;
use super::layer::ToolLayer;
use super::types::{MayHaveHappened, ToolClass};
use crate::fingerprint::PayloadFields;
use crate::idempotency::decision::OutcomeHook;
use crate::idempotency::hold::OperationSettings;
use crate::idempotency::OutcomeEvent;
use crate::idempotency::{BusyPolicy, Reconcile};
use crate::ledger::IdempotencyStore;
use crate::provider::ProviderKeys;
use crate::retry::RetryPolicy;
use crate::ConfigError;
use crate::DriftPolicy;

/// Configures a [`ToolLayer`]; [`build`](Self::build) checks the settings.
///
/// | setting | default |
/// |---|---|
/// | provider deduplicates on the key | **no default**: [`ProviderKeys`] is required |
/// | [class](Self::class) | [`ToolClass::SideEffect`] (through the ledger) |
/// | scope (mixed into every key) | `""` |
/// | regenerated arguments | [`DriftPolicy::ResendFrozen`]: the frozen ones are used, the output says what was discarded |
/// | [defining fields](Self::defining_fields) (a change there: refused, whatever the policy) | none declared: all the arguments, judged by the drift policy |
/// | tool errors | [`MayHaveHappened`] (in doubt); see [`classify`](Self::classify) |
/// | retries | [`RetryPolicy::default`]: 3 attempts within 30 s, full-jitter backoff, a budget |
/// | lease (renewed by a live owner) | 10 s |
/// | retention | 24 h |
/// | protected window (never evicted) | retry window + lease |
/// | busy operation | wait up to 30 s, then a busy error |
/// | recorded response cap | 1 MiB (larger: returned, kept as a tombstone) |
/// | ledger unavailable | fail closed (the tool is not called) |
/// | reconciler of in-doubt operations | none (asked within 10 s when set) |
/// | [outcome hook](Self::on_outcome) | none |
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::fingerprint::PayloadFields;
/// use tower_idempotency::ledger::MemoryStore;
/// use tower_idempotency::tool::{ProviderKeys, ToolLayer};
/// use tower_idempotency::DriftPolicy;
///
/// let layer = ToolLayer::builder(MemoryStore::new(), "create_refund", ProviderKeys::Deduplicates)
///     .scope("support-agent")
///     .defining_fields(PayloadFields::new(["/order_id", "/amount"]).unwrap())
///     .drift_policy(DriftPolicy::Reject)
///     .lease(Duration::from_secs(30))
///     .build()
///     .unwrap();
/// # let _ = layer;
/// ```
#[must_use = "a builder does nothing until `build` is called"]
pub struct Builder<C = MayHaveHappened> {
    /// Lease, retention, protected window, busy duplicates, record cap, retry policy and
    /// reconciler: the settings the client face shares, checked by the same rules.
    operation: OperationSettings,
    name: String,
    provider: ProviderKeys,
    scope: String,
    class: ToolClass,
    drift: DriftPolicy,
    fields: Option<PayloadFields>,
    classifier: C,
    on_outcome: Option<OutcomeHook>,
}

impl<C> fmt::Debug for Builder<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Builder")
            .field("name", &self.name)
            .field("provider", &self.provider)
            .field("scope", &self.scope)
            .field("class", &self.class)
            .finish_non_exhaustive()
    }
}

impl Builder {
    pub(crate) fn new(
        store: Arc<dyn IdempotencyStore>,
        name: String,
        provider: ProviderKeys,
    ) -> Self {
        Self {
            operation: OperationSettings::new(store),
            name,
            provider,
            scope: String::new(),
            class: ToolClass::SideEffect,
            drift: DriftPolicy::ResendFrozen,
            fields: None,
            classifier: MayHaveHappened,
            on_outcome: None,
        }
    }
}

/// What the tool is, and whose operations these are.
impl<C> Builder<C> {
    /// What the tool does: only [side effects](ToolClass::SideEffect) go through the ledger.
    ///
    /// See [`ToolClass`] for an example.
    pub fn class(mut self, class: ToolClass) -> Self {
        self.class = class;
        self
    }

    /// Mixed into every key, so two orchestrators (or tenants, or environments) sharing a
    /// ledger never collide on equal task ids.
    ///
    /// See the [builder docs](Self) for an example.
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = scope.into();
        self
    }
}

/// Regenerated arguments: what a re-run step's new arguments come to.
impl<C> Builder<C> {
    /// What a call whose arguments differ from the frozen ones does:
    /// [`ResendFrozen`](DriftPolicy::ResendFrozen) (the default here) goes on with the
    /// frozen arguments and marks the output ([`ToolOutput::discarded`](super::ToolOutput::discarded));
    /// [`Reject`](DriftPolicy::Reject) refuses with a drift error.
    ///
    /// Only the arguments may differ: a record under the same `OperationId` made by another
    /// tool (the name is part of the fingerprint) or by an HTTP call is refused with a drift
    /// error naming the target, whatever the policy, so one tool never answers with
    /// another's outcome nor is called with its arguments. A changed
    /// [defining field](Self::defining_fields), when some are declared, is refused
    /// whatever the policy too.
    ///
    /// See the [builder docs](Self) for an example.
    pub fn drift_policy(mut self, policy: DriftPolicy) -> Self {
        self.drift = policy;
        self
    }

    /// The fields of the arguments that say what the operation **is** (the order, the
    /// amount, the recipient), which are never discarded: the same setting as the client
    /// face's [`defining_fields`](crate::client::Builder::defining_fields). None are
    /// declared by default: all the arguments are judged by the
    /// [drift policy](Self::drift_policy), so under the default
    /// [`ResendFrozen`](DriftPolicy::ResendFrozen) a step identity reused for another order
    /// is answered with the first order's outcome, as a reworded `summary` is.
    ///
    /// Declared, they decide, whatever the policy: a call with a changed defining field is
    /// refused with a drift error, the tool not called, under `ResendFrozen` too; a call
    /// differing only elsewhere (a reworded `summary`, a fresh `fulfillment_intent_id`) is
    /// the same operation, even under [`Reject`](DriftPolicy::Reject): it goes on with the
    /// frozen arguments and its output names what was discarded
    /// ([`ToolOutput::discarded`](super::ToolOutput::discarded); the names come from the
    /// record, so a store that keeps no field digests of completed records reports the
    /// discard without them). The tool is always called with the frozen arguments, whole:
    /// the selection decides what counts as the same operation, never what the tool
    /// receives.
    ///
    /// See the [builder docs](Self) for an example.
    pub fn defining_fields(mut self, fields: PayloadFields) -> Self {
        self.fields = Some(fields);
        self
    }
}

/// The ledger: how long it holds an operation and what a duplicate does meanwhile.
impl<C> Builder<C> {
    /// How long an owner may hold an operation without renewing it (default 10 s; live
    /// owners renew every third of it, or have it held by a store that
    /// [holds leases](crate::ledger::IdempotencyStore::hold_lease), such as `MemoryStore`).
    ///
    /// See the [builder docs](Self) for an example.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.operation.lease = lease;
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
        self.operation.retention = retention;
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
        self.operation.protected = Some(window);
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
        self.operation.busy = policy;
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
        self.operation.response_limit = limit;
        self
    }
}

/// Attempts: how the tool is retried and what its errors mean.
impl<C> Builder<C> {
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
        self.operation.retry = policy;
        self
    }

    /// Classify the tool's errors by phase (see [`Verdict`](super::Verdict)).
    ///
    /// See [`ClassifyToolError`](super::ClassifyToolError) for an example.
    pub fn classify<C2>(self, classifier: C2) -> Builder<C2> {
        Builder {
            operation: self.operation,
            name: self.name,
            provider: self.provider,
            scope: self.scope,
            class: self.class,
            drift: self.drift,
            fields: self.fields,
            classifier,
            on_outcome: self.on_outcome,
        }
    }
}

/// What the application hears of each call.
impl<C> Builder<C> {
    /// Call `hook` once per side-effecting call, when its answer is known, with what it
    /// came to: the face ([`Face::Tool`](crate::idempotency::Face::Tool)), the decision,
    /// the key's digest, how long it took and the [safety signals](crate::idempotency::Signal)
    /// raised (arguments discarded for the ones first frozen). See
    /// [`OutcomeEvent`]; its [`status`](OutcomeEvent::status) is `None` on this face.
    ///
    /// For observability of your own: a signal's `WARN` event in `tracing` reaches only a
    /// subscriber, the hook reaches your code. Unset, it costs nothing. It runs on the
    /// caller's task: keep it short and never block in it.
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use tower::{service_fn, Layer, ServiceExt};
    /// use tower_idempotency::idempotency::{Decision, Signal};
    /// use tower_idempotency::tool::{ProviderKeys, ToolCall, ToolLayer};
    /// use tower_idempotency::{ledger::MemoryStore, OperationId};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let seen = Arc::new(Mutex::new(Vec::new()));
    /// let layer = ToolLayer::builder(MemoryStore::new(), "send_email", ProviderKeys::Ignored)
    ///     .on_outcome({
    ///         let seen = seen.clone();
    ///         move |event| seen.lock().unwrap().push((event.decision(), event.signals().collect::<Vec<_>>()))
    ///     })
    ///     .build()
    ///     .unwrap();
    /// let tool = layer.layer(service_fn(|call: ToolCall<serde_json::Value>| async move {
    ///     Ok::<_, std::io::Error>(call.into_arguments()["to"].clone())
    /// }));
    /// let op = OperationId::new("task-9", "notify");
    /// let first = ToolCall::new(op.clone(), serde_json::json!({"to": "a@example.com"}));
    /// tool.clone().oneshot(first).await.unwrap();
    /// let regenerated = ToolCall::new(op, serde_json::json!({"to": "b@example.com"}));
    /// tool.oneshot(regenerated).await.unwrap();
    ///
    /// let seen = seen.lock().unwrap();
    /// assert_eq!(seen[0], (Decision::Acquired, vec![]));
    /// assert_eq!(seen[1], (Decision::Replayed, vec![Signal::PayloadDiscarded]));
    /// # }
    /// ```
    pub fn on_outcome(mut self, hook: impl Fn(&OutcomeEvent<'_>) + Send + Sync + 'static) -> Self {
        self.on_outcome = Some(OutcomeHook::new(hook));
        self
    }
}

/// Operations in doubt: who is asked before one is called again.
impl<C> Builder<C> {
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
        self.operation.reconciler = Some(Arc::new(reconciler));
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
        self.operation.reconcile_timeout = bound;
        self
    }
}

/// Building.
impl<C> Builder<C> {
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
        let ledger = self.operation.ledger()?;
        let target = format!("/tools/{}", self.name);
        let uri = target
            .parse()
            .map_err(|_| ConfigError::new("the tool name does not make a URI path"))?;
        let face = ToolFace {
            ledger,
            scope: self.scope,
            target,
            uri,
            class: self.class,
            provider: self.provider,
            drift: self.drift,
            fields: self.fields,
            busy: self.operation.busy,
            response_limit: self.operation.response_limit,
            reconciler: self.operation.reconciler,
            reconcile_timeout: self.operation.reconcile_timeout,
            retry: Arc::new(self.operation.retry),
            classifier: self.classifier,
            on_outcome: self.on_outcome,
        };
        Ok(ToolLayer {
            face: Arc::new(face),
        })
    }
}

impl ToolLayer {
    /// Configure a layer for the tool `name` over `store`, stating whether its provider
    /// deduplicates on the key (see [`ProviderKeys`]).
    ///
    /// See [`Builder`] for the settings and an example.
    pub fn builder(
        store: impl IdempotencyStore,
        name: impl Into<String>,
        provider: ProviderKeys,
    ) -> Builder {
        Builder::new(Arc::new(store), name.into(), provider)
    }
}
