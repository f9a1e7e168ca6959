//! What the server face reads of a side-effecting request's head: before its body, the
//! `Idempotency-Key`, whether a `Content-Digest` came with it, and the length its
//! `Content-Length` declares; once the body is read, the target as the client sent it and
//! the body's digest, checked against the sender's.
//!
//! One pass over the headers rather than three lookups. The first two names are custom
//! headers, which a `HeaderMap` lookup hashes byte by byte, while a pass compares each name
//! it meets by its kind and length first (and a standard name like `Content-Length` by its
//! tag alone): a request of a dozen headers is cheaper to walk than the three names are to
//! hash and probe for. [`HeaderKey::from_headers`], `HeaderMap::contains_key` and
//! `HeaderMap::get` give the same answers (a property test below holds the pass to them).

use http::header::{self, CONTENT_LENGTH};
use http::request::Parts;
use http::HeaderMap;

use crate::digest::{BodyDigest, ContentDigest, DigestError, CONTENT_DIGEST};
use crate::frozen::declared_length;
use crate::key::{HeaderKey, InvalidKey, IDEMPOTENCY_KEY};

/// A keyed request's head as the server face reads it (see the module docs).
#[derive(Debug)]
pub(super) struct KeyedHead {
    /// The key, none, or why it was refused: as [`HeaderKey::from_headers`] answers.
    pub(super) key: Result<Option<HeaderKey>, InvalidKey>,
    /// Whether the request carries a `Content-Digest` (of any value) to check the body by.
    pub(super) content_digest: bool,
    /// What the request's (first) `Content-Length` declares, when it is a number.
    pub(super) declared_length: Option<u64>,
}

impl KeyedHead {
    /// Read `headers` once.
    pub(super) fn of(headers: &HeaderMap) -> Self {
        let mut key = None;
        let mut repeated = false;
        let mut content_digest = false;
        let mut content_length = None;
        for (name, value) in headers {
            if *name == CONTENT_LENGTH {
                // The first, as `HeaderMap::get` reads it.
                content_length = content_length.or(Some(value));
            } else if *name == IDEMPOTENCY_KEY {
                // Kept going after a second copy rather than stopping: the pass must still
                // find the other two names, and `repeated` alone decides the answer.
                repeated |= key.replace(value).is_some();
            } else if *name == CONTENT_DIGEST {
                content_digest = true;
            }
        }
        let key = match key {
            None => Ok(None),
            // Refused even when the copies agree, as `HeaderKey::from_headers` refuses them:
            // two field lines are one comma-joined field (RFC 9110 §5.3), which is no single
            // sf-string, and picking one copy would guess at which the client meant.
            Some(_) if repeated => Err(InvalidKey::Repeated),
            Some(value) => HeaderKey::parse(value).map(Some),
        };
        Self {
            key,
            content_digest,
            declared_length: declared_length(content_length),
        }
    }
}

/// The request target as the client sent it. A router that nests this layer under a
/// prefix (`Router::nest("/accounts/{id}", …)`) hands it a URI with the prefix stripped;
/// with feature `axum`, the layer reads the original from axum's `OriginalUri` extension,
/// so `/accounts/1/charges` and `/accounts/2/charges` never look like one request.
pub(super) fn original_target(parts: &Parts) -> &http::Uri {
    #[cfg(feature = "axum")]
    if let Some(axum::extract::OriginalUri(uri)) = parts.extensions.get() {
        return uri;
    }
    &parts.uri
}

/// The body's SHA-256: the sender's, once checked, when its `Content-Digest` carries one
/// (`sent`: the request has that header); else computed here. Every `sha-256` and `sha-512`
/// member must match the body, unless a layer in front decoded it (see [`decoded_in_front`]):
/// the digest is then of bytes this layer never sees, and the body is fingerprinted as
/// received, as if no digest had come.
pub(super) fn verified_body_digest(
    headers: &HeaderMap,
    sent: bool,
    body: &[u8],
) -> Result<BodyDigest, DigestError> {
    debug_assert_eq!(sent, headers.contains_key(&CONTENT_DIGEST));
    if !sent {
        return Ok(BodyDigest::of(body));
    }
    let field = ContentDigest::of_headers(headers)?;
    match field.verify(body) {
        // `None`: no `sha-256` member was checked (`sha-512` only), and the fingerprint
        // still needs the body's SHA-256.
        Ok(verified) => Ok(verified.unwrap_or_else(|| BodyDigest::of(body))),
        Err(err) if err.is_mismatch() && decoded_in_front(headers) => {
            tracing::debug!(
                "the Content-Digest is not of the body received, whose framing headers a layer \
                 in front removed (request decompression): not verified"
            );
            Ok(BodyDigest::of(body))
        }
        Err(err) => Err(err),
    }
}

/// Whether a layer in front of this one may have decoded the body: it carries neither
/// `Content-Length` nor `Transfer-Encoding`, nor a `Content-Encoding` still to decode.
///
/// `Content-Digest` is over the content as sent, content coding applied (RFC 9530 §2).
/// Request decompression (tower-http's `RequestDecompressionLayer`) decodes the body and
/// removes `Content-Encoding` and `Content-Length`, and leaves the `Content-Digest` of the
/// encoded bytes behind: checked against the decoded body, it would refuse every compressed
/// request. A body as received over HTTP/1.1 always has its framing (one of the two
/// headers), so a mismatch with it present is a body that is not what its sender digested.
/// Without them (a decoded body; HTTP/2 senders that declare no length; requests made
/// in-process) the digest cannot be told from one of other bytes, and a `400` that drops
/// the request would be wrong for the first.
fn decoded_in_front(headers: &HeaderMap) -> bool {
    !headers.contains_key(header::CONTENT_LENGTH)
        && !headers.contains_key(header::TRANSFER_ENCODING)
        && !headers.contains_key(header::CONTENT_ENCODING)
}

#[cfg(test)]
mod tests {
    use http::header::{HeaderName, HeaderValue, CONTENT_LENGTH, CONTENT_TYPE, HOST};
    use proptest::prelude::*;

    use super::*;

    /// Names a request may carry: the two read here, standard ones, and custom ones of the
    /// same length as each of the two (the pass compares lengths first).
    fn name() -> impl Strategy<Value = HeaderName> {
        prop_oneof![
            Just(IDEMPOTENCY_KEY.clone()),
            Just(CONTENT_DIGEST.clone()),
            Just(HOST),
            Just(CONTENT_TYPE),
            Just(CONTENT_LENGTH),
            Just(HeaderName::from_static("idempotency-kez")),
            Just(HeaderName::from_static("content-digesx")),
            Just(HeaderName::from_static("x-request-id")),
        ]
    }

    /// Values that are valid keys, malformed keys, lengths (some padded, some too long to
    /// be one) and empty values.
    fn value() -> impl Strategy<Value = HeaderValue> {
        prop_oneof![
            "[ ]?[0-9]{1,21}[ ]?".prop_map(|text| HeaderValue::from_str(&text).unwrap()),
            "\"[a-z0-9-]{0,12}\"".prop_map(|text| HeaderValue::from_str(&text).unwrap()),
            "[a-z0-9 ]{0,12}".prop_map(|text| HeaderValue::from_str(&text).unwrap()),
            Just(HeaderValue::from_static("")),
        ]
    }

    proptest! {
        #[test]
        fn one_pass_reads_what_the_lookups_read(
            headers in prop::collection::vec((name(), value()), 0..12),
        ) {
            let mut map = HeaderMap::new();
            for (name, value) in headers {
                map.append(name, value);
            }
            let head = KeyedHead::of(&map);
            prop_assert_eq!(head.key, HeaderKey::from_headers(&map));
            prop_assert_eq!(head.content_digest, map.contains_key(&CONTENT_DIGEST));
            prop_assert_eq!(head.declared_length, declared_length(map.get(CONTENT_LENGTH)));
        }
    }

    #[test]
    fn a_repeated_key_is_refused_even_when_each_value_is_valid() {
        let mut map = HeaderMap::new();
        map.append(&IDEMPOTENCY_KEY, HeaderValue::from_static("\"a\""));
        map.append(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        map.append(&IDEMPOTENCY_KEY, HeaderValue::from_static("\"a\""));
        let head = KeyedHead::of(&map);
        assert_eq!(head.key, Err(InvalidKey::Repeated));
        assert!(!head.content_digest);
    }
}
