//! [`Builder`]: one set of settings for the client layer and the client stack.

use std::sync::Arc;
use std::time::Duration;

use crate::fingerprint::PayloadFields;
use crate::frozen::DEFAULT_BODY_LIMIT;
use crate::idempotency::decision::{OutcomeEvent, OutcomeHook};
use crate::idempotency::engine::BusyPolicy;
use crate::idempotency::hold::OperationSettings;
use crate::idempotency::reconcile::Reconcile;
use crate::idempotency::scope::Scope;
use crate::key::KeyHeader;
use crate::ledger::IdempotencyStore;
use crate::phase::ClassifyPhase;
use crate::retry::{FrozenRetryLayer, RetryPolicy};
use crate::ConfigError;
use crate::IdempotencyLayer;
use crate::ProviderKeys;

use super::face::ClientFace;
use super::policy::DriftPolicy;
use super::release::ReleaseOn;
use super::stack::ClientStack;

/// Configures the client face: [`build`](Builder::build) gives the client
/// [`IdempotencyLayer`], [`build_stack`](Builder::build_stack) the whole
/// [`ClientStack`] (the layer over a [`FrozenRetryLayer`]) from the same settings. Both check
/// the TTLs against the retry window of the [retry policy](Builder::retry_policy).
///
/// Two settings have no default: whether the provider deduplicates on the key
/// ([`provider_keys`](Builder::provider_keys), or
/// [`provider_deduplicates`](Builder::provider_deduplicates)), and, if it does, the header
/// it reads the key from ([`key_header`](Builder::key_header)). Left out, `build` and
/// `build_stack` return a [`ConfigError`] that says what each choice means.
///
/// | setting | default |
/// |---|---|
/// | **Keys** | |
/// | [scope](Builder::scope) (mixed into every key) | `""` |
/// | [a caller's own key](Builder::caller_key_scope) | scoped by its `Authorization` header, refused without one |
/// | [key required](Builder::require_key) on side effects | yes: a side effect without an `OperationId` or key fails, nothing sent |
/// | [key header](Builder::key_header) (name and form) | **no default** when the provider deduplicates: required, `build` refuses without it; else [`KeyHeader::ietf`], `Idempotency-Key: "<key>"` |
/// | **The ledger** | |
/// | [lease](Builder::lease) (renewed by a live owner) | 10 s |
/// | [retention](Builder::retention) | 24 h |
/// | [protected window](Builder::protected_window) (never evicted) | retry window + lease |
/// | [busy operation](Builder::busy_policy) | wait up to 30 s, then a busy error |
/// | [recorded response cap](Builder::response_limit) | 1 MiB (larger: returned whole, kept as a tombstone) |
/// | [ledger unavailable](Builder::fail_open) | fail closed (nothing is sent) |
/// | **Attempts** | |
/// | [retry policy](Builder::retry_policy) (stacked by `build_stack`; its window checked by both) | [`RetryPolicy::default`]: a 30 s window |
/// | [answers released](Builder::release_on), not recorded | `401`, `407`, `429`, the server face's refusals that say nothing ran |
/// | [request body limit](Builder::body_limit) | 1 MiB |
/// | **Regenerated calls** | |
/// | [payload drift](Builder::drift_policy) | under an `OperationId`: continue with the bytes first frozen, marked [`PayloadDiscarded`](crate::PayloadDiscarded); under a caller's own key: refused |
/// | [defining fields](Builder::defining_fields) (a change there: refused, whatever the policy) | none declared: the whole request, judged by the drift policy |
/// | **Operations in doubt** | |
/// | [provider deduplicates](Builder::provider_keys) on `Idempotency-Key` | **no default**: required, `build` refuses without it |
/// | [reconciler](Builder::reconcile) | none (asked within 10 s when set) |
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::KeyHeader;
/// use tower_idempotency::{ledger::MemoryStore, DriftPolicy, IdempotencyLayer};
///
/// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
///     .provider_deduplicates(true)
///     .key_header(KeyHeader::ietf())
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
pub struct Builder {
    /// Lease, retention, protected window, busy duplicates, record cap, retry policy and
    /// reconciler: the settings the tool face shares, checked by the same rules.
    operation: OperationSettings,
    scope: String,
    caller_keys: Scope,
    require_key: bool,
    release_on: ReleaseOn,
    drift: Option<DriftPolicy>,
    defining_fields: Option<PayloadFields>,
    /// Unset: the default here, the retry policy's own in `build_stack`.
    body_limit: Option<usize>,
    fail_open: bool,
    /// `None` until told: required when the provider deduplicates (a provider that reads
    /// another header never sees the key), the IETF header otherwise.
    key_header: Option<KeyHeader>,
    /// `None` until told, and `build` refuses it: no default is safe for both kinds of
    /// provider.
    provider: Option<ProviderKeys>,
    phase_classifier: Option<Arc<dyn ClassifyPhase>>,
    reconcile_when_deduplicating: bool,
    on_outcome: Option<OutcomeHook>,
}

impl Builder {
    pub(crate) fn new(store: Arc<dyn IdempotencyStore>) -> Self {
        Self {
            operation: OperationSettings::new(store),
            scope: String::new(),
            caller_keys: Scope::Authorization,
            require_key: true,
            release_on: ReleaseOn::default(),
            drift: None,
            defining_fields: None,
            body_limit: None,
            fail_open: false,
            key_header: None,
            provider: None,
            phase_classifier: None,
            reconcile_when_deduplicating: false,
            on_outcome: None,
        }
    }
}

/// Keys: whose operation it is, and whether a side effect must name one.
impl Builder {
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
    /// use tower_idempotency::KeyHeader;
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .provider_deduplicates(true)
    ///     .key_header(KeyHeader::ietf())
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
    /// use tower_idempotency::KeyHeader;
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .provider_deduplicates(true)
    ///     .key_header(KeyHeader::ietf())
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
    /// [`ResponseSource::Unprotected`](crate::ResponseSource::Unprotected) and
    /// reported once as a warning. To let one request through without turning the check
    /// off, declare what it is: an [`EffectClass`](crate::EffectClass) other than
    /// `SideEffect` in its extensions (a `POST` that only reads, say).
    ///
    /// ```
    /// use tower_idempotency::KeyHeader;
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// // Opt out: keyless side effects pass through, unprotected.
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .provider_deduplicates(true)
    ///     .key_header(KeyHeader::ietf())
    ///     .require_key(false)
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    /// ```
    pub fn require_key(mut self, require: bool) -> Self {
        self.require_key = require;
        self
    }

    /// The header the provider reads the key from, and the form of its value. **Required**
    /// when the provider deduplicates ([`provider_keys`](Self::provider_keys)): a key sent
    /// under another header than the one it reads is never seen, and every resend of an
    /// operation in doubt runs again, so `build` refuses to guess. Otherwise the default is
    /// [`KeyHeader::ietf`] (`Idempotency-Key: "<key>"`, the IETF draft's sf-string).
    ///
    /// A key derived from an [`OperationId`](crate::OperationId) is sent under this header
    /// in this form, and a caller's own key is read from it. The same setting reaches what
    /// reads the key back: the [`FrozenRetryLayer`] of [`build_stack`](Self::build_stack)
    /// (a request carrying the key is safe to resend), and the [reconciler](Self::reconcile)
    /// (given the value [exactly as it was sent](crate::idempotency::InDoubtOperation::sent_key)).
    /// A `FrozenRetryLayer` you stack yourself learns it from this layer; used alone, it
    /// takes it from [`RetryPolicyBuilder::key_header`](crate::retry::RetryPolicyBuilder::key_header).
    ///
    /// ```
    /// use tower_idempotency::key::KeyHeader;
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// // PayPal reads `PayPal-Request-Id: <key>`.
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .provider_deduplicates(true)
    ///     .key_header(KeyHeader::paypal())
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    ///
    /// // Left out for a provider that deduplicates, the build names the presets.
    /// let err = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .provider_deduplicates(true)
    ///     .build()
    ///     .unwrap_err();
    /// assert!(err.is_choice_missing());
    /// assert!(err.to_string().contains("KeyHeader::paypal()"));
    /// ```
    pub fn key_header(mut self, header: KeyHeader) -> Self {
        self.key_header = Some(header);
        self
    }
}

/// The ledger: how long it holds an operation, what a duplicate does meanwhile, and what
/// happens when the ledger itself is away.
impl Builder {
    /// How long an owner may hold an operation in flight without renewing it (default
    /// 10 s). A live owner keeps its lease while an attempt is under way (the default
    /// `MemoryStore` holds it until the owner lets go; other stores are renewed every third
    /// of it), so the lease never has to cover a slow call: it is how soon after an owner
    /// **died** (a crashed orchestrator) the next run of the operation may resume it. An
    /// owner that is neither dead nor running (its future leaked) keeps it busy on
    /// `MemoryStore` until the record's retention ends.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.operation.lease = lease;
        self
    }

    /// How long records are kept (default 24 h). Must outlast the retry window plus the
    /// lease, and should outlast your longest crash-and-resume gap. "Keep forever"
    /// (`Duration::MAX`) is accepted and held as about 139 years, as is any duration of the
    /// ledger longer than that (lease, protected window, busy wait).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.operation.retention = retention;
        self
    }

    /// How long after its last transition a record is never evicted from a store with a
    /// memory budget (default: the retry window plus the lease, at least). Inside it, a
    /// full store refuses new operations rather than forget this one; past it, the record
    /// may be evicted before its retention ends. Clamped to the retention.
    pub fn protected_window(mut self, window: Duration) -> Self {
        self.operation.protected = Some(window);
        self
    }

    /// See [`BusyPolicy`].
    pub fn busy_policy(mut self, policy: BusyPolicy) -> Self {
        self.operation.busy = policy;
        self
    }

    /// The largest response recorded for replay (default 1 MiB). A larger response still
    /// reaches the caller whole; the ledger keeps a tombstone.
    pub fn response_limit(mut self, limit: usize) -> Self {
        self.operation.response_limit = limit;
        self
    }

    /// When the ledger is unavailable, send anyway (without protection) instead of failing.
    /// Off by default; turning it on trades exactly-once for availability.
    pub fn fail_open(mut self, fail_open: bool) -> Self {
        self.fail_open = fail_open;
        self
    }
}

/// Attempts: the retry policy whose window the ledger must outlast, which answers say
/// nothing started, and the limits and errors of a request on its way out.
impl Builder {
    /// The retry policy of the stack inside (default [`RetryPolicy::default`]): the
    /// policy of the [`FrozenRetryLayer`] that [`build_stack`](Self::build_stack) puts
    /// inside, and, whichever retries you stack, the retry window the ledger's TTLs are
    /// checked against — its maximum elapsed time plus one per-attempt timeout (the last
    /// attempt may start at the deadline). It sets the default protected window.
    ///
    /// With a retrying layer of your own (`reqwest-retry` outside the
    /// [`IdempotencyMiddleware`](crate::reqwest_middleware::IdempotencyMiddleware)), give a
    /// policy whose window covers its whole schedule.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::KeyHeader;
    /// use tower_idempotency::{ledger::MemoryStore, retry::RetryPolicy, IdempotencyLayer};
    ///
    /// let policy = RetryPolicy::builder().max_elapsed(Duration::from_secs(90)).build().unwrap();
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .provider_deduplicates(true)
    ///     .key_header(KeyHeader::ietf())
    ///     .retry_policy(policy)
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    /// ```
    pub fn retry_policy(mut self, policy: RetryPolicy) -> Self {
        self.operation.retry = policy;
        self
    }

    /// Which answers say the operation never started (default [`ReleaseOn::default`]:
    /// `401`, `407`, `429`, and this crate's server-face refusals that say nothing ran; not
    /// `408`, see [`ReleaseOn`]). Such an answer reaches the caller, but the operation is
    /// **released** rather than recorded, so the next run sends it again — after the token
    /// was refreshed, the rate limit waited out, the credentials fixed — instead of being
    /// answered with the refusal for the whole retention. An operation an earlier attempt may have sent is
    /// never released: it stays in doubt. [`ReleaseOn::nothing`] records every answer.
    ///
    /// ```
    /// use http::StatusCode;
    /// use tower_idempotency::KeyHeader;
    /// use tower_idempotency::client::ReleaseOn;
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .provider_deduplicates(true)
    ///     .key_header(KeyHeader::ietf())
    ///     .release_on(ReleaseOn::default().status(StatusCode::FORBIDDEN))
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    /// ```
    pub fn release_on(mut self, rule: ReleaseOn) -> Self {
        self.release_on = rule;
        self
    }

    /// The largest request body (default 1 MiB); larger ones fail before anything is sent.
    /// [`build_stack`](Self::build_stack) gives the retry layer the same limit (unset, it
    /// keeps its policy's).
    pub fn body_limit(mut self, limit: usize) -> Self {
        self.body_limit = Some(limit);
        self
    }

    /// Teach the layer which of your transport's errors are pre-write failures (the retry
    /// layer of [`build_stack`](Self::build_stack) too).
    pub fn classify_phase(mut self, classifier: impl ClassifyPhase) -> Self {
        self.phase_classifier = Some(Arc::new(classifier));
        self
    }
}

/// Regenerated calls: what a re-run step's new payload comes to.
impl Builder {
    /// What to do with a regenerated payload under a known operation, for every request
    /// (see [`DriftPolicy`]).
    ///
    /// Unset, it depends on who named the operation. Under an
    /// [`OperationId`](crate::OperationId) — the orchestrator's step, which a re-run agent
    /// regenerates — a regenerated **body** is resent as first frozen
    /// ([`DriftPolicy::ResendFrozen`]): the step finishes and the response says what was
    /// discarded ([`PayloadDiscarded`](crate::PayloadDiscarded)). Under a
    /// caller's own `Idempotency-Key`, [`DriftPolicy::Reject`]: a key reused for another
    /// payload is a caller's mistake, as providers (and the server face's `422`) treat it.
    ///
    /// Whatever the policy, a changed method or target is refused (an operation is never
    /// answered with another target's outcome, nor its bytes resent there), and so is a
    /// changed [defining field](Self::defining_fields), when some are declared.
    ///
    /// ```
    /// use tower_idempotency::KeyHeader;
    /// use tower_idempotency::{ledger::MemoryStore, DriftPolicy, IdempotencyLayer};
    ///
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .provider_deduplicates(true)
    ///     .key_header(KeyHeader::ietf())
    ///     .drift_policy(DriftPolicy::Reject)
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    /// ```
    pub fn drift_policy(mut self, policy: DriftPolicy) -> Self {
        self.drift = Some(policy);
        self
    }

    /// The fields of a JSON payload that say what the operation **is** (the order, the
    /// amount, the recipient), which are never discarded. None are declared by default:
    /// the whole request is judged by the [drift policy](Self::drift_policy), so under an
    /// `OperationId` a step identity reused for another order is answered with the first
    /// order's outcome, as a reworded `summary` is.
    ///
    /// Declared, they decide, whatever the policy: a payload with a changed defining field
    /// (or that is not JSON, so that they cannot be read) is refused with a drift error
    /// naming it, nothing sent, under [`ResendFrozen`](DriftPolicy::ResendFrozen) too; a
    /// payload that changed only other fields — a reworded `summary`, a freshly minted
    /// `fulfillment_intent_id` — is the same operation, under
    /// [`Reject`](DriftPolicy::Reject) too: it continues with the bytes first frozen,
    /// marked [`PayloadDiscarded`](crate::PayloadDiscarded) naming the discarded fields. A
    /// change to the method or target is refused as always. In the spirit of AWS
    /// Powertools' payload validation.
    ///
    /// The bytes sent are still the ones first frozen, whole: the selection decides what
    /// counts as the same operation, never what is sent.
    ///
    /// ```
    /// use tower_idempotency::KeyHeader;
    /// use tower_idempotency::fingerprint::PayloadFields;
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .provider_deduplicates(true)
    ///     .key_header(KeyHeader::ietf())
    ///     // A changed order or amount is refused; a reworded summary is not.
    ///     .defining_fields(PayloadFields::new(["/order_id", "/amount_cents"]).unwrap())
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    /// ```
    pub fn defining_fields(mut self, fields: PayloadFields) -> Self {
        self.defining_fields = Some(fields);
        self
    }
}

/// Operations in doubt: whether the provider's deduplication makes a resend safe, and who
/// is asked before one that would not be.
impl Builder {
    /// Whether the provider deduplicates on `Idempotency-Key`. **Required**: there is no
    /// default, since the safe answer differs by provider; without it,
    /// [`build`](Self::build) and [`build_stack`](Self::build_stack) return a
    /// [`ConfigError`] (its [`is_choice_missing`](ConfigError::is_choice_missing) is true).
    ///
    /// Resending an operation whose first attempt may have arrived is one effect only when
    /// the provider recognises the key.
    ///
    /// - [`ProviderKeys::Deduplicates`] (payment providers that honour the IETF header,
    ///   this crate's server face): an operation in doubt is resent with the same key and
    ///   the bytes first frozen, and the retry layer inside may retry an attempt that may
    ///   have arrived. Exactly once, as long as the provider keeps the key.
    /// - [`ProviderKeys::Ignored`] (a server that ignores the key or reads another header,
    ///   such as your own handler without the server face): nothing that may have arrived
    ///   is sent again. The retry layer inside stops treating the key as making the request
    ///   retry-safe, and an operation found in doubt is not resent: with a
    ///   [reconciler](Self::reconcile) the layer asks it whether the operation happened
    ///   (and records its answer, or sends the frozen bytes it says never arrived); without
    ///   one, it fails with an [in-doubt error](crate::Error::is_in_doubt) for you to
    ///   reconcile. At most once, rather than exactly once, unless reconciled.
    ///
    /// Earlier releases assumed `Deduplicates` when this was left unset.
    ///
    /// ```
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer, ProviderKeys};
    ///
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .provider_keys(ProviderKeys::Ignored)
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    ///
    /// // Left out, the build says what each choice means.
    /// let err = IdempotencyLayer::client_builder(MemoryStore::new()).build().unwrap_err();
    /// assert!(err.is_choice_missing());
    /// assert!(err.to_string().contains("ProviderKeys::Deduplicates"));
    /// assert!(err.to_string().contains("ProviderKeys::Ignored"));
    /// ```
    pub fn provider_keys(mut self, provider: ProviderKeys) -> Self {
        self.provider = Some(provider);
        self
    }

    /// [`provider_keys`](Self::provider_keys) as a flag: `true` is
    /// [`ProviderKeys::Deduplicates`], `false` is [`ProviderKeys::Ignored`]. One of the two
    /// is **required**.
    ///
    /// ```
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// // Your own handler, which does not read `Idempotency-Key`.
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .provider_deduplicates(false)
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    /// ```
    pub fn provider_deduplicates(self, deduplicates: bool) -> Self {
        self.provider_keys(if deduplicates {
            ProviderKeys::Deduplicates
        } else {
            ProviderKeys::Ignored
        })
    }

    /// Ask `reconciler` whether an in-doubt operation happened before it would be sent
    /// again: always when the provider does not deduplicate
    /// ([`provider_deduplicates(false)`](Self::provider_deduplicates)), and also when it does
    /// if [`reconcile_when_deduplicating`](Self::reconcile_when_deduplicating) is on. See
    /// [`Reconcile`] and [`LookupReconciler`](crate::idempotency::LookupReconciler).
    ///
    /// ```
    /// use tower_idempotency::idempotency::{record_or_not_found, LookupReconciler};
    /// use tower_idempotency::testing::SideEffectService;
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// let provider = SideEffectService::builder().honour_keys(false).build();
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .provider_deduplicates(false)
    ///     .reconcile(LookupReconciler::by_key(provider, "/effects", "idempotency_key", record_or_not_found))
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    /// ```
    pub fn reconcile(mut self, reconciler: impl Reconcile) -> Self {
        self.operation.reconciler = Some(Arc::new(reconciler));
        self
    }

    /// How long the reconciler may take (default 10 s); past
    /// it, the operation stays in doubt.
    pub fn reconcile_timeout(mut self, bound: Duration) -> Self {
        self.operation.reconcile_timeout = bound;
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
}

/// Observing and building.
impl Builder {
    /// Call `hook` once per request that reached the ledger, when its answer is known,
    /// with what it came to: the face, the last decision, the key's digest, the status
    /// (when there was a response) and how long it took. See [`OutcomeEvent`].
    ///
    /// For observability of your own (another metrics system, an audit log). Unset, it
    /// costs nothing: no clock is read and no digest is computed. The hook runs on the
    /// request's task, inside its span: keep it short and never block in it.
    ///
    /// ```
    /// use tower_idempotency::KeyHeader;
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .provider_deduplicates(true)
    ///     .key_header(KeyHeader::ietf())
    ///     .on_outcome(|event| eprintln!("{} {}", event.decision().as_str(), event.key_digest()))
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    /// ```
    pub fn on_outcome(mut self, hook: impl Fn(&OutcomeEvent<'_>) + Send + Sync + 'static) -> Self {
        self.on_outcome = Some(OutcomeHook::new(hook));
        self
    }

    /// Check the settings and build the layer.
    ///
    /// Refuses a builder not told whether the provider deduplicates
    /// ([`provider_keys`](Self::provider_keys)), a zero lease, a retention shorter than the retry window plus the lease (a
    /// record would vanish while its operation can still retry) and a protected window
    /// shorter than that (a full store could evict an operation still being retried).
    pub fn build(self) -> Result<IdempotencyLayer<ClientFace>, ConfigError> {
        if self.reconcile_when_deduplicating && self.operation.reconciler.is_none() {
            return Err(ConfigError::new(
                "reconcile_when_deduplicating needs a reconciler (see `reconcile`)",
            ));
        }
        let provider = self.provider.ok_or_else(provider_keys_missing)?;
        let key_header = self.chosen_key_header()?;
        let ledger = self.operation.ledger()?;
        let retry_window = self.operation.retry.retry_window();
        let client = ClientFace {
            ledger,
            scope: self.scope,
            caller_keys: self.caller_keys,
            require_key: self.require_key,
            release_on: self.release_on,
            drift: self.drift,
            defining_fields: self.defining_fields,
            busy: self.operation.busy,
            body_limit: self.body_limit.unwrap_or(DEFAULT_BODY_LIMIT),
            response_limit: self.operation.response_limit,
            fail_open: self.fail_open,
            key_header,
            provider_deduplicates: provider == ProviderKeys::Deduplicates,
            phase_classifier: self.phase_classifier,
            reconciler: self.operation.reconciler,
            reconcile_timeout: self.operation.reconcile_timeout,
            reconcile_when_deduplicating: self.reconcile_when_deduplicating,
            retry_window,
            warned_window: std::sync::atomic::AtomicBool::new(false),
            warned_unprotected: std::sync::atomic::AtomicBool::new(false),
            on_outcome: self.on_outcome,
        };
        Ok(IdempotencyLayer::from_face(client))
    }

    /// Check the settings and build the whole client stack: the layer over a
    /// [`FrozenRetryLayer`] running the [retry policy](Self::retry_policy), with the
    /// [body limit](Self::body_limit) and the [phase classifier](Self::classify_phase)
    /// applied to both. Refuses what [`build`](Self::build) refuses.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower::ServiceBuilder;
    /// use tower_idempotency::KeyHeader;
    /// use tower_idempotency::testing::SideEffectService;
    /// use tower_idempotency::{ledger::MemoryStore, retry::RetryPolicy, IdempotencyLayer};
    ///
    /// let stack = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .provider_deduplicates(true)
    ///     .key_header(KeyHeader::ietf())
    ///     .scope("billing-agent")
    ///     .retry_policy(RetryPolicy::builder().attempt_timeout(Duration::from_secs(2)).build().unwrap())
    ///     .body_limit(256 * 1024)
    ///     .build_stack()
    ///     .unwrap();
    /// let client = ServiceBuilder::new().layer(stack).service(SideEffectService::new());
    /// # let _ = client;
    /// ```
    pub fn build_stack(self) -> Result<ClientStack, ConfigError> {
        let mut policy = self.operation.retry.clone();
        // The retry layer tells a keyed request by the header this layer sends.
        policy.key_header = self.chosen_key_header()?;
        if let Some(limit) = self.body_limit {
            policy.body_limit = limit;
        }
        if let Some(classifier) = &self.phase_classifier {
            policy.phase_classifier = Some(classifier.clone());
        }
        Ok(ClientStack::new(
            self.build()?,
            FrozenRetryLayer::new(policy),
        ))
    }
}

impl Builder {
    /// The header the key is sent under: the one chosen; unchosen, the IETF header, unless
    /// the provider deduplicates — it must be told the header that provider reads, since
    /// a key sent under any other is never seen and every resend runs again.
    fn chosen_key_header(&self) -> Result<KeyHeader, ConfigError> {
        match (&self.key_header, self.provider) {
            (Some(header), _) => Ok(header.clone()),
            (None, Some(ProviderKeys::Deduplicates)) => Err(key_header_missing()),
            (None, _) => Ok(KeyHeader::ietf()),
        }
    }
}

/// The refusal of a builder not told whether the provider deduplicates: what each choice
/// means, so the one reading it can choose without the docs.
fn provider_keys_missing() -> ConfigError {
    ConfigError::choice_missing(
        "say whether the provider deduplicates on Idempotency-Key: \
         provider_keys(ProviderKeys::Deduplicates) (or provider_deduplicates(true)) if it runs \
         a request at most once per key, and an operation in doubt is then resent with the same \
         key and the bytes first frozen; provider_keys(ProviderKeys::Ignored) (or \
         provider_deduplicates(false)) if it ignores the key, and an operation in doubt is then \
         never resent blind: it is reconciled, or reported as in doubt",
    )
}

/// The refusal of a builder told that the provider deduplicates but not on which header:
/// the presets, so the one reading it can choose without the docs.
fn key_header_missing() -> ConfigError {
    ConfigError::choice_missing(
        "the provider deduplicates: say which header it reads the key from, as \
         key_header(KeyHeader::ietf()) for `Idempotency-Key: \"<key>\"` (the IETF draft), \
         KeyHeader::stripe() or ::adyen() for `Idempotency-Key: <key>`, \
         KeyHeader::paypal() for `PayPal-Request-Id: <key>`, KeyHeader::checkout_com() for \
         `Cko-Idempotency-Key: <key>`, or KeyHeader::new(name, form); a provider that reads \
         another header than the one sent never sees the key, and runs every resend again",
    )
}

impl IdempotencyLayer<ClientFace> {
    /// The client layer over `store`, every other setting at its default, for a provider
    /// that deduplicates on the key or ignores it, as `provider` says (see [`ProviderKeys`]
    /// and [`Builder::provider_keys`]; there is no default), sending the key under
    /// `key_header` ([`Builder::key_header`]: the header a provider that deduplicates reads
    /// it from; there is no default either, since a key sent under another header than the
    /// provider reads is never seen, and every resend runs again).
    ///
    /// See the [module docs](crate::client) for the stack it belongs in, and
    /// [`client_builder`](Self::client_builder) for the other settings.
    ///
    /// ```
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer, KeyHeader, ProviderKeys};
    ///
    /// // Stripe reads `Idempotency-Key: <key>`; PayPal would be `KeyHeader::paypal()`.
    /// let layer = IdempotencyLayer::client(MemoryStore::new(), ProviderKeys::Deduplicates, KeyHeader::stripe());
    /// # let _ = layer;
    /// ```
    ///
    /// # Retrying layers
    ///
    /// The only retrying layer that belongs under this one is one
    /// [`FrozenRetryLayer`](crate::FrozenRetryLayer), directly inside it (or both built as
    /// one with [`build_stack`](crate::client::Builder::build_stack)): its retries know the
    /// provider's keys and keep "may have been sent" across attempts. Any other retry resends
    /// an attempt that may have run, and against a provider that ignores keys runs the
    /// effect again. These wirings are refused with an error
    /// ([`Error::is_retry_inside`](crate::Error::is_retry_inside) or its siblings), before
    /// anything is sent:
    ///
    /// - `tower::retry` or `tower::hedge` anywhere in the type of the service this layer
    ///   wraps (under a `FrozenRetryLayer` too), or in the transport a
    ///   [`ClientStack`](crate::client::ClientStack) wraps: read from the type once, when
    ///   the layer wraps it, and every side effect is refused before it is claimed;
    /// - a `FrozenRetryLayer` outside this layer ([`Error::is_retry_outside`](crate::Error::is_retry_outside));
    /// - a second `FrozenRetryLayer` under the first ([`Error::is_retry_nested`](crate::Error::is_retry_nested));
    /// - a retrying layer the type does not show (boxed in a `BoxCloneService`, behind a
    ///   `Buffer`, or one of your own) between this layer and a transport that counts its sends
    ///   ([`ReqwestService`](crate::reqwest::ReqwestService), any transport wrapped in
    ///   [`SendOnce`](crate::client::SendOnce)), or between this layer and a
    ///   `FrozenRetryLayer`: each operation's request carries a marker in its extensions,
    ///   and the second send under it is refused before any byte of it leaves; the
    ///   operation is settled as the first send's outcome dictates.
    ///
    /// **These cannot be detected**, and must be avoided by hand:
    ///
    /// - a retrying layer the type does not show above a transport that counts nothing
    ///   (hyper-util's `Client` or a service of your own, not wrapped in `SendOnce`);
    /// - a retry policy that drops the request's extensions when it clones the request
    ///   (one that builds the copy from the method, URI, headers and body alone): the copy
    ///   carries no marker, and reads as a first send;
    /// - a retrying layer the type does not show under a `FrozenRetryLayer` or in the
    ///   transport of a stack built with `build_stack`: those attempts carry no marker;
    /// - `reqwest-retry` after (inside) the
    ///   [`IdempotencyMiddleware`](crate::reqwest_middleware::IdempotencyMiddleware) in a
    ///   `reqwest-middleware` chain: the rest of the chain is opaque to a middleware, and
    ///   reqwest sends what it is handed (see
    ///   [its module docs](crate::reqwest_middleware#retries-put-reqwest-retry-before-it-never-after-it)).
    pub fn client(
        store: impl IdempotencyStore,
        provider: ProviderKeys,
        key_header: KeyHeader,
    ) -> Self {
        Self::client_builder(store)
            .provider_keys(provider)
            .key_header(key_header)
            .build()
            .expect("the default client settings are valid once the provider is named")
    }

    /// Configure the client layer over `store`. Whether the provider deduplicates
    /// ([`provider_keys`](Builder::provider_keys)) must be said before it builds, and, if
    /// it does, the header it reads the key from ([`key_header`](Builder::key_header)).
    pub fn client_builder(store: impl IdempotencyStore) -> Builder {
        Builder::new(Arc::new(store))
    }

    /// An operator's handle on this layer's ledger: look at the record of an
    /// [`OperationId`](crate::OperationId) as this layer keys it (its scope included) and
    /// forget it, fenced. See [`Records`](crate::ledger::Records).
    ///
    /// ```
    /// use tower_idempotency::KeyHeader;
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer, OperationId};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new()).provider_deduplicates(true).key_header(KeyHeader::ietf()).scope("agent").build().unwrap();
    /// let records = layer.records();
    /// let key = records.operation_key(&OperationId::new("task-7", "charge"));
    /// assert!(records.inspect(key).await?.is_none());
    /// # Ok(())
    /// # }
    /// ```
    pub fn records(&self) -> crate::ledger::Records {
        let face = self.face();
        let reconciling =
            face.reconciler
                .clone()
                .map(|reconciler| crate::idempotency::reconcile::Reconciling {
                    reconciler,
                    timeout: face.reconcile_timeout,
                    key_header: face.key_header.clone(),
                    response_limit: face.response_limit,
                });
        crate::ledger::Records::client(
            face.ledger.store.clone(),
            face.scope.clone(),
            face.ledger.retention,
        )
        .with_reconciling(reconciling)
    }
}
