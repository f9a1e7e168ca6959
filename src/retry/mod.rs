//! Retries that resend the request's exact bytes.
//!
//! A retry that re-runs the code (or the model) that produced a request sends *new* bytes
//! under the *old* idempotency key — a reworded `summary`, a fresh `fulfillment_intent_id` —
//! and no server-side deduplication on the key can catch it. [`FrozenRetryLayer`] freezes the
//! request once, before the first network call ([`FrozenRequest`](crate::FrozenRequest)),
//! and every attempt sends exactly those bytes: same method, URI, version, headers and body.
//!
//! The pieces are separate, as in tower's `retry`:
//!
//! - **what** to retry: a [`ClassifyRetry`]; the [`DefaultClassifier`] never resends a
//!   side-effecting request without a key (under its
//!   [`KeyHeader`](crate::key::KeyHeader), `Idempotency-Key` by default) once its bytes may
//!   have left;
//! - **when**: full-jitter exponential backoff on tower's `ExponentialBackoff` schedule, or
//!   the server's `Retry-After`;
//! - **how much**: at most 5 attempts, a maximum elapsed time, and
//!   a retry budget with tower's `TpsBudget`'s arithmetic, so a fleet-wide outage is not
//!   multiplied by retries (kept without `TpsBudget`'s lock on every call; a shared
//!   `TpsBudget` of your own is used as it is).
//!
//! Why a budget: with 3 attempts per call, a dependency that fails every request receives
//! 3× its normal load exactly when it is least able to take it. The budget caps retries at
//! a fraction (20 %) of recent calls plus a small floor, so retries help with sporadic
//! failures and stand back during an outage.
//!
//! Responses that took more than one attempt carry an [`Attempts`] extension
//! ([`Attempts::of`] reads any response); every attempt emits a `tracing` event at `DEBUG`.
//!
//! # Example
//!
//! ```
//! use bytes::Bytes;
//! use http::{Request, Response};
//! use http_body_util::Full;
//! use tower::{service_fn, ServiceBuilder, ServiceExt};
//! use tower_idempotency::retry::{Attempts, RetryPolicy};
//! use tower_idempotency::FrozenRetryLayer;
//! use std::sync::atomic::{AtomicU32, Ordering};
//! use std::sync::Arc;
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), tower_idempotency::Error> {
//! let calls = Arc::new(AtomicU32::new(0));
//! let flaky = service_fn({
//!     let calls = calls.clone();
//!     move |_req: Request<Full<Bytes>>| {
//!         let n = calls.fetch_add(1, Ordering::SeqCst);
//!         async move {
//!             let status = if n == 0 { 503 } else { 200 };
//!             Ok::<_, std::convert::Infallible>(
//!                 Response::builder().status(status).body(Full::new(Bytes::new())).unwrap(),
//!             )
//!         }
//!     }
//! });
//! let client = ServiceBuilder::new()
//!     .layer(FrozenRetryLayer::new(RetryPolicy::default()))
//!     .service(flaky);
//!
//! // A GET is safe to resend: the 503 is retried.
//! let req = Request::get("http://inventory.local/stock").body(Full::new(Bytes::new())).unwrap();
//! let response = client.oneshot(req).await?;
//! assert_eq!(response.status(), 200);
//! assert_eq!(Attempts::of(&response).get(), 2);
//! # Ok(())
//! # }
//! ```

mod attempts;
mod backoff;
mod budget;
mod call;
mod future;
pub(crate) mod layer;
mod policy;
mod service;

pub use attempts::Attempts;
pub use backoff::retry_after;
pub(crate) use future::FrozenAttempts;
pub use future::ResponseFuture;
pub(crate) use layer::FrozenRetryLayer;
pub use policy::{
    AttemptResult, ClassifyRetry, DefaultClassifier, RetryContext, RetryDecision, RetryPolicy,
    RetryPolicyBuilder,
};
pub use service::FrozenRetry;

pub(crate) use backoff::FullJitter;
pub(crate) use policy::{is_in_progress_answer, is_retryable_status};
