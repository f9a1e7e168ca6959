use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Extensions, Request, Response};
use http_body::Body;
use http_body_util::Full;
use pin_project_lite::pin_project;
use tokio::time::{Instant, Sleep};
use tower::retry::budget::Budget;
use tower_service::Service;

use super::backoff::{retry_after, FullJitter};
use super::policy::{AttemptResult, RetryContext, RetryDecision, RetryPolicy};
use super::FrozenRetryLayer;
use crate::effect::EffectClass;
use crate::frozen::{hand_over, CollectRequest, FrozenRequest, Handed, Handoff, RetriedOutside};
use crate::key::OperationId;
use crate::phase::{classify, FailurePhase};
use crate::{BoxError, Error};

/// Resends the exact frozen bytes of a request on retry. See the [module docs](crate::retry).
#[derive(Clone, Debug)]
pub struct FrozenRetry<S> {
    inner: S,
    policy: Arc<RetryPolicy>,
}

impl<S> FrozenRetry<S> {
    /// Wrap `inner` with `policy`.
    pub fn new(inner: S, policy: RetryPolicy) -> Self {
        Self {
            inner,
            policy: Arc::new(policy),
        }
    }

    pub(crate) fn from_shared(inner: S, policy: Arc<RetryPolicy>) -> Self {
        Self { inner, policy }
    }

    /// A layer wrapping services with `policy`.
    pub fn layer(policy: RetryPolicy) -> FrozenRetryLayer {
        FrozenRetryLayer::new(policy)
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwrap the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

/// How many attempts produced a response: a response extension set by [`FrozenRetry`] on
/// the answers that took **more than one** attempt.
///
/// A response answered by its first attempt carries no `Attempts` (an extension costs every
/// response three allocations, more than the rest of the layer's work on the common path);
/// [`Attempts::of`] reads either kind.
///
/// ```
/// # use tower_idempotency::retry::Attempts;
/// let attempts = Attempts::new(2);
/// assert_eq!(attempts.get(), 2);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attempts(u32);

impl Attempts {
    /// `n` attempts.
    pub const fn new(n: u32) -> Self {
        Self(n)
    }

    /// The number of attempts made, the first included.
    pub const fn get(self) -> u32 {
        self.0
    }

    /// How many attempts produced `response`: its `Attempts` extension, or one attempt when
    /// it carries none (a first-attempt answer, or one that did not pass a [`FrozenRetry`]).
    ///
    /// ```
    /// use tower_idempotency::retry::Attempts;
    ///
    /// let mut response = http::Response::new(());
    /// assert_eq!(Attempts::of(&response), Attempts::new(1));
    /// response.extensions_mut().insert(Attempts::new(3));
    /// assert_eq!(Attempts::of(&response).get(), 3);
    /// ```
    pub fn of<B>(response: &Response<B>) -> Self {
        response
            .extensions()
            .get::<Self>()
            .copied()
            .unwrap_or(Self(1))
    }
}

impl<S, B, ResBody> Service<Request<B>> for FrozenRetry<S>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>> + Clone,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
{
    type Response = Response<ResBody>;
    type Error = Error;
    type Future = ResponseFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Nothing has been sent when readiness fails.
        self.inner
            .poll_ready(cx)
            .map_err(|err| Error::inner(err.into(), FailurePhase::PreWrite))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // Take the instance that was driven to readiness; leave a clone in its place.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let state = match CollectRequest::new(req, self.policy.body_limit) {
            Ok(collect) => State::Freezing { collect },
            Err(error) => State::Refused { error: Some(error) },
        };
        ResponseFuture {
            state,
            inner,
            policy: self.policy.clone(),
            call: None,
        }
    }
}

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
        state: State<S::Future, B>,
        // The instance the first attempt is sent on (the one `call` found ready), and
        // every later one.
        inner: S,
        policy: Arc<RetryPolicy>,
        // What the attempts share, once the request is frozen.
        call: Option<Call>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, B> {
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

/// What the attempts of one call share.
struct Call {
    /// What every attempt is rebuilt from.
    frozen: FrozenRequest,
    /// The request's extensions, given to every attempt.
    extensions: Extensions,
    effect: EffectClass,
    handoff: Option<Handoff>,
    key_honoured: bool,
    /// How far any attempt so far may have got: once one may have been sent, the call may
    /// have been, whatever later attempts did.
    furthest: FailurePhase,
    /// How far the attempts before the last one may have got.
    earlier: FailurePhase,
    /// The deadline is `max_elapsed` after this; it is only worked out when a retry is
    /// considered.
    started: Instant,
    /// Made on the first retry: most calls never need one (boxed, so that calls that
    /// never retry carry none of its room).
    backoff: Option<Box<FullJitter>>,
    /// Attempts started so far.
    attempt: u32,
}

impl Call {
    /// What the attempts of `frozen` share, with the request's `extensions`.
    fn start(frozen: FrozenRequest, mut extensions: Extensions, policy: &RetryPolicy) -> Self {
        let effect = EffectClass::resolve(frozen.method(), &extensions);
        let handoff = extensions.get::<Handoff>().cloned();
        if handoff.is_none() && effect.is_side_effect() && extensions.get::<OperationId>().is_some()
        {
            // An operation no idempotency layer handed us: one may sit inside us, wrongly.
            extensions.insert(RetriedOutside);
        }
        if let Some(handoff) = &handoff {
            handoff.report_retry_window(policy.retry_window());
        }
        let key_honoured = !handoff.as_ref().is_some_and(Handoff::key_ignored);
        if let Some(budget) = &policy.budget {
            budget.deposit();
        }
        Self {
            frozen,
            extensions,
            effect,
            handoff,
            key_honoured,
            furthest: FailurePhase::PreWrite,
            earlier: FailurePhase::PreWrite,
            started: Instant::now(),
            backoff: None,
            attempt: 0,
        }
    }

    /// The next attempt: exactly the frozen bytes. The head as handed in is the frozen
    /// one: sent as it is, it saves a copy of it.
    fn next_request(&self, first: Option<(http::request::Parts, Bytes)>) -> Request<Full<Bytes>> {
        match first {
            Some((mut parts, body)) => {
                parts.extensions = self.extensions.clone();
                Request::from_parts(parts, Full::new(body))
            }
            None => self.frozen.to_request_with(self.extensions.clone()),
        }
    }

    /// Weigh an attempt's result: the pause before the next attempt, or `None` when the
    /// result is the call's answer ([`answer`](Self::answer)). By reference, so that the
    /// response is not moved through here on its way out.
    fn after_attempt<T>(
        &mut self,
        policy: &RetryPolicy,
        result: &Result<Response<T>, Failure>,
    ) -> Option<Duration> {
        let reached = match result {
            Ok(_) => FailurePhase::AfterWrite,
            Err(failure) => failure.phase,
        };
        if reached.may_have_been_sent() {
            if let Some(handoff) = &self.handoff {
                handoff.attempt_may_have_left();
            }
        }
        self.earlier = self.furthest;
        self.furthest = self.furthest.strongest(reached);
        let attempt = self.attempt;
        let delay = match result {
            Ok(response) => {
                let ctx = context(
                    &self.frozen,
                    self.effect,
                    self.key_honoured,
                    attempt,
                    AttemptResult::Response {
                        status: response.status(),
                        headers: response.headers(),
                    },
                );
                tracing::debug!(attempt, status = %response.status(), "attempt answered");
                next_delay(
                    policy,
                    &ctx,
                    &mut self.backoff,
                    || retry_after(response.headers()),
                    self.started,
                )
            }
            Err(failure) => {
                let ctx = context(
                    &self.frozen,
                    self.effect,
                    self.key_honoured,
                    attempt,
                    AttemptResult::Error {
                        phase: failure.phase,
                        error: &*failure.error,
                    },
                );
                tracing::debug!(attempt, phase = ?failure.phase, error = %failure.error, "attempt failed");
                next_delay(policy, &ctx, &mut self.backoff, || None, self.started)
            }
        };
        if let Some(delay) = delay {
            tracing::debug!(attempt, ?delay, "retrying with the frozen request");
        }
        delay
    }

    /// The call's answer: the last attempt's result, once [`after_attempt`](Self::after_attempt)
    /// has weighed it and returned `None` (which is when it sets `earlier`).
    fn answer<T>(&self, result: Result<Response<T>, Failure>) -> Result<Response<T>, Error> {
        match result {
            Ok(mut response) => {
                // A first-attempt answer carries nothing: an extension costs the response
                // three allocations (`http::Extensions`' map, its table and the boxed
                // value), more than the rest of the layer's bookkeeping.
                if self.attempt > 1 {
                    response.extensions_mut().insert(Attempts(self.attempt));
                }
                Ok(response)
            }
            Err(failure) => Err(failure.into_error(self.earlier)),
        }
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
            let result = match this.state.as_mut().project() {
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
                            mut first,
                        } = hand_over(parts, body);
                        let call = this
                            .call
                            .insert(Call::start(frozen, extensions, this.policy));
                        // Most services are ready at once: the first head then goes
                        // straight into its request, not through `Readying`.
                        match send_when_ready(this.inner, call, this.policy, &mut first, cx) {
                            Poll::Ready(Ok(calling)) => {
                                this.state.set(calling);
                                continue;
                            }
                            Poll::Ready(Err(failure)) => Err(failure),
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
                        Err(failure) => Err(failure),
                    }
                }
                StateProj::Calling { attempt, timeout } => match attempt.poll(cx) {
                    Poll::Ready(outcome) => outcome.map_err(|err| {
                        let error: BoxError = err.into();
                        let phase = classify(&*error, this.policy.phase_classifier.as_deref());
                        Failure { error, phase }
                    }),
                    Poll::Pending => match timeout.as_pin_mut().map(|timeout| timeout.poll(cx)) {
                        Some(Poll::Ready(())) => Err(Failure {
                            error: Box::new(Error::attempt_timeout()),
                            phase: FailurePhase::Unknown,
                        }),
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
            match call.after_attempt(this.policy, &result) {
                Some(delay) => this.state.set(State::Pausing {
                    pause: tokio::time::sleep(delay),
                }),
                None => {
                    this.state.set(State::Done);
                    return Poll::Ready(call.answer(result));
                }
            }
        }
    }
}

/// Start the next attempt once `inner` is ready: the [`State::Calling`] of it, or the
/// failure of a readiness that failed (nothing has been sent then). `first` is the head
/// the first attempt may be sent with (see [`Call::next_request`]). Inlined into both
/// callers, so that the state it makes is built in place.
#[inline(always)]
fn send_when_ready<S, B>(
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

/// A failed attempt: the error, and whether the request may have left.
struct Failure {
    error: BoxError,
    phase: FailurePhase,
}

impl Failure {
    /// The call's error; `earlier` is the furthest an earlier attempt may have got.
    fn into_error(self, earlier: FailurePhase) -> Error {
        let error = match self.error.downcast::<Error>() {
            Ok(ours) => *ours,
            Err(other) => Error::inner(other, self.phase),
        };
        error.after_earlier_attempts(earlier)
    }
}

fn context<'a>(
    request: &'a FrozenRequest,
    effect: EffectClass,
    key_honoured: bool,
    attempt: u32,
    result: AttemptResult<'a>,
) -> RetryContext<'a> {
    RetryContext {
        request,
        effect,
        key_honoured,
        attempt,
        result,
    }
}

/// The delay before the next attempt, or `None` to stop here.
///
/// `server_asked` reads the server's `Retry-After`; it is only called once the classifier
/// wants a retry, so a final answer (most answers) costs no header parsing.
fn next_delay(
    policy: &RetryPolicy,
    ctx: &RetryContext<'_>,
    backoff: &mut Option<Box<FullJitter>>,
    server_asked: impl FnOnce() -> Option<Duration>,
    started: Instant,
) -> Option<Duration> {
    if ctx.attempt >= policy.max_attempts || policy.classifier.classify(ctx) == RetryDecision::Stop
    {
        return None;
    }
    let server_asked = server_asked();
    let now = Instant::now();
    // A server that asks us to come back after our deadline gets its answer now.
    if let Some(asked) = server_asked.filter(|asked| starts_past(policy, started, now, *asked)) {
        tracing::debug!(?asked, "Retry-After points past the deadline; not retrying");
        return None;
    }
    let backoff = backoff
        .get_or_insert_with(|| Box::new(FullJitter::new(policy.backoff_base, policy.backoff_cap)))
        .next_delay();
    // `Retry-After` may lengthen the pause (up to the cap), never shorten it: a `0` or a
    // date in the past would otherwise turn the retries into a burst.
    let delay = match server_asked {
        Some(asked) => backoff.max(asked.min(policy.backoff_cap)),
        None => backoff,
    };
    if starts_past(policy, started, now, delay) {
        tracing::debug!("the next retry would start past the deadline; not retrying");
        return None;
    }
    if let Some(budget) = &policy.budget {
        if !budget.withdraw() {
            tracing::debug!("retry budget exhausted; not retrying");
            return None;
        }
    }
    Some(delay)
}

/// Whether an attempt `delay` from `now` would start more than the policy's maximum elapsed
/// time after the call `started` (in durations, so absurd settings cannot overflow).
fn starts_past(policy: &RetryPolicy, started: Instant, now: Instant, delay: Duration) -> bool {
    policy
        .max_elapsed
        .checked_sub(now.saturating_duration_since(started))
        .is_none_or(|left| delay > left)
}
