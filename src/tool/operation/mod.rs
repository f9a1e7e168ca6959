//! One tool call through the ledger: claim, call (with retries), settle; or resume,
//! reconcile, replay or refuse. The same protocol the HTTP client face drives.
use std::future::Future;

use http::{HeaderName, StatusCode};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tower::ServiceExt;
use tower_service::Service;

use crate::fingerprint::canonical;
use crate::idempotency::decision::{report_once, Decision, Face, Signal, Track, WireKey};
use crate::ledger::LedgerKey;
use crate::tool::face::ToolFace;
use crate::tool::types::{
    ClassifyToolError, FinalAnswer, ToolCall, ToolClass, ToolError, ToolOutput, ToolSource,
    VerdictKind,
};

mod arguments;
mod operate;
mod outcome;
mod retries;

use arguments::Frozen;
use operate::{attempt, Operation};
use outcome::{
    discarded_from, drift_error, json_or_text, record, recorded, replay, settle, settle_watched,
    warn_discarded,
};
use retries::Retries;

/// The header a recorded outcome keeps the digest of the arguments it was made with in,
/// so a replay can tell the caller its arguments differed from them.
const ARGUMENTS_DIGEST: HeaderName = HeaderName::from_static("tool-arguments-digest");
/// The header a recorded outcome keeps the field digests of the arguments it was made
/// with in ([`FieldDigests`](crate::ledger::FieldDigests)' entries, base64), for a face
/// with defining fields on a store that keeps no field digests of its own: a later call
/// whose defining fields agree (a replay, not a drift) is then told which of its other
/// fields were discarded, on every store.
const ARGUMENT_FIELDS: HeaderName = HeaderName::from_static("tool-argument-fields");
/// A final answer's recorded status; a response's is `200`.
const FINAL_ANSWER: StatusCode = StatusCode::UNPROCESSABLE_ENTITY;

/// A tool the operation calls: a tower service, or a closure (see
/// [`idempotent_call`](super::idempotent_call)).
pub(crate) trait Invoke<A, R, E> {
    /// Wait until the tool can take a call. Nothing is sent while it waits, so a caller
    /// that gives up here, or an error here (a shed load, a closed pool), leaves nothing
    /// that may have happened. A closure is always ready.
    fn ready(&mut self) -> impl Future<Output = Result<(), E>> + Send {
        // An async block, not `future::ready`: it holds no `E`, so it is `Send` whatever `E`.
        async { Ok(()) }
    }

    /// Call the tool, once [`ready`](Self::ready).
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
    async fn ready(&mut self) -> Result<(), E> {
        self.0.ready().await.map(|_| ())
    }

    async fn invoke(&mut self, call: ToolCall<A>) -> Result<R, E> {
        self.0.call(call).await
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
    let ours = Frozen::new(face, call.arguments()).map_err(ToolError::Arguments)?;
    let operation = Operation {
        face,
        op: call.operation().clone(),
        key,
        ledger_key: LedgerKey::for_operation(key),
        // Its signals only: the tool face reads its decision from the answer.
        track: Track::new(Face::Tool, None),
    };
    // The clock is read only for a hook: unset, it costs nothing.
    let started = face.on_outcome.is_some().then(tokio::time::Instant::now);
    let answered = operation.operate(ours, tool).await;
    report(face, (key, started), &operation.track, &answered);
    answered
}

/// Count the [`Signal`]s a side-effecting call raised (on its `track` while it ran, and
/// read from its answer: a [`Discarded`](crate::tool::Discarded) on the output), and tell
/// the face's hook, if any, what the call came to: the decision the ledger's part ended
/// on, and those signals.
fn report<C, R, E>(
    face: &ToolFace<C>,
    (key, started): (crate::IdempotencyKey, Option<tokio::time::Instant>),
    track: &Track,
    answered: &Result<ToolOutput<R>, ToolError<E>>,
) where
    C: ClassifyToolError<E>,
{
    if answered
        .as_ref()
        .is_ok_and(|output| output.discarded().is_some())
    {
        track.signal(Signal::PayloadDiscarded);
    }
    if let (Some(hook), Some(started)) = (&face.on_outcome, started) {
        let decision = decision_of(face, answered);
        let wire = WireKey::Derived(key);
        report_once(hook, (Face::Tool, decision, &wire), started, track);
    }
}

/// The decision a call's answer shows the ledger took last.
fn decision_of<C, R, E>(
    face: &ToolFace<C>,
    answered: &Result<ToolOutput<R>, ToolError<E>>,
) -> Decision
where
    C: ClassifyToolError<E>,
{
    match answered {
        Ok(output) => match output.source() {
            ToolSource::Resumed => Decision::Resumed,
            ToolSource::Replayed => Decision::Replayed,
            ToolSource::Reconciled => Decision::Reconciled,
            _ => Decision::Acquired,
        },
        // A final answer is recorded like a response.
        Err(ToolError::Final(_)) => Decision::Acquired,
        // The tool's verdict settled the operation: released before the effect, else
        // left in doubt (see `ToolError::Tool`).
        Err(ToolError::Tool(error)) => match face.classifier.classify(error).kind {
            VerdictKind::BeforeEffect => Decision::Released,
            VerdictKind::Final(_) => Decision::Acquired,
            VerdictKind::MayHaveHappened => Decision::InDoubt,
        },
        Err(ToolError::Idempotency(err)) if err.is_drift() => Decision::Drift,
        Err(ToolError::Idempotency(err)) if err.is_busy() => Decision::Busy,
        Err(ToolError::Idempotency(err)) if err.is_ledger_full() => Decision::Full,
        Err(ToolError::Idempotency(err)) if err.is_store() => Decision::Unavailable,
        Err(ToolError::Idempotency(err)) if err.is_replay_unavailable() => Decision::Replayed,
        // Every other end (a timed-out attempt, a response that could not be recorded, an
        // operation found in doubt) leaves the operation in doubt; so may frozen arguments
        // that could not be thawed for a retry, after an attempt that may have happened:
        // reported as in doubt, the side a hook must not miss.
        Err(_) => Decision::InDoubt,
    }
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
        return match attempt(face, ready_and_invoke(tool, call)).await {
            Ok(Ok(response)) => Ok(output(response)),
            Ok(Err(error)) => Err(failed(face, error)),
            Err(timed_out) => Err(ToolError::Idempotency(timed_out)),
        };
    }
    // Kept to call again with: frozen, as every retry of this face is.
    let (op, key) = (call.operation().clone(), call.key());
    let body = canonical::to_bytes(call.arguments()).map_err(ToolError::Arguments)?;
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
        match attempt(face, ready_and_invoke(tool, call)).await {
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

/// One attempt outside the ledger: readiness and the call, which nothing there needs to
/// tell apart (running it again is safe either way).
async fn ready_and_invoke<A, R, E, T: Invoke<A, R, E>>(
    tool: &mut T,
    call: ToolCall<A>,
) -> Result<R, E> {
    tool.ready().await?;
    tool.invoke(call).await
}

/// A pass-through tool's error: its final answer, or the error itself.
fn failed<C: ClassifyToolError<E>, E>(face: &ToolFace<C>, error: E) -> ToolError<E> {
    match face.classifier.classify(&error).kind {
        VerdictKind::Final(answer) => ToolError::Final(FinalAnswer::new(answer)),
        _ => ToolError::Tool(error),
    }
}
