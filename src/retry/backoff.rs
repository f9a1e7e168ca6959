//! When to retry: full-jitter exponential backoff, and the server's `Retry-After`.
//!
//! The exponential schedule is tower's `ExponentialBackoff` (base × 2ⁿ, capped), used with
//! its own jitter off; on top of it we draw the delay uniformly from `[0, ceiling]` — the
//! "full jitter" that spreads a thundering herd best (AWS Architecture Blog, "Exponential
//! Backoff and Jitter"). tower's jitter only adds to the ceiling, which keeps retries of
//! simultaneous failures bunched together.

use std::time::{Duration, SystemTime};

use http::header::RETRY_AFTER;
use http::HeaderMap;
use tower::retry::backoff::{Backoff, ExponentialBackoff, ExponentialBackoffMaker, MakeBackoff};
use tower::util::rng::HasherRng;

/// The backoff of one call: successive full-jitter delays.
#[derive(Debug)]
pub(crate) struct FullJitter {
    schedule: ExponentialBackoff<HasherRng>,
}

impl FullJitter {
    pub(crate) fn new(base: Duration, cap: Duration) -> Self {
        let mut maker = ExponentialBackoffMaker::new(base, cap, 0.0, HasherRng::default())
            .expect("the policy builder validated base and cap");
        Self {
            schedule: maker.make_backoff(),
        }
    }

    /// The next delay: uniform in `[0, ceiling]`.
    pub(crate) fn next_delay(&mut self) -> Duration {
        // tower hands out its schedule as a `Sleep`; its deadline tells us the ceiling
        // without reimplementing the schedule.
        let sleep = self.schedule.next_backoff();
        let ceiling = sleep
            .deadline()
            .saturating_duration_since(tokio::time::Instant::now());
        ceiling.mul_f64(fastrand::f64())
    }
}

/// How long the server asked us to wait, if it did in a form we understand.
///
/// `Retry-After` is either delay-seconds (`120`) or an HTTP-date; anything else (garbage,
/// negative numbers, several values) is `None`, and the backoff applies. A date in the
/// past is `Some(0)`; the [`FrozenRetryLayer`](crate::FrozenRetryLayer) never waits less
/// than its backoff whatever this says.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::retry::retry_after;
///
/// let mut headers = http::HeaderMap::new();
/// headers.insert("retry-after", "120".parse().unwrap());
/// assert_eq!(retry_after(&headers), Some(Duration::from_secs(120)));
/// headers.insert("retry-after", "soon".parse().unwrap());
/// assert_eq!(retry_after(&headers), None);
/// ```
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let mut values = headers.get_all(RETRY_AFTER).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return None;
    }
    let text = value.to_str().ok()?.trim();
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        // delay-seconds may have any number of digits; too many for a u64 still means
        // "later than any deadline", not garbage.
        return Some(Duration::from_secs(text.parse::<u64>().unwrap_or(u64::MAX)));
    }
    let date = httpdate::parse_http_date(text).ok()?;
    // A date in the past means "now".
    Some(
        date.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(RETRY_AFTER, HeaderValue::from_str(value).unwrap());
        headers
    }

    #[test]
    fn retry_after_forms() {
        assert_eq!(retry_after(&headers("3")), Some(Duration::from_secs(3)));
        assert_eq!(retry_after(&headers("0")), Some(Duration::ZERO));
        assert_eq!(retry_after(&headers("soon")), None);
        assert_eq!(retry_after(&headers("-1")), None);
        assert_eq!(retry_after(&HeaderMap::new()), None);
        let in_a_minute = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(61));
        let parsed = retry_after(&headers(&in_a_minute)).unwrap();
        assert!(parsed > Duration::from_secs(55) && parsed <= Duration::from_secs(61));
        assert_eq!(
            retry_after(&headers("Wed, 21 Oct 2015 07:28:00 GMT")),
            Some(Duration::ZERO)
        );
    }

    #[tokio::test(start_paused = true)]
    async fn full_jitter_stays_under_the_exponential_ceiling() {
        let base = Duration::from_millis(100);
        let cap = Duration::from_secs(10);
        for _ in 0..50 {
            let mut backoff = FullJitter::new(base, cap);
            for n in 0..10u32 {
                let ceiling = (base * 2u32.pow(n)).min(cap);
                assert!(backoff.next_delay() <= ceiling);
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn full_jitter_spreads_delays() {
        let mut seen_low = false;
        let mut seen_high = false;
        for _ in 0..200 {
            let delay =
                FullJitter::new(Duration::from_millis(100), Duration::from_secs(1)).next_delay();
            seen_low |= delay < Duration::from_millis(30);
            seen_high |= delay > Duration::from_millis(70);
        }
        assert!(
            seen_low && seen_high,
            "delays are drawn from the whole range"
        );
    }
}
