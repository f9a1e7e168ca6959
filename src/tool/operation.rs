//! One tool call through the ledger: claim, call (with retries), settle; or resume,
//! reconcile, replay or refuse. The same protocol the HTTP client face drives.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, StatusCode, Version};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::time::Instant;
use tower::retry::budget::Budget;
use tower::ServiceExt;
use tower_service::Service;

use super::canonical;
use super::face::ToolFace;
use super::types::{
    ClassifyToolError, Discarded, FinalAnswer, ProviderKeys, ToolCall, ToolClass, ToolError,
    ToolOutput, ToolSource, VerdictKind,
};
use crate::digest::BodyDigest;
use crate::error::Drift;
use crate::frozen::FrozenRequest;
use crate::idempotency::{ask_reconciler, InDoubtOperation, LeaseGuard, Reconciled};
use crate::key::IdempotencyKey;
use crate::ledger::{Begin, LeaseToken, LedgerKey, Outcome, StoredResponse};
use crate::retry::FullJitter;
use crate::{DriftPolicy, Error, Fingerprint, OperationId};

/// The header a recorded outcome keeps the digest of the arguments it was made with in,
/// so a replay can tell the caller its arguments differed from them.
const ARGUMENTS_DIGEST: HeaderName = HeaderName::from_static("tool-arguments-digest");
/// A final answer's recorded status; a response's is `200`.
const FINAL_ANSWER: StatusCode = StatusCode::UNPROCESSABLE_ENTITY;

/// A tool the operation calls: a tower service, or a closure (see
/// [`idempotent_call`](super::idempotent_call)).
pub(crate) trait Invoke<A, R, E> {
    fn invoke(&mut self, call: ToolCall<A>) -> impl Future<Output = Result<R, E>> + Send;
}

/// A tower service as an [`Invoke`].
pub(crate) struct Tower<S>(pub(crate) S);

impl<S, A, R, E> Invoke<A, R, E> for Tower<S>
where
    S: Service<ToolCall<A>, Response = R, Error = E> + Send,
    S::Future: Send,
    A: Send,
    E: Send,
{
    async fn invoke(&mut self, call: ToolCall<A>) -> Result<R, E> {
        self.0.ready().await?.call(call).await
    }
}

/// A call's arguments, frozen: the canonical bytes as the ledger stores them, and the
/// fingerprint and digest that identify them.
struct Frozen {
    request: FrozenRequest,
    fingerprint: Fingerprint,
    digest: HeaderValue,
}

impl Frozen {
    fn new<C>(face: &ToolFace<C>, body: Bytes, value: &serde_json::Value) -> Self {
        let digest = BodyDigest::of(&body);
        let fingerprint = match &face.fields {
            Some(pointers) => Fingerprint::of(
                &Method::POST,
                &face.target,
                &canonical::selected(value, pointers),
            ),
            None => Fingerprint::from_digest(&Method::POST, &face.target, &digest),
        };
        let request = FrozenRequest::from_parts(
            Method::POST,
            face.uri.clone(),
            Version::HTTP_11,
            HeaderMap::new(),
            body,
        );
        Self {
            request,
            fingerprint,
            digest: digest.header_value(),
        }
    }

    fn body(&self) -> &[u8] {
        self.request.body()
    }

    /// Whether `first` is these frozen arguments (the same bytes, not a copy).
    fn is(&self, first: &FrozenRequest) -> bool {
        let (mine, theirs) = (self.request.body(), first.body());
        mine.as_ptr() == theirs.as_ptr() && mine.len() == theirs.len()
    }

    /// The digest of `first`, the arguments an operation goes on with: ours, already made,
    /// when they are ours (the same bytes), else made now.
    fn digest_of(&self, first: &FrozenRequest) -> HeaderValue {
        if self.is(first) {
            return self.digest.clone();
        }
        first.body_digest().header_value()
    }
}

/// Run `call` through the face: straight through for reads and idempotent writes, through
/// the ledger for side effects.
pub(crate) async fn run<C, A, R, E, T>(
    face: &ToolFace<C>,
    call: ToolCall<A>,
    tool: &mut T,
) -> Result<ToolOutput<R>, ToolError<E>>
where
    C: ClassifyToolError<E>,
    A: Serialize + DeserializeOwned + Send,
    R: Serialize + DeserializeOwned,
    T: Invoke<A, R, E>,
{
    let key = call.operation().key(&face.scope);
    if face.class != ToolClass::SideEffect {
        return pass_through(face, call.with_key(key), tool).await;
    }
    let (body, value) = canonical::freeze(call.arguments()).map_err(ToolError::Arguments)?;
    let ours = Frozen::new(face, body, &value);
    let operation = Operation {
        face,
        op: call.operation().clone(),
        key,
        ledger_key: LedgerKey::for_operation(key),
    };
    operation.operate(ours, call.into_arguments(), tool).await
}

/// One side-effect operation's identity, and the face it runs on.
struct Operation<'a, C> {
    face: &'a ToolFace<C>,
    op: OperationId,
    key: IdempotencyKey,
    ledger_key: LedgerKey,
}

impl<C> Operation<'_, C> {
    /// `handed`: the arguments handed in, whose frozen form is `ours`.
    async fn operate<A, R, E, T>(
        &self,
        ours: Frozen,
        handed: A,
        tool: &mut T,
    ) -> Result<ToolOutput<R>, ToolError<E>>
    where
        C: ClassifyToolError<E>,
        A: DeserializeOwned + Send,
        R: Serialize + DeserializeOwned,
        T: Invoke<A, R, E>,
    {
        let face = self.face;
        let ledger = &face.ledger;
        let begin = ledger
            .request(self.ledger_key, ours.fingerprint)
            .with_frozen(ours.request.clone());
        let answer = self.begin(begin).await?;
        // What the operation is known by and what it sends, once the ledger has shown us
        // the first frozen arguments: never the ones just handed in, if they differ.
        let mut fingerprint = ours.fingerprint;
        let mut to_send = ours.request.clone();
        let mut discarded = None;
        let answer = match answer {
            Begin::Drift { stored, frozen } => {
                if face.drift == DriftPolicy::Reject {
                    return Err(drift_error(stored, frozen.as_ref(), &ours));
                }
                discarded =
                    Some(Discarded::new(frozen.as_ref().and_then(|first| {
                        canonical::changed_fields(first.body(), ours.body())
                    })));
                tracing::info!(key = %self.ledger_key.to_hex(), "regenerated tool arguments; continuing with the ones first frozen");
                fingerprint = stored;
                let mut again = ledger.request(self.ledger_key, stored);
                if let Some(first) = frozen {
                    again = again.with_frozen(first.clone());
                    to_send = first;
                }
                self.begin(again).await?
            }
            Begin::DriftFields { stored, fields } => {
                let changed = fields.changed_fields(ours.body());
                let refused = || {
                    ToolError::Idempotency(Error::from_drift(Drift::with_fields(
                        stored,
                        ours.fingerprint,
                        changed.clone(),
                    )))
                };
                if face.drift == DriftPolicy::Reject {
                    return Err(refused());
                }
                discarded = Some(Discarded::new(changed.clone()));
                // A completed operation whose store kept only its fields' digests: its
                // recorded outcome is what the first arguments gave. Asked as a probe.
                let probe = ledger.request(self.ledger_key, stored).probe();
                match ledger.begin(probe, face.busy).await {
                    Ok(Begin::Replay(outcome)) => Begin::Replay(outcome),
                    Ok(Begin::Acquired { token }) => {
                        // The record left meanwhile: nothing of the first call to go on with.
                        let _ = ledger.hold_unsent(self.ledger_key, token).abandon().await;
                        return Err(refused());
                    }
                    Ok(Begin::Busy { retry_after }) => {
                        return Err(ToolError::Idempotency(Error::busy(retry_after)))
                    }
                    Ok(_) => return Err(refused()),
                    Err(err) => return Err(ToolError::Idempotency(Error::store(err))),
                }
            }
            other => other,
        };
        match answer {
            Begin::Acquired { token } => {
                let digest = ours.digest_of(&to_send);
                // A new operation going on with the arguments just frozen: its first
                // attempt takes them as handed in (they are what the frozen bytes were
                // made from); every retry, and every resume, thaws the frozen bytes.
                let handed = ours.is(&to_send).then_some(handed);
                self.exchange(
                    tool,
                    token,
                    (&to_send, digest),
                    ToolSource::Called,
                    discarded,
                    handed,
                )
                .await
            }
            Begin::Resume { token, frozen } => {
                let first = frozen.unwrap_or(to_send);
                let discarded = discarded.or_else(|| discarded_from(&first, &ours));
                let digest = ours.digest_of(&first);
                if face.reconciler.is_some() {
                    return self
                        .reconcile(tool, token, (first, digest), discarded)
                        .await;
                }
                tracing::info!(key = %self.ledger_key.to_hex(), "tool operation in doubt; calling it again with the frozen arguments");
                self.exchange(
                    tool,
                    token,
                    (&first, digest),
                    ToolSource::Resumed,
                    discarded,
                    None,
                )
                .await
            }
            Begin::InDoubt if face.reconciler.is_some() => {
                // Taken over (fenced, under a token of our own) before asking, so two runs
                // never reconcile it at once and the outcome is written as its owner.
                let take_over = ledger
                    .request(self.ledger_key, fingerprint)
                    .with_frozen(to_send.clone());
                match ledger.begin(take_over, face.busy).await {
                    Ok(Begin::Resume { token, frozen }) => {
                        let first = frozen.unwrap_or(to_send);
                        let discarded = discarded.or_else(|| discarded_from(&first, &ours));
                        let digest = ours.digest_of(&first);
                        self.reconcile(tool, token, (first, digest), discarded)
                            .await
                    }
                    // The record left while we looked: the call may still have happened.
                    Ok(Begin::Acquired { token }) => {
                        let digest = ours.digest_of(&to_send);
                        self.reconcile(tool, token, (to_send, digest), discarded)
                            .await
                    }
                    Ok(Begin::Replay(outcome)) => replay(outcome, &ours, discarded),
                    Ok(Begin::Busy { retry_after }) => {
                        Err(ToolError::Idempotency(Error::busy(retry_after)))
                    }
                    Ok(_) => Err(ToolError::Idempotency(Error::in_doubt())),
                    Err(err) => Err(ToolError::Idempotency(Error::store(err))),
                }
            }
            // The provider would run it again: left in doubt, untouched, to reconcile.
            Begin::InDoubt => Err(ToolError::Idempotency(Error::in_doubt())),
            Begin::Replay(outcome) => replay(outcome, &ours, discarded),
            Begin::Busy { retry_after } => Err(ToolError::Idempotency(Error::busy(retry_after))),
            Begin::Drift { stored, frozen } => Err(drift_error(stored, frozen.as_ref(), &ours)),
            Begin::DriftFields { stored, fields } => Err(ToolError::Idempotency(
                Error::from_drift(Drift::with_fields(
                    stored,
                    ours.fingerprint,
                    fields.changed_fields(ours.body()),
                )),
            )),
            // Answers added later are not understood by this release: call nothing.
            #[allow(unreachable_patterns)]
            _ => Err(ToolError::Idempotency(Error::in_doubt())),
        }
    }

    /// `begin`, as a probe when the provider ignores keys (an in-doubt operation is then
    /// answered [`Begin::InDoubt`], never taken over to be called again); fail closed.
    async fn begin<E>(&self, begin: crate::ledger::BeginRequest) -> Result<Begin, ToolError<E>> {
        let begin = match self.face.provider {
            ProviderKeys::Deduplicates => begin,
            ProviderKeys::Ignored => begin.probe(),
        };
        self.face
            .ledger
            .begin(begin, self.face.busy)
            .await
            .map_err(|err| ToolError::Idempotency(Error::store(err)))
    }

    /// Call the tool with `first` (thawed) as the operation's owner under `token`, retrying
    /// by the face's policy, and settle the lease by what happened.
    async fn exchange<A, R, E, T>(
        &self,
        tool: &mut T,
        token: LeaseToken,
        (first, digest): (&FrozenRequest, HeaderValue),
        source: ToolSource,
        discarded: Option<Discarded>,
        mut handed: Option<A>,
    ) -> Result<ToolOutput<R>, ToolError<E>>
    where
        C: ClassifyToolError<E>,
        A: DeserializeOwned + Send,
        R: Serialize + DeserializeOwned,
        T: Invoke<A, R, E>,
    {
        let face = self.face;
        // Until `sending`, a drop (the caller gave up) releases the operation.
        let mut lease = face.ledger.hold_unsent(self.ledger_key, token);
        let mut retries = Retries::new(face);
        loop {
            let thawed = match handed.take() {
                Some(handed) => Ok(handed),
                None => serde_json::from_slice(first.body()),
            };
            let arguments: A = match thawed {
                Ok(arguments) => arguments,
                Err(err) => {
                    settle(lease.abandon(), "release").await;
                    return Err(ToolError::Arguments(err));
                }
            };
            let call = ToolCall::new(self.op.clone(), arguments).with_key(self.key);
            // From here on the effect may happen: a drop or a panic leaves it in doubt.
            lease.sending();
            let attempt = lease.renewing(attempt(face, tool.invoke(call))).await;
            let error = match attempt {
                Ok(Ok(response)) => {
                    return record(lease, response, digest, source, discarded).await;
                }
                Ok(Err(error)) => error,
                Err(timed_out) => {
                    // The attempt timed out: it may have happened.
                    let retry =
                        face.provider == ProviderKeys::Deduplicates && retries.next(None).is_some();
                    if retry {
                        lease.renewing(retries.wait()).await;
                        continue;
                    }
                    settle(lease.mark_in_doubt(), "leave in doubt").await;
                    return Err(ToolError::Idempotency(timed_out));
                }
            };
            let verdict = face.classifier.classify(&error);
            let retry = match &verdict.kind {
                VerdictKind::Final(answer) => {
                    let answer = FinalAnswer::new(answer.clone());
                    let outcome = recorded(FINAL_ANSWER, answer.value(), digest, face);
                    settle(lease.complete(outcome), "record the final answer").await;
                    return Err(ToolError::Final(answer));
                }
                VerdictKind::BeforeEffect => retries.next(verdict.retry_after).is_some(),
                VerdictKind::MayHaveHappened => {
                    face.provider == ProviderKeys::Deduplicates
                        && retries.next(verdict.retry_after).is_some()
                }
            };
            if retry {
                lease.renewing(retries.wait()).await;
                continue;
            }
            match verdict.kind {
                // Released; the store keeps it in doubt if an earlier attempt may have
                // happened ("may have happened" is sticky).
                VerdictKind::BeforeEffect => settle(lease.abandon(), "release").await,
                _ => settle(lease.mark_in_doubt(), "leave in doubt").await,
            }
            return Err(ToolError::Tool(error));
        }
    }

    /// Ask the reconciler about an in-doubt operation we own under `token`, and act on its
    /// answer: record and return what it found, call the tool it says was never called,
    /// or leave the operation in doubt.
    async fn reconcile<A, R, E, T>(
        &self,
        tool: &mut T,
        token: LeaseToken,
        (first, digest): (FrozenRequest, HeaderValue),
        discarded: Option<Discarded>,
    ) -> Result<ToolOutput<R>, ToolError<E>>
    where
        C: ClassifyToolError<E>,
        A: DeserializeOwned + Send,
        R: Serialize + DeserializeOwned,
        T: Invoke<A, R, E>,
    {
        let face = self.face;
        let reconciler = face
            .reconciler
            .as_deref()
            .expect("only called with a reconciler");
        // Dropped before settling (the caller gave up), the guard leaves it in doubt.
        let lease = face.ledger.hold(self.ledger_key, token);
        let attempts = match face.ledger.store.inspect(self.ledger_key).await {
            Ok(view) => view.map(|view| view.attempts),
            Err(_) => None,
        };
        let operation = InDoubtOperation::new(first.clone(), self.key.to_hex(), attempts);
        let verdict = lease
            .renewing(ask_reconciler(
                reconciler,
                operation,
                face.reconcile_timeout,
            ))
            .await;
        match verdict {
            Reconciled::Applied(found) => {
                tracing::info!(key = %self.ledger_key.to_hex(), "in-doubt tool operation reconciled: it happened");
                let (parts, body) = found.into_parts();
                if !parts.status.is_success() {
                    let answer = FinalAnswer::new(json_or_text(&body));
                    let outcome = recorded(FINAL_ANSWER, answer.value(), digest, face);
                    settle(lease.complete(outcome), "record the reconciled answer").await;
                    return Err(ToolError::Final(answer));
                }
                match serde_json::from_slice::<R>(&body) {
                    Ok(response) => {
                        record(lease, response, digest, ToolSource::Reconciled, discarded).await
                    }
                    Err(err) => {
                        settle(lease.mark_in_doubt(), "leave in doubt").await;
                        Err(ToolError::Response(err))
                    }
                }
            }
            Reconciled::NotApplied => {
                tracing::info!(key = %self.ledger_key.to_hex(), "in-doubt tool operation reconciled: it never happened; calling it with the frozen arguments");
                let token = lease.hand_on();
                self.exchange(
                    tool,
                    token,
                    (&first, digest),
                    ToolSource::Resumed,
                    discarded,
                    None,
                )
                .await
            }
            _ => {
                settle(lease.mark_in_doubt(), "leave in doubt").await;
                Err(ToolError::Idempotency(Error::in_doubt()))
            }
        }
    }
}

/// One attempt, bounded by the policy's attempt timeout if it has one.
async fn attempt<C, T: Future>(face: &ToolFace<C>, call: T) -> Result<T::Output, Error> {
    match face.retry.attempt_timeout {
        Some(bound) => tokio::time::timeout(bound, call)
            .await
            .map_err(|_| Error::attempt_timeout()),
        None => Ok(call.await),
    }
}

/// The retries left to an operation: attempts, elapsed time, budget and backoff, as the
/// [`FrozenRetryLayer`](crate::FrozenRetryLayer) counts them.
struct Retries<'a> {
    policy: &'a crate::retry::RetryPolicy,
    attempts: u32,
    started: Instant,
    backoff: Option<FullJitter>,
    wait: Duration,
}

impl<'a> Retries<'a> {
    fn new<C>(face: &'a ToolFace<C>) -> Self {
        let policy = &*face.retry;
        if let Some(budget) = &policy.budget {
            budget.deposit();
        }
        Self {
            policy,
            attempts: 1,
            started: Instant::now(),
            backoff: None,
            wait: Duration::ZERO,
        }
    }

    /// The wait before another attempt, if one is allowed: at least the backoff and the
    /// provider's hint, within the attempts, the elapsed time and the budget.
    fn next(&mut self, hint: Option<Duration>) -> Option<Duration> {
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
            if !budget.withdraw() {
                tracing::debug!("retry budget exhausted; not retrying the tool");
                return None;
            }
        }
        self.attempts += 1;
        self.wait = wait;
        Some(wait)
    }

    fn wait(&self) -> tokio::time::Sleep {
        tokio::time::sleep(self.wait)
    }
}

/// Record `response` as the operation's outcome (a tombstone past the face's cap) and
/// return it.
async fn record<R: Serialize, E>(
    lease: LeaseGuard,
    response: R,
    digest: HeaderValue,
    source: ToolSource,
    discarded: Option<Discarded>,
) -> Result<ToolOutput<R>, ToolError<E>> {
    let body = match serde_json::to_vec(&response) {
        Ok(body) => body,
        Err(err) => {
            // The tool ran; what it answered cannot be kept: in doubt, never released.
            settle(lease.mark_in_doubt(), "leave in doubt").await;
            return Err(ToolError::Response(err));
        }
    };
    settle(
        lease.complete(stored(StatusCode::OK, body, digest)),
        "record the response",
    )
    .await;
    Ok(ToolOutput::new(response, source, discarded))
}

/// An outcome with `status` and `body`, remembering the digest of the arguments it was
/// made with.
fn stored(status: StatusCode, body: Vec<u8>, digest: HeaderValue) -> Outcome {
    let mut headers = HeaderMap::with_capacity(1);
    headers.insert(ARGUMENTS_DIGEST, digest);
    Outcome::Response(StoredResponse::new(
        status,
        Version::HTTP_11,
        headers,
        Bytes::from(body),
    ))
}

/// [`stored`] for a JSON `value`, a tombstone past the face's response cap.
fn recorded<C>(
    status: StatusCode,
    value: &serde_json::Value,
    digest: HeaderValue,
    face: &ToolFace<C>,
) -> Outcome {
    let body = value.to_string().into_bytes();
    if body.len() > face.response_limit {
        return Outcome::Tombstone { status };
    }
    stored(status, body, digest)
}

/// Wait for a settle; a failure is logged (the lease then expires into doubt, which is
/// never a second call).
async fn settle(settling: impl Future<Output = Result<(), crate::ledger::StoreError>>, what: &str) {
    if let Err(err) = settling.await {
        tracing::warn!(%err, what, "could not settle a tool operation; it will expire into doubt");
    }
}

/// A recorded outcome, as the face answers it.
fn replay<R: DeserializeOwned, E>(
    outcome: Outcome,
    ours: &Frozen,
    discarded: Option<Discarded>,
) -> Result<ToolOutput<R>, ToolError<E>> {
    let Outcome::Response(stored) = outcome else {
        return Err(ToolError::Idempotency(Error::replay_unavailable()));
    };
    let body = stored.body();
    match stored.status() {
        StatusCode::OK => {
            let response = serde_json::from_slice(&body).map_err(ToolError::Response)?;
            // Same fingerprint (only some fields are fingerprinted) yet other arguments:
            // the caller's were discarded all the same.
            let differs = stored
                .headers()
                .get(&ARGUMENTS_DIGEST)
                .is_some_and(|first| first != ours.digest);
            let discarded = discarded.or_else(|| differs.then(|| Discarded::new(None)));
            Ok(ToolOutput::new(response, ToolSource::Replayed, discarded))
        }
        FINAL_ANSWER => Err(ToolError::Final(FinalAnswer::new(json_or_text(&body)))),
        // Another face's record under the same key (an HTTP call of this operation).
        _ => Err(ToolError::Idempotency(Error::replay_unavailable())),
    }
}

/// A discarded marker when the arguments first frozen differ from ours.
fn discarded_from(first: &FrozenRequest, ours: &Frozen) -> Option<Discarded> {
    (first.body().as_ref() != ours.body())
        .then(|| Discarded::new(canonical::changed_fields(first.body(), ours.body())))
}

fn drift_error<E>(
    stored: Fingerprint,
    first: Option<&FrozenRequest>,
    ours: &Frozen,
) -> ToolError<E> {
    let drift = match first {
        Some(first) => Drift::between(stored, first.body(), ours.fingerprint, ours.body()),
        None => Drift::fingerprints(stored, ours.fingerprint),
    };
    tracing::warn!(%drift, "refusing regenerated tool arguments");
    ToolError::Idempotency(Error::from_drift(drift))
}

fn json_or_text(body: &[u8]) -> serde_json::Value {
    serde_json::from_slice(body)
        .unwrap_or_else(|_| serde_json::Value::String(String::from_utf8_lossy(body).into_owned()))
}

/// Reads and idempotent writes: called outside the ledger, with the key, retried by the
/// policy whatever the phase (running them again is safe by their declaration).
async fn pass_through<C, A, R, E, T>(
    face: &ToolFace<C>,
    call: ToolCall<A>,
    tool: &mut T,
) -> Result<ToolOutput<R>, ToolError<E>>
where
    C: ClassifyToolError<E>,
    A: Serialize + DeserializeOwned + Send,
    T: Invoke<A, R, E>,
{
    let output = |response| ToolOutput::new(response, ToolSource::PassedThrough, None);
    if face.retry.max_attempts <= 1 {
        return match attempt(face, tool.invoke(call)).await {
            Ok(Ok(response)) => Ok(output(response)),
            Ok(Err(error)) => Err(failed(face, error)),
            Err(timed_out) => Err(ToolError::Idempotency(timed_out)),
        };
    }
    // Kept to call again with: frozen, as every retry of this face is.
    let (op, key) = (call.operation().clone(), call.key());
    let (body, _) = canonical::freeze(call.arguments()).map_err(ToolError::Arguments)?;
    let mut retries = Retries::new(face);
    let mut next = Some(call);
    loop {
        let call = match next.take() {
            Some(call) => call,
            None => {
                let arguments = serde_json::from_slice(&body).map_err(ToolError::Arguments)?;
                let call = ToolCall::new(op.clone(), arguments);
                match key {
                    Some(key) => call.with_key(key),
                    None => call,
                }
            }
        };
        match attempt(face, tool.invoke(call)).await {
            Ok(Ok(response)) => return Ok(output(response)),
            Ok(Err(error)) => {
                let verdict = face.classifier.classify(&error);
                if let VerdictKind::Final(answer) = verdict.kind {
                    return Err(ToolError::Final(FinalAnswer::new(answer)));
                }
                if retries.next(verdict.retry_after).is_none() {
                    return Err(ToolError::Tool(error));
                }
            }
            Err(timed_out) => {
                if retries.next(None).is_none() {
                    return Err(ToolError::Idempotency(timed_out));
                }
            }
        }
        retries.wait().await;
    }
}

/// A pass-through tool's error: its final answer, or the error itself.
fn failed<C: ClassifyToolError<E>, E>(face: &ToolFace<C>, error: E) -> ToolError<E> {
    match face.classifier.classify(&error).kind {
        VerdictKind::Final(answer) => ToolError::Final(FinalAnswer::new(answer)),
        _ => ToolError::Tool(error),
    }
}
