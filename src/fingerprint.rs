//! Fingerprints: what a request *says*, so a regenerated payload under an old key is caught.
//!
//! ```text
//! fingerprint = SHA-256( "tower-idempotency/fingerprint/v1"
//!                        || u64_be(len(method)) || method
//!                        || u64_be(len(path_and_query)) || path_and_query
//!                        || body )
//! ```
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

/// SHA-256 over a request's method, path-and-query and raw body bytes.
///
/// See the [module docs](crate::fingerprint) for the exact encoding.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of a whole request.
    pub fn of(method: &Method, path_and_query: &str, body: &[u8]) -> Self {
        let mut hasher = FingerprintHasher::new(method, path_and_query);
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

/// Incremental fingerprinting: the head first, then body chunks as they arrive.
pub(crate) struct FingerprintHasher(Sha256);

impl FingerprintHasher {
    pub(crate) fn new(method: &Method, path_and_query: &str) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(FINGERPRINT_TAG);
        update_length_prefixed(&mut hasher, method.as_str().as_bytes());
        update_length_prefixed(&mut hasher, path_and_query.as_bytes());
        Self(hasher)
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
        let mut hasher = FingerprintHasher::new(&Method::POST, "/a?b=c");
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
