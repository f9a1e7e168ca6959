//! Handing a frozen request on to a retry layer outside.

use std::sync::Arc;

use bytes::Bytes;
use http::Extensions;

use super::request::FrozenRequest;
use crate::key::KeyHeader;
use crate::phase::FailurePhase;

/// What the client [`IdempotencyLayer`](crate::IdempotencyLayer) leaves in a request's
/// extensions for the [`FrozenRetryLayer`](crate::FrozenRetryLayer) inside it, and what the
/// retry layer tells it back.
///
/// The retry layer sends what it is handed (a layer in between may have added a header);
/// when it is handed the very bytes the idempotency layer froze, it reuses their fingerprint
/// instead of hashing them again. Every attempt that may have left and was followed by
/// another is reported here, so "may have been sent" survives later attempts that were
/// refused before writing, or answered that nothing started; the last attempt speaks for
/// itself (its answer, or its failure's phase).
#[derive(Clone, Debug)]
pub(crate) struct Handoff(Arc<HandoffState>);

#[derive(Debug)]
pub(super) struct HandoffState {
    frozen: FrozenRequest,
    /// The server ignores `Idempotency-Key`: a keyed side effect is then no safer to resend
    /// than an unkeyed one.
    key_ignored: bool,
    /// The header the key travels under: how the retry layer tells a keyed request.
    key_header: KeyHeader,
    sent: std::sync::atomic::AtomicBool,
    /// The retry window of the retry layer inside, in ms, once it reported it (0: none).
    retry_window_ms: std::sync::atomic::AtomicU64,
    /// Sends of the attempt this hand-off travels with, counted by what sends it (see
    /// [`Handoff::start_send`]).
    sends: std::sync::atomic::AtomicU32,
    /// How far the first send got, once it ended (the codes below; 0: not yet).
    first_send: std::sync::atomic::AtomicU8,
}

impl Handoff {
    pub(crate) fn new(frozen: FrozenRequest, key_ignored: bool, key_header: KeyHeader) -> Self {
        Self(Arc::new(HandoffState {
            frozen,
            key_ignored,
            key_header,
            sent: std::sync::atomic::AtomicBool::new(false),
            retry_window_ms: std::sync::atomic::AtomicU64::new(0),
            sends: std::sync::atomic::AtomicU32::new(0),
            first_send: std::sync::atomic::AtomicU8::new(0),
        }))
    }

    /// The request handed on, frozen.
    pub(crate) fn frozen(&self) -> &FrozenRequest {
        &self.0.frozen
    }

    pub(crate) fn key_ignored(&self) -> bool {
        self.0.key_ignored
    }

    /// The header the idempotency layer sends the key under.
    pub(crate) fn key_header(&self) -> &KeyHeader {
        &self.0.key_header
    }

    /// An attempt of this operation that may have reached the server is followed by
    /// another.
    pub(crate) fn attempt_may_have_left(&self) {
        self.0
            .sent
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The retry layer inside reports the longest it may keep retrying.
    pub(crate) fn report_retry_window(&self, window: std::time::Duration) {
        let ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX).max(1);
        self.0
            .retry_window_ms
            .store(ms, std::sync::atomic::Ordering::Relaxed);
    }

    /// The retry window the retry layer inside reported, if it did.
    pub(crate) fn retry_window(&self) -> Option<std::time::Duration> {
        match self
            .0
            .retry_window_ms
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            0 => None,
            ms => Some(std::time::Duration::from_millis(ms)),
        }
    }

    /// Whether an attempt followed by another may have reached the server.
    pub(crate) fn may_have_been_sent(&self) -> bool {
        self.0.sent.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// What sends the attempt this hand-off travels with (this crate's transport, or the
    /// [`FrozenRetryLayer`](crate::FrozenRetryLayer) it is handed to) is about to send it.
    /// The first send goes ahead. Any later one is a retrying layer in between that cloned
    /// the request, extensions and all, to send it again, blind to the provider's keys:
    /// refused before any of it leaves, with how far the first send got (a send still
    /// under way may have left).
    pub(crate) fn start_send(&self) -> Result<(), crate::Error> {
        use std::sync::atomic::Ordering::Relaxed;
        if self.0.sends.fetch_add(1, Relaxed) == 0 {
            return Ok(());
        }
        let first = match self.0.first_send.load(Relaxed) {
            PRE_WRITE => FailurePhase::PreWrite,
            AFTER_WRITE => FailurePhase::AfterWrite,
            _ => FailurePhase::Unknown,
        };
        Err(crate::Error::retry_inside(first))
    }

    /// The first send ended, having got as far as `phase` (an answer is `AfterWrite`).
    pub(crate) fn first_send_ended(&self, phase: FailurePhase) {
        let code = match phase {
            FailurePhase::PreWrite => PRE_WRITE,
            FailurePhase::AfterWrite => AFTER_WRITE,
            FailurePhase::Unknown => UNKNOWN,
        };
        // Only the first send's: a refused later one never gets here.
        let _ = self.0.first_send.compare_exchange(
            0,
            code,
            std::sync::atomic::Ordering::Relaxed,
            std::sync::atomic::Ordering::Relaxed,
        );
    }
}

/// [`HandoffState::first_send`]'s codes (0: the first send has not ended).
const PRE_WRITE: u8 = 1;
const AFTER_WRITE: u8 = 2;
const UNKNOWN: u8 = 3;

/// Left by a [`FrozenRetryLayer`](crate::FrozenRetryLayer) on the attempts of a request no
/// idempotency layer handed it, so an [`IdempotencyLayer`](crate::IdempotencyLayer) inside
/// it can tell that the layers are stacked the wrong way round. Zero-sized: inserting it
/// allocates nothing but, at most, the extensions' map.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RetriedOutside;

/// Left by a [`FrozenRetryLayer`](crate::FrozenRetryLayer) on each attempt of an operation
/// an [`IdempotencyLayer`](crate::IdempotencyLayer) handed it, so a second retry layer under
/// it refuses the attempt rather than retrying it on its own, blind to the provider's keys
/// and to the operation's doubt. Zero-sized, and put in a map that held the hand-off: it
/// costs no allocation, neither here nor in each attempt's copy of the extensions.
#[derive(Clone, Copy, Debug)]
pub(crate) struct OperationAttempt;

/// Refuse a request that is an attempt of an operation another retry layer already
/// retries (see [`OperationAttempt`]), before anything of it is sent.
pub(crate) fn refuse_nested_retry(extensions: &Extensions) -> Result<(), crate::Error> {
    match extensions.get::<OperationAttempt>() {
        Some(OperationAttempt) => Err(crate::Error::retry_nested()),
        None => Ok(()),
    }
}

/// What the retry layer was handed, frozen.
pub(crate) struct Handed {
    /// What every attempt is rebuilt from.
    pub(crate) frozen: FrozenRequest,
    /// The request's extensions, given to every attempt (without the hand-off: nothing
    /// below the retry layer reads it, and each attempt's copy would cost an allocation).
    pub(crate) extensions: Extensions,
    /// What the idempotency layer outside handed on, if one did.
    pub(crate) handoff: Option<Handoff>,
    /// The head and body exactly as handed in, when they are the bytes the outer
    /// idempotency layer froze: the first attempt sends them as they are, and `frozen` is
    /// that layer's own, so no second copy of the head is made for an operation that is
    /// answered at once.
    pub(crate) first: Option<(http::request::Parts, Bytes)>,
}

/// Freeze the request the retry layer was handed, once its body is read. When an outer
/// idempotency layer handed on exactly the request it froze (same method, URI, version,
/// headers in the same order and the same body bytes), its [`FrozenRequest`] is taken as
/// it is, digest and fingerprint included; otherwise the request is frozen anew, reusing
/// the fingerprint when the bytes are the ones it froze.
#[inline(always)]
pub(crate) fn hand_over(mut parts: http::request::Parts, body: Bytes) -> Handed {
    let mut extensions = std::mem::take(&mut parts.extensions);
    let handoff = extensions.remove::<Handoff>();
    let same = handoff
        .as_ref()
        .map(|handoff| &handoff.0.frozen)
        .filter(|frozen| frozen.is_exactly(&parts, &body))
        .cloned();
    if let Some(frozen) = same {
        return Handed {
            frozen,
            extensions,
            handoff,
            first: Some((parts, body)),
        };
    }
    let frozen =
        FrozenRequest::from_parts(parts.method, parts.uri, parts.version, parts.headers, body);
    if let Some(handoff) = &handoff {
        frozen.reuse_fingerprint_of(&handoff.0.frozen);
    }
    Handed {
        frozen,
        extensions,
        handoff,
        first: None,
    }
}
