//! reqwest-middleware (feature `reqwest-middleware`): the client face as a
//! [`reqwest_middleware::Middleware`].
//!
//! [`IdempotencyMiddleware`] gives a `ClientWithMiddleware` the client face's guarantees:
//! the key is derived from the [`OperationId`] in the request's extensions (the
//! `RequestBuilder::with_extension` ones or the request's own), the ledger is consulted
//! before anything is sent, a completed operation is replayed without a request, an
//! operation in doubt is resumed by resending the **stored** frozen bytes under the same
//! key, and a regenerated payload under a known operation finishes it with the bytes first
//! frozen, the response marked [`PayloadDiscarded`](crate::PayloadDiscarded) (or is refused
//! as drift: see [`DriftPolicy`](crate::DriftPolicy)). It drives the
//! same engine as [`IdempotencyLayer`](crate::IdempotencyLayer), around
//! `next.run(req, extensions)`: the rest of the chain (and reqwest) sends the frozen bytes.
//! Build the `reqwest::Client` under the chain without redirects, for the reason
//! [`crate::reqwest`'s docs](crate::reqwest#redirects) give.
//!
//! # Retries: put `reqwest-retry` before it, never after it
//!
//! The middleware does not retry by itself. With `reqwest-retry`, add the retry middleware
//! **first** (outside), this one after it:
//!
//! ```text
//! ClientBuilder::new(client)
//!     .with(RetryTransientMiddleware::new_with_policy(policy)) // outside: retries the operation
//!     .with(IdempotencyMiddleware::new(layer))                 // inside: one ledger visit per attempt
//!     .build()
//! ```
//!
//! Then every retry goes through the ledger, so there is one retrying layer and retries
//! are exactly the ledger's: an attempt that timed out after its bytes may have left puts
//! the operation in doubt, and the retry **resumes** it, resending the stored bytes
//! (byte-identical: method, target, headers, body) under the same key; an attempt answered
//! `5xx` does the same; an attempt whose answer was recorded is replayed. Transport errors
//! come back to `reqwest-retry` as the `reqwest::Error` they were, so its transient/fatal
//! judgement is unchanged; the ledger's own refusals (drift, busy, ledger unavailable) come
//! back as `reqwest_middleware::Error::Middleware` wrapping a [`crate::Error`], which it
//! treats as fatal.
//!
//! Placed **after** this middleware, `reqwest-retry` would retry inside one ledger visit:
//! an attempt that may have reached the server followed by one refused at connect would
//! read as "nothing was sent", and the operation would be released instead of left in
//! doubt — the next run would send whatever payload it then has. Against a provider that
//! ignores keys, its retry after a timeout is a second effect, and the response still
//! reads [`Sent`](crate::ResponseSource::Sent).
//!
//! **This wiring cannot be detected**: the rest of the chain is opaque to a middleware
//! (`Next` lists no middleware), and `reqwest-retry` duplicates the request with
//! `Request::try_clone` and hands each copy on with the same extensions to reqwest itself,
//! so nothing of ours sees a second send (unlike a `tower::retry` between the tower
//! [`IdempotencyLayer`](crate::IdempotencyLayer) and
//! [`ReqwestService`](crate::reqwest::ReqwestService), which is refused: see
//! [`Error::is_retry_inside`](crate::Error::is_retry_inside)). Nor is any other retrying
//! middleware after this one. Order the chain as above.
//!
//! # Finding our error behind `reqwest-retry`
//!
//! A refusal of ours reaches the caller two wrappers deep: `reqwest-retry` wraps the
//! `reqwest_middleware::Error::Middleware` this middleware returned in its `RetryError`,
//! inside another `Middleware`, and both forward `source` past what they hold. Use
//! [`Error::find`](crate::Error::find):
//!
//! ```
//! fn refused_as_drift(err: &reqwest_middleware::Error) -> bool {
//!     tower_idempotency::Error::find(err).is_some_and(tower_idempotency::Error::is_drift)
//! }
//! # let _ = refused_as_drift;
//! ```
//!
//! **Instead of `reqwest-retry`**, stack [`ClientStack`](crate::client::ClientStack)
//! over [`ReqwestService`](crate::reqwest::ReqwestService): the frozen-retry layer retries
//! inside one operation and keeps "may have been sent" across its attempts. Without any
//! retrying layer, a failed operation stays in doubt and the orchestrator's next run of
//! the step resumes it.
//!
//! # Example
//!
//! ```no_run
//! use reqwest_middleware::ClientBuilder;
//! use tower_idempotency::reqwest_middleware::IdempotencyMiddleware;
//! use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer, KeyHeader, OperationId, ProviderKeys};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let no_redirects = reqwest::Client::builder()
//!     .redirect(reqwest::redirect::Policy::none())
//!     .build()?;
//! let client = ClientBuilder::new(no_redirects)
//!     // A provider that honours `Idempotency-Key`: an operation in doubt may be resent.
//!     .with(IdempotencyMiddleware::new(IdempotencyLayer::client(
//!         MemoryStore::new(),
//!         ProviderKeys::Deduplicates,
//!         KeyHeader::ietf(),
//!     )))
//!     .build();
//!
//! let response = client
//!     .post("https://payments.example/v1/charges")
//!     .header("content-type", "application/json")
//!     .body(r#"{"order_id":"order_42","amount_cents":1999}"#)
//!     // The orchestrator owns this identity; never derive it from the payload.
//!     .with_extension(OperationId::new("task-7", "charge_customer"))
//!     .send()
//!     .await?;
//! # let _ = response;
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::Extensions;
use http_body_util::{BodyExt, Full};
use reqwest::ResponseBuilderExt;
use reqwest_middleware::{Middleware, Next};
use tower_service::Service;
use tracing::Instrument;

use crate::client::{self, ClientFace, ClientLayer};
use crate::idempotency::request_span;
use crate::{BoxError, EffectClass, OperationId, ResponseSource};

/// The client face as a `reqwest_middleware::Middleware`. See the [module docs](self).
///
/// **A retrying middleware after this one (`reqwest-retry` added after it) cannot be
/// detected**, and would resend attempts that may have run: put it before this one (see
/// [Retries](self#retries-put-reqwest-retry-before-it-never-after-it)).
///
/// ```
/// use tower_idempotency::KeyHeader;
/// use tower_idempotency::reqwest_middleware::IdempotencyMiddleware;
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
///
/// let layer = IdempotencyLayer::client_builder(MemoryStore::new()).provider_deduplicates(true).key_header(KeyHeader::ietf())
///     .scope("billing-agent")
///     .build()
///     .unwrap();
/// let no_redirects = reqwest::Client::builder()
///     .redirect(reqwest::redirect::Policy::none())
///     .build()
///     .unwrap();
/// let client = reqwest_middleware::ClientBuilder::new(no_redirects)
///     .with(IdempotencyMiddleware::new(layer))
///     .build();
/// # let _ = client;
/// ```
#[derive(Clone)]
pub struct IdempotencyMiddleware {
    face: Arc<ClientFace>,
}

impl IdempotencyMiddleware {
    /// The middleware applying `layer`'s configuration (store, scope, policies, limits,
    /// hook). Build the layer with [`retry_policy`](crate::client::Builder::retry_policy)
    /// covering your `reqwest-retry` policy's total time, so records outlive its retries.
    pub fn new(layer: ClientLayer) -> Self {
        Self {
            face: layer.face().clone(),
        }
    }
}

impl fmt::Debug for IdempotencyMiddleware {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IdempotencyMiddleware")
            .field("face", &self.face)
            .finish()
    }
}

impl Middleware for IdempotencyMiddleware {
    fn handle<'life0, 'life1, 'life2, 'async_trait>(
        &'life0 self,
        req: reqwest::Request,
        extensions: &'life1 mut Extensions,
        next: Next<'life2>,
    ) -> Pin<
        Box<
            dyn Future<Output = reqwest_middleware::Result<reqwest::Response>>
                + Send
                + 'async_trait,
        >,
    >
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        'life2: 'async_trait,
        Self: 'async_trait,
    {
        let span = request_span!(face = "client", key = tracing::field::Empty);
        Box::pin(operation(self.face.clone(), req, extensions, next).instrument(span.into_span()))
    }
}

/// One operation: the client face's flow, with the rest of the chain as its transport.
async fn operation(
    face: Arc<ClientFace>,
    req: reqwest::Request,
    extensions: &mut Extensions,
    next: Next<'_>,
) -> reqwest_middleware::Result<reqwest::Response> {
    let url = req.url().clone();
    // The conversion to `http` forgets the per-request timeout; the attempts get it back.
    let timeout = req.timeout().copied();
    let mut req = http::Request::<reqwest::Body>::try_from(req)?;
    // `with_extension` puts the operation's identity in the middleware's extensions.
    if let Some(op) = extensions.get::<OperationId>() {
        req.extensions_mut().insert(op.clone());
    }
    if let Some(class) = extensions.get::<EffectClass>() {
        req.extensions_mut().insert(*class);
    }
    let started = face.on_outcome_set().then(tokio::time::Instant::now);
    let rest = RestOfChain {
        next,
        extensions: extensions.clone(),
        timeout,
    };
    match client::run(rest, face, req, started).await {
        Ok(response) => Ok(into_reqwest(response, url)),
        Err(err) => Err(into_middleware_error(err)),
    }
}

/// A response of the client face as reqwest's. A replay never went through reqwest, so it
/// gets the request's URL; a sent response keeps the URL reqwest gave it.
fn into_reqwest(
    response: http::Response<crate::idempotency::ResponseBody<reqwest::Body>>,
    url: reqwest::Url,
) -> reqwest::Response {
    let (mut parts, body) = response.into_parts();
    if parts.extensions.get::<ResponseSource>() == Some(&ResponseSource::Replayed) {
        with_url(&mut parts.extensions, url);
    }
    reqwest::Response::from(http::Response::from_parts(parts, reqwest::Body::wrap(body)))
}

/// Put reqwest's record of a response's URL (a private type) into `extensions`.
fn with_url(extensions: &mut Extensions, url: reqwest::Url) {
    let (carrier, ()) = http::Response::builder()
        .url(url)
        .body(())
        .expect("an empty response with an extension is valid")
        .into_parts();
    extensions.extend(carrier.extensions);
}

/// A failure as reqwest-middleware reports it: the transport's own error as it was (so a
/// `reqwest-retry` outside judges it as it would without us); our refusals wrapped.
fn into_middleware_error(err: crate::Error) -> reqwest_middleware::Error {
    if !err.is_inner() {
        return ours(err);
    }
    let err = match err.take_source::<FromRestOfChain>() {
        Ok(theirs) => return theirs.0,
        Err(err) => err,
    };
    // A request reqwest could not rebuild from the frozen one.
    match err.take_source::<reqwest::Error>() {
        Ok(reqwest) => reqwest_middleware::Error::Reqwest(*reqwest),
        Err(err) => ours(err),
    }
}

/// Our error as a `reqwest_middleware::Error::Middleware`, findable as a **source**.
///
/// `Middleware` and `reqwest-retry`'s `RetryError::Error` both forward `source` straight
/// past the error they hold, so an error held plainly is skipped by anyone walking the
/// chain of a `reqwest-retry` failure. Held under a context (its own message, so the text
/// is unchanged), it is the context's source: `Error::find` and `anyhow`'s `chain` reach
/// it, and `downcast_ref::<Error>()` on the `Middleware` payload still finds it.
fn ours(err: crate::Error) -> reqwest_middleware::Error {
    let message = err.to_string();
    reqwest_middleware::Error::Middleware(anyhow::Error::new(err).context(message))
}

/// The rest of the middleware chain as the transport the client face calls: once per
/// operation (a `reqwest-retry` outside retries the operation, not this call).
struct RestOfChain<'a> {
    next: Next<'a>,
    /// The chain's extensions, handed to the rest of it (what it adds there stays there).
    extensions: Extensions,
    timeout: Option<Duration>,
}

/// An error of the rest of the chain, kept whole so it can be handed back as it was.
#[derive(Debug)]
struct FromRestOfChain(reqwest_middleware::Error);

impl fmt::Display for FromRestOfChain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl std::error::Error for FromRestOfChain {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        // The reqwest error itself, so `phase::classify` sees a connect error as pre-write.
        match &self.0 {
            reqwest_middleware::Error::Reqwest(err) => Some(err),
            reqwest_middleware::Error::Middleware(err) => Some(err.as_ref()),
        }
    }
}

type RestFuture<'a> =
    Pin<Box<dyn Future<Output = Result<http::Response<reqwest::Body>, BoxError>> + Send + 'a>>;

impl<'a> Service<http::Request<Full<Bytes>>> for RestOfChain<'a> {
    type Response = http::Response<reqwest::Body>;
    type Error = BoxError;
    type Future = RestFuture<'a>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Full<Bytes>>) -> Self::Future {
        let next = self.next.clone();
        let mut extensions = self.extensions.clone();
        let timeout = self.timeout;
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            // A frozen body is one buffer: collecting it is a move, not a copy.
            let body = body.collect().await?.to_bytes();
            let mut req = reqwest::Request::try_from(http::Request::from_parts(parts, body))?;
            *req.timeout_mut() = timeout;
            let sent = req.url().clone();
            let response = next
                .run(req, &mut extensions)
                .await
                .map_err(|err| Box::new(FromRestOfChain(err)) as BoxError)?;
            let url = response.url().clone();
            let redirected = url != sent;
            let mut response = http::Response::from(response);
            with_url(response.extensions_mut(), url);
            if redirected {
                // Followed by the client at the end of the chain (see `crate::reqwest`).
                crate::reqwest::followed_a_redirect(response.extensions_mut());
            }
            Ok(response)
        })
    }
}
