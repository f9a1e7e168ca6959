//! The retries left to an operation, counted as the retry layer counts them.

use std::time::Duration;

use tokio::time::Instant;

use crate::retry::FullJitter;
use crate::tool::face::ToolFace;

/// The retries left to an operation: attempts, elapsed time, budget and backoff, as the
/// [`FrozenRetryLayer`](crate::FrozenRetryLayer) counts them.
pub(super) struct Retries<'a> {
    policy: &'a crate::retry::RetryPolicy,
    attempts: u32,
    started: Instant,
    backoff: Option<FullJitter>,
    wait: Duration,
}

impl<'a> Retries<'a> {
    pub(super) fn new<C>(face: &'a ToolFace<C>) -> Self {
        let policy = &*face.retry;
        let started = Instant::now();
        if let Some(budget) = &policy.budget {
            budget.deposit_at(started);
        }
        Self {
            policy,
            attempts: 1,
            started,
            backoff: None,
            wait: Duration::ZERO,
        }
    }

    /// The wait before another attempt, if one is allowed: at least the backoff and the
    /// provider's hint, within the attempts, the elapsed time and the budget.
    pub(super) fn next(&mut self, hint: Option<Duration>) -> Option<Duration> {
        let policy = self.policy;
        if self.attempts >= policy.max_attempts {
            return None;
        }
        let backoff = self
            .backoff
            .get_or_insert_with(|| FullJitter::new(policy.backoff_base, policy.backoff_cap));
        let wait = backoff.next_delay().max(hint.unwrap_or_default());
        if self.started.elapsed().saturating_add(wait) > policy.max_elapsed {
            return None;
        }
        if let Some(budget) = &policy.budget {
            if !budget.withdraw_at(Instant::now()) {
                tracing::debug!("retry budget exhausted; not retrying the tool");
                return None;
            }
        }
        self.attempts += 1;
        self.wait = wait;
        Some(wait)
    }

    pub(super) fn wait(&self) -> tokio::time::Sleep {
        tokio::time::sleep(self.wait)
    }
}
