//! The faults a [`SideEffectService`](super::SideEffectService) can be told to inject.

use std::time::Duration;

use http::StatusCode;

/// A fault to inject into one call of a [`SideEffectService`](super::SideEffectService).
///
/// Queue faults with [`SideEffectService::push_fault`](super::SideEffectService::push_fault)
/// or [`with_faults`](super::SideEffectService::with_faults); each call takes the next one.
/// "Commit" below means the call's side effect happens (it counts) — and only when the call would
/// have committed anyway: a replay, a `409` or a `422` never commits.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::testing::{Fault, SideEffectService};
///
/// let provider = SideEffectService::new().with_faults([
///     Fault::Latency(Duration::from_millis(250)),
///     Fault::ServerError { status: http::StatusCode::SERVICE_UNAVAILABLE, commit: false },
/// ]);
/// provider.push_fault(Fault::RefuseBeforeSend);
/// assert_eq!(provider.pending_faults().len(), 3);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// Commit the effect (and, with key honouring on, record the answer for the key), then
    /// never answer, so the caller's timeout fires. The first incident: charged, but the
    /// caller cannot know.
    ///
    /// Over HTTP the response is held open until the client gives up.
    CommitThenTimeout,
    /// Fail at once with an [`io::Error`](std::io::Error) of kind
    /// [`ConnectionRefused`](std::io::ErrorKind::ConnectionRefused), without reading the
    /// request and without an effect, the way a refused connect looks to a client. This crate
    /// classifies that error as a pre-write failure
    /// ([`FailurePhase::PreWrite`](crate::phase::FailurePhase::PreWrite)).
    ///
    /// The request is not recorded in [`attempts`](super::SideEffectService::attempts) (the
    /// provider never saw it), but counts in [`calls`](super::SideEffectService::calls).
    ///
    /// Over HTTP the connection is closed without answering once the request head has
    /// arrived. A client cannot tell that from a failure after its bytes were written, and
    /// rightly treats it so; to test a true pre-write refusal over HTTP, point the client
    /// at a closed port.
    RefuseBeforeSend,
    /// Answer `status` (say `500` or `503`) with a JSON error body, after committing the
    /// effect when `commit` is `true` ("500, but the write happened": with key honouring on,
    /// a retry with the same key replays the commit's `201`) or without it (the key, if the
    /// call claimed one, is released so a retry runs normally).
    ServerError {
        /// The status to answer.
        status: StatusCode,
        /// Whether the effect happens before the error is answered.
        commit: bool,
    },
    /// Panic, after committing the effect when `after_commit` is `true` (without it, a
    /// claimed key is released first). In-process the caller's future panics; over HTTP
    /// the connection is dropped.
    Panic {
        /// Whether the effect happens before the panic.
        after_commit: bool,
    },
    /// Refuse the call as a provider still processing another request with its key does:
    /// `409` with Stripe's error object, `{"error":{"type":"idempotency_error",…}}`, and
    /// no `Retry-After`, without an effect (a key the call claimed is released, so the next
    /// call runs normally). Not an outcome: a client must neither record nor replay it.
    KeyInUse,
    /// Wait this long (with [`tokio::time::sleep`], so a paused test clock works), on top
    /// of the base latency, then answer normally.
    Latency(Duration),
}
