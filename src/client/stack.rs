//! [`ClientStack`]: the client layer over the frozen-retry layer, in the right order, and
//! [`StackService`], the two as one service.

use crate::idempotency::wiring::Wiring;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::Full;
use tower_layer::Layer;
use tower_service::Service;

use super::face::ClientFace;
use super::failure::into_error;
use super::future::StackFuture;
use super::service::{ready_instance, start};
use crate::idempotency::body::ResponseBody;
use crate::idempotency::IdempotencyLayer;
use crate::phase::FailurePhase;
use crate::retry::{FrozenRetry, FrozenRetryLayer};
use crate::{BoxError, Error};

/// The client stack as one layer: [`IdempotencyLayer`] over [`FrozenRetryLayer`] over the
/// service it wraps ([`StackService`](super::StackService)). Built by
/// [`Builder::build_stack`](super::Builder::build_stack).
///
/// The inner service (the transport) takes `Request<Full<Bytes>>`, answers `Response<B>`
/// with `B: Body<Data = Bytes> + Unpin + Send`, and must be `Clone + Send + 'static`.
///
/// ```
/// use tower::Layer;
/// use tower_idempotency::KeyHeader;
/// use tower_idempotency::testing::SideEffectService;
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
///
/// let stack = IdempotencyLayer::client_builder(MemoryStore::new()).provider_deduplicates(true).key_header(KeyHeader::ietf()).build_stack().unwrap();
/// let client = stack.layer(SideEffectService::new());
/// # let _ = client;
/// ```
#[derive(Clone, Debug)]
#[must_use = "a layer does nothing until it wraps a service"]
pub struct ClientStack {
    idempotency: IdempotencyLayer<ClientFace>,
    retry: FrozenRetryLayer,
}

impl ClientStack {
    pub(super) fn new(idempotency: IdempotencyLayer<ClientFace>, retry: FrozenRetryLayer) -> Self {
        Self { idempotency, retry }
    }

    /// The idempotency layer, outside.
    pub fn idempotency(&self) -> &IdempotencyLayer<ClientFace> {
        &self.idempotency
    }

    /// The retry layer, inside.
    pub fn retry(&self) -> &FrozenRetryLayer {
        &self.retry
    }
}

impl<S> Layer<S> for ClientStack {
    type Service = StackService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        StackService {
            // The transport's type: a foreign retrying layer in it would resend the
            // attempts of the retry layer above it.
            wiring: Wiring::of::<S>(),
            retry: self.retry.layer(inner),
            client: self.idempotency.face().clone(),
        }
    }
}

/// The whole client stack around the transport `S`, as a [`ClientStack`] builds it: the
/// client [`IdempotencyLayer`] over [`FrozenRetry`], as one service.
///
/// It behaves as the two layers stacked by hand do, and costs less: the operation's owner
/// hands its frozen request straight to the retry layer's attempts (no hand-off through
/// the request's extensions, no second look at the request), and an operation is one
/// future, [`StackFuture`]. One difference: the transport's requests carry the caller's
/// extensions less the [`OperationId`](crate::OperationId), which the stack has turned into
/// the `Idempotency-Key` header they carry (a layer stacked in between by hand still sees
/// it).
///
/// ```
/// use tower::Layer;
/// use tower_idempotency::KeyHeader;
/// use tower_idempotency::client::StackService;
/// use tower_idempotency::testing::SideEffectService;
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
///
/// let stack = IdempotencyLayer::client_builder(MemoryStore::new()).provider_deduplicates(true).key_header(KeyHeader::ietf()).build_stack().unwrap();
/// let client: StackService<SideEffectService> = stack.layer(SideEffectService::new());
/// # let _ = client;
/// ```
#[derive(Debug)]
pub struct StackService<S> {
    retry: FrozenRetry<S>,
    client: Arc<ClientFace>,
    wiring: Wiring,
}

impl<S: Clone> Clone for StackService<S> {
    fn clone(&self) -> Self {
        Self {
            retry: self.retry.clone(),
            client: self.client.clone(),
            wiring: self.wiring,
        }
    }
}

impl<S> StackService<S> {
    /// The retry service inside, around the transport.
    pub fn get_ref(&self) -> &FrozenRetry<S> {
        &self.retry
    }

    /// The retry service inside, mutably.
    pub fn get_mut(&mut self) -> &mut FrozenRetry<S> {
        &mut self.retry
    }

    /// Unwrap the retry service inside.
    pub fn into_inner(self) -> FrozenRetry<S> {
        self.retry
    }
}

impl<S, B, ResBody> Service<Request<B>> for StackService<S>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = Error;
    type Future = StackFuture<S, B, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Service::<Request<Full<Bytes>>>::poll_ready(&mut self.retry, cx)
            .map_err(|err| into_error(err.into(), FailurePhase::PreWrite))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        start(
            ready_instance(&mut self.retry),
            (&self.client, self.wiring),
            req,
            |operation, span| StackFuture { operation, span },
        )
    }
}
