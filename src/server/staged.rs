//! A keyed request's future: the ledger's part in place, then the handler's part boxed,
//! so that it can finish in the background when its client goes away.
//!
//! # Who may drop what, and what it leaves behind
//!
//! hyper drops a request's future when its connection closes. What that does to the key
//! depends on the stage the future is in, and each stage is built so the answer is safe:
//!
//! - **In the ledger's part** ([`Admit`]): nothing of the handler ran. A body half read
//!   or a refusal leaves the key unused; a claim whose answer never arrived is released by
//!   the engine. The client's retry is a first request.
//! - **In the handler's part, cancelling** (`cancel_on_disconnect(true)`): the boxed
//!   future is dropped where it stands, and its lease guard marks the key in doubt at once.
//!   In doubt, not released: the handler may have done part of its work, and only a
//!   record of its outcome could say otherwise.
//! - **In the handler's part, detaching** (the default): [`Detaching`]'s `Drop` moves the
//!   boxed future to a task of its own, inside the request's span, where it finishes and
//!   records its outcome. The retry then gets a replay rather than an unknown outcome.
//!
//! The handler's part is boxed for this move: a future held in place inside hyper's
//! connection task cannot outlive it, but a `Pin<Box<_>>` can be handed to `spawn` as it
//! is, mid-poll state and all. Spawning only on drop (rather than running every handler
//! on a task up front) keeps the common request, whose client waits, free of a task.

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
    /// ([`Execute`](super::execute::Execute)), boxed so that it can move to a task of its
    /// own. Both run inside the request's span, entered on every poll, so that the events
    /// of the store calls and of the handler land in it whichever task polls them.
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
    #[inline(always)]
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
                        // The span is cloned now, while the request's future still holds
                        // it, so that a detached handler can finish in it after a drop.
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
    // `None` once it finished: a drop after the answer has nothing to hand over.
    future: Option<Pin<Box<dyn Background<Output = R>>>>,
    // Set across each poll of `future`. If `Drop` finds it set, the poll never returned:
    // the future panicked mid-poll, and its state is whatever the panic left. Spawning it
    // would poll a future that already panicked (a second panic, in a task nobody
    // watches), so it is dropped instead, and its guard puts the key in doubt.
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
        // Outside a tokio runtime there is nowhere to finish: the future is dropped here,
        // and its lease guard leaves the key in doubt, the answer that is always safe.
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

    // `polling` is set around the inner poll only, and cleared only when that poll
    // returns: a panic inside leaves it set for `Drop` to see (see the field).
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
        // Finished, or cancelling on disconnect: the plain drop of `future` is the answer
        // (nothing to do, or the lease guard inside marks the key in doubt).
        let (Some(future), Some(span)) = (self.future.take(), self.detach.take()) else {
            return;
        };
        // Also when a panic unwinds through us from elsewhere (a layer outside panicked
        // while holding this future): the process is in trouble, and a background task
        // that outlives the panic is not what the operator expects. The key goes in doubt.
        if self.polling || std::thread::panicking() {
            return;
        }
        future.finish_in_background(span);
    }
}
