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
use crate::frozen::{hand_over, CollectRequest, Handed};
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
        pub(super) state: State<S::Future, B>,
        // The instance the first attempt is sent on (the one `call` found ready), and
        // every later one.
        pub(super) inner: S,
        pub(super) policy: Arc<RetryPolicy>,
        // What the attempts share, once the request is frozen.
        pub(super) call: Option<Call>,
    }
}

pin_project! {
    #[project = StateProj]
    pub(super) enum State<F, B> {
        // The body says it is over the limit: nothing is read, nothing sent.
        Refused { error: Option<Error> },
        // Reading the body to freeze it.
        Freezing { #[pin] collect: CollectRequest<B> },
        // Waiting for the inner service to take the next attempt; the first one may be
        // sent as it was handed in (see `Handed`). Held here rather than in `Call`, so
        // that it shares its room with the body being read; a readiness failure drops
        // it, and the retry is rebuilt from the frozen request (the same bytes).
        Readying { first: Option<(http::request::Parts, Bytes)> },
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
                            mut first,
                        } = hand_over(parts, body);
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

impl<S, B> ResponseFuture<S, B>
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

/// Start the next attempt once `inner` is ready: the [`State::Calling`] of it, or the
/// failure of a readiness that failed (nothing has been sent then). `first` is the head
/// the first attempt may be sent with (see [`Call::next_request`]). Inlined into both
/// callers, so that the state it makes is built in place.
#[inline(always)]
pub(super) fn send_when_ready<S, B>(
    inner: &mut S,
    call: &mut Call,
    policy: &RetryPolicy,
    first: &mut Option<(http::request::Parts, Bytes)>,
    cx: &mut Context<'_>,
) -> Poll<Result<State<S::Future, B>, Failure>>
where
    S: Service<Request<Full<Bytes>>>,
    S::Error: Into<BoxError>,
{
    let ready = ready!(inner.poll_ready(cx));
    call.attempt += 1;
    Poll::Ready(match ready {
        Ok(()) => Ok(State::Calling {
            attempt: inner.call(call.next_request(first.take())),
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
        let state = match &self.state {
            State::Refused { .. } => "Refused",
            State::Freezing { .. } => "Freezing",
            State::Readying { .. } => "Readying",
            State::Calling { .. } => "Calling",
            State::Pausing { .. } => "Pausing",
            State::Done => "Done",
        };
        let attempt = self.call.as_ref().map_or(0, |call| call.attempt);
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .field("attempt", &attempt)
            .finish_non_exhaustive()
    }
}
