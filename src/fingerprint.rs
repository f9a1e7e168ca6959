//! Fingerprints: what a request *says*, so a regenerated payload under an old key is caught.
//!
//! ```text
//! fingerprint = SHA-256( "tower-idempotency/fingerprint/v1"
//!                        || u64_be(len(method)) || method
//!                        || u64_be(len(target)) || target
//!                        || body )
//! ```
//!
//! `target` is the request target as the client sent it: `scheme://authority/path?query`
//! for an absolute URI (what a client sends through the layers), the path and query alone
//! for an origin-form one (what a server receives). So one key reused against another host,
//! another resource or another method is a different fingerprint: a drift, never a replay
//! of the other request's outcome.
//!
//! The body comes last and is hashed as it streams in, so a request's bytes are read once
//! and hashed once. Headers are left out on purpose: they carry the idempotency key itself,
//! tracing ids and dates that legitimately differ between a request and its retry.
//!
//! # Example
//!
//! ```
//! use tower_idempotency::Fingerprint;
//!
//! let a = Fingerprint::of(&http::Method::POST, "/charges", b"{\"amount\":100}");
//! let b = Fingerprint::of(&http::Method::POST, "/charges", b"{\"amount\":200}");
//! assert_ne!(a, b);
//! ```

use std::fmt;

use http::Method;
use sha2::{Digest, Sha256};

use crate::key::{hex, update_length_prefixed};

const FINGERPRINT_TAG: &[u8] = b"tower-idempotency/fingerprint/v1";

/// SHA-256 over a request's method, target and raw body bytes.
///
/// See the [module docs](crate::fingerprint) for the exact encoding.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of a whole request; `target` as in the [module docs](crate::fingerprint).
    pub fn of(method: &Method, target: &str, body: &[u8]) -> Self {
        let mut hasher = FingerprintHasher::new(method, &[target]);
        hasher.update(body);
        hasher.finish()
    }

    /// Wrap raw digest bytes (for stores decoding their own records).
    ///
    /// ```
    /// # use tower_idempotency::Fingerprint;
    /// let fp = Fingerprint::of(&http::Method::GET, "/", b"");
    /// assert_eq!(Fingerprint::from_bytes(*fp.as_bytes()), fp);
    /// ```
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The raw digest.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The digest as 64 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", self.to_hex())
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl Fingerprint {
    /// The fingerprint of a request to `uri`, hashing its target in pieces.
    pub(crate) fn of_request(method: &Method, uri: &http::Uri, body: &[u8]) -> Self {
        let mut hasher = FingerprintHasher::for_target(method, uri);
        hasher.update(body);
        hasher.finish()
    }

    /// The fingerprint of a request a server received, its target in origin form: a client
    /// may send `POST /charges` or, through a proxy, `POST http://host/charges`, and both
    /// name one resource of this server (RFC 9112 §3.2.2).
    pub(crate) fn of_received(method: &Method, uri: &http::Uri, body: &[u8]) -> Self {
        let path = uri.path_and_query().map_or("/", |pq| pq.as_str());
        let slash = if path.starts_with('?') { "/" } else { "" };
        let mut hasher = FingerprintHasher::new(method, &[slash, path]);
        hasher.update(body);
        hasher.finish()
    }
}

/// Incremental fingerprinting: the head first, then body chunks as they arrive.
pub(crate) struct FingerprintHasher(Sha256);

impl FingerprintHasher {
    /// Start with the method and the target, given in pieces that are hashed as if joined
    /// (so an absolute URI need not be formatted into a new string first).
    pub(crate) fn new(method: &Method, target: &[&str]) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(FINGERPRINT_TAG);
        update_length_prefixed(&mut hasher, method.as_str().as_bytes());
        let len: usize = target.iter().map(|piece| piece.len()).sum();
        hasher.update((len as u64).to_be_bytes());
        for piece in target {
            hasher.update(piece.as_bytes());
        }
        Self(hasher)
    }

    /// Start with the method and `uri` as the client sent it: absolute when it has a scheme
    /// and an authority, else its path and query.
    pub(crate) fn for_target(method: &Method, uri: &http::Uri) -> Self {
        let path = uri.path_and_query().map_or("/", |pq| pq.as_str());
        // `http://h?q` and `http://h/?q` are one resource (an empty path is `/`, RFC 9110
        // §4.2.3), and a URI decoded from its text form always has the `/`.
        let slash = if path.starts_with('?') { "/" } else { "" };
        match (uri.scheme_str(), uri.authority()) {
            (Some(scheme), Some(authority)) => {
                Self::new(method, &[scheme, "://", authority.as_str(), slash, path])
            }
            _ => Self::new(method, &[slash, path]),
        }
    }

    pub(crate) fn update(&mut self, chunk: &[u8]) {
        self.0.update(chunk);
    }

    pub(crate) fn finish(self) -> Fingerprint {
        Fingerprint(self.0.finalize().into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streaming_equals_one_shot() {
        let mut hasher = FingerprintHasher::new(&Method::POST, &["/a?b=c"]);
        hasher.update(b"hello ");
        hasher.update(b"world");
        assert_eq!(
            hasher.finish(),
            Fingerprint::of(&Method::POST, "/a?b=c", b"hello world")
        );
    }

    #[test]
    fn every_field_counts() {
        let base = Fingerprint::of(&Method::POST, "/a", b"x");
        assert_ne!(base, Fingerprint::of(&Method::PUT, "/a", b"x"));
        assert_ne!(base, Fingerprint::of(&Method::POST, "/a?", b"x"));
        assert_ne!(base, Fingerprint::of(&Method::POST, "/a", b"y"));
        // The path's length prefix keeps path and body apart.
        assert_ne!(
            Fingerprint::of(&Method::POST, "/ab", b""),
            Fingerprint::of(&Method::POST, "/a", b"b")
        );
    }
}
