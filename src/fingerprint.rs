//! Fingerprints: what a request *says*, so a regenerated payload under an old key is caught.
//!
//! ```text
//! body_digest = SHA-256( body )
//! fingerprint =      SHA-256( "tower-idempotency/fingerprint/v3/method" || method )[..4]
//!                 || SHA-256( "tower-idempotency/fingerprint/v3/target" || target )[..12]
//!                 || body_digest[..16]
//! ```
//!
//! `target` is the request target as the client sent it: `scheme://authority/path?query`
//! for an absolute URI (what a client sends through the layers), the path and query alone
//! for an origin-form one (what a server receives). So one key reused against another host,
//! another resource or another method is a different fingerprint: a drift, never a replay
//! of the other request's outcome.
//!
//! The fingerprint is made of three segments, one per part of the request, so two that
//! differ say **which part** differs ([`Fingerprint::differing_parts`]): a `422` or a drift
//! error names the method, the target or the body instead of leaving the caller to guess.
//! Equality still means "the same request": 4 bytes tell methods apart (there are a handful
//! per resource), 12 the targets, 16 the bodies; guessing a different body with the same
//! segment takes 2^64 tries for a collision and 2^128 for a chosen one. Each segment hashes
//! one part alone behind its own tag, so no part can run into another.
//!
//! The body enters through its SHA-256 [`BodyDigest`], the very digest `Content-Digest:
//! sha-256` carries (see [`digest`](crate::digest)): the body is hashed once, for both, and
//! a server that verified a client's `Content-Digest` fingerprints without a second pass.
//! Headers are left out on purpose: they carry the idempotency key itself, tracing ids and
//! dates that legitimately differ between a request and its retry.
//!
//! Version 1 hashed the body into the fingerprint directly, version 2 hashed method, target
//! and body digest into one SHA-256; records written by either read as a drift under
//! version 3, naming every part (see the changelog).
//!
//! # Example
//!
//! ```
//! use tower_idempotency::digest::BodyDigest;
//! use tower_idempotency::fingerprint::RequestPart;
//! use tower_idempotency::fingerprint::Fingerprint;
//!
//! let a = Fingerprint::of(&http::Method::POST, "/charges", b"{\"amount\":100}");
//! let b = Fingerprint::of(&http::Method::POST, "/charges", b"{\"amount\":200}");
//! assert_ne!(a, b);
//! assert_eq!(a.differing_parts(&b).collect::<Vec<_>>(), [RequestPart::Body]);
//! let digest = BodyDigest::of(b"{\"amount\":100}");
//! assert_eq!(Fingerprint::from_digest(&http::Method::POST, "/charges", &digest), a);
//! ```

use std::fmt;

use http::Method;

pub(crate) mod canonical;
mod fields;

pub use fields::PayloadFields;
use sha2::{Digest, Sha256};

use crate::digest::BodyDigest;
use crate::key::hex;

const METHOD_TAG: &[u8] = b"tower-idempotency/fingerprint/v3/method";
const TARGET_TAG: &[u8] = b"tower-idempotency/fingerprint/v3/target";

/// Where each part's segment lies in the fingerprint.
const METHOD: std::ops::Range<usize> = 0..4;
const TARGET: std::ops::Range<usize> = 4..16;
const BODY: std::ops::Range<usize> = 16..32;

/// A request's method, target and body digest, hashed segment by segment.
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
        of_parts(method, &[target], body)
    }

    /// Wrap raw digest bytes (for stores decoding their own records).
    ///
    /// ```
    /// # use tower_idempotency::fingerprint::Fingerprint;
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

    /// The fingerprint that 64 hex digits spell (as [`to_hex`](Self::to_hex) writes it,
    /// either case); `None` for any other text.
    ///
    /// ```
    /// use tower_idempotency::fingerprint::Fingerprint;
    ///
    /// let fp = Fingerprint::of(&http::Method::POST, "/charges", b"{}");
    /// assert_eq!(Fingerprint::from_hex(&fp.to_hex()), Some(fp));
    /// assert_eq!(Fingerprint::from_hex("not hex"), None);
    /// ```
    pub fn from_hex(text: &str) -> Option<Self> {
        crate::key::derived::from_hex32(text).map(Self)
    }
}

impl Fingerprint {
    /// The parts of the request in which the requests fingerprinted `self` and `other`
    /// differ: none when the fingerprints are equal. Fingerprints of an older derivation
    /// (see the [module docs](crate::fingerprint)) differ in every part.
    ///
    /// ```
    /// use tower_idempotency::fingerprint::RequestPart;
    /// use tower_idempotency::fingerprint::Fingerprint;
    ///
    /// let first = Fingerprint::of(&http::Method::POST, "/orders", b"{}");
    /// let again = Fingerprint::of(&http::Method::PUT, "/orders/7", b"{}");
    /// let parts: Vec<_> = first.differing_parts(&again).collect();
    /// assert_eq!(parts, [RequestPart::Method, RequestPart::Target]);
    /// assert_eq!(first.differing_parts(&first).count(), 0);
    /// ```
    pub fn differing_parts(&self, other: &Fingerprint) -> impl Iterator<Item = RequestPart> {
        let (a, b) = (self.0, other.0);
        [
            (RequestPart::Method, METHOD),
            (RequestPart::Target, TARGET),
            (RequestPart::Body, BODY),
        ]
        .into_iter()
        .filter(move |(_, range)| a[range.clone()] != b[range.clone()])
        .map(|(part, _)| part)
    }
}

impl Fingerprint {
    /// The segment of `part` in hex: for the body, the first bytes of its SHA-256.
    pub(crate) fn segment_hex(&self, part: RequestPart) -> String {
        let range = match part {
            RequestPart::Method => METHOD,
            RequestPart::Target => TARGET,
            RequestPart::Body => BODY,
        };
        hex(&self.0[range])
    }
}

/// A part of a request its [`Fingerprint`] covers.
///
/// ```
/// use tower_idempotency::fingerprint::RequestPart;
///
/// assert_eq!(RequestPart::Target.as_str(), "target");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum RequestPart {
    /// The method.
    Method,
    /// The request target: the path and query (and, for a client, the scheme and host).
    Target,
    /// The body's bytes.
    Body,
}

impl RequestPart {
    /// `"method"`, `"target"` or `"body"`.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Method => "method",
            Self::Target => "target",
            Self::Body => "body",
        }
    }
}

impl fmt::Display for RequestPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
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
    /// The fingerprint of a request to `uri` as a client sends it, its body's SHA-256
    /// already known: the target is the absolute URI when `uri` has a scheme and an
    /// authority, else its path and query (see the [module docs](crate::fingerprint)). This
    /// is the fingerprint the client face claims its operations with, so a layer of one's
    /// own built on the crate's parts compares equal with it.
    ///
    /// ```
    /// use tower_idempotency::digest::BodyDigest;
    /// use tower_idempotency::fingerprint::{Fingerprint, RequestPart};
    ///
    /// let digest = BodyDigest::of(b"{}");
    /// let post = http::Method::POST;
    /// let sent = Fingerprint::of_sent(&post, &"https://pay.example/charges".parse().unwrap(), &digest);
    /// let same = Fingerprint::from_digest(&post, "https://pay.example/charges", &digest);
    /// assert_eq!(sent, same);
    /// // Another host is another target, even for the same path.
    /// let other = Fingerprint::of_sent(&post, &"https://other.example/charges".parse().unwrap(), &digest);
    /// assert_eq!(sent.differing_parts(&other).collect::<Vec<_>>(), [RequestPart::Target]);
    /// ```
    pub fn of_sent(method: &Method, uri: &http::Uri, body: &BodyDigest) -> Self {
        let path = uri.path_and_query().map_or("/", |pq| pq.as_str());
        // `http://h?q` and `http://h/?q` are one resource (an empty path is `/`, RFC 9110
        // §4.2.3), and a URI decoded from its text form always has the `/`.
        let slash = if path.starts_with('?') { "/" } else { "" };
        match (uri.scheme_str(), uri.authority()) {
            (Some(scheme), Some(authority)) => of_parts(
                method,
                &[scheme, "://", authority.as_str(), slash, path],
                body,
            ),
            _ => of_parts(method, &[slash, path], body),
        }
    }

    /// The fingerprint of a request a server received, its target in origin form: a client
    /// may send `POST /charges` or, through a proxy, `POST http://host/charges`, and both
    /// name one resource of this server (RFC 9112 §3.2.2).
    pub(crate) fn of_received(method: &Method, uri: &http::Uri, body: &BodyDigest) -> Self {
        let path = uri.path_and_query().map_or("/", |pq| pq.as_str());
        let slash = if path.starts_with('?') { "/" } else { "" };
        of_parts(method, &[slash, path], body)
    }
}

/// The fingerprint of `method`, a target given in pieces that are hashed as if joined (so an
/// absolute URI need not be formatted into a new string first), and `body`'s digest. Each
/// part is hashed alone behind its own tag, so no part needs a length prefix to stay apart
/// from another. Inlined into each caller, the hasher in one frame: every keyed request
/// makes one fingerprint, and each move of the hasher's state is a copy.
#[inline(always)]
fn of_parts(method: &Method, target: &[&str], body: &BodyDigest) -> Fingerprint {
    let mut hasher = Sha256::new();
    hasher.update(TARGET_TAG);
    for piece in target {
        hasher.update(piece.as_bytes());
    }
    let target: [u8; 32] = hasher.finalize().into();
    let mut fingerprint = [0; 32];
    fingerprint[METHOD].copy_from_slice(&method_segment(method));
    fingerprint[TARGET].copy_from_slice(&target[..TARGET.len()]);
    fingerprint[BODY].copy_from_slice(&body.as_bytes()[..BODY.len()]);
    Fingerprint(fingerprint)
}

/// The method's segment: the first bytes of its tagged hash. The methods that carry side
/// effects are hashed once per process, not once per request: each request saves a SHA-256
/// block spent on four bytes that never change.
fn method_segment(method: &Method) -> [u8; 4] {
    static COMMON: std::sync::OnceLock<[[u8; 4]; 4]> = std::sync::OnceLock::new();
    let at = match *method {
        Method::POST => 0,
        Method::PUT => 1,
        Method::PATCH => 2,
        Method::DELETE => 3,
        _ => return hashed_method_segment(method.as_str()),
    };
    COMMON.get_or_init(|| ["POST", "PUT", "PATCH", "DELETE"].map(hashed_method_segment))[at]
}

/// The first four bytes of SHA-256(method tag, `method`).
fn hashed_method_segment(method: &str) -> [u8; 4] {
    let hash: [u8; 32] = Sha256::new()
        .chain_update(METHOD_TAG)
        .chain_update(method)
        .finalize()
        .into();
    let mut segment = [0; 4];
    segment.copy_from_slice(&hash[..4]);
    segment
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_common_methods_remembered_segment_is_its_hash() {
        for method in [
            Method::POST,
            Method::PUT,
            Method::PATCH,
            Method::DELETE,
            Method::GET,
            Method::from_bytes(b"CHARGE").unwrap(),
        ] {
            assert_eq!(
                method_segment(&method),
                hashed_method_segment(method.as_str()),
                "{method}"
            );
        }
    }

    #[test]
    fn golden_vector_v3() {
        // Pinned: stores keep fingerprints, so a change here makes every record a drift.
        assert_eq!(
            Fingerprint::of(&Method::POST, "/charges", b"{}").to_hex(),
            "44a44d82b0709c1d8ad6d176bb707eb744136fa355b3678a1146ad16f7e8649e"
        );
    }

    #[test]
    fn golden_vector_matches_an_independent_encoding() {
        // The module docs' encoding, computed by hand.
        let segment = |tag: &str, part: &[u8], len: usize| {
            let mut input = tag.as_bytes().to_vec();
            input.extend_from_slice(part);
            Sha256::digest(&input)[..len].to_vec()
        };
        let mut expected = segment("tower-idempotency/fingerprint/v3/method", b"POST", 4);
        expected.extend(segment(
            "tower-idempotency/fingerprint/v3/target",
            b"/charges",
            12,
        ));
        expected.extend_from_slice(&Sha256::digest(b"{}")[..16]);
        assert_eq!(
            Fingerprint::of(&Method::POST, "/charges", b"{}").as_bytes(),
            &expected[..]
        );
        let absolute: http::Uri = "https://pay.local:8443/charges?x=1".parse().unwrap();
        let mut expected = segment("tower-idempotency/fingerprint/v3/method", b"POST", 4);
        expected.extend(segment(
            "tower-idempotency/fingerprint/v3/target",
            b"https://pay.local:8443/charges?x=1",
            12,
        ));
        expected.extend_from_slice(&Sha256::digest(b"{}")[..16]);
        assert_eq!(
            Fingerprint::of_sent(&Method::POST, &absolute, &BodyDigest::of(b"{}")).as_bytes(),
            &expected[..]
        );
    }

    #[test]
    fn a_difference_names_exactly_the_parts_that_differ() {
        use RequestPart::{Body, Method as M, Target};
        let methods = [Method::POST, Method::PATCH];
        let targets = ["/orders", "/orders?retry=1"];
        let bodies: [&[u8]; 2] = [b"{\"a\":1}", b"{ \"a\": 1 }"];
        let fp = |i: usize, j: usize, k: usize| Fingerprint::of(&methods[i], targets[j], bodies[k]);
        for (i, j, k) in (0..8).map(|n| (n & 1, (n >> 1) & 1, (n >> 2) & 1)) {
            let mut expected = Vec::new();
            if i == 1 {
                expected.push(M);
            }
            if j == 1 {
                expected.push(Target);
            }
            if k == 1 {
                expected.push(Body);
            }
            assert_eq!(
                fp(0, 0, 0)
                    .differing_parts(&fp(i, j, k))
                    .collect::<Vec<_>>(),
                expected
            );
            assert_eq!((fp(0, 0, 0) == fp(i, j, k)), expected.is_empty());
        }
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
        // Each part is hashed alone: path and body stay apart.
        assert_ne!(
            Fingerprint::of(&Method::POST, "/ab", b""),
            Fingerprint::of(&Method::POST, "/a", b"b")
        );
    }
}
