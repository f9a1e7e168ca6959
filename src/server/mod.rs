//! The server face: IETF `Idempotency-Key` semantics in front of the handlers that
//! perform the side effects.
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
//! # What it answers
//!
//! Side-effecting requests (by default `POST` and `PATCH`; see
//! [`Builder::side_effect_methods`](crate::server::Builder::side_effect_methods)) go through the ledger. Everything else (`GET`,
//! `HEAD`, `OPTIONS`, `PUT`, `DELETE`… by default) passes straight through, its body
//! untouched, without touching the ledger. Problem bodies are RFC 9457
//! `application/problem+json`; their `type` URIs are listed in [`problem`].
//!
//! | situation | status and body | ledger |
//! |---|---|---|
//! | side-effecting, no `Idempotency-Key` | `400` [`key-missing`](problem::KEY_MISSING) (passed through when the key is [optional](crate::server::Builder::require_key)) | not touched |
//! | key malformed: empty, over 255 characters, not visible ASCII, control characters, bad RFC 8941 string, header repeated | `400` [`key-invalid`](problem::KEY_INVALID), with `reason` | not touched |
//! | body over the limit (1 MiB), by `Content-Length` or while reading | `413` [`body-too-large`](problem::BODY_TOO_LARGE) | not touched: no lease |
//! | body could not be read | `400` [`body-unreadable`](problem::BODY_UNREADABLE) | not touched |
//! | keyed, but no principal to scope the key by (no `Authorization`, no scope function) | `400` [`scope-missing`](problem::SCOPE_MISSING) | not touched |
//! | ledger unavailable | `503` [`ledger-unavailable`](problem::LEDGER_UNAVAILABLE) with `Retry-After`; the handler does not run (fail closed). Opt-in [fail open](crate::server::Builder::fail_open): the handler's response with `Idempotency-Fail-Open: true` | — |
//! | ledger full of records it must keep | `503` [`ledger-full`](problem::LEDGER_FULL) with `Retry-After` (none for a request heavier than the ledger's whole budget: it can never fit); the handler does not run | not touched |
//! | new key | the handler's response | recorded |
//! | same key, in flight | `409` [`in-flight`](problem::IN_FLIGHT) with `Retry-After` | unchanged |
//! | same key, other method, path (as the client sent it), query or body | `422` [`payload-mismatch`](problem::PAYLOAD_MISMATCH): one key is one request, never a second run | unchanged |
//! | same key, completed | the recorded status, allow-listed headers and byte-identical body, with `Idempotent-Replayed: true`; the handler does not run | unchanged |
//! | same key, completed with a response over the cap (1 MiB) | `410` [`response-not-recorded`](problem::RESPONSE_NOT_RECORDED), never a re-run, never a truncated body | unchanged |
//! | same key, in doubt (see below) | `500` [`outcome-unknown`](problem::OUTCOME_UNKNOWN) by default, or the handler runs again | stays in doubt / recorded |
//!
//! # Scoping
//!
//! The ledger key is `LedgerKey::server(scope, key)`
//! ([`LedgerKey::server`](crate::ledger::LedgerKey::server)), a hash: the scope, the raw
//! key and credentials are never stored or logged. One key is one request: the method, the
//! request target and the body are its [fingerprint](crate::fingerprint::Fingerprint), so a key reused
//! with another method, path, query or body is a `422`, never a second execution and never
//! a replay of the other request's answer (as the IETF draft and Stripe treat it).
//!
//! The target is judged **as the client sent it**. `Router::nest("/accounts/{id}", …)`
//! strips its prefix from the URI the layer sees; with feature `axum` the layer reads
//! axum's `OriginalUri` instead, so `POST /accounts/1/charges` and
//! `POST /accounts/2/charges` never look like one request. Without the feature, put the
//! layer on the outer router, or outside `nest`.
//!
//! `scope` comes from [`Builder::scope`](crate::server::Builder::scope), a function of the request head naming the
//! tenant or principal. One scope can never read, block or probe another's keys: a foreign
//! key behaves exactly like an unused one (no `409`, no `422`, no replay).
//!
//! **Without a scope function**, the scope is a hash of the `Authorization` header, read as
//! HTTP reads it (the auth-scheme's case and the spaces after it do not matter:
//! `bearer tok` and `Bearer tok` are one caller; the credentials are compared exactly):
//! every credential gets its own keys, with no configuration, and nothing leaks between API
//! clients. A keyed request **without** `Authorization` is refused with `400`
//! [`scope-missing`](problem::SCOPE_MISSING): there is no silent shared scope in which one
//! cookie-session caller, sending another's key and body, would be served the other's
//! recorded response. Callers that authenticate otherwise (cookies, mTLS, API keys in other
//! headers), or whose tokens rotate between a request and its retry, need a scope function:
//! put authentication **outside** this layer and derive the scope from the principal it
//! found, as below. [`Builder::unscoped`](crate::server::Builder::unscoped) opts into one scope for all.
//!
//! **Scope by the principal**, which is what a real service should do: a credential is not
//! a caller. A client whose token is refreshed between a request and its retry is the same
//! caller, and must get the replay, not a second charge. The authentication layer outside
//! puts the principal it established into the request's extensions; the scope function
//! reads it:
//!
//! ```
//! use axum::body::Body;
//! use axum::extract::Request;
//! use axum::http::StatusCode;
//! use axum::middleware::{from_fn, Next};
//! use axum::response::{IntoResponse, Response};
//! use axum::routing::post;
//! use axum::Router;
//! use tower::ServiceExt;
//! use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
//!
//! /// Who the caller is, as the authentication layer established it.
//! #[derive(Clone)]
//! struct Principal(String);
//!
//! /// Authentication: a token to its account, or `401` before anything else runs.
//! async fn authenticate(mut request: Request, next: Next) -> Response {
//!     let token = request.headers().get("authorization").and_then(|v| v.to_str().ok());
//!     let account = match token {
//!         // Stands for your token check: both tokens are alice's, the second a refresh.
//!         Some("Bearer alice-token-1" | "Bearer alice-token-2") => "acct_alice",
//!         _ => return StatusCode::UNAUTHORIZED.into_response(),
//!     };
//!     request.extensions_mut().insert(Principal(account.to_owned()));
//!     next.run(request).await
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let idempotency = IdempotencyLayer::server_builder(MemoryStore::new())
//!     // Never empty: `authenticate`, outside this layer, refuses a request without one.
//!     .scope(|head| head.extensions.get::<Principal>().map(|p| p.0.clone()).unwrap_or_default())
//!     .build()
//!     .unwrap();
//! let charge = post(|| async { (StatusCode::CREATED, "ch_1") })
//!     .route_layer(idempotency) // inside: sees the principal
//!     .route_layer(from_fn(authenticate)); // outside: runs first
//! let app = Router::new().route("/charges", charge);
//!
//! let charge_with = |token: &str| {
//!     Request::post("/charges")
//!         .header("authorization", token)
//!         .header("idempotency-key", "\"order-42\"")
//!         .body(Body::from(r#"{"amount_cents":1999}"#))
//!         .unwrap()
//! };
//! let first = app.clone().oneshot(charge_with("Bearer alice-token-1")).await.unwrap();
//! assert_eq!(first.status(), StatusCode::CREATED);
//! // The token was refreshed before the retry: the same caller, so the same key's replay.
//! let retry = app.oneshot(charge_with("Bearer alice-token-2")).await.unwrap();
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! # }
//! ```
//!
//! Scopes separate the callers of one service, not services: two services sharing a store
//! (or a Redis key prefix) see each other's keys when a caller sends both the same key
//! under the same credential, or when they are unscoped. Give each service a store, or a
//! prefix, of its own.
//!
//! # Handler failures, cancellation and expired leases
//!
//! - **A `5xx` from the handler** is recorded and replayed by default
//!   ([`ServerErrorPolicy::Record`](crate::ServerErrorPolicy::Record), as Stripe does): a handler can fail *after* its effect,
//!   and only it knows. [`ServerErrorPolicy::Release`](crate::ServerErrorPolicy::Release) releases the key instead, so a retry
//!   runs the handler again; choose it when your `5xx` reliably means "nothing happened".
//!   A panic caught by tower-http's `CatchPanicLayer` *inside* this layer is such a `5xx`.
//! - **A refusal before processing** (`406`, `412`, `415`, `428`, `429`, `431` by default:
//!   [`release_statuses`](crate::server::Builder::release_statuses), and a `503` with
//!   `Retry-After`) releases the key: the request was refused for what its headers said,
//!   which the fingerprint leaves out, or for the server's load, so the same key and bytes,
//!   sent again once fixed, run. An axum extractor's `415` (`Json` without
//!   `Content-Type: application/json`) is one; a handler shedding load with `503` and
//!   `Retry-After` is another.
//! - **Any answer the handler marks "nothing happened"** with [`NotProcessed`] (a response
//!   extension; in axum, `Extension(NotProcessed)` among the response's parts) releases the
//!   key whatever its status: the handler knows it turned the request away before its
//!   effect, as when a dependency it checks first is down.
//!
//!   ```
//!   use axum::http::StatusCode;
//!   use axum::response::{IntoResponse, Response};
//!   use axum::Extension;
//!   use tower_idempotency::server::NotProcessed;
//!
//!   async fn charge() -> Response {
//!       let inventory_reachable = false;
//!       if !inventory_reachable {
//!           // Checked before charging anyone: a retry with the key must run again.
//!           return (StatusCode::BAD_GATEWAY, Extension(NotProcessed)).into_response();
//!       }
//!       (StatusCode::CREATED, "ch_1").into_response()
//!   }
//!   # let _ = charge;
//!   ```
//! - **In doubt.** A key whose handler started and never finished cannot be "resent" by a
//!   server: the handler panicked with nothing catching it, was cancelled, its response body
//!   failed, or its process died (its lease, kept while the handler runs, then runs out:
//!   10 s by default). By default ([`InDoubtPolicy::OutcomeUnknown`](crate::InDoubtPolicy::OutcomeUnknown), **at most once**) every later
//!   request with the key gets `500` [`outcome-unknown`](problem::OUTCOME_UNKNOWN): the
//!   layer cannot know whether the effect happened, and running it again is the double
//!   charge this crate exists to stop. [`InDoubtPolicy::RunAgain`](crate::InDoubtPolicy::RunAgain) (**at least once**) runs
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
//!   [`cancel_on_disconnect(true)`](crate::server::Builder::cancel_on_disconnect), the handler is
//!   dropped with the request and the key goes in doubt at once.
//!
//! With the client face calling a server behind this layer: `409 in-flight` (it carries
//! `Retry-After`), `503` and other `5xx` answers leave the client's operation in doubt, to
//! be resent later under the same key (an `outcome-unknown` stays so, truthfully); `410`
//! and `422` are final.
//!
//! # Replay
//!
//! A replay has the recorded status and body (byte for byte) and only the headers of an
//! allow-list (by default `Content-Type`, `Content-Encoding`,
//! `Content-Language`, `Content-Location`, `Location`, `ETag`, `Last-Modified`,
//! `Cache-Control`, `Vary`, `Link`, and `Retry-After`, so a replayed answer says when to
//! come back as the first one did), configurable with [`Builder::replay_headers`](crate::server::Builder::replay_headers).
//! Other headers are not even stored. `Set-Cookie`, `WWW-Authenticate`, `Authorization`,
//! `Date`, `Content-Length` and hop-by-hop headers can never be replayed: the builder
//! refuses them. Place layers that vary the response per caller (compression, CORS) and
//! rate limiting (a `429` would be recorded) **outside** this layer.
//!
//! # Bodies
//!
//! A keyed request's body is read whole, under the limit, and fingerprinted in the same
//! pass ([`FrozenRequest::freeze`](crate::FrozenRequest::freeze)); the handler receives
//! those bytes as a [`RequestBody`]. Responses are recorded up to
//! [`response_limit`](crate::server::Builder::response_limit); larger ones stream on to the first
//! caller whole and leave a tombstone.
//!
//! # Tracing
//!
//! Each keyed request runs in a `DEBUG` span `idempotency` with `face = "server"`, `key`
//! (the key's digest, as in the decision events below: never the key itself, never the
//! scope or a credential), `outcome` (`executed`,
//! `executed-again`, `replayed`, `in-flight`, `payload-mismatch`, `outcome-unknown`,
//! `response-not-recorded`, `ledger-unavailable`, `ledger-full`, `scope-missing`,
//! `fail-open`, `body-too-large`, `body-unreadable`) and, when the handler ran, `settled` (`recorded`, `tombstone`,
//! `released`, `in-doubt`, `not-recorded`). Refused keys are `DEBUG` events.
//!
//! # Layout
//!
//! [`Builder`] (`builder.rs`) makes the [`ServerLayer`]; its service's `call`
//! (`service.rs`) sorts a request into pass-through, refusal or keyed, and returns a
//! [`ResponseFuture`] (`future.rs`). A keyed request then runs in stages (`staged.rs`):
//! the ledger's part (`admit.rs`: read the body, claim the key, answer without the
//! handler or hand it the owned key) and the handler's part as the key's owner
//! (`execute.rs`, or `transactional.rs` in the PostgreSQL transactional mode). What is
//! recorded and replayed is in `replay.rs`; the refusals' bodies in [`problem`].

mod admit;
mod body;
mod builder;
mod execute;
mod face;
mod future;
mod head;
pub(crate) mod policy;
pub mod problem;
pub(crate) mod replay;
mod report;
mod service;
mod staged;
#[cfg(feature = "postgres")]
mod transactional;

use crate::idempotency::Idempotency;

pub use admit::IDEMPOTENCY_FAIL_OPEN;
pub use body::RequestBody;
pub use builder::{Builder, ServerLayer};
pub use face::ServerFace;
pub use future::ResponseFuture;
pub use policy::NotProcessed;
pub use replay::IDEMPOTENT_REPLAYED;

/// The server layer's service around `S` (an axum handler or router, a hyper service).
///
/// ```
/// use tower::Layer;
/// use tower_idempotency::server::ServerService;
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
///
/// let handler = tower::service_fn(|_req: http::Request<tower_idempotency::server::RequestBody<String>>| async {
///     Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
/// });
/// let service: ServerService<_> = IdempotencyLayer::server(MemoryStore::new()).layer(handler);
/// # let _ = service;
/// ```
pub type ServerService<S> = Idempotency<S, ServerFace>;
