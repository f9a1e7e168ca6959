//! One side-effect operation through the ledger: claim, call, settle; or resume,
//! reconcile, replay or refuse.

use std::future::Future;

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::digest::BodyDigest;
use crate::error::Drift;
use crate::fingerprint::{canonical, Fingerprint, RequestPart};
use crate::idempotency::decision::Track;
use crate::idempotency::{ask_reconciler, InDoubtOperation, Reconciled};
use crate::ledger::{Begin, LeaseToken, LedgerKey, Origin};
use crate::tool::face::ToolFace;
use crate::tool::types::{
    ClassifyToolError, Discarded, FinalAnswer, ToolCall, ToolError, ToolOutput, ToolSource,
    VerdictKind,
};
use crate::FrozenRequest;
use crate::IdempotencyKey;
use crate::ProviderKeys;
use crate::{DriftPolicy, Error, OperationId};

use super::{
    discarded_from, drift_error, json_or_text, record, recorded, replay, settle, settle_watched,
    warn_discarded, Frozen, Invoke, Retries, FINAL_ANSWER,
};

/// One side-effect operation's identity, and the face it runs on.
pub(super) struct Operation<'a, C> {
    pub(super) face: &'a ToolFace<C>,
    pub(super) op: OperationId,
    pub(super) key: IdempotencyKey,
    pub(super) ledger_key: LedgerKey,
    /// The call's safety signals, raised while it runs.
    pub(super) track: Track,
}

impl<C> Operation<'_, C> {
    /// What the operation's record is of: the tool, and the step that called it.
    fn origin(&self) -> Origin {
        let name = self
            .face
            .target
            .strip_prefix("/tools/")
            .unwrap_or(&self.face.target);
        Origin::tool(name).with_operation(&self.op)
    }

    /// `ours`: the arguments handed in, frozen.
    pub(super) async fn operate<A, R, E, T>(
        &self,
        ours: Frozen,
        tool: &mut T,
    ) -> Result<ToolOutput<R>, ToolError<E>>
    where
        C: ClassifyToolError<E>,
        A: Serialize + DeserializeOwned + Send,
        R: Serialize + DeserializeOwned,
        T: Invoke<A, R, E>,
    {
        let face = self.face;
        let ledger = &face.ledger;
        let begin = ledger
            .request(self.ledger_key, ours.fingerprint)
            .with_frozen(ours.request.clone())
            .with_origin(self.origin());
        let answer = self.begin(begin).await?;
        // What the operation is known by and what it sends, once the ledger has shown us
        // the first frozen arguments: never the ones just handed in, if they differ.
        let mut fingerprint = ours.fingerprint;
        let mut to_send = ours.request.clone();
        let mut discarded = None;
        let answer = match answer {
            Begin::Drift { stored, frozen } => {
                if refuses_drift(face, stored, &ours) {
                    return Err(drift_error(stored, frozen.as_ref(), &ours));
                }
                discarded =
                    Some(Discarded::new(frozen.as_ref().and_then(|first| {
                        canonical::changed_fields(first.body(), ours.body())
                    })));
                warn_discarded(self.ledger_key);
                fingerprint = stored;
                let mut again = ledger.request(self.ledger_key, stored);
                if let Some(first) = frozen {
                    again = again.with_frozen(first.clone());
                    to_send = first;
                }
                // Boxed, as every rare path here: held in place, its state would weigh on
                // every call's future (moved whole into its box as the call starts).
                Box::pin(self.begin(again)).await?
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
                if refuses_drift(face, stored, &ours) {
                    return Err(refused());
                }
                discarded = Some(Discarded::new(changed.clone()));
                warn_discarded(self.ledger_key);
                // A completed operation whose store kept only its fields' digests: its
                // recorded outcome is what the first arguments gave. Asked as a probe.
                let probe = ledger.request(self.ledger_key, stored).probe();
                match Box::pin(ledger.begin(probe, face.busy)).await {
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
                // A new operation going on with the arguments just frozen: read back
                // before its first attempt, which takes them as read (as every retry and
                // every resume will), never as handed in. Refused, nothing called, when
                // they do not read back as frozen: no resume could finish the operation.
                let read = if ours.is(&to_send) {
                    match ours.read_back::<A>() {
                        Ok(arguments) => Some(arguments),
                        Err(refused) => {
                            tracing::warn!(%refused, "refusing a tool call before it runs");
                            let released = ledger.hold_unsent(self.ledger_key, token).abandon();
                            settle(released, "release").await;
                            return Err(ToolError::NotReadBack(refused));
                        }
                    }
                } else {
                    None
                };
                self.exchange(
                    tool,
                    token,
                    (&to_send, digest),
                    ToolSource::Called,
                    discarded,
                    read,
                )
                .await
            }
            Begin::Resume { token, frozen } => {
                let first = frozen.unwrap_or(to_send);
                let discarded = discarded.or_else(|| discarded_from(&first, &ours));
                let digest = ours.digest_of(&first);
                if face.reconciler.is_some() {
                    return Box::pin(self.reconcile(tool, token, (first, digest), discarded)).await;
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
                match Box::pin(ledger.begin(take_over, face.busy)).await {
                    Ok(Begin::Resume { token, frozen }) => {
                        let first = frozen.unwrap_or(to_send);
                        let discarded = discarded.or_else(|| discarded_from(&first, &ours));
                        let digest = ours.digest_of(&first);
                        Box::pin(self.reconcile(tool, token, (first, digest), discarded)).await
                    }
                    // The record left while we looked: the call may still have happened.
                    Ok(Begin::Acquired { token }) => {
                        let digest = ours.digest_of(&to_send);
                        Box::pin(self.reconcile(tool, token, (to_send, digest), discarded)).await
                    }
                    Ok(Begin::Replay(outcome)) => {
                        replay(outcome, (&ours, self.ledger_key), discarded)
                    }
                    Ok(Begin::Busy { retry_after }) => {
                        Err(ToolError::Idempotency(Error::busy(retry_after)))
                    }
                    Ok(_) => Err(ToolError::Idempotency(Error::in_doubt())),
                    Err(err) => Err(ToolError::Idempotency(Error::store(err))),
                }
            }
            // The provider would run it again: left in doubt, untouched, to reconcile.
            Begin::InDoubt => Err(ToolError::Idempotency(Error::in_doubt())),
            Begin::Replay(outcome) => replay(outcome, (&ours, self.ledger_key), discarded),
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
        // In place when the store answers at once (a `MemoryStore`): the waiting and
        // asking-again machinery only when it does not, or its answer was lost.
        let ledger = &self.face.ledger;
        let answered = match ledger.begin_in_place(&begin, self.face.busy) {
            Ok(answered) => answered,
            Err(lost) => Box::pin(ledger.begin_after(begin, self.face.busy, lost)).await,
        };
        answered.map_err(|err| ToolError::Idempotency(Error::store(err)))
    }

    /// Call the tool with `first` (thawed) as the operation's owner under `token`, retrying
    /// by the face's policy, and settle the lease by what happened. `read`: `first`
    /// already read back, for the first attempt.
    async fn exchange<A, R, E, T>(
        &self,
        tool: &mut T,
        token: LeaseToken,
        (first, digest): (&FrozenRequest, BodyDigest),
        source: ToolSource,
        discarded: Option<Discarded>,
        mut read: Option<A>,
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
        // Whether an attempt of this exchange may have happened. Sticky: a later attempt
        // refused before the effect proves nothing about an earlier one, so the operation
        // is then left in doubt, never released to be claimed anew with other arguments.
        let mut may_have_happened = false;
        loop {
            // Readiness first: nothing is sent while the tool is not ready, so its error is
            // a failure before the effect. Not bounded by the attempt timeout, which is the
            // call's, as the client face's retry layer waits for its transport: a caller's
            // own deadline ends the wait, and releases the operation if nothing was sent.
            if let Err(error) = lease.renewing(&self.track, tool.ready()).await {
                if retries.next(None).is_some() {
                    lease.between_attempts(may_have_happened);
                    lease.renewing(&self.track, retries.wait()).await;
                    continue;
                }
                settle_failed(lease, may_have_happened).await;
                return Err(ToolError::Tool(error));
            }
            let thawed = match read.take() {
                Some(read) => Ok(read),
                None => serde_json::from_slice(first.body()),
            };
            let arguments: A = match thawed {
                Ok(arguments) => arguments,
                Err(err) => {
                    settle_failed(lease, may_have_happened).await;
                    return Err(ToolError::Arguments(err));
                }
            };
            let call = ToolCall::new(self.op.clone(), arguments).with_key(self.key);
            // From here on the effect may happen: a drop or a panic leaves it in doubt.
            lease.sending();
            let attempt = lease
                .renewing(&self.track, attempt(face, tool.invoke(call)))
                .await;
            let error = match attempt {
                Ok(Ok(response)) => {
                    let digests = (digest, first);
                    return record(
                        (lease, &self.track),
                        response,
                        digests,
                        source,
                        discarded,
                        face,
                    )
                    .await;
                }
                Ok(Err(error)) => error,
                Err(timed_out) => {
                    // The attempt timed out: it may have happened.
                    may_have_happened = true;
                    let retry =
                        face.provider == ProviderKeys::Deduplicates && retries.next(None).is_some();
                    if retry {
                        lease.renewing(&self.track, retries.wait()).await;
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
                    let digests = (digest, first);
                    let outcome = recorded(FINAL_ANSWER, answer.value(), digests, face);
                    settle_watched(
                        lease.complete(outcome),
                        &self.track,
                        "record the final answer",
                    )
                    .await;
                    return Err(ToolError::Final(answer));
                }
                VerdictKind::BeforeEffect => retries.next(verdict.retry_after).is_some(),
                VerdictKind::MayHaveHappened => {
                    may_have_happened = true;
                    face.provider == ProviderKeys::Deduplicates
                        && retries.next(verdict.retry_after).is_some()
                }
            };
            if retry {
                lease.between_attempts(may_have_happened);
                lease.renewing(&self.track, retries.wait()).await;
                continue;
            }
            settle_failed(lease, may_have_happened).await;
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
        (first, digest): (FrozenRequest, BodyDigest),
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
            .renewing(
                &self.track,
                ask_reconciler(reconciler, operation, face.reconcile_timeout),
            )
            .await;
        match verdict {
            Ok(Reconciled::Applied(found)) => {
                tracing::info!(key = %self.ledger_key.to_hex(), "in-doubt tool operation reconciled: it happened");
                let (parts, body) = found.into_parts();
                if !parts.status.is_success() {
                    let answer = FinalAnswer::new(json_or_text(&body));
                    let digests = (digest, &first);
                    let outcome = recorded(FINAL_ANSWER, answer.value(), digests, face);
                    let recording = lease.complete(outcome);
                    settle_watched(recording, &self.track, "record the reconciled answer").await;
                    return Err(ToolError::Final(answer));
                }
                match serde_json::from_slice::<R>(&body) {
                    Ok(response) => {
                        let digests = (digest, &first);
                        record(
                            (lease, &self.track),
                            response,
                            digests,
                            ToolSource::Reconciled,
                            discarded,
                            face,
                        )
                        .await
                    }
                    Err(err) => {
                        settle(lease.mark_in_doubt(), "leave in doubt").await;
                        Err(ToolError::Response(err))
                    }
                }
            }
            Ok(Reconciled::NotApplied) => {
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
            unknown => {
                settle(lease.mark_in_doubt(), "leave in doubt").await;
                Err(ToolError::Idempotency(Error::unreconciled(unknown.err())))
            }
        }
    }
}

/// Whether a drift from the record under our key, fingerprinted `stored`, to `ours` is
/// refused rather than answered with the arguments first frozen: under
/// [`DriftPolicy::Reject`]; for another call than ours ([`another_call`]); and whenever
/// [defining fields](crate::tool::Builder::defining_fields) are declared, since the
/// fingerprint then covers them alone and a drift means one of them changed: they say
/// what the operation is, and are never discarded, whatever the policy.
fn refuses_drift<C>(face: &ToolFace<C>, stored: Fingerprint, ours: &Frozen) -> bool {
    face.drift == DriftPolicy::Reject || face.fields.is_some() || another_call(stored, ours)
}

/// Whether the record under our key, fingerprinted `stored`, is another call than ours:
/// another tool's (the tool's name is the fingerprint's target), or an HTTP call's, made
/// under the same `OperationId`. Only arguments may be regenerated: going on with another
/// tool's frozen arguments, or answering with its outcome, would be a wrong call or a
/// wrong answer, so that is refused whatever the drift policy, as the client face does.
fn another_call(stored: Fingerprint, ours: &Frozen) -> bool {
    stored
        .differing_parts(&ours.fingerprint)
        .any(|part| part != RequestPart::Body)
}

/// One attempt, bounded by the policy's attempt timeout if it has one.
pub(super) async fn attempt<C, T: Future>(face: &ToolFace<C>, call: T) -> Result<T::Output, Error> {
    match face.retry.attempt_timeout {
        Some(bound) => tokio::time::timeout(bound, call)
            .await
            .map_err(|_| Error::attempt_timeout()),
        None => Ok(call.await),
    }
}

/// Settle an exchange that failed without an answer: released when none of its attempts
/// may have happened (a resumed operation stays in doubt all the same: the store keeps
/// what an earlier run may have done), in doubt otherwise.
async fn settle_failed(lease: crate::idempotency::LeaseGuard, may_have_happened: bool) {
    if may_have_happened {
        settle(lease.mark_in_doubt(), "leave in doubt").await;
    } else {
        settle(lease.abandon(), "release").await;
    }
}
