use std::sync::Arc;

use tower_layer::Layer;

/// Applies the ledger to a service, with one of two faces: the client face
/// ([`ClientLayer`](crate::client::ClientLayer) = `IdempotencyLayer<ClientFace>`, built by
/// [`IdempotencyLayer::client`]) for callers of side-effecting APIs, or the server face
/// ([`ServerLayer`](crate::server::ServerLayer) = `IdempotencyLayer<ServerFace>`, built by
/// [`IdempotencyLayer::server`]) in front of the handlers that perform the effects.
///
/// - Client face: the inner service takes `Request<Full<Bytes>>` (whatever body you send
///   in), answers `Response<B>` with `B: Body<Data = Bytes> + Unpin + Send`, and must be
///   `Clone + Send + 'static`.
/// - Server face: the inner service takes `Request<RequestBody<B>>` for the incoming body
///   `B: Body<Data = Bytes>`, answers `Response<B2>` with `B2: Body<Data = Bytes> + Unpin +
///   Send`, and must be `Clone + Send + 'static` (axum's handlers and routers are).
///
/// See the [module docs](crate::idempotency) and [`server`](crate::server).
#[derive(Debug)]
#[must_use = "a layer does nothing until it wraps a service"]
pub struct IdempotencyLayer<F> {
    face: Arc<F>,
}

impl<F> Clone for IdempotencyLayer<F> {
    fn clone(&self) -> Self {
        Self {
            face: self.face.clone(),
        }
    }
}

impl<F> IdempotencyLayer<F> {
    pub(crate) fn from_face(face: F) -> Self {
        Self {
            face: Arc::new(face),
        }
    }

    /// The face's configuration, for adapters that drive it without a tower service.
    #[cfg_attr(not(feature = "reqwest-middleware"), allow(dead_code))]
    pub(crate) fn face(&self) -> &Arc<F> {
        &self.face
    }
}

impl<S, F> Layer<S> for IdempotencyLayer<F> {
    type Service = Idempotency<S, F>;

    fn layer(&self, inner: S) -> Self::Service {
        Idempotency {
            wiring: super::wiring::Wiring::of::<S>(),
            inner,
            face: self.face.clone(),
        }
    }
}

/// The service of an [`IdempotencyLayer`].
#[derive(Debug)]
pub struct Idempotency<S, F> {
    pub(crate) inner: S,
    pub(crate) face: Arc<F>,
    /// What the type of `inner` shows (a retrying layer inside, refused on the client face).
    pub(crate) wiring: super::wiring::Wiring,
}

impl<S: Clone, F> Clone for Idempotency<S, F> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            face: self.face.clone(),
            wiring: self.wiring,
        }
    }
}

impl<S, F> Idempotency<S, F> {
    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwrap the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}
