//! The handler's part of a keyed request, as the key's owner: run the handler while the
//! lease is renewed, read its response up to the recording cap, record it.
//!
//! A future of its own rather than an `async fn`: nested `async fn`s each keep a copy of
//! what they are handed, and the request's future (boxed, moved as it is built) carried
//! every one of them.
//!
//! # The lease, and the order of settling
//!
//! This request owns the key from the moment [`handle`] is called until the lease is
//! settled by exactly one of: recording the response (`complete`), releasing the key
//! (`abandon`, for an answer the face releases: see [`ServerFace::releases`]), or leaving it in doubt
//! (`mark_in_doubt`). The [`LeaseGuard`] is what makes "exactly one" hold whatever
//! happens: each settle consumes it, and dropping it unsettled (a panic, a cancelled
//! future) marks the key in doubt in the background. No path can forget the key in
//! flight until its lease runs out, and none can settle it twice.
//!
//! Why each failure settles the way it does:
//!
//! - **The handler returned an error, or its body failed**: in doubt. The handler ran and
//!   may have done its effect; nothing proves otherwise. Releasing would let a retry run
//!   it a second time, the double effect this crate exists to stop.
//! - **A `5xx` under `Release`**: released, because the application has declared that its
//!   `5xx` means nothing happened. Under the default `Record` it is recorded like any
//!   answer.
//! - **The record could not be written**: the caller still gets the handler's answer (the
//!   effect happened, and hiding its result would not undo it); the key reads in doubt
//!   once the lease ends, so a retry is refused rather than run again.
//!
//! The response is recorded **before** it is returned. A client that saw an answer may
//! retry (its connection dropped right after); the record is then already there to be
//! replayed. Returned first, a retry racing the write would find the key in flight
//! (`409`), and a crash in between would leave in doubt an operation whose answer was
//! delivered.
//!
//! The lease is kept (renewed, or held by a store that holds leases) while the handler runs
//! **and** while its body is read: a large or
//! slow response is still the owner's work, and a lease that ran out mid-body would let
//! a duplicate take the key over (its late `complete` then refused as fenced).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use tower_service::Service;

use super::body::RequestBody;
use super::face::ServerFace;
use super::problem;
use super::replay::recording;
use super::report::{settled, Report};
use crate::digest::BodyDigest;
use crate::idempotency::body::{buffer_up_to, BufferUpTo, Buffered, ResponseBody};
use crate::idempotency::decision::{with_store_signals, Track};
use crate::idempotency::engine::{InPlace, LeaseGuard, Renewal};
use crate::ledger::{LeaseToken, LedgerKey};
use crate::BoxError;

/// What the handler's part answers.
type Answer<B, E> = Result<Response<ResponseBody<B>>, E>;

/// The rare ends of a handler's part, boxed: settling through a store that awaits, after a
/// failure, or the transactional mode.
type Finishing<B, E> = Pin<Box<dyn Future<Output = Answer<B, E>> + Send>>;

/// The transaction a claim was made in (transactional mode), if any. Dropped unused (a
/// replay, a refusal) it rolls back.
#[cfg(feature = "postgres")]
pub(super) type Transaction = Option<crate::ledger::postgres::OpenTransaction>;
#[cfg(not(feature = "postgres"))]
pub(super) type Transaction = Option<std::convert::Infallible>;

/// What running the handler as the key's owner needs.
///
/// Built only in [`decide`](super::admit), from a `begin` that answered `Acquired` or
/// `Resume`: holding one means the `token` is the key's current owner's.
pub(super) struct Owned<S, B> {
    /// The instance our caller polled ready (taken in `call`).
    pub(super) inner: S,
    pub(super) server: Arc<ServerFace>,
    pub(super) key: (LedgerKey, BodyDigest),
    pub(super) token: LeaseToken,
    pub(super) transaction: Transaction,
    pub(super) request: Request<RequestBody<B>>,
    pub(super) report: Report,
}

/// Start the handler's part: the handler is called here, as the key's owner.
pub(super) fn handle<S, B, ResBody>(owned: Owned<S, B>) -> Execute<S::Future, ResBody, S::Error>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let Owned {
        mut inner,
        server,
        key: (key, digest),
        token,
        transaction,
        request,
        report,
    } = owned;
    match transaction {
        #[cfg(feature = "postgres")]
        // A transaction means the claim was made inside it (transactional mode): the key
        // is held by the transaction, not by a lease, so no guard and no renewal. The run
        // is one `async fn` there, boxed at once: that mode pays a database round trip per
        // request, and a box is nothing beside it.
        Some(transaction) => {
            let key = (key, digest);
            let execute = super::transactional::execute(
                inner,
                server.clone(),
                key,
                token,
                transaction,
                request,
            );
            Execute::finishing(server, digest, report, Box::pin(execute))
        }
        #[cfg(not(feature = "postgres"))]
        Some(never) => match never {},
        None => {
            // Dropped unsettled (a panic unwinding, a cancelled future), the guard puts the
            // key in doubt at once: the handler may have done part of its work. Never
            // `Abandon` here: nothing proves the handler did nothing. Held before the
            // handler is called, so a handler that panics in `call` is covered too.
            let lease = server.ledger.hold(key, token);
            // `inner` is the instance our caller polled ready (taken in `call`).
            let handling = inner.call(request);
            Execute {
                server,
                lease: Some(lease),
                digest,
                report,
                renewal: Renewal::new(),
                step: Step::Calling { handling },
            }
        }
    }
}

pin_project! {
    /// The handler's part of a keyed request (see [`handle`]).
    ///
    /// Its steps move one way, `Calling` → `Buffering` → (`Finishing`) → `Done`, and the
    /// lease moves with them: held in `lease` while the handler runs and its body is read,
    /// taken out exactly once to be settled (in place, or inside a `Finishing` future). A
    /// step that finds `lease` empty where it needs it is a bug, hence the `expect`s.
    pub(super) struct Execute<F, B, E> {
        server: Arc<ServerFace>,
        // Taken when the lease is settled (or handed to a finishing future).
        lease: Option<LeaseGuard>,
        digest: BodyDigest,
        report: Report,
        // Keeps the lease alive while the handler runs and while its body is read: a live
        // handler is never taken for dead, however slow it is.
        #[pin]
        renewal: Renewal,
        #[pin]
        step: Step<F, B, E>,
    }
}

pin_project! {
    #[project = StepProj]
    enum Step<F, B, E> {
        Calling { #[pin] handling: F },
        Buffering { parts: Option<http::response::Parts>, buffer: BufferUpTo<B> },
        Finishing { future: Finishing<B, E> },
        Done,
    }
}

impl<F, B, E> Execute<F, B, E> {
    #[cfg(feature = "postgres")]
    fn finishing(
        server: Arc<ServerFace>,
        digest: BodyDigest,
        report: Report,
        future: Finishing<B, E>,
    ) -> Self {
        Self {
            server,
            lease: None,
            digest,
            report,
            renewal: Renewal::new(),
            step: Step::Finishing { future },
        }
    }
}

/// Poll the handler. If it panics, its lease is settled here, before the panic goes on
/// to whatever answers it (a `CatchPanicLayer`'s `500` outside this layer): dropped as the
/// panic unwound, the guard could only hand its settle to a task of its own, and a retry
/// sent the moment that `500` arrived could still find the key in flight (`409`) rather
/// than in doubt. Caught, the guard is dropped outside the unwinding, so a store that
/// answers at once (`MemoryStore`) has the key in doubt before the panic resumes. The
/// handler is never polled again after a panic.
#[inline(always)]
fn polled_or_settled<F: Future>(
    handling: Pin<&mut F>,
    lease: &mut Option<LeaseGuard>,
    cx: &mut Context<'_>,
) -> Poll<F::Output> {
    match poll_catching_unwind(handling, cx) {
        Ok(polled) => polled,
        Err(panic) => {
            settled("in-doubt");
            // Unsettled, the guard marks the key in doubt as it drops (see `LeaseGuard`).
            drop(lease.take());
            std::panic::resume_unwind(panic)
        }
    }
}

/// One poll of a handler's future, or the panic it raised: for a mode to settle what the
/// handler held (its lease, its transaction) before the panic goes on. A future that
/// panicked must not be polled again.
#[inline(always)]
pub(super) fn poll_catching_unwind<F: Future>(
    handling: Pin<&mut F>,
    cx: &mut Context<'_>,
) -> Result<Poll<F::Output>, Box<dyn std::any::Any + Send>> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handling.poll(cx)))
}

impl<F, B, E> Future for Execute<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
    B: Body<Data = Bytes> + Unpin + Send + 'static,
    B::Error: Into<BoxError>,
    E: Send + 'static,
{
    type Output = Answer<B, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            let next = match this.step.as_mut().project() {
                StepProj::Calling { handling } => match polled_or_settled(handling, this.lease, cx)
                {
                    Poll::Ready(Ok(response)) => answered(this.server, this.lease, response),
                    Poll::Ready(Err(err)) => {
                        // No response: the handler's fate is unknown. Settled in a boxed
                        // future because the store call may await; the error is returned
                        // only once the key is marked, so a retry the caller fires at
                        // once finds "in doubt", not a lease still running.
                        settled("in-doubt");
                        let lease = this.lease.take().expect("held while the handler runs");
                        Step::Finishing {
                            future: Box::pin(async move {
                                mark_in_doubt(lease).await;
                                Err(err)
                            }),
                        }
                    }
                    // Pending: the renewal is polled too (a timer, unless the store holds the
                    // lease), so the lease is renewed on this task's wakeups, with no task of
                    // its own per request.
                    Poll::Pending => {
                        return this
                            .renewal
                            .poll_renew_while(this.lease, &this.report.track, cx)
                    }
                },
                StepProj::Buffering { parts, buffer } => {
                    let buffered = match Pin::new(buffer).poll(cx) {
                        Poll::Pending => {
                            return this.renewal.poll_renew_while(
                                this.lease,
                                &this.report.track,
                                cx,
                            )
                        }
                        Poll::Ready(buffered) => buffered.map_err(Into::<BoxError>::into),
                    };
                    // The body is whole (or past the cap): the renewals stop here, since the
                    // lease leaves `this.lease` to be settled, and an empty slot renews nothing.
                    let lease = this.lease.take().expect("held while the body is read");
                    let parts = parts.take().expect("taken once");
                    let track = &this.report.track;
                    match record(this.server, (lease, track), parts, buffered, this.digest) {
                        Ok(response) => {
                            this.step.set(Step::Done);
                            return Poll::Ready(this.report.answer(Ok(response)));
                        }
                        Err(finishing) => Step::Finishing { future: finishing },
                    }
                }
                StepProj::Finishing { future } => {
                    let answered = std::task::ready!(future.as_mut().poll(cx));
                    this.step.set(Step::Done);
                    return Poll::Ready(this.report.answer(answered));
                }
                StepProj::Done => panic!("ResponseFuture polled after completion"),
            };
            this.step.set(next);
        }
    }
}

/// Leave the key in doubt after a failure, saying so if even that fails. A failed mark is
/// still safe: the record stays in flight under a lease nobody renews, and reads as in
/// doubt once the lease runs out, the same answer, later.
async fn mark_in_doubt(lease: LeaseGuard) {
    if let Err(store_err) = lease.mark_in_doubt().await {
        tracing::warn!(%store_err, "could not mark the key in doubt");
    }
}

/// The handler answered: release the key for an answer the face releases (one marked
/// [`NotProcessed`](super::NotProcessed), a refusal before processing, a `5xx` under
/// [`ServerErrorPolicy::Release`](crate::ServerErrorPolicy::Release): see
/// [`ServerFace::releases`]), or read the body to record it.
fn answered<F, B, E>(
    server: &ServerFace,
    lease: &mut Option<LeaseGuard>,
    response: Response<B>,
) -> Step<F, B, E>
where
    B: Body<Data = Bytes> + Unpin + Send + 'static,
    E: Send + 'static,
{
    if server.releases(&response) {
        // Released before the answer is returned, for the reason a record is written first:
        // the client's retry must find the key free, not still held by this request.
        settled("released");
        let lease = lease.take().expect("held while the handler runs");
        return Step::Finishing {
            future: Box::pin(async move {
                if let Err(err) = lease.abandon().await {
                    tracing::warn!(%err, "could not release the key after a released answer");
                }
                Ok(response.map(ResponseBody::inner))
            }),
        };
    }
    let (parts, body) = response.into_parts();
    Step::Buffering {
        parts: Some(parts),
        buffer: buffer_up_to(body, server.response_limit),
    }
}

/// Record the buffered response (or a tombstone) and answer it; a store that awaits, or
/// whose answer was lost, finishes in a future of its own.
fn record<B, E>(
    server: &ServerFace,
    (lease, track): (LeaseGuard, &Track),
    parts: http::response::Parts,
    buffered: Result<Buffered<B>, BoxError>,
    digest: &BodyDigest,
) -> Result<Response<ResponseBody<B>>, Finishing<B, E>>
where
    B: Send + 'static,
    E: Send + 'static,
{
    let buffered = match buffered {
        Ok(buffered) => buffered,
        Err(err) => {
            // The handler acted, but its answer is lost: the outcome is unknown, to this
            // caller as to the next.
            tracing::warn!(%err, "the handler's response body failed");
            settled("in-doubt");
            return Err(Box::pin(async move {
                mark_in_doubt(lease).await;
                Ok(problem::outcome_unknown())
            }));
        }
    };
    // Over the cap, a tombstone is recorded now and the body streams on afterwards: the
    // rest of it cannot be held, and the retry must learn the handler ran (`410`) rather
    // than run it again. A stream that fails after this point cannot change the record.
    let (recorded, body, how) = recording(server, &parts, buffered, digest);
    // A store that keeps only a tombstone of the outcome (no room for it) says so here.
    let (in_place, raised) = with_store_signals(|| lease.complete_in_place(recorded));
    track.signal_all(raised);
    match in_place {
        InPlace::Done(completed) => {
            recorded_as(how, completed);
            Ok(Response::from_parts(parts, body))
        }
        InPlace::Later(unsettled) => Err(Box::pin(async move {
            recorded_as(how, unsettled.complete().await);
            Ok(Response::from_parts(parts, body))
        })),
    }
}

/// Say how the outcome was settled: `how`, or not recorded at all.
fn recorded_as(how: &'static str, completed: Result<(), crate::ledger::StoreError>) {
    match completed {
        Ok(()) => settled(how),
        Err(err) => {
            // The handler's effect happened and this caller gets its answer; a retry will
            // find the key in doubt once the lease ends (or at once, if it was taken over).
            settled("not-recorded");
            tracing::error!(%err, "could not record the outcome");
        }
    }
}
