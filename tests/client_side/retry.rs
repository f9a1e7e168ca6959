//! `FrozenRetryLayer`: what it retries, when, and how often — on a paused tokio clock.
//!
//! The inner service is an [`Upstream`]: a `tower::service_fn` answering from a script and
//! recording every attempt it receives (the paused-clock instant, method, URI, version,
//! headers and body). Time is measured with `tokio::time::Instant`; nothing sleeps for real.
//!
//! On a paused clock tokio advances time to the next timer's deadline, rounded up to the
//! millisecond, and every test starts on a millisecond boundary, so a gap between attempts is
//! the delay the policy chose, rounded up to the next millisecond (exact for whole seconds).

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::header::RETRY_AFTER;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Uri, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use tokio::time::Instant;
use tower::retry::budget::TpsBudget;
use tower::{Layer, Service, ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::phase::FailurePhase;
use tower_idempotency::retry::{
    AttemptResult, Attempts, ClassifyRetry, FrozenRetry, RetryContext, RetryDecision, RetryPolicy,
};
use tower_idempotency::ProviderKeys;
use tower_idempotency::{EffectClass, Error, FrozenRetryLayer, IdempotencyLayer, KeyHeader};

// ---------------------------------------------------------------------------------------
// The scripted upstream
// ---------------------------------------------------------------------------------------

type Req = Request<Full<Bytes>>;
type Res = Response<Full<Bytes>>;
type UpstreamFuture = Pin<Box<dyn Future<Output = Result<Res, io::Error>> + Send>>;

/// How the upstream answers one attempt.
#[derive(Clone, Debug)]
enum Step {
    /// Answer this status.
    Status(u16),
    /// Answer this status with `Retry-After: <value>`.
    RetryAfter(u16, &'static str),
    /// Answer this status with `Retry-After: <HTTP-date this far ahead>`, the date formatted
    /// when the answer is made.
    RetryAfterDate(u16, Duration),
    /// Fail with an I/O error of this kind.
    Fail(io::ErrorKind),
    /// Never answer.
    Hang,
    /// Work this long on the paused clock, then take the next step's shape.
    Slow(Duration, Box<Step>),
}

/// One attempt as the upstream received it.
#[derive(Clone, Debug)]
struct Seen {
    at: Instant,
    method: Method,
    uri: Uri,
    version: Version,
    headers: HeaderMap,
    body: Bytes,
    effect: Option<EffectClass>,
}

/// A scripted upstream: answers with the queued steps, then with `fallback` forever.
#[derive(Clone)]
struct Upstream {
    script: Arc<Mutex<VecDeque<Step>>>,
    fallback: Step,
    seen: Arc<Mutex<Vec<Seen>>>,
    calls: Arc<AtomicUsize>,
    /// Record the full attempt (off for the 1000-call budget runs, which only count).
    record: bool,
}

impl Upstream {
    fn always(step: Step) -> Self {
        Self::scripted([], step)
    }

    fn scripted(steps: impl IntoIterator<Item = Step>, fallback: Step) -> Self {
        Self {
            script: Arc::new(Mutex::new(steps.into_iter().collect())),
            fallback,
            seen: Arc::default(),
            calls: Arc::default(),
            record: true,
        }
    }

    fn counting_only(mut self) -> Self {
        self.record = false;
        self
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }

    /// Gaps between the starts of consecutive attempts.
    fn gaps(&self) -> Vec<Duration> {
        self.seen()
            .windows(2)
            .map(|pair| pair[1].at - pair[0].at)
            .collect()
    }

    fn service(
        &self,
    ) -> impl Service<Req, Response = Res, Error = io::Error, Future = UpstreamFuture>
           + Clone
           + Send
           + 'static {
        let upstream = self.clone();
        tower::service_fn(move |req: Req| -> UpstreamFuture {
            let upstream = upstream.clone();
            Box::pin(async move {
                upstream.calls.fetch_add(1, Ordering::SeqCst);
                let at = Instant::now();
                let (parts, body) = req.into_parts();
                let body = body.collect().await.expect("Full never fails").to_bytes();
                if upstream.record {
                    upstream.seen.lock().unwrap().push(Seen {
                        at,
                        method: parts.method,
                        uri: parts.uri,
                        version: parts.version,
                        headers: parts.headers,
                        body,
                        effect: parts.extensions.get::<EffectClass>().copied(),
                    });
                }
                let step = upstream
                    .script
                    .lock()
                    .unwrap()
                    .pop_front()
                    .unwrap_or_else(|| upstream.fallback.clone());
                answer(step).await
            })
        })
    }

    /// The upstream behind a `FrozenRetryLayer` with `policy`.
    fn behind(
        &self,
        policy: RetryPolicy,
    ) -> FrozenRetry<
        impl Service<Req, Response = Res, Error = io::Error, Future = UpstreamFuture>
            + Clone
            + Send
            + 'static,
    > {
        ServiceBuilder::new()
            .layer(FrozenRetryLayer::new(policy))
            .service(self.service())
    }
}

fn answer(step: Step) -> UpstreamFuture {
    Box::pin(async move {
        match step {
            Step::Status(status) => Ok(respond(status, None)),
            Step::RetryAfter(status, value) => {
                Ok(respond(status, Some(HeaderValue::from_static(value))))
            }
            Step::RetryAfterDate(status, ahead) => {
                let date = httpdate::fmt_http_date(SystemTime::now() + ahead);
                Ok(respond(status, Some(HeaderValue::from_str(&date).unwrap())))
            }
            Step::Fail(kind) => Err(io::Error::from(kind)),
            Step::Hang => std::future::pending().await,
            Step::Slow(work, then) => {
                tokio::time::sleep(work).await;
                answer(*then).await
            }
        }
    })
}

fn respond(status: u16, retry_after: Option<HeaderValue>) -> Res {
    let mut res = Response::new(Full::new(Bytes::from_static(b"{}")));
    *res.status_mut() = StatusCode::from_u16(status).unwrap();
    if let Some(value) = retry_after {
        res.headers_mut().insert(RETRY_AFTER, value);
    }
    res
}

// ---------------------------------------------------------------------------------------
// Requests and policies
// ---------------------------------------------------------------------------------------

fn get() -> Req {
    Request::get("http://inventory.local/stock?sku=SKU-4471")
        .body(Full::new(Bytes::new()))
        .unwrap()
}

fn post_without_key() -> Req {
    Request::post("http://payments.local/charges")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(b"{\"amount\":4200}")))
        .unwrap()
}

fn post_with_key() -> Req {
    let mut req = post_without_key();
    req.headers_mut().insert(
        "idempotency-key",
        HeaderValue::from_static("\"order-42-charge\""),
    );
    // A caller's own key is scoped by the credential it travels with.
    req.headers_mut()
        .insert("authorization", HeaderValue::from_static("Bearer sk_test"));
    req
}

/// The defaults, without a budget: the tests that are not about the budget must not depend
/// on how much of it earlier calls used.
fn unbudgeted() -> RetryPolicy {
    RetryPolicy::builder().no_budget().build().unwrap()
}

/// The attempts behind `res`, checking the extension's contract on the way: a retried answer
/// carries `Attempts` with its count (at least 2), a first-attempt answer carries none.
fn attempts_of<B>(res: &Response<B>) -> u32 {
    match res.extensions().get::<Attempts>() {
        Some(attempts) => {
            assert!(
                attempts.get() >= 2,
                "only retried answers carry Attempts, got {attempts:?}"
            );
            attempts.get()
        }
        None => 1,
    }
}

const FIRST_CEILING: Duration = Duration::from_millis(100);
const SECOND_CEILING: Duration = Duration::from_millis(200);

// ---------------------------------------------------------------------------------------
// Attempt cap
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn always_503_get_makes_exactly_three_attempts_by_default() {
    let upstream = Upstream::always(Step::Status(503));
    let res = upstream
        .behind(RetryPolicy::default())
        .oneshot(get())
        .await
        .unwrap();
    assert_eq!(res.status(), 503, "the last answer is returned");
    assert_eq!(upstream.calls(), 3);
    assert_eq!(attempts_of(&res), 3);
    assert_eq!(res.extensions().get::<Attempts>(), Some(&Attempts::new(3)));
}

#[tokio::test(start_paused = true)]
async fn always_503_get_makes_exactly_five_attempts_with_max_attempts_5() {
    let upstream = Upstream::always(Step::Status(503));
    let policy = RetryPolicy::builder().max_attempts(5).build().unwrap();
    let res = upstream.behind(policy).oneshot(get()).await.unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(upstream.calls(), 5);
    assert_eq!(attempts_of(&res), 5);
}

#[tokio::test(start_paused = true)]
async fn max_attempts_1_never_retries() {
    let upstream = Upstream::always(Step::Status(503));
    let policy = RetryPolicy::builder().max_attempts(1).build().unwrap();
    let res = upstream.behind(policy).oneshot(get()).await.unwrap();
    assert_eq!(upstream.calls(), 1);
    assert_eq!(attempts_of(&res), 1);
}

#[tokio::test(start_paused = true)]
async fn only_answers_that_took_more_than_one_attempt_carry_attempts() {
    let first_time = Upstream::always(Step::Status(200));
    let res = first_time
        .behind(unbudgeted())
        .oneshot(get())
        .await
        .unwrap();
    assert_eq!(first_time.calls(), 1);
    assert_eq!(res.extensions().get::<Attempts>(), None);
    assert_eq!(Attempts::of(&res), Attempts::new(1));

    let given_up_at_once = Upstream::always(Step::Status(404));
    let res = given_up_at_once
        .behind(unbudgeted())
        .oneshot(get())
        .await
        .unwrap();
    assert_eq!(
        res.extensions().get::<Attempts>(),
        None,
        "a final first answer"
    );

    let second_time = Upstream::scripted([Step::Status(503)], Step::Status(200));
    let res = second_time
        .behind(unbudgeted())
        .oneshot(get())
        .await
        .unwrap();
    assert_eq!(second_time.calls(), 2);
    assert_eq!(res.extensions().get::<Attempts>(), Some(&Attempts::new(2)));
    assert_eq!(Attempts::of(&res), Attempts::new(2));
}

#[test]
fn build_refuses_max_attempts_above_the_ceiling_of_5_and_zero() {
    assert!(RetryPolicy::builder().max_attempts(6).build().is_err());
    assert!(RetryPolicy::builder().max_attempts(0).build().is_err());
    assert!(RetryPolicy::builder()
        .max_attempts(u32::MAX)
        .build()
        .is_err());
    assert_eq!(
        RetryPolicy::builder()
            .max_attempts(5)
            .build()
            .unwrap()
            .max_attempts(),
        5
    );
    assert_eq!(RetryPolicy::default().max_attempts(), 3);
}

#[tokio::test(start_paused = true)]
async fn attempts_extension_counts_the_attempts_that_led_to_success() {
    let upstream = Upstream::scripted([Step::Status(503), Step::Status(502)], Step::Status(200));
    let res = upstream.behind(unbudgeted()).oneshot(get()).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(attempts_of(&res), 3);
    assert_eq!(upstream.calls(), 3);
}

// ---------------------------------------------------------------------------------------
// Frozen bytes
// ---------------------------------------------------------------------------------------

/// A streaming body: several data frames, each after a `Pending`, with no length announced.
/// It counts the frames it hands out, so a test can tell it was read once.
struct Streaming {
    frames: VecDeque<Bytes>,
    handed_out: Arc<AtomicUsize>,
    ends_seen: Arc<AtomicUsize>,
    pending_next: bool,
}

impl Body for Streaming {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        // Make every frame arrive "later", as a socket's would.
        if self.pending_next {
            self.pending_next = false;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        self.pending_next = true;
        match self.frames.pop_front() {
            Some(chunk) => {
                self.handed_out.fetch_add(1, Ordering::SeqCst);
                Poll::Ready(Some(Ok(Frame::data(chunk))))
            }
            None => {
                self.ends_seen.fetch_add(1, Ordering::SeqCst);
                Poll::Ready(None)
            }
        }
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::default()
    }
}

#[tokio::test(start_paused = true)]
async fn every_attempt_sends_byte_identical_head_and_body_of_a_streamed_request() {
    let chunks: [&'static [u8]; 4] = [
        b"{\"amount\":4200,",
        b"\"currency\":\"eur\",",
        b"\"summary\":\"restock SKU-4471\",",
        b"\"fulfillment_intent_id\":\"fi_123\"}",
    ];
    let handed_out = Arc::new(AtomicUsize::new(0));
    let ends_seen = Arc::new(AtomicUsize::new(0));
    let body = Streaming {
        frames: chunks.iter().map(|c| Bytes::from_static(c)).collect(),
        handed_out: handed_out.clone(),
        ends_seen: ends_seen.clone(),
        pending_next: true,
    };
    let req = Request::builder()
        .method(Method::POST)
        .uri("http://payments.local/charges?tenant=acme&retry=yes")
        .version(Version::HTTP_2)
        .header("idempotency-key", "\"order-42-charge\"")
        .header("content-type", "application/json")
        .header("x-trace", "a")
        .header("x-trace", "b")
        .header("authorization", "Bearer t0k3n")
        .body(body)
        .unwrap();
    let expected_headers = req.headers().clone();
    let expected_body: Bytes = chunks.concat().into();

    let upstream = Upstream::always(Step::Status(503));
    let res = upstream.behind(unbudgeted()).oneshot(req).await.unwrap();
    assert_eq!(attempts_of(&res), 3);

    let seen = upstream.seen();
    assert_eq!(seen.len(), 3);
    for (n, attempt) in seen.iter().enumerate() {
        assert_eq!(attempt.method, Method::POST, "attempt {n}");
        assert_eq!(
            attempt.uri, "http://payments.local/charges?tenant=acme&retry=yes",
            "attempt {n}"
        );
        assert_eq!(attempt.version, Version::HTTP_2, "attempt {n}");
        assert_eq!(attempt.headers, expected_headers, "attempt {n}");
        let traces: Vec<_> = attempt.headers.get_all("x-trace").iter().collect();
        assert_eq!(
            traces,
            ["a", "b"],
            "attempt {n}: repeated headers keep their order"
        );
        assert_eq!(attempt.body, expected_body, "attempt {n}");
    }
    // The streaming body was read exactly once: each frame handed out once, the end once.
    assert_eq!(handed_out.load(Ordering::SeqCst), chunks.len());
    assert_eq!(ends_seen.load(Ordering::SeqCst), 1);
}

/// How the hesitant service answers one `poll_ready`.
#[derive(Clone, Copy, Debug)]
enum Readiness {
    /// As `inner` is.
    Ready,
    Pending,
    Fail,
}

/// `inner` behind a `poll_ready` that answers from a script (then as `inner` does): a
/// service that is not ready at once, or whose readiness fails.
#[derive(Clone)]
struct Hesitant<S> {
    inner: S,
    script: Arc<Mutex<VecDeque<Readiness>>>,
}

impl<S: Service<Req>> Service<Req> for Hesitant<S>
where
    S::Error: From<io::Error>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        match self.script.lock().unwrap().pop_front() {
            Some(Readiness::Pending) => {
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            Some(Readiness::Fail) => Poll::Ready(Err(io::Error::other("not ready").into())),
            Some(Readiness::Ready) | None => self.inner.poll_ready(cx),
        }
    }

    fn call(&mut self, req: Req) -> Self::Future {
        self.inner.call(req)
    }
}

/// Readiness that waits, or fails, moves nothing of the request: the first attempt sent
/// after a wait is the request as handed in, and after a failed readiness (nothing sent)
/// the retry is the frozen request, the same bytes. Alone, and under the client
/// `IdempotencyLayer`, whose frozen request the retry layer then sends as it is.
#[tokio::test(start_paused = true)]
async fn an_attempt_that_waits_for_readiness_or_outlives_its_failure_sends_the_same_bytes() {
    use Readiness::{Fail, Pending, Ready};
    // The retry layer's future asks before each attempt; what asked before it (the
    // layer's own `poll_ready`, and under the client layer that layer's too, and its call's)
    // takes the first answers.
    let scripts = [
        (vec![Pending, Pending], 1),
        (vec![Pending, Fail], 2),
        (vec![Fail, Pending], 2),
        (vec![Fail, Fail, Pending], 3),
    ];
    for stacked in [false, true] {
        for (script, attempts) in &scripts {
            let asked_before = if stacked { 2 } else { 1 };
            let script = std::iter::repeat_n(Ready, asked_before).chain(script.iter().copied());
            let upstream = Upstream::always(Step::Status(201));
            let hesitant = Hesitant {
                inner: upstream.service(),
                script: Arc::new(Mutex::new(script.collect())),
            };
            let retry = FrozenRetryLayer::new(unbudgeted());
            let (status, attempted) = if stacked {
                let res = ServiceBuilder::new()
                    .layer(IdempotencyLayer::client(
                        MemoryStore::new(),
                        ProviderKeys::Deduplicates,
                        KeyHeader::ietf(),
                    ))
                    .layer(retry)
                    .service(hesitant)
                    .oneshot(post_with_key())
                    .await
                    .unwrap();
                (res.status(), attempts_of(&res))
            } else {
                let res = retry
                    .layer(hesitant)
                    .oneshot(post_with_key())
                    .await
                    .unwrap();
                (res.status(), attempts_of(&res))
            };
            let case = format!("stacked={stacked}, {attempts} attempts");
            assert_eq!(status, StatusCode::CREATED, "{case}");
            assert_eq!(attempted, *attempts, "{case}");
            let seen = upstream.seen();
            assert_eq!(seen.len(), 1, "{case}: only a ready service is called");
            assert_eq!(seen[0].method, Method::POST, "{case}");
            assert_eq!(seen[0].uri, "http://payments.local/charges", "{case}");
            let mut headers = seen[0].headers.clone();
            // The client layer adds the frozen body's digest; nothing else changes.
            assert_eq!(
                headers.remove("content-digest").is_some(),
                stacked,
                "{case}"
            );
            assert_eq!(headers, *post_with_key().headers(), "{case}");
            assert_eq!(&seen[0].body[..], b"{\"amount\":4200}", "{case}");
        }
    }
}

#[tokio::test(start_paused = true)]
async fn every_attempt_carries_the_callers_extensions() {
    let mut req = post_without_key();
    req.extensions_mut().insert(EffectClass::Read);
    let upstream = Upstream::always(Step::Status(503));
    upstream.behind(unbudgeted()).oneshot(req).await.unwrap();
    let seen = upstream.seen();
    assert_eq!(seen.len(), 3);
    assert!(seen.iter().all(|s| s.effect == Some(EffectClass::Read)));
}

#[tokio::test(start_paused = true)]
async fn a_body_over_the_freeze_limit_is_refused_before_anything_is_sent() {
    let policy = RetryPolicy::builder()
        .body_limit(8)
        .no_budget()
        .build()
        .unwrap();
    let upstream = Upstream::always(Step::Status(200));
    let err = upstream
        .behind(policy)
        .oneshot(post_with_key())
        .await
        .unwrap_err();
    assert!(err.is_body_too_large(), "{err:?}");
    assert_eq!(upstream.calls(), 0);
}

/// A body whose stream breaks after its first frame.
struct Broken(bool);

impl Body for Broken {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        if std::mem::replace(&mut self.0, true) {
            Poll::Ready(Some(Err(io::ErrorKind::UnexpectedEof.into())))
        } else {
            Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(b"{\"amo")))))
        }
    }
}

#[tokio::test(start_paused = true)]
async fn a_body_that_fails_to_stream_is_refused_before_anything_is_sent() {
    let req = Request::post("http://payments.local/charges")
        .header("idempotency-key", "\"k\"")
        .body(Broken(false))
        .unwrap();
    let upstream = Upstream::always(Step::Status(200));
    let err = upstream
        .behind(unbudgeted())
        .oneshot(req)
        .await
        .unwrap_err();
    assert!(err.is_body(), "{err:?}");
    assert_eq!(upstream.calls(), 0);
}

// ---------------------------------------------------------------------------------------
// Retry budget
// ---------------------------------------------------------------------------------------

/// Runs `calls` sequential GETs against an always-503 upstream; returns the attempts made
/// and the paused-clock time the run took.
async fn storm(policy: RetryPolicy, calls: usize) -> (usize, Duration) {
    let upstream = Upstream::always(Step::Status(503)).counting_only();
    let client = upstream.behind(policy);
    let start = Instant::now();
    for _ in 0..calls {
        let res = client.clone().oneshot(get()).await.unwrap();
        assert_eq!(res.status(), 503);
    }
    (upstream.calls(), start.elapsed())
}

// How tower 0.5.3's `TpsBudget::new(ttl = 10 s, min_per_sec = 1, retry_percent = 0.2)`
// limits retries (tower/src/retry/budget/tps_budget.rs):
//
// - deposit_amount = 1 and withdraw_amount = (1.0 / 0.2f32) as isize = 5 (the f32 quotient
//   rounds to exactly 5.0): every call deposits 1 token, every retry withdraws 5;
// - reserve = min_per_sec × ttl_secs × withdraw_amount = 1 × 10 × 5 = 50 tokens, a constant
//   added to the balance: 10 retries' worth;
// - a retry is allowed iff balance = reserve + (live deposits) − 5 × (live withdrawals) ≥ 5,
//   so after every allowed retry the balance is ≥ 0;
// - deposits and withdrawals live in 10 one-second slots (ttl / 10) and are forgotten when
//   their slot is recycled. `expire()` advances ceil(diff / 1 s) slots for a gap diff ≥ 1 s
//   (its `while diff > window` loop zeroes one slot too many unless diff is a whole number
//   of seconds), i.e. at most 2 slots per elapsed second, so an entry lives at least
//   5.5 s − 1 s = 4.5 s, not the nominal 10 s.
//
// Within one slot (no recycling) the invariant is exact: with D deposits and R retries,
// 50 + D − 5R ≥ 0, so R ≤ (D + 50) / 5. For D = 1000 calls that is R ≤ 210, and because
// the balance never reaches 5 without being spent, R = 210 exactly: 1210 attempts.
//
// Across slots, forgotten entries form a prefix in time (slots are recycled oldest first).
// Writing the invariant at the last retry (time T) with the forgotten prefix cut at c:
// 50 + (D(T) − D(c)) − 5 (R(T) − R(c)) ≥ 0, and applying it again at the last forgotten
// retry (≥ 4.5 s earlier), and so on back to the start, telescopes to
//
//     R ≤ D / 5 + 10 × (⌊T / 4.5 s⌋ + 1),
//
// 10 being the reserve's retries, refreshed at most once per 4.5 s of elapsed time.
fn tps_bound_on_retries(calls: usize, elapsed: Duration) -> usize {
    let refreshes = (elapsed.as_secs_f64() / 4.5).floor() as usize + 1;
    calls / 5 + 10 * refreshes
}

#[tokio::test(start_paused = true)]
async fn retry_budget_caps_a_total_failure_storm_near_twenty_percent_of_calls() {
    const CALLS: usize = 1000;
    let policy = RetryPolicy::builder()
        .budget(Arc::new(TpsBudget::new(Duration::from_secs(10), 1, 0.2)))
        .build()
        .unwrap();
    let (attempts, elapsed) = storm(policy, CALLS).await;
    let retries = attempts - CALLS;
    let bound = tps_bound_on_retries(CALLS, elapsed);
    eprintln!("{attempts} attempts ({retries} retries) in {elapsed:?}; bound {bound} retries");
    assert!(
        retries <= bound,
        "{retries} retries in {elapsed:?}, over tower's TpsBudget bound of {bound}"
    );
    // 20 % of the calls plus a few reserve refreshes over the run — far from the 3000
    // attempts the same storm makes without a budget.
    assert!(
        attempts <= CALLS + CALLS / 5 + 40,
        "{attempts} attempts in {elapsed:?}"
    );
    // The reserve alone allows 10 retries: the budget did let some through.
    assert!(retries >= 10, "{retries} retries");
}

#[tokio::test(start_paused = true)]
async fn retry_budget_allows_exactly_reserve_plus_twenty_percent_within_one_slot() {
    const CALLS: usize = 1000;
    // Backoff of at most 1 ms keeps the whole storm (≤ 210 ms of retries) inside the
    // budget's first one-second slot: nothing expires, and the exact bound applies.
    let policy = RetryPolicy::builder()
        .backoff(Duration::from_millis(1), Duration::from_millis(1))
        .budget(Arc::new(TpsBudget::new(Duration::from_secs(10), 1, 0.2)))
        .build()
        .unwrap();
    let (attempts, elapsed) = storm(policy, CALLS).await;
    assert!(elapsed < Duration::from_secs(1), "{elapsed:?}");
    assert_eq!(
        attempts,
        CALLS + (CALLS + 50) / 5,
        "1000 calls + 210 retries"
    );
}

#[tokio::test(start_paused = true)]
async fn without_a_budget_a_total_failure_storm_makes_three_attempts_per_call() {
    let (attempts, _) = storm(unbudgeted(), 1000).await;
    assert_eq!(attempts, 3000);
}

#[tokio::test(start_paused = true)]
async fn an_empty_budget_allows_no_retries() {
    let policy = RetryPolicy::builder()
        .budget(Arc::new(TpsBudget::new(Duration::from_secs(1), 0, 0.0)))
        .build()
        .unwrap();
    let upstream = Upstream::always(Step::Status(503));
    let res = upstream.behind(policy).oneshot(get()).await.unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(attempts_of(&res), 1);
}

#[tokio::test(start_paused = true)]
async fn one_budget_is_shared_by_every_clone_of_the_layer() {
    // Reserve 1 × 1 s × withdraw 1 = 1 token and nothing from deposits (0 %): one retry in
    // total, however many services the layer builds.
    let layer = FrozenRetryLayer::new(
        RetryPolicy::builder()
            .budget(Arc::new(TpsBudget::new(Duration::from_secs(1), 1, 0.0)))
            .build()
            .unwrap(),
    );
    let first = Upstream::always(Step::Status(503));
    let second = Upstream::always(Step::Status(503));
    let a = ServiceBuilder::new()
        .layer(layer.clone())
        .service(first.service());
    let b = ServiceBuilder::new().layer(layer).service(second.service());
    let res = a.oneshot(get()).await.unwrap();
    assert_eq!(attempts_of(&res), 2, "the one token buys one retry");
    let res = b.oneshot(get()).await.unwrap();
    assert_eq!(
        attempts_of(&res),
        1,
        "the other service finds the budget spent"
    );
}

// ---------------------------------------------------------------------------------------
// Retry-After
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn retry_after_seconds_delays_the_next_attempt_exactly() {
    let upstream = Upstream::scripted([Step::RetryAfter(503, "2")], Step::Status(200));
    let res = upstream.behind(unbudgeted()).oneshot(get()).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(attempts_of(&res), 2);
    assert_eq!(upstream.gaps(), [Duration::from_secs(2)]);
}

#[tokio::test(start_paused = true)]
async fn retry_after_http_date_delays_the_next_attempt_until_that_date() {
    let upstream = Upstream::scripted(
        [Step::RetryAfterDate(503, Duration::from_secs(3))],
        Step::Status(200),
    );
    let res = upstream.behind(unbudgeted()).oneshot(get()).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(attempts_of(&res), 2);
    // An HTTP-date has whole seconds: "now + 3 s" truncated is more than 2 s ahead, at most
    // 3 s. The date is read against the real clock a few microseconds after it was written
    // (the 10 ms slack covers a descheduled test thread).
    let gap = upstream.gaps()[0];
    assert!(
        gap >= Duration::from_millis(1990) && gap <= Duration::from_secs(3),
        "{gap:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn retry_after_zero_or_in_the_past_never_shortens_the_backoff() {
    // `Retry-After` may lengthen a pause, never shorten it: `0` and a past date fall back to
    // the full-jitter backoff (uniform in [0, 100 ms] for the first retry), over many runs.
    for asked in ["0", "Wed, 21 Oct 2015 07:28:00 GMT"] {
        let mut total = Duration::ZERO;
        for _ in 0..20 {
            let upstream = Upstream::scripted([Step::RetryAfter(503, asked)], Step::Status(200));
            let res = upstream.behind(unbudgeted()).oneshot(get()).await.unwrap();
            assert_eq!(attempts_of(&res), 2);
            let gap = upstream.gaps()[0];
            assert!(gap <= Duration::from_millis(101), "{asked}: {gap:?}");
            total += gap;
        }
        assert!(
            total > Duration::from_millis(100),
            "{asked}: 20 retries in {total:?} is a burst, not a backoff"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn five_attempts_answered_retry_after_zero_do_not_happen_at_once() {
    let upstream = Upstream::always(Step::RetryAfter(503, "0"));
    let policy = RetryPolicy::builder()
        .max_attempts(5)
        .no_budget()
        .build()
        .unwrap();
    let start = Instant::now();
    let res = upstream.behind(policy).oneshot(get()).await.unwrap();
    assert_eq!(attempts_of(&res), 5);
    // Four full-jitter pauses under ceilings of 100, 200, 400 and 800 ms: together under
    // 10 ms about once in a billion runs.
    assert!(
        start.elapsed() > Duration::from_millis(10),
        "{:?}",
        start.elapsed()
    );
}

#[tokio::test(start_paused = true)]
async fn retry_after_garbage_falls_back_to_the_backoff() {
    for garbage in ["soon", "-1", "1.5", "in 2 seconds"] {
        let upstream = Upstream::scripted([Step::RetryAfter(503, garbage)], Step::Status(200));
        let res = upstream.behind(unbudgeted()).oneshot(get()).await.unwrap();
        assert_eq!(attempts_of(&res), 2, "Retry-After: {garbage}");
        let gap = upstream.gaps()[0];
        assert!(gap <= FIRST_CEILING, "Retry-After: {garbage}: {gap:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn retry_after_is_capped_at_the_backoff_cap() {
    let upstream = Upstream::scripted([Step::RetryAfter(503, "20")], Step::Status(200));
    let policy = RetryPolicy::builder()
        .backoff(Duration::from_millis(100), Duration::from_secs(10))
        .max_elapsed(Duration::from_secs(120))
        .no_budget()
        .build()
        .unwrap();
    let res = upstream.behind(policy).oneshot(get()).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(upstream.gaps(), [Duration::from_secs(10)]);
}

#[tokio::test(start_paused = true)]
async fn retry_after_past_the_deadline_ends_retrying_at_once() {
    let upstream = Upstream::scripted([Step::RetryAfter(503, "120")], Step::Status(200));
    let policy = RetryPolicy::builder()
        .max_elapsed(Duration::from_secs(30))
        .no_budget()
        .build()
        .unwrap();
    let start = Instant::now();
    let res = upstream.behind(policy).oneshot(get()).await.unwrap();
    assert_eq!(res.status(), 503, "the server's answer is returned");
    assert_eq!(res.headers()[RETRY_AFTER], "120");
    assert_eq!(attempts_of(&res), 1);
    assert_eq!(upstream.calls(), 1);
    assert_eq!(
        start.elapsed(),
        Duration::ZERO,
        "no waiting for a retry that won't come"
    );
}

/// Sends one GET to an upstream answering `503` with `Retry-After: <value>` (then `200`),
/// in a task so a panic is reported, not propagated.
async fn one_get_after_retry_after(value: &'static str) -> Res {
    let upstream = Upstream::scripted([Step::RetryAfter(503, value)], Step::Status(200));
    let call = tokio::spawn(upstream.behind(unbudgeted()).oneshot(get()));
    call.await
        .unwrap_or_else(|panic| panic!("Retry-After: {value} panicked the client: {panic}"))
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn retry_after_u64_max_seconds_ends_retrying_without_panicking() {
    // RFC 9110 delay-seconds is `1*DIGIT`: any size. u64::MAX seconds does not fit in an
    // `Instant`; a server sending it must not crash the client, and it points past any
    // deadline, so the 503 is returned after one attempt.
    let res = one_get_after_retry_after("18446744073709551615").await;
    assert_eq!(res.status(), 503);
    assert_eq!(attempts_of(&res), 1);
}

#[tokio::test(start_paused = true)]
async fn retry_after_beyond_u64_seconds_ends_retrying() {
    // Too many digits for a u64 is still delay-seconds, and still past the deadline.
    let res = one_get_after_retry_after("99999999999999999999999").await;
    assert_eq!(res.status(), 503);
    assert_eq!(attempts_of(&res), 1);
}

#[tokio::test(start_paused = true)]
async fn retry_after_of_a_thousand_years_ends_retrying() {
    let res = one_get_after_retry_after("31536000000").await;
    assert_eq!(res.status(), 503);
    assert_eq!(attempts_of(&res), 1);
}

#[tokio::test(start_paused = true)]
async fn retry_after_far_in_the_future_as_a_date_ends_retrying() {
    let upstream = Upstream::scripted(
        [Step::RetryAfter(503, "Fri, 31 Dec 9999 23:59:59 GMT")],
        Step::Status(200),
    );
    let res = upstream.behind(unbudgeted()).oneshot(get()).await.unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(attempts_of(&res), 1);
}

// ---------------------------------------------------------------------------------------
// Which statuses are retried
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn client_error_statuses_are_never_retried_even_for_get() {
    // 409 is not in DESIGN §6's retryable set either.
    for status in [400, 401, 403, 404, 405, 409, 410, 412, 413, 422] {
        let upstream = Upstream::always(Step::Status(status));
        let res = upstream.behind(unbudgeted()).oneshot(get()).await.unwrap();
        assert_eq!(res.status(), status);
        assert_eq!(upstream.calls(), 1, "{status} was retried");
        assert_eq!(attempts_of(&res), 1, "{status}");
    }
}

#[tokio::test(start_paused = true)]
async fn success_and_redirect_statuses_are_final() {
    for status in [200, 201, 202, 204, 301, 302, 303, 304, 307, 308] {
        let upstream = Upstream::always(Step::Status(status));
        let res = upstream.behind(unbudgeted()).oneshot(get()).await.unwrap();
        assert_eq!(res.status(), status);
        assert_eq!(upstream.calls(), 1, "{status} was retried");
        assert_eq!(attempts_of(&res), 1, "{status}");
    }
}

#[tokio::test(start_paused = true)]
async fn server_error_statuses_other_than_the_retryable_six_are_final() {
    for status in [501, 505, 507, 511] {
        let upstream = Upstream::always(Step::Status(status));
        let res = upstream.behind(unbudgeted()).oneshot(get()).await.unwrap();
        assert_eq!(upstream.calls(), 1, "{status} was retried");
        assert_eq!(attempts_of(&res), 1, "{status}");
    }
}

#[tokio::test(start_paused = true)]
async fn retryable_statuses_408_429_500_502_503_504_are_retried_on_get() {
    for status in [408, 429, 500, 502, 503, 504] {
        let upstream = Upstream::scripted([Step::Status(status)], Step::Status(200));
        let res = upstream.behind(unbudgeted()).oneshot(get()).await.unwrap();
        assert_eq!(res.status(), 200, "{status} was not retried");
        assert_eq!(attempts_of(&res), 2, "{status}");

        let upstream = Upstream::always(Step::Status(status));
        let res = upstream.behind(unbudgeted()).oneshot(get()).await.unwrap();
        assert_eq!(res.status(), status);
        assert_eq!(upstream.calls(), 3, "{status} is retried up to the cap");
    }
}

#[tokio::test(start_paused = true)]
async fn put_and_delete_are_idempotent_writes_and_retried() {
    for method in [Method::PUT, Method::DELETE, Method::HEAD, Method::OPTIONS] {
        let req = Request::builder()
            .method(method.clone())
            .uri("http://orders.local/orders/42/status")
            .body(Full::new(Bytes::from_static(b"shipped")))
            .unwrap();
        let upstream = Upstream::scripted([Step::Status(503)], Step::Status(200));
        let res = upstream.behind(unbudgeted()).oneshot(req).await.unwrap();
        assert_eq!(attempts_of(&res), 2, "{method}");
    }
}

// ---------------------------------------------------------------------------------------
// Side effects: never resent once their bytes may have left, unless keyed
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn post_without_key_answered_503_is_not_retried() {
    let upstream = Upstream::always(Step::Status(503));
    let res = upstream
        .behind(unbudgeted())
        .oneshot(post_without_key())
        .await
        .unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(attempts_of(&res), 1);
    assert_eq!(upstream.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn patch_without_key_answered_503_is_not_retried() {
    let req = Request::patch("http://orders.local/orders/42")
        .body(Full::new(Bytes::from_static(b"{\"qty\":2}")))
        .unwrap();
    let upstream = Upstream::always(Step::Status(503));
    let res = upstream.behind(unbudgeted()).oneshot(req).await.unwrap();
    assert_eq!(attempts_of(&res), 1);
}

#[tokio::test(start_paused = true)]
async fn post_without_key_refused_before_the_write_is_retried() {
    let upstream = Upstream::scripted(
        [Step::Fail(io::ErrorKind::ConnectionRefused)],
        Step::Status(201),
    );
    let res = upstream
        .behind(unbudgeted())
        .oneshot(post_without_key())
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    assert_eq!(attempts_of(&res), 2);
    assert_eq!(upstream.calls(), 2);
}

#[tokio::test(start_paused = true)]
async fn post_with_idempotency_key_answered_503_is_retried() {
    let upstream = Upstream::scripted([Step::Status(503)], Step::Status(201));
    let res = upstream
        .behind(unbudgeted())
        .oneshot(post_with_key())
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    assert_eq!(attempts_of(&res), 2);
    let seen = upstream.seen();
    assert!(seen
        .iter()
        .all(|s| s.headers["idempotency-key"] == "\"order-42-charge\""));
}

#[tokio::test(start_paused = true)]
async fn post_marked_as_read_answered_503_is_retried() {
    let mut req = post_without_key();
    req.extensions_mut().insert(EffectClass::Read);
    let upstream = Upstream::scripted([Step::Status(503)], Step::Status(200));
    let res = upstream.behind(unbudgeted()).oneshot(req).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(attempts_of(&res), 2);
}

#[tokio::test(start_paused = true)]
async fn get_marked_as_side_effect_without_key_is_not_retried() {
    let mut req = get();
    req.extensions_mut().insert(EffectClass::SideEffect);
    let upstream = Upstream::always(Step::Status(503));
    let res = upstream.behind(unbudgeted()).oneshot(req).await.unwrap();
    assert_eq!(attempts_of(&res), 1);
}

#[tokio::test(start_paused = true)]
async fn post_without_key_reset_after_the_write_is_not_retried() {
    let upstream = Upstream::scripted(
        [Step::Fail(io::ErrorKind::ConnectionReset)],
        Step::Status(201),
    );
    let err = upstream
        .behind(unbudgeted())
        .oneshot(post_without_key())
        .await
        .unwrap_err();
    assert_eq!(upstream.calls(), 1);
    assert!(err.is_inner(), "{err:?}");
    assert_ne!(err.phase(), Some(FailurePhase::PreWrite));
    assert!(err.phase().unwrap().may_have_been_sent());
    let io = err.into_inner().unwrap().downcast::<io::Error>().unwrap();
    assert_eq!(io.kind(), io::ErrorKind::ConnectionReset);
}

#[tokio::test(start_paused = true)]
async fn post_with_key_reset_after_the_write_is_retried() {
    let upstream = Upstream::scripted(
        [Step::Fail(io::ErrorKind::ConnectionReset)],
        Step::Status(201),
    );
    let res = upstream
        .behind(unbudgeted())
        .oneshot(post_with_key())
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    assert_eq!(attempts_of(&res), 2);
}

// ---------------------------------------------------------------------------------------
// Per-attempt timeout
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn get_whose_first_attempt_hangs_is_retried_after_the_attempt_timeout() {
    let upstream = Upstream::scripted([Step::Hang], Step::Status(200));
    let policy = RetryPolicy::builder()
        .attempt_timeout(Duration::from_secs(1))
        .no_budget()
        .build()
        .unwrap();
    let start = Instant::now();
    let res = upstream.behind(policy).oneshot(get()).await.unwrap();
    let elapsed = start.elapsed();
    assert_eq!(res.status(), 200);
    assert_eq!(attempts_of(&res), 2);
    assert!(
        elapsed >= Duration::from_secs(1) && elapsed <= Duration::from_secs(1) + FIRST_CEILING,
        "{elapsed:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn post_without_key_that_times_out_is_not_retried() {
    let upstream = Upstream::scripted([Step::Hang], Step::Status(201));
    let policy = RetryPolicy::builder()
        .attempt_timeout(Duration::from_secs(1))
        .no_budget()
        .build()
        .unwrap();
    let start = Instant::now();
    let err = upstream
        .behind(policy)
        .oneshot(post_without_key())
        .await
        .unwrap_err();
    assert!(err.is_timeout(), "{err:?}");
    assert_eq!(err.phase(), Some(FailurePhase::Unknown));
    assert_eq!(upstream.calls(), 1);
    assert_eq!(start.elapsed(), Duration::from_secs(1));
}

#[tokio::test(start_paused = true)]
async fn get_that_always_times_out_ends_with_a_timeout_error_after_the_cap() {
    let upstream = Upstream::always(Step::Hang);
    let policy = RetryPolicy::builder()
        .attempt_timeout(Duration::from_secs(1))
        .no_budget()
        .build()
        .unwrap();
    let start = Instant::now();
    let err = upstream.behind(policy).oneshot(get()).await.unwrap_err();
    let elapsed = start.elapsed();
    assert!(err.is_timeout(), "{err:?}");
    assert_eq!(upstream.calls(), 3);
    assert!(
        elapsed >= Duration::from_secs(3)
            && elapsed <= Duration::from_secs(3) + FIRST_CEILING + SECOND_CEILING,
        "{elapsed:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_slow_attempt_within_the_attempt_timeout_is_not_cut_short() {
    let upstream = Upstream::always(Step::Slow(
        Duration::from_millis(999),
        Box::new(Step::Status(200)),
    ));
    let policy = RetryPolicy::builder()
        .attempt_timeout(Duration::from_secs(1))
        .no_budget()
        .build()
        .unwrap();
    let res = upstream.behind(policy).oneshot(get()).await.unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(attempts_of(&res), 1);
}

#[tokio::test(start_paused = true)]
async fn post_with_key_that_times_out_is_retried() {
    let upstream = Upstream::scripted([Step::Hang], Step::Status(201));
    let policy = RetryPolicy::builder()
        .attempt_timeout(Duration::from_secs(1))
        .no_budget()
        .build()
        .unwrap();
    let res = upstream
        .behind(policy)
        .oneshot(post_with_key())
        .await
        .unwrap();
    assert_eq!(res.status(), 201);
    assert_eq!(attempts_of(&res), 2);
}

// ---------------------------------------------------------------------------------------
// Backoff timing
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn backoff_gaps_stay_within_the_full_jitter_ceilings() {
    for _ in 0..50 {
        let upstream = Upstream::always(Step::Status(503));
        upstream.behind(unbudgeted()).oneshot(get()).await.unwrap();
        let gaps = upstream.gaps();
        assert_eq!(gaps.len(), 2);
        assert!(gaps[0] <= FIRST_CEILING, "{gaps:?}");
        assert!(gaps[1] <= SECOND_CEILING, "{gaps:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn backoff_is_full_jitter_spread_over_the_whole_range() {
    let mut first_gaps = Vec::new();
    let mut second_gaps = Vec::new();
    for _ in 0..200 {
        let upstream = Upstream::always(Step::Status(503));
        upstream.behind(unbudgeted()).oneshot(get()).await.unwrap();
        let gaps = upstream.gaps();
        first_gaps.push(gaps[0]);
        second_gaps.push(gaps[1]);
    }
    let low = first_gaps
        .iter()
        .filter(|g| **g < Duration::from_millis(30))
        .count();
    let high = first_gaps
        .iter()
        .filter(|g| **g > Duration::from_millis(70))
        .count();
    // Uniform on [0, 100 ms]: about 60 of 200 in each tail; fewer than 10 is ~1e-14 likely.
    assert!(
        low >= 10 && high >= 10,
        "low {low}, high {high}: {first_gaps:?}"
    );
    let distinct: std::collections::BTreeSet<_> = first_gaps.iter().collect();
    assert!(distinct.len() > 20, "not jittered: {distinct:?}");
    // The second delay's ceiling doubled: some of them land above the first ceiling.
    assert!(second_gaps.iter().any(|g| *g > FIRST_CEILING));
    let mean = first_gaps.iter().sum::<Duration>() / 200;
    assert!(
        mean > Duration::from_millis(35) && mean < Duration::from_millis(65),
        "a full-jitter mean is half the ceiling: {mean:?}"
    );
}

// ---------------------------------------------------------------------------------------
// Maximum elapsed time
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn no_attempt_starts_past_max_elapsed() {
    let deadline = Duration::from_millis(250);
    let mut cut_short = 0;
    for _ in 0..100 {
        let upstream = Upstream::always(Step::Status(503));
        let policy = RetryPolicy::builder()
            .max_attempts(5)
            .max_elapsed(deadline)
            .backoff(Duration::from_millis(200), Duration::from_secs(10))
            .no_budget()
            .build()
            .unwrap();
        let res = upstream.behind(policy).oneshot(get()).await.unwrap();
        let seen = upstream.seen();
        assert_eq!(attempts_of(&res) as usize, seen.len());
        let first = seen[0].at;
        for attempt in &seen {
            assert!(attempt.at - first <= deadline, "{:?}", attempt.at - first);
        }
        if seen.len() < 5 {
            cut_short += 1;
        }
    }
    // The backoff ceilings 200, 400, 800, 1600 ms make five attempts within 250 ms rare:
    // the deadline, not the attempt cap, ends most runs.
    assert!(
        cut_short > 50,
        "{cut_short} of 100 runs stopped by the deadline"
    );
}

#[tokio::test(start_paused = true)]
async fn max_elapsed_stops_retrying_when_slow_attempts_use_up_the_window() {
    // Each attempt takes 100 ms and the backoff is a millisecond at most: attempts start at
    // about 0, 100 and 200 ms; the fourth would start after 300 ms, past the 250 ms deadline.
    let upstream = Upstream::always(Step::Slow(
        Duration::from_millis(100),
        Box::new(Step::Status(503)),
    ));
    let policy = RetryPolicy::builder()
        .max_attempts(5)
        .max_elapsed(Duration::from_millis(250))
        .backoff(Duration::from_micros(500), Duration::from_micros(500))
        .no_budget()
        .build()
        .unwrap();
    let start = Instant::now();
    let res = upstream.behind(policy).oneshot(get()).await.unwrap();
    assert_eq!(res.status(), 503);
    assert_eq!(attempts_of(&res), 3);
    let starts: Vec<_> = upstream.seen().iter().map(|s| s.at - start).collect();
    for (start, expected) in starts.iter().zip([0, 100, 200]) {
        let expected = Duration::from_millis(expected);
        assert!(
            *start >= expected && *start <= expected + Duration::from_millis(3),
            "attempt start times {starts:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// A custom classifier
// ---------------------------------------------------------------------------------------

/// Retries 404s (say, a read-your-writes lag), nothing else; records what it was asked.
#[derive(Debug, Default)]
struct RetryNotFoundOnly {
    asked: Asked,
}

/// `(attempt, status)` for every attempt a classifier was asked about.
type Asked = Arc<Mutex<Vec<(u32, Option<u16>)>>>;

impl ClassifyRetry for RetryNotFoundOnly {
    fn classify(&self, ctx: &RetryContext<'_>) -> RetryDecision {
        let status = match ctx.result {
            AttemptResult::Response { status, .. } => Some(status.as_u16()),
            _ => None,
        };
        self.asked.lock().unwrap().push((ctx.attempt, status));
        if status == Some(404) {
            RetryDecision::Retry
        } else {
            RetryDecision::Stop
        }
    }
}

#[tokio::test(start_paused = true)]
async fn custom_classifier_replaces_the_default_rules() {
    let classifier = RetryNotFoundOnly::default();
    let asked = classifier.asked.clone();
    let policy = RetryPolicy::builder()
        .classifier(classifier)
        .no_budget()
        .build()
        .unwrap();

    // A 404 is now retried…
    let upstream = Upstream::scripted([Step::Status(404), Step::Status(404)], Step::Status(200));
    let res = upstream
        .behind(policy.clone())
        .oneshot(get())
        .await
        .unwrap();
    assert_eq!(res.status(), 200);
    assert_eq!(attempts_of(&res), 3);
    // The last allowed attempt is final whatever it is: the classifier is not asked.
    assert_eq!(*asked.lock().unwrap(), [(1, Some(404)), (2, Some(404))]);

    // …even for an unkeyed POST, which the default rules never resend…
    let upstream = Upstream::scripted([Step::Status(404)], Step::Status(201));
    let res = upstream
        .behind(policy.clone())
        .oneshot(post_without_key())
        .await
        .unwrap();
    assert_eq!(attempts_of(&res), 2);

    // …while a 503 and a pre-write failure, which the default rules retry, are not.
    let upstream = Upstream::always(Step::Status(503));
    let res = upstream
        .behind(policy.clone())
        .oneshot(get())
        .await
        .unwrap();
    assert_eq!(attempts_of(&res), 1);
    let upstream = Upstream::always(Step::Fail(io::ErrorKind::ConnectionRefused));
    upstream.behind(policy).oneshot(get()).await.unwrap_err();
    assert_eq!(upstream.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn custom_classifier_is_still_bound_by_the_attempt_cap() {
    let policy = RetryPolicy::builder()
        .classifier(RetryNotFoundOnly::default())
        .max_attempts(4)
        .no_budget()
        .build()
        .unwrap();
    let upstream = Upstream::always(Step::Status(404));
    let res = upstream.behind(policy).oneshot(get()).await.unwrap();
    assert_eq!(attempts_of(&res), 4);
}

// ---------------------------------------------------------------------------------------
// Errors after the retries are exhausted
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn exhausted_after_write_errors_surface_as_inner_errors_in_doubt() {
    let upstream = Upstream::always(Step::Fail(io::ErrorKind::ConnectionReset));
    let err: Error = upstream
        .behind(unbudgeted())
        .oneshot(get())
        .await
        .unwrap_err();
    assert_eq!(upstream.calls(), 3, "a GET reset is retried up to the cap");
    assert!(err.is_inner(), "{err:?}");
    assert!(!err.is_timeout());
    assert_eq!(err.phase(), Some(FailurePhase::Unknown));
    let io = err.into_inner().unwrap().downcast::<io::Error>().unwrap();
    assert_eq!(io.kind(), io::ErrorKind::ConnectionReset);
}

#[tokio::test(start_paused = true)]
async fn exhausted_pre_write_errors_surface_as_inner_errors_never_sent() {
    let upstream = Upstream::always(Step::Fail(io::ErrorKind::ConnectionRefused));
    let err = upstream
        .behind(unbudgeted())
        .oneshot(post_without_key())
        .await
        .unwrap_err();
    assert_eq!(
        upstream.calls(),
        3,
        "pre-write failures are retried even unkeyed"
    );
    assert!(err.is_inner(), "{err:?}");
    assert_eq!(err.phase(), Some(FailurePhase::PreWrite));
    let boxed: tower_idempotency::BoxError = err.into();
    let ours = boxed.downcast::<Error>().expect("converts into a BoxError");
    let io = ours.into_inner().unwrap().downcast::<io::Error>().unwrap();
    assert_eq!(io.kind(), io::ErrorKind::ConnectionRefused);
}

#[tokio::test(start_paused = true)]
async fn the_last_attempts_error_is_the_one_returned() {
    let upstream = Upstream::scripted(
        [
            Step::Fail(io::ErrorKind::ConnectionRefused),
            Step::Fail(io::ErrorKind::ConnectionRefused),
        ],
        Step::Fail(io::ErrorKind::ConnectionAborted),
    );
    let err = upstream
        .behind(unbudgeted())
        .oneshot(get())
        .await
        .unwrap_err();
    assert_eq!(upstream.calls(), 3);
    assert_eq!(err.phase(), Some(FailurePhase::Unknown));
    let io = err.into_inner().unwrap().downcast::<io::Error>().unwrap();
    assert_eq!(io.kind(), io::ErrorKind::ConnectionAborted);
}

// ---------------------------------------------------------------------------------------
// With the fault-injecting provider double
// ---------------------------------------------------------------------------------------

#[cfg(feature = "test-util")]
mod with_side_effect_service {
    use super::*;
    use tower_idempotency::testing::{Fault, SideEffectService};

    fn charge() -> Request<Full<Bytes>> {
        Request::post("http://payments.local/charges")
            .header("idempotency-key", "\"order-42\"")
            .body(Full::new(Bytes::from_static(b"{\"amount\":4200}")))
            .unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn keyed_charge_that_commits_then_times_out_is_charged_once() {
        let provider = SideEffectService::new().with_faults([Fault::CommitThenTimeout]);
        let policy = RetryPolicy::builder()
            .attempt_timeout(Duration::from_secs(1))
            .no_budget()
            .build()
            .unwrap();
        let mut client = ServiceBuilder::new()
            .layer(FrozenRetryLayer::new(policy))
            .service(provider.clone());
        let ready = ServiceExt::<Request<Full<Bytes>>>::ready(&mut client)
            .await
            .unwrap();
        let res = ready.call(charge()).await.unwrap();
        assert_eq!(res.status(), StatusCode::CREATED);
        assert_eq!(attempts_of(&res), 2);
        assert_eq!(res.headers()["idempotent-replayed"], "true");
        assert_eq!(provider.effects_for_key("order-42"), 1);
        let attempts = provider.attempts();
        assert_eq!(attempts.len(), 2);
        assert_eq!(attempts[0].body(), attempts[1].body());
        assert_eq!(attempts[0].headers(), attempts[1].headers());
    }

    #[tokio::test(start_paused = true)]
    async fn unkeyed_charge_refused_before_send_is_retried_and_charged_once() {
        let provider = SideEffectService::new().with_faults([Fault::RefuseBeforeSend]);
        let client = ServiceBuilder::new()
            .layer(FrozenRetryLayer::new(unbudgeted()))
            .service(provider.clone());
        let res = client.oneshot(post_without_key()).await.unwrap();
        assert_eq!(res.status(), StatusCode::CREATED);
        assert_eq!(attempts_of(&res), 2);
        assert_eq!(provider.calls(), 2);
        assert_eq!(provider.effects_without_key(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn unkeyed_charge_answered_500_after_commit_is_not_charged_twice() {
        let provider = SideEffectService::new().with_faults([Fault::ServerError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            commit: true,
        }]);
        let client = ServiceBuilder::new()
            .layer(FrozenRetryLayer::new(unbudgeted()))
            .service(provider.clone());
        let res = client.oneshot(post_without_key()).await.unwrap();
        assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(attempts_of(&res), 1);
        assert_eq!(provider.effects_without_key(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn keyed_charge_answered_503_after_commit_is_retried_and_replayed() {
        let provider = SideEffectService::new().with_faults([Fault::ServerError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            commit: true,
        }]);
        let client = ServiceBuilder::new()
            .layer(FrozenRetryLayer::new(unbudgeted()))
            .service(provider.clone());
        let res = client.oneshot(charge()).await.unwrap();
        assert_eq!(res.status(), StatusCode::CREATED);
        assert_eq!(attempts_of(&res), 2);
        assert_eq!(provider.effects_for_key("order-42"), 1);
    }
}
