//! The client layer's service: one operation per call.

use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::Full;
use tower_service::Service;

use crate::idempotency::body::ResponseBody;
use crate::idempotency::decision::{request_span, RequestSpan};
use crate::idempotency::wiring::Wiring;
use crate::idempotency::Idempotency;
use crate::phase::FailurePhase;
use crate::{BoxError, Error};

use super::face::ClientFace;
use super::failure::into_error;
use super::future::ResponseFuture;
use super::operation::{Admission, Operation};
use super::send::{Handed, Sending};
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
        start(
            ready_instance(&mut self.inner),
            (&self.face, self.wiring),
            req,
            |operation, span| ResponseFuture { operation, span },
        )
    }
}

/// The instance of `service` that was driven to readiness, a clone left in its place.
pub(super) fn ready_instance<S: Clone>(service: &mut S) -> S {
    let clone = service.clone();
    std::mem::replace(service, clone)
}

/// One operation of `req` on `inner`, sent as `M` says, made inside its own span (which it
/// is then polled in), and timed when the outcome hook wants it; `held` makes the future
/// that holds the operation and its span. The request is looked at inside the span, and the
/// future built after, in one expression: built where its caller holds it, rather than
/// built here and copied out (it is the largest thing an operation makes).
#[inline(always)]
pub(super) fn start<S, B, ResB, M, F>(
    inner: S,
    (client, wiring): (&Arc<ClientFace>, Wiring),
    req: Request<B>,
    held: impl FnOnce(Operation<'static, S, B, ResB, M>, RequestSpan) -> F,
) -> F
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
    M: Sending<S, ResB>,
    B: Body,
{
    let span = request_span!(face = "client", key = tracing::field::Empty);
    let started = client.on_outcome.is_some().then(tokio::time::Instant::now);
    let (parts, body) = req.into_parts();
    let admission = {
        let _entered = span.enter();
        Admission::of(client, wiring, &parts, &body)
    };
    held(
        Operation::held(inner, client.clone(), (parts, body), admission, started),
        span,
    )
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
