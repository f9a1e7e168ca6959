//! The client layer's future.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::Full;
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::idempotency::body::ResponseBody;
use crate::idempotency::decision::RequestSpan;
use crate::{BoxError, Error};

use super::operation::Operation;
use super::send::{Fused, Handed};
use crate::retry::FrozenRetry;
pin_project! {
    /// The future of the client [`IdempotencyLayer`]: one logical operation, held in
    /// place (not boxed), inside its span.
    pub struct ResponseFuture<S, B, ResB>
    where
        S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
    {
        #[pin]
        pub(super) operation: Operation<'static, S, B, ResB, Handed>,
        pub(super) span: RequestSpan,
    }
}

impl<S, B, ResB> Future for ResponseFuture<S, B, ResB>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Unpin + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Output = Result<Response<ResponseBody<ResB>>, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        poll_in_span(this.operation, this.span, cx)
    }
}

impl<S, B, ResB> fmt::Debug for ResponseFuture<S, B, ResB>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

pin_project! {
    /// The future of a [`StackService`](super::StackService): one logical operation, its
    /// attempts included, held in place (not boxed), inside its span.
    pub struct StackFuture<S, B, ResB>
    where
        S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
        S: Clone,
        S::Error: Into<BoxError>,
    {
        #[pin]
        pub(super) operation: Operation<'static, FrozenRetry<S>, B, ResB, Fused>,
        pub(super) span: RequestSpan,
    }
}

impl<S, B, ResB> Future for StackFuture<S, B, ResB>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Unpin + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Output = Result<Response<ResponseBody<ResB>>, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        poll_in_span(this.operation, this.span, cx)
    }
}

impl<S, B, ResB> fmt::Debug for StackFuture<S, B, ResB>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>> + Clone,
    S::Error: Into<BoxError>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StackFuture").finish_non_exhaustive()
    }
}

/// Poll an operation inside its span.
#[inline(always)]
fn poll_in_span<F: Future>(
    operation: Pin<&mut F>,
    span: &RequestSpan,
    cx: &mut Context<'_>,
) -> Poll<F::Output> {
    let _entered = span.enter();
    operation.poll(cx)
}
