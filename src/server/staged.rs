//! A keyed request's future: the ledger's part in place, then the handler's part boxed,
//! so that it can finish in the background when its client goes away.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::{Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use tower_service::Service;
use tracing::Instrument;

use super::admit::{Admit, Admitted};
use super::body::RequestBody;
use crate::idempotency::body::ResponseBody;
use crate::idempotency::decision::RequestSpan;
use crate::BoxError;

pin_project! {
    /// A keyed request: the ledger's part ([`Admit`]) held in place, so a replay or a
    /// refusal allocates no future; once the key is owned, the handler's part
    /// ([`Execute`](super::execute::Execute)), boxed so that it can move to a task of its own. Both run inside the
    /// request's span.
    pub(super) struct Keyed<S, B, ResB>
    where
        S: Service<Request<RequestBody<B>>, Response = Response<ResB>>,
    {
        #[pin]
        stage: Stage<S, B, ResB>,
        span: RequestSpan,
        // Whether a handler still running when the client goes away finishes anyway.
        detach: bool,
    }
}

pin_project! {
    #[project = StageProj]
    enum Stage<S, B, ResB>
    where
        S: Service<Request<RequestBody<B>>, Response = Response<ResB>>,
    {
        Admit { #[pin] admit: Admit<S, B, ResB> },
        Handle { execute: Detaching<Result<Response<ResponseBody<ResB>>, S::Error>> },
        Done,
    }
}

impl<S, B, ResB> Keyed<S, B, ResB>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>>,
    B: Body,
{
    pub(super) fn new(admit: Admit<S, B, ResB>, span: RequestSpan, detach: bool) -> Self {
        Self {
            stage: Stage::Admit { admit },
            span,
            detach,
        }
    }
}

impl<S, B, ResB> Future for Keyed<S, B, ResB>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResB: Body<Data = bytes::Bytes> + Unpin + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Output = Result<Response<ResponseBody<ResB>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let _entered = this.span.enter();
        loop {
            match this.stage.as_mut().project() {
                StageProj::Admit { admit } => match std::task::ready!(admit.poll(cx)) {
                    Admitted::Answer(answer) => {
                        this.stage.set(Stage::Done);
                        return Poll::Ready(answer);
                    }
                    Admitted::Handle(handling) => {
                        let span = this.detach.then(|| this.span.clone().into_span());
                        let execute = Detaching::new(handling, span);
                        this.stage.set(Stage::Handle { execute });
                    }
                },
                StageProj::Handle { execute } => {
                    let answer = std::task::ready!(execute.poll(cx));
                    this.stage.set(Stage::Done);
                    return Poll::Ready(answer);
                }
                StageProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

/// The boxed handler's part of a keyed request. Dropped while it runs (the client went
/// away: hyper drops our future), it moves to a task of its own and still finishes, so
/// its outcome is recorded and the client's retry gets a replay instead of an unknown
/// outcome. Handing over only on a drop spares every other request a task.
///
/// Not when it panicked: a poll that never returned leaves `polling` set, and the future
/// is then dropped where it stands (its lease guard puts the key in doubt at once) while
/// the panic goes on to whatever catches it outside, as without this layer.
pub(super) struct Detaching<R> {
    future: Option<Pin<Box<dyn Background<Output = R>>>>,
    polling: bool,
    /// The request's span, to finish in, when the layer lets a handler outlive its
    /// client; `None` when it cancels on disconnect.
    detach: Option<tracing::Span>,
}

/// A future that can finish in a task of its own.
trait Background: Future + Send {
    /// Finish in a task of its own, in `span` (on the current runtime; without one, it is
    /// dropped, and its lease guard leaves the key in doubt).
    fn finish_in_background(self: Pin<Box<Self>>, span: tracing::Span);
}

impl<F: Future + Send + 'static> Background for F {
    fn finish_in_background(self: Pin<Box<Self>>, span: tracing::Span) {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(
                async move {
                    drop(self.await);
                }
                .instrument(span),
            );
        }
    }
}

impl<R> Detaching<R> {
    fn new<F>(future: Pin<Box<F>>, detach: Option<tracing::Span>) -> Self
    where
        F: Future<Output = R> + Send + 'static,
    {
        Self {
            future: Some(future),
            polling: false,
            detach,
        }
    }

    fn poll(&mut self, cx: &mut Context<'_>) -> Poll<R> {
        let future = self
            .future
            .as_mut()
            .expect("ResponseFuture polled after completion");
        self.polling = true;
        let polled = future.as_mut().poll(cx);
        self.polling = false;
        let output = std::task::ready!(polled);
        self.future = None;
        Poll::Ready(output)
    }
}

impl<R> Drop for Detaching<R> {
    fn drop(&mut self) {
        let (Some(future), Some(span)) = (self.future.take(), self.detach.take()) else {
            return;
        };
        if self.polling || std::thread::panicking() {
            return;
        }
        future.finish_in_background(span);
    }
}
