//! The retry service's response future: freezing, sending, waiting, sending again.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::Full;
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tower_service::Service;

use super::call::{Attempted, Call, Failure};
use super::policy::RetryPolicy;
use crate::frozen::{hand_over, refuse_nested_retry, CollectRequest, Handed, Handoff};
use crate::phase::{classify, FailurePhase};
use crate::{BoxError, Error};

pin_project! {
    /// The future of [`FrozenRetry`]: all attempts of one call.
    ///
    /// A state machine held in place (no allocation of its own): reading and freezing the
    /// body, then for each attempt waiting for the inner service, the attempt and its
    /// timeout, and the pause before the next one.
    pub struct ResponseFuture<S, B>
    where
        S: Service<Request<Full<Bytes>>>,
    {
        #[pin]
        attempts: Attempting<S, CollectRequest<B>, Head>,
    }
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<Full<Bytes>>>,
{
    #[inline(always)]
    pub(super) fn new(
        state: State<S::Future, CollectRequest<B>, Head>,
        inner: S,
        policy: Arc<RetryPolicy>,
    ) -> Self {
        Self {
            attempts: Attempting {
                state,
                inner,
                policy,
                call: None,
            },
        }
    }
}

/// A request's head and body as handed in, which its first attempt may be sent with (see
/// [`Handed`]).
type Head = (http::request::Parts, Bytes);

pin_project! {
    /// The attempts of one call: [`ResponseFuture`]'s state machine, and the future a
    /// client stack built as one drives for the frozen request it hands over
    /// ([`FrozenAttempts`]). `C` reads and freezes the request, `H` is the head its first
    /// attempt may be sent with as handed in; a stack hands over a request frozen already,
    /// so its future holds room for neither (see [`Never`]).
    pub(crate) struct Attempting<S, C, H>
    where
        S: Service<Request<Full<Bytes>>>,
    {
        #[pin]
        pub(super) state: State<S::Future, C, H>,
        // The instance the first attempt is sent on (the one `call` found ready), and
        // every later one.
        pub(super) inner: S,
        pub(super) policy: Arc<RetryPolicy>,
        // What the attempts share, once the request is frozen.
        pub(super) call: Option<Call>,
    }
}

/// The attempts of a request frozen already, as a client stack built as one hands it over
/// ([`FrozenRetry::send_frozen`](super::FrozenRetry)): nothing to read, no head kept
/// aside, so the future holds an attempt and its bookkeeping and no room for either. The
/// stack's operation future is 160 bytes smaller for it (704 rather than 864 over a
/// transport whose future is 16), and it is moved whole every time a caller moves it.
pub(crate) type FrozenAttempts<S> = Attempting<S, Never, Never>;

/// What a [`FrozenAttempts`] has none of: no request to read, no head kept aside.
pub(crate) enum Never {}

impl Future for Never {
    type Output = Result<Head, Error>;

    fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Self::Output> {
        match *self.get_mut() {}
    }
}

/// The head the first attempt may be sent with as it was handed in, if the attempts keep
/// one.
pub(crate) trait FirstHead: Sized {
    /// Kept, if these attempts keep one.
    fn kept(head: Head) -> Option<Self>;
    /// The head and body, to send.
    fn into_head(self) -> Head;
}

impl FirstHead for Head {
    #[inline(always)]
    fn kept(head: Head) -> Option<Self> {
        Some(head)
    }

    #[inline(always)]
    fn into_head(self) -> Head {
        self
    }
}

impl FirstHead for Never {
    fn kept(_: Head) -> Option<Self> {
        None
    }

    fn into_head(self) -> Head {
        match self {}
    }
}

pin_project! {
    #[project = StateProj]
    pub(super) enum State<F, C, H> {
        // The body says it is over the limit: nothing is read, nothing sent.
        Refused { error: Option<Error> },
        // Reading the body to freeze it.
        Freezing { #[pin] collect: C },
        // Waiting for the inner service to take the next attempt; the first one may be
        // sent as it was handed in (see `Handed`). Held here rather than in `Call`, so
        // that it shares its room with the body being read; a readiness failure drops
        // it, and the retry is rebuilt from the frozen request (the same bytes).
        Readying { first: Option<H> },
        // An attempt in flight, and its timeout when the policy sets one.
        Calling {
            #[pin]
            attempt: F,
            #[pin]
            timeout: Option<Sleep>,
        },
        // The pause before the next attempt.
        Pausing { #[pin] pause: Sleep },
        // The call's answer has been returned.
        Done,
    }
}

impl<S, B, ResBody> Future for ResponseFuture<S, B>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
{
    type Output = Result<Response<ResBody>, Error>;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.project().attempts.poll(cx)
    }
}

impl<S, C, H, ResBody> Future for Attempting<S, C, H>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    C: Future<Output = Result<Head, Error>>,
    H: FirstHead,
{
    type Output = Result<Response<ResBody>, Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            let failure = match this.state.as_mut().project() {
                StateProj::Refused { error } => {
                    let error = error
                        .take()
                        .expect("ResponseFuture polled after completion");
                    this.state.set(State::Done);
                    return Poll::Ready(Err(error));
                }
                StateProj::Freezing { collect } => match ready!(collect.poll(cx)) {
                    Ok((parts, body)) => {
                        let Handed {
                            frozen,
                            extensions,
                            handoff,
                            first,
                        } = hand_over(parts, body);
                        let refused = refuse_nested_retry(&extensions)
                            .and_then(|()| handoff.as_ref().map_or(Ok(()), Handoff::start_send));
                        if let Err(error) = refused {
                            this.state.set(State::Done);
                            return Poll::Ready(Err(error));
                        }
                        let mut first = first.and_then(H::kept);
                        let call =
                            this.call
                                .insert(Call::start(frozen, extensions, handoff, this.policy));
                        // Most services are ready at once: the first head then goes
                        // straight into its request, not through `Readying`.
                        match send_when_ready(this.inner, call, this.policy, &mut first, cx) {
                            Poll::Ready(Ok(calling)) => {
                                this.state.set(calling);
                                continue;
                            }
                            Poll::Ready(Err(failure)) => failure,
                            Poll::Pending => {
                                this.state.set(State::Readying { first });
                                return Poll::Pending;
                            }
                        }
                    }
                    Err(error) => {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(error));
                    }
                },
                StateProj::Readying { first } => {
                    let call = this.call.as_mut().expect("frozen before any attempt");
                    match ready!(send_when_ready(this.inner, call, this.policy, first, cx)) {
                        Ok(calling) => {
                            this.state.set(calling);
                            continue;
                        }
                        Err(failure) => failure,
                    }
                }
                StateProj::Calling { attempt, timeout } => match attempt.poll(cx) {
                    // An answer goes straight out, weighed where it stands: the common
                    // path moves it as little as it can.
                    Poll::Ready(Ok(response)) => {
                        let call = this.call.as_mut().expect("frozen before any attempt");
                        match call.after_attempt(this.policy, Attempted::Answered(&response)) {
                            Some(delay) => {
                                drop(response);
                                this.state.set(State::Pausing {
                                    pause: tokio::time::sleep(delay),
                                });
                                continue;
                            }
                            None => {
                                this.state.set(State::Done);
                                return Poll::Ready(Ok(call.answered(response)));
                            }
                        }
                    }
                    Poll::Ready(Err(err)) => {
                        let error: BoxError = err.into();
                        let phase = classify(&*error, this.policy.phase_classifier.as_deref());
                        Failure { error, phase }
                    }
                    Poll::Pending => match timeout.as_pin_mut().map(|timeout| timeout.poll(cx)) {
                        Some(Poll::Ready(())) => Failure {
                            error: Box::new(Error::attempt_timeout()),
                            phase: FailurePhase::Unknown,
                        },
                        _ => return Poll::Pending,
                    },
                },
                StateProj::Pausing { pause } => {
                    ready!(pause.poll(cx));
                    this.state.set(State::Readying { first: None });
                    continue;
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            };
            let call = this.call.as_mut().expect("frozen before any attempt");
            match call.after_attempt(this.policy, Attempted::<ResBody>::Failed(&failure)) {
                Some(delay) => this.state.set(State::Pausing {
                    pause: tokio::time::sleep(delay),
                }),
                None => {
                    this.state.set(State::Done);
                    return Poll::Ready(Err(call.failed(failure)));
                }
            }
        }
    }
}

impl<S, C, H> Attempting<S, C, H>
where
    S: Service<Request<Full<Bytes>>>,
{
    /// Once the call is over: whether an attempt before its last one may have reached the
    /// server (see [`Handoff`](crate::frozen::Handoff), which says the same to a layer
    /// stacked by hand).
    pub(crate) fn earlier_may_have_left(&self) -> bool {
        self.call.as_ref().is_some_and(Call::earlier_may_have_left)
    }
}

/// The state of an attempt started, or the failure of the readiness it waited for.
type NextAttempt<S, C, H> =
    Result<State<<S as Service<Request<Full<Bytes>>>>::Future, C, H>, Failure>;

/// Start the next attempt once `inner` is ready: the [`State::Calling`] of it, or the
/// failure of a readiness that failed (nothing has been sent then). `first` is the head
/// the first attempt may be sent with (see [`Call::next_request`]). Inlined into both
/// callers, so that the state it makes is built in place.
#[inline(always)]
pub(super) fn send_when_ready<S, C, H: FirstHead>(
    inner: &mut S,
    call: &mut Call,
    policy: &RetryPolicy,
    first: &mut Option<H>,
    cx: &mut Context<'_>,
) -> Poll<NextAttempt<S, C, H>>
where
    S: Service<Request<Full<Bytes>>>,
    S::Error: Into<BoxError>,
{
    let ready = ready!(inner.poll_ready(cx));
    call.attempt += 1;
    Poll::Ready(match ready {
        Ok(()) => Ok(State::Calling {
            attempt: inner.call(call.next_request(first.take().map(H::into_head))),
            timeout: policy.attempt_timeout.map(tokio::time::sleep),
        }),
        Err(err) => Err(Failure {
            error: err.into(),
            phase: FailurePhase::PreWrite,
        }),
    })
}

impl<S, B> fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<Full<Bytes>>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.attempts.fmt_as("ResponseFuture", f)
    }
}

impl<S, C, H> Attempting<S, C, H>
where
    S: Service<Request<Full<Bytes>>>,
{
    fn fmt_as(&self, name: &str, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Refused { .. } => "Refused",
            State::Freezing { .. } => "Freezing",
            State::Readying { .. } => "Readying",
            State::Calling { .. } => "Calling",
            State::Pausing { .. } => "Pausing",
            State::Done => "Done",
        };
        let attempt = self.call.as_ref().map_or(0, |call| call.attempt);
        f.debug_struct(name)
            .field("state", &state)
            .field("attempt", &attempt)
            .finish_non_exhaustive()
    }
}

impl<S, C, H> fmt::Debug for Attempting<S, C, H>
where
    S: Service<Request<Full<Bytes>>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.fmt_as("Attempting", f)
    }
}
