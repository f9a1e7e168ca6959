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
//!    neither, the request passes through, or fails with a missing-key error when
//!    [required](ClientBuilder::require_key).
//! 2. Freeze the request (body limit 1 MiB; over it, nothing is sent).
//! 3. `begin` in the ledger, storing the frozen request before any byte leaves.
//! 4. **Acquired**: send. A response is recorded (up to 1 MiB; a larger one reaches the
//!    caller whole and is kept as a tombstone). A response meaning "try again" (`408`, `409`,
//!    `429`, `5xx`) leaves the operation *in doubt*, so a later run resends rather than
//!    replaying the failure. An error proven pre-write releases the operation; any other
//!    error leaves it in doubt.
//! 5. **Replay**: return the recorded response without calling the inner service, marked
//!    with [`ResponseSource::Replayed`].
//! 6. **Resume** (in doubt): resend the **stored** frozen bytes under the same key.
//! 7. **Busy**: wait for the owner (bounded, [`BusyPolicy`]) or fail.
//! 8. **Drift** (same operation, different payload): refuse, naming the changed JSON
//!    fields, or resend the original bytes ([`DriftPolicy`]).
//!
//! Every request reaches the inner service as `Request<Full<Bytes>>`, so the inner stack is
//! the same whichever path a request takes.
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

mod body;
mod client;
mod engine;
mod layer;

pub use body::ResponseBody;
pub use client::{Client, ClientBuilder, ClientFuture, DriftPolicy, DEFAULT_RESPONSE_LIMIT};
pub use engine::{BusyPolicy, DEFAULT_LEASE, DEFAULT_RETENTION};
pub use layer::{Idempotency, IdempotencyLayer};

/// Where a response came from: a response extension set by the client
/// [`IdempotencyLayer`] on every response of a side-effecting operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ResponseSource {
    /// The operation was sent for the first time.
    Sent,
    /// The operation was in doubt; its stored frozen bytes were sent again.
    Resent,
    /// The recorded response of a completed operation; the inner service was not called.
    Replayed,
}
