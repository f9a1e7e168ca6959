//! [`Exchange`]: send the frozen request as the operation's owner and settle its lease.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Extensions, Request, Response};
use http_body::Body;
use http_body_util::Full;
use pin_project_lite::pin_project;
use tower_service::Service;

use crate::frozen::FrozenRequest;
use crate::idempotency::body::{buffer_up_to, BufferUpTo, ResponseBody};
use crate::idempotency::decision::{Decision, Signal, Track};
use crate::idempotency::engine::{LeaseGuard, Renewal};
use crate::ledger::{LeaseToken, LedgerKey};
use crate::retry::{is_in_progress_answer, is_retryable_status};
use crate::ResponseSource;
use crate::{BoxError, Error};

use super::face::ClientFace;
use super::send::Sending;
pub(super) use super::settle::Answer;
use super::settle::{
    failed, not_ready, record, release_not_started, settled_then, Finishing, Read,
};

/// A keyed operation's request, frozen, and what its decisions are logged under.
pub(super) struct Keyed {
    pub(super) key: LedgerKey,
    pub(super) frozen: FrozenRequest,
    pub(super) extensions: Extensions,
    pub(super) track: Track,
}

pin_project! {
    /// Send the frozen request as the operation's owner, renewing the lease while the call
    /// and its response body are under way, and settle the lease by what happened: record
    /// the response (or a tombstone), leave the operation in doubt (an answer that says
    /// "try again", a failure after the bytes may have left, a lost body) or release it
    /// (a failure before they could). Its output gives the decision log back. `M` is how
    /// the request is sent ([`Sending`]).
    pub(super) struct Exchange<S, ResB, M>
    where
        S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
        M: Sending<S, ResB>,
    {
        client: Arc<ClientFace>,
        track: Option<Track>,
        // Taken when the lease is settled (or handed to a finishing future).
        lease: Option<LeaseGuard>,
        // Set when the request is sent.
        link: Option<M::Link>,
        source: ResponseSource,
        // The frozen request, when the store keeps a completed request's field digests:
        // they are gathered from it for the record, outside the store.
        request: Option<FrozenRequest>,
        #[pin]
        renewal: Renewal,
        #[pin]
        step: ExchangeStep<S, ResB, M::Call>,
    }
}

pin_project! {
    #[project = ExchangeStepProj]
    enum ExchangeStep<S, ResB, C>
    where
        S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
    {
        // Waiting for the inner service to be ready: nothing has been sent.
        Readying {
            inner: Option<S>,
            frozen: Option<FrozenRequest>,
            extensions: Option<Extensions>,
        },
        Calling { #[pin] call: C },
        Buffering {
            parts: Option<http::response::Parts>,
            buffer: BufferUpTo<ResB>,
            // What the answer says once read: "try again" (in doubt unless the body says
            // nothing ran), and whether the body may name a problem type that releases.
            retryable: bool,
            read_problem: bool,
            // Whether an attempt inside may have left (an earlier one, if this answer is
            // one that says nothing ran).
            sent: bool,
        },
        Finishing { future: Finishing<ResB> },
        Done,
    }
}

impl<S, ResB, M> Exchange<S, ResB, M>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
    M: Sending<S, ResB>,
{
    /// Send the frozen request of `keyed` under `token`, as first sent (the request goes
    /// out from here: `inner` is called on the first poll).
    #[inline(always)]
    pub(super) fn of_keyed(
        inner: S,
        client: Arc<ClientFace>,
        keyed: Keyed,
        token: LeaseToken,
    ) -> Self {
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
            frozen,
            extensions,
            source,
        )
    }

    /// Send `frozen` under `token`, for a response that will carry `source`.
    #[inline(always)]
    pub(super) fn with_source(
        inner: S,
        client: Arc<ClientFace>,
        (key, track): (LedgerKey, Track),
        token: LeaseToken,
        frozen: FrozenRequest,
        extensions: Extensions,
        source: ResponseSource,
    ) -> Self {
        // Dropped before settling (the caller gave up), the guard releases the operation
        // while nothing was sent, and marks it in doubt once the inner service was called:
        // the request may be on the wire.
        let lease = client.ledger.hold_unsent(key, token);
        let request = client.ledger.request_for_fields(&frozen).cloned();
        Self {
            client,
            track: Some(track),
            lease: Some(lease),
            link: None,
            source,
            request,
            renewal: Renewal::new(),
            step: ExchangeStep::Readying {
                inner: Some(inner),
                frozen: Some(frozen),
                extensions: Some(extensions),
            },
        }
    }
}

impl<S, ResB, M> Future for Exchange<S, ResB, M>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
    M: Sending<S, ResB>,
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
                ExchangeStepProj::Readying {
                    inner,
                    frozen,
                    extensions,
                } => {
                    let service = inner.as_mut().expect("called once");
                    match service.poll_ready(cx) {
                        // Renewed while waiting too: a slow `poll_ready` (a full pool) must
                        // not let the lease lapse and hand the operation to another run.
                        Poll::Pending => {
                            return this.renewal.poll_renew_while(this.lease, track, cx)
                        }
                        Poll::Ready(Ok(())) => {
                            // The last moment nothing can have left: from the call on, a
                            // drop leaves the operation in doubt. `sending` is marked
                            // *before* `call`, not after: a service may write inside `call`
                            // itself, and a guard still believing "unsent" would then
                            // release an operation whose bytes are on the wire — the next
                            // run would send its own, regenerated ones.
                            this.lease
                                .as_mut()
                                .expect("held until the call is answered")
                                .sending();
                            let (call, link) = M::send(
                                this.client,
                                inner.take().expect("called once"),
                                frozen.take().expect("sent once"),
                                extensions.take().expect("sent once"),
                            );
                            *this.link = Some(link);
                            // Set here rather than below: the call is the step's largest
                            // state, and each move of it a copy.
                            this.step.set(ExchangeStep::Calling { call });
                            continue;
                        }
                        Poll::Ready(Err(error)) => {
                            let lease = this.lease.take().expect("held until the call");
                            ExchangeStep::Finishing {
                                future: not_ready(track, lease, error.into()),
                            }
                        }
                    }
                }
                ExchangeStepProj::Calling { mut call } => {
                    let result = match call.as_mut().poll(cx) {
                        Poll::Pending => {
                            return this.renewal.poll_renew_while(this.lease, track, cx)
                        }
                        Poll::Ready(result) => result,
                    };
                    let link = this.link.as_ref().expect("set when sent");
                    let sent = M::may_have_left(this.client, track, link, call.as_ref().get_ref());
                    if sent {
                        // A later attempt followed one that may have arrived: the provider
                        // was trusted to deduplicate it (the retry layer resends after such
                        // a failure only to a provider said to).
                        track.signal(Signal::ResentInDoubt);
                    }
                    // Out of `this.lease` before anything is decided: from here the guard
                    // moves with the settling (a boxed future, or back into `held` to read
                    // the body), so exactly one place settles it, and a drop of either
                    // still settles it from the guard.
                    let lease = this.lease.take().expect("held while the call is under way");
                    match result {
                        Ok(response) => answered(
                            this.client,
                            (track, sent),
                            lease,
                            response,
                            *this.source,
                            this.lease,
                        ),
                        Err(error) => ExchangeStep::Finishing {
                            future: failed(this.client, track, sent, lease, error.into()),
                        },
                    }
                }
                ExchangeStepProj::Buffering {
                    parts,
                    buffer,
                    retryable,
                    read_problem,
                    sent,
                } => {
                    let buffered = match Pin::new(buffer).poll(cx) {
                        Poll::Pending => {
                            return this.renewal.poll_renew_while(this.lease, track, cx)
                        }
                        Poll::Ready(buffered) => buffered.map_err(Into::<BoxError>::into),
                    };
                    let lease = this.lease.take().expect("held while the body is read");
                    let parts = parts.take().expect("taken once");
                    let read = Read {
                        retryable: *retryable,
                        read_problem: *read_problem,
                    };
                    let request = this.request.take();
                    let answer = (parts, read);
                    match record(
                        this.client,
                        (track, *sent),
                        lease,
                        answer,
                        buffered,
                        request,
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

/// Whether the transport got `response` by following a redirect (see
/// [`AnsweredAfterRedirect`](super::release::AnsweredAfterRedirect)): a redirect's answer
/// never releases the operation. Such a transport may let an effect repeat (a failure on a
/// later redirect's hop reads as "never sent"), so the request's track says so, for
/// metrics and the outcome hook. A lookup in the response's extensions: nothing allocated.
fn answered_after_redirect<ResB>(track: &Track, response: &Response<ResB>) -> bool {
    let redirected = response
        .extensions()
        .get::<super::release::AnsweredAfterRedirect>()
        .is_some();
    if redirected {
        track.signal(Signal::RedirectFollowed);
    }
    redirected
}

/// The server answered. An answer that says the operation never started (see
/// [`ReleaseOn`](super::ReleaseOn)) releases it; one that says "try again"
/// leaves it in doubt, so a later run resends the frozen bytes rather than replaying a
/// 503; any other is read to be recorded (the lease goes back in `held`). A problem
/// response is read first in either case, to see whether its type says nothing ran.
fn answered<ResB, S, C>(
    client: &ClientFace,
    (track, sent): (&Track, bool),
    lease: LeaseGuard,
    response: Response<ResB>,
    source: ResponseSource,
    held: &mut Option<LeaseGuard>,
) -> ExchangeStep<S, ResB, C>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
    ResB: Body<Data = Bytes> + Unpin + Send + 'static,
{
    let status = response.status();
    let after_redirect = answered_after_redirect(track, &response);
    // An answer to a resend of an attempt that may have arrived is a resent operation's.
    let source = match source {
        ResponseSource::Sent if sent => ResponseSource::Resent,
        source => source,
    };
    if client.release_on.releases_status(status) && !after_redirect {
        let settling = release_not_started(track, sent, lease);
        let mut response = response.map(ResponseBody::inner);
        source.mark(response.extensions_mut());
        return ExchangeStep::Finishing {
            future: settled_then(settling, response),
        };
    }
    // Only answers that mean "come back later" leave the operation open; any other answer,
    // a business `409` ("already exists") included, is its final outcome.
    let retryable =
        is_retryable_status(status) || is_in_progress_answer(status, response.headers());
    let read_problem =
        client.release_on.reads_problem(status, response.headers()) && !after_redirect;
    if retryable && !read_problem {
        if status == http::StatusCode::CONFLICT {
            // "Still in progress" (its `Retry-After` says so): not an outcome, and not an
            // answer for the caller to take as final.
            return ExchangeStep::Finishing {
                future: super::settle::refused_key_in_use(track, lease, response.headers()),
            };
        }
        track.decided(Decision::InDoubt);
        let mut response = response.map(ResponseBody::inner);
        source.mark(response.extensions_mut());
        return ExchangeStep::Finishing {
            future: settled_then(lease.mark_in_doubt(), response),
        };
    }
    let (mut parts, body) = response.into_parts();
    source.mark(&mut parts.extensions);
    *held = Some(lease);
    ExchangeStep::Buffering {
        parts: Some(parts),
        buffer: buffer_up_to(body, client.response_limit),
        retryable,
        read_problem,
        sent,
    }
}

/// Send `frozen` as the operation's owner and settle the lease by what happened (see
/// [`Exchange`]), from one of the `async` paths.
pub(super) async fn exchange<S, ResBody, M>(
    inner: S,
    client: &Arc<ClientFace>,
    (key, track): (LedgerKey, &Track),
    token: LeaseToken,
    frozen: &FrozenRequest,
    extensions: Extensions,
    source: ResponseSource,
) -> Result<Response<ResponseBody<ResBody>>, Error>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
    M: Sending<S, ResBody>,
    S::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let keyed = (key, track.fork());
    let exchange = Exchange::<S, ResBody, M>::with_source(
        inner,
        client.clone(),
        keyed,
        token,
        frozen.clone(),
        extensions,
        source,
    );
    let (answer, forked) = exchange.await;
    track.follow(&forked);
    answer
}
