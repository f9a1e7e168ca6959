//! How an `Exchange` settles its lease by what happened: the inner service refused, failed
//! or answered, and the answer was read and recorded.

use std::future::Future;
use std::pin::Pin;

use http::Response;

use crate::frozen::FrozenRequest;
use crate::idempotency::body::{Buffered, ResponseBody};
use crate::idempotency::decision::{with_store_signals, Decision, Track};
use crate::idempotency::engine::{InPlace, LeaseGuard, Settling};
use crate::ledger::{GatheredFields, Outcome, StoredResponse};
use crate::phase::{classify, FailurePhase};
use crate::{BoxError, Error};

use super::face::ClientFace;
use super::failure::into_error;

/// What an operation answers.
pub(super) type Answer<ResB> = Result<Response<ResponseBody<ResB>>, Error>;

/// The settling of an exchange that could not be done in place, boxed.
pub(super) type Finishing<ResB> = Pin<Box<dyn Future<Output = Answer<ResB>> + Send>>;

/// The inner service refused to become ready: nothing was sent, so release the operation
/// (a resumed one goes back to doubt: the store never releases what may have been sent).
pub(super) fn not_ready<ResB: Send + 'static>(
    track: &Track,
    lease: LeaseGuard,
    error: BoxError,
) -> Finishing<ResB> {
    track.decided(Decision::Released);
    let settling = lease.abandon();
    Box::pin(async move {
        if let Err(err) = settling.await {
            tracing::warn!(%err, "could not release the operation; it will expire into doubt");
        }
        Err(into_error(error, crate::phase::FailurePhase::PreWrite))
    })
}

/// The call failed: leave the operation in doubt if its bytes may have left, else release
/// it; then answer the error with its phase. `sent` says an attempt inside may have left.
pub(super) fn failed<ResB: Send + 'static>(
    client: &ClientFace,
    track: &Track,
    sent: bool,
    lease: LeaseGuard,
    error: BoxError,
) -> Finishing<ResB> {
    let phase = if Error::find(&*error).is_some_and(Error::refused_before_sending) {
        // A layer of ours inside refused the request before any attempt.
        FailurePhase::PreWrite
    } else {
        classify(&*error, client.phase_classifier.as_deref())
    };
    // Sticky: an earlier attempt inside (reported by the retry layer) may have left even
    // when the last one was refused before writing.
    let settling = if phase.may_have_been_sent() || sent {
        track.decided(Decision::InDoubt);
        lease.mark_in_doubt()
    } else {
        track.decided(Decision::Released);
        lease.abandon()
    };
    Box::pin(async move {
        if let Err(err) = settling.await {
            tracing::warn!(%err, "could not settle the lease after a failure; it will expire into doubt");
        }
        tracing::debug!(?phase, %error, "operation failed");
        Err(into_error(error, phase))
    })
}

/// What an answer said before its body was read.
#[derive(Clone, Copy)]
pub(super) struct Read {
    /// "Try again": left in doubt unless the body says nothing ran.
    pub(super) retryable: bool,
    /// A problem response whose type may say nothing ran.
    pub(super) read_problem: bool,
}

/// Settle the lease of an operation whose answer says it never started: released, unless
/// an attempt inside may have sent it (`sent`; sticky: then it stays in doubt).
pub(super) fn release_not_started(track: &Track, sent: bool, lease: LeaseGuard) -> Settling {
    if sent {
        track.decided(Decision::InDoubt);
        lease.mark_in_doubt()
    } else {
        track.decided(Decision::Released);
        lease.abandon()
    }
}

/// Finish settling, then answer `response` as it came.
pub(super) fn settled_then<ResB: Send + 'static>(
    settling: Settling,
    response: Response<ResponseBody<ResB>>,
) -> Finishing<ResB> {
    Box::pin(async move {
        if let Err(err) = settling.await {
            tracing::warn!(%err, "could not settle the operation; it will expire into doubt");
        }
        Ok(response)
    })
}

/// A provider refused the request because its key is in use (see
/// [`refusal`](super::refusal)): the refusal is no outcome, so the operation stays in doubt
/// (a later run resends the frozen bytes and gets the first request's answer), and the
/// caller gets a [key-in-use error](Error::is_key_in_use), not a `409` it could take for a
/// final business answer.
pub(super) fn refused_key_in_use<ResB: Send + 'static>(
    track: &Track,
    lease: LeaseGuard,
    headers: &http::HeaderMap,
) -> Finishing<ResB> {
    track.decided(Decision::InDoubt);
    let retry_after = crate::retry::retry_after(headers);
    tracing::info!(
        ?retry_after,
        "the provider refused the request: its key is in use; the operation stays in doubt"
    );
    Box::pin(async move {
        if let Err(err) = lease.mark_in_doubt().await {
            tracing::warn!(%err, "could not settle the operation; it will expire into doubt");
        }
        Err(Error::key_in_use(retry_after))
    })
}

/// Record the buffered response (or a tombstone) and answer it; a store that awaits, or
/// whose answer was lost, finishes in a future of its own, as does a lost body. A problem
/// response whose type says nothing ran releases the operation instead, and a "try again"
/// one leaves it in doubt.
pub(super) fn record<ResB: Send + 'static>(
    client: &ClientFace,
    (track, sent): (&Track, bool),
    lease: LeaseGuard,
    (parts, read): (http::response::Parts, Read),
    buffered: Result<Buffered<ResB>, BoxError>,
    request: Option<FrozenRequest>,
) -> Result<Response<ResponseBody<ResB>>, Finishing<ResB>> {
    let buffered = match buffered {
        Ok(buffered) => buffered,
        Err(err) => {
            // The server acted (it answered); only the body was lost.
            return Err(Box::pin(async move {
                if let Err(store_err) = lease.mark_in_doubt().await {
                    tracing::warn!(%store_err, "could not mark the operation in doubt");
                }
                Err(Error::response_body(err))
            }));
        }
    };
    if let Buffered::Whole(bytes) = &buffered {
        if read.read_problem && client.release_on.releases_problem(bytes) {
            let settling = release_not_started(track, sent, lease);
            let response = Response::from_parts(parts, ResponseBody::buffered(bytes.clone()));
            return Err(settled_then(settling, response));
        }
        // A `409` is read whole: "key in use" is said by its `Retry-After` or its body.
        if parts.status == http::StatusCode::CONFLICT
            && (read.retryable || super::refusal::says_key_in_use(bytes))
        {
            return Err(refused_key_in_use(track, lease, &parts.headers));
        }
        if read.retryable {
            track.decided(Decision::InDoubt);
            let response = Response::from_parts(parts, ResponseBody::buffered(bytes.clone()));
            return Err(settled_then(lease.mark_in_doubt(), response));
        }
    }
    let (outcome, body) = match buffered {
        Buffered::Whole(bytes) => {
            // The record gets its own exact-size copy (see `HeaderBlock::with_body`), and
            // the request's field digests after it when the store keeps them.
            let gathered =
                GatheredFields::judged_by(request.as_ref(), client.defining_fields.as_ref());
            let stored = StoredResponse::with_request_fields(
                parts.status,
                parts.version,
                &parts.headers,
                &bytes,
                &gathered,
            );
            (Outcome::Response(stored), ResponseBody::buffered(bytes))
        }
        Buffered::Overflow(prefix, rest) if read.retryable => {
            // A "try again" answer too large to read whole: in doubt, as unread.
            track.decided(Decision::InDoubt);
            let response = Response::from_parts(parts, ResponseBody::overflow(prefix, rest));
            return Err(settled_then(lease.mark_in_doubt(), response));
        }
        Buffered::Overflow(prefix, rest) => {
            tracing::info!(
                limit = client.response_limit,
                "response over the recording cap; keeping a tombstone"
            );
            let status = parts.status;
            (
                Outcome::Tombstone { status },
                ResponseBody::overflow(prefix, rest),
            )
        }
    };
    // A store that keeps only a tombstone of the outcome (no room for it) says so here.
    let (in_place, raised) = with_store_signals(|| lease.complete_in_place(outcome));
    track.signal_all(raised);
    match in_place {
        InPlace::Done(completed) => {
            not_recorded(completed);
            Ok(Response::from_parts(parts, body))
        }
        InPlace::Later(unsettled) => Err(Box::pin(async move {
            not_recorded(unsettled.complete().await);
            Ok(Response::from_parts(parts, body))
        })),
    }
}

/// Say so when the outcome could not be recorded.
fn not_recorded(completed: Result<(), crate::ledger::StoreError>) {
    if let Err(err) = completed {
        // The effect happened and the caller gets the real answer; a later run will find
        // the record in doubt and resend the same bytes under the same key.
        tracing::error!(%err, "could not record the outcome");
    }
}
