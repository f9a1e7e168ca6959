//! The ledger's part of a keyed request: read the body, claim the key, and answer without
//! the handler (a replay, a refusal, a conflict) or hand the owned key to it.
//!
//! A future of its own rather than an `async fn`, so that the request's future is a type
//! that can be named and held in place: a replay or a refusal allocates no future at all,
//! and only a request whose handler runs boxes that part, where its claim is decided (see
//! [`Handling`] and [`Keyed`](super::staged::Keyed)).
//!
//! # Why the steps come in this order
//!
//! A keyed request walks `Reading` → `Claiming` → (answered | handed to the handler), and
//! each step is placed where a failure costs nothing that must be undone:
//!
//! 1. **The body is read before the key is claimed.** Reading can fail (too large, the
//!    client went away, a broken stream) and takes as long as the client wants. Read first,
//!    a failure leaves no trace in the ledger: the key is still unused, and the client's
//!    retry with a good body is a first request. Claimed first, every slow or broken upload
//!    would hold the key in flight (turning duplicates away with `409`) and then have to
//!    give it back, a second store call on the failure path.
//! 2. **The body's `Content-Digest` is checked before the fingerprint is made.** The
//!    fingerprint is what one key is bound to forever; it must be of the bytes the handler
//!    will see, never of bytes a proxy mangled. A verified SHA-256 is also reused as the
//!    fingerprint's body digest, so the body is hashed once.
//! 3. **The claim is one atomic `begin` in the store.** It is the only mutual exclusion the
//!    server face has: there is no lock in this process, because the requests racing on one
//!    key may be in different processes. Of any number of concurrent requests with one key
//!    exactly one is answered [`Begin::Acquired`]; the others see `Busy`, `Replay`, `Drift`
//!    or `InDoubt`. So "who runs the handler" is decided by the store, and everything after
//!    it here only acts on the answer.
//! 4. **Ownership passes to the handler's part without an await in between.** [`decide`]
//!    builds the [`Execute`] future in the same poll that saw `Acquired`, and
//!    [`execute::handle`] takes the lease guard before it calls the handler. There is no
//!    point at which this request owns the key and nothing would put it in doubt if the
//!    future were dropped: before the answer is seen, the engine's unanswered-claim guard
//!    releases a claim that was made (nothing ran); after, the lease guard marks it in
//!    doubt (the handler may have run).
//!
//! Everything that answers without the handler (a replay, `409`, `422`, `500`
//! outcome-unknown, `503`) changes nothing in the ledger: only the owner of a lease ever
//! writes a key's record.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{HeaderName, HeaderValue};
use http::request::Parts;
use http::{Request, Response};
use http_body::Body;
use pin_project_lite::pin_project;
use tower_service::Service;

use super::body::RequestBody;
use super::execute::{self, Execute};
use super::execute::{Owned, Transaction};
use super::face::ServerFace;
use super::head::{original_target, verified_body_digest};
use super::policy::InDoubtPolicy;
use super::problem;
use super::replay::replay;
use super::report::{outcome, Report};
use crate::digest::{BodyDigest, DigestError};
use crate::fingerprint::Fingerprint;
use crate::frozen::CollectRequest;
use crate::idempotency::body::ResponseBody;
use crate::idempotency::decision::{Decision, Signal};
use crate::ledger::{Begin, BeginRequest, LedgerKey, StoreError};
use crate::BoxError;
use crate::HeaderKey;

/// `Idempotency-Fail-Open: true` marks a response produced while the ledger was unavailable
/// by a layer built with [`fail_open`](crate::server::Builder::fail_open): the key was **not**
/// checked, so a retry may run the handler again.
pub static IDEMPOTENCY_FAIL_OPEN: HeaderName = HeaderName::from_static("idempotency-fail-open");

/// What claiming a key came to, and the transaction it was made in (transactional mode).
/// The transaction travels with the answer because in that mode the claim *is* the
/// transaction's first statement: dropping it rolls the claim back, so a replay or a
/// refusal that drops it unused leaves the key exactly as it found it.
type Claimed = (Result<Begin, StoreError>, Transaction);

/// A claim that could not be made in place: the store awaits, a busy key is waited for, a
/// lost answer is asked again, or the transactional mode opens its transaction. Boxed:
/// held in place, its state would weigh on every request's future.
type Claiming = Pin<Box<dyn Future<Output = Claimed> + Send>>;

/// A handler run unprotected because the ledger is unavailable ([`fail_open`]). Boxed for
/// the reason [`Claiming`] is.
///
/// [`fail_open`]: super::Builder::fail_open
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

/// How the ledger's part of a keyed request ended.
pub(super) enum Admitted<R, O> {
    /// Answered without the handler: a replay, a refusal, a conflict.
    Answer(R),
    /// The key is this request's: its handler's part, started.
    Handle(O),
}

async fn call<S, B, ResBody>(
    mut inner: S,
    request: Request<RequestBody<B>>,
) -> Result<Response<ResBody>, S::Error>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResBody>>,
{
    // `inner` is the instance our caller polled ready (taken in `call`).
    inner.call(request).await
}

pin_project! {
    /// The ledger's part of one keyed request (see the module docs).
    pub(super) struct Admit<S, B, ResB>
    where
        S: Service<Request<RequestBody<B>>, Response = Response<ResB>>,
    {
        // The instance our caller polled ready (taken in `call`), until it is handed on.
        // tower's contract is that `call` goes to the instance `poll_ready` said yes to; it
        // travels here untouched, and is called at most once: by the handler's part, or by
        // the fail-open path, never both (`Option::take` makes a second call a panic).
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

/// A request waiting for its claim: what deciding needs once the answer comes. Kept out of
/// the boxed claim future on purpose: the box holds only what the store call needs, and the
/// request's head and body stay here, moved once into the handler's request.
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
    /// Inlined (as the two that hold it are), so that it is built where the layer's future
    /// holds it, not copied there through each of them.
    #[inline(always)]
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
                        let report = Report::for_key(this.server, &key, *this.started);
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
                    // Nothing claimed yet: the refusal leaves the key unused (module docs, 1.).
                    Err(err) => {
                        let answer = refused_body(this.server, &err);
                        return done(this.step, Admitted::Answer(Ok(answer)));
                    }
                },
                // Dropped while pending, the boxed claim goes with it: the engine's
                // unanswered-claim guard releases whatever the store may have claimed (in the
                // transactional mode, the dropped connection rolls the claim back).
                StepProj::Claiming { claiming, claimant } => {
                    let claimed = std::task::ready!(claiming.as_mut().poll(cx));
                    let claimant = claimant.take().expect("claimed once");
                    decide(this.server, this.inner, *this.ledger_key, claimant, claimed)
                }
                // The mark goes on the handler's answer, since it is the client that must learn
                // that a retry may run the handler again; nothing is recorded either way.
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
                StepProj::Done => panic!("ResponseFuture polled after completion"),
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

#[inline(always)]
fn done<S, B, ResB, T>(mut step: Pin<&mut Step<S, B, ResB>>, admitted: T) -> Poll<T>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResB>>,
    B: Body,
{
    step.set(Step::Done);
    Poll::Ready(admitted)
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
/// when the store answers at once, else by a boxed future. Inlined into its one caller, so
/// that the request's head is moved into the claimant once.
#[inline(always)]
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
    // them; a verified sha-256 is the digest the fingerprint is made of (one pass). A
    // refusal here, like a refused body, leaves the key unused: the sender's retry with
    // the right bytes is a first request, not a `422` against bytes nobody meant.
    let digest = match verified_body_digest(&parts.headers, digest_sent, &body) {
        Ok(digest) => digest,
        Err(err) => return answered_by(report, refused_digest(&err)),
    };
    // One key is one request: the method, the target as the client sent it and the body.
    // A reuse with anything else is a mismatch, never a second run and never a replay.
    let target = original_target(&parts);
    let fingerprint = Fingerprint::of_received(&parts.method, target, &digest);
    let origin = crate::ledger::Origin::server(&parts.method, target.path());
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
        .with_scope_id(scope)
        .with_origin(origin);
    if server.in_doubt == InDoubtPolicy::OutcomeUnknown {
        // An in-doubt key is only ever looked at: answering it never changes its record,
        // so a client that keeps retrying cannot keep it alive. Without the probe, the
        // store would hand the key to this request (`Resume`) and we would have to give it
        // back in doubt: two writes per refusal, each a transition that renews the record,
        // so a client retrying in a loop could keep the key alive past its retention.
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
///
/// The in-place path exists for stores that answer without awaiting (`MemoryStore`): the
/// common request then never allocates for its claim. It is only taken when waiting and
/// asking again are not needed: a `Busy` under [`BusyPolicy::Wait`] or a lost answer
/// falls through to the engine's `begin_after`, which resumes from exactly that answer
/// (a lost answer is asked again with the same token, so a claim the store made but whose
/// reply was lost is found again, never made twice).
///
/// [`BusyPolicy::Wait`]: crate::BusyPolicy::Wait
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
            // No lease, so no guard: the ledger is unreachable, so nothing could be
            // written about this run anyway. The response says so (`Idempotency-Fail-Open`)
            // because a retry of it may run the handler again.
            outcome("fail-open");
            tracing::warn!(%err, "ledger unavailable; running the handler unprotected (fail-open)");
            // Not in `tracing` alone: a retry of this request may run the handler again.
            report.track.decided(Decision::Unavailable);
            report.track.signal(Signal::FailOpen);
            let inner = inner.take().expect("handed on once");
            let request = handler_request(parts, header_key, body);
            return Next::Step(Step::FailingOpen {
                running: Box::pin(call(inner, request)),
                report: Some(report),
            });
        }
        // A full store refused to make a record it could not keep. Nothing was claimed, so
        // nothing is released: the handler must not run, because its outcome could not be
        // recorded and a retry would run it again.
        Err(err) if err.is_full() => {
            outcome("ledger-full");
            report.track.decided(Decision::Full);
            if err.is_never_fits() {
                return answered_by(report, problem::ledger_never_fits());
            }
            let retry_after = err.retry_after().unwrap_or(server.retry_after);
            return answered_by(report, problem::ledger_full(retry_after));
        }
        // Fail closed: running the handler without knowing whether the key was used is
        // the double effect this layer exists to prevent.
        Err(err) => {
            outcome("ledger-unavailable");
            report.track.decided(Decision::Unavailable);
            tracing::error!(%err, "ledger unavailable; refusing the request (fail closed)");
            return answered_by(report, problem::ledger_unavailable(server.retry_after));
        }
    };
    report.track.decided(Decision::of_begin(&answer));
    let token = match answer {
        // The two answers that make this request the key's owner. From here the `token`
        // fences every write: if our lease ever runs out and another request takes the
        // key over, the store refuses our late `complete` instead of overwriting theirs.
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
            // The owner's remaining lease bounds the advice: by then the key is settled or
            // in doubt, so a longer wait would only delay the client's replay.
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
    // No await between the store's answer and the lease guard taken in `handle`: see the
    // module docs (4.). The transaction, when there is one, moves along with the key.
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
#[inline(always)]
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
