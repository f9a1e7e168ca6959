//! Recording outcomes and replaying them.

use std::cell::RefCell;
use std::future::Future;

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine;
use http::{StatusCode, Version};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::digest::BodyDigest;
use crate::error::Drift;
use crate::fingerprint::canonical;
use crate::idempotency::decision::{watch_store_signals, with_store_signals, Track};
use crate::idempotency::engine::InPlace;
use crate::idempotency::LeaseGuard;
use crate::ledger::{
    FieldDigests, GatheredFields, HeaderBlock, LedgerKey, Outcome, RequestFields, StoredResponse,
};
use crate::tool::face::ToolFace;
use crate::tool::types::{Discarded, FinalAnswer, ToolError, ToolOutput, ToolSource};
use crate::FrozenRequest;
use crate::{fingerprint::Fingerprint, Error};

use super::{Frozen, ARGUMENTS_DIGEST, ARGUMENT_FIELDS, FINAL_ANSWER};

/// Record `response` as the operation's outcome (a tombstone past the face's cap) and
/// return it.
pub(super) async fn record<R: Serialize, E, C>(
    (lease, track): (LeaseGuard, &Track),
    response: R,
    (digest, first): (BodyDigest, &FrozenRequest),
    source: ToolSource,
    discarded: Option<Discarded>,
    face: &ToolFace<C>,
) -> Result<ToolOutput<R>, ToolError<E>> {
    let outcome = with_buffer(|body| {
        serde_json::to_writer(&mut *body, &response)?;
        Ok(tombstone_over_cap(StatusCode::OK, body, face)
            .unwrap_or_else(|| stored(StatusCode::OK, body, (&digest, first), face)))
    });
    let outcome = match outcome {
        Ok(outcome) => outcome,
        Err(err) => {
            // The tool ran; what it answered cannot be kept: in doubt, never released.
            settle(lease.mark_in_doubt(), "leave in doubt").await;
            return Err(ToolError::Response(err));
        }
    };
    // In place when the store answers at once, as the HTTP faces record theirs.
    // A store that keeps only a tombstone of the outcome (no room for it) says so here.
    let (in_place, raised) = with_store_signals(|| lease.complete_in_place(outcome));
    track.signal_all(raised);
    match in_place {
        InPlace::Done(completed) => settled(completed, "record the response"),
        InPlace::Later(unsettled) => {
            let recording = Box::pin(unsettled.complete());
            settle_watched(recording, track, "record the response").await
        }
    }
    Ok(ToolOutput::new(response, source, discarded))
}

/// Runs `write` with an empty buffer the thread keeps: a response is serialized there and
/// copied once into its record, rather than into a buffer of its own grown to fit.
fn with_buffer<T>(write: impl FnOnce(&mut Vec<u8>) -> T) -> T {
    /// The most buffer memory a thread keeps between responses.
    const KEEP: usize = 64 * 1024;
    thread_local! {
        static BUFFER: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
    }
    let mut write = Some(write);
    let kept = BUFFER.try_with(|buffer| {
        // Already borrowed only if a response's own serialization records one.
        let mut buffer = buffer.try_borrow_mut().ok()?;
        buffer.clear();
        let written = (write.take()?)(&mut buffer);
        if buffer.capacity() > KEEP {
            *buffer = Vec::new();
        }
        Some(written)
    });
    match (kept, write) {
        (Ok(Some(written)), _) => written,
        (_, Some(write)) => write(&mut Vec::new()),
        (_, None) => unreachable!("`write` runs once, and then gives an answer"),
    }
}

/// An outcome with `status` and `body`, remembering the digest of the arguments it was
/// made with (`first`, digested `digest`): the header, the body and the field digests of
/// the arguments (when the store keeps them: see [`GatheredFields`]) in one buffer of
/// exactly their size, as the HTTP client face records a response.
pub(super) fn stored<C>(
    status: StatusCode,
    body: &[u8],
    (digest, first): (&BodyDigest, &FrozenRequest),
    face: &ToolFace<C>,
) -> Outcome {
    let arguments = face.ledger.request_for_fields(first);
    let named = named_fields(face, first, arguments.is_some());
    let digest = digest.field();
    let both = [
        (ARGUMENTS_DIGEST, &digest[..]),
        (ARGUMENT_FIELDS, named.as_deref().unwrap_or_default()),
    ];
    let pairs = if named.is_some() {
        &both[..]
    } else {
        &both[..1]
    };
    // Gathered here, not handed in: its buffer would otherwise ride in the call's future.
    let gathered = GatheredFields::of(arguments);
    Outcome::Response(StoredResponse::of_block_with_fields(
        status,
        Version::HTTP_11,
        |tail| HeaderBlock::of_checked_pairs(pairs, body, tail),
        &gathered,
    ))
}

/// The [`ARGUMENT_FIELDS`] value for arguments `first`: only for a face with defining
/// fields (without them, other arguments are another fingerprint, a drift that names
/// them) on a store that keeps no field digests itself (`kept`), and arguments that are a
/// JSON object.
fn named_fields<C>(face: &ToolFace<C>, first: &FrozenRequest, kept: bool) -> Option<Vec<u8>> {
    if face.fields.is_none() || kept {
        return None;
    }
    let digests = FieldDigests::of(first.body())?;
    Some(BASE64.encode(digests.entries()).into_bytes())
}

/// [`stored`] for a JSON `value`, a tombstone past the face's response cap.
pub(super) fn recorded<C>(
    status: StatusCode,
    value: &serde_json::Value,
    (digest, first): (BodyDigest, &FrozenRequest),
    face: &ToolFace<C>,
) -> Outcome {
    let body = value.to_string();
    tombstone_over_cap(status, body.as_bytes(), face)
        .unwrap_or_else(|| stored(status, body.as_bytes(), (&digest, first), face))
}

/// A tombstone for a `body` over the face's response cap: the answer is returned to its
/// caller, and a replay cannot answer it.
fn tombstone_over_cap<C>(status: StatusCode, body: &[u8], face: &ToolFace<C>) -> Option<Outcome> {
    if body.len() <= face.response_limit {
        return None;
    }
    tracing::info!(
        limit = face.response_limit,
        len = body.len(),
        "tool response over the recording cap; keeping a tombstone"
    );
    Some(Outcome::Tombstone { status })
}

/// Wait for a settle; a failure is logged (the lease then expires into doubt, which is
/// never a second call).
pub(super) async fn settle(
    settling: impl Future<Output = Result<(), crate::ledger::StoreError>>,
    what: &str,
) {
    settled(settling.await, what);
}

/// [`settle`] a completion, putting what the store raised while it recorded (a tombstone
/// kept for lack of room) on the call's track.
pub(super) async fn settle_watched(
    settling: impl Future<Output = Result<(), crate::ledger::StoreError>>,
    track: &Track,
    what: &str,
) {
    let (result, raised) = watch_store_signals(settling).await;
    track.signal_all(raised);
    settled(result, what);
}

/// Log a settle that failed.
fn settled(result: Result<(), crate::ledger::StoreError>, what: &str) {
    if let Err(err) = result {
        tracing::warn!(%err, what, "could not settle a tool operation; it will expire into doubt");
    }
}

/// A recorded outcome, as the face answers it.
pub(super) fn replay<R: DeserializeOwned, E>(
    outcome: Outcome,
    (ours, key): (&Frozen, LedgerKey),
    discarded: Option<Discarded>,
) -> Result<ToolOutput<R>, ToolError<E>> {
    let Outcome::Response(stored) = outcome else {
        return Err(ToolError::Idempotency(Error::replay_unavailable()));
    };
    // Read where the record holds them: no header map built, no handle on the body.
    let body = stored.body_bytes();
    match stored.status() {
        StatusCode::OK => {
            let response = serde_json::from_slice(body).map_err(ToolError::Response)?;
            // Same fingerprint (only some fields are fingerprinted) yet other arguments:
            // the caller's were discarded all the same.
            let block = stored.header_block();
            let differs = block
                .entries()
                .find(|entry| entry.name == ARGUMENTS_DIGEST.as_str().as_bytes())
                .is_some_and(|first| block.value_bytes(&first)[..] != ours.digest.field());
            // Told once a call: a drift found by the ledger was told when it was found.
            // Named as the client face names them, from the field digests the record
            // holds of the arguments first frozen, when it holds them.
            let discarded = discarded.or_else(|| {
                differs.then(|| {
                    warn_discarded(key);
                    Discarded::new(changed_since_recorded(&stored, ours))
                })
            });
            Ok(ToolOutput::new(response, ToolSource::Replayed, discarded))
        }
        FINAL_ANSWER => Err(ToolError::Final(FinalAnswer::new(json_or_text(body)))),
        // Another face's record under the same key (an HTTP call of this operation).
        _ => Err(ToolError::Idempotency(Error::replay_unavailable())),
    }
}

/// The top-level fields `ours` changed against the arguments a recorded outcome was made
/// with, from the field digests the record holds of them (kept by the store, or in
/// [`ARGUMENT_FIELDS`]); `None` when it holds none.
fn changed_since_recorded(stored: &StoredResponse, ours: &Frozen) -> Option<Vec<String>> {
    if let RequestFields::Entries(entries) = stored.request_fields() {
        return FieldDigests::from_entries(entries).changed_fields(ours.body());
    }
    let block = stored.header_block();
    let named = block
        .entries()
        .find(|entry| entry.name == ARGUMENT_FIELDS.as_str().as_bytes())?;
    let entries = BASE64.decode(&block.value_bytes(&named)[..]).ok()?;
    FieldDigests::from_entries(&entries).changed_fields(ours.body())
}

/// Where a caller that reads no [`Discarded`] marker (or that reused an operation's identity
/// for other arguments by mistake: another order, another tenant under the same task ids)
/// sees it: its arguments took no effect. Once a call, where the difference is found.
pub(super) fn warn_discarded(key: LedgerKey) {
    tracing::warn!(
        key = %key.to_hex(),
        "regenerated tool arguments; going on with the ones first frozen, these discarded \
         (Discarded on the output; DriftPolicy::Reject refuses them, and a change to a \
         defining field is always refused)"
    );
}

/// A discarded marker when the arguments first frozen differ from ours.
pub(super) fn discarded_from(first: &FrozenRequest, ours: &Frozen) -> Option<Discarded> {
    (first.body().as_ref() != ours.body())
        .then(|| Discarded::new(canonical::changed_fields(first.body(), ours.body())))
}

pub(super) fn drift_error<E>(
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

pub(super) fn json_or_text(body: &[u8]) -> serde_json::Value {
    serde_json::from_slice(body)
        .unwrap_or_else(|_| serde_json::Value::String(String::from_utf8_lossy(body).into_owned()))
}
