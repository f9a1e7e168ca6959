//! The ledger's part of a keyed request: read the body, claim the key, and answer without
//! the handler (a replay, a refusal, a conflict) or hand the owned key to it.
//!
//! A future of its own rather than an `async fn`, so that the request's future is a type
//! that can be named and held in place: a replay or a refusal allocates no future at all,
//! and only a request whose handler runs boxes that part, where its claim is decided (see
//! [`Handling`] and [`Keyed`](super::staged::Keyed)).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::HeaderValue;
use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use tower_service::Service;

use super::body::RequestBody;
use super::execute::{self, Execute};
use super::staged::Admitted;
use super::{
    call, original_target, outcome, problem, replay, verified_body_digest, InDoubtPolicy, Owned,
    Report, ServerFace, Transaction, IDEMPOTENCY_FAIL_OPEN,
};
use crate::digest::{BodyDigest, DigestError};
use crate::fingerprint::Fingerprint;
use crate::frozen::CollectRequest;
use crate::idempotency::body::ResponseBody;
use crate::idempotency::decision::decision_of;
use crate::idempotency::decision::{self, Decision, Face, Track, WireKey};
use crate::key::HeaderKey;
use crate::ledger::{Begin, BeginRequest, LedgerKey, StoreError};
use crate::BoxError;

/// What claiming a key came to, and the transaction it was made in (transactional mode).
type Claimed = (Result<Begin, StoreError>, Transaction);

/// A claim that could not be made in place: the store awaits, a busy key is waited for, a
/// lost answer is asked again, or the transactional mode opens its transaction. Boxed:
/// held in place, its state would weigh on every request's future.
type Claiming = Pin<Box<dyn Future<Output = Claimed> + Send>>;

/// A handler run unprotected because the ledger is unavailable ([`fail_open`]). Boxed for
/// the reason [`Claiming`] is.
///
/// [`fail_open`]: super::ServerBuilder::fail_open
type FailingOpen<ResB, E> = Pin<Box<dyn Future<Output = Result<Response<ResB>, E>> + Send>>;

/// What a keyed request's ledger part answers without the handler.
type Answer<ResB, E> = Result<Response<ResponseBody<ResB>>, E>;

/// The handler's part of a request whose key is owned, boxed where it is made: the request
/// and what settling it needs go into the box once, rather than through each future on
/// the way to it.
pub(super) type Handling<S, B, ResB> = Pin<
    Box<
        Execute<
            <S as Service<Request<RequestBody<B>>>>::Future,
            ResB,
            <S as Service<Request<RequestBody<B>>>>::Error,
        >,
    >,
>;

pin_project! {
    /// The ledger's part of one keyed request (see the module docs).
    pub(super) struct Admit<S, B, ResB>
    where
        S: Service<Request<RequestBody<B>>, Response = Response<ResB>>,
    {
        // The instance our caller polled ready (taken in `call`), until it is handed on.
        inner: Option<S>,
        server: Arc<ServerFace>,
        key: Option<HeaderKey>,
        ledger_key: LedgerKey,
        // The short id of the key's scope: its share of a store's budget.
        scope: u64,
        // Whether the request carries a `Content-Digest` to check its body by.
        digest_sent: bool,
        started: Option<tokio::time::Instant>,
        #[pin]
        step: Step<S, B, ResB>,
    }
}

pin_project! {
    #[project = StepProj]
    enum Step<S, B, ResB>
    where
        S: Service<Request<RequestBody<B>>, Response = Response<ResB>>,
    {
        Reading { #[pin] collect: CollectRequest<B> },
        Claiming { claiming: Claiming, claimant: Option<Claimant> },
        FailingOpen { running: FailingOpen<ResB, S::Error>, report: Option<Report> },
        Done,
    }
}

/// A request waiting for its claim: what deciding needs once the answer comes.
struct Claimant {
    parts: Parts,
    key: HeaderKey,
    body: Bytes,
    digest: BodyDigest,
    report: Report,
}

impl<S, B, ResB> Admit<S, B, ResB>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>>,
    B: Body,
{
    /// The ledger's part of a request whose body `collect` reads, under its key (as sent,
    /// and as the ledger knows it); `digest_sent` says whether it carries a `Content-Digest`.
    pub(super) fn new(
        inner: S,
        server: Arc<ServerFace>,
        (key, ledger_key, scope): (HeaderKey, LedgerKey, u64),
        digest_sent: bool,
        collect: CollectRequest<B>,
        started: Option<tokio::time::Instant>,
    ) -> Self {
        Self {
            inner: Some(inner),
            server,
            key: Some(key),
            ledger_key,
            scope,
            digest_sent,
            started,
            step: Step::Reading { collect },
        }
    }
}

/// The answer to a body that could not be taken in.
pub(super) fn refused_body<T>(
    server: &ServerFace,
    err: &crate::Error,
) -> Response<ResponseBody<T>> {
    if err.is_body_too_large() {
        outcome("body-too-large");
        return problem::body_too_large(server.body_limit);
    }
    outcome("body-unreadable");
    tracing::debug!(%err, "could not read the request body");
    problem::body_unreadable()
}

impl<S, B, ResB> Future for Admit<S, B, ResB>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Unpin + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Output = Admitted<Answer<ResB, S::Error>, Handling<S, B, ResB>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            let next = match this.step.as_mut().project() {
                StepProj::Reading { collect } => match std::task::ready!(collect.poll(cx)) {
                    Ok(read) => {
                        let key = this.key.take().expect("read once");
                        let report = reporting(this.server, &key, *this.started);
                        let keys = (key, *this.ledger_key, *this.scope);
                        claim(
                            this.server,
                            this.inner,
                            keys,
                            *this.digest_sent,
                            read,
                            report,
                        )
                    }
                    Err(err) => {
                        let answer = refused_body(this.server, &err);
                        return done(this.step, Admitted::Answer(Ok(answer)));
                    }
                },
                StepProj::Claiming { claiming, claimant } => {
                    let claimed = std::task::ready!(claiming.as_mut().poll(cx));
                    let claimant = claimant.take().expect("claimed once");
                    decide(this.server, this.inner, *this.ledger_key, claimant, claimed)
                }
                StepProj::FailingOpen { running, report } => {
                    let answered = std::task::ready!(running.as_mut().poll(cx)).map(|response| {
                        let mut response = response.map(ResponseBody::inner);
                        response.headers_mut().insert(
                            IDEMPOTENCY_FAIL_OPEN.clone(),
                            HeaderValue::from_static("true"),
                        );
                        response
                    });
                    let report = report.take().expect("answered once");
                    report.answered(&answered);
                    return done(this.step, Admitted::Answer(answered));
                }
                StepProj::Done => panic!("ServerFuture polled after completion"),
            };
            match next {
                Next::Step(step) => this.step.set(step),
                Next::Admitted(admitted) => return done(this.step, admitted),
            }
        }
    }
}

/// Where deciding leaves the ledger's part: another step, or its end.
// The next step is built once and moved into place; boxing it is what this future avoids.
#[allow(clippy::large_enum_variant)]
enum Next<S, B, ResB>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>>,
    B: Body,
{
    Step(Step<S, B, ResB>),
    Admitted(Admitted<Answer<ResB, S::Error>, Handling<S, B, ResB>>),
}

fn done<S, B, ResB, T>(mut step: Pin<&mut Step<S, B, ResB>>, admitted: T) -> Poll<T>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>>,
    B: Body,
{
    step.set(Step::Done);
    Poll::Ready(admitted)
}

/// What the hook will hear of this request: every answer once the body is read is
/// reported, refusals included.
fn reporting(
    server: &ServerFace,
    key: &HeaderKey,
    started: Option<tokio::time::Instant>,
) -> Report {
    // Kept for the decision events and the hook only when they could use it: it is a copy.
    let hook = server.on_outcome.clone();
    let wire = (hook.is_some() || tracing::enabled!(tracing::Level::WARN))
        .then(|| WireKey::Header(key.clone()));
    let track = Track::new(Face::Server, wire);
    if let Some(wire) = track.wire() {
        decision::record_in_layer_span("key", tracing::field::display(decision::KeyDigest(wire)));
    }
    Report {
        track,
        hook,
        started,
    }
}

/// The answer to a body that is not what its `Content-Digest` says.
fn refused_digest<T>(err: &DigestError) -> Response<ResponseBody<T>> {
    outcome(if err.is_mismatch() {
        "content-digest-mismatch"
    } else {
        "content-digest-invalid"
    });
    problem::content_digest(err)
}

/// The body is read: check it against its `Content-Digest`, then claim the key, in place
/// when the store answers at once, else by a boxed future.
fn claim<S, B, ResB>(
    server: &Arc<ServerFace>,
    inner: &mut Option<S>,
    (key, ledger_key, scope): (HeaderKey, LedgerKey, u64),
    digest_sent: bool,
    (parts, body): (Parts, Bytes),
    report: Report,
) -> Next<S, B, ResB>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    ResB: Body<Data = Bytes> + Unpin + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    // Bytes that are not what their sender digested are refused before the ledger sees
    // them; a verified sha-256 is the digest the fingerprint is made of (one pass).
    let digest = match verified_body_digest(&parts.headers, digest_sent, &body) {
        Ok(digest) => digest,
        Err(err) => return answered_by(report, refused_digest(&err)),
    };
    // One key is one request: the method, the target as the client sent it and the body.
    // A reuse with anything else is a mismatch, never a second run and never a replay.
    let fingerprint = Fingerprint::of_received(&parts.method, original_target(&parts), &digest);
    let claimant = Claimant {
        parts,
        key,
        body,
        digest,
        report,
    };
    let mut begin = server
        .ledger
        .request(ledger_key, fingerprint)
        .with_scope_id(scope);
    if server.in_doubt == InDoubtPolicy::OutcomeUnknown {
        // An in-doubt key is only ever looked at: answering it never changes its record,
        // so a client that keeps retrying cannot keep it alive.
        begin = begin.probe();
    }
    match claim_in_place(server, begin) {
        Ok(claimed) => decide(server, inner, ledger_key, claimant, claimed),
        Err(claiming) => Next::Step(Step::Claiming {
            claiming,
            claimant: Some(claimant),
        }),
    }
}

/// Claim the key through the engine in place, or say how to claim it later: through the
/// engine's waiting and retrying path, or in transactional mode as the first statement of
/// the request's transaction.
fn claim_in_place(server: &Arc<ServerFace>, begin: BeginRequest) -> Result<Claimed, Claiming> {
    #[cfg(feature = "postgres")]
    if server.transactional.is_some() {
        let server = server.clone();
        return Err(Box::pin(async move {
            let database = server.transactional.as_ref().expect("checked above");
            match super::transactional::claim(&server, database, &begin).await {
                Ok((answer, transaction)) => (Ok(answer), transaction),
                Err(err) => (Err(err), None),
            }
        }));
    }
    match server.ledger.begin_in_place(&begin, server.busy) {
        Ok(answer) => Ok((answer, None)),
        Err(lost) => {
            let server = server.clone();
            Err(Box::pin(async move {
                let answer = server.ledger.begin_after(begin, server.busy, lost).await;
                (answer, None)
            }))
        }
    }
}

/// Act on the ledger's answer: answer without the handler, or hand it the owned key.
fn decide<S, B, ResB>(
    server: &Arc<ServerFace>,
    inner: &mut Option<S>,
    ledger_key: LedgerKey,
    claimant: Claimant,
    (answered, transaction): Claimed,
) -> Next<S, B, ResB>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    ResB: Body<Data = Bytes> + Unpin + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let Claimant {
        parts,
        key: header_key,
        body,
        digest,
        report,
    } = claimant;
    let answer = match answered {
        Ok(answer) => answer,
        Err(err) if server.fail_open => {
            outcome("fail-open");
            tracing::warn!(%err, "ledger unavailable; running the handler unprotected (fail-open)");
            let inner = inner.take().expect("handed on once");
            let request = handler_request(parts, header_key, body);
            return Next::Step(Step::FailingOpen {
                running: Box::pin(call(inner, request)),
                report: Some(report),
            });
        }
        Err(err) if err.is_full() => {
            outcome("ledger-full");
            report.track.decided(Decision::Full);
            let retry_after = err.retry_after().unwrap_or(server.retry_after);
            return answered_by(report, problem::ledger_full(retry_after));
        }
        Err(err) => {
            outcome("ledger-unavailable");
            report.track.decided(Decision::Unavailable);
            tracing::error!(%err, "ledger unavailable; refusing the request (fail closed)");
            return answered_by(report, problem::ledger_unavailable(server.retry_after));
        }
    };
    report.track.decided(decision_of(&answer));
    let token = match answer {
        Begin::Acquired { token } => {
            outcome("executed");
            token
        }
        Begin::Resume { token, .. } => {
            // Only asked for under `RunAgain`: a probe is answered `InDoubt` instead.
            outcome("executed-again");
            tracing::info!("key in doubt; running the handler again (at least once)");
            token
        }
        Begin::InDoubt => {
            outcome("outcome-unknown");
            return answered_by(report, problem::outcome_unknown());
        }
        Begin::Replay(stored) => return answered_by(report, replay(server, stored)),
        Begin::Busy { retry_after } => {
            outcome("in-flight");
            let retry_after = retry_after.min(server.retry_after);
            return answered_by(report, problem::in_flight(retry_after));
        }
        Begin::Drift { stored, .. } => {
            outcome("payload-mismatch");
            // Made again rather than kept for the rare refusal: it costs a hash of the
            // method and the target, on this path alone.
            let new = Fingerprint::of_received(&parts.method, original_target(&parts), &digest);
            let differs: Vec<_> = stored.differing_parts(&new).collect();
            return answered_by(report, problem::payload_mismatch(&differs));
        }
        // Answers added later are not understood by this release: run nothing.
        #[allow(unreachable_patterns)]
        _ => {
            outcome("outcome-unknown");
            return answered_by(report, problem::outcome_unknown());
        }
    };
    let owned = Owned {
        inner: inner.take().expect("handed on once"),
        server: server.clone(),
        key: (ledger_key, digest),
        token,
        transaction,
        request: handler_request(parts, header_key, body),
        report,
    };
    Next::Admitted(Admitted::Handle(Box::pin(execute::handle(owned))))
}

/// The request the handler gets: the head as it came, with the key, which handlers can pass
/// on to their own downstream calls. Assembled only when the handler is to run: a replay
/// or a refusal never pays for the key's place in the extensions.
fn handler_request<B>(mut parts: Parts, key: HeaderKey, body: Bytes) -> Request<RequestBody<B>> {
    parts.extensions.insert(key);
    Request::from_parts(parts, RequestBody::buffered(body))
}

/// Answer `response` without the handler, telling the hook.
fn answered_by<S, B, ResB>(
    report: Report,
    response: Response<ResponseBody<ResB>>,
) -> Next<S, B, ResB>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>>,
    B: Body,
{
    let answer = Ok(response);
    report.answered(&answer);
    Next::Admitted(Admitted::Answer(answer))
}
