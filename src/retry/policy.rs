//! What to retry: the classifier, and the policy that bundles every retry setting.

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, StatusCode};
use tower::retry::budget::TpsBudget;

use super::budget::{RetryBudget, Windowed};

use crate::effect::EffectClass;
use crate::frozen::{FrozenRequest, DEFAULT_BODY_LIMIT};
use crate::key::KeyHeader;
use crate::phase::{ClassifyPhase, FailurePhase};

/// The default number of attempts (the first one included).
pub(crate) const DEFAULT_MAX_ATTEMPTS: u32 = 3;
/// No policy makes more attempts than this: beyond it, retries amplify outages.
pub(crate) const MAX_ATTEMPTS_CEILING: u32 = 5;
/// The default first backoff ceiling.
pub(crate) const DEFAULT_BACKOFF_BASE: Duration = Duration::from_millis(100);
/// The default longest backoff (and cap on `Retry-After`).
pub(crate) const DEFAULT_BACKOFF_CAP: Duration = Duration::from_secs(10);
/// The default longest time from the first attempt to the last retry.
pub(crate) const DEFAULT_MAX_ELAPSED: Duration = Duration::from_secs(30);

/// One finished attempt, as a classifier sees it.
#[derive(Debug)]
#[non_exhaustive]
pub enum AttemptResult<'a> {
    /// The inner service answered.
    Response {
        /// The response status.
        status: StatusCode,
        /// The response headers.
        headers: &'a HeaderMap,
    },
    /// The inner service failed (or the attempt timed out).
    Error {
        /// Whether the request may have left.
        phase: FailurePhase,
        /// The error.
        error: &'a (dyn StdError + Send + Sync + 'static),
    },
}

/// What a classifier is told about an attempt.
#[derive(Debug)]
#[non_exhaustive]
pub struct RetryContext<'a> {
    /// The request, as frozen: every attempt sends exactly this.
    pub request: &'a FrozenRequest,
    /// The request's effect class (its extension override, else its method's default).
    pub effect: EffectClass,
    /// The attempt just made, from 1.
    pub attempt: u32,
    /// Whether the server is known to deduplicate on `Idempotency-Key` (`false` when the
    /// client [`IdempotencyLayer`](crate::IdempotencyLayer) was told it does not).
    pub key_honoured: bool,
    /// The header a keyed request carries its key under (the client
    /// [`IdempotencyLayer`](crate::IdempotencyLayer)'s
    /// [`key_header`](crate::client::Builder::key_header) when one hands the request on,
    /// else the policy's [`key_header`](RetryPolicyBuilder::key_header)).
    pub key_header: &'a KeyHeader,
    /// How it ended.
    pub result: AttemptResult<'a>,
}

impl RetryContext<'_> {
    /// Whether resending is harmless: a read or idempotent write, or a request carrying a
    /// key (under [`key_header`](Self::key_header)) the server can deduplicate on.
    pub fn is_retry_safe(&self) -> bool {
        !self.effect.is_side_effect() || (self.key_honoured && self.is_keyed())
    }

    /// Whether the request carries a key under [`key_header`](Self::key_header).
    pub fn is_keyed(&self) -> bool {
        self.key_header.is_carried_by(self.request.headers())
    }
}

/// Whether to make another attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetryDecision {
    /// Retry (subject to attempts, budget, backoff and deadline).
    Retry,
    /// Return this result to the caller.
    Stop,
}

/// Decides which attempts are retried. Replace the [`DefaultClassifier`] with your own
/// through [`RetryPolicyBuilder::classifier`].
///
/// ```
/// use tower_idempotency::retry::{AttemptResult, ClassifyRetry, RetryContext, RetryDecision};
///
/// /// Retry only 503s.
/// #[derive(Debug)]
/// struct OnlyUnavailable;
/// impl ClassifyRetry for OnlyUnavailable {
///     fn classify(&self, ctx: &RetryContext<'_>) -> RetryDecision {
///         match ctx.result {
///             AttemptResult::Response { status, .. } if status == 503 => RetryDecision::Retry,
///             _ => RetryDecision::Stop,
///         }
///     }
/// }
/// # let _ = OnlyUnavailable;
/// ```
pub trait ClassifyRetry: Send + Sync + fmt::Debug + 'static {
    /// Decide about one finished attempt.
    fn classify(&self, ctx: &RetryContext<'_>) -> RetryDecision;
}

/// The default retry rules: retry what cannot cause a second effect, and nothing else.
///
/// - A failure proven to happen **before the write** is always retried: nothing left.
/// - A `408`, `429`, `500`, `502`, `503` or `504`, a `409` with `Retry-After` to a keyed
///   request (the IETF draft's "still in progress"), or a failure after the request may have
///   left (timeout, reset, unknown), is retried **only when the request is retry-safe**:
///   a read or idempotent write, or a request carrying a key under the
///   [key header](RetryContext::key_header) (`Idempotency-Key` unless configured). A
///   side-effecting request without a key is never resent once its bytes may have left.
/// - Everything else (`2xx`, `3xx`, `400`, `401`, `403`, `404`, `422`, a `409` without
///   `Retry-After`…) is final to the retry layer, which judges an attempt by its head. (A
///   `409` whose body says the key is in use is still no outcome to the client
///   [`IdempotencyLayer`](crate::IdempotencyLayer): see the
///   [client docs](crate::client#a-providers-409).)
///
/// ```
/// use tower_idempotency::retry::{DefaultClassifier, ClassifyRetry};
/// # let _ = DefaultClassifier;
/// ```
#[derive(Clone, Copy, Debug, Default)]
pub struct DefaultClassifier;

/// The IETF draft's answer to a key whose first request is still being processed: `409`
/// with `Retry-After`. Only a keyed request can receive it, and it asks to come back.
fn is_in_progress(status: StatusCode, headers: &HeaderMap, ctx: &RetryContext<'_>) -> bool {
    is_in_progress_answer(status, headers) && ctx.is_keyed()
}

/// A `409` that says "the first request with this key is still in progress, come back":
/// the IETF draft's answer carries `Retry-After`. Any other `409` ("order already exists")
/// is a final business answer.
pub(crate) fn is_in_progress_answer(status: StatusCode, headers: &HeaderMap) -> bool {
    status == StatusCode::CONFLICT && headers.contains_key(http::header::RETRY_AFTER)
}

/// Statuses that mean "try again later" rather than "no".
pub(crate) fn is_retryable_status(status: StatusCode) -> bool {
    matches!(status.as_u16(), 408 | 429 | 500 | 502 | 503 | 504)
}

impl ClassifyRetry for DefaultClassifier {
    fn classify(&self, ctx: &RetryContext<'_>) -> RetryDecision {
        let retry = match ctx.result {
            AttemptResult::Error {
                phase: FailurePhase::PreWrite,
                ..
            } => true,
            AttemptResult::Error { .. } => ctx.is_retry_safe(),
            AttemptResult::Response { status, headers } => {
                (is_retryable_status(status) || is_in_progress(status, headers, ctx))
                    && ctx.is_retry_safe()
            }
        };
        if retry {
            RetryDecision::Retry
        } else {
            RetryDecision::Stop
        }
    }
}

/// Every setting of the [`FrozenRetryLayer`](crate::FrozenRetryLayer).
///
/// Built with [`RetryPolicy::builder`]; [`RetryPolicy::default`] is the recommended
/// configuration:
///
/// | setting | default |
/// |---|---|
/// | attempts (first included) | 3, at most 5 |
/// | backoff | full jitter: uniform in `[0, min(10 s, 100 ms × 2ⁿ)]` |
/// | retry budget | tower's `TpsBudget`'s arithmetic (no lock per call): 10 s window, 10 retries/s floor, 20 % of calls |
/// | max elapsed (first attempt to last retry) | 30 s |
/// | per-attempt timeout | none |
/// | `Retry-After` | honoured (seconds or HTTP-date) when longer than the backoff, capped at the backoff cap; never shortens the backoff (`0`, past dates and garbage fall back to it); past the deadline it ends retrying |
/// | request body limit | 1 MiB |
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::retry::RetryPolicy;
///
/// let policy = RetryPolicy::builder()
///     .max_attempts(4)
///     .attempt_timeout(Duration::from_secs(2))
///     .max_elapsed(Duration::from_secs(20))
///     .build()
///     .unwrap();
/// assert_eq!(policy.max_attempts(), 4);
/// assert!(RetryPolicy::builder().max_attempts(6).build().is_err());
/// ```
#[derive(Clone, Debug)]
pub struct RetryPolicy {
    pub(crate) max_attempts: u32,
    pub(crate) backoff_base: Duration,
    pub(crate) backoff_cap: Duration,
    pub(crate) max_elapsed: Duration,
    pub(crate) attempt_timeout: Option<Duration>,
    pub(crate) budget: Option<RetryBudget>,
    pub(crate) classifier: Arc<dyn ClassifyRetry>,
    pub(crate) phase_classifier: Option<Arc<dyn ClassifyPhase>>,
    pub(crate) body_limit: usize,
    pub(crate) key_header: KeyHeader,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self::builder()
            .build()
            .expect("the default retry policy is valid")
    }
}

impl RetryPolicy {
    /// Start from the defaults.
    pub fn builder() -> RetryPolicyBuilder {
        RetryPolicyBuilder {
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            backoff_base: DEFAULT_BACKOFF_BASE,
            backoff_cap: DEFAULT_BACKOFF_CAP,
            max_elapsed: DEFAULT_MAX_ELAPSED,
            attempt_timeout: None,
            budget: Some(RetryBudget::Windowed(Arc::new(default_budget()))),
            classifier: Arc::new(DefaultClassifier),
            phase_classifier: None,
            body_limit: DEFAULT_BODY_LIMIT,
            key_header: KeyHeader::ietf(),
        }
    }

    /// Attempts per call, the first included.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// The longest time from the first attempt to the start of the last retry.
    ///
    /// Size the idempotency ledger's retention above this plus its lease.
    pub fn max_elapsed(&self) -> Duration {
        self.max_elapsed
    }

    /// The longest time one call may keep retrying: the maximum elapsed time plus one
    /// per-attempt timeout (the last attempt may start at the deadline).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::retry::RetryPolicy;
    ///
    /// let policy = RetryPolicy::builder()
    ///     .max_elapsed(Duration::from_secs(20))
    ///     .attempt_timeout(Duration::from_secs(2))
    ///     .build()
    ///     .unwrap();
    /// assert_eq!(policy.retry_window(), Duration::from_secs(22));
    /// ```
    pub fn retry_window(&self) -> Duration {
        // Saturating: "retry for ever" (`Duration::MAX`) is a window no ledger outlives, not
        // an overflow.
        self.max_elapsed
            .saturating_add(self.attempt_timeout.unwrap_or_default())
    }
}

/// tower's budget with the defaults from Finagle/Envoy guidance: a 10 s window, a floor of
/// 10 retries per second, and 20 % of calls; kept without a lock on every call
/// ([`Windowed`]).
fn default_budget() -> Windowed {
    Windowed::new(Duration::from_secs(10), 10, 0.2)
}

/// Builds a [`RetryPolicy`]; [`build`](RetryPolicyBuilder::build) refuses invalid settings.
#[derive(Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct RetryPolicyBuilder {
    max_attempts: u32,
    backoff_base: Duration,
    backoff_cap: Duration,
    max_elapsed: Duration,
    attempt_timeout: Option<Duration>,
    budget: Option<RetryBudget>,
    classifier: Arc<dyn ClassifyRetry>,
    phase_classifier: Option<Arc<dyn ClassifyPhase>>,
    body_limit: usize,
    key_header: KeyHeader,
}

impl RetryPolicyBuilder {
    /// Attempts per call, the first included: 1 to 5 (default 3).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// The first backoff ceiling and the longest backoff (default 100 ms and 10 s). The
    /// `Retry-After` a server sends is capped at `cap` too.
    pub fn backoff(mut self, base: Duration, cap: Duration) -> Self {
        self.backoff_base = base;
        self.backoff_cap = cap;
        self
    }

    /// The longest time from the first attempt to the start of the last retry (default 30 s).
    pub fn max_elapsed(mut self, max_elapsed: Duration) -> Self {
        self.max_elapsed = max_elapsed;
        self
    }

    /// Give up on a single attempt after `timeout` (default: no per-attempt timeout). An
    /// attempt that times out may have been sent.
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = Some(timeout);
        self
    }

    /// Share this retry budget (tower's `TpsBudget`), e.g. across several layers. (The
    /// default budget counts as a `TpsBudget::new(10 s, 10, 0.2)` does, without its lock on
    /// every call; one passed here is used as it is.)
    pub fn budget(mut self, budget: Arc<TpsBudget>) -> Self {
        self.budget = Some(RetryBudget::Tower(budget));
        self
    }

    /// No retry budget: only the attempt cap limits retries. Not recommended in production.
    pub fn no_budget(mut self) -> Self {
        self.budget = None;
        self
    }

    /// Replace the [`DefaultClassifier`].
    pub fn classifier(mut self, classifier: impl ClassifyRetry) -> Self {
        self.classifier = Arc::new(classifier);
        self
    }

    /// Teach the layer which of your transport's errors are pre-write failures.
    pub fn classify_phase(mut self, classifier: impl ClassifyPhase) -> Self {
        self.phase_classifier = Some(Arc::new(classifier));
        self
    }

    /// The largest request body that may be frozen (default 1 MiB).
    pub fn body_limit(mut self, limit: usize) -> Self {
        self.body_limit = limit;
        self
    }

    /// The header that makes a side-effecting request safe to resend when it carries a key
    /// (default [`KeyHeader::ietf`], `Idempotency-Key`), for a `FrozenRetryLayer` used
    /// alone in front of a provider that reads its key elsewhere (`PayPal-Request-Id`).
    /// Under a client [`IdempotencyLayer`](crate::IdempotencyLayer), the layer's own
    /// [`key_header`](crate::client::Builder::key_header) is used instead.
    ///
    /// ```
    /// use tower_idempotency::key::KeyHeader;
    /// use tower_idempotency::retry::RetryPolicy;
    /// use tower_idempotency::FrozenRetryLayer;
    ///
    /// let policy = RetryPolicy::builder().key_header(KeyHeader::paypal()).build().unwrap();
    /// let layer = FrozenRetryLayer::new(policy);
    /// # let _ = layer;
    /// ```
    pub fn key_header(mut self, header: KeyHeader) -> Self {
        self.key_header = header;
        self
    }

    /// Check the settings and build the policy.
    pub fn build(self) -> Result<RetryPolicy, crate::ConfigError> {
        use crate::ConfigError;
        if self.max_attempts == 0 || self.max_attempts > MAX_ATTEMPTS_CEILING {
            return Err(ConfigError::new(format!(
                "max_attempts must be between 1 and {MAX_ATTEMPTS_CEILING}, got {}",
                self.max_attempts
            )));
        }
        if self.backoff_base.is_zero() || self.backoff_base > self.backoff_cap {
            return Err(ConfigError::new(
                "the backoff base must be non-zero and not above the cap",
            ));
        }
        Ok(RetryPolicy {
            max_attempts: self.max_attempts,
            backoff_base: self.backoff_base,
            backoff_cap: self.backoff_cap,
            max_elapsed: self.max_elapsed,
            attempt_timeout: self.attempt_timeout,
            budget: self.budget,
            classifier: self.classifier,
            phase_classifier: self.phase_classifier,
            body_limit: self.body_limit,
            key_header: self.key_header,
        })
    }
}
