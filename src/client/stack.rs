//! [`ClientStack`]: the client layer over the frozen-retry layer, in the right order.

use tower_layer::Layer;

use super::face::ClientFace;
use crate::idempotency::{Idempotency, IdempotencyLayer};
use crate::retry::{FrozenRetry, FrozenRetryLayer};

/// The client stack as one layer: [`IdempotencyLayer`] over [`FrozenRetryLayer`] over the
/// service it wraps ([`StackService`](super::StackService)). Built by
/// [`Builder::build_stack`](super::Builder::build_stack).
///
/// The inner service (the transport) takes `Request<Full<Bytes>>`, answers `Response<B>`
/// with `B: Body<Data = Bytes> + Unpin + Send`, and must be `Clone + Send + 'static`.
///
/// ```
/// use tower::Layer;
/// use tower_idempotency::testing::SideEffectService;
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
///
/// let stack = IdempotencyLayer::client_builder(MemoryStore::new()).build_stack().unwrap();
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
    type Service = Idempotency<FrozenRetry<S>, ClientFace>;

    fn layer(&self, inner: S) -> Self::Service {
        self.idempotency.layer(self.retry.layer(inner))
    }
}
