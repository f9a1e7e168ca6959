//! One call's retry state: its attempts, its backoff, and whether to go on.

use std::time::Duration;

use bytes::Bytes;
use http::{Extensions, Request, Response};
use http_body_util::Full;
use tokio::time::Instant;

use super::attempts::Attempts;
use super::backoff::{retry_after, FullJitter};
use super::policy::{AttemptResult, RetryContext, RetryDecision, RetryPolicy};
use crate::effect::EffectClass;
use crate::frozen::{FrozenRequest, Handoff, OperationAttempt, RetriedOutside};
use crate::key::KeyHeader;
use crate::phase::FailurePhase;
use crate::OperationId;
use crate::{BoxError, Error};

/// What the attempts of one call share.
pub(super) struct Call {
    /// What every attempt is rebuilt from.
    frozen: FrozenRequest,
    /// The request's extensions, given to every attempt.
    extensions: Extensions,
    effect: EffectClass,
    handoff: Option<Handoff>,
    key_honoured: bool,
    /// The header a key travels under, as the idempotency layer outside sends it; `None`:
    /// the policy's (the retry layer used alone).
    key_header: Option<KeyHeader>,
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
    pub(super) attempt: u32,
}

impl Call {
    /// What the attempts of `frozen` share, with the request's `extensions` and what an
    /// idempotency layer outside handed on.
    pub(super) fn start(
        frozen: FrozenRequest,
        extensions: Extensions,
        handoff: Option<Handoff>,
        policy: &RetryPolicy,
    ) -> Self {
        if let Some(handoff) = &handoff {
            handoff.report_retry_window(policy.retry_window());
        }
        let key_honoured = !handoff.as_ref().is_some_and(Handoff::key_ignored);
        let key_header = handoff.as_ref().map(|handoff| handoff.key_header().clone());
        let mut call = Self::handed(frozen, extensions, key_honoured, key_header, policy);
        if handoff.is_some() {
            // Our attempts are the operation's: a retry layer under us must not retry
            // them. The map already holds room (the hand-off was in it), and the marker
            // is zero-sized: no allocation, none in each attempt's copy.
            call.extensions.insert(OperationAttempt);
        } else if call.effect.is_side_effect() && call.extensions.get::<OperationId>().is_some() {
            // An operation no idempotency layer handed us: one may sit inside us, wrongly.
            call.extensions.insert(RetriedOutside);
        }
        call.handoff = handoff;
        call
    }

    /// What the attempts of `frozen` share when the client layer of a stack built as one
    /// hands it over directly (see [`FrozenRetry::send_frozen`](super::FrozenRetry)): no
    /// hand-off to find, nothing to report, nobody to warn.
    #[inline(always)]
    pub(super) fn handed(
        frozen: FrozenRequest,
        extensions: Extensions,
        key_honoured: bool,
        key_header: Option<KeyHeader>,
        policy: &RetryPolicy,
    ) -> Self {
        let effect = EffectClass::resolve(frozen.method(), &extensions);
        // One clock read: the deadline starts here, and the budget's window is read by it.
        let started = Instant::now();
        if let Some(budget) = &policy.budget {
            budget.deposit_at(started);
        }
        Self {
            frozen,
            extensions,
            effect,
            handoff: None,
            key_honoured,
            key_header,
            furthest: FailurePhase::PreWrite,
            earlier: FailurePhase::PreWrite,
            started,
            backoff: None,
            attempt: 0,
        }
    }

    /// Once the call is over: whether an attempt before its last one may have reached the
    /// server. (The last one speaks for itself: an answer came from the server, a failure
    /// carries its phase.)
    pub(super) fn earlier_may_have_left(&self) -> bool {
        self.earlier.may_have_been_sent()
    }

    /// The next attempt: exactly the frozen bytes. The head as handed in is the frozen
    /// one: sent as it is, it saves a copy of it.
    #[inline(always)]
    pub(super) fn next_request(
        &self,
        first: Option<(http::request::Parts, Bytes)>,
    ) -> Request<Full<Bytes>> {
        match first {
            Some((mut parts, body)) => {
                parts.extensions = self.extensions.clone();
                Request::from_parts(parts, Full::new(body))
            }
            None => self.frozen.to_request_with(self.extensions.clone()),
        }
    }

    /// Weigh an attempt's result: the pause before the next attempt, or `None` when the
    /// result is the call's answer ([`answered`](Self::answered), [`failed`](Self::failed)).
    /// By reference, so that the response is not moved through here on its way out.
    pub(super) fn after_attempt<T>(
        &mut self,
        policy: &RetryPolicy,
        result: Attempted<'_, T>,
    ) -> Option<Duration> {
        let reached = match result {
            Attempted::Answered(_) => FailurePhase::AfterWrite,
            Attempted::Failed(failure) => failure.phase,
        };
        self.earlier = self.furthest;
        self.furthest = self.furthest.strongest(reached);
        if let Attempted::Failed(failure) = result {
            if failure.is_refusal() {
                // A layer of ours inside refused the request for what it is or how the
                // stack is built: every retry would be refused the same way.
                return None;
            }
        }
        let attempt = self.attempt;
        let key_header = self.key_header.as_ref().unwrap_or(&policy.key_header);
        let delay = match result {
            Attempted::Answered(response) => {
                let ctx = context(
                    &self.frozen,
                    self.effect,
                    (self.key_honoured, key_header),
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
            Attempted::Failed(failure) => {
                let ctx = context(
                    &self.frozen,
                    self.effect,
                    (self.key_honoured, key_header),
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
            // Another attempt follows one that may have left: the idempotency layer outside
            // must not take the last one's word that nothing ran. (The last attempt's own
            // answer or failure reaches it as it is; a `401` to an operation's only
            // attempt releases it.)
            if reached.may_have_been_sent() {
                if let Some(handoff) = &self.handoff {
                    handoff.attempt_may_have_left();
                }
            }
        }
        delay
    }

    /// The call's answer, a response, once [`after_attempt`](Self::after_attempt) has
    /// weighed it and returned `None`.
    #[inline]
    pub(super) fn answered<T>(&self, mut response: Response<T>) -> Response<T> {
        // A first-attempt answer carries nothing: an extension costs the response three
        // allocations (`http::Extensions`' map, its table and the boxed value), more than
        // the rest of the layer's bookkeeping.
        if self.attempt > 1 {
            response.extensions_mut().insert(Attempts(self.attempt));
        }
        if let Some(handoff) = &self.handoff {
            handoff.first_send_ended(FailurePhase::AfterWrite);
        }
        response
    }

    /// The call's error, once [`after_attempt`](Self::after_attempt) has weighed the
    /// failure and returned `None` (which is when it sets `earlier`).
    pub(super) fn failed(&self, failure: Failure) -> Error {
        if let Some(handoff) = &self.handoff {
            handoff.first_send_ended(failure.phase.strongest(self.earlier));
        }
        failure.into_error(self.earlier)
    }
}

/// An attempt's result, as [`Call::after_attempt`] weighs it.
pub(super) enum Attempted<'a, T> {
    Answered(&'a Response<T>),
    Failed(&'a Failure),
}

impl<T> Clone for Attempted<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for Attempted<'_, T> {}

/// A failed attempt: the error, and whether the request may have left.
pub(super) struct Failure {
    pub(super) error: BoxError,
    pub(super) phase: FailurePhase,
}

impl Failure {
    /// A layer of ours inside refused the request before sending any of it.
    fn is_refusal(&self) -> bool {
        Error::find(&*self.error).is_some_and(Error::refused_before_sending)
    }

    /// The call's error; `earlier` is the furthest an earlier attempt may have got.
    fn into_error(self, earlier: FailurePhase) -> Error {
        let error = match self.error.downcast::<Error>() {
            Ok(ours) => *ours,
            Err(other) => Error::inner(other, self.phase),
        };
        error.after_earlier_attempts(earlier)
    }
}

pub(super) fn context<'a>(
    request: &'a FrozenRequest,
    effect: EffectClass,
    (key_honoured, key_header): (bool, &'a KeyHeader),
    attempt: u32,
    result: AttemptResult<'a>,
) -> RetryContext<'a> {
    RetryContext {
        request,
        effect,
        key_honoured,
        key_header,
        attempt,
        result,
    }
}

/// The delay before the next attempt, or `None` to stop here.
///
/// `server_asked` reads the server's `Retry-After`; it is only called once the classifier
/// wants a retry, so a final answer (most answers) costs no header parsing.
pub(super) fn next_delay(
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
        if !budget.withdraw_at(now) {
            tracing::debug!("retry budget exhausted; not retrying");
            return None;
        }
    }
    Some(delay)
}

/// Whether an attempt `delay` from `now` would start more than the policy's maximum elapsed
/// time after the call `started` (in durations, so absurd settings cannot overflow).
pub(super) fn starts_past(
    policy: &RetryPolicy,
    started: Instant,
    now: Instant,
    delay: Duration,
) -> bool {
    policy
        .max_elapsed
        .checked_sub(now.saturating_duration_since(started))
        .is_none_or(|left| delay > left)
}
