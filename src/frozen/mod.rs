//! Frozen requests: capture a request's bytes once, resend exactly those bytes every time.
//!
//! A retry that rebuilds its request — re-running the step that produced it — sends new
//! bytes under the old key (the second incident this crate exists to stop). A
//! [`FrozenRequest`] is captured once, before the first network call: method, URI, version,
//! headers and the whole body as [`Bytes`](bytes::Bytes). Each attempt is rebuilt from it by
//! cloning `Bytes` (a reference-count increment) and the head; the body is never copied again.
//!
//! The body is collected under a limit (1 MiB unless the layer's `body_limit` says
//! otherwise) enforced twice: up front from `Content-Length` and the body's size hint, and
//! again while the body streams in. Over the limit, freezing fails with a `BodyTooLarge`
//! [`Error`](crate::Error) and nothing is sent. Trailers are not part of a frozen request.
//!
//! # Example
//!
//! ```
//! use bytes::Bytes;
//! use http_body_util::{BodyExt, Full};
//! use tower_idempotency::FrozenRequest;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tower_idempotency::Error> {
//! let req = http::Request::post("http://orders.local/orders")
//!     .header("content-type", "application/json")
//!     .body(Full::new(Bytes::from_static(b"{\"sku\":\"SKU-4471\"}")))
//!     .unwrap();
//! let (frozen, _extensions) = FrozenRequest::freeze(req, 1024).await?;
//!
//! let first = frozen.to_request();
//! let second = frozen.to_request();
//! assert_eq!(first.uri(), second.uri());
//! assert_eq!(
//!     first.into_body().collect().await.unwrap().to_bytes(),
//!     second.into_body().collect().await.unwrap().to_bytes(),
//! );
//! # Ok(())
//! # }
//! ```

mod collect;
mod handoff;
pub(crate) mod request;

#[cfg(feature = "tonic")]
pub(crate) use collect::collect_request;
pub(crate) use collect::{check_declared_length, check_length, declared_length, CollectRequest};
pub(crate) use handoff::{
    hand_over, refuse_nested_retry, Handed, Handoff, OperationAttempt, RetriedOutside,
};
#[cfg(test)]
pub(crate) use request::test_post;
pub(crate) use request::{Adding, FrozenRequest};

/// The default limit on a request body that may be frozen: 1 MiB.
pub(crate) const DEFAULT_BODY_LIMIT: usize = 1024 * 1024;
