//! [`SendOnce`]: a transport of your own, made to count the sends of each operation, so a
//! retrying layer between it and the client face is refused rather than charging twice.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Request;
use pin_project_lite::pin_project;
use tower::Layer;
use tower_service::Service;

use crate::frozen::Handoff;
use crate::phase::{classify, FailurePhase};
use crate::BoxError;

/// Wraps the service that puts requests on the wire (hyper-util's `Client`, a service of
/// your own) so that it sends each operation's attempt **once**.
///
/// The client [`IdempotencyLayer`](crate::IdempotencyLayer) marks each operation's
/// request in its extensions. A retrying layer that is not a
/// [`FrozenRetryLayer`](crate::FrozenRetryLayer) (`tower::retry`, a hedge) placed between
/// the layer and the transport clones the request, mark and all, and sends it again, blind
/// to the provider's keys: against a provider that ignores them, a second effect. Through
/// `SendOnce`, the second send under one mark is refused before any of it reaches the
/// inner service, with an error that names the wiring
/// ([`Error::is_retry_inside`](crate::Error::is_retry_inside)), and the operation is
/// settled as the first send's outcome dictates: in doubt if it may have reached the
/// provider, released only if it failed before it was written.
///
/// [`ReqwestService`](crate::reqwest::ReqwestService) counts its sends the same way; any
/// other transport counts nothing unless wrapped, and a retrying layer above it goes
/// unseen. Requests without a mark (reads, requests outside the ledger, a
/// `FrozenRetryLayer`'s own attempts) pass through untouched. Errors are boxed; a failure
/// of the inner service is classified with [`phase::classify`](crate::phase::classify) to
/// tell how far the first send got.
///
/// ```
/// use bytes::Bytes;
/// use http::Request;
/// use http_body_util::Full;
/// use tower::{ServiceBuilder, ServiceExt};
/// use tower_idempotency::client::SendOnce;
/// use tower_idempotency::testing::SideEffectService;
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer, KeyHeader, OperationId, ProviderKeys};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower::BoxError> {
/// // In production, `SendOnce::new(hyper_util_client)`.
/// let provider = SideEffectService::new();
/// let client = ServiceBuilder::new()
///     .layer(IdempotencyLayer::client(MemoryStore::new(), ProviderKeys::Ignored, KeyHeader::ietf()))
///     .service(SendOnce::new(provider.clone()));
///
/// let mut req = Request::post("http://payments.local/charges").body(Full::new(Bytes::from("{}")))?;
/// req.extensions_mut().insert(OperationId::new("task-7", "charge"));
/// assert_eq!(client.oneshot(req).await?.status(), 201);
/// assert_eq!(provider.effects(), 1);
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct SendOnce<S> {
    inner: S,
}

impl<S> SendOnce<S> {
    /// `inner`, sending each operation's attempt once.
    pub fn new(inner: S) -> Self {
        Self { inner }
    }

    /// The wrapped transport.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped transport, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The wrapped transport, unwrapped.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// The [`Layer`] of [`SendOnce`]: put it last, directly around the transport.
///
/// ```
/// use tower::ServiceBuilder;
/// use tower_idempotency::client::SendOnceLayer;
/// use tower_idempotency::testing::SideEffectService;
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer, KeyHeader, ProviderKeys};
///
/// let client = ServiceBuilder::new()
///     .layer(IdempotencyLayer::client(MemoryStore::new(), ProviderKeys::Ignored, KeyHeader::ietf()))
///     .layer(SendOnceLayer::new())
///     .service(SideEffectService::new());
/// # let _ = client;
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct SendOnceLayer {
    _priv: (),
}

impl SendOnceLayer {
    /// The layer.
    pub fn new() -> Self {
        Self { _priv: () }
    }
}

impl<S> Layer<S> for SendOnceLayer {
    type Service = SendOnce<S>;

    fn layer(&self, inner: S) -> SendOnce<S> {
        SendOnce::new(inner)
    }
}

impl<S, B> Service<Request<B>> for SendOnce<S>
where
    S: Service<Request<B>>,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = SendOnceFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let mark = req.extensions().get::<Handoff>().cloned();
        if let Some(Err(refused)) = mark.as_ref().map(Handoff::start_send) {
            return SendOnceFuture {
                state: State::Refused {
                    error: Some(refused),
                },
            };
        }
        SendOnceFuture {
            state: State::Sending {
                call: self.inner.call(req),
                mark,
            },
        }
    }
}

pin_project! {
    /// The future of [`SendOnce`]: the inner call, or a second send refused.
    #[derive(Debug)]
    pub struct SendOnceFuture<F> {
        #[pin]
        state: State<F>,
    }
}

pin_project! {
    #[project = StateProj]
    #[derive(Debug)]
    enum State<F> {
        Sending {
            #[pin]
            call: F,
            mark: Option<Handoff>,
        },
        Refused {
            error: Option<crate::Error>,
        },
    }
}

impl<F, T, E> Future for SendOnceFuture<F>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Refused { error } => {
                Poll::Ready(Err(error.take().expect("polled after completion").into()))
            }
            StateProj::Sending { call, mark } => {
                let result = std::task::ready!(call.poll(cx)).map_err(Into::into);
                if let Some(mark) = mark.take() {
                    // How far the first send got, for a second one to be settled by.
                    mark.first_send_ended(match &result {
                        Ok(_) => FailurePhase::AfterWrite,
                        Err(err) => classify(&**err, None),
                    });
                }
                Poll::Ready(result)
            }
        }
    }
}
