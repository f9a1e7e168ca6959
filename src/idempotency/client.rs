//! The client face: once per logical operation, before the side effect fires.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::Entry;
use http::{Extensions, Request, Response};
use http_body::Body;
use http_body_util::Full;
use pin_project_lite::pin_project;
use tower::ServiceExt;
use tower_service::Service;

use super::body::ResponseBody;
use super::decision::{
    request_span, Decision, OutcomeEvent, OutcomeHook, RequestSpan, Track, WireKey,
};
use super::engine::{BusyPolicy, LeaseGuard, Ledger, DEFAULT_LEASE, DEFAULT_RETENTION};
use super::reconcile::{self, InDoubtOperation, Reconcile, Reconciled, DEFAULT_RECONCILE_TIMEOUT};
use super::release::ReleaseOn;
use super::scope::Scope;
use super::{Idempotency, IdempotencyLayer, ResponseSource};
use crate::error::{ConfigError, Drift};
use crate::fingerprint::{PayloadFields, RequestPart};
use crate::frozen::{FrozenRequest, Handoff, RetriedOutside, DEFAULT_BODY_LIMIT};
use crate::key::{HeaderKey, OperationId, IDEMPOTENCY_KEY};
use crate::ledger::{
    Begin, HeaderBlock, IdempotencyStore, LeaseToken, LedgerKey, Outcome, StoredResponse,
};
use crate::phase::{classify, ClassifyPhase, FailurePhase};
use crate::retry::{RetryPolicy, DEFAULT_MAX_ELAPSED};
use crate::{BoxError, Error};

mod operation;

use operation::{Exchange, Operation};

/// The default cap on a recorded response: 1 MiB.
pub const DEFAULT_RESPONSE_LIMIT: usize = 1024 * 1024;

/// What to do when an operation comes back with a different payload (*drift*).
///
/// The default depends on who named the operation (see
/// [`ClientBuilder::drift_policy`]): [`ResendFrozen`](Self::ResendFrozen) for an
/// [`OperationId`](crate::OperationId), [`Reject`](Self::Reject) for a caller's own
/// `Idempotency-Key`.
///
/// ```
/// use tower_idempotency::{ledger::MemoryStore, DriftPolicy, IdempotencyLayer};
///
/// // Refuse regenerated payloads even under an `OperationId`.
/// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
///     .drift_policy(DriftPolicy::Reject)
///     .build()
///     .unwrap();
/// # let _ = layer;
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DriftPolicy {
    /// Refuse with a [drift error](crate::Error::is_drift) naming the changed JSON fields;
    /// nothing is sent. The operation stays as it was: only a run with the first payload
    /// finishes it.
    Reject,
    /// Continue the operation with the bytes first frozen, never the new ones: resend them
    /// if in doubt, replay the outcome if completed. The response carries a
    /// [`PayloadDiscarded`] naming what the discarded payload changed.
    ResendFrozen,
}

/// A response extension: the request handed in was **not** sent, because its operation
/// was first sent with another payload, and this response is that operation's (resent from
/// the bytes first frozen, or replayed). Set whenever a drift was resolved without a
/// refusal: under [`DriftPolicy::ResendFrozen`] (the default for an
/// [`OperationId`](crate::OperationId)), or when only fields outside the
/// [defining fields](ClientBuilder::defining_fields) changed.
///
/// ```
/// use bytes::Bytes;
/// use http::Request;
/// use http_body_util::Full;
/// use tower::{ServiceBuilder, ServiceExt};
/// use tower_idempotency::testing::SideEffectService;
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer, OperationId, PayloadDiscarded};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_idempotency::Error> {
/// let provider = SideEffectService::new();
/// let client = ServiceBuilder::new()
///     .layer(IdempotencyLayer::client(MemoryStore::new()))
///     .service(provider.clone());
/// let charge = |summary: &str| {
///     let body = format!(r#"{{"order_id":"order_42","amount_cents":1999,"summary":"{summary}"}}"#);
///     let mut req = Request::post("http://payments.local/charges").body(Full::new(Bytes::from(body))).unwrap();
///     req.extensions_mut().insert(OperationId::new("task-7", "charge_customer"));
///     req
/// };
///
/// client.clone().oneshot(charge("Order 42")).await?;
/// // The orchestrator re-ran the step and the model reworded the call.
/// let again = client.clone().oneshot(charge("Charge for order 42")).await?;
/// let discarded = again.extensions().get::<PayloadDiscarded>().expect("told");
/// assert_eq!(discarded.changed_fields(), Some(&["summary".to_owned()][..]));
/// assert_eq!(provider.effects(), 1);
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PayloadDiscarded {
    drift: Drift,
}

impl PayloadDiscarded {
    /// How the discarded request differed from the one first sent.
    pub fn drift(&self) -> &Drift {
        &self.drift
    }

    /// The top-level JSON fields the discarded payload changed, sorted; `None` when
    /// either payload is not a JSON object (see [`Drift::changed_fields`]).
    pub fn changed_fields(&self) -> Option<&[String]> {
        self.drift.changed_fields()
    }
}

/// The client face's configuration (see [`ClientBuilder`]).
#[derive(Debug)]
pub struct ClientFace {
    ledger: Ledger,
    scope: String,
    caller_keys: Scope,
    require_key: bool,
    release_on: ReleaseOn,
    /// Unset: per who named the operation (see `drift_policy_for`).
    drift: Option<DriftPolicy>,
    defining_fields: Option<PayloadFields>,
    busy: BusyPolicy,
    body_limit: usize,
    response_limit: usize,
    fail_open: bool,
    provider_deduplicates: bool,
    phase_classifier: Option<Arc<dyn ClassifyPhase>>,
    reconciler: Option<Arc<dyn Reconcile>>,
    reconcile_timeout: Duration,
    reconcile_when_deduplicating: bool,
    /// The retry window the builder checked the TTLs against.
    retry_window: Duration,
    /// Whether the mismatch with the real retry policy was already reported.
    warned_window: std::sync::atomic::AtomicBool,
    /// Whether an unprotected side effect was already reported.
    warned_unprotected: std::sync::atomic::AtomicBool,
    /// Whether a retry layer outside this one was already reported.
    warned_order: std::sync::atomic::AtomicBool,
    on_outcome: Option<OutcomeHook>,
}

impl fmt::Debug for dyn ClassifyPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ClassifyPhase")
    }
}

/// Configures the client [`IdempotencyLayer`]; [`build`](ClientBuilder::build) checks the
/// TTLs against the retry window.
///
/// | setting | default |
/// |---|---|
/// | scope (mixed into every key) | `""` |
/// | [key required](ClientBuilder::require_key) on side effects | yes: a side effect without an `OperationId` or key fails, nothing sent |
/// | lease (renewed by a live owner) | 10 s |
/// | retention | 24 h |
/// | retry window checked against | 30 s (the default retry policy's); see [`retry_policy`](ClientBuilder::retry_policy) |
/// | protected window (never evicted) | retry window + lease |
/// | busy operation | wait up to 30 s, then a busy error |
/// | [answers released](ClientBuilder::release_on), not recorded | `401`, `407`, `408`, `429`, the server face's refusals that say nothing ran |
/// | [payload drift](ClientBuilder::drift_policy) | under an `OperationId`: continue with the bytes first frozen, marked [`PayloadDiscarded`]; under a caller's own key: refused |
/// | [defining fields](ClientBuilder::defining_fields) | the whole request |
/// | request body limit | 1 MiB |
/// | recorded response cap | 1 MiB (larger: returned whole, kept as a tombstone) |
/// | ledger unavailable | fail closed (nothing is sent) |
/// | provider deduplicates on `Idempotency-Key` | yes: in-doubt operations are resent |
/// | [reconciler](ClientBuilder::reconcile) of in-doubt operations | none (asked within 10 s when set) |
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{ledger::MemoryStore, DriftPolicy, IdempotencyLayer};
///
/// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
///     .scope("billing-agent")
///     .require_key(true)
///     .drift_policy(DriftPolicy::ResendFrozen)
///     .lease(Duration::from_secs(120))
///     .build()
///     .unwrap();
/// # let _ = layer;
/// ```
#[derive(Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct ClientBuilder {
    store: Arc<dyn IdempotencyStore>,
    scope: String,
    caller_keys: Scope,
    require_key: bool,
    release_on: ReleaseOn,
    lease: Duration,
    retention: Duration,
    retry_window: Duration,
    protected: Option<Duration>,
    drift: Option<DriftPolicy>,
    defining_fields: Option<PayloadFields>,
    busy: BusyPolicy,
    body_limit: usize,
    response_limit: usize,
    fail_open: bool,
    provider_deduplicates: bool,
    phase_classifier: Option<Arc<dyn ClassifyPhase>>,
    reconciler: Option<Arc<dyn Reconcile>>,
    reconcile_timeout: Duration,
    reconcile_when_deduplicating: bool,
    on_outcome: Option<OutcomeHook>,
}

impl ClientBuilder {
    pub(crate) fn new(store: Arc<dyn IdempotencyStore>) -> Self {
        Self {
            store,
            scope: String::new(),
            caller_keys: Scope::Authorization,
            require_key: true,
            release_on: ReleaseOn::default(),
            lease: DEFAULT_LEASE,
            retention: DEFAULT_RETENTION,
            retry_window: DEFAULT_MAX_ELAPSED,
            protected: None,
            drift: None,
            defining_fields: None,
            busy: BusyPolicy::Wait(Duration::from_secs(30)),
            body_limit: DEFAULT_BODY_LIMIT,
            response_limit: DEFAULT_RESPONSE_LIMIT,
            fail_open: false,
            provider_deduplicates: true,
            phase_classifier: None,
            reconciler: None,
            reconcile_timeout: DEFAULT_RECONCILE_TIMEOUT,
            reconcile_when_deduplicating: false,
            on_outcome: None,
        }
    }

    /// Mixed into every key, so two orchestrators (or environments) sharing a ledger never
    /// collide on equal task ids.
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = scope.into();
        self
    }

    /// Who owns a caller's own `Idempotency-Key`: a function of the request head giving the
    /// principal it is sent for. A key the caller chose (rather than one derived from an
    /// [`OperationId`](crate::OperationId)) is only unique within that principal's
    /// namespace — two merchants may both send `order-1001-charge` — so its record is kept
    /// under the principal, and one principal's record never answers another's request.
    ///
    /// **Without a scope function**, the principal is a hash of the `Authorization` header
    /// the key travels with (as providers scope keys by API key, and as the server face
    /// does), and a request carrying its own key but **no** `Authorization` fails with a
    /// [missing-scope error](crate::Error::is_missing_scope) before anything is sent. Set a
    /// function when your credentials travel otherwise (an `X-Api-Key` header, mTLS) or
    /// rotate between an operation's attempts; it is trusted, `""` included.
    ///
    /// Keys derived from an `OperationId` are not scoped by credential: the orchestrator
    /// names the operation, and a token refreshed between a call and its resume must not
    /// turn it into a second operation. Keep tenants apart there with [`scope`](Self::scope)
    /// (one layer per tenant) or tenant-unique task ids.
    ///
    /// ```
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .caller_key_scope(|parts| {
    ///         parts.headers.get("x-api-key").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned()
    ///     })
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    /// ```
    pub fn caller_key_scope<F>(mut self, scope: F) -> Self
    where
        F: Fn(&http::request::Parts) -> String + Send + Sync + 'static,
    {
        self.caller_keys = Scope::Custom(Arc::new(scope));
        self
    }

    /// One namespace for every caller's own keys, whatever credential they travel with:
    /// a request sent under one credential can be answered with the record of a request
    /// sent under another with the same key, target and payload. Choose it only when every
    /// request through this layer acts for one principal.
    ///
    /// ```
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .caller_keys_unscoped()
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    /// ```
    pub fn caller_keys_unscoped(mut self) -> Self {
        self.caller_keys = Scope::Unscoped;
        self
    }

    /// Refuse side-effecting requests that carry neither an
    /// [`OperationId`](crate::OperationId) nor an `Idempotency-Key`: a
    /// [missing-key error](crate::Error::is_missing_key) naming the missing `OperationId`,
    /// and nothing is sent. **On by default** (fail closed, as the server face does): a
    /// side effect whose `OperationId` was forgotten would otherwise pass through
    /// unprotected, and a retry outside this layer would run it twice.
    ///
    /// With `false`, such requests pass through untouched, marked
    /// [`ResponseSource::Unprotected`](crate::idempotency::ResponseSource::Unprotected) and
    /// reported once as a warning. To let one request through without turning the check
    /// off, declare what it is: an [`EffectClass`](crate::EffectClass) other than
    /// `SideEffect` in its extensions (a `POST` that only reads, say).
    ///
    /// ```
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// // Opt out: keyless side effects pass through, unprotected.
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .require_key(false)
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    /// ```
    pub fn require_key(mut self, require: bool) -> Self {
        self.require_key = require;
        self
    }

    /// How long an owner may hold an operation in flight without renewing it (default
    /// 10 s). A live owner renews its lease every third of it while an attempt is under way,
    /// so the lease never has to cover a slow call: it is how soon after an owner **died**
    /// (a crashed orchestrator) the next run of the operation may resume it.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long records are kept (default 24 h). Must outlast the retry window plus the
    /// lease, and should outlast your longest crash-and-resume gap. "Keep forever"
    /// (`Duration::MAX`) is accepted and held as about 139 years, as is any duration of the
    /// ledger longer than that (lease, protected window, busy wait).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// The longest retry window of the stack inside (default 30 s, the default
    /// [`RetryPolicy`]'s); prefer [`retry_policy`](Self::retry_policy), which reads it off
    /// the policy you stack. The builder checks the retention against it, and it sets the
    /// default protected window.
    pub fn retry_window(mut self, window: Duration) -> Self {
        self.retry_window = window;
        self
    }

    /// Take the retry window from the policy of the
    /// [`FrozenRetryLayer`](crate::FrozenRetryLayer) stacked inside: its maximum elapsed
    /// time plus one per-attempt timeout (the last attempt may start at the deadline).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{ledger::MemoryStore, retry::RetryPolicy, IdempotencyLayer};
    ///
    /// let policy = RetryPolicy::builder().max_elapsed(Duration::from_secs(90)).build().unwrap();
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .retry_policy(&policy)
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    /// ```
    pub fn retry_policy(mut self, policy: &RetryPolicy) -> Self {
        self.retry_window = policy.retry_window();
        self
    }

    /// How long after its last transition a record is never evicted from a store with a
    /// memory budget (default: the retry window plus the lease, at least). Inside it, a
    /// full store refuses new operations rather than forget this one; past it, the record
    /// may be evicted before its retention ends. Clamped to the retention.
    pub fn protected_window(mut self, window: Duration) -> Self {
        self.protected = Some(window);
        self
    }

    /// Which answers say the operation never started (default [`ReleaseOn::default`]:
    /// `401`, `407`, `408`, `429`, and this crate's server-face refusals that say nothing
    /// ran). Such an answer reaches the caller, but the operation is **released** rather
    /// than recorded, so the next run sends it again — after the token was refreshed, the
    /// rate limit waited out, the credentials fixed — instead of being answered with the
    /// refusal for the whole retention. An operation an earlier attempt may have sent is
    /// never released: it stays in doubt. [`ReleaseOn::nothing`] records every answer.
    ///
    /// ```
    /// use http::StatusCode;
    /// use tower_idempotency::idempotency::ReleaseOn;
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .release_on(ReleaseOn::default().status(StatusCode::FORBIDDEN))
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    /// ```
    pub fn release_on(mut self, rule: ReleaseOn) -> Self {
        self.release_on = rule;
        self
    }

    /// What to do with a regenerated payload under a known operation, for every request
    /// (see [`DriftPolicy`]).
    ///
    /// Unset, it depends on who named the operation. Under an
    /// [`OperationId`](crate::OperationId) — the orchestrator's step, which a re-run agent
    /// regenerates — a regenerated **body** is resent as first frozen
    /// ([`DriftPolicy::ResendFrozen`]): the step finishes and the response says what was
    /// discarded ([`PayloadDiscarded`]); a changed method or target is still refused (an
    /// operation is never answered with another target's outcome). Under a
    /// caller's own `Idempotency-Key`, [`DriftPolicy::Reject`]: a key reused for another
    /// payload is a caller's mistake, as providers (and the server face's `422`) treat it.
    ///
    /// ```
    /// use tower_idempotency::{ledger::MemoryStore, DriftPolicy, IdempotencyLayer};
    ///
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .drift_policy(DriftPolicy::Reject)
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    /// ```
    pub fn drift_policy(mut self, policy: DriftPolicy) -> Self {
        self.drift = Some(policy);
        self
    }

    /// Judge drift on these fields of a JSON payload alone (default: the whole request).
    /// A regenerated payload that changed only other fields — a reworded `summary`, a
    /// freshly minted `fulfillment_intent_id` — is the same operation, whatever the
    /// [drift policy](Self::drift_policy): it continues with the bytes first frozen, marked
    /// [`PayloadDiscarded`]. A change to a defining field, or to the method or target, is
    /// drift as before. In the spirit of AWS Powertools' payload validation.
    ///
    /// The bytes sent are still the ones first frozen, whole: the selection decides what
    /// counts as the same operation, never what is sent.
    ///
    /// ```
    /// use tower_idempotency::fingerprint::PayloadFields;
    /// use tower_idempotency::{ledger::MemoryStore, DriftPolicy, IdempotencyLayer};
    ///
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .drift_policy(DriftPolicy::Reject) // a changed amount is refused…
    ///     .defining_fields(PayloadFields::new(["/order_id", "/amount_cents"]).unwrap()) // …a reworded summary is not
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    /// ```
    pub fn defining_fields(mut self, fields: PayloadFields) -> Self {
        self.defining_fields = Some(fields);
        self
    }

    /// See [`BusyPolicy`].
    pub fn busy_policy(mut self, policy: BusyPolicy) -> Self {
        self.busy = policy;
        self
    }

    /// The largest request body (default 1 MiB); larger ones fail before anything is sent.
    pub fn body_limit(mut self, limit: usize) -> Self {
        self.body_limit = limit;
        self
    }

    /// The largest response recorded for replay (default 1 MiB). A larger response still
    /// reaches the caller whole; the ledger keeps a tombstone.
    pub fn response_limit(mut self, limit: usize) -> Self {
        self.response_limit = limit;
        self
    }

    /// When the ledger is unavailable, send anyway (without protection) instead of failing.
    /// Off by default; turning it on trades exactly-once for availability.
    pub fn fail_open(mut self, fail_open: bool) -> Self {
        self.fail_open = fail_open;
        self
    }

    /// Whether the server deduplicates on `Idempotency-Key` (default `true`, as payment
    /// providers do).
    ///
    /// Resending an operation whose first attempt may have arrived is only safe when the
    /// server recognises the key. Set this to `false` for a server that ignores keys: the
    /// layer then never resends once bytes may have left — the retry layer inside stops
    /// treating the key as making the request retry-safe, and an operation found in doubt
    /// is not sent again: with a [reconciler](Self::reconcile) the layer asks it whether the
    /// operation happened (and records its answer, or sends the frozen bytes it says never
    /// arrived); without one, it fails with an [in-doubt error](crate::Error::is_in_doubt)
    /// for you to reconcile. At most once, rather than exactly once, unless reconciled.
    pub fn provider_deduplicates(mut self, deduplicates: bool) -> Self {
        self.provider_deduplicates = deduplicates;
        self
    }

    /// Ask `reconciler` whether an in-doubt operation happened before it would be sent
    /// again: always when the provider does not deduplicate
    /// ([`provider_deduplicates(false)`](Self::provider_deduplicates)), and also when it does
    /// if [`reconcile_when_deduplicating`](Self::reconcile_when_deduplicating) is on. See
    /// [`Reconcile`] and [`LookupReconciler`](crate::idempotency::LookupReconciler).
    ///
    /// ```
    /// use tower_idempotency::idempotency::LookupReconciler;
    /// use tower_idempotency::testing::SideEffectService;
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// let provider = SideEffectService::builder().honour_keys(false).build();
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .provider_deduplicates(false)
    ///     .reconcile(LookupReconciler::by_key(provider, "/effects", "idempotency_key"))
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    /// ```
    pub fn reconcile(mut self, reconciler: impl Reconcile) -> Self {
        self.reconciler = Some(Arc::new(reconciler));
        self
    }

    /// How long the reconciler may take (default [`DEFAULT_RECONCILE_TIMEOUT`], 10 s); past
    /// it, the operation stays in doubt.
    pub fn reconcile_timeout(mut self, bound: Duration) -> Self {
        self.reconcile_timeout = bound;
        self
    }

    /// Reconcile in-doubt operations before resending them to a provider that deduplicates
    /// too (default `false`: it recognises the key, so the frozen bytes are resent at once).
    /// Turn it on when the provider forgets keys sooner than your operations may stay in
    /// doubt (a key kept 24 h, an orchestrator resuming after days): an
    /// [`Unknown`](crate::idempotency::Reconciled::Unknown) then leaves the operation in
    /// doubt rather than risk a resend the provider no longer recognises.
    pub fn reconcile_when_deduplicating(mut self, reconcile: bool) -> Self {
        self.reconcile_when_deduplicating = reconcile;
        self
    }

    /// Teach the layer which of your transport's errors are pre-write failures.
    pub fn classify_phase(mut self, classifier: impl ClassifyPhase) -> Self {
        self.phase_classifier = Some(Arc::new(classifier));
        self
    }

    /// Call `hook` once per request that reached the ledger, when its answer is known,
    /// with what it came to: the face, the last decision, the key's digest, the status
    /// (when there was a response) and how long it took. See [`OutcomeEvent`].
    ///
    /// For observability of your own (another metrics system, an audit log). Unset, it
    /// costs nothing: no clock is read and no digest is computed. The hook runs on the
    /// request's task, inside its span: keep it short and never block in it.
    ///
    /// ```
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .on_outcome(|event| eprintln!("{} {}", event.decision().as_str(), event.key_digest()))
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    /// ```
    pub fn on_outcome(mut self, hook: impl Fn(&OutcomeEvent<'_>) + Send + Sync + 'static) -> Self {
        self.on_outcome = Some(OutcomeHook::new(hook));
        self
    }

    /// The same, sharing a classifier with the retry layer.
    pub(crate) fn shared_phase_classifier(mut self, classifier: Arc<dyn ClassifyPhase>) -> Self {
        self.phase_classifier = Some(classifier);
        self
    }

    /// Check the settings and build the layer.
    ///
    /// Refuses a zero lease, a retention shorter than the retry window plus the lease (a
    /// record would vanish while its operation can still retry) and a protected window
    /// shorter than that (a full store could evict an operation still being retried).
    pub fn build(self) -> Result<IdempotencyLayer<ClientFace>, ConfigError> {
        // Saturating: durations are unbounded here and saturate when the ledger takes them.
        let must_keep = self.retry_window.saturating_add(self.lease);
        if self.lease.is_zero() {
            return Err(ConfigError::new("the lease must be longer than zero"));
        }
        if self.retention < must_keep {
            return Err(ConfigError::new(format!(
                "the retention ({:?}) must be at least the retry window plus the lease ({:?})",
                self.retention, must_keep
            )));
        }
        if self.reconcile_when_deduplicating && self.reconciler.is_none() {
            return Err(ConfigError::new(
                "reconcile_when_deduplicating needs a reconciler (see `reconcile`)",
            ));
        }
        if self.reconciler.is_some() && self.reconcile_timeout.is_zero() {
            return Err(ConfigError::new(
                "the reconcile timeout must be longer than zero",
            ));
        }
        let protected = self.protected.unwrap_or(must_keep);
        if protected < must_keep {
            return Err(ConfigError::new(format!(
                "the protected window ({protected:?}) must be at least the retry window plus the lease ({must_keep:?})"
            )));
        }
        let client = ClientFace {
            ledger: Ledger::new(self.store, self.lease, self.retention, protected),
            scope: self.scope,
            caller_keys: self.caller_keys,
            require_key: self.require_key,
            release_on: self.release_on,
            drift: self.drift,
            defining_fields: self.defining_fields,
            busy: self.busy,
            body_limit: self.body_limit,
            response_limit: self.response_limit,
            fail_open: self.fail_open,
            provider_deduplicates: self.provider_deduplicates,
            phase_classifier: self.phase_classifier,
            reconciler: self.reconciler,
            reconcile_timeout: self.reconcile_timeout,
            reconcile_when_deduplicating: self.reconcile_when_deduplicating,
            retry_window: self.retry_window,
            warned_window: std::sync::atomic::AtomicBool::new(false),
            warned_unprotected: std::sync::atomic::AtomicBool::new(false),
            warned_order: std::sync::atomic::AtomicBool::new(false),
            on_outcome: self.on_outcome,
        };
        Ok(IdempotencyLayer::from_face(client))
    }
}

impl IdempotencyLayer<ClientFace> {
    /// The client layer with default settings over `store`.
    ///
    /// See the [module docs](crate::idempotency) for the stack it belongs in.
    pub fn client(store: impl IdempotencyStore) -> Self {
        Self::client_builder(store)
            .build()
            .expect("the default client settings are valid")
    }

    /// Configure the client layer over `store`.
    pub fn client_builder(store: impl IdempotencyStore) -> ClientBuilder {
        ClientBuilder::new(Arc::new(store))
    }

    /// An operator's handle on this layer's ledger: look at the record of an
    /// [`OperationId`](crate::OperationId) as this layer keys it (its scope included) and
    /// forget it, fenced. See [`Records`](crate::ledger::Records).
    ///
    /// ```
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer, OperationId};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new()).scope("agent").build().unwrap();
    /// let records = layer.records();
    /// let key = records.operation_key(&OperationId::new("task-7", "charge"));
    /// assert!(records.inspect(key).await?.is_none());
    /// # Ok(())
    /// # }
    /// ```
    pub fn records(&self) -> crate::ledger::Records {
        let face = self.face();
        crate::ledger::Records::client(face.ledger.store.clone(), face.scope.clone())
    }
}

impl<S, B, ResBody> Service<Request<B>> for Idempotency<S, ClientFace>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = Error;
    type Future = ClientFuture<S, B, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner
            .poll_ready(cx)
            .map_err(|err| into_error(err.into(), FailurePhase::PreWrite))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let span = request_span!(face = "client", key = tracing::field::Empty);
        let started = self
            .face
            .on_outcome
            .is_some()
            .then(tokio::time::Instant::now);
        let operation = {
            let _entered = span.enter();
            Operation::new(inner, self.face.clone(), req, started)
        };
        ClientFuture { operation, span }
    }
}

pin_project! {
    /// The future of the client [`IdempotencyLayer`]: one logical operation, held in
    /// place (not boxed), inside its span.
    pub struct ClientFuture<S, B, ResB>
    where
        S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
    {
        #[pin]
        operation: Operation<'static, S, B, ResB>,
        span: RequestSpan,
    }
}

impl<S, B, ResB> Future for ClientFuture<S, B, ResB>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Unpin + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Output = Result<Response<ResponseBody<ResB>>, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let _entered = this.span.enter();
        this.operation.poll(cx)
    }
}

impl<S, B, ResB> fmt::Debug for ClientFuture<S, B, ResB>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientFuture").finish_non_exhaustive()
    }
}

impl ClientFace {
    /// Whether a drift from `stored` to `new` of an operation keyed `wire` continues with
    /// the bytes first frozen: as the [policy](ClientBuilder::drift_policy) says when set;
    /// else for a regenerated body under an `OperationId` (its method and target unchanged:
    /// an operation sent elsewhere is refused, never answered with another target's
    /// outcome), and never under a caller's own key.
    fn resends_frozen_on_drift(
        &self,
        wire: Option<&WireKey>,
        stored: crate::Fingerprint,
        new: crate::Fingerprint,
    ) -> bool {
        match (self.drift, wire) {
            (Some(policy), _) => policy == DriftPolicy::ResendFrozen,
            (None, Some(WireKey::Derived(_))) => only_the_body_differs(stored, new),
            (None, _) => false,
        }
    }

    /// Whether `new` is the operation first sent as `original` (fingerprinted `stored`)
    /// once judged on the defining fields: only the body differs, both bodies are JSON, and
    /// no defining field changed.
    fn same_operation(
        &self,
        stored: crate::Fingerprint,
        original: &FrozenRequest,
        new: &FrozenRequest,
    ) -> bool {
        let Some(fields) = &self.defining_fields else {
            return false;
        };
        if !only_the_body_differs(stored, new.fingerprint()) {
            return false;
        }
        let parse = |body: &[u8]| serde_json::from_slice::<serde_json::Value>(body).ok();
        match (parse(original.body()), parse(new.body())) {
            (Some(old), Some(new)) => fields.changed(&old, &new).is_empty(),
            _ => false,
        }
    }

    /// [`same_operation`](Self::same_operation) when the store kept only digests of the
    /// first body's top-level members: the same unless a changed member holds a defining
    /// field (a member the digests cannot see into counts as changed).
    fn same_operation_by_members(
        &self,
        stored: crate::Fingerprint,
        new: &FrozenRequest,
        changed: Option<&[String]>,
    ) -> bool {
        match (&self.defining_fields, changed) {
            (Some(fields), Some(changed)) => {
                only_the_body_differs(stored, new.fingerprint())
                    && !changed.iter().any(|member| fields.covers_member(member))
            }
            _ => false,
        }
    }

    /// Whether an `on_outcome` hook wants to hear of each operation (and its duration).
    #[cfg_attr(not(feature = "reqwest-middleware"), allow(dead_code))]
    pub(crate) fn on_outcome_set(&self) -> bool {
        self.on_outcome.is_some()
    }

    /// A side effect without an `OperationId` or a key passed through, unprotected: the retry
    /// layer inside will not resend it once it may have left, but a caller's own retry runs
    /// it again. Visible in every response (`ResponseSource::Unprotected`) and a `DEBUG`
    /// event, and once as a warning.
    fn report_unprotected(&self, frozen: &FrozenRequest) {
        use std::sync::atomic::Ordering::Relaxed;
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
    /// attempts would then consult the ledger on its own, so a retry after a lost answer is
    /// a replay at best and a busy error at worst. Said once, naming the fix.
    fn check_layer_order(&self, extensions: &Extensions) {
        use std::sync::atomic::Ordering::Relaxed;
        if extensions.get::<RetriedOutside>().is_some() && !self.warned_order.swap(true, Relaxed) {
            tracing::warn!(
                "FrozenRetryLayer is outside IdempotencyLayer: put the idempotency layer \
                 outside (first in ServiceBuilder), or build both with \
                 IdempotencyLayer::client_stack"
            );
        }
    }

    /// The builder checked the TTLs against `retry_window`; the retry layer inside reports
    /// its real one. A longer real window can outlive the protected window or the retention
    /// (a record could be evicted or expire while its operation still retries): say so,
    /// once, naming the fix.
    fn check_real_retry_window(&self, handoff: &Handoff) {
        use std::sync::atomic::Ordering::Relaxed;
        let Some(real) = handoff.retry_window() else {
            return;
        };
        if real <= self.retry_window || self.warned_window.swap(true, Relaxed) {
            return;
        }
        tracing::warn!(
            configured = ?self.retry_window,
            real = ?real,
            "the retry policy inside retries longer than the idempotency layer was told: \
             build the layer with `.retry_policy(&policy)` so its protected window and \
             retention cover the real retry window"
        );
    }
}

/// Whether two fingerprints differ in the body alone: the same method and target.
fn only_the_body_differs(stored: crate::Fingerprint, new: crate::Fingerprint) -> bool {
    stored
        .differing_parts(&new)
        .all(|part| part == RequestPart::Body)
}

/// Tell the caller its payload was discarded, on the response of the operation it joined.
fn marked_discarded<T>(
    answer: Result<Response<T>, Error>,
    discarded: Option<Drift>,
) -> Result<Response<T>, Error> {
    match (answer, discarded) {
        (Ok(mut response), Some(drift)) => {
            response.extensions_mut().insert(PayloadDiscarded { drift });
            Ok(response)
        }
        (answer, _) => answer,
    }
}

/// Keep our own errors as they are; wrap anything else with its phase.
fn into_error(error: BoxError, phase: FailurePhase) -> Error {
    match error.downcast::<Error>() {
        Ok(ours) => *ours,
        Err(other) => Error::inner(other, phase),
    }
}

/// Which ledger record a request belongs to, setting the header a derived key travels in.
///
/// A caller's own `Idempotency-Key` names an operation **at its target**: the same key sent
/// to two hosts is two operations, and one's record never answers the other. An
/// [`OperationId`] names one operation, wherever it is sent: sent to another target (or
/// with another method, path or body) it is a drift, never a replay of the first target's
/// answer, since the fingerprint covers the whole target.
fn identify(
    client: &ClientFace,
    parts: &mut http::request::Parts,
) -> Result<Option<(LedgerKey, WireKey)>, Error> {
    // An operation's key is derived before its header is looked up, so that one lookup
    // finds the key sent (which wins) or makes the derived key's place.
    let derived = parts
        .extensions
        .get::<OperationId>()
        .map(|op| op.key(&client.scope));
    let sent = match derived {
        Some(key) => match parts.headers.entry(&IDEMPOTENCY_KEY) {
            Entry::Occupied(sent) => HeaderKey::from_values(sent.iter()),
            Entry::Vacant(place) => {
                place.insert(key.header_value());
                return Ok(Some((LedgerKey::for_operation(key), WireKey::Derived(key))));
            }
        },
        None => HeaderKey::from_headers(&parts.headers),
    };
    if let Some(key) = sent.map_err(Error::from_invalid_key)? {
        // A caller's own key is the caller's principal's: kept under it, so that another
        // principal's record with the same key never answers this request.
        let principal = client
            .caller_keys
            .of(parts)
            .ok_or_else(Error::missing_scope)?;
        let uri = &parts.uri;
        let ledger_key = LedgerKey::client_header_of(
            &client.scope,
            &principal,
            uri.scheme_str().unwrap_or(""),
            uri.authority().map_or("", |a| a.as_str()),
            key.as_bytes(),
        );
        return Ok(Some((ledger_key, WireKey::Header(key))));
    }
    if client.require_key {
        return Err(Error::missing_key());
    }
    Ok(None)
}

/// One logical operation through the client face. `inner` need not be `'static` or
/// `Clone`: it is called once (the retries, if any, are its own).
#[cfg_attr(not(feature = "reqwest-middleware"), allow(dead_code))]
pub(crate) fn run<'a, S, B, ResBody>(
    inner: S,
    client: Arc<ClientFace>,
    req: Request<B>,
    started: Option<tokio::time::Instant>,
) -> Operation<'a, S, B, ResBody>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
    B: Body,
{
    Operation::new(inner, client, req, started)
}

/// The ledger's part of one keyed operation, once `begin` answered (`answered`): send,
/// resend, replay or refuse. The path of the answers the in-place one leaves (see
/// [`Operation`]).
async fn operate_after<S, ResBody>(
    inner: S,
    client: &Arc<ClientFace>,
    key: LedgerKey,
    frozen: FrozenRequest,
    extensions: Extensions,
    track: &Track,
    answered: Result<Begin, crate::ledger::StoreError>,
) -> Result<Response<ResponseBody<ResBody>>, Error>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let answer = match answered {
        Ok(answer) => answer,
        Err(err) if client.fail_open => {
            tracing::warn!(%err, "ledger unavailable; sending without protection (fail-open)");
            return pass_through(inner, client, &frozen, extensions).await;
        }
        Err(err) => {
            let decided = if err.is_full() {
                Decision::Full
            } else {
                Decision::Unavailable
            };
            track.decided(decided);
            return Err(Error::store(err));
        }
    };
    // What this operation sends if it is to be sent: the bytes first frozen, once the
    // ledger has shown them to us, never the request just handed in.
    let mut to_send = frozen.clone();
    // Set when a drift is resolved by continuing with the bytes first frozen: the caller
    // is told, on the response, what its discarded payload changed.
    let mut discarded = None;
    let answer = match answer {
        Begin::Drift {
            stored,
            frozen: Some(original),
        } if client.resends_frozen_on_drift(track.wire(), stored, frozen.fingerprint())
            || client.same_operation(stored, &original, &frozen) =>
        {
            tracing::info!(key = %key.to_hex(), "payload drift; continuing with the bytes first frozen");
            discarded = Some(Drift::between(
                stored,
                original.body(),
                frozen.fingerprint(),
                frozen.body(),
            ));
            let mut begin = client
                .ledger
                .request(key, stored)
                .with_frozen(original.clone());
            if !client.provider_deduplicates {
                begin = begin.probe();
            }
            to_send = original;
            client
                .ledger
                .begin(begin, client.busy)
                .await
                .map_err(Error::store)?
        }
        Begin::DriftFields { stored, fields } => {
            let changed = fields.changed_fields(frozen.body());
            if client.resends_frozen_on_drift(track.wire(), stored, frozen.fingerprint())
                || client.same_operation_by_members(stored, &frozen, changed.as_deref())
            {
                discarded = Some(Drift::with_fields(stored, frozen.fingerprint(), changed));
                replay_by_fingerprint(client, key, stored, fields).await?
            } else {
                Begin::DriftFields { stored, fields }
            }
        }
        other => other,
    };
    track.decided(decision_of(&answer));
    let answered = match answer {
        Begin::Acquired { token } => {
            exchange(
                inner,
                client,
                (key, track),
                token,
                &to_send,
                extensions,
                ResponseSource::Sent,
            )
            .await
        }
        Begin::InDoubt if client.reconciler.is_some() => {
            // Take the operation over (fenced, under a token of our own) before asking, so
            // two runs never reconcile it at once and the outcome is written as its owner.
            let begin = client
                .ledger
                .request(key, to_send.fingerprint())
                .with_frozen(to_send.clone());
            let taken = client
                .ledger
                .begin(begin, client.busy)
                .await
                .map_err(Error::store)?;
            match taken {
                Begin::Resume {
                    token,
                    frozen: stored,
                } => {
                    let original = stored.unwrap_or(to_send);
                    reconcile(inner, client, (key, track), token, original, extensions).await
                }
                // The record left while we looked (expired, evicted): the bytes may still
                // have reached the provider, so ask all the same.
                Begin::Acquired { token } => {
                    reconcile(inner, client, (key, track), token, to_send, extensions).await
                }
                Begin::Replay(outcome) => replay(outcome),
                Begin::Busy { retry_after } => Err(Error::busy(retry_after)),
                Begin::Drift {
                    stored,
                    frozen: original,
                } => Err(drift_error(stored, original.as_ref(), &frozen)),
                Begin::DriftFields { stored, fields } => {
                    Err(drift_fields_error(stored, &fields, &frozen))
                }
                _ => Err(Error::in_doubt()),
            }
        }
        Begin::InDoubt => {
            // The server would run it again: leave it in doubt, untouched, to reconcile.
            Err(Error::in_doubt())
        }
        Begin::Resume {
            token,
            frozen: stored,
        } if client.reconcile_when_deduplicating => {
            let original = stored.unwrap_or(to_send);
            reconcile(inner, client, (key, track), token, original, extensions).await
        }
        Begin::Resume {
            token,
            frozen: stored,
        } => {
            // Resend what was first frozen, never the request just handed to us.
            let original = stored.unwrap_or(to_send);
            tracing::info!(key = %key.to_hex(), "operation in doubt; resending the frozen request");
            exchange(
                inner,
                client,
                (key, track),
                token,
                &original,
                extensions,
                ResponseSource::Resent,
            )
            .await
        }
        Begin::Replay(outcome) => replay(outcome),
        Begin::Busy { retry_after } => Err(Error::busy(retry_after)),
        Begin::Drift {
            stored,
            frozen: original,
        } => Err(drift_error(stored, original.as_ref(), &frozen)),
        Begin::DriftFields { stored, fields } => Err(drift_fields_error(stored, &fields, &frozen)),
        // Answers added later are not understood by this release: send nothing.
        #[allow(unreachable_patterns)]
        _ => Err(Error::in_doubt()),
    };
    marked_discarded(answered, discarded)
}

/// A completed operation whose store kept only its fields' digests: its outcome is what
/// continuing with the bytes first frozen gives. Asked for under the fingerprint on record,
/// as a probe; if the record left meanwhile there is nothing to resend, and the drift
/// stands.
async fn replay_by_fingerprint(
    client: &ClientFace,
    key: LedgerKey,
    stored: crate::Fingerprint,
    fields: crate::ledger::FieldDigests,
) -> Result<Begin, Error> {
    let begin = client.ledger.request(key, stored).probe();
    let answer = client
        .ledger
        .begin(begin, client.busy)
        .await
        .map_err(Error::store)?;
    Ok(match answer {
        Begin::Replay(outcome) => Begin::Replay(outcome),
        Begin::Acquired { token } => {
            // Ours now, with nothing sent and nothing to send: let it go.
            // (Were the release lost, the claim stays unsent and leaves with its
            // lease: nothing was sent either way.)
            let _ = client.ledger.hold_unsent(key, token).abandon().await;
            Begin::DriftFields { stored, fields }
        }
        _ => Begin::DriftFields { stored, fields },
    })
}

/// How a `begin` answer is logged.
pub(crate) fn decision_of(answer: &Begin) -> Decision {
    match answer {
        Begin::Acquired { .. } => Decision::Acquired,
        Begin::Resume { .. } => Decision::Resumed,
        Begin::Replay(_) => Decision::Replayed,
        Begin::Busy { .. } => Decision::Busy,
        Begin::InDoubt => Decision::InDoubt,
        Begin::Drift { .. } | Begin::DriftFields { .. } => Decision::Drift,
        // Answers added later are refused like an in-doubt operation.
        #[allow(unreachable_patterns)]
        _ => Decision::InDoubt,
    }
}

fn drift_error(
    stored: crate::Fingerprint,
    original: Option<&FrozenRequest>,
    new: &FrozenRequest,
) -> Error {
    let drift = match original {
        Some(original) => Drift::between(stored, original.body(), new.fingerprint(), new.body()),
        None => Drift::fingerprints(stored, new.fingerprint()),
    };
    tracing::warn!(%drift, "refusing a regenerated payload");
    Error::from_drift(drift)
}

/// [`drift_error`] where the store kept only the digests of the first request's fields.
fn drift_fields_error(
    stored: crate::Fingerprint,
    fields: &crate::ledger::FieldDigests,
    new: &FrozenRequest,
) -> Error {
    let drift = Drift::with_fields(stored, new.fingerprint(), fields.changed_fields(new.body()));
    tracing::warn!(%drift, "refusing a regenerated payload");
    Error::from_drift(drift)
}

fn replay<T>(outcome: Outcome) -> Result<Response<ResponseBody<T>>, Error> {
    match outcome {
        Outcome::Response(stored) => {
            let mut response = Response::new(ResponseBody::buffered(stored.body()));
            *response.status_mut() = stored.status();
            *response.version_mut() = stored.version();
            *response.headers_mut() = stored.headers();
            response.extensions_mut().insert(ResponseSource::Replayed);
            Ok(response)
        }
        Outcome::Tombstone { .. } => Err(Error::replay_unavailable()),
        // Outcomes added later are not replayable by this release.
        #[allow(unreachable_patterns)]
        _ => Err(Error::replay_unavailable()),
    }
}

/// Call `inner` once with the frozen request, outside the ledger.
async fn pass_through<S, ResBody>(
    inner: S,
    client: &ClientFace,
    frozen: &FrozenRequest,
    extensions: Extensions,
) -> Result<Response<ResponseBody<ResBody>>, Error>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
{
    let response = inner
        .oneshot(frozen.to_request_with(extensions))
        .await
        .map_err(|error| failed_outside(client, error.into()))?;
    Ok(response.map(ResponseBody::inner))
}

/// A call outside the ledger failed: keep our own errors, wrap the rest with their phase.
fn failed_outside(client: &ClientFace, error: BoxError) -> Error {
    let phase = classify(&*error, client.phase_classifier.as_deref());
    into_error(error, phase)
}

/// Send `frozen` as the operation's owner and settle the lease by what happened (see
/// [`Exchange`]), from one of the `async` paths.
async fn exchange<S, ResBody>(
    inner: S,
    client: &Arc<ClientFace>,
    (key, track): (LedgerKey, &Track),
    token: LeaseToken,
    frozen: &FrozenRequest,
    extensions: Extensions,
    source: ResponseSource,
) -> Result<Response<ResponseBody<ResBody>>, Error>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let keyed = (key, track.fork());
    let exchange = Exchange::with_source(
        inner,
        client.clone(),
        keyed,
        token,
        frozen,
        extensions,
        source,
    );
    let (answer, forked) = exchange.await;
    track.follow(&forked);
    answer
}

/// Ask the reconciler about an in-doubt operation we now own under `token`, and act on its
/// answer: record and return what it found, send the frozen bytes it says never arrived,
/// or leave the operation in doubt.
async fn reconcile<S, ResBody>(
    inner: S,
    client: &Arc<ClientFace>,
    (key, track): (LedgerKey, &Track),
    token: LeaseToken,
    original: FrozenRequest,
    extensions: Extensions,
) -> Result<Response<ResponseBody<ResBody>>, Error>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let reconciler = client
        .reconciler
        .as_deref()
        .expect("only called with a reconciler");
    // Dropped before settling (the caller gave up), the guard leaves the operation in doubt.
    let lease = client.ledger.hold(key, token);
    let attempts = match client.ledger.store.inspect(key).await {
        Ok(view) => view.map(|view| view.attempts),
        Err(_) => None,
    };
    let wire_key = match track.wire() {
        Some(WireKey::Derived(key)) => key.to_hex(),
        Some(WireKey::Header(key)) => key.as_str().to_owned(),
        None => String::new(),
    };
    let operation = InDoubtOperation::new(original.clone(), wire_key, attempts);
    let verdict = lease
        .renewing(reconcile::ask(
            reconciler,
            operation,
            client.reconcile_timeout,
        ))
        .await;
    match verdict {
        Reconciled::Applied(found) => {
            track.decided(Decision::Reconciled);
            tracing::info!(key = %key.to_hex(), status = %found.status(), "in-doubt operation reconciled: it happened");
            record_reconciled(client, lease, found).await
        }
        Reconciled::NotApplied => {
            tracing::info!(key = %key.to_hex(), "in-doubt operation reconciled: it never happened; sending the frozen request");
            track.decided(Decision::Resumed);
            let token = lease.hand_on();
            exchange(
                inner,
                client,
                (key, track),
                token,
                &original,
                extensions,
                ResponseSource::Resent,
            )
            .await
        }
        _ => {
            track.decided(Decision::InDoubt);
            if let Err(err) = lease.mark_in_doubt().await {
                tracing::warn!(%err, "could not leave the operation in doubt; its lease will expire into doubt");
            }
            Err(Error::in_doubt())
        }
    }
}

/// Record what the reconciler found as the operation's outcome (a tombstone if it is over
/// the recording cap) and return it.
async fn record_reconciled<T>(
    client: &ClientFace,
    lease: LeaseGuard,
    found: Response<Bytes>,
) -> Result<Response<ResponseBody<T>>, Error> {
    let (parts, body) = found.into_parts();
    let outcome = if body.len() > client.response_limit {
        Outcome::Tombstone {
            status: parts.status,
        }
    } else {
        let recorded = HeaderBlock::with_body(&parts.headers, &body);
        Outcome::Response(StoredResponse::of_block_with_body(
            parts.status,
            parts.version,
            recorded,
        ))
    };
    if let Err(err) = lease.complete(outcome).await {
        // Fenced (the operation was taken over) or the store is away: the caller still
        // gets what happened; a later run finds it in doubt and reconciles again.
        tracing::error!(%err, "could not record the reconciled outcome");
    }
    let mut response = Response::from_parts(parts, ResponseBody::buffered(body));
    response.extensions_mut().insert(ResponseSource::Reconciled);
    Ok(response)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_detached_copy_owns_its_bytes_and_keeps_every_header_as_it_was() {
        let read_buffer = Bytes::from(b"text/plain;ch_1secret{\"id\":\"ch_1\"}".to_vec());
        let start = read_buffer.as_ptr() as usize;
        let range = start..start + read_buffer.len();
        let value = |at: std::ops::Range<usize>| {
            http::HeaderValue::from_maybe_shared(read_buffer.slice(at)).unwrap()
        };
        let mut headers = http::HeaderMap::new();
        headers.append(http::header::CONTENT_TYPE, value(0..10));
        headers.append("x-charge-id", value(11..15));
        headers.append("x-charge-id", http::HeaderValue::from_static(""));
        let mut secret = value(15..21);
        secret.set_sensitive(true);
        headers.append(http::header::AUTHORIZATION, secret);
        let body = read_buffer.slice(21..);

        let recorded = HeaderBlock::with_body(&headers, &body);
        let copied_body = recorded.body();
        let copy = recorded.to_map();

        assert_eq!(copied_body, body);
        assert!(!range.contains(&(copied_body.as_ptr() as usize)));
        let before: Vec<_> = headers.iter().collect();
        let after: Vec<_> = copy.iter().collect();
        assert_eq!(before, after, "the same headers, in the same order");
        for ((_, was), (_, is)) in headers.iter().zip(copy.iter()) {
            assert_eq!(was.is_sensitive(), is.is_sensitive());
            assert!(is.is_empty() || !range.contains(&(is.as_bytes().as_ptr() as usize)));
        }
    }

    #[test]
    fn a_records_headers_and_body_share_one_buffer() {
        let mut headers = http::HeaderMap::new();
        headers.append(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
        headers.append("x-charge-id", http::HeaderValue::from_static("ch_1"));
        let block = HeaderBlock::with_body(&headers, b"{\"id\":\"ch_1\"}");
        let body = block.body();
        // The body starts where the block's last value ends: one allocation, freed once.
        let last = block.entries().last().expect("two entries");
        let end = block.value_bytes(&last).as_ptr_range().end;
        assert_eq!(end, body.as_ptr());
    }
}
