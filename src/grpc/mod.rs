//! gRPC unary calls, once: retries for tonic channels that resend the frozen message.
//!
//! tonic is built on tower, yet `tower::retry` cannot retry its calls: a request's body is a
//! stream, and a stream cannot be cloned. [`RetryLayer`] freezes a unary call's encoded
//! message once (the 5-byte gRPC prefix and the message, under the policy's body limit) and
//! sends every attempt with exactly those bytes; only the metadata may change between
//! attempts.
//!
//! # Which calls, and when (gRFC A6)
//!
//! - **Which calls**: the methods a [`Methods`] table names as unary or server-streaming.
//!   On the wire a unary call looks like a streaming one, so a method the table does not
//!   name is passed through untouched, sent once.
//! - **Committed once the answer's headers arrive**: an answer whose headers do not carry
//!   its status (a normal answer, whose status comes in its trailers) is returned as it is,
//!   whatever its trailers say later. Only a *trailers-only* answer (its `grpc-status` in
//!   its headers) or an HTTP error from a proxy (mapped by gRPC's HTTP-to-gRPC table: a
//!   `503` is `UNAVAILABLE`) can be retried, when its code is retryable (`UNAVAILABLE`
//!   unless [`RetryLayer::retryable_codes`] says otherwise).
//! - **Only what cannot charge twice**: a failure proven to happen before anything was
//!   written (tonic's `ConnectError`, a refused connection) is always retried. A call that
//!   may have reached the server (a retryable status, a reset, a timed-out attempt, which is
//!   read as `UNAVAILABLE`) is resent only when resending is harmless: the method is
//!   `NO_SIDE_EFFECTS` or `IDEMPOTENT` in the table, or the call carries an idempotency key
//!   in its metadata (under the policy's [key header](crate::retry::RetryPolicyBuilder::key_header),
//!   `idempotency-key` by default) for a server that deduplicates.
//! - **`grpc-retry-pushback-ms`**: a server's pushback replaces the backoff (full jitter
//!   otherwise); a negative or malformed one ends the retries.
//! - **`grpc-previous-rpc-attempts`** is sent on every retry; **`grpc-timeout`**, when the
//!   caller set one, is the caller's deadline: each attempt is sent with what is left of it,
//!   and no retry starts after it.
//! - **Throttling**: the policy's retry budget (a fifth of recent calls plus a floor) is
//!   asked before every retry, so a failing service is not sent three times its load.
//! - Attempts, backoff, the overall deadline (`max_elapsed`) and the per-attempt timeout are
//!   the policy's, as on the HTTP face. The answer of a call that took more than one attempt
//!   carries an [`Attempts`](crate::retry::Attempts) extension.
//!
//! # Example
//!
//! Between a tonic channel and the client generated for it:
//!
//! ```
//! use tonic::transport::Channel;
//! use tower::ServiceBuilder;
//! use tower_idempotency::grpc::{Methods, RetryLayer};
//! use tower_idempotency::retry::RetryPolicy;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let methods = Methods::new()
//!     .unary("/payments.v1.Payments/Charge")
//!     .reads("/payments.v1.Payments/GetCharge");
//! let channel = Channel::from_static("http://127.0.0.1:50051").connect_lazy();
//! let channel = ServiceBuilder::new()
//!     .layer(RetryLayer::new(RetryPolicy::default(), methods))
//!     .service(channel);
//! // Any generated client takes it: `PaymentsClient::new(channel)`.
//! let client = tonic::client::Grpc::new(channel);
//! # let _ = client;
//! # }
//! ```

mod methods;
mod retry;
mod wire;

pub use methods::{Method, MethodEffect, MethodKind, Methods};
pub use retry::{ResponseFuture, Retry, RetryLayer};
