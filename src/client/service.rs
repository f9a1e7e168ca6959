//! The client layer's service: one operation per call.

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::Full;
use tower_service::Service;

use crate::idempotency::body::ResponseBody;
use crate::idempotency::decision::request_span;
use crate::idempotency::Idempotency;
use crate::phase::FailurePhase;
use crate::{BoxError, Error};

use super::face::ClientFace;
use super::failure::into_error;
use super::future::ResponseFuture;
use super::operation::Operation;
use super::send::Handed;
impl<S, B, ResBody> Service<Request<B>> for Idempotency<S, ClientFace>
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
    type Future = ResponseFuture<S, B, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner
            .poll_ready(cx)
            .map_err(|err| into_error(err.into(), FailurePhase::PreWrite))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let span = request_span!(face = "client", key = tracing::field::Empty);
        let started = self
            .face
            .on_outcome
            .is_some()
            .then(tokio::time::Instant::now);
        let operation = {
            let _entered = span.enter();
            Operation::new(inner, self.face.clone(), req, started)
        };
        ResponseFuture { operation, span }
    }
}

/// One logical operation through the client face. `inner` need not be `'static` or
/// `Clone`: it is called once (the retries, if any, are its own).
#[cfg_attr(not(feature = "reqwest-middleware"), allow(dead_code))]
pub(crate) fn run<'a, S, B, ResBody>(
    inner: S,
    client: Arc<ClientFace>,
    req: Request<B>,
    started: Option<tokio::time::Instant>,
) -> Operation<'a, S, B, ResBody, Handed>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
    B: Body,
{
    Operation::new(inner, client, req, started)
}
