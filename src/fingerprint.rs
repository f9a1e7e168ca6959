//! Fingerprints: what a request *says*, so a regenerated payload under an old key is caught.
//!
//! ```text
//! body_digest = SHA-256( body )
//! fingerprint = SHA-256( "tower-idempotency/fingerprint/v2"
//!                        || u64_be(len(method)) || method
//!                        || u64_be(len(target)) || target
//!                        || body_digest )
//! ```
//!
//! `target` is the request target as the client sent it: `scheme://authority/path?query`
//! for an absolute URI (what a client sends through the layers), the path and query alone
//! for an origin-form one (what a server receives). So one key reused against another host,
//! another resource or another method is a different fingerprint: a drift, never a replay
//! of the other request's outcome.
//!
//! The body enters through its SHA-256 [`BodyDigest`], the very digest `Content-Digest:
//! sha-256` carries (see [`digest`](crate::digest)): the body is hashed once, for both, and
//! a server that verified a client's `Content-Digest` fingerprints without a second pass.
//! Headers are left out on purpose: they carry the idempotency key itself, tracing ids and
//! dates that legitimately differ between a request and its retry.
//!
//! Version 1 hashed the body into the fingerprint directly; records written by it read as a
//! drift under version 2 (see the changelog).
//!
//! # Example
//!
//! ```
//! use tower_idempotency::digest::BodyDigest;
//! use tower_idempotency::Fingerprint;
//!
//! let a = Fingerprint::of(&http::Method::POST, "/charges", b"{\"amount\":100}");
//! let b = Fingerprint::of(&http::Method::POST, "/charges", b"{\"amount\":200}");
//! assert_ne!(a, b);
//! let digest = BodyDigest::of(b"{\"amount\":100}");
//! assert_eq!(Fingerprint::from_digest(&http::Method::POST, "/charges", &digest), a);
//! ```

use std::fmt;

use http::Method;
use sha2::{Digest, Sha256};

use crate::digest::BodyDigest;
use crate::key::{hex, update_length_prefixed};

const FINGERPRINT_TAG: &[u8] = b"tower-idempotency/fingerprint/v2";

/// SHA-256 over a request's method, target and body digest.
///
/// See the [module docs](crate::fingerprint) for the exact encoding.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

impl Fingerprint {
    /// The fingerprint of a whole request; `target` as in the [module docs](crate::fingerprint).
    pub fn of(method: &Method, target: &str, body: &[u8]) -> Self {
        Self::from_digest(method, target, &BodyDigest::of(body))
    }

    /// The fingerprint of a request whose body's SHA-256 is already known (from a verified
    /// `Content-Digest`, or computed once for it): the body is not read again.
    pub fn from_digest(method: &Method, target: &str, body: &BodyDigest) -> Self {
        finish(head(method, &[target]), body)
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
    /// The fingerprint of a request to `uri` as the client sends it: absolute when it has a
    /// scheme and an authority, else its path and query.
    pub(crate) fn of_request(method: &Method, uri: &http::Uri, body: &BodyDigest) -> Self {
        let path = uri.path_and_query().map_or("/", |pq| pq.as_str());
        // `http://h?q` and `http://h/?q` are one resource (an empty path is `/`, RFC 9110
        // §4.2.3), and a URI decoded from its text form always has the `/`.
        let slash = if path.starts_with('?') { "/" } else { "" };
        let hasher = match (uri.scheme_str(), uri.authority()) {
            (Some(scheme), Some(authority)) => {
                head(method, &[scheme, "://", authority.as_str(), slash, path])
            }
            _ => head(method, &[slash, path]),
        };
        finish(hasher, body)
    }

    /// The fingerprint of a request a server received, its target in origin form: a client
    /// may send `POST /charges` or, through a proxy, `POST http://host/charges`, and both
    /// name one resource of this server (RFC 9112 §3.2.2).
    pub(crate) fn of_received(method: &Method, uri: &http::Uri, body: &BodyDigest) -> Self {
        let path = uri.path_and_query().map_or("/", |pq| pq.as_str());
        let slash = if path.starts_with('?') { "/" } else { "" };
        finish(head(method, &[slash, path]), body)
    }
}

/// Hash the tag, the method and the target, given in pieces that are hashed as if joined
/// (so an absolute URI need not be formatted into a new string first).
fn head(method: &Method, target: &[&str]) -> Sha256 {
    let mut hasher = Sha256::new();
    hasher.update(FINGERPRINT_TAG);
    update_length_prefixed(&mut hasher, method.as_str().as_bytes());
    let len: usize = target.iter().map(|piece| piece.len()).sum();
    hasher.update((len as u64).to_be_bytes());
    for piece in target {
        hasher.update(piece.as_bytes());
    }
    hasher
}

/// The body digest is fixed-size, so it needs no length prefix to stay apart from the head.
/// Inlined into each caller (every keyed request makes one fingerprint): a call moves the
/// hasher's state, for a handful of instructions of work.
#[inline(always)]
fn finish(mut hasher: Sha256, body: &BodyDigest) -> Fingerprint {
    hasher.update(body.as_bytes());
    Fingerprint(hasher.finalize().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_vector_v2() {
        // Pinned: stores keep fingerprints, so a change here makes every record a drift.
        assert_eq!(
            Fingerprint::of(&Method::POST, "/charges", b"{}").to_hex(),
            // The module docs' encoding, computed independently.
            "bbb7e7196d68041880fff7283ff3abe4d49de6623e00c2a9dd4e369700d55669"
        );
    }

    #[test]
    fn derived_from_the_body_digest() {
        let digest = BodyDigest::of(b"hello world");
        assert_eq!(
            Fingerprint::from_digest(&Method::POST, "/a?b=c", &digest),
            Fingerprint::of(&Method::POST, "/a?b=c", b"hello world")
        );
        let uri: http::Uri = "/a?b=c".parse().unwrap();
        assert_eq!(
            Fingerprint::of_received(&Method::POST, &uri, &digest),
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
