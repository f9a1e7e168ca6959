//! [`FaultLayer`]: faults injected into a handler or a service it wraps.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use http::{Request, Response, StatusCode};
use tower_layer::Layer;
use tower_service::Service;

/// A fault for one call of a service behind a [`FaultLayer`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum HandlerFault {
    /// Panic before calling the service: nothing of the call happened.
    PanicBefore,
    /// Call the service (its effect happens), then panic instead of answering.
    PanicAfterHandler,
    /// Wait this long (with [`tokio::time::sleep`]), then call the service.
    Delay(Duration),
    /// Call the service (its effect happens), then answer this status with an empty body
    /// instead of its response: "the work was done, the answer was lost".
    FailAfterHandler(StatusCode),
    /// Call the service, then never answer, as a handler stuck after its effect.
    HangAfterHandler,
}

/// Injects queued [`HandlerFault`]s into the service it wraps. Clones share one queue and one call count.
///
/// Faults around **your own** services: a layer that makes a handler panic, stall or fail
/// after doing its work, and a helper that makes an operation's process "crash".
///
/// [`FaultLayer`] wraps any `Service<Request<_>>` (an axum handler or `Router`, a hyper
/// service) and injects one queued [`HandlerFault`] per call, in order; a call with no fault
/// queued runs normally. Put it **inside** the server `IdempotencyLayer` to see what your
/// handler's failures do to its keys.
///
/// [`crash_after`] drives an operation's future and, at the chosen moment, abandons it the
/// way a killed process does: no destructor runs, so nothing of it is settled or recorded.
///
/// # Example
///
/// ```
/// use axum::{body::Body, http::{Request, StatusCode}, routing::post, Router};
/// use tower::ServiceExt;
/// use tower_idempotency::testing::{FaultLayer, HandlerFault};
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// // The handler charges, then its response is lost to a 500.
/// let faults = FaultLayer::new().with_faults([HandlerFault::FailAfterHandler(StatusCode::INTERNAL_SERVER_ERROR)]);
/// let charges = post(|| async { (StatusCode::CREATED, "ch_1") })
///     .route_layer(faults.clone())
///     .route_layer(IdempotencyLayer::server_builder(MemoryStore::new()).unscoped().build().unwrap());
/// let app = Router::new().route("/charges", charges);
/// let charge = || Request::post("/charges").header("idempotency-key", "\"k\"").body(Body::empty()).unwrap();
/// let first = app.clone().oneshot(charge()).await.unwrap();
/// assert_eq!(first.status(), StatusCode::INTERNAL_SERVER_ERROR);
/// // Recorded (the default server-error policy): the retry is the same 500, not a second charge.
/// let retry = app.oneshot(charge()).await.unwrap();
/// assert_eq!(retry.headers()["idempotent-replayed"], "true");
/// assert_eq!(faults.calls(), 1);
/// # }
/// ```
#[derive(Clone, Default)]
#[must_use = "a layer does nothing until it wraps a service"]
pub struct FaultLayer {
    state: Arc<State>,
}

#[derive(Default)]
struct State {
    faults: Mutex<VecDeque<HandlerFault>>,
    calls: AtomicUsize,
}

impl fmt::Debug for FaultLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultLayer")
            .field("pending", &self.pending_faults())
            .field("calls", &self.calls())
            .finish()
    }
}

impl FaultLayer {
    /// A layer with no faults queued.
    pub fn new() -> Self {
        Self::default()
    }

    /// Queue `faults` after those already queued.
    pub fn with_faults(self, faults: impl IntoIterator<Item = HandlerFault>) -> Self {
        self.queue().extend(faults);
        self
    }

    /// Queue one fault.
    pub fn push_fault(&self, fault: HandlerFault) {
        self.queue().push_back(fault);
    }

    /// The faults still queued, next first.
    pub fn pending_faults(&self) -> Vec<HandlerFault> {
        self.queue().iter().cloned().collect()
    }

    /// How many times the wrapped service was called (a `PanicBefore` call does not count).
    pub fn calls(&self) -> usize {
        self.state.calls.load(Ordering::SeqCst)
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, VecDeque<HandlerFault>> {
        self.state
            .faults
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

impl<S> Layer<S> for FaultLayer {
    type Service = FaultService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        FaultService {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service of a [`FaultLayer`].
#[derive(Clone, Debug)]
pub struct FaultService<S> {
    inner: S,
    layer: FaultLayer,
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for FaultService<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    ReqBody: Send + 'static,
    ResBody: Default + Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Response<ResBody>, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let fault = self.layer.queue().pop_front();
        let layer = self.layer.clone();
        Box::pin(async move {
            if fault == Some(HandlerFault::PanicBefore) {
                panic!("FaultLayer: injected panic before the handler");
            }
            if let Some(HandlerFault::Delay(delay)) = fault {
                tokio::time::sleep(delay).await;
            }
            layer.state.calls.fetch_add(1, Ordering::SeqCst);
            let response = inner.call(req).await?;
            match fault {
                Some(HandlerFault::PanicAfterHandler) => {
                    panic!("FaultLayer: injected panic after the handler")
                }
                Some(HandlerFault::FailAfterHandler(status)) => {
                    let mut failed = Response::new(ResBody::default());
                    *failed.status_mut() = status;
                    Ok(failed)
                }
                Some(HandlerFault::HangAfterHandler) => std::future::pending().await,
                _ => Ok(response),
            }
        })
    }
}

/// Drive `operation` until it finishes, or abandon it `after` into it as a killed process
/// would: the future is leaked, so no destructor runs — no lease is released, marked or
/// recorded; whatever it claimed stays as it was until its lease runs out. A lease that a
/// store in this process held for the operation's owners
/// ([`MemoryStore`](crate::ledger::MemoryStore), see
/// [`hold_lease`](crate::ledger::IdempotencyStore::hold_lease)) is let go at the crash, as
/// it would be with the process, so it runs out a lease later there too; so are those of
/// a `crash_after` nested inside it.
///
/// The operation is owned (`'static`): a crashed process polls nothing of it again, and a
/// borrowed future would outlive the "crash" with its owner still able to run.
///
/// `None` when it "crashed". Use it to test crash-and-resume without a second process.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::testing::crash_after;
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let finished = crash_after(async { 7 }, Duration::from_secs(1)).await;
/// assert_eq!(finished, Some(7));
/// let crashed = crash_after(tokio::time::sleep(Duration::from_secs(5)), Duration::from_secs(1)).await;
/// assert_eq!(crashed, None);
/// # }
/// ```
///
/// A borrowed future is refused: it would still be there to poll after the "crash".
///
/// ```compile_fail
/// # use std::time::Duration;
/// # use tower_idempotency::testing::crash_after;
/// # async fn borrowed() {
/// let mut operation = Box::pin(tokio::time::sleep(Duration::from_secs(5)));
/// crash_after(operation.as_mut(), Duration::from_secs(1)).await;
/// # }
/// ```
pub async fn crash_after<F: Future + 'static>(operation: F, after: Duration) -> Option<F::Output> {
    let held = super::crash::Domain::nested();
    let mut operation = Box::pin(held.scope(operation));
    tokio::select! {
        output = &mut operation => Some(output),
        () = tokio::time::sleep(after) => {
            std::mem::forget(operation);
            held.crash();
            None
        }
    }
}
