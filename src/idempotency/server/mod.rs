//! The server face: IETF `Idempotency-Key` semantics in front of handlers.
//!
//! The user-facing documentation lives in the [module docs](crate::idempotency); this
//! file keeps the reasons next to the code.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::request::Parts;
use http::{HeaderMap, Method, Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use tower_service::Service;

use super::body::{Buffered, ResponseBody};
use super::decision::{record_in_layer_span, request_span, OutcomeEvent, OutcomeHook, Track};
use super::engine::{BusyPolicy, Ledger, DEFAULT_LEASE, DEFAULT_RETENTION, LONGEST};
use super::scope::Scope;
use super::{Idempotency, IdempotencyLayer, DEFAULT_RESPONSE_LIMIT};
use crate::digest::{
    BodyDigest, ContentDigest, DigestError, CONTENT_DIGEST, IDEMPOTENT_REQUEST_DIGEST,
};
use crate::effect::EffectClass;
use crate::error::ConfigError;
use crate::frozen::{check_length, CollectRequest, DEFAULT_BODY_LIMIT};
use crate::ledger::{entries_size, entry_size, BlockWriter, HeaderBlock};
use crate::ledger::{scope_id, IdempotencyStore, LeaseToken, LedgerKey, Outcome, StoredResponse};
use crate::BoxError;

mod admit;
mod body;
mod execute;
mod head;
pub mod problem;
mod staged;
#[cfg(feature = "postgres")]
mod transactional;

use admit::Admit;
pub use body::RequestBody;
use head::KeyedHead;
use staged::Keyed;

/// `Idempotent-Replayed: true` marks a response replayed from the ledger: the handler was
/// not called for this request.
pub static IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// `Idempotency-Fail-Open: true` marks a response produced while the ledger was unavailable
/// by a layer built with [`fail_open`](ServerBuilder::fail_open): the key was **not**
/// checked, so a retry may run the handler again.
pub static IDEMPOTENCY_FAIL_OPEN: HeaderName = HeaderName::from_static("idempotency-fail-open");

/// The response headers recorded and replayed by default.
///
/// They describe the representation and where it lives, and stay true when replayed:
/// `Content-Type`, `Content-Encoding`, `Content-Language`, `Content-Location`, `Location`,
/// `ETag`, `Last-Modified`, `Cache-Control`, `Vary`, `Link`. Left out on purpose:
/// `Retry-After` and `Expires` (relative to the first response's time, stale on replay),
/// `Content-Length` (recomputed from the body), and everything that must never be replayed
/// (see [`ServerBuilder::replay_headers`]).
///
/// ```
/// use http::header::HeaderName;
/// use tower_idempotency::{idempotency::DEFAULT_REPLAY_HEADERS, ledger::MemoryStore, IdempotencyLayer};
///
/// // Also replay a request id header of your own.
/// let layer = IdempotencyLayer::server_builder(MemoryStore::new())
///     .replay_headers(
///         DEFAULT_REPLAY_HEADERS.iter().cloned().chain([HeaderName::from_static("x-charge-id")]),
///     )
///     .build()
///     .unwrap();
/// # let _ = layer;
/// ```
pub const DEFAULT_REPLAY_HEADERS: &[HeaderName] = &[
    header::CONTENT_TYPE,
    header::CONTENT_ENCODING,
    header::CONTENT_LANGUAGE,
    header::CONTENT_LOCATION,
    header::LOCATION,
    header::ETAG,
    header::LAST_MODIFIED,
    header::CACHE_CONTROL,
    header::VARY,
    header::LINK,
];

/// Headers never recorded nor replayed, whatever the configuration: credentials and
/// session state of the first caller, per-response values, hop-by-hop headers, and the
/// layer's own (a replay's digest is the request's, never a value the handler set).
const NEVER_REPLAYED: &[&str] = &[
    "set-cookie",
    "set-cookie2",
    "www-authenticate",
    "proxy-authenticate",
    "authentication-info",
    "proxy-authentication-info",
    "authorization",
    "proxy-authorization",
    "cookie",
    "date",
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "content-length",
    "idempotent-replayed",
    "idempotent-request-digest",
    "idempotency-fail-open",
];

/// What to do with a `5xx` response from the handler.
///
/// ```
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer, ServerErrorPolicy};
///
/// // My handler's 5xx always means "rolled back, nothing happened".
/// let layer = IdempotencyLayer::server_builder(MemoryStore::new())
///     .server_error_policy(ServerErrorPolicy::Release)
///     .build()
///     .unwrap();
/// # let _ = layer;
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ServerErrorPolicy {
    /// Record the `5xx` like any other response and replay it to retries (as Stripe does).
    /// The default: a handler can fail *after* its side effect, and only the handler knows
    /// whether it did; recording never runs an effect twice.
    #[default]
    Record,
    /// Release the key: the next request with it runs the handler again. Choose it when
    /// your handler's `5xx` reliably means nothing happened (its effect and its failure
    /// share one transaction), so clients' retries get a fresh attempt.
    Release,
}

/// What to do with a key whose earlier attempt started and never finished: its handler
/// panicked (with nothing catching it), its request future was cancelled, its response body
/// failed, or it ran past its lease. The ledger holds such a key *in doubt*.
///
/// A server cannot "resend" like a client can: the only choices are to run the handler
/// again or to refuse.
///
/// ```
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer, InDoubtPolicy};
///
/// // The handler passes the key to its payment provider, which deduplicates on it.
/// let layer = IdempotencyLayer::server_builder(MemoryStore::new())
///     .in_doubt_policy(InDoubtPolicy::RunAgain)
///     .build()
///     .unwrap();
/// # let _ = layer;
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum InDoubtPolicy {
    /// Answer every later request with the key `500`
    /// [`outcome-unknown`](problem::OUTCOME_UNKNOWN) until the record's retention ends:
    /// **at most once**. The default, because the layer cannot know whether the handler's
    /// effect happened, and running it again is exactly the double charge this crate exists
    /// to prevent.
    #[default]
    OutcomeUnknown,
    /// Run the handler again for a request with the same fingerprint: **at least once**.
    /// Safe only when the handler's own effects are idempotent, e.g. its downstream calls
    /// carry the key (it is in the request's extensions as a [`HeaderKey`](crate::HeaderKey)).
    RunAgain,
}

/// The default bound on requests waiting at once for in-flight keys under
/// [`BusyPolicy::Wait`] (see [`ServerBuilder::max_waiters`]).
pub const DEFAULT_MAX_WAITERS: usize = 256;

/// The default protected window of a server record, besides the lease: how long after it
/// completes it is never evicted from a store with a memory budget, so the clients' retries
/// find it. A minute covers a client's automatic retries (this crate's default retry window
/// is 30 s, and SDKs' are shorter); a caller that comes back later (an orchestrator resuming
/// after a crash) needs a durable store, where nothing is evicted, not a longer window here.
pub const DEFAULT_SERVER_PROTECTED_WINDOW: Duration = Duration::from_secs(60);

/// The server face's configuration (see [`ServerBuilder`] and the
/// [module docs](crate::idempotency#the-server-face)).
pub struct ServerFace {
    ledger: Ledger,
    scope: Scope,
    methods: Vec<Method>,
    require_key: bool,
    busy: BusyPolicy,
    body_limit: usize,
    response_limit: usize,
    replay_headers: Vec<HeaderName>,
    server_errors: ServerErrorPolicy,
    in_doubt: InDoubtPolicy,
    fail_open: bool,
    cancel_on_disconnect: bool,
    retry_after: Duration,
    on_outcome: Option<OutcomeHook>,
    /// The transactional mode's database: each keyed request runs in one transaction.
    #[cfg(feature = "postgres")]
    transactional: Option<crate::ledger::PostgresStore>,
}

impl fmt::Debug for ServerFace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerFace")
            .field("ledger", &self.ledger)
            .field("methods", &self.methods)
            .field("require_key", &self.require_key)
            .field("busy", &self.busy)
            .field("body_limit", &self.body_limit)
            .field("response_limit", &self.response_limit)
            .field("replay_headers", &self.replay_headers)
            .field("server_errors", &self.server_errors)
            .field("in_doubt", &self.in_doubt)
            .field("fail_open", &self.fail_open)
            .field("cancel_on_disconnect", &self.cancel_on_disconnect)
            .field("retry_after", &self.retry_after)
            .finish_non_exhaustive()
    }
}

/// Configures the server [`IdempotencyLayer`]; [`build`](ServerBuilder::build) checks the
/// settings.
///
/// | setting | default |
/// |---|---|
/// | [scope](ServerBuilder::scope) | a hash of the `Authorization` header; a keyed request without one gets `400` [`scope-missing`](problem::SCOPE_MISSING) |
/// | [side-effecting methods](ServerBuilder::side_effect_methods) | `POST`, `PATCH` |
/// | [key required](ServerBuilder::require_key) on them | yes: `400` without one |
/// | [lease](ServerBuilder::lease) (renewed while the handler runs) | 10 s |
/// | [retention](ServerBuilder::retention) | 24 h |
/// | [protected window](ServerBuilder::protected_window) (never evicted) | lease + 1 min |
/// | [busy key](ServerBuilder::busy_policy) | `409` at once ([`BusyPolicy::Fail`]) |
/// | [waiters](ServerBuilder::max_waiters) under [`BusyPolicy::Wait`] | at most 256 at once, then `409` |
/// | [request body limit](ServerBuilder::body_limit) | 1 MiB (`413`) |
/// | [recorded response cap](ServerBuilder::response_limit) | 1 MiB (larger: sent whole, kept as a tombstone) |
/// | [replayed headers](ServerBuilder::replay_headers) | [`DEFAULT_REPLAY_HEADERS`] |
/// | [handler `5xx`](ServerBuilder::server_error_policy) | [`ServerErrorPolicy::Record`] |
/// | [in-doubt key](ServerBuilder::in_doubt_policy) | [`InDoubtPolicy::OutcomeUnknown`] |
/// | [ledger unavailable](ServerBuilder::fail_open) | fail closed (`503`) |
/// | [client goes away](ServerBuilder::cancel_on_disconnect) | the handler runs to completion |
/// | [`Retry-After`](ServerBuilder::retry_after) of `409`/`503` | 1 s |
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer, InDoubtPolicy};
///
/// #[derive(Clone)]
/// struct Tenant(String); // put there by your authentication middleware
///
/// let layer = IdempotencyLayer::server_builder(MemoryStore::new())
///     .scope(|parts| parts.extensions.get::<Tenant>().map(|t| t.0.clone()).unwrap_or_default())
///     .lease(Duration::from_secs(30))
///     .in_doubt_policy(InDoubtPolicy::RunAgain)
///     .build()
///     .unwrap();
/// # let _ = layer;
/// ```
#[must_use = "a builder does nothing until `build` is called"]
pub struct ServerBuilder {
    store: Arc<dyn IdempotencyStore>,
    scope: Scope,
    methods: Vec<Method>,
    require_key: bool,
    lease: Duration,
    retention: Duration,
    protected: Duration,
    busy: BusyPolicy,
    max_waiters: usize,
    body_limit: usize,
    response_limit: usize,
    replay_headers: Vec<HeaderName>,
    server_errors: ServerErrorPolicy,
    in_doubt: InDoubtPolicy,
    fail_open: bool,
    cancel_on_disconnect: bool,
    retry_after: Duration,
    on_outcome: Option<OutcomeHook>,
    #[cfg(feature = "postgres")]
    transactional: Option<crate::ledger::PostgresStore>,
}

impl fmt::Debug for ServerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerBuilder")
            .field("store", &self.store)
            .field("methods", &self.methods)
            .field("require_key", &self.require_key)
            .field("lease", &self.lease)
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

/// The request target as the client sent it. A router that nests this layer under a
/// prefix (`Router::nest("/accounts/{id}", …)`) hands it a URI with the prefix stripped;
/// with feature `axum`, the layer reads the original from axum's `OriginalUri` extension,
/// so `/accounts/1/charges` and `/accounts/2/charges` never look like one request.
fn original_target(parts: &Parts) -> &http::Uri {
    #[cfg(feature = "axum")]
    if let Some(axum::extract::OriginalUri(uri)) = parts.extensions.get() {
        return uri;
    }
    &parts.uri
}

impl ServerBuilder {
    fn new(store: Arc<dyn IdempotencyStore>) -> Self {
        Self {
            store,
            scope: Scope::Authorization,
            methods: vec![Method::POST, Method::PATCH],
            require_key: true,
            lease: DEFAULT_LEASE,
            retention: DEFAULT_RETENTION,
            protected: DEFAULT_LEASE + DEFAULT_SERVER_PROTECTED_WINDOW,
            busy: BusyPolicy::Fail,
            max_waiters: DEFAULT_MAX_WAITERS,
            body_limit: DEFAULT_BODY_LIMIT,
            response_limit: DEFAULT_RESPONSE_LIMIT,
            replay_headers: DEFAULT_REPLAY_HEADERS.to_vec(),
            server_errors: ServerErrorPolicy::Record,
            in_doubt: InDoubtPolicy::OutcomeUnknown,
            fail_open: false,
            cancel_on_disconnect: false,
            retry_after: Duration::from_secs(1),
            on_outcome: None,
            #[cfg(feature = "postgres")]
            transactional: None,
        }
    }

    /// Who owns a key: a function of the request head giving the tenant or principal.
    /// Keys of different scopes never meet: another scope's key behaves exactly like an
    /// unused one (no `409`, no `422`, no replay).
    ///
    /// **Without a scope function**, the scope is a hash of the `Authorization` header, so
    /// every credential gets its own keys with no configuration, and a keyed request
    /// **without** `Authorization` is refused with `400`
    /// [`scope-missing`](problem::SCOPE_MISSING): there is no silent shared scope in which
    /// one anonymous caller, sending another's key and body, would be served the other's
    /// recorded response. Set a scope from your authenticated principal instead when your
    /// callers authenticate otherwise (cookie sessions, mTLS, API keys in other headers) or
    /// their tokens rotate between a request and its retry: put authentication **outside**
    /// this layer and read what it inserted into the request's extensions. A scope function
    /// is trusted: whatever it returns is the scope, `""` included.
    ///
    /// ```
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// let layer = IdempotencyLayer::server_builder(MemoryStore::new())
    ///     .scope(|parts| {
    ///         parts.headers.get("x-tenant-id").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned()
    ///     })
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    /// ```
    pub fn scope<F>(mut self, scope: F) -> Self
    where
        F: Fn(&Parts) -> String + Send + Sync + 'static,
    {
        self.scope = Scope::Custom(Arc::new(scope));
        self
    }

    /// One scope for every caller: any caller who sends another's key with the same request
    /// is served its recorded response. Choose it only when every caller is one principal
    /// (a service called by one trusted peer) or keys are unguessable secrets.
    ///
    /// ```
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// let layer = IdempotencyLayer::server_builder(MemoryStore::new()).unscoped().build().unwrap();
    /// # let _ = layer;
    /// ```
    pub fn unscoped(mut self) -> Self {
        self.scope = Scope::Unscoped;
        self
    }

    /// The methods that go through the ledger (default `POST` and `PATCH`). Safe methods
    /// (`GET`, `HEAD`, `OPTIONS`, `TRACE`) are refused at build time: they pass straight
    /// through without touching the ledger. An [`EffectClass`](crate::EffectClass) in a
    /// request's extensions (set by a layer outside this one) overrides the method.
    ///
    /// ```
    /// use http::Method;
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// let layer = IdempotencyLayer::server_builder(MemoryStore::new())
    ///     .side_effect_methods([Method::POST, Method::PATCH, Method::DELETE])
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    /// ```
    pub fn side_effect_methods(mut self, methods: impl IntoIterator<Item = Method>) -> Self {
        self.methods = methods.into_iter().collect();
        self
    }

    /// Answer `400` to a side-effecting request without an `Idempotency-Key` (the default,
    /// as the IETF draft recommends for endpoints documented to need one). With `false`,
    /// such requests pass through untouched, unprotected; a malformed key is still a `400`.
    pub fn require_key(mut self, require: bool) -> Self {
        self.require_key = require;
        self
    }

    /// How long a request may hold its key in flight without renewing it (default 10 s).
    /// While the handler runs, the layer renews the lease every third of it, so a slow
    /// handler is never taken for dead; the lease is how soon a key whose process died
    /// mid-handler reads as in doubt (see [`InDoubtPolicy`]).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long after it completes a key's record is never evicted from a store with a
    /// memory budget (default the lease plus 1 minute): cover your clients' retry windows.
    /// When the budget is full of such records, new keys get `503`
    /// [`ledger-full`](problem::LEDGER_FULL) rather than an outcome being forgotten.
    /// Clamped to the retention.
    pub fn protected_window(mut self, window: Duration) -> Self {
        self.protected = window;
        self
    }

    /// How long outcomes are kept for replay (default 24 h); must be longer than the lease.
    /// Make it outlast your clients' longest retry window. "Keep forever" (`Duration::MAX`)
    /// is accepted and held as about 139 years, as is any duration of the ledger longer
    /// than that (lease, protected window, busy wait).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// What a request finds when its key is in flight: `409` at once (the default,
    /// [`BusyPolicy::Fail`], as the IETF draft specifies), or wait up to a bound for the
    /// first request's outcome and replay it ([`BusyPolicy::Wait`]; still busy then, `409`
    /// with `Retry-After`).
    ///
    /// A waiting duplicate wakes when the first request's outcome lands, if the store can
    /// notify ([`MemoryStore`](crate::ledger::MemoryStore) does, in-process), else it polls
    /// the store with a backoff (5 ms doubling to 250 ms; [`RedisStore`](crate::ledger::redis)
    /// polls). It also wakes when the first request ends without an outcome: its key
    /// released (a `5xx` under [`ServerErrorPolicy::Release`], and the waiter runs the
    /// handler as the key's next owner) or in doubt (the waiter gets what
    /// [`InDoubtPolicy`] says). At most [`max_waiters`](Self::max_waiters) requests wait at
    /// once; beyond, `409` at once.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{ledger::MemoryStore, BusyPolicy, IdempotencyLayer};
    ///
    /// // Duplicates wait up to 5 s for the first request's response; at most 64 at a time.
    /// let layer = IdempotencyLayer::server_builder(MemoryStore::new())
    ///     .busy_policy(BusyPolicy::Wait(Duration::from_secs(5)))
    ///     .max_waiters(64)
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    /// ```
    pub fn busy_policy(mut self, policy: BusyPolicy) -> Self {
        self.busy = policy;
        self
    }

    /// How many requests may wait at once for in-flight keys under [`BusyPolicy::Wait`]
    /// (default [`DEFAULT_MAX_WAITERS`], across all keys of this layer). Each waiter holds
    /// its request and body, so the bound keeps a storm of duplicates from growing memory:
    /// past it, a duplicate gets its `409` at once.
    pub fn max_waiters(mut self, max: usize) -> Self {
        self.max_waiters = max;
        self
    }

    /// The largest request body of a keyed request (default 1 MiB). Larger ones get `413`
    /// before any lease is taken, from `Content-Length` when declared, else once the body
    /// passes the limit while it is read.
    pub fn body_limit(mut self, limit: usize) -> Self {
        self.body_limit = limit;
        self
    }

    /// The largest response recorded for replay (default 1 MiB). A larger response still
    /// reaches the first caller whole; the ledger keeps a tombstone, and a retry gets `410`
    /// [`response-not-recorded`](problem::RESPONSE_NOT_RECORDED), never a re-execution or a
    /// truncated body.
    pub fn response_limit(mut self, limit: usize) -> Self {
        self.response_limit = limit;
        self
    }

    /// The response headers recorded and replayed (replacing [`DEFAULT_REPLAY_HEADERS`]).
    /// Headers that must never be replayed are refused at build time: `Set-Cookie`,
    /// `WWW-Authenticate`, `Proxy-Authenticate`, `Authentication-Info`, `Authorization`,
    /// `Cookie`, `Date`, `Content-Length`, the hop-by-hop headers (`Connection`,
    /// `Keep-Alive`, `TE`, `Trailer`, `Transfer-Encoding`, `Upgrade`), and the layer's own
    /// (`Idempotent-Replayed`, `Idempotent-Request-Digest`, `Idempotency-Fail-Open`: the
    /// layer writes them, whatever the handler set).
    pub fn replay_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.replay_headers = headers.into_iter().collect();
        self
    }

    /// See [`ServerErrorPolicy`] (default [`Record`](ServerErrorPolicy::Record)).
    pub fn server_error_policy(mut self, policy: ServerErrorPolicy) -> Self {
        self.server_errors = policy;
        self
    }

    /// See [`InDoubtPolicy`] (default [`OutcomeUnknown`](InDoubtPolicy::OutcomeUnknown)).
    pub fn in_doubt_policy(mut self, policy: InDoubtPolicy) -> Self {
        self.in_doubt = policy;
        self
    }

    /// When the ledger is unavailable, run the handler anyway, unprotected, and mark the
    /// response `Idempotency-Fail-Open: true`, instead of answering `503`. Off by default:
    /// it trades exactly-once for availability.
    pub fn fail_open(mut self, fail_open: bool) -> Self {
        self.fail_open = fail_open;
        self
    }

    /// Whether a handler is cancelled when its client goes away (default `false`).
    ///
    /// By default the handler of a keyed request runs on its own task and finishes even if
    /// the connection closes (hyper drops the request future then): its outcome is recorded
    /// and the client's retry gets the replay. With `true`, the handler's future is dropped
    /// with the request, wherever it was; since it may have done part of its work, its key
    /// goes in doubt at once (see [`InDoubtPolicy`]).
    pub fn cancel_on_disconnect(mut self, cancel: bool) -> Self {
        self.cancel_on_disconnect = cancel;
        self
    }

    /// The `Retry-After` of `409` and `503` answers (default 1 s; sent in whole seconds,
    /// at least 1). A `409` never advises longer than the first request's remaining lease.
    pub fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = after;
        self
    }

    /// Call `hook` once per keyed request that reached the ledger, when its answer is
    /// known, with what it came to: the face, the decision, the key's digest, the status
    /// answered and how long it took. See [`OutcomeEvent`].
    ///
    /// For observability of your own. Unset, it costs nothing: no clock is read and no
    /// copy of the key is kept. The hook runs on the request's task, inside its span: keep
    /// it short and never block in it.
    ///
    /// ```
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// let layer = IdempotencyLayer::server_builder(MemoryStore::new())
    ///     .on_outcome(|event| eprintln!("{} {:?}", event.decision().as_str(), event.status()))
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
    /// Refuses a zero lease, a retention not longer than the lease (an in-flight record
    /// would vanish while its handler runs, letting a duplicate in), safe methods among the
    /// side-effecting ones, and headers that must never be replayed.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// let err = IdempotencyLayer::server_builder(MemoryStore::new())
    ///     .replay_headers([http::header::SET_COOKIE])
    ///     .build()
    ///     .unwrap_err();
    /// assert!(err.to_string().contains("set-cookie"));
    /// ```
    pub fn build(self) -> Result<IdempotencyLayer<ServerFace>, ConfigError> {
        if self.lease.is_zero() {
            return Err(ConfigError::new("the lease must be longer than zero"));
        }
        // Compared as the ledger will hold them (saturated): a lease and a retention that
        // both saturate are equal there.
        if self.retention.min(LONGEST) <= self.lease.min(LONGEST) {
            return Err(ConfigError::new(format!(
                "the retention ({:?}) must be longer than the lease ({:?})",
                self.retention, self.lease
            )));
        }
        if let Some(safe) = self
            .methods
            .iter()
            .find(|m| EffectClass::of_method(m) == EffectClass::Read)
        {
            return Err(ConfigError::new(format!(
                "{safe} is a safe method; it cannot be side-effecting"
            )));
        }
        if let Some(never) = self
            .replay_headers
            .iter()
            .find(|name| NEVER_REPLAYED.contains(&name.as_str()))
        {
            return Err(ConfigError::new(format!(
                "the {never} header must never be replayed"
            )));
        }
        #[cfg(feature = "postgres")]
        if self.fail_open && self.transactional.is_some() {
            // The handler's writes need the very database that is unavailable: running it
            // "unprotected" would only run it without its transaction.
            return Err(ConfigError::new(
                "fail_open cannot be combined with the transactional mode: the handler's \
                 writes go to the ledger's database",
            ));
        }
        let server = ServerFace {
            ledger: Ledger::with_max_waiters(
                self.store,
                self.lease,
                self.retention,
                self.protected,
                self.max_waiters,
            ),
            scope: self.scope,
            methods: self.methods,
            require_key: self.require_key,
            busy: self.busy,
            body_limit: self.body_limit,
            response_limit: self.response_limit,
            replay_headers: self.replay_headers,
            server_errors: self.server_errors,
            in_doubt: self.in_doubt,
            fail_open: self.fail_open,
            cancel_on_disconnect: self.cancel_on_disconnect,
            retry_after: self.retry_after,
            on_outcome: self.on_outcome,
            #[cfg(feature = "postgres")]
            transactional: self.transactional,
        };
        Ok(IdempotencyLayer::from_face(server))
    }
}

impl IdempotencyLayer<ServerFace> {
    /// The server layer with default settings over `store`.
    ///
    /// See the [module docs](crate::idempotency#the-server-face) and [`ServerBuilder`]
    /// for what the defaults are and why.
    ///
    /// ```
    /// use axum::{routing::post, Router};
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// // Around `POST` alone: axum's own 404 and 405 stay axum's.
    /// let charge = post(|| async { "charged" });
    /// let app: Router = Router::new()
    ///     .route("/charges", charge.route_layer(IdempotencyLayer::server(MemoryStore::new())));
    /// # let _ = app;
    /// ```
    pub fn server(store: impl IdempotencyStore) -> Self {
        Self::server_builder(store)
            .build()
            .expect("the default server settings are valid")
    }

    /// Configure the server layer over `store`.
    pub fn server_builder(store: impl IdempotencyStore) -> ServerBuilder {
        ServerBuilder::new(Arc::new(store))
    }

    /// An operator's handle on this layer's ledger: look at the record a request head
    /// (its `Idempotency-Key` and whatever the layer's scope reads, e.g. `Authorization`)
    /// leads to, as this layer keys it, and forget it, fenced. See
    /// [`Records`](crate::ledger::Records).
    ///
    /// ```
    /// use axum::http::Request;
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
    /// let layer = IdempotencyLayer::server(MemoryStore::new());
    /// let (head, ()) = Request::post("/charges")
    ///     .header("authorization", "Bearer tenant-1")
    ///     .header("idempotency-key", "\"order-17\"")
    ///     .body(())
    ///     .unwrap()
    ///     .into_parts();
    /// let records = layer.records();
    /// let key = records.request_key(&head).expect("keyed and scoped");
    /// assert!(records.inspect(key).await?.is_none());
    /// # Ok(())
    /// # }
    /// ```
    pub fn records(&self) -> crate::ledger::Records {
        let face = self.face().clone();
        let store = face.ledger.store.clone();
        crate::ledger::Records::server(store, move |head: &Parts| {
            let key = crate::key::HeaderKey::from_headers(&head.headers).ok()??;
            let scope = face.scope.of(head)?;
            Some(LedgerKey::server_of(&scope, key.as_bytes()))
        })
    }

    /// Configure the server layer in **transactional mode** over a PostgreSQL ledger
    /// (feature `postgres`): each keyed request runs in one transaction of `store`'s
    /// database, which the handler receives as a
    /// [`PostgresTransaction`](crate::ledger::PostgresTransaction) (a request extension,
    /// and an axum extractor with feature `axum`). Its writes and the recorded response
    /// commit together, so an effect can never happen with its outcome lost.
    ///
    /// - The claim is the transaction's first statement, sent with `BEGIN`; the record is
    ///   sent with `COMMIT`: no round trip besides the transaction's own.
    /// - The transaction commits when the handler answers below `500` and did not call
    ///   [`set_rollback_only`](crate::ledger::PostgresTransaction::set_rollback_only).
    ///   A `5xx`, an error, a panic or a rollback request rolls everything back and records
    ///   nothing: the key is free, and a retry runs the handler again (the
    ///   [`ServerErrorPolicy`] does not apply: the rollback proves nothing happened).
    /// - A process that dies before the commit leaves nothing (PostgreSQL rolls back), so
    ///   no key is ever left in doubt by this mode.
    /// - A duplicate arriving while the first runs is answered `409` at once under
    ///   [`BusyPolicy::Fail`] (the default); under [`BusyPolicy::Wait`] it waits for the
    ///   commit, up to the bound, and replays it (still busy then, `409`). Waiters hold no
    ///   pooled connection and count against [`max_waiters`](ServerBuilder::max_waiters).
    /// - A commit PostgreSQL refuses is answered `503`
    ///   [`ledger-unavailable`](problem::LEDGER_UNAVAILABLE) (nothing happened); a commit
    ///   whose answer is lost, `503` [`commit-unknown`](problem::COMMIT_UNKNOWN) (it may
    ///   have happened). Both carry `Retry-After`: the retry replays the record or,
    ///   finding none, runs again.
    ///
    /// Every other setting of [`ServerBuilder`] applies as usual. Only the transaction's
    /// writes are covered: calls the handler makes to other systems are not undone by a
    /// rollback, and must carry the key themselves.
    ///
    /// ```no_run
    /// use axum::{http::StatusCode, routing::post, Router};
    /// use tower_idempotency::ledger::{PostgresStore, PostgresTransaction};
    /// use tower_idempotency::IdempotencyLayer;
    ///
    /// async fn transfer(tx: PostgresTransaction) -> StatusCode {
    ///     let Ok(client) = tx.client().await else { return StatusCode::SERVICE_UNAVAILABLE };
    ///     match client.execute("UPDATE accounts SET balance = balance - 10 WHERE id = 1", &[]).await {
    ///         Ok(_) => StatusCode::NO_CONTENT,
    ///         Err(_) => StatusCode::INTERNAL_SERVER_ERROR, // rolled back, nothing recorded
    ///     }
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let store = PostgresStore::connect("postgres://app@127.0.0.1/bank").await?;
    /// store.migrate().await?;
    /// let layer = IdempotencyLayer::transactional_server_builder(store).build()?;
    /// let app: Router = Router::new().route("/transfers", post(transfer).route_layer(layer));
    /// # let _ = app;
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(feature = "postgres")]
    #[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
    pub fn transactional_server_builder(store: crate::ledger::PostgresStore) -> ServerBuilder {
        let mut builder = ServerBuilder::new(Arc::new(store.clone()));
        builder.transactional = Some(store);
        builder
    }
}

impl ServerFace {
    fn is_side_effect<B>(&self, req: &Request<B>) -> bool {
        match req.extensions().get::<EffectClass>() {
            Some(class) => class.is_side_effect(),
            None => self.methods.contains(req.method()),
        }
    }

    /// The allowed name a response header named `name` (in lower case, as names are held)
    /// is replayed under, if it is: cloned from the allow-list, never parsed again.
    fn replays(&self, name: &[u8]) -> Option<&HeaderName> {
        self.replay_headers
            .iter()
            .find(|allowed| allowed.as_str().as_bytes() == name)
    }

    /// The headers to record of a response: the allowed ones, in order, then the request's
    /// `digest` field. Written into one buffer of exactly their size; a replay adds its
    /// `Idempotent-Replayed: true` (see [`replayed_headers`](Self::replayed_headers)).
    fn recorded_headers(&self, response: &HeaderMap, digest: &[u8]) -> HeaderBlock {
        let digest_name = IDEMPOTENT_REQUEST_DIGEST.as_str().as_bytes();
        let kept = || {
            response
                .iter()
                .filter(|(name, _)| self.replay_headers.contains(name))
        };
        let size = entries_size(kept()) + entry_size(digest_name.len(), digest.len());
        let mut block = BlockWriter::with_capacity(size);
        for (name, value) in kept() {
            block.push(name, value);
        }
        block.push_checked(digest_name, digest, false);
        block.finish()
    }

    /// The headers a replay of `stored` carries: the allowed ones, the request's digest
    /// (its first value) and one `Idempotent-Replayed: true`. Filtered on every replay, so
    /// a record made by an earlier release (which held the mark), under another replica's
    /// wider allow-list, or by a store of one's own replays only what this layer allows.
    fn replayed_headers(&self, stored: &StoredResponse) -> HeaderMap {
        let block = stored.header_block();
        let mut headers = block.map_sized_for(1);
        let mut digest_kept = false;
        for entry in block.entries() {
            let name = if entry.name == IDEMPOTENT_REQUEST_DIGEST.as_str().as_bytes() {
                if std::mem::replace(&mut digest_kept, true) {
                    continue;
                }
                IDEMPOTENT_REQUEST_DIGEST.clone()
            } else if entry.name == IDEMPOTENT_REPLAYED.as_str().as_bytes() {
                // An earlier release's record holds its mark; the replay adds its own.
                continue;
            } else {
                match self.replays(entry.name) {
                    Some(allowed) => allowed.clone(),
                    None => continue,
                }
            };
            // Never stops early: see `HeaderBlock::to_map`.
            if headers.try_append(name, block.value(&entry)).is_err() {
                break;
            }
        }
        headers.append(
            IDEMPOTENT_REPLAYED.clone(),
            HeaderValue::from_static("true"),
        );
        headers
    }
}

impl<S, B, ResBody> Service<Request<B>> for Idempotency<S, ServerFace>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ServerFuture<S, B, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let server = &*self.face;
        // Reads and keyless requests cost one method check: no span, no box, no buffering.
        if !server.is_side_effect(&req) {
            return ServerFuture::pass_through(self.inner.call(req.map(RequestBody::streaming)));
        }
        let head = KeyedHead::of(req.headers());
        let key = match head.key {
            Ok(Some(key)) => key,
            Ok(None) if !server.require_key => {
                return ServerFuture::pass_through(
                    self.inner.call(req.map(RequestBody::streaming)),
                );
            }
            Ok(None) => {
                tracing::debug!(outcome = "key-missing", method = %req.method(), "refused: no Idempotency-Key");
                return ServerFuture::answer(problem::key_missing(req.method()));
            }
            Err(invalid) => {
                tracing::debug!(outcome = "key-invalid", %invalid, "refused: malformed Idempotency-Key");
                return ServerFuture::answer(problem::key_invalid(&invalid));
            }
        };
        let span = request_span!(
            face = "server",
            key = tracing::field::Empty,
            outcome = tracing::field::Empty,
            settled = tracing::field::Empty,
        );
        let admit = {
            let _entered = span.enter();
            let (parts, body) = req.into_parts();
            let (ledger_key, scope_id) = {
                // The scope stays in this block: it may name a tenant, and neither logs nor
                // the ledger ever see it, only the hashes it goes into (the second, short,
                // gives the scope its share of a store's budget).
                let Some(scope) = server.scope.of(&parts) else {
                    outcome("scope-missing");
                    return ServerFuture::answer(problem::scope_missing());
                };
                (
                    LedgerKey::server_of(&scope, key.as_bytes()),
                    scope_id(&scope),
                )
            };
            // Read and limit the body before any lease is taken: a refused body leaves the
            // key unused.
            if let Err(err) = check_length(head.declared_length, &body, server.body_limit) {
                return ServerFuture::answer(admit::refused_body(server, &err));
            }
            let collect = CollectRequest::checked(parts, body, server.body_limit);
            let started = server.on_outcome.is_some().then(tokio::time::Instant::now);
            let clone = self.inner.clone();
            let inner = std::mem::replace(&mut self.inner, clone);
            let digest_sent = head.content_digest;
            Admit::new(
                inner,
                self.face.clone(),
                (key, ledger_key, scope_id),
                digest_sent,
                collect,
                started,
            )
        };
        let detach = !self.face.cancel_on_disconnect;
        ServerFuture::keyed(Keyed::new(admit, span, detach))
    }
}

pin_project! {
    /// The future of the server [`IdempotencyLayer`].
    ///
    /// Requests outside the ledger poll the inner service's future in place. A keyed
    /// request's ledger part (its body, the claim, a replay or a refusal) runs in place
    /// too; once its key is owned, its handler's part is boxed (one allocation), so that
    /// it can finish in the background when the client goes away.
    pub struct ServerFuture<S, B, ResB>
    where
        S: Service<Request<RequestBody<B>>, Response = Response<ResB>>,
    {
        #[pin]
        kind: FutureKind<S, B, ResB>,
    }
}

pin_project! {
    #[project = FutureKindProj]
    enum FutureKind<S, B, ResB>
    where
        S: Service<Request<RequestBody<B>>, Response = Response<ResB>>,
    {
        PassThrough { #[pin] future: S::Future },
        Answer { response: Option<Response<ResponseBody<ResB>>> },
        Keyed { #[pin] keyed: Keyed<S, B, ResB> },
    }
}

impl<S, B, ResB> ServerFuture<S, B, ResB>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>>,
{
    fn pass_through(future: S::Future) -> Self {
        Self {
            kind: FutureKind::PassThrough { future },
        }
    }

    fn answer(response: Response<ResponseBody<ResB>>) -> Self {
        Self {
            kind: FutureKind::Answer {
                response: Some(response),
            },
        }
    }

    fn keyed(keyed: Keyed<S, B, ResB>) -> Self {
        Self {
            kind: FutureKind::Keyed { keyed },
        }
    }
}

impl<S, B, ResB> Future for ServerFuture<S, B, ResB>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Unpin + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Output = Result<Response<ResponseBody<ResB>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            FutureKindProj::PassThrough { future } => {
                future.poll(cx).map_ok(|r| r.map(ResponseBody::inner))
            }
            FutureKindProj::Answer { response } => Poll::Ready(Ok(response
                .take()
                .expect("ServerFuture polled after completion"))),
            FutureKindProj::Keyed { keyed } => keyed.poll(cx),
        }
    }
}

impl<S, B, ResB> fmt::Debug for ServerFuture<S, B, ResB>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            FutureKind::PassThrough { .. } => "PassThrough",
            FutureKind::Answer { .. } => "Answer",
            FutureKind::Keyed { .. } => "Keyed",
        };
        f.debug_struct("ServerFuture").field("kind", &kind).finish()
    }
}

/// Record what the layer decided for this request (once per request).
fn outcome(what: &'static str) {
    record_in_layer_span("outcome", what);
}

/// Record how a handler run's lease was settled (once per run).
fn settled(how: &'static str) {
    record_in_layer_span("settled", how);
}

/// The body's SHA-256: the sender's, once checked, when its `Content-Digest` carries one
/// (`sent`: the request has that header); else computed here. Every `sha-256` and `sha-512`
/// member must match the body, unless a layer in front decoded it (see [`decoded_in_front`]):
/// the digest is then of bytes this layer never sees, and the body is fingerprinted as
/// received, as if no digest had come.
fn verified_body_digest(
    headers: &HeaderMap,
    sent: bool,
    body: &[u8],
) -> Result<BodyDigest, DigestError> {
    debug_assert_eq!(sent, headers.contains_key(&CONTENT_DIGEST));
    if !sent {
        return Ok(BodyDigest::of(body));
    }
    let field = ContentDigest::of_headers(headers)?;
    match field.verify(body) {
        Ok(verified) => Ok(verified.unwrap_or_else(|| BodyDigest::of(body))),
        Err(err) if err.is_mismatch() && decoded_in_front(headers) => {
            tracing::debug!(
                "the Content-Digest is not of the body received, whose framing headers a layer \
                 in front removed (request decompression): not verified"
            );
            Ok(BodyDigest::of(body))
        }
        Err(err) => Err(err),
    }
}

/// Whether a layer in front of this one may have decoded the body: it carries neither
/// `Content-Length` nor `Transfer-Encoding`, nor a `Content-Encoding` still to decode.
///
/// `Content-Digest` is over the content as sent, content coding applied (RFC 9530 §2).
/// Request decompression (tower-http's `RequestDecompressionLayer`) decodes the body and
/// removes `Content-Encoding` and `Content-Length`, and leaves the `Content-Digest` of the
/// encoded bytes behind: checked against the decoded body, it would refuse every compressed
/// request. A body as received over HTTP/1.1 always has its framing (one of the two
/// headers), so a mismatch with it present is a body that is not what its sender digested.
/// Without them (a decoded body; HTTP/2 senders that declare no length; requests made
/// in-process) the digest cannot be told from one of other bytes, and a `400` that drops
/// the request would be wrong for the first.
fn decoded_in_front(headers: &HeaderMap) -> bool {
    !headers.contains_key(header::CONTENT_LENGTH)
        && !headers.contains_key(header::TRANSFER_ENCODING)
        && !headers.contains_key(header::CONTENT_ENCODING)
}

/// The transaction a claim was made in (transactional mode), if any. Dropped unused (a
/// replay, a refusal) it rolls back.
#[cfg(feature = "postgres")]
type Transaction = Option<crate::ledger::postgres::OpenTransaction>;
#[cfg(not(feature = "postgres"))]
type Transaction = Option<std::convert::Infallible>;

/// What running the handler as the key's owner needs.
struct Owned<S, B> {
    /// The instance our caller polled ready (taken in `call`).
    inner: S,
    server: Arc<ServerFace>,
    key: (LedgerKey, BodyDigest),
    token: LeaseToken,
    transaction: Transaction,
    request: Request<RequestBody<B>>,
    report: Report,
}

/// What the [`on_outcome`](ServerBuilder::on_outcome) hook hears of, once the request is
/// answered.
struct Report {
    track: Track,
    hook: Option<OutcomeHook>,
    started: Option<tokio::time::Instant>,
}

impl Report {
    fn answered<T, E>(&self, answered: &Result<Response<T>, E>) {
        let status = answered.as_ref().ok().map(|response| response.status());
        self.track.report(self.hook.as_ref(), self.started, status);
    }
}

async fn call<S, B, ResBody>(
    mut inner: S,
    request: Request<RequestBody<B>>,
) -> Result<Response<ResBody>, S::Error>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResBody>>,
{
    // `inner` is the instance our caller polled ready (taken in `call`).
    inner.call(request).await
}

fn replay<T>(server: &ServerFace, stored: Outcome) -> Response<ResponseBody<T>> {
    match stored {
        Outcome::Response(stored) => {
            outcome("replayed");
            let mut response = Response::new(ResponseBody::buffered(stored.body()));
            *response.status_mut() = stored.status();
            *response.headers_mut() = server.replayed_headers(&stored);
            response
        }
        Outcome::Tombstone { status } => {
            outcome("response-not-recorded");
            problem::response_not_recorded(status)
        }
        // Outcomes added later are not replayable by this release.
        #[allow(unreachable_patterns)]
        _ => {
            outcome("response-not-recorded");
            problem::outcome_unknown()
        }
    }
}

/// What to record of a buffered response, the body to send, and how it was settled.
fn recording<ResBody>(
    server: &ServerFace,
    parts: &http::response::Parts,
    buffered: Buffered<ResBody>,
    digest: &BodyDigest,
) -> (Outcome, ResponseBody<ResBody>, &'static str) {
    let status = parts.status;
    match buffered {
        Buffered::Whole(bytes) => {
            // Replays say which request they answer (see `crate::digest`).
            let headers = server.recorded_headers(&parts.headers, &digest.field());
            let stored = StoredResponse::of_block(status, parts.version, headers, bytes.clone());
            (
                Outcome::Response(stored),
                ResponseBody::buffered(bytes),
                "recorded",
            )
        }
        Buffered::Overflow(prefix, rest) => {
            tracing::info!(
                limit = server.response_limit,
                "response over the recording cap; keeping a tombstone"
            );
            (
                Outcome::Tombstone { status },
                ResponseBody::overflow(prefix, rest),
                "tombstone",
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::MemoryStore;
    use http::{StatusCode, Version};

    #[test]
    fn build_refuses_unsafe_settings() {
        let builder = || IdempotencyLayer::server_builder(MemoryStore::new());
        assert!(builder()
            .side_effect_methods([Method::GET])
            .build()
            .is_err());
        assert!(builder()
            .side_effect_methods([Method::PUT, Method::DELETE])
            .build()
            .is_ok());
        assert!(builder().replay_headers([header::DATE]).build().is_err());
        assert!(builder()
            .replay_headers([header::TRANSFER_ENCODING])
            .build()
            .is_err());
        // The layer's own headers: a replay carries the request's digest and one mark.
        for own in [&IDEMPOTENT_REQUEST_DIGEST, &IDEMPOTENT_REPLAYED] {
            let err = builder().replay_headers([own.clone()]).build().unwrap_err();
            assert!(err.to_string().contains(own.as_str()), "{err}");
        }
        assert!(builder().lease(Duration::ZERO).build().is_err());
        let err = builder()
            .lease(Duration::from_secs(10))
            .retention(Duration::from_secs(10))
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("retention"));
    }

    fn replayed(face: &ServerFace, recorded: HeaderMap) -> HeaderMap {
        let stored = StoredResponse::new(StatusCode::OK, Version::HTTP_11, recorded, Bytes::new());
        face.replayed_headers(&stored)
    }

    #[test]
    fn only_allow_listed_headers_are_recorded() {
        let service = tower_layer::Layer::layer(&IdempotencyLayer::server(MemoryStore::new()), ());
        let digest = b"sha-256=:AAAA:";
        // A handler's own digest header is never recorded: the record's is the request's.
        let handlers = HeaderValue::from_static("sha-256=:from-the-handler:");
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert(
            header::SET_COOKIE,
            HeaderValue::from_static("session=secret"),
        );
        headers.append(header::LINK, HeaderValue::from_static("</a>; rel=a"));
        headers.append(header::LINK, HeaderValue::from_static("</b>; rel=b"));
        let mut with_handlers = headers.clone();
        with_handlers.insert(IDEMPOTENT_REQUEST_DIGEST.clone(), handlers);
        let kept = service
            .face
            .recorded_headers(&with_handlers, digest)
            .to_map();
        assert_eq!(kept.len(), 4);
        assert!(kept.get(header::SET_COOKIE).is_none());
        assert_eq!(kept.get_all(header::LINK).iter().count(), 2);
        assert_eq!(kept[&IDEMPOTENT_REQUEST_DIGEST], "sha-256=:AAAA:");
        assert!(
            kept.get(&IDEMPOTENT_REPLAYED).is_none(),
            "each replay adds it"
        );

        // Every header allowed: kept whole, every value of every name in its order.
        headers.remove(header::SET_COOKIE);
        let mut kept = service.face.recorded_headers(&headers, digest).to_map();
        kept.remove(&IDEMPOTENT_REQUEST_DIGEST);
        assert_eq!(kept, headers);
        let order = |map: &HeaderMap| {
            map.get_all(header::LINK)
                .iter()
                .cloned()
                .collect::<Vec<_>>()
        };
        assert_eq!(order(&kept), order(&headers));
    }

    #[test]
    fn a_replay_carries_the_allowed_headers_the_digest_and_the_replay_mark() {
        let service = tower_layer::Layer::layer(&IdempotencyLayer::server(MemoryStore::new()), ());
        let digest = HeaderValue::from_static("sha-256=:AAAA:");
        let mut response = HeaderMap::new();
        response.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        response.append(header::LINK, HeaderValue::from_static("</a>; rel=a"));
        response.append(header::LINK, HeaderValue::from_static("</b>; rel=b"));
        response.insert(
            header::SET_COOKIE,
            HeaderValue::from_static("session=secret"),
        );
        let block = service.face.recorded_headers(&response, digest.as_bytes());
        let stored =
            StoredResponse::of_block(StatusCode::OK, Version::HTTP_11, block, Bytes::new());
        let mut expected = response.clone();
        expected.remove(header::SET_COOKIE);
        expected.insert(IDEMPOTENT_REQUEST_DIGEST.clone(), digest.clone());
        expected.insert(
            IDEMPOTENT_REPLAYED.clone(),
            HeaderValue::from_static("true"),
        );
        assert_eq!(service.face.replayed_headers(&stored), expected);
        let recorded = stored.headers();

        // A record of an earlier release (which held the mark), one made under a wider
        // allow-list, or one marked otherwise replays only what this one allows, marked.
        let mut earlier = recorded.clone();
        earlier.insert(
            IDEMPOTENT_REPLAYED.clone(),
            HeaderValue::from_static("true"),
        );
        assert_eq!(replayed(&service.face, earlier), expected);
        let mut wider = recorded.clone();
        wider.insert(
            header::SET_COOKIE,
            HeaderValue::from_static("session=secret"),
        );
        wider.insert("x-internal", HeaderValue::from_static("1"));
        assert_eq!(replayed(&service.face, wider), expected);
        let mut unmarked = recorded.clone();
        unmarked.insert(
            IDEMPOTENT_REPLAYED.clone(),
            HeaderValue::from_static("false"),
        );
        assert_eq!(replayed(&service.face, unmarked), expected);
        // Whatever the record holds, a replay carries one mark and one digest: the first.
        let mut repeated = recorded.clone();
        repeated.append(
            IDEMPOTENT_REPLAYED.clone(),
            HeaderValue::from_static("true"),
        );
        repeated.append(
            IDEMPOTENT_REQUEST_DIGEST.clone(),
            HeaderValue::from_static("x"),
        );
        let replayed = replayed(&service.face, repeated);
        assert_eq!(replayed, expected);
        assert_eq!(replayed.get_all(&IDEMPOTENT_REPLAYED).iter().count(), 1);
        assert_eq!(
            replayed.get_all(&IDEMPOTENT_REQUEST_DIGEST).iter().count(),
            1
        );
    }
}
