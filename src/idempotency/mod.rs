//! Exactly-once side effects: a ledger consulted before the effect fires.
//!
//! [`IdempotencyLayer`] has two faces over one ledger engine.
//!
//! # The client face
//!
//! For an orchestrator calling tools over HTTP. Put it **outside** the
//! [`FrozenRetryLayer`](crate::FrozenRetryLayer): the ledger is then consulted once per
//! logical operation, and the retries inside reuse its key and its frozen bytes (the body is
//! buffered and hashed once, by this layer; the retry layer picks up what it froze).
//!
//! For each side-effecting request (see [`EffectClass`](crate::EffectClass)):
//!
//! 1. Find the key: the caller's own `Idempotency-Key` header, else one derived from the
//!    request's [`OperationId`](crate::OperationId) (and sent as `Idempotency-Key`). With
//!    neither, the request fails with a [missing-key error](crate::Error::is_missing_key)
//!    and nothing is sent (fail closed, as on the server face): a side effect whose
//!    `OperationId` was forgotten would otherwise be charged twice by any retry outside
//!    this layer. Opt out with [`require_key(false)`](ClientBuilder::require_key): such
//!    requests then pass through, marked [`ResponseSource::Unprotected`] and reported once
//!    as a warning.
//! 2. Freeze the request (body limit 1 MiB; over it, nothing is sent), adding
//!    `Content-Digest: sha-256=:…:` of its body (see [`digest`](crate::digest)), hashed in
//!    the one pass that also makes the fingerprint.
//! 3. `begin` in the ledger, storing the frozen request before any byte leaves.
//! 4. **Acquired**: send, renewing the lease while the call is under way (so a slow call is
//!    never taken for a dead owner's). A response is recorded (up to 1 MiB; a larger one
//!    reaches the caller whole and is kept as a tombstone). A response saying the operation
//!    never started ([`ReleaseOn`]: `401`, `407`, `408`, `429`, the server face's refusals
//!    that say nothing ran) releases it, so the next run sends it once the token is
//!    refreshed or the limit waited out. A response meaning "try again" (`5xx`, and a `409`
//!    with `Retry-After`: "still in progress") leaves the operation *in doubt*, so a later
//!    run resends rather than replaying the failure; any other `409` ("already exists") is
//!    a final answer, recorded like a `201`. An error
//!    releases the operation only when **no** attempt of it may have been sent: "may have
//!    been sent" is sticky across the retries inside, so attempts refused at connect after
//!    one that reached the server leave the operation in doubt. A recording lost to a
//!    ledger outage is retried inside the lease.
//! 5. **Replay**: return the recorded response without calling the inner service, marked
//!    with [`ResponseSource::Replayed`].
//! 6. **Resume** (in doubt): resend the **stored** frozen bytes under the same key — or,
//!    against a provider that does not deduplicate, first ask a [`Reconcile`]r whether it
//!    happened (see [`reconcile`](self#reconciling-in-doubt-operations)).
//! 7. **Busy**: wait for the owner (bounded, [`BusyPolicy`]) or fail.
//! 8. **Drift** (same operation, different payload or target): refuse, naming the changed
//!    JSON fields, or resend the original bytes ([`DriftPolicy`]) — never the new ones.
//! 9. **Full** (a store with a memory budget has no room for a record it may not forget):
//!    fail with [`Error::is_ledger_full`](crate::Error::is_ledger_full); nothing is sent.
//!
//! Layers between this one and the [`FrozenRetryLayer`](crate::FrozenRetryLayer) (a
//! `map_request` adding `Authorization`, a tracing header) keep their changes: the retry
//! layer resends what it was handed, byte for byte, reusing the body and fingerprint this
//! layer computed. A caller's own `Idempotency-Key` names an operation **for its principal
//! at its target**: the same key sent under two credentials (by default, two
//! `Authorization` headers; see [`ClientBuilder::caller_key_scope`]) or to two hosts is
//! two operations, and a caller's key travelling with no credential is refused (the
//! credential must be on the request when it reaches this layer; one added by a layer
//! inside is not seen). An [`OperationId`](crate::OperationId) names one operation
//! wherever it is sent and whatever credential it travels with (a token refreshed between
//! a call and its resume is the same operation): sent to another target it is a drift,
//! never a replay of the first target's answer.
//!
//! # Reconciling in-doubt operations
//!
//! [`ClientBuilder::reconcile`] takes a [`Reconcile`], asked before an in-doubt operation
//! would be resent to a provider that ignores keys: [`Reconciled::Applied`] records and
//! returns what it found ([`ResponseSource::Reconciled`]), [`Reconciled::NotApplied`] sends
//! the frozen bytes, [`Reconciled::Unknown`] (and a reconciler that fails, panics or runs
//! past its bound) leaves the operation in doubt. [`LookupReconciler`] builds one from a
//! lookup request; its docs show a crash after sending resolved this way.
//!
//! Every request reaches the inner service as `Request<Full<Bytes>>`, so the inner stack is
//! the same whichever path a request takes.
//!
//! [`IdempotencyLayer::client_stack`] builds both layers in the right order from one
//! configuration ([`ClientStackBuilder`]): the body limit and the phase classifier apply to
//! both, and the ledger's TTLs are checked against the retry policy really stacked inside.
//! Stacked by hand the wrong way round (the retry layer outside), the layers say so once, as
//! a warning naming the fix.
//!
//! # Example
//!
//! ```
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use http_body_util::Full;
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use std::sync::Arc;
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//! use tower_idempotency::{
//!     ledger::MemoryStore, retry::RetryPolicy, FrozenRetryLayer, IdempotencyLayer, OperationId,
//!     ResponseSource,
//! };
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tower_idempotency::Error> {
//! let charges = Arc::new(AtomicUsize::new(0));
//! let provider = service_fn({
//!     let charges = charges.clone();
//!     move |_req: Request<Full<Bytes>>| {
//!         charges.fetch_add(1, Ordering::SeqCst);
//!         async { Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from("ch_1")))) }
//!     }
//! });
//!
//! let client = ServiceBuilder::new()
//!     .layer(IdempotencyLayer::client(MemoryStore::new())) // once per logical operation
//!     .layer(FrozenRetryLayer::new(RetryPolicy::default())) // resends the frozen bytes
//!     .service(provider);
//!
//! let charge = || {
//!     let mut req = Request::post("http://payments.local/charges")
//!         .body(Full::new(Bytes::from(r#"{"order_id":"order_42","amount_cents":1999}"#)))
//!         .unwrap();
//!     req.extensions_mut().insert(OperationId::new("task-7", "charge-customer"));
//!     req
//! };
//!
//! let first = client.clone().oneshot(charge()).await?;
//! let again = client.clone().oneshot(charge()).await?; // the orchestrator retried the step
//! assert_eq!(again.extensions().get::<ResponseSource>(), Some(&ResponseSource::Replayed));
//! assert_eq!(charges.load(Ordering::SeqCst), 1);
//! # let _ = first;
//! # Ok(())
//! # }
//! ```
//!
//! # The server face
//!
//! For a service that performs the side effect: IETF `Idempotency-Key` semantics
//! (draft-ietf-httpapi-idempotency-key-header) in front of your handlers, as a plain tower
//! layer. It wraps any `Service<Request<RequestBody<B>>>` (an axum `Router` or handler, a
//! hyper service) and keeps its error type, so it drops into axum's `route_layer` with
//! `Infallible` intact: every idempotency outcome is an HTTP response.
//!
//! ```
//! use axum::body::Body;
//! use axum::http::{Request, StatusCode};
//! use axum::routing::post;
//! use axum::Router;
//! use tower::ServiceExt;
//! use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
//!
//! async fn charge() -> (StatusCode, &'static str) {
//!     (StatusCode::CREATED, r#"{"charge_id":"ch_1"}"#)
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let app = Router::new().route(
//!     "/charges",
//!     post(charge).route_layer(IdempotencyLayer::server(MemoryStore::new())),
//! );
//! // axum::serve(listener, app).await
//!
//! let charge_order_42 = || {
//!     Request::post("/charges")
//!         .header("authorization", "Bearer sk_live_alice") // keys are scoped by caller
//!         .header("idempotency-key", "\"order-42\"")
//!         .body(Body::from(r#"{"order_id":"order-42","amount_cents":1999}"#))
//!         .unwrap()
//! };
//! let first = app.clone().oneshot(charge_order_42()).await.unwrap();
//! let retry = app.clone().oneshot(charge_order_42()).await.unwrap(); // the answer was lost
//! assert_eq!(retry.status(), StatusCode::CREATED);
//! assert_eq!(retry.headers()["idempotent-replayed"], "true"); // the handler ran once
//! # let _ = first;
//! # }
//! ```
//!
//! `examples/axum_server.rs` is a complete payments service built this way
//! (`cargo run --example axum_server`).
//!
//! **Layer the method router, not the `Router`.** Put the layer around the methods that
//! have side effects (`post(charge).route_layer(layer)`): axum then answers an unknown
//! path (`404`) and a method the route does not serve (`405`) outside it. `Router::layer` and `Router::route_layer` also wrap axum's
//! method-not-allowed fallback, so a keyless `PATCH` to a `POST`-only route would get
//! `400 key-missing` instead of `405`, and a keyed one would have its `405` recorded and
//! replayed (`Router::layer` wraps the `404` fallback too). The layer cannot tell on its
//! own: wrapped around a whole router, it does not know which methods a route serves.
//!
//! ## What it answers
//!
//! Side-effecting requests (by default `POST` and `PATCH`; see
//! [`ServerBuilder::side_effect_methods`]) go through the ledger. Everything else (`GET`,
//! `HEAD`, `OPTIONS`, `PUT`, `DELETE`… by default) passes straight through, its body
//! untouched, without touching the ledger. Problem bodies are RFC 9457
//! `application/problem+json`; their `type` URIs are listed in [`problem`].
//!
//! | situation | status and body | ledger |
//! |---|---|---|
//! | side-effecting, no `Idempotency-Key` | `400` [`key-missing`](problem::KEY_MISSING) (passed through when the key is [optional](ServerBuilder::require_key)) | not touched |
//! | key malformed: empty, over 255 characters, not visible ASCII, control characters, bad RFC 8941 string, header repeated | `400` [`key-invalid`](problem::KEY_INVALID), with `reason` | not touched |
//! | body over the limit (1 MiB), by `Content-Length` or while reading | `413` [`body-too-large`](problem::BODY_TOO_LARGE) | not touched: no lease |
//! | body could not be read | `400` [`body-unreadable`](problem::BODY_UNREADABLE) | not touched |
//! | keyed, but no principal to scope the key by (no `Authorization`, no scope function) | `400` [`scope-missing`](problem::SCOPE_MISSING) | not touched |
//! | ledger unavailable | `503` [`ledger-unavailable`](problem::LEDGER_UNAVAILABLE) with `Retry-After`; the handler does not run (fail closed). Opt-in [fail open](ServerBuilder::fail_open): the handler's response with `Idempotency-Fail-Open: true` | — |
//! | ledger full of records it must keep | `503` [`ledger-full`](problem::LEDGER_FULL) with `Retry-After`; the handler does not run | not touched |
//! | new key | the handler's response | recorded |
//! | same key, in flight | `409` [`in-flight`](problem::IN_FLIGHT) with `Retry-After` | unchanged |
//! | same key, other method, path (as the client sent it), query or body | `422` [`payload-mismatch`](problem::PAYLOAD_MISMATCH): one key is one request, never a second run | unchanged |
//! | same key, completed | the recorded status, allow-listed headers and byte-identical body, with `Idempotent-Replayed: true`; the handler does not run | unchanged |
//! | same key, completed with a response over the cap (1 MiB) | `410` [`response-not-recorded`](problem::RESPONSE_NOT_RECORDED), never a re-run, never a truncated body | unchanged |
//! | same key, in doubt (see below) | `500` [`outcome-unknown`](problem::OUTCOME_UNKNOWN) by default, or the handler runs again | stays in doubt / recorded |
//!
//! ## Scoping
//!
//! The ledger key is `LedgerKey::server(scope, key)`
//! ([`LedgerKey::server`](crate::ledger::LedgerKey::server)), a hash: the scope, the raw
//! key and credentials are never stored or logged. One key is one request: the method, the
//! request target and the body are its [fingerprint](crate::Fingerprint), so a key reused
//! with another method, path, query or body is a `422`, never a second execution and never
//! a replay of the other request's answer (as the IETF draft and Stripe treat it).
//!
//! The target is judged **as the client sent it**. `Router::nest("/accounts/{id}", …)`
//! strips its prefix from the URI the layer sees; with feature `axum` the layer reads
//! axum's `OriginalUri` instead, so `POST /accounts/1/charges` and
//! `POST /accounts/2/charges` never look like one request. Without the feature, put the
//! layer on the outer router, or outside `nest`.
//!
//! `scope` comes from [`ServerBuilder::scope`], a function of the request head naming the
//! tenant or principal. One scope can never read, block or probe another's keys: a foreign
//! key behaves exactly like an unused one (no `409`, no `422`, no replay).
//!
//! **Without a scope function**, the scope is a hash of the `Authorization` header: every
//! credential gets its own keys, with no configuration, and nothing leaks between API
//! clients. A keyed request **without** `Authorization` is refused with `400`
//! [`scope-missing`](problem::SCOPE_MISSING): there is no silent shared scope in which one
//! cookie-session caller, sending another's key and body, would be served the other's
//! recorded response. Callers that authenticate otherwise (cookies, mTLS, API keys in other
//! headers), or whose tokens rotate between a request and its retry, need a scope function:
//! put authentication **outside** this layer and derive the scope from the principal it
//! found, as the example does. [`ServerBuilder::unscoped`] opts into one scope for all.
//!
//! ## Handler failures, cancellation and expired leases
//!
//! - **A `5xx` from the handler** is recorded and replayed by default
//!   ([`ServerErrorPolicy::Record`], as Stripe does): a handler can fail *after* its effect,
//!   and only it knows. [`ServerErrorPolicy::Release`] releases the key instead, so a retry
//!   runs the handler again; choose it when your `5xx` reliably means "nothing happened".
//!   A panic caught by tower-http's `CatchPanicLayer` *inside* this layer is such a `5xx`.
//! - **In doubt.** A key whose handler started and never finished cannot be "resent" by a
//!   server: the handler panicked with nothing catching it, was cancelled, its response body
//!   failed, or its process died (its lease, renewed while the handler runs, then runs out:
//!   10 s by default). By default ([`InDoubtPolicy::OutcomeUnknown`], **at most once**) every later
//!   request with the key gets `500` [`outcome-unknown`](problem::OUTCOME_UNKNOWN): the
//!   layer cannot know whether the effect happened, and running it again is the double
//!   charge this crate exists to stop. [`InDoubtPolicy::RunAgain`] (**at least once**) runs
//!   the handler again; use it when the handler's own effects are idempotent, e.g. it
//!   passes the key (a [`HeaderKey`](crate::HeaderKey) in the request's extensions) on to
//!   its payment provider. Answering an in-doubt key under `OutcomeUnknown` is a probe:
//!   it never changes the record, so a client that keeps retrying cannot keep the key alive
//!   past its retention.
//! - **A panic** unwinding through this layer puts the key in doubt at once, not when the
//!   lease ends, and keeps unwinding (hyper then closes the connection, as without us).
//! - **The client goes away.** hyper drops the request's future. The handler of a keyed
//!   request runs on its own task and **keeps running**: its outcome is recorded and the
//!   client's retry gets the replay. With
//!   [`cancel_on_disconnect(true)`](ServerBuilder::cancel_on_disconnect), the handler is
//!   dropped with the request and the key goes in doubt at once.
//!
//! With the client face calling a server behind this layer: `409 in-flight` (it carries
//! `Retry-After`), `503` and other `5xx` answers leave the client's operation in doubt, to
//! be resent later under the same key (an `outcome-unknown` stays so, truthfully); `410`
//! and `422` are final.
//!
//! ## Replay
//!
//! A replay has the recorded status and body (byte for byte) and only the headers of an
//! allow-list, [`DEFAULT_REPLAY_HEADERS`] (`Content-Type`, `Content-Encoding`,
//! `Content-Language`, `Content-Location`, `Location`, `ETag`, `Last-Modified`,
//! `Cache-Control`, `Vary`, `Link`), configurable with [`ServerBuilder::replay_headers`].
//! Other headers are not even stored. `Set-Cookie`, `WWW-Authenticate`, `Authorization`,
//! `Date`, `Content-Length` and hop-by-hop headers can never be replayed: the builder
//! refuses them. Place layers that vary the response per caller (compression, CORS) and
//! rate limiting (a `429` would be recorded) **outside** this layer.
//!
//! ## Bodies
//!
//! A keyed request's body is read whole, under the limit, and fingerprinted in the same
//! pass ([`FrozenRequest::freeze`](crate::FrozenRequest::freeze)); the handler receives
//! those bytes as a [`RequestBody`]. Responses are recorded up to
//! [`response_limit`](ServerBuilder::response_limit); larger ones stream on to the first
//! caller whole and leave a tombstone.
//!
//! ## Tracing
//!
//! Each keyed request runs in a `DEBUG` span `idempotency` with `face = "server"`, `key`
//! (the key's digest, as in the decision events below: never the key itself, never the
//! scope or a credential), `outcome` (`executed`,
//! `executed-again`, `replayed`, `in-flight`, `payload-mismatch`, `outcome-unknown`,
//! `response-not-recorded`, `ledger-unavailable`, `ledger-full`, `scope-missing`,
//! `fail-open`, `body-too-large`, `body-unreadable`) and, when the handler ran, `settled` (`recorded`, `tombstone`,
//! `released`, `in-doubt`, `not-recorded`). Refused keys are `DEBUG` events.
//!
//! ## Decision events (both faces)
//!
//! Every ledger decision is one event `idempotency decision`, inside the request's span,
//! with the fields `idempotency.face` (`client`, `server`), `idempotency.decision`
//! (`acquired`, `replayed`, `resumed`, `busy`, `drift`, `in_doubt`, `released`, `full`,
//! `unavailable`, `reconciled`) and `idempotency.key.digest`: the first 16 hex digits of
//! `SHA-256("tower-idempotency/log/v1" || key)` over the `Idempotency-Key` as it travels
//! (unquoted). A client and the server it calls log the same digest for one operation, so
//! their logs join; neither logs the key itself, the scope or a credential. Levels: `WARN`
//! for `drift`, `full` and `unavailable`, `INFO` for `in_doubt`, `resumed` and `reconciled`, `DEBUG` for
//! the rest. The client span `idempotency` (`face = "client"`) carries the same digest as
//! `key`.
//!
//! For observability of your own, `on_outcome` on either builder
//! ([`ClientBuilder::on_outcome`], [`ServerBuilder::on_outcome`],
//! [`ClientStackBuilder::on_outcome`]) calls a hook once per request that reached the
//! ledger, with an [`OutcomeEvent`]: the face, the last decision, the key's digest, the
//! status when there was a response, and the time taken. Unset, it costs nothing.

mod body;
pub(crate) mod client;
pub(crate) mod decision;
mod engine;
mod layer;
mod reconcile;
mod release;
mod scope;
mod server;
mod stack;

pub use body::ResponseBody;
pub use client::{ClientBuilder, ClientFace, ClientFuture, DriftPolicy, DEFAULT_RESPONSE_LIMIT};
#[cfg(feature = "reqwest-middleware")]
pub(crate) use decision::request_span;
pub use decision::{Decision, Face, OutcomeEvent};
pub use engine::{BusyPolicy, DEFAULT_LEASE, DEFAULT_RETENTION};
pub(crate) use engine::{LeaseGuard, Ledger};
pub use layer::{Idempotency, IdempotencyLayer};
pub(crate) use reconcile::ask as ask_reconciler;
pub use reconcile::{
    InDoubtOperation, LookupReconciler, Reconcile, ReconcileFuture, Reconciled,
    DEFAULT_RECONCILE_TIMEOUT,
};
pub use release::ReleaseOn;
pub use server::{
    problem, InDoubtPolicy, RequestBody, ServerBuilder, ServerErrorPolicy, ServerFace,
    ServerFuture, DEFAULT_MAX_WAITERS, DEFAULT_REPLAY_HEADERS, DEFAULT_SERVER_PROTECTED_WINDOW,
    IDEMPOTENCY_FAIL_OPEN, IDEMPOTENT_REPLAYED,
};
pub use stack::{ClientStack, ClientStackBuilder};

/// The client [`IdempotencyLayer`], as [`IdempotencyLayer::client`] and
/// [`ClientBuilder::build`] return it.
///
/// ```
/// use tower_idempotency::{idempotency::ClientLayer, ledger::MemoryStore, IdempotencyLayer};
///
/// let layer: ClientLayer = IdempotencyLayer::client(MemoryStore::new());
/// # let _ = layer;
/// ```
pub type ClientLayer = IdempotencyLayer<ClientFace>;

/// The server [`IdempotencyLayer`], as [`IdempotencyLayer::server`] and
/// [`ServerBuilder::build`] return it.
///
/// ```
/// use tower_idempotency::{idempotency::ServerLayer, ledger::MemoryStore, IdempotencyLayer};
///
/// let layer: ServerLayer = IdempotencyLayer::server(MemoryStore::new());
/// # let _ = layer;
/// ```
pub type ServerLayer = IdempotencyLayer<ServerFace>;

/// The server layer's service around `S` (an axum handler or router, a hyper service).
///
/// ```
/// use tower::Layer;
/// use tower_idempotency::idempotency::ServerService;
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
///
/// let handler = tower::service_fn(|_req: http::Request<tower_idempotency::idempotency::RequestBody<String>>| async {
///     Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
/// });
/// let service: ServerService<_> = IdempotencyLayer::server(MemoryStore::new()).layer(handler);
/// # let _ = service;
/// ```
pub type ServerService<S> = Idempotency<S, ServerFace>;

/// The whole client stack around the transport `S`, as a [`ClientStack`] builds it:
/// [`IdempotencyLayer`] outside, [`FrozenRetry`](crate::retry::FrozenRetry) inside.
///
/// ```
/// use tower::Layer;
/// use tower_idempotency::idempotency::ClientStackService;
/// use tower_idempotency::testing::SideEffectService;
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
///
/// let stack = IdempotencyLayer::client_stack(MemoryStore::new()).build().unwrap();
/// let client: ClientStackService<SideEffectService> = stack.layer(SideEffectService::new());
/// # let _ = client;
/// ```
pub type ClientStackService<S> = Idempotency<crate::retry::FrozenRetry<S>, ClientFace>;

/// The client stack over hyper-util's legacy client with connector `C` (feature
/// `hyper-util`), the stack of the README's quickstart.
///
/// ```
/// use bytes::Bytes;
/// use http_body_util::Full;
/// use hyper_util::client::legacy::{connect::HttpConnector, Client};
/// use hyper_util::rt::TokioExecutor;
/// use tower::Layer;
/// use tower_idempotency::idempotency::HyperClientStack;
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
///
/// let stack = IdempotencyLayer::client_stack(MemoryStore::new()).build().unwrap();
/// let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
/// let client: HyperClientStack<HttpConnector> = stack.layer(http);
/// # let _ = client;
/// ```
#[cfg(feature = "hyper-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "hyper-util")))]
pub type HyperClientStack<C> =
    ClientStackService<hyper_util::client::legacy::Client<C, http_body_util::Full<bytes::Bytes>>>;

/// Renamed [`ClientFace`]: `Client` clashed with hyper-util's and reqwest's `Client` in
/// type errors.
#[deprecated(note = "renamed `ClientFace`; or use the `ClientLayer` alias")]
pub type Client = ClientFace;

/// Renamed [`ServerFace`], after [`ClientFace`].
#[deprecated(note = "renamed `ServerFace`; or use the `ServerLayer` alias")]
pub type Server = ServerFace;

/// Where a response came from: a response extension set by the client
/// [`IdempotencyLayer`] on every response of a side-effecting request. (The server face
/// marks replays with the `Idempotent-Replayed: true` header instead.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ResponseSource {
    /// The operation was sent for the first time.
    Sent,
    /// The operation was in doubt; its stored frozen bytes were sent again.
    Resent,
    /// The recorded response of a completed operation; the inner service was not called.
    Replayed,
    /// The operation was in doubt and its [reconciler](crate::idempotency::Reconcile) found
    /// it had happened: this is the provider's response (or the reconciler's stand-in), now
    /// recorded; nothing was sent again.
    Reconciled,
    /// A side effect without an [`OperationId`](crate::OperationId) or an `Idempotency-Key`:
    /// sent once, outside the ledger, unprotected against a caller's own retry. See
    /// [`ClientBuilder::require_key`].
    Unprotected,
}
