//! gRFC A6 retries for tonic channels, resending the frozen message byte for byte.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::request::Parts;
use http::{HeaderValue, Request, Response};
use http_body_util::Full;
use tokio::time::Instant;
use tonic::Code;
use tower::ServiceExt;
use tower_layer::Layer;
use tower_service::Service;

use super::methods::{Method, Methods};
use super::wire::{self, Pushback};
use crate::frozen::collect_request;
use crate::phase::{classify, FailurePhase};
use crate::retry::{Attempts, FullJitter, RetryPolicy};
use crate::{BoxError, Error};

/// The request body of a tonic channel and of the clients it generates.
type GrpcBody = tonic::body::Body;

/// Wraps a tonic channel (or any `Service<http::Request<tonic::body::Body>>`) in [`Retry`]:
/// unary calls frozen once and resent byte for byte, as gRFC A6 retries them.
///
/// See the [module docs](crate::grpc) for the rules and an example.
#[derive(Clone, Debug)]
#[must_use = "a layer does nothing until it wraps a service"]
pub struct RetryLayer {
    shared: Arc<Shared>,
}

/// What every call through a layer shares.
#[derive(Clone, Debug)]
struct Shared {
    policy: RetryPolicy,
    methods: Methods,
    /// The retryable codes, one bit per code (gRPC has 17).
    retryable: u32,
}

impl RetryLayer {
    /// A layer retrying the calls of `methods` per `policy` (its attempts, backoff, budget,
    /// deadline, attempt timeout, body limit and key header; its HTTP classifier is not
    /// used). Retryable codes: `UNAVAILABLE` alone, as gRFC A6's examples configure.
    pub fn new(policy: RetryPolicy, methods: Methods) -> Self {
        Self {
            shared: Arc::new(Shared {
                policy,
                methods,
                retryable: bit(Code::Unavailable),
            }),
        }
    }

    /// The status codes a trailers-only answer is retried on (default `UNAVAILABLE`).
    ///
    /// `OK` is never retried, whatever this list says.
    pub fn retryable_codes(mut self, codes: impl IntoIterator<Item = Code>) -> Self {
        let retryable = codes.into_iter().fold(0, |bits, code| bits | bit(code)) & !bit(Code::Ok);
        Arc::make_mut(&mut self.shared).retryable = retryable;
        self
    }
}

fn bit(code: Code) -> u32 {
    1 << (code as i32 as u32 & 31)
}

impl<S> Layer<S> for RetryLayer {
    type Service = Retry<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Retry {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// Retries unary gRPC calls, resending their frozen bytes. See the
/// [module docs](crate::grpc).
#[derive(Clone, Debug)]
pub struct Retry<S> {
    inner: S,
    shared: Arc<Shared>,
}

impl<S> Retry<S> {
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

impl<S, ResBody> Service<Request<GrpcBody>> for Retry<S>
where
    S: Service<Request<GrpcBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
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

    fn call(&mut self, req: Request<GrpcBody>) -> Self::Future {
        // Take the instance that was driven to readiness; leave a clone in its place.
        let clone = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, clone);
        let method = self
            .shared
            .methods
            .get(req.uri().path())
            .filter(|method| method.has_one_request());
        let future: BoxFuture<ResBody> = match method {
            Some(method) => Box::pin(retried(ready, self.shared.clone(), method, req)),
            None => Box::pin(passed_through(ready, req)),
        };
        ResponseFuture { future }
    }
}

type BoxFuture<B> = Pin<Box<dyn Future<Output = Result<Response<B>, Error>> + Send>>;

/// The future of [`Retry`]: all attempts of one call.
pub struct ResponseFuture<B> {
    future: BoxFuture<B>,
}

impl<B> Future for ResponseFuture<B> {
    type Output = Result<Response<B>, Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.future.as_mut().poll(cx)
    }
}

impl<B> fmt::Debug for ResponseFuture<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

/// A call the table does not name as having one request message: sent once, as it came.
async fn passed_through<S, B>(mut ready: S, req: Request<GrpcBody>) -> Result<Response<B>, Error>
where
    S: Service<Request<GrpcBody>, Response = Response<B>>,
    S::Error: Into<BoxError>,
{
    ready.call(req).await.map_err(|err| {
        let err = err.into();
        let phase = classify_grpc(&*err, None);
        Error::inner(err, phase)
    })
}

/// The phase of a channel's failure: tonic reports a failed (re)connect as a
/// [`tonic::ConnectError`], which nothing left.
fn classify_grpc(
    err: &(dyn std::error::Error + 'static),
    custom: Option<&dyn crate::phase::ClassifyPhase>,
) -> FailurePhase {
    let mut link: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(error) = link {
        if error.is::<tonic::ConnectError>() {
            return FailurePhase::PreWrite;
        }
        link = error.source();
    }
    classify(err, custom)
}

/// How one attempt ended, as the retry decision reads it.
enum Outcome<B> {
    /// The answer's headers arrived: the call is committed unless they carry its status.
    Answer(Response<B>),
    /// No answer: the channel failed, or the attempt timed out.
    Failed(Error),
}

/// One call's attempts: what they share, and how far they got.
struct Attempting<S> {
    inner: S,
    shared: Arc<Shared>,
    method: Method,
    head: Parts,
    body: Bytes,
    /// The caller's deadline, from its `grpc-timeout`: every attempt is sent with what is
    /// left of it, and no retry starts after it.
    deadline: Option<Instant>,
    /// `max_elapsed` after the first attempt.
    give_up: Instant,
    backoff: Option<FullJitter>,
    /// How far any attempt so far may have got.
    furthest: FailurePhase,
}

async fn retried<S, B>(
    ready: S,
    shared: Arc<Shared>,
    method: Method,
    req: Request<GrpcBody>,
) -> Result<Response<B>, Error>
where
    S: Service<Request<GrpcBody>, Response = Response<B>> + Clone,
    S::Error: Into<BoxError>,
{
    let (head, body) = collect_request(req, shared.policy.body_limit).await?;
    let started = Instant::now();
    if let Some(budget) = &shared.policy.budget {
        budget.deposit_at(started);
    }
    let mut call = Attempting {
        deadline: wire::timeout(&head.headers).map(|timeout| started + timeout),
        give_up: started + shared.policy.max_elapsed,
        inner: ready.clone(),
        shared,
        method,
        head,
        body,
        backoff: None,
        furthest: FailurePhase::PreWrite,
    };
    let mut ready = Some(ready);
    let mut attempt = 1;
    loop {
        let outcome = call.send(ready.take(), attempt).await;
        match call.pause_before_retry(&outcome, attempt) {
            Some(pause) => {
                tokio::time::sleep(pause).await;
                attempt += 1;
            }
            None => return call.finish(outcome, attempt),
        }
    }
}

impl<S, B> Attempting<S>
where
    S: Service<Request<GrpcBody>, Response = Response<B>> + Clone,
    S::Error: Into<BoxError>,
{
    /// Send attempt number `attempt` through `ready` (the caller's instance, already ready,
    /// for the first) or a fresh clone.
    async fn send(&mut self, ready: Option<S>, attempt: u32) -> Outcome<B> {
        let mut inner = match ready {
            Some(inner) => inner,
            None => match self.inner.clone().ready_oneshot().await {
                Ok(inner) => inner,
                Err(err) => {
                    return Outcome::Failed(Error::inner(err.into(), FailurePhase::PreWrite))
                }
            },
        };
        let request = self.attempt_request(attempt);
        let sent = inner.call(request);
        let result = match self.shared.policy.attempt_timeout {
            Some(limit) => match tokio::time::timeout(limit, sent).await {
                Ok(result) => result,
                Err(_elapsed) => return self.failed(Error::attempt_timeout()),
            },
            None => sent.await,
        };
        match result {
            Ok(response) => {
                self.furthest = FailurePhase::Unknown;
                Outcome::Answer(response)
            }
            Err(err) => {
                let err = err.into();
                let phase = classify_grpc(&*err, self.shared.policy.phase_classifier.as_deref());
                self.failed(Error::inner(err, phase))
            }
        }
    }

    fn failed(&mut self, error: Error) -> Outcome<B> {
        let phase = error.phase().unwrap_or(FailurePhase::Unknown);
        self.furthest = self.furthest.strongest(phase);
        Outcome::Failed(error)
    }

    /// The frozen request, as attempt number `attempt` sends it: the same bytes, with
    /// `grpc-previous-rpc-attempts` on a retry and what is left of the caller's deadline.
    fn attempt_request(&self, attempt: u32) -> Request<GrpcBody> {
        let mut head = self.head.clone();
        if attempt > 1 {
            head.headers
                .insert(wire::PREVIOUS_ATTEMPTS, HeaderValue::from(attempt - 1));
        }
        if let Some(deadline) = self.deadline {
            let remaining = deadline.saturating_duration_since(Instant::now());
            head.headers
                .insert(wire::GRPC_TIMEOUT, wire::timeout_value(remaining));
        }
        Request::from_parts(head, GrpcBody::new(Full::new(self.body.clone())))
    }

    /// How long to wait before the next attempt, or `None` to end with `outcome`.
    fn pause_before_retry(&mut self, outcome: &Outcome<B>, attempt: u32) -> Option<Duration> {
        let (code, pushback, may_have_run) = match outcome {
            Outcome::Answer(response) => {
                // gRFC A6: an answer whose headers arrived without its status is committed.
                let code = wire::status_in_head(response.status(), response.headers())?;
                (code, wire::pushback(response.headers()), true)
            }
            Outcome::Failed(error) => {
                let sent = error.phase().is_none_or(FailurePhase::may_have_been_sent);
                (Code::Unavailable, Pushback::Absent, sent)
            }
        };
        let retryable = self.shared.retryable & bit(code) != 0 || !may_have_run;
        let safe = !may_have_run || self.method.is_retry_safe() || self.is_keyed();
        if !retryable || !safe || attempt >= self.shared.policy.max_attempts {
            return None;
        }
        let pause = match pushback {
            Pushback::Refused => return None,
            Pushback::After(wait) => wait,
            Pushback::Absent => self.backoff().next_delay(),
        };
        let resume_at = Instant::now() + pause;
        if resume_at > self.give_up || self.deadline.is_some_and(|deadline| resume_at >= deadline) {
            return None;
        }
        // Throttling (gRFC A6): the budget's share of recent calls; asked last, so a retry
        // the rules above refuse costs none of it.
        let budget = self.shared.policy.budget.as_ref();
        if budget.is_some_and(|budget| !budget.withdraw_at(Instant::now())) {
            return None;
        }
        Some(pause)
    }

    fn backoff(&mut self) -> &mut FullJitter {
        let policy = &self.shared.policy;
        self.backoff
            .get_or_insert_with(|| FullJitter::new(policy.backoff_base, policy.backoff_cap))
    }

    /// Whether the call carries an idempotency key (under the policy's key header), which
    /// a server that deduplicates answers a resend with the first call's outcome.
    fn is_keyed(&self) -> bool {
        self.head
            .headers
            .contains_key(self.shared.policy.key_header.name())
    }

    fn finish(self, outcome: Outcome<B>, attempts: u32) -> Result<Response<B>, Error> {
        match outcome {
            Outcome::Answer(mut response) => {
                if attempts > 1 {
                    response.extensions_mut().insert(Attempts::new(attempts));
                }
                Ok(response)
            }
            Outcome::Failed(error) => Err(error.after_earlier_attempts(self.furthest)),
        }
    }
}
