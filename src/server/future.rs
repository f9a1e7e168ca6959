//! [`ResponseFuture`]: what the server layer's service returns.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use tower_service::Service;

use super::body::RequestBody;
use super::staged::Keyed;
use crate::idempotency::body::ResponseBody;
use crate::BoxError;

pin_project! {
    /// The future of the server layer's service, [`ServerService`](super::ServerService).
    ///
    /// Requests outside the ledger poll the inner service's future in place. A keyed
    /// request's ledger part (its body, the claim, a replay or a refusal) runs in place
    /// too; once its key is owned, its handler's part is boxed (one allocation), so that
    /// it can finish in the background when the client goes away.
    pub struct ResponseFuture<S, B, ResB>
    where
        S: Service<Request<RequestBody<B>>, Response = Response<ResB>>,
    {
        #[pin]
        kind: FutureKind<S, B, ResB>,
    }
}

pin_project! {
    #[project = FutureKindProj]
    enum FutureKind<S, B, ResB>
    where
        S: Service<Request<RequestBody<B>>, Response = Response<ResB>>,
    {
        PassThrough { #[pin] future: S::Future },
        Answer { response: Option<Response<ResponseBody<ResB>>> },
        Keyed { #[pin] keyed: Keyed<S, B, ResB> },
    }
}

impl<S, B, ResB> ResponseFuture<S, B, ResB>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>>,
{
    pub(super) fn pass_through(future: S::Future) -> Self {
        Self {
            kind: FutureKind::PassThrough { future },
        }
    }

    pub(super) fn answer(response: Response<ResponseBody<ResB>>) -> Self {
        Self {
            kind: FutureKind::Answer {
                response: Some(response),
            },
        }
    }

    #[inline(always)]
    pub(super) fn keyed(keyed: Keyed<S, B, ResB>) -> Self {
        Self {
            kind: FutureKind::Keyed { keyed },
        }
    }
}

impl<S, B, ResB> Future for ResponseFuture<S, B, ResB>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Unpin + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Output = Result<Response<ResponseBody<ResB>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            // Polled in place, its body wrapped, never buffered: a request outside the ledger
            // costs this layer no allocation, and its response streams as the handler
            // writes it.
            FutureKindProj::PassThrough { future } => {
                future.poll(cx).map_ok(|r| r.map(ResponseBody::inner))
            }
            FutureKindProj::Answer { response } => Poll::Ready(Ok(response
                .take()
                .expect("ResponseFuture polled after completion"))),
            FutureKindProj::Keyed { keyed } => keyed.poll(cx),
        }
    }
}

impl<S, B, ResB> fmt::Debug for ResponseFuture<S, B, ResB>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match &self.kind {
            FutureKind::PassThrough { .. } => "PassThrough",
            FutureKind::Answer { .. } => "Answer",
            FutureKind::Keyed { .. } => "Keyed",
        };
        f.debug_struct("ResponseFuture")
            .field("kind", &kind)
            .finish()
    }
}
