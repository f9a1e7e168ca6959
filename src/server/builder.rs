//! [`Builder`]: the server face's settings, checked once by `build`, and the
//! [`IdempotencyLayer`] constructors that start from it.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::header::HeaderName;
use http::request::Parts;
use http::{Method, StatusCode};

use super::face::ServerFace;
use super::policy::{InDoubtPolicy, ServerErrorPolicy};
use super::replay::{DEFAULT_REPLAY_HEADERS, NEVER_REPLAYED};
use crate::effect::EffectClass;
use crate::frozen::DEFAULT_BODY_LIMIT;
use crate::idempotency::decision::{OutcomeEvent, OutcomeHook};
use crate::idempotency::engine::{BusyPolicy, Ledger, DEFAULT_LEASE, DEFAULT_RETENTION, LONGEST};
use crate::idempotency::scope::Scope;
use crate::ledger::IdempotencyStore;
use crate::ConfigError;
use crate::IdempotencyLayer;

/// The default bound on requests waiting at once for in-flight keys under
/// [`BusyPolicy::Wait`] (see [`Builder::max_waiters`]).
const MAX_WAITERS: usize = 256;

/// The default protected window of a server record, besides the lease: how long after it
/// completes it is never evicted from a store with a memory budget, so the clients' retries
/// find it. A minute covers a client's automatic retries (this crate's default retry window
/// is 30 s, and SDKs' are shorter); a caller that comes back later (an orchestrator resuming
/// after a crash) needs a durable store, where nothing is evicted, not a longer window here.
const PROTECTED_AFTER_COMPLETION: Duration = Duration::from_secs(60);

/// The default cap on a recorded response (1 MiB).
const RESPONSE_LIMIT: usize = 1024 * 1024;

/// Configures the server [`IdempotencyLayer`]; [`build`](Builder::build) checks the
/// settings.
///
/// | setting | default |
/// |---|---|
/// | [scope](Builder::scope) | a hash of the `Authorization` header; a keyed request without one gets `400` [`scope-missing`](super::problem::SCOPE_MISSING) |
/// | [side-effecting methods](Builder::side_effect_methods) | `POST`, `PATCH` |
/// | [key required](Builder::require_key) on them | yes: `400` without one |
/// | [lease](Builder::lease) (renewed while the handler runs) | 10 s |
/// | [retention](Builder::retention) | 24 h |
/// | [protected window](Builder::protected_window) (never evicted) | lease + 1 min |
/// | [busy key](Builder::busy_policy) | `409` at once ([`BusyPolicy::Fail`]) |
/// | [waiters](Builder::max_waiters) under [`BusyPolicy::Wait`] | at most 256 at once, then `409` |
/// | [request body limit](Builder::body_limit) | 1 MiB (`413`) |
/// | [recorded response cap](Builder::response_limit) | 1 MiB (larger: sent whole, kept as a tombstone) |
/// | [replayed headers](Builder::replay_headers) | `Content-Type`, `Location`, `ETag` and the other headers that describe the representation, and `Retry-After` |
/// | [handler `5xx`](Builder::server_error_policy) | [`ServerErrorPolicy::Record`]; a `503` with `Retry-After` is released |
/// | [answers released](Builder::release_statuses), not recorded | `406`, `412`, `415`, `428`, `429`, `431`: refused before processing; and any answer marked [`NotProcessed`](super::NotProcessed) |
/// | [in-doubt key](Builder::in_doubt_policy) | [`InDoubtPolicy::OutcomeUnknown`] |
/// | [ledger unavailable](Builder::fail_open) | fail closed (`503`) |
/// | [client goes away](Builder::cancel_on_disconnect) | the handler runs to completion |
/// | [`Retry-After`](Builder::retry_after) of `409`/`503` | 1 s |
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
pub struct Builder {
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
    released: Vec<StatusCode>,
    in_doubt: InDoubtPolicy,
    fail_open: bool,
    cancel_on_disconnect: bool,
    retry_after: Duration,
    on_outcome: Option<OutcomeHook>,
    #[cfg(feature = "postgres")]
    transactional: Option<crate::ledger::PostgresStore>,
}

/// The answers released by default (see [`Builder::release_statuses`]): each refuses a
/// request before processing it, for what it said in headers the fingerprint leaves out
/// (`Accept`, preconditions, `Content-Type`, their size) or for the server's load.
const RELEASED_BY_DEFAULT: [StatusCode; 6] = [
    StatusCode::NOT_ACCEPTABLE,
    StatusCode::PRECONDITION_FAILED,
    StatusCode::UNSUPPORTED_MEDIA_TYPE,
    StatusCode::PRECONDITION_REQUIRED,
    StatusCode::TOO_MANY_REQUESTS,
    StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
];

impl fmt::Debug for Builder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Builder")
            .field("store", &self.store)
            .field("methods", &self.methods)
            .field("require_key", &self.require_key)
            .field("lease", &self.lease)
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}

impl Builder {
    fn new(store: Arc<dyn IdempotencyStore>) -> Self {
        Self {
            store,
            scope: Scope::Authorization,
            methods: vec![Method::POST, Method::PATCH],
            require_key: true,
            lease: DEFAULT_LEASE,
            retention: DEFAULT_RETENTION,
            protected: DEFAULT_LEASE + PROTECTED_AFTER_COMPLETION,
            busy: BusyPolicy::Fail,
            max_waiters: MAX_WAITERS,
            body_limit: DEFAULT_BODY_LIMIT,
            response_limit: RESPONSE_LIMIT,
            replay_headers: DEFAULT_REPLAY_HEADERS.to_vec(),
            server_errors: ServerErrorPolicy::Record,
            released: RELEASED_BY_DEFAULT.to_vec(),
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
    /// every credential gets its own keys with no configuration (its auth-scheme compared
    /// case-insensitively and whatever the spaces after it, as HTTP compares it; its
    /// credentials exactly), and a keyed request
    /// **without** `Authorization` is refused with `400`
    /// [`scope-missing`](super::problem::SCOPE_MISSING): there is no silent shared scope in which
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
    /// While the handler runs, the layer renews the lease every third of it (or, on a store
    /// that [holds leases](crate::ledger::IdempotencyStore::hold_lease), such as
    /// `MemoryStore`, has it held until the request lets go), so a slow handler is never
    /// taken for dead; the lease is how soon a key whose process died mid-handler reads as
    /// in doubt (see [`InDoubtPolicy`]).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How long after it completes a key's record is never evicted from a store with a
    /// memory budget (default the lease plus 1 minute): cover your clients' retry windows.
    /// When the budget is full of such records, new keys get `503`
    /// [`ledger-full`](super::problem::LEDGER_FULL) rather than an outcome being forgotten.
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
    /// released (a `5xx` under [`ServerErrorPolicy::Release`], an answer of
    /// [`release_statuses`](Self::release_statuses); the waiter runs the handler as the
    /// key's next owner) or in doubt (the waiter gets what
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
    /// (default 256, across all keys of this layer). Each waiter holds
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
    /// [`response-not-recorded`](super::problem::RESPONSE_NOT_RECORDED), never a re-execution or a
    /// truncated body.
    pub fn response_limit(mut self, limit: usize) -> Self {
        self.response_limit = limit;
        self
    }

    /// The response headers recorded and replayed, replacing the default list.
    ///
    /// By default: `Content-Type`, `Content-Encoding`, `Content-Language`,
    /// `Content-Location`, `Location`, `ETag`, `Last-Modified`, `Cache-Control`, `Vary`,
    /// `Link`, which describe the representation and where it lives and stay true when
    /// replayed, and `Retry-After` (**a changed default**: earlier versions left it out, so a replay lost it): a replayed `202`,
    /// `3xx` or `5xx` keeps the `Retry-After` it was recorded with, since it is part of what
    /// the answer tells its caller. Left out on purpose: `Expires` (a date the first
    /// response computed) and `Content-Length` (recomputed from the body). A list of your
    /// own replaces the defaults: name `Retry-After` in it to keep it.
    ///
    /// Headers that must never be replayed are refused at build time: `Set-Cookie`,
    /// `WWW-Authenticate`, `Proxy-Authenticate`, `Authentication-Info`, `Authorization`,
    /// `Cookie`, `Date`, `Content-Length`, the hop-by-hop headers (`Connection`,
    /// `Keep-Alive`, `TE`, `Trailer`, `Transfer-Encoding`, `Upgrade`), and the layer's own
    /// (`Idempotent-Replayed`, `Idempotent-Request-Digest`, `Idempotency-Fail-Open`: the
    /// layer writes them, whatever the handler set).
    ///
    /// ```
    /// use http::header::{self, HeaderName};
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// // Replay what a charge's client needs, and a request id header of our own.
    /// let layer = IdempotencyLayer::server_builder(MemoryStore::new())
    ///     .replay_headers([
    ///         header::CONTENT_TYPE,
    ///         header::LOCATION,
    ///         HeaderName::from_static("x-charge-id"),
    ///     ])
    ///     .build()
    ///     .unwrap();
    /// # let _ = layer;
    /// ```
    pub fn replay_headers(mut self, headers: impl IntoIterator<Item = HeaderName>) -> Self {
        self.replay_headers = headers.into_iter().collect();
        self
    }

    /// See [`ServerErrorPolicy`] (default [`Record`](ServerErrorPolicy::Record)). Behind
    /// the gRPC server layer (feature `tonic`), the gRPC status codes it counts as server
    /// errors are in the `grpc` module's docs.
    pub fn server_error_policy(mut self, policy: ServerErrorPolicy) -> Self {
        self.server_errors = policy;
        self
    }

    /// The answers that say the request was refused before it was processed: released, not
    /// recorded, so the same key with the same bytes runs once the caller has fixed what
    /// was refused. Default: `406`, `412`, `415`, `428`, `429` and `431`: each refuses a
    /// request for what its headers said (`Accept`, a precondition, `Content-Type`, their
    /// size), which the fingerprint leaves out, or for the server's load. Recorded, an
    /// extractor's `415` (axum's `Json` without `Content-Type: application/json`) or an
    /// inner rate limiter's `429` would be replayed to the corrected request for the whole
    /// retention, and the handler would never run. Any other answer is the key's outcome
    /// (a `400` or `422` too: the same bytes get the same answer), and a `2xx` always is.
    ///
    /// A handler that answers one of these after acting must not be released: take the
    /// status out (`release_statuses([])` records every answer). In the transactional mode
    /// a released answer rolls the handler's transaction back.
    ///
    /// Besides this list, two answers are always released: a `503` with `Retry-After` (a
    /// refusal for load, like a `429`; recorded, it would be replayed for the whole retention
    /// and the key would be stuck), and any answer the handler marked
    /// [`NotProcessed`](super::NotProcessed), whatever its status.
    ///
    /// ```
    /// use http::StatusCode;
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// // The defaults, and `403`: this API's authorization refuses before anything runs.
    /// let layer = IdempotencyLayer::server_builder(MemoryStore::new())
    ///     .release_statuses([
    ///         StatusCode::FORBIDDEN,
    ///         StatusCode::NOT_ACCEPTABLE,
    ///         StatusCode::PRECONDITION_FAILED,
    ///         StatusCode::UNSUPPORTED_MEDIA_TYPE,
    ///         StatusCode::PRECONDITION_REQUIRED,
    ///         StatusCode::TOO_MANY_REQUESTS,
    ///         StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
    ///     ])
    ///     .build();
    /// assert!(layer.is_ok());
    /// ```
    pub fn release_statuses(mut self, statuses: impl IntoIterator<Item = StatusCode>) -> Self {
        self.released = statuses.into_iter().collect();
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
        // A zero lease is born expired: every claim would read as in doubt at once, and the
        // first duplicate would find an owner that is still working "dead".
        if self.lease.is_zero() {
            return Err(ConfigError::new("the lease must be longer than zero"));
        }
        // A record must outlive its owner's lease: one that expired first would vanish under
        // a running handler, and a duplicate would find the key free and run it again.
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
            released: self.released,
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
    /// See the [module docs](super) and [`Builder`]
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
    pub fn server_builder(store: impl IdempotencyStore) -> Builder {
        Builder::new(Arc::new(store))
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
    ///   pooled connection and count against [`max_waiters`](Builder::max_waiters).
    /// - A commit PostgreSQL refuses is answered `503`
    ///   [`ledger-unavailable`](super::problem::LEDGER_UNAVAILABLE) (nothing happened); a commit
    ///   whose answer is lost, `503` [`commit-unknown`](super::problem::COMMIT_UNKNOWN) (it may
    ///   have happened). Both carry `Retry-After`: the retry replays the record or,
    ///   finding none, runs again.
    ///
    /// Every other setting of [`Builder`] applies as usual. Only the transaction's
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
    pub fn transactional_server_builder(store: crate::ledger::PostgresStore) -> Builder {
        let mut builder = Builder::new(Arc::new(store.clone()));
        builder.transactional = Some(store);
        builder
    }
}

/// The server [`IdempotencyLayer`](crate::IdempotencyLayer), as [`IdempotencyLayer::server`](crate::IdempotencyLayer::server) and
/// [`Builder::build`] return it.
///
/// ```
/// use tower_idempotency::{ledger::MemoryStore, server::ServerLayer, IdempotencyLayer};
///
/// let layer: ServerLayer = IdempotencyLayer::server(MemoryStore::new());
/// # let _ = layer;
/// ```
pub type ServerLayer = IdempotencyLayer<ServerFace>;

#[cfg(test)]
mod tests {
    use http::header;

    use super::*;
    use crate::digest::IDEMPOTENT_REQUEST_DIGEST;
    use crate::ledger::MemoryStore;
    use crate::server::IDEMPOTENT_REPLAYED;

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
}
