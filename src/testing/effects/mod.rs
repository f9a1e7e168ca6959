//! [`SideEffectService`]: the fault-injecting provider double, one role per file.

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
/// [`SideEffectService`](crate::testing::SideEffectService#looking-an-effect-up)).
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
