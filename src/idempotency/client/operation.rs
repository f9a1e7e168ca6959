//! One keyed operation through the client face, as hand-written futures: freeze the
//! request, claim the operation, then send it as its owner ([`Exchange`]) or replay it.
//!
//! Futures of their own rather than `async fn`s, so that the operation is a type that can
//! be named and held in place: the layer's future is not boxed, and nested `async fn`s no
//! longer each keep a copy of what they are handed. The rare paths (a store that awaits,
//! drift, resuming or reconciling an operation in doubt, fail open, a failure to settle)
//! stay `async` and are boxed when taken.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Extensions, Request, Response};
use http_body::Body;
use http_body_util::Full;
use pin_project_lite::pin_project;
use tower::util::Oneshot;
use tower::ServiceExt;
use tower_service::Service;

use super::{failed_outside, identify, into_error, operate_after, replay, ClientFace};
use crate::effect::EffectClass;
use crate::frozen::{check_declared_length, CollectRequest, FrozenRequest, Handoff};
use crate::idempotency::body::{buffer_up_to, BufferUpTo, Buffered, ResponseBody};
use crate::idempotency::decision::{self, Decision, Face, Track, WireKey};
use crate::idempotency::engine::{InPlace, LeaseGuard, Renewal, Settling};
use crate::idempotency::ResponseSource;
use crate::ledger::{Begin, HeaderBlock, LeaseToken, LedgerKey, Outcome, StoredResponse};
use crate::phase::classify;
use crate::retry::{is_in_progress_answer, is_retryable_status};
use crate::{BoxError, Error};

/// What an operation answers.
type Answer<ResB> = Result<Response<ResponseBody<ResB>>, Error>;

/// A rare path of an operation, boxed: while the inner service may still be called, it
/// lives as long as that service (`'a`).
type Slow<'a, ResB> = Pin<Box<dyn Future<Output = Answer<ResB>> + Send + 'a>>;

pin_project! {
    /// One logical operation through the client face (see the module docs).
    pub(crate) struct Operation<'a, S, B, ResB>
    where
        S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
    {
        // Called once: the retries, if any, are its own.
        inner: Option<S>,
        client: Arc<ClientFace>,
        started: Option<tokio::time::Instant>,
        #[pin]
        step: Step<'a, S, B, ResB>,
    }
}

pin_project! {
    #[project = StepProj]
    enum Step<'a, S, B, ResB>
    where
        S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
    {
        Refused { error: Option<Error> },
        Freezing {
            #[pin]
            collect: CollectRequest<B>,
            key: Option<(LedgerKey, WireKey)>,
            side_effect: bool,
        },
        // Outside the ledger; the frozen request when it is an unprotected side effect.
        PassingThrough {
            #[pin]
            call: Oneshot<S, Request<Full<Bytes>>>,
            unprotected: Option<FrozenRequest>,
        },
        Exchanging { #[pin] exchange: Exchange<S, ResB> },
        Slow { future: Slow<'a, ResB> },
        Done,
    }
}

impl<'a, S, B, ResB> Operation<'a, S, B, ResB>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
    B: Body,
{
    /// The operation of `req`: its key (or the refusal of a missing or malformed one),
    /// then its body read up to the limit.
    pub(crate) fn new(
        inner: S,
        client: Arc<ClientFace>,
        req: Request<B>,
        started: Option<tokio::time::Instant>,
    ) -> Self {
        let side_effect = EffectClass::of_request(&req).is_side_effect();
        let (mut parts, body) = req.into_parts();
        let key = if side_effect {
            client.check_layer_order(&parts.extensions);
            identify(&client, &mut parts)
        } else {
            Ok(None)
        };
        let step = match key.and_then(|key| {
            check_declared_length(&parts.headers, &body, client.body_limit)?;
            Ok((key, CollectRequest::checked(parts, body, client.body_limit)))
        }) {
            Ok((key, collect)) => Step::Freezing {
                collect,
                key,
                side_effect,
            },
            Err(error) => Step::Refused { error: Some(error) },
        };
        Self {
            inner: Some(inner),
            client,
            started,
            step,
        }
    }
}

impl<'a, S, B, ResB> Future for Operation<'a, S, B, ResB>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>> + Send + 'a,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Unpin + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Output = Answer<ResB>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            let next = match this.step.as_mut().project() {
                StepProj::Refused { error } => {
                    let error = error.take().expect("ClientFuture polled after completion");
                    Next::Answer(Err(error))
                }
                StepProj::Freezing {
                    collect,
                    key,
                    side_effect,
                } => match std::task::ready!(collect.poll(cx)) {
                    Err(error) => Next::Answer(Err(error)),
                    Ok((parts, body)) => {
                        let inner = this.inner.take().expect("called once");
                        let key = key.take();
                        // A keyed request carries `Content-Digest` of its frozen body, hashed
                        // once with the fingerprint, so the server can check that the bytes
                        // it got are the bytes we froze.
                        let (frozen, extensions) =
                            FrozenRequest::of_collected(parts, body, key.is_some());
                        match key {
                            None => Next::Step(Step::PassingThrough {
                                call: inner.oneshot(frozen.to_request_with(extensions)),
                                unprotected: side_effect.then_some(frozen),
                            }),
                            Some((key, wire)) => {
                                let keyed = Keyed {
                                    key,
                                    frozen,
                                    extensions,
                                    track: tracked(wire),
                                };
                                operate(inner, this.client, keyed, *this.started)
                            }
                        }
                    }
                },
                StepProj::PassingThrough { call, unprotected } => {
                    let response = std::task::ready!(call.poll(cx))
                        .map_err(|error| failed_outside(this.client, error.into()));
                    Next::Answer(response.map(|response| {
                        let mut response = response.map(ResponseBody::inner);
                        if let Some(frozen) = unprotected.take() {
                            this.client.report_unprotected(&frozen);
                            response
                                .extensions_mut()
                                .insert(ResponseSource::Unprotected);
                        }
                        response
                    }))
                }
                StepProj::Exchanging { exchange } => {
                    let (answer, track) = std::task::ready!(exchange.poll(cx));
                    Next::Answer(reported(this.client, &track, *this.started, answer))
                }
                StepProj::Slow { future } => {
                    Next::Answer(std::task::ready!(future.as_mut().poll(cx)))
                }
                StepProj::Done => panic!("ClientFuture polled after completion"),
            };
            match next {
                Next::Step(step) => this.step.set(step),
                Next::Answer(answer) => {
                    this.step.set(Step::Done);
                    return Poll::Ready(answer);
                }
            }
        }
    }
}

/// Where a step leaves the operation: another step, or its answer.
// The next step is built once and moved into place; boxing it is what these futures avoid.
#[allow(clippy::large_enum_variant)]
enum Next<'a, S, B, ResB>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
{
    Step(Step<'a, S, B, ResB>),
    Answer(Answer<ResB>),
}

/// A keyed operation's request, frozen, and what its decisions are logged under.
struct Keyed {
    key: LedgerKey,
    frozen: FrozenRequest,
    extensions: Extensions,
    track: Track,
}

/// The operation's decision log, its key also recorded in the span.
fn tracked(wire: WireKey) -> Track {
    decision::record_in_layer_span("key", tracing::field::display(decision::KeyDigest(&wire)));
    Track::new(Face::Client, Some(wire))
}

/// Tell the hook what the operation came to, and pass its answer on.
fn reported<T>(
    client: &ClientFace,
    track: &Track,
    started: Option<tokio::time::Instant>,
    answer: Answer<T>,
) -> Answer<T> {
    let status = answer.as_ref().ok().map(|response| response.status());
    track.report(client.on_outcome.as_ref(), started, status);
    answer
}

/// The ledger's part: `begin` in place, then send as the owner or replay; anything else
/// (a store that awaits, a lost answer, drift, doubt, a refusal) by the boxed slow path.
fn operate<'a, S, B, ResB>(
    inner: S,
    client: &Arc<ClientFace>,
    keyed: Keyed,
    started: Option<tokio::time::Instant>,
) -> Next<'a, S, B, ResB>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>> + Send + 'a,
    S::Future: Send,
    S::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Unpin + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let mut begin = client
        .ledger
        .request(keyed.key, keyed.frozen.fingerprint())
        .with_frozen(keyed.frozen.clone());
    if !client.provider_deduplicates {
        // The server would run an in-doubt operation again: only ever look at one.
        begin = begin.probe();
    }
    let answered = match client.ledger.begin_in_place(&begin, client.busy) {
        Ok(answered) => answered,
        // Boxed: waiting and asking again are the rare path; held in place, their state
        // would weigh on every operation's future.
        Err(lost) => {
            let client = client.clone();
            return Next::Step(Step::Slow {
                future: Box::pin(async move {
                    let answered = client.ledger.begin_after(begin, client.busy, lost).await;
                    slowly(inner, &client, keyed, answered, started).await
                }),
            });
        }
    };
    match answered {
        Ok(Begin::Acquired { token }) => {
            keyed.track.decided(Decision::Acquired);
            let exchange = Exchange::of_keyed(inner, client.clone(), keyed, token);
            Next::Step(Step::Exchanging { exchange })
        }
        Ok(Begin::Replay(outcome)) => {
            keyed.track.decided(Decision::Replayed);
            Next::Answer(reported(client, &keyed.track, started, replay(outcome)))
        }
        answered => {
            let client = client.clone();
            Next::Step(Step::Slow {
                future: Box::pin(
                    async move { slowly(inner, &client, keyed, answered, started).await },
                ),
            })
        }
    }
}

/// The slow path: act on the ledger's answer as [`operate_after`] does, then tell the hook.
async fn slowly<S, ResB>(
    inner: S,
    client: &Arc<ClientFace>,
    keyed: Keyed,
    answered: Result<Begin, crate::ledger::StoreError>,
    started: Option<tokio::time::Instant>,
) -> Answer<ResB>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Unpin + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let Keyed {
        key,
        frozen,
        extensions,
        track,
    } = keyed;
    let answer = operate_after(inner, client, key, frozen, extensions, &track, answered).await;
    reported(client, &track, started, answer)
}

/// The settling of an exchange that could not be done in place, boxed.
type Finishing<ResB> = Pin<Box<dyn Future<Output = Answer<ResB>> + Send>>;

pin_project! {
    /// Send the frozen request as the operation's owner, renewing the lease while the call
    /// and its response body are under way, and settle the lease by what happened: record
    /// the response (or a tombstone), leave the operation in doubt (an answer that says
    /// "try again", a failure after the bytes may have left, a lost body) or release it
    /// (a failure before they could). Its output gives the decision log back.
    pub(super) struct Exchange<S, ResB>
    where
        S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
    {
        client: Arc<ClientFace>,
        track: Option<Track>,
        // Taken when the lease is settled (or handed to a finishing future).
        lease: Option<LeaseGuard>,
        handoff: Handoff,
        source: ResponseSource,
        #[pin]
        renewal: Renewal,
        #[pin]
        step: ExchangeStep<S, ResB>,
    }
}

pin_project! {
    #[project = ExchangeStepProj]
    enum ExchangeStep<S, ResB>
    where
        S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
    {
        // Waiting for the inner service to be ready: nothing has been sent.
        Readying { inner: Option<S>, request: Option<Request<Full<Bytes>>> },
        Calling { #[pin] call: S::Future },
        Buffering {
            parts: Option<http::response::Parts>,
            buffer: BufferUpTo<ResB>,
            // What the answer says once read: "try again" (in doubt unless the body says
            // nothing ran), and whether the body may name a problem type that releases.
            retryable: bool,
            read_problem: bool,
        },
        Finishing { future: Finishing<ResB> },
        Done,
    }
}

impl<S, ResB> Exchange<S, ResB>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
{
    /// Send the frozen request of `keyed` under `token`, as first sent (the request goes
    /// out from here: `inner` is called on the first poll).
    fn of_keyed(inner: S, client: Arc<ClientFace>, keyed: Keyed, token: LeaseToken) -> Self {
        let Keyed {
            key,
            frozen,
            extensions,
            track,
        } = keyed;
        let source = ResponseSource::Sent;
        Self::with_source(
            inner,
            client,
            (key, track),
            token,
            &frozen,
            extensions,
            source,
        )
    }

    /// Send `frozen` under `token`, for a response that will carry `source`.
    pub(super) fn with_source(
        inner: S,
        client: Arc<ClientFace>,
        (key, track): (LedgerKey, Track),
        token: LeaseToken,
        frozen: &FrozenRequest,
        mut extensions: Extensions,
        source: ResponseSource,
    ) -> Self {
        // Dropped before settling (the caller gave up), the guard releases the operation
        // while nothing was sent, and marks it in doubt once the inner service was called:
        // the request may be on the wire.
        let lease = client.ledger.hold_unsent(key, token);
        let handoff = Handoff::new(frozen.clone(), !client.provider_deduplicates);
        extensions.insert(handoff.clone());
        let request = frozen.to_request_with(extensions);
        Self {
            client,
            track: Some(track),
            lease: Some(lease),
            handoff,
            source,
            renewal: Renewal::new(),
            step: ExchangeStep::Readying {
                inner: Some(inner),
                request: Some(request),
            },
        }
    }
}

impl<S, ResB> Future for Exchange<S, ResB>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
    S::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Unpin + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Output = (Answer<ResB>, Track);

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            let track = this
                .track
                .as_ref()
                .expect("Exchange polled after completion");
            let next = match this.step.as_mut().project() {
                ExchangeStepProj::Readying { inner, request } => {
                    let service = inner.as_mut().expect("called once");
                    match service.poll_ready(cx) {
                        Poll::Pending => return this.renewal.poll_renew_while(this.lease, cx),
                        Poll::Ready(Ok(())) => {
                            // The last moment nothing can have left: from the call on, a
                            // drop leaves the operation in doubt.
                            this.lease
                                .as_mut()
                                .expect("held until the call is answered")
                                .sending();
                            let request = request.take().expect("sent once");
                            let call = inner.take().expect("called once").call(request);
                            ExchangeStep::Calling { call }
                        }
                        Poll::Ready(Err(error)) => {
                            let lease = this.lease.take().expect("held until the call");
                            ExchangeStep::Finishing {
                                future: not_ready(track, lease, error.into()),
                            }
                        }
                    }
                }
                ExchangeStepProj::Calling { call } => {
                    let result = match call.poll(cx) {
                        Poll::Pending => return this.renewal.poll_renew_while(this.lease, cx),
                        Poll::Ready(result) => result,
                    };
                    this.client.check_real_retry_window(this.handoff);
                    let lease = this.lease.take().expect("held while the call is under way");
                    match result {
                        Ok(response) => answered(
                            this.client,
                            (track, this.handoff),
                            lease,
                            response,
                            *this.source,
                            this.lease,
                        ),
                        Err(error) => ExchangeStep::Finishing {
                            future: failed(this.client, track, this.handoff, lease, error.into()),
                        },
                    }
                }
                ExchangeStepProj::Buffering {
                    parts,
                    buffer,
                    retryable,
                    read_problem,
                } => {
                    let buffered = match Pin::new(buffer).poll(cx) {
                        Poll::Pending => return this.renewal.poll_renew_while(this.lease, cx),
                        Poll::Ready(buffered) => buffered.map_err(Into::<BoxError>::into),
                    };
                    let lease = this.lease.take().expect("held while the body is read");
                    let parts = parts.take().expect("taken once");
                    let read = Read {
                        retryable: *retryable,
                        read_problem: *read_problem,
                    };
                    match record(
                        this.client,
                        (track, this.handoff),
                        lease,
                        (parts, read),
                        buffered,
                    ) {
                        Ok(response) => {
                            this.step.set(ExchangeStep::Done);
                            let track = this.track.take().expect("given back once");
                            return Poll::Ready((Ok(response), track));
                        }
                        Err(finishing) => ExchangeStep::Finishing { future: finishing },
                    }
                }
                ExchangeStepProj::Finishing { future } => {
                    let answer = std::task::ready!(future.as_mut().poll(cx));
                    this.step.set(ExchangeStep::Done);
                    let track = this.track.take().expect("given back once");
                    return Poll::Ready((answer, track));
                }
                ExchangeStepProj::Done => panic!("Exchange polled after completion"),
            };
            this.step.set(next);
        }
    }
}

/// The inner service refused to become ready: nothing was sent, so release the operation
/// (a resumed one goes back to doubt: the store never releases what may have been sent).
fn not_ready<ResB: Send + 'static>(
    track: &Track,
    lease: LeaseGuard,
    error: BoxError,
) -> Finishing<ResB> {
    track.decided(Decision::Released);
    let settling = lease.abandon();
    Box::pin(async move {
        if let Err(err) = settling.await {
            tracing::warn!(%err, "could not release the operation; it will expire into doubt");
        }
        Err(into_error(error, crate::phase::FailurePhase::PreWrite))
    })
}

/// The call failed: leave the operation in doubt if its bytes may have left, else release
/// it; then answer the error with its phase.
fn failed<ResB: Send + 'static>(
    client: &ClientFace,
    track: &Track,
    handoff: &Handoff,
    lease: LeaseGuard,
    error: BoxError,
) -> Finishing<ResB> {
    let phase = classify(&*error, client.phase_classifier.as_deref());
    // Sticky: an earlier attempt inside (reported by the retry layer) may have left even
    // when the last one was refused before writing.
    let settling = if phase.may_have_been_sent() || handoff.may_have_been_sent() {
        track.decided(Decision::InDoubt);
        lease.mark_in_doubt()
    } else {
        track.decided(Decision::Released);
        lease.abandon()
    };
    Box::pin(async move {
        if let Err(err) = settling.await {
            tracing::warn!(%err, "could not settle the lease after a failure; it will expire into doubt");
        }
        tracing::debug!(?phase, %error, "operation failed");
        Err(into_error(error, phase))
    })
}

/// What an answer said before its body was read.
#[derive(Clone, Copy)]
struct Read {
    /// "Try again": left in doubt unless the body says nothing ran.
    retryable: bool,
    /// A problem response whose type may say nothing ran.
    read_problem: bool,
}

/// Settle the lease of an operation whose answer says it never started: released, unless
/// an earlier attempt may have sent it (sticky: then it stays in doubt).
fn release_not_started(track: &Track, handoff: &Handoff, lease: LeaseGuard) -> Settling {
    if handoff.may_have_been_sent() {
        track.decided(Decision::InDoubt);
        lease.mark_in_doubt()
    } else {
        track.decided(Decision::Released);
        lease.abandon()
    }
}

/// Finish settling, then answer `response` as it came.
fn settled_then<ResB: Send + 'static>(
    settling: Settling,
    response: Response<ResponseBody<ResB>>,
) -> Finishing<ResB> {
    Box::pin(async move {
        if let Err(err) = settling.await {
            tracing::warn!(%err, "could not settle the operation; it will expire into doubt");
        }
        Ok(response)
    })
}

/// The server answered. An answer that says the operation never started (see
/// [`ReleaseOn`](crate::idempotency::ReleaseOn)) releases it; one that says "try again"
/// leaves it in doubt, so a later run resends the frozen bytes rather than replaying a
/// 503; any other is read to be recorded (the lease goes back in `held`). A problem
/// response is read first in either case, to see whether its type says nothing ran.
fn answered<ResB, S>(
    client: &ClientFace,
    (track, handoff): (&Track, &Handoff),
    lease: LeaseGuard,
    response: Response<ResB>,
    source: ResponseSource,
    held: &mut Option<LeaseGuard>,
) -> ExchangeStep<S, ResB>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes> + Unpin + Send + 'static,
{
    let status = response.status();
    if client.release_on.releases_status(status) {
        let settling = release_not_started(track, handoff, lease);
        let mut response = response.map(ResponseBody::inner);
        response.extensions_mut().insert(source);
        return ExchangeStep::Finishing {
            future: settled_then(settling, response),
        };
    }
    // Only answers that mean "come back later" leave the operation open; any other answer,
    // a business `409` ("already exists") included, is its final outcome.
    let retryable =
        is_retryable_status(status) || is_in_progress_answer(status, response.headers());
    let read_problem = client.release_on.reads_problem(response.headers());
    if retryable && !read_problem {
        track.decided(Decision::InDoubt);
        let mut response = response.map(ResponseBody::inner);
        response.extensions_mut().insert(source);
        return ExchangeStep::Finishing {
            future: settled_then(lease.mark_in_doubt(), response),
        };
    }
    let (mut parts, body) = response.into_parts();
    parts.extensions.insert(source);
    *held = Some(lease);
    ExchangeStep::Buffering {
        parts: Some(parts),
        buffer: buffer_up_to(body, client.response_limit),
        retryable,
        read_problem,
    }
}

/// Record the buffered response (or a tombstone) and answer it; a store that awaits, or
/// whose answer was lost, finishes in a future of its own, as does a lost body. A problem
/// response whose type says nothing ran releases the operation instead, and a "try again"
/// one leaves it in doubt.
fn record<ResB: Send + 'static>(
    client: &ClientFace,
    (track, handoff): (&Track, &Handoff),
    lease: LeaseGuard,
    (parts, read): (http::response::Parts, Read),
    buffered: Result<Buffered<ResB>, BoxError>,
) -> Result<Response<ResponseBody<ResB>>, Finishing<ResB>> {
    let buffered = match buffered {
        Ok(buffered) => buffered,
        Err(err) => {
            // The server acted (it answered); only the body was lost.
            return Err(Box::pin(async move {
                if let Err(store_err) = lease.mark_in_doubt().await {
                    tracing::warn!(%store_err, "could not mark the operation in doubt");
                }
                Err(Error::response_body(err))
            }));
        }
    };
    if let Buffered::Whole(bytes) = &buffered {
        if read.read_problem && client.release_on.releases_problem(bytes) {
            let settling = release_not_started(track, handoff, lease);
            let response = Response::from_parts(parts, ResponseBody::buffered(bytes.clone()));
            return Err(settled_then(settling, response));
        }
        if read.retryable {
            track.decided(Decision::InDoubt);
            let response = Response::from_parts(parts, ResponseBody::buffered(bytes.clone()));
            return Err(settled_then(lease.mark_in_doubt(), response));
        }
    }
    let (outcome, body) = match buffered {
        Buffered::Whole(bytes) => {
            // The record gets its own exact-size copy (see `HeaderBlock::with_body`).
            let recorded = HeaderBlock::with_body(&parts.headers, &bytes);
            let stored = StoredResponse::of_block_with_body(parts.status, parts.version, recorded);
            (Outcome::Response(stored), ResponseBody::buffered(bytes))
        }
        Buffered::Overflow(prefix, rest) if read.retryable => {
            // A "try again" answer too large to read whole: in doubt, as unread.
            track.decided(Decision::InDoubt);
            let response = Response::from_parts(parts, ResponseBody::overflow(prefix, rest));
            return Err(settled_then(lease.mark_in_doubt(), response));
        }
        Buffered::Overflow(prefix, rest) => {
            tracing::info!(
                limit = client.response_limit,
                "response over the recording cap; keeping a tombstone"
            );
            let status = parts.status;
            (
                Outcome::Tombstone { status },
                ResponseBody::overflow(prefix, rest),
            )
        }
    };
    match lease.complete_in_place(outcome) {
        InPlace::Done(completed) => {
            not_recorded(completed);
            Ok(Response::from_parts(parts, body))
        }
        InPlace::Later(unsettled) => Err(Box::pin(async move {
            not_recorded(unsettled.complete().await);
            Ok(Response::from_parts(parts, body))
        })),
    }
}

/// Say so when the outcome could not be recorded.
fn not_recorded(completed: Result<(), crate::ledger::StoreError>) {
    if let Err(err) = completed {
        // The effect happened and the caller gets the real answer; a later run will find
        // the record in doubt and resend the same bytes under the same key.
        tracing::error!(%err, "could not record the outcome");
    }
}
