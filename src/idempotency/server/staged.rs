//! A keyed request's future: the ledger's part and the handler's in one allocation, and
//! how it finishes in the background when its client goes away.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use pin_project_lite::pin_project;

/// How the ledger's part of a keyed request ended.
pub(super) enum Admitted<R, O> {
    /// Answered without the handler: a replay, a refusal, a conflict.
    Answer(R),
    /// The key is this request's: its handler is to run.
    Handle(O),
}

pin_project! {
    /// A keyed request in one allocation: the ledger's part ([`admit`](super::admit)),
    /// then, in the same place, the handler's ([`handle`](super::handle)), inside the
    /// request's span.
    pub(super) struct Staged<A, H, W> {
        #[pin]
        stage: Stage<A, W>,
        handle: Option<H>,
        span: tracing::Span,
        // Whether a handler still running when the client goes away finishes anyway.
        detach: bool,
    }
}

pin_project! {
    #[project = StageProj]
    enum Stage<A, W> {
        Admit { #[pin] admit: A },
        Handle { #[pin] work: W },
        Done,
    }
}

impl<A, H, W> Staged<A, H, W> {
    pub(super) fn new(admit: A, handle: H, span: tracing::Span, detach: bool) -> Self {
        Self {
            stage: Stage::Admit { admit },
            handle: Some(handle),
            span,
            detach,
        }
    }
}

impl<A, H, W, O, R> Future for Staged<A, H, W>
where
    A: Future<Output = Admitted<R, O>>,
    H: FnOnce(O) -> W,
    W: Future<Output = R>,
{
    type Output = R;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<R> {
        let mut this = self.project();
        let _entered = this.span.enter();
        loop {
            match this.stage.as_mut().project() {
                StageProj::Admit { admit } => match std::task::ready!(admit.poll(cx)) {
                    Admitted::Answer(answer) => {
                        this.stage.set(Stage::Done);
                        return Poll::Ready(answer);
                    }
                    Admitted::Handle(owned) => {
                        let handle = this.handle.take().expect("admitted once");
                        this.stage.set(Stage::Handle {
                            work: handle(owned),
                        });
                    }
                },
                StageProj::Handle { work } => {
                    let answer = std::task::ready!(work.poll(cx));
                    this.stage.set(Stage::Done);
                    return Poll::Ready(answer);
                }
                StageProj::Done => panic!("ServerFuture polled after completion"),
            }
        }
    }
}

/// A keyed request's future, boxed, that can say whether it may finish in the background.
pub(super) trait DetachableFuture: Future + Send {
    /// Whether, dropped now, it should finish in the background: its handler is running
    /// and the layer does not cancel on disconnect.
    fn detachable(&self) -> bool;

    /// Finish in a task of its own (on the current runtime; without one, it is dropped and
    /// its lease guard leaves the key in doubt).
    fn finish_in_background(self: Pin<Box<Self>>);
}

impl<A, H, W, O, R> DetachableFuture for Staged<A, H, W>
where
    A: Future<Output = Admitted<R, O>> + Send + 'static,
    H: FnOnce(O) -> W + Send + 'static,
    W: Future<Output = R> + Send + 'static,
    R: Send + 'static,
{
    fn detachable(&self) -> bool {
        self.detach && matches!(self.stage, Stage::Handle { .. })
    }

    fn finish_in_background(self: Pin<Box<Self>>) {
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(async move {
                drop(self.await);
            });
        }
    }
}

/// The boxed future of a keyed request. Dropped while its handler runs (the client went
/// away: hyper drops our future), what is left of it moves to a task of its own and still
/// finishes, so its outcome is recorded and the client's retry gets a replay instead of an
/// unknown outcome. Handing over only on a drop spares every other request a task.
///
/// Not when it panicked: a poll that never returned leaves `polling` set, and the future
/// is then dropped where it stands (its lease guard puts the key in doubt at once) while
/// the panic goes on to whatever catches it outside, as without this layer.
pub(super) struct Detaching<R> {
    future: Option<Pin<Box<dyn DetachableFuture<Output = R>>>>,
    polling: bool,
}

impl<R> Detaching<R> {
    pub(super) fn new(future: Pin<Box<dyn DetachableFuture<Output = R>>>) -> Self {
        Self {
            future: Some(future),
            polling: false,
        }
    }

    pub(super) fn poll(&mut self, cx: &mut Context<'_>) -> Poll<R> {
        let future = self
            .future
            .as_mut()
            .expect("ServerFuture polled after completion");
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
        let Some(future) = self.future.take() else {
            return;
        };
        if self.polling || std::thread::panicking() || !future.detachable() {
            return;
        }
        future.finish_in_background();
    }
}
