use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Extensions, Request, Response};
use http_body::Body;
use http_body_util::Full;
use tokio::time::Instant;
use tower::retry::budget::Budget;
use tower::ServiceExt;
use tower_service::Service;

use super::backoff::{retry_after, FullJitter};
use super::policy::{AttemptResult, RetryContext, RetryDecision, RetryPolicy};
use super::FrozenRetryLayer;
use crate::effect::EffectClass;
use crate::frozen::{freeze_handed, FrozenRequest, Handed, Handoff, RetriedOutside};
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
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    ResBody: Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = Error;
    type Future = ResponseFuture<ResBody>;

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
        ResponseFuture {
            inner: Box::pin(run(inner, self.policy.clone(), req)),
        }
    }
}

/// The future of [`FrozenRetry`]: all attempts of one call.
pub struct ResponseFuture<T> {
    inner: Pin<Box<dyn Future<Output = Result<Response<T>, Error>> + Send>>,
}

impl<T> Future for ResponseFuture<T> {
    type Output = Result<Response<T>, Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<T> fmt::Debug for ResponseFuture<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
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

async fn run<S, B, ResBody>(
    mut inner: S,
    policy: Arc<RetryPolicy>,
    req: Request<B>,
) -> Result<Response<ResBody>, Error>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
{
    let Handed {
        frozen,
        mut extensions,
        mut first,
    } = freeze_handed(req, policy.body_limit).await?;
    let effect = EffectClass::resolve(frozen.method(), &extensions);
    let handoff = extensions.get::<Handoff>().cloned();
    if handoff.is_none() && effect.is_side_effect() && extensions.get::<OperationId>().is_some() {
        // An operation no idempotency layer handed us: one may sit inside us, wrongly.
        extensions.insert(RetriedOutside);
    }
    if let Some(handoff) = &handoff {
        handoff.report_retry_window(policy.retry_window());
    }
    let key_honoured = !handoff.as_ref().is_some_and(Handoff::key_ignored);
    // How far any attempt so far may have got: once one may have been sent, the call may
    // have been, whatever later attempts did.
    let mut furthest = FailurePhase::PreWrite;
    if let Some(budget) = &policy.budget {
        budget.deposit();
    }
    // The deadline is `max_elapsed` after this; it is only worked out when a retry is
    // considered.
    let started = Instant::now();
    // Made on the first retry: most calls never need one.
    let mut backoff: Option<FullJitter> = None;
    let mut attempt = 0;
    loop {
        attempt += 1;
        let result = send_once(&mut inner, &policy, &frozen, first.take(), &extensions).await;
        let reached = match &result {
            Ok(_) => FailurePhase::AfterWrite,
            Err(failure) => failure.phase,
        };
        if reached.may_have_been_sent() {
            if let Some(handoff) = &handoff {
                handoff.attempt_may_have_left();
            }
        }
        let earlier = furthest;
        furthest = furthest.strongest(reached);
        let delay = match &result {
            Ok(response) => {
                let ctx = context(
                    &frozen,
                    effect,
                    key_honoured,
                    attempt,
                    AttemptResult::Response {
                        status: response.status(),
                        headers: response.headers(),
                    },
                );
                tracing::debug!(attempt, status = %response.status(), "attempt answered");
                next_delay(
                    &policy,
                    &ctx,
                    &mut backoff,
                    || retry_after(response.headers()),
                    started,
                )
            }
            Err(failure) => {
                let ctx = context(
                    &frozen,
                    effect,
                    key_honoured,
                    attempt,
                    AttemptResult::Error {
                        phase: failure.phase,
                        error: &*failure.error,
                    },
                );
                tracing::debug!(attempt, phase = ?failure.phase, error = %failure.error, "attempt failed");
                next_delay(&policy, &ctx, &mut backoff, || None, started)
            }
        };
        match delay {
            Some(delay) => {
                tracing::debug!(attempt, ?delay, "retrying with the frozen request");
                tokio::time::sleep(delay).await;
            }
            None => {
                return match result {
                    Ok(mut response) => {
                        // A first-attempt answer carries nothing: an extension costs the
                        // response three allocations (`http::Extensions`' map, its table and
                        // the boxed value), more than the rest of the layer's bookkeeping.
                        if attempt > 1 {
                            response.extensions_mut().insert(Attempts(attempt));
                        }
                        Ok(response)
                    }
                    Err(failure) => Err(failure.into_error(earlier)),
                };
            }
        }
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

/// Send one attempt of exactly the frozen bytes.
async fn send_once<S, ResBody>(
    inner: &mut S,
    policy: &RetryPolicy,
    frozen: &FrozenRequest,
    handed: Option<(http::request::Parts, Bytes)>,
    extensions: &Extensions,
) -> Result<Response<ResBody>, Failure>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
{
    let ready = inner.ready().await.map_err(|err| Failure {
        error: err.into(),
        phase: FailurePhase::PreWrite,
    })?;
    // The head as handed in is the frozen one: sent as it is, it saves a copy of it.
    let req = match handed {
        Some((mut parts, body)) => {
            parts.extensions = extensions.clone();
            Request::from_parts(parts, Full::new(body))
        }
        None => frozen.to_request_with(extensions.clone()),
    };
    let call = ready.call(req);
    let outcome = match policy.attempt_timeout {
        Some(limit) => match tokio::time::timeout(limit, call).await {
            Ok(outcome) => outcome,
            Err(_elapsed) => {
                return Err(Failure {
                    error: Box::new(Error::attempt_timeout()),
                    phase: FailurePhase::Unknown,
                })
            }
        },
        None => call.await,
    };
    outcome.map_err(|err| {
        let error: BoxError = err.into();
        let phase = classify(&*error, policy.phase_classifier.as_deref());
        Failure { error, phase }
    })
}

/// The delay before the next attempt, or `None` to stop here.
///
/// `server_asked` reads the server's `Retry-After`; it is only called once the classifier
/// wants a retry, so a final answer (most answers) costs no header parsing.
fn next_delay(
    policy: &RetryPolicy,
    ctx: &RetryContext<'_>,
    backoff: &mut Option<FullJitter>,
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
        .get_or_insert_with(|| FullJitter::new(policy.backoff_base, policy.backoff_cap))
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
