//! A fault-injecting side-effect service: a payment, email or order provider double.
//!
//! Use [`SideEffectService`] to assert "one effect per operation" in your own tests. It
//! stands in for the downstream service whose effect must happen exactly once (a card
//! charge, a sent email, a placed order): every call that *commits* counts one effect for
//! the request's `Idempotency-Key`, and faults can be queued to fail calls at the points
//! that matter, so a test can replay both incidents this crate exists to stop:
//!
//! - [`Fault::CommitThenTimeout`]: the effect happens, the answer never arrives, the caller
//!   times out and retries (the first incident).
//! - [`Fault::ServerError`] with `commit: true`: a `500` although the write happened.
//! - [`Fault::RefuseBeforeSend`]: a refused connection, proven to fail before the write.
//! - [`Fault::Panic`] and [`Fault::Latency`]: a provider that dies mid-way, or is slow.
//!
//! Faults are queued and consumed one per call, in order; a call with no fault queued
//! behaves normally. All clones of a service share one state, so keep a clone to read the
//! counts ([`effects_for_key`](SideEffectService::effects_for_key),
//! [`attempts`](SideEffectService::attempts), …) after handing another to the stack under
//! test. Use it in-process as the inner service of a tower stack, or over real HTTP with
//! [`SideEffectService::serve`].
//!
//! # How a call is answered
//!
//! 1. The call takes the next queued fault. [`Fault::RefuseBeforeSend`] fails it at once.
//! 2. The whole body is read and the request recorded in the
//!    [`attempts`](SideEffectService::attempts) log.
//! 3. With key honouring on (the default, like a payment provider), a request with a key is
//!    checked against earlier ones with the same key:
//!
//!    | earlier request with this key | answer | effect |
//!    |---|---|---|
//!    | none | commit (below) | yes |
//!    | committed, same body | the first commit's response, with `idempotent-replayed: true` | no |
//!    | committed, different body | `422` JSON error | no |
//!    | still being processed | `409` JSON error with `retry-after: 1` | no |
//!    | (the key header is malformed or repeated) | `400` JSON error | no |
//!
//!    With key honouring off (a naive provider) or without a key, every call commits.
//! 4. The provider "works" for the base latency plus any [`Fault::Latency`].
//! 5. A commit is the side effect: it counts one effect for the key, assigns an effect id
//!    (`eff_1`, `eff_2`, … in commit order) and answers `201 Created` with
//!    `content-type: application/json` and the body
//!    `{"effect_id":"eff_N","key":"<key>" or null,"body_sha256":"<hex>"}`.
//!
//! # Looking an effect up
//!
//! `GET /effects?idempotency_key=<key>` ([`LOOKUP_PATH`]) asks the provider whether it
//! committed an effect under `<key>` — whether or not it honours keys, as a provider that
//! ignores `Idempotency-Key` for deduplication may still store it with the charge. Found:
//! `200` with the first such commit's body; not found: `404`. This is what a
//! [reconciler](crate::idempotency::LookupReconciler) asks about an in-doubt operation. A
//! lookup is a call (it counts in [`calls`](SideEffectService::calls) and in
//! [`lookups`](SideEffectService::lookups), and takes the next queued fault, so a test can
//! make the lookup itself fail), but never an effect nor an attempt.
//!
//! A fault acts on the call that takes it, whatever step 3 decided; its commit part only
//! happens when the call would commit (a replay, a `409` or a `422` never commits). Once a
//! call has claimed a key, the provider finishes its work even if the caller gives up
//! (drops the future) during the latency, as a real server does when a client disconnects.
//!
//! # Example
//!
//! The first incident, and a provider that honours keys saving the day:
//!
//! ```
//! use std::time::Duration;
//!
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use tower::ServiceExt;
//! use tower_idempotency::testing::{Fault, SideEffectService};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! let provider = SideEffectService::new().with_faults([Fault::CommitThenTimeout]);
//!
//! let charge = || {
//!     http::Request::post("http://payments.local/charges")
//!         .header("idempotency-key", "\"order-42\"")
//!         .body(Full::new(Bytes::from_static(b"{\"amount\":4200}")))
//!         .unwrap()
//! };
//!
//! // The provider charges the card, but its answer never arrives: the caller times out.
//! let first = tokio::time::timeout(Duration::from_secs(5), provider.clone().oneshot(charge())).await;
//! assert!(first.is_err());
//! assert_eq!(provider.effects_for_key("order-42"), 1);
//!
//! // The retry sends the same key and the same bytes: the provider replays its first answer.
//! let retry = provider.clone().oneshot(charge()).await.unwrap();
//! assert_eq!(retry.status(), http::StatusCode::CREATED);
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//!
//! // One operation, one charge.
//! assert_eq!(provider.effects_for_key("order-42"), 1);
//! assert_eq!(provider.calls(), 2);
//! # }
//! ```

mod builder;
mod captured;
mod fault;
mod future;
mod responses;
mod serve;
mod service;
mod state;
#[cfg(test)]
mod tests;

pub use builder::SideEffectServiceBuilder;
pub use captured::CapturedRequest;
pub use fault::Fault;
pub use future::ResponseFuture;
pub use serve::ServeHandle;
pub use service::SideEffectService;

/// Where [`SideEffectService`] answers lookups: `GET /effects?idempotency_key=<key>` (see
/// the [module docs](self#looking-an-effect-up)).
///
/// ```
/// # use bytes::Bytes;
/// # use http_body_util::Full;
/// # use tower::ServiceExt;
/// use tower_idempotency::testing::{SideEffectService, LOOKUP_PATH};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let provider = SideEffectService::builder().honour_keys(false).build();
/// let lookup = || {
///     http::Request::get(format!("http://pay.local{LOOKUP_PATH}?idempotency_key=k-1"))
///         .body(Full::new(Bytes::new()))
///         .unwrap()
/// };
/// assert_eq!(provider.clone().oneshot(lookup()).await.unwrap().status(), 404);
///
/// let charge = http::Request::post("http://pay.local/charges")
///     .header("idempotency-key", "k-1")
///     .body(Full::new(Bytes::from_static(b"{}")))
///     .unwrap();
/// provider.clone().oneshot(charge).await.unwrap();
/// assert_eq!(provider.clone().oneshot(lookup()).await.unwrap().status(), 200);
/// assert_eq!((provider.effects(), provider.lookups()), (1, 2));
/// # }
/// ```
pub const LOOKUP_PATH: &str = "/effects";
