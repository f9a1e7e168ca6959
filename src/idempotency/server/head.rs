//! What the server face reads of a side-effecting request's headers before its body: the
//! `Idempotency-Key`, whether a `Content-Digest` came with it, and the length its
//! `Content-Length` declares.
//!
//! One pass over the headers rather than three lookups. The first two names are custom
//! headers, which a `HeaderMap` lookup hashes byte by byte, while a pass compares each name
//! it meets by its kind and length first (and a standard name like `Content-Length` by its
//! tag alone): a request of a dozen headers is cheaper to walk than the three names are to
//! hash and probe for. [`HeaderKey::from_headers`], `HeaderMap::contains_key` and
//! `HeaderMap::get` give the same answers (a property test below holds the pass to them).

use http::header::CONTENT_LENGTH;
use http::HeaderMap;

use crate::digest::CONTENT_DIGEST;
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
                repeated |= key.replace(value).is_some();
            } else if *name == CONTENT_DIGEST {
                content_digest = true;
            }
        }
        let key = match key {
            None => Ok(None),
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
