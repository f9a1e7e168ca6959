//! reqwest, first class (feature `reqwest`): the layers in front of a [`reqwest::Client`].
//!
//! reqwest's `Client` is a `tower::Service<reqwest::Request>`; the layers speak
//! `http::Request<Full<Bytes>>`. [`ReqwestService`] bridges the two with reqwest's own
//! conversions, moving the frozen body (one buffer) rather than copying it, and answers
//! `http::Response<reqwest::Body>`, so responses stream as reqwest hands them out.
//!
//! With this feature on, [`phase::classify`](crate::phase::classify) knows reqwest's errors: a
//! connect error (refused, DNS, TLS handshake) happened **before** the request was written
//! and releases the operation; any other failure (a timeout once the request was handed to
//! a connection, a reset, a body error) may have been sent and leaves it in doubt. No
//! `classify_phase` is needed.
//!
//! # Redirects
//!
//! A `reqwest::Client` follows up to ten redirects by default, and the layers then see the
//! last hop's answer or failure, not their request's. An answer got by following a redirect
//! is never taken to say the operation never started (a redirect's `401` or `429` does not
//! release it); but a failure on a later hop looks like one on the first, and reqwest gives
//! it the first hop's URL: a connect error there reads as "before the request was written"
//! and releases an operation that ran. **The client must be built with
//! `.redirect(reqwest::redirect::Policy::none())`**: a redirect is then the answer, recorded
//! as the operation's outcome; [`ReqwestService::from_builder`] builds it so. The layers
//! warn once when they see a client follow one, but
//! they see it only by the answer's URL, so a redirect back to the URL sent (a
//! `303 Location` to the same path) goes unseen, and a middleware after ours that rewrites
//! the URL makes every answer look redirected (none then releases the operation).
//!
//! # A retrying layer inside
//!
//! A `tower::retry` or `tower::hedge` between the client face and [`ReqwestService`] is
//! seen in the type the face wraps, and every side effect is refused before it is sent.
//! One the type hides (boxed, or your own) is seen at run time: the client face marks each
//! operation's request (in its extensions), and
//! [`ReqwestService`] counts the sends made under that mark: a retrying layer between the
//! two that is not a [`FrozenRetryLayer`](crate::FrozenRetryLayer) resends the attempt
//! blind to the provider's keys, and its second send is refused
//! before any byte of it leaves, with an error that names the wiring
//! ([`Error::is_retry_inside`](crate::Error::is_retry_inside)). The operation is settled
//! as the first send's outcome dictates: left in doubt if it may have reached the
//! provider, released only if it failed before it was written. A retry policy that drops
//! the extensions when it clones the request, or a retrying layer under a
//! `FrozenRetryLayer`, goes unseen (see
//! [`IdempotencyLayer::client`](crate::IdempotencyLayer::client), "Retrying layers").
//!
//! # Example
//!
//! ```no_run
//! use std::time::Duration;
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use tower::{ServiceBuilder, ServiceExt};
//! use tower_idempotency::KeyHeader;
//! use tower_idempotency::reqwest::ReqwestService;
//! use tower_idempotency::{
//!     ledger::MemoryStore, retry::RetryPolicy, FrozenRetryLayer, IdempotencyLayer, OperationId,
//! };
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tower::BoxError> {
//! let policy = RetryPolicy::builder().attempt_timeout(Duration::from_secs(2)).build()?;
//! let client = ServiceBuilder::new()
//!     .layer(IdempotencyLayer::client_builder(MemoryStore::new()).provider_deduplicates(true).key_header(KeyHeader::ietf()).retry_policy(policy.clone()).build()?)
//!     .layer(FrozenRetryLayer::new(policy))
//!     // Redirects off: a redirect comes back as the answer, never followed (see above).
//!     .service(ReqwestService::from_builder(reqwest::Client::builder())?);
//!
//! let mut charge = http::Request::post("https://payments.example/v1/charges")
//!     .header("content-type", "application/json")
//!     .body(Full::new(Bytes::from(r#"{"order_id":"order_42","amount_cents":1999}"#)))?;
//! charge.extensions_mut().insert(OperationId::new("task-7", "charge_customer"));
//! let response = client.oneshot(charge).await?;
//! # let _ = response;
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use tower_service::Service;

use crate::BoxError;

/// A [`reqwest::Client`] as a `Service<http::Request<Full<Bytes>>>`, the shape the layers
/// send. See the [module docs](self).
///
/// Build it with [`from_builder`](Self::from_builder), which turns reqwest's redirects off
/// (see [Redirects](self#redirects)); [`new`](Self::new) takes a client as it was built.
///
/// ```
/// use tower_idempotency::reqwest::ReqwestService;
///
/// let service = ReqwestService::from_builder(reqwest::Client::builder()).unwrap();
/// assert!(format!("{service:?}").contains("ReqwestService"));
/// ```
#[derive(Clone)]
pub struct ReqwestService {
    client: ::reqwest::Client,
}

impl ReqwestService {
    /// Build the client from `builder` **with redirects turned off**, whatever `builder`
    /// said about them, and send through it: a redirect then comes back as the answer and
    /// is recorded as the operation's outcome, rather than followed to a hop whose failure
    /// would read as "never sent" (see [Redirects](self#redirects)). The rest of the
    /// builder (TLS, timeouts, pool, proxies) is kept.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::reqwest::ReqwestService;
    ///
    /// let service = ReqwestService::from_builder(
    ///     reqwest::Client::builder().connect_timeout(Duration::from_secs(2)),
    /// )
    /// .unwrap();
    /// # let _ = service;
    /// ```
    pub fn from_builder(builder: ::reqwest::ClientBuilder) -> Result<Self, ::reqwest::Error> {
        let client = builder
            .redirect(::reqwest::redirect::Policy::none())
            .build()?;
        Ok(Self { client })
    }

    /// Send through `client` as it was built (its connection pool, TLS and timeouts are
    /// its own). reqwest follows redirects unless the client was built with
    /// `.redirect(reqwest::redirect::Policy::none())`: prefer
    /// [`from_builder`](Self::from_builder), which does that for you.
    pub fn new(client: ::reqwest::Client) -> Self {
        Self { client }
    }

    /// The client requests are sent through.
    pub fn client(&self) -> &::reqwest::Client {
        &self.client
    }
}

impl fmt::Debug for ReqwestService {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReqwestService").finish_non_exhaustive()
    }
}

/// The whole client stack in front of a `reqwest::Client`, as
/// [`ClientStack`](crate::client::ClientStack) builds it over a [`ReqwestService`].
///
/// ```
/// use tower::Layer;
/// use tower_idempotency::KeyHeader;
/// use tower_idempotency::reqwest::{ReqwestClientStack, ReqwestService};
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
///
/// let stack = IdempotencyLayer::client_builder(MemoryStore::new()).provider_deduplicates(true).key_header(KeyHeader::ietf()).build_stack().unwrap();
/// let no_redirects = reqwest::Client::builder()
///     .redirect(reqwest::redirect::Policy::none())
///     .build()
///     .unwrap();
/// let client: ReqwestClientStack = stack.layer(ReqwestService::new(no_redirects));
/// # let _ = client;
/// ```
pub type ReqwestClientStack = crate::client::StackService<ReqwestService>;

/// The future of [`ReqwestService`].
pub type ReqwestFuture =
    Pin<Box<dyn Future<Output = Result<http::Response<::reqwest::Body>, BoxError>> + Send>>;

/// Mark a response reqwest got by following a redirect (see the [module
/// docs](self#redirects)): the client face never takes its status for its request's, and
/// raises [`Signal::RedirectFollowed`](crate::idempotency::Signal::RedirectFollowed) for it
/// (metrics, `on_outcome`) every time. Says so once, at `WARN`: such a client's failures
/// on a redirect's hop cannot be told from failures before the request was sent.
pub(crate) fn followed_a_redirect(extensions: &mut http::Extensions) {
    static WARNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    extensions.insert(crate::client::AnsweredAfterRedirect);
    if !WARNED.swap(true, std::sync::atomic::Ordering::Relaxed) {
        tracing::warn!(
            "reqwest followed a redirect of a request the idempotency layer sent: build the \
             reqwest::Client with .redirect(reqwest::redirect::Policy::none()), or a failure \
             on a redirect's hop (a receipt page that refuses connections) reads as a failure \
             before the operation was sent, and releases an operation that ran"
        );
    }
}

impl Service<http::Request<Full<Bytes>>> for ReqwestService {
    type Response = http::Response<::reqwest::Body>;
    type Error = BoxError;
    type Future = ReqwestFuture;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // reqwest's pool makes room (or a connection) inside `execute`.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Full<Bytes>>) -> Self::Future {
        let client = self.client.clone();
        // The operation's mark (see [A retrying layer inside](self#a-retrying-layer-inside)):
        // a second send under it is refused here, before any byte of it leaves.
        let attempt = req.extensions().get::<crate::frozen::Handoff>().cloned();
        if let Some(Err(refused)) = attempt.as_ref().map(crate::frozen::Handoff::start_send) {
            return Box::pin(std::future::ready(Err(refused.into())));
        }
        Box::pin(async move {
            let result = send(&client, req).await;
            if let Some(attempt) = attempt {
                attempt.first_send_ended(match &result {
                    Ok(_) => crate::phase::FailurePhase::AfterWrite,
                    Err(err) => crate::phase::classify(&**err, None),
                });
            }
            result
        })
    }
}

/// Send `req` through `client`, marking an answer reqwest got by following a redirect.
async fn send(
    client: &::reqwest::Client,
    req: http::Request<Full<Bytes>>,
) -> Result<http::Response<::reqwest::Body>, BoxError> {
    let (parts, body) = req.into_parts();
    // A frozen body is one buffer: collecting it is a move, not a copy.
    let body = body.collect().await?.to_bytes();
    let req = ::reqwest::Request::try_from(http::Request::from_parts(parts, body))?;
    let sent = req.url().clone();
    let response = client.execute(req).await?;
    let redirected = *response.url() != sent;
    let mut response = http::Response::from(response);
    if redirected {
        followed_a_redirect(response.extensions_mut());
    }
    Ok(response)
}
