//! The slow path of an operation: acting on every answer of the ledger that is not sent or
//! replayed in place (drift, doubt, a store that awaits, fail open).

use std::sync::Arc;

use bytes::Bytes;
use http::{Extensions, Request, Response};
use http_body::Body;
use http_body_util::Full;
use tower::ServiceExt;
use tower_service::Service;

use crate::error::Drift;
use crate::fingerprint::{PayloadFields, RequestPart};
use crate::idempotency::body::ResponseBody;
use crate::idempotency::decision::{decision_of, Decision, Signal, Track, WireKey};
use crate::ledger::{Begin, FieldDigests, LedgerKey, Outcome};
use crate::FrozenRequest;
use crate::ResponseSource;
use crate::{BoxError, Error};

use super::exchange::exchange;
use super::face::ClientFace;
use super::failure::failed_outside;
use super::policy::{DriftPolicy, PayloadDiscarded};
use super::reconciling::reconcile;
use super::send::Sending;
/// The ledger's part of one keyed operation, once `begin` answered (`answered`): send,
/// resend, replay or refuse. The path of the answers the in-place one leaves (see
/// [`Operation`]).
pub(super) async fn operate_after<S, ResBody, M>(
    inner: S,
    client: &Arc<ClientFace>,
    key: LedgerKey,
    frozen: FrozenRequest,
    extensions: Extensions,
    track: &Track,
    answered: Result<Begin, crate::ledger::StoreError>,
) -> Result<Response<ResponseBody<ResBody>>, Error>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
    M: Sending<S, ResBody>,
    S::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let answer = match answered {
        Ok(answer) => answer,
        Err(err) if client.fail_open => {
            tracing::warn!(%err, "ledger unavailable; sending without protection (fail-open)");
            // Not in `tracing` alone: a retry of this operation may be a second effect.
            track.decided(Decision::Unavailable);
            track.signal(Signal::FailOpen);
            return pass_through(inner, client, &frozen, extensions).await;
        }
        Err(err) => {
            let decided = if err.is_full() {
                Decision::Full
            } else {
                Decision::Unavailable
            };
            track.decided(decided);
            return Err(Error::store(err));
        }
    };
    // What this operation sends if it is to be sent: the bytes first frozen, once the
    // ledger has shown them to us, never the request just handed in.
    let mut to_send = frozen.clone();
    // Set when a drift is resolved by continuing with the bytes first frozen: the caller
    // is told, on the response, what its discarded payload changed.
    let mut discarded = None;
    let answer = match answer {
        Begin::Drift {
            stored,
            frozen: Some(original),
        } if client.continues_with_frozen(track.wire(), stored, &original, &frozen) => {
            tracing::info!(key = %key.to_hex(), "payload drift; continuing with the bytes first frozen");
            discarded = Some(Drift::between(
                stored,
                original.body(),
                frozen.fingerprint(),
                frozen.body(),
            ));
            let mut begin = client
                .ledger
                .request(key, stored)
                .with_frozen(original.clone());
            if !client.provider_deduplicates {
                begin = begin.probe();
            }
            to_send = original;
            client
                .ledger
                .begin(begin, client.busy)
                .await
                .map_err(Error::store)?
        }
        Begin::DriftFields { stored, fields } => {
            let changed = fields.changed_fields(frozen.body());
            if client.continues_by_members(
                track.wire(),
                stored,
                &frozen,
                &fields,
                changed.as_deref(),
            ) {
                discarded = Some(Drift::with_fields(stored, frozen.fingerprint(), changed));
                replay_by_fingerprint(client, key, stored, fields).await?
            } else {
                Begin::DriftFields { stored, fields }
            }
        }
        other => other,
    };
    track.decided(decision_of(&answer));
    let answered = match answer {
        Begin::Acquired { token } => {
            exchange::<S, ResBody, M>(
                inner,
                client,
                (key, track),
                token,
                &to_send,
                extensions,
                ResponseSource::Sent,
            )
            .await
        }
        Begin::InDoubt if client.reconciler.is_some() => {
            // Take the operation over (fenced, under a token of our own) before asking, so
            // two runs never reconcile it at once and the outcome is written as its owner.
            let begin = client
                .ledger
                .request(key, to_send.fingerprint())
                .with_frozen(to_send.clone());
            let taken = client
                .ledger
                .begin(begin, client.busy)
                .await
                .map_err(Error::store)?;
            match taken {
                Begin::Resume {
                    token,
                    frozen: stored,
                } => {
                    let original = stored.unwrap_or(to_send);
                    reconcile::<S, ResBody, M>(
                        inner,
                        client,
                        (key, track),
                        token,
                        original,
                        extensions,
                    )
                    .await
                }
                // The record left while we looked (expired, evicted): the bytes may still
                // have reached the provider, so ask all the same.
                Begin::Acquired { token } => {
                    reconcile::<S, ResBody, M>(
                        inner,
                        client,
                        (key, track),
                        token,
                        to_send,
                        extensions,
                    )
                    .await
                }
                Begin::Replay(outcome) => replay(outcome, extensions),
                Begin::Busy { retry_after } => Err(Error::busy(retry_after)),
                Begin::Drift {
                    stored,
                    frozen: original,
                } => Err(drift_error(stored, original.as_ref(), &frozen)),
                Begin::DriftFields { stored, fields } => {
                    Err(drift_fields_error(stored, &fields, &frozen))
                }
                _ => Err(Error::in_doubt()),
            }
        }
        Begin::InDoubt => {
            // The server would run it again: leave it in doubt, untouched, to reconcile.
            Err(Error::in_doubt())
        }
        Begin::Resume {
            token,
            frozen: stored,
        } if client.reconcile_when_deduplicating => {
            let original = stored.unwrap_or(to_send);
            reconcile::<S, ResBody, M>(inner, client, (key, track), token, original, extensions)
                .await
        }
        Begin::Resume {
            token,
            frozen: stored,
        } => {
            // Resend what was first frozen, never the request just handed to us.
            let original = stored.unwrap_or(to_send);
            tracing::info!(key = %key.to_hex(), "operation in doubt; resending the frozen request");
            track.signal(Signal::ResentInDoubt);
            exchange::<S, ResBody, M>(
                inner,
                client,
                (key, track),
                token,
                &original,
                extensions,
                ResponseSource::Resent,
            )
            .await
        }
        Begin::Replay(outcome) => replay(outcome, extensions),
        Begin::Busy { retry_after } => Err(Error::busy(retry_after)),
        Begin::Drift {
            stored,
            frozen: original,
        } => Err(drift_error(stored, original.as_ref(), &frozen)),
        Begin::DriftFields { stored, fields } => Err(drift_fields_error(stored, &fields, &frozen)),
        // Answers added later are not understood by this release: send nothing.
        #[allow(unreachable_patterns)]
        _ => Err(Error::in_doubt()),
    };
    marked_discarded(answered, discarded, track)
}

/// A completed operation whose store kept only its fields' digests: its outcome is what
/// continuing with the bytes first frozen gives. Asked for under the fingerprint on record,
/// as a probe; if the record left meanwhile there is nothing to resend, and the drift
/// stands.
async fn replay_by_fingerprint(
    client: &ClientFace,
    key: LedgerKey,
    stored: crate::fingerprint::Fingerprint,
    fields: crate::ledger::FieldDigests,
) -> Result<Begin, Error> {
    let begin = client.ledger.request(key, stored).probe();
    let answer = client
        .ledger
        .begin(begin, client.busy)
        .await
        .map_err(Error::store)?;
    Ok(match answer {
        Begin::Replay(outcome) => Begin::Replay(outcome),
        Begin::Acquired { token } => {
            // Ours now, with nothing sent and nothing to send: let it go.
            // (Were the release lost, the claim stays unsent and leaves with its
            // lease: nothing was sent either way.)
            let _ = client.ledger.hold_unsent(key, token).abandon().await;
            Begin::DriftFields { stored, fields }
        }
        _ => Begin::DriftFields { stored, fields },
    })
}

fn drift_error(
    stored: crate::fingerprint::Fingerprint,
    original: Option<&FrozenRequest>,
    new: &FrozenRequest,
) -> Error {
    let drift = match original {
        Some(original) => Drift::between(stored, original.body(), new.fingerprint(), new.body()),
        None => Drift::fingerprints(stored, new.fingerprint()),
    };
    tracing::warn!(%drift, "refusing a regenerated payload");
    Error::from_drift(drift)
}

/// [`drift_error`] where the store kept only the digests of the first request's fields.
fn drift_fields_error(
    stored: crate::fingerprint::Fingerprint,
    fields: &crate::ledger::FieldDigests,
    new: &FrozenRequest,
) -> Error {
    let drift = Drift::with_fields(stored, new.fingerprint(), fields.changed_fields(new.body()));
    tracing::warn!(%drift, "refusing a regenerated payload");
    Error::from_drift(drift)
}

/// The answer a recorded outcome replays: its response, or a tombstone's error.
///
/// The replayed response carries [`ResponseSource::Replayed`] and nothing else of
/// `request`'s extensions: their map, emptied, holds it, so that marking a replay
/// allocates no map of its own (a request under the client face always carries one: its
/// `OperationId` is in it).
pub(super) fn replay<T>(
    outcome: Outcome,
    request: Extensions,
) -> Result<Response<ResponseBody<T>>, Error> {
    match outcome {
        Outcome::Response(stored) => {
            let mut response = Response::new(ResponseBody::buffered(stored.body()));
            *response.status_mut() = stored.status();
            *response.version_mut() = stored.version();
            *response.headers_mut() = stored.headers();
            let extensions = response.extensions_mut();
            *extensions = request;
            extensions.clear();
            extensions.insert(ResponseSource::Replayed);
            Ok(response)
        }
        Outcome::Tombstone { .. } => Err(Error::replay_unavailable()),
        // Outcomes added later are not replayable by this release.
        #[allow(unreachable_patterns)]
        _ => Err(Error::replay_unavailable()),
    }
}

/// Call `inner` once with the frozen request, outside the ledger.
async fn pass_through<S, ResBody>(
    inner: S,
    client: &ClientFace,
    frozen: &FrozenRequest,
    extensions: Extensions,
) -> Result<Response<ResponseBody<ResBody>>, Error>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>>,
    S::Error: Into<BoxError>,
{
    let response = inner
        .oneshot(frozen.to_request_with(extensions))
        .await
        .map_err(|error| failed_outside(client, error.into()))?;
    Ok(response.map(ResponseBody::inner))
}

impl ClientFace {
    /// Whether a drift from the request first frozen (`original`, fingerprinted `stored`)
    /// to `new` continues the operation with the bytes first frozen.
    ///
    /// Only a regenerated **body** ever does: a changed method or target is another
    /// request (a refund is not the charge first sent), so going on would answer it with
    /// another target's outcome or resend another target's bytes, whatever the policy.
    /// Where [defining fields](super::Builder::defining_fields) are declared, they say
    /// what the operation is and are never discarded: the body continues when none of
    /// them changed (both bodies JSON), and is refused otherwise, whatever the policy.
    /// Elsewhere the [policy](super::Builder::drift_policy) decides.
    fn continues_with_frozen(
        &self,
        wire: Option<&WireKey>,
        stored: crate::fingerprint::Fingerprint,
        original: &FrozenRequest,
        new: &FrozenRequest,
    ) -> bool {
        if !only_the_body_differs(stored, new.fingerprint()) {
            return false;
        }
        match &self.defining_fields {
            Some(fields) => no_defining_field_changed(fields, original.body(), new.body()),
            None => self.resends_regenerated_bodies(wire),
        }
    }

    /// [`continues_with_frozen`](Self::continues_with_frozen) when the store kept only
    /// digests of the first body's top-level members (`changed`: the members `new`
    /// changed, `None` when either body is no JSON object) and of the defining fields'
    /// values: a changed member that holds a defining field whose value changed, or one the
    /// digests cannot see into, counts as a defining change.
    fn continues_by_members(
        &self,
        wire: Option<&WireKey>,
        stored: crate::fingerprint::Fingerprint,
        new: &FrozenRequest,
        digests: &FieldDigests,
        changed: Option<&[String]>,
    ) -> bool {
        if !only_the_body_differs(stored, new.fingerprint()) {
            return false;
        }
        match (&self.defining_fields, changed) {
            (Some(fields), Some(changed)) => {
                no_defining_value_changed(fields, digests, new.body(), changed)
            }
            (Some(_), None) => false,
            (None, _) => self.resends_regenerated_bodies(wire),
        }
    }

    /// Whether a regenerated body of an operation keyed `wire`, with no defining fields
    /// declared, continues with the bytes first frozen: as the
    /// [policy](super::Builder::drift_policy) says when set; else under an `OperationId`,
    /// and never under a caller's own key.
    fn resends_regenerated_bodies(&self, wire: Option<&WireKey>) -> bool {
        match (self.drift, wire) {
            (Some(policy), _) => policy == DriftPolicy::ResendFrozen,
            (None, Some(WireKey::Derived(_))) => true,
            (None, _) => false,
        }
    }
}

/// Whether no field of `fields` differs between two JSON bodies; `false` when either is
/// not JSON (what a defining field holds cannot be told).
fn no_defining_field_changed(fields: &PayloadFields, original: &[u8], new: &[u8]) -> bool {
    let parse = |body: &[u8]| serde_json::from_slice::<serde_json::Value>(body).ok();
    match (parse(original), parse(new)) {
        (Some(old), Some(new)) => fields.changed(&old, &new).is_empty(),
        _ => false,
    }
}

/// Whether no defining field reached through the top-level members `changed` holds
/// another value in `new_body` than the first request's, as the digests of the defining
/// fields' values (gathered when the operation was recorded) tell. A defining field
/// without a digest of its own (recorded by a face judging by other fields) counts as
/// changed when its member did.
fn no_defining_value_changed(
    fields: &PayloadFields,
    digests: &FieldDigests,
    new_body: &[u8],
    changed: &[String],
) -> bool {
    let mut reached = changed
        .iter()
        .flat_map(|member| fields.pointers_into(member))
        .peekable();
    if reached.peek().is_none() {
        return true;
    }
    let Ok(new) = serde_json::from_slice::<serde_json::Value>(new_body) else {
        return false;
    };
    reached.all(|pointer| digests.pointer_changed(pointer, &new) == Some(false))
}

/// Whether two fingerprints differ in the body alone: the same method and target.
fn only_the_body_differs(
    stored: crate::fingerprint::Fingerprint,
    new: crate::fingerprint::Fingerprint,
) -> bool {
    stored
        .differing_parts(&new)
        .all(|part| part == RequestPart::Body)
}

/// Tell the caller its payload was discarded, on the response of the operation it joined.
fn marked_discarded<T>(
    answer: Result<Response<T>, Error>,
    discarded: Option<Drift>,
    track: &Track,
) -> Result<Response<T>, Error> {
    match (answer, discarded) {
        (Ok(mut response), Some(drift)) => {
            // Where a caller that reads no extension (or one that reused an operation's
            // identity for another payload by mistake: another order, another tenant under
            // the same task ids) can see it: in the log, as a warning, since the caller's
            // arguments did not take effect.
            tracing::warn!(
                %drift,
                "a regenerated request joined its operation: answered for the bytes first \
                 frozen, its own discarded (PayloadDiscarded on the response; \
                 DriftPolicy::Reject refuses it; a change to a defining field is always refused)"
            );
            track.signal(Signal::PayloadDiscarded);
            response
                .extensions_mut()
                .insert(PayloadDiscarded::new(drift));
            Ok(response)
        }
        (answer, _) => answer,
    }
}
