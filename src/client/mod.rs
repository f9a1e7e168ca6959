//! The client face: once per logical operation, before the side effect fires.
//!
//! For an orchestrator calling tools over HTTP. Put the layer **outside** the
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
//!    this layer. Opt out with [`require_key(false)`](Builder::require_key): such
//!    requests then pass through, marked [`ResponseSource::Unprotected`](crate::ResponseSource::Unprotected) and reported once
//!    as a warning.
//! 2. Freeze the request (body limit 1 MiB; over it, nothing is sent), adding
//!    `Content-Digest: sha-256=:…:` of its body (see [`digest`](crate::digest)), hashed in
//!    the one pass that also makes the fingerprint.
//! 3. `begin` in the ledger, storing the frozen request before any byte leaves.
//! 4. **Acquired**: send, keeping the lease while the call is under way (so a slow call is
//!    never taken for a dead owner's): renewed every third of it, or held until the owner
//!    lets go by a store in this process (`MemoryStore`, see
//!    [`hold_lease`](crate::ledger::IdempotencyStore::hold_lease)). A response is recorded
//!    (up to 1 MiB; a larger one reaches the caller whole and is kept as a tombstone). A response saying the operation
//!    never started ([`ReleaseOn`]: `401`, `407`, `429`, the server face's refusals
//!    that say nothing ran) releases it, so the next run sends it once the token is
//!    refreshed or the limit waited out. A response meaning "try again" (`5xx`, a `408`,
//!    and a `409` with `Retry-After`: "still in progress") leaves the operation *in
//!    doubt*, so a later run resends rather than replaying the failure; any other `409`
//!    ("already exists") is a final answer, recorded like a `201`. An error
//!    releases the operation only when **no** attempt of it may have been sent: "may have
//!    been sent" is sticky across the retries inside, so attempts refused at connect after
//!    one that reached the server leave the operation in doubt. A recording lost to a
//!    ledger outage is retried inside the lease.
//! 5. **Replay**: return the recorded response without calling the inner service, marked
//!    with [`ResponseSource::Replayed`](crate::ResponseSource::Replayed).
//! 6. **Resume** (in doubt): resend the **stored** frozen bytes under the same key — or,
//!    against a provider that does not deduplicate, first ask a [`Reconcile`](crate::idempotency::Reconcile)r whether it
//!    happened (see [below](self#reconciling-in-doubt-operations)).
//! 7. **Busy**: wait for the owner (bounded, [`BusyPolicy`](crate::BusyPolicy)) or fail.
//! 8. **Drift** (same operation, different payload or target): by default, a regenerated
//!    body under an `OperationId` continues the operation with the bytes first frozen, the
//!    response marked [`PayloadDiscarded`](crate::PayloadDiscarded) with the changed JSON fields; anything else is
//!    refused, naming them ([`DriftPolicy`](crate::DriftPolicy)). A changed method or target, and a
//!    changed [defining field](Builder::defining_fields) (the order, the amount, the
//!    recipient: what the operation *is*), are refused under every policy. Never are the
//!    new bytes sent.
//! 9. **Full** (a store with a memory budget has no room for a record it may not forget):
//!    fail with [`Error::is_ledger_full`](crate::Error::is_ledger_full); nothing is sent.
//!
//! Layers between this one and the [`FrozenRetryLayer`](crate::FrozenRetryLayer) (a
//! `map_request` adding `Authorization`, a tracing header) keep their changes: the retry
//! layer resends what it was handed, byte for byte, reusing the body and fingerprint this
//! layer computed. A caller's own `Idempotency-Key` names an operation **for its principal
//! at its target**: the same key sent under two credentials (by default, two
//! `Authorization` headers; see [`Builder::caller_key_scope`]) or to two hosts is
//! two operations, and a caller's key travelling with no credential is refused (the
//! credential must be on the request when it reaches this layer; one added by a layer
//! inside is not seen). An [`OperationId`](crate::OperationId) names one operation
//! wherever it is sent and whatever credential it travels with (a token refreshed between
//! a call and its resume is the same operation): sent to another target it is a drift,
//! never a replay of the first target's answer. A resume sends the frozen request as it
//! was frozen, its credential included, because a server that scopes keys by credential
//! (this crate's server face does, by `Authorization`, unless given a scope function)
//! finds the operation only under that one: a provider that has revoked it answers `401`
//! and the operation stays in doubt, to reconcile ([`Builder::reconcile`]). A server that
//! scopes keys by the principal rather than the token (a scope function that reads it)
//! lets tokens expire between an operation's runs.
//!
//! # Before production
//!
//! The defaults keep every promise above; these settings depend on your provider and your
//! stack, and only you can give them:
//!
//! - **The store lives as long as the process**: build it once and clone it into every
//!   layer. A store made per call remembers nothing, so a re-run step is sent again.
//! - **Say whether the provider deduplicates** on `Idempotency-Key`
//!   ([`Builder::provider_deduplicates`]). Until you do, `true` is assumed, and an
//!   operation whose first attempt may have charged is resent; against a provider that
//!   ignores keys, that resend is a second charge. The first such resend logs a warning.
//! - **Give the retry policy to both layers** ([`Builder::retry_policy`]; `build_stack`
//!   does it for you): the ledger's lease and protected window are sized by the retry
//!   window. A retry layer stacked outside this one, or a longer policy inside than the
//!   one this layer was given, logs a warning.
//! - **Bound each attempt.** The default retry policy sets no per-attempt timeout, and
//!   neither does hyper-util's client: a provider that hangs holds the call until you set
//!   [`RetryPolicyBuilder::attempt_timeout`](crate::retry::RetryPolicyBuilder::attempt_timeout).
//! - **With `reqwest`, turn redirects off** (`redirect(reqwest::redirect::Policy::none())`):
//!   a failure on a followed redirect's hop reads as "never sent" and would release an
//!   operation that charged. The `reqwest` adapters' docs say more.
//! - **With `reqwest-middleware`, put `reqwest-retry` before the middleware**, so it retries
//!   whole operations; [`Error::find`](crate::Error::find) reaches this crate's error
//!   through its wrappers.
//! - **For agents**, say which fields define an operation ([`Builder::defining_fields`]) and
//!   whether another value of them is refused ([`DriftPolicy::Reject`](crate::DriftPolicy::Reject)):
//!   by default a regenerated call, and an identity reused for another order by mistake,
//!   finishes with the bytes first frozen, marked [`PayloadDiscarded`](crate::PayloadDiscarded)
//!   and logged as a warning.
//!
//! # Reconciling in-doubt operations
//!
//! [`Builder::reconcile`] takes a [`Reconcile`](crate::idempotency::Reconcile), asked before an in-doubt operation
//! would be resent to a provider that ignores keys: [`Reconciled::Applied`](crate::idempotency::Reconciled::Applied) records and
//! returns what it found ([`ResponseSource::Reconciled`](crate::ResponseSource::Reconciled)), [`Reconciled::NotApplied`](crate::idempotency::Reconciled::NotApplied) sends
//! the frozen bytes, [`Reconciled::Unknown`](crate::idempotency::Reconciled::Unknown) (and a reconciler that fails, panics or runs
//! past its bound) leaves the operation in doubt. [`LookupReconciler`](crate::idempotency::LookupReconciler) builds one from a
//! lookup request and a reading of its answer that you give it (a `2xx` alone never means
//! "applied": a search answers `200` with an empty list); its docs show a crash after
//! sending resolved this way.
//!
//! # A provider's 409
//!
//! A `409` to a keyed request means one of two things. "A request with this key is still
//! being processed" is a refusal, never the operation's outcome: the first request's real
//! answer is still to come. "Order already exists" is a business answer, and final. They
//! are told apart by this rule:
//!
//! - a `409` with `Retry-After` is the IETF draft's "still in progress";
//! - a `409` whose body is an RFC 9457 problem with the server face's
//!   [`IN_FLIGHT`](crate::server::problem::IN_FLIGHT) type (the draft registers no type of
//!   its own), or Stripe's `{"error":{"type":"idempotency_error"}}`, says the key is in use;
//! - any other `409` is a business answer: recorded and replayed.
//!
//! A refusal is never recorded. The [`FrozenRetryLayer`](crate::FrozenRetryLayer) inside
//! retries the one it can tell by its head (`Retry-After`) within the retry policy; one it
//! cannot, or one still refused when the policy is spent, leaves the operation in doubt,
//! and the caller gets a [key-in-use error](crate::Error::is_key_in_use), which says the
//! answer is not final (never a bare `409`). Running the step again resends the frozen
//! bytes, and the provider answers with the first request's outcome, which is recorded.
//!
//! Every request reaches the inner service as `Request<Full<Bytes>>`, so the inner stack is
//! the same whichever path a request takes.
//!
//! [`Builder::build_stack`] builds both layers in the right order from one
//! configuration ([`ClientStack`]): the body limit and the phase classifier apply to both,
//! and the ledger's TTLs are checked against the [retry policy](Builder::retry_policy)
//! really stacked inside. Stacked by hand the wrong way round (the retry layer outside),
//! the layers say so once, as a warning naming the fix.
//!
//! # Retrying layers: which wirings are refused, which cannot be seen
//!
//! One retrying layer belongs under this one: a [`FrozenRetryLayer`](crate::FrozenRetryLayer)
//! directly inside it (or both built as one with
//! [`build_stack`](Builder::build_stack)), which keeps "may have been sent" across its
//! attempts and, against a provider that [ignores keys](crate::ProviderKeys::Ignored),
//! never resends an attempt that may have arrived.
//!
//! - **Refused** (an [`is_retry_outside`](crate::Error::is_retry_outside) error, before the
//!   ledger is consulted, nothing sent): a `FrozenRetryLayer` **outside** this layer, seen
//!   on a side effect carrying an [`OperationId`](crate::OperationId).
//! - **Refused** (an [`is_retry_nested`](crate::Error::is_retry_nested) error, before the
//!   second one sends anything; the operation is released): a second `FrozenRetryLayer`
//!   under the one directly inside this layer. The first leaves a zero-sized mark on each
//!   attempt, which the second finds.
//! - **Refused** (an [`is_retry_inside`](crate::Error::is_retry_inside) error, at its
//!   second send, before any byte of it leaves; the operation settled as the first send's
//!   outcome dictates): a retrying layer that is not ours (`tower::retry`, a hedge) between
//!   this layer and [`ReqwestService`](crate::reqwest::ReqwestService), or between this
//!   layer and a `FrozenRetryLayer`. The request this layer hands on carries a mark in its
//!   extensions (the hand-off the `FrozenRetryLayer` takes), which such a layer's policy
//!   clones with the request; the transport, or the `FrozenRetryLayer`, counts the sends
//!   under it.
//! - **Not detected**, and not to be wired: any other retrying layer inside this one —
//!   `tower::retry` over a transport that is not this crate's (`hyper_util`'s `Client`, a
//!   service of your own), or whose policy drops the extensions when it clones the
//!   request, a retrying layer that is not ours under the `FrozenRetryLayer` inside this
//!   layer, or any under the service a [`build_stack`](Builder::build_stack) stack wraps
//!   (their attempts carry no mark: the mark would cost each one an allocation), a transport that
//!   retries by itself — and a `FrozenRetryLayer` outside this one around a request that
//!   carries its own `Idempotency-Key` rather than an `OperationId`. Against a provider that
//!   deduplicates, such a retry is one effect; against one that ignores keys, it can be
//!   two, and the response still reads [`Sent`](crate::ResponseSource::Sent).
//!
//! With `reqwest-middleware`, `reqwest-retry` goes **before** the
//! [`IdempotencyMiddleware`](crate::reqwest_middleware::IdempotencyMiddleware); placed after
//! it, it cannot be detected (see [that module](crate::reqwest_middleware)).
//!
//! # Layout
//!
//! [`builder`](Builder) → [`ClientFace`] (the settings, built) → the service
//! (`service.rs`) → [`ResponseFuture`] over one `Operation` (`operation.rs`: freeze,
//! claim) → an `Exchange` as the owner (`exchange.rs`: send, renew; `settle.rs`: settle the
//! lease by what happened), or the slow path for every other answer of the ledger
//! (`resolve.rs`: drift, doubt, fail open; `reconciling.rs`). Imports only flow that way.
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
//! use tower_idempotency::KeyHeader;
//! use tower_idempotency::{
//!     fingerprint::PayloadFields, ledger::MemoryStore, retry::RetryPolicy, FrozenRetryLayer,
//!     IdempotencyLayer, OperationId, ResponseSource,
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
//! let layer = IdempotencyLayer::client_builder(MemoryStore::new())
//!     .provider_deduplicates(true)
//!     .key_header(KeyHeader::ietf())
//!     // What the operation is: never discarded, a change there is refused.
//!     .defining_fields(PayloadFields::new(["/order_id", "/amount_cents"]).unwrap())
//!     .build()
//!     .unwrap();
//! let client = ServiceBuilder::new()
//!     .layer(layer) // once per logical operation
//!     .layer(FrozenRetryLayer::new(RetryPolicy::default())) // resends the frozen bytes
//!     .service(provider);
//!
//! let charge = |order: &str| {
//!     let body = format!(r#"{{"order_id":"{order}","amount_cents":1999}}"#);
//!     let mut req = Request::post("http://payments.local/charges")
//!         .body(Full::new(Bytes::from(body)))
//!         .unwrap();
//!     req.extensions_mut().insert(OperationId::new("task-7", "charge-customer"));
//!     req
//! };
//!
//! let first = client.clone().oneshot(charge("order_42")).await?;
//! let again = client.clone().oneshot(charge("order_42")).await?; // the orchestrator retried the step
//! assert_eq!(ResponseSource::of(&first), ResponseSource::Sent);
//! assert_eq!(ResponseSource::of(&again), ResponseSource::Replayed);
//! // The step's identity reused for another order: refused, never the first order's receipt.
//! let other = client.clone().oneshot(charge("order_43")).await.unwrap_err();
//! assert!(other.is_drift());
//! assert_eq!(charges.load(Ordering::SeqCst), 1);
//! # Ok(())
//! # }
//! ```
//!

mod builder;
mod exchange;
mod face;
mod failure;
mod future;
mod identify;
mod operation;
pub(crate) mod policy;
mod reconciling;
mod refusal;
mod release;
mod resolve;
mod send;
mod send_once;
mod service;
mod settle;
mod stack;

pub use builder::Builder;
pub use face::ClientFace;
// The tool face caps recorded outputs as this face caps responses.
pub use future::{ResponseFuture, StackFuture};
#[cfg(feature = "reqwest")]
pub(crate) use release::AnsweredAfterRedirect;
pub use release::ReleaseOn;
pub use send_once::{SendOnce, SendOnceFuture, SendOnceLayer};
#[cfg(feature = "reqwest-middleware")]
pub(crate) use service::run;
pub use stack::{ClientStack, StackService};

use crate::idempotency::IdempotencyLayer;

/// The client [`IdempotencyLayer`], as [`IdempotencyLayer::client`] and
/// [`Builder::build`] return it.
///
/// ```
/// use tower_idempotency::KeyHeader;
/// use tower_idempotency::{client::ClientLayer, ledger::MemoryStore, IdempotencyLayer, ProviderKeys};
///
/// let layer: ClientLayer = IdempotencyLayer::client(MemoryStore::new(), ProviderKeys::Deduplicates, KeyHeader::ietf());
/// # let _ = layer;
/// ```
pub type ClientLayer = IdempotencyLayer<ClientFace>;

/// The client stack over hyper-util's legacy client with connector `C` (feature
/// `hyper-util`), the stack of the README's quickstart.
///
/// ```
/// use bytes::Bytes;
/// use http_body_util::Full;
/// use hyper_util::client::legacy::{connect::HttpConnector, Client};
/// use hyper_util::rt::TokioExecutor;
/// use tower::Layer;
/// use tower_idempotency::KeyHeader;
/// use tower_idempotency::client::HyperStack;
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
///
/// let stack = IdempotencyLayer::client_builder(MemoryStore::new()).provider_deduplicates(true).key_header(KeyHeader::ietf()).build_stack().unwrap();
/// let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
/// let client: HyperStack<HttpConnector> = stack.layer(http);
/// # let _ = client;
/// ```
#[cfg(feature = "hyper-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "hyper-util")))]
pub type HyperStack<C> =
    StackService<hyper_util::client::legacy::Client<C, http_body_util::Full<bytes::Bytes>>>;
