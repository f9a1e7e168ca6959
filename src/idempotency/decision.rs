//! One `tracing` event per ledger decision, the same on both faces.
//!
//! Field names are dotted, as OpenTelemetry attributes are: `idempotency.face` (`client`,
//! `server`), `idempotency.decision` and `idempotency.key.digest`. The digest is the first
//! 16 hex digits of `SHA-256("tower-idempotency/log/v1" || key)` over the `Idempotency-Key`
//! as it travels (unquoted), so a client's and a server's logs of one operation can be
//! joined, while neither ever logs the key itself (a caller's own key may be a secret) or a
//! credential. It is computed only when an event is recorded.
//!
//! With feature `metrics`, each decision also counts in `idempotency_decisions_total`
//! (labels `face`, `decision`).

use std::fmt;

use sha2::{Digest, Sha256};

use crate::key::{hex, HeaderKey, IdempotencyKey};

/// Which face decided.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Face {
    Client,
    Server,
}

impl Face {
    fn as_str(self) -> &'static str {
        match self {
            Self::Client => "client",
            Self::Server => "server",
        }
    }
}

/// What the ledger decided for one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Decision {
    /// A new operation: sent (client) or run (server).
    Acquired,
    /// The recorded outcome was returned; nothing was sent or run.
    Replayed,
    /// An in-doubt operation was taken over: resent (client) or run again (server).
    Resumed,
    /// Another owner holds it.
    Busy,
    /// The same key with another request.
    Drift,
    /// Left or found in doubt.
    InDoubt,
    /// Released after a failure proven to happen before anything was sent.
    Released,
    /// Refused: the ledger is full of records it must keep.
    Full,
    /// Refused: the ledger is unavailable (fail closed).
    Unavailable,
}

impl Decision {
    fn as_str(self) -> &'static str {
        match self {
            Self::Acquired => "acquired",
            Self::Replayed => "replayed",
            Self::Resumed => "resumed",
            Self::Busy => "busy",
            Self::Drift => "drift",
            Self::InDoubt => "in_doubt",
            Self::Released => "released",
            Self::Full => "full",
            Self::Unavailable => "unavailable",
        }
    }
}

/// The key as it travels in `Idempotency-Key`, for its digest.
#[derive(Clone, Debug)]
pub(crate) enum WireKey {
    /// Derived from an `OperationId`: travels as its 64 hex digits.
    Derived(IdempotencyKey),
    /// The caller's own, or the one a server received.
    Header(HeaderKey),
}

/// Formats the digest of a [`WireKey`] (only when an event or a span records it).
pub(crate) struct KeyDigest<'a>(pub(crate) &'a WireKey);

impl fmt::Display for KeyDigest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut hasher = Sha256::new();
        hasher.update(b"tower-idempotency/log/v1");
        match self.0 {
            WireKey::Derived(key) => hasher.update(key.to_hex().as_bytes()),
            WireKey::Header(key) => hasher.update(key.as_str().as_bytes()),
        }
        f.write_str(&hex(&hasher.finalize()[..8]))
    }
}

/// Record `decision` as one event, at a level that says how much it deserves attention.
pub(crate) fn log(face: Face, decision: Decision, key: &WireKey) {
    let (face, what, digest) = (face.as_str(), decision.as_str(), KeyDigest(key));
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_decisions_total", "face" => face, "decision" => what)
        .increment(1);
    match decision {
        Decision::Drift | Decision::Full | Decision::Unavailable => tracing::warn!(
            idempotency.face = face,
            idempotency.decision = what,
            idempotency.key.digest = %digest,
            "idempotency decision"
        ),
        Decision::InDoubt | Decision::Resumed => tracing::info!(
            idempotency.face = face,
            idempotency.decision = what,
            idempotency.key.digest = %digest,
            "idempotency decision"
        ),
        _ => tracing::debug!(
            idempotency.face = face,
            idempotency.decision = what,
            idempotency.key.digest = %digest,
            "idempotency decision"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_derived_key_and_the_header_it_travels_in_have_one_digest() {
        let derived = IdempotencyKey::derive("", "task", "step");
        let value = derived.header_value();
        let received = HeaderKey::parse(&value).unwrap();
        let a = KeyDigest(&WireKey::Derived(derived)).to_string();
        let b = KeyDigest(&WireKey::Header(received)).to_string();
        assert_eq!(a, b);
        assert_eq!(a.len(), 16);
        assert!(!a.contains(&derived.to_hex()[..16]));
    }
}
