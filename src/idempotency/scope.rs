//! Whose keys a key is among: the rule both faces use to keep one principal's
//! `Idempotency-Key`s apart from another's.
//!
//! A key chosen by a caller (a client sending its own `Idempotency-Key`, or a server
//! receiving one) is only unique within the caller's own namespace: two merchants may both
//! call their charge `order-1001-charge`. So a caller's key is stored under its **scope**.
//! By default the scope is a hash of the `Authorization` header the key travels with, as
//! payment providers scope keys by API key; a request that carries a key but no
//! credential has no scope, and is refused rather than put in a scope shared by everyone.
//! The user can name the principal instead (a function of the request head), or opt into
//! one scope for all.

use std::sync::Arc;

use http::header;
use http::request::Parts;
use http::HeaderMap;
use sha2::{Digest, Sha256};

use crate::key::{hex, update_length_prefixed};

/// A user's scope function: the principal of a request head.
pub(crate) type ScopeFn = dyn Fn(&Parts) -> String + Send + Sync;

/// Whose keys a request's key is among.
#[derive(Clone)]
pub(crate) enum Scope {
    /// A hash of the `Authorization` header; a keyed request without one has no scope.
    Authorization,
    /// One scope for every caller, chosen explicitly.
    Unscoped,
    /// The user's function of the request head.
    Custom(Arc<ScopeFn>),
}

impl std::fmt::Debug for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Authorization => "Authorization",
            Self::Unscoped => "Unscoped",
            Self::Custom(_) => "Custom",
        })
    }
}

impl Scope {
    /// The scope of a request, or `None` when it has no principal to be scoped by.
    pub(crate) fn of(&self, parts: &Parts) -> Option<String> {
        match self {
            Self::Authorization => authorization_scope(&parts.headers),
            Self::Unscoped => Some(String::new()),
            Self::Custom(scope) => Some(scope(parts)),
        }
    }
}

/// The default scope: a hash of the `Authorization` header's values, so each credential
/// gets its own keys and the credential itself is never part of a key input kept anywhere.
/// Without the header there is no principal: `None`.
///
/// Each value is hashed as HTTP reads it ([`canonical_credentials`]): `bearer tok`,
/// `Bearer tok` and `BEARER  tok` are one caller, whose retry must replay, not run again.
pub(crate) fn authorization_scope(headers: &HeaderMap) -> Option<String> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter().peekable();
    values.peek()?;
    let mut hasher = Sha256::new();
    hasher.update(b"tower-idempotency/scope/authorization/v1");
    for value in values {
        update_length_prefixed(&mut hasher, &canonical_credentials(value.as_bytes()));
    }
    Some(hex(&hasher.finalize()))
}

/// Spaces and horizontal tabs: the whitespace HTTP allows around and inside a field value.
fn is_whitespace(byte: &u8) -> bool {
    matches!(byte, b' ' | b'\t')
}

/// An `Authorization` value as HTTP compares it (RFC 9110, 11.4 and 11.6.2): the
/// auth-scheme is case-insensitive and separated from the credentials by one or more
/// spaces; the credentials are compared exactly (a token's case is its own). Whitespace
/// around the value is not part of it (RFC 9110, 5.5).
///
/// The canonical scheme is its first letter upper case and the rest lower case, one space,
/// then the credentials: the spelling nearly every client sends (`Bearer`, `Basic`,
/// `Digest`, `Negotiate`), which is then hashed as before this rule existed, so a record a
/// durable store kept under such a credential is still found after an upgrade. Borrowed
/// when the value is already canonical, as such a value is.
fn canonical_credentials(value: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    let start = value
        .iter()
        .position(|b| !is_whitespace(b))
        .unwrap_or(value.len());
    let end = value
        .iter()
        .rposition(|b| !is_whitespace(b))
        .map_or(start, |last| last + 1);
    let value = &value[start..end];
    let scheme_end = value.iter().position(is_whitespace).unwrap_or(value.len());
    let (scheme, rest) = value.split_at(scheme_end);
    let credentials = &rest[rest
        .iter()
        .position(|b| !is_whitespace(b))
        .unwrap_or(rest.len())..];
    let canonical_scheme = scheme.iter().enumerate().map(|(i, b)| {
        if i == 0 {
            b.to_ascii_uppercase()
        } else {
            b.to_ascii_lowercase()
        }
    });
    let separator = &rest[..rest.len() - credentials.len()];
    let separated_by_one_space = rest.is_empty() || separator == b" ";
    if separated_by_one_space && canonical_scheme.clone().eq(scheme.iter().copied()) {
        return std::borrow::Cow::Borrowed(value);
    }
    let mut canonical = Vec::with_capacity(scheme.len() + 1 + credentials.len());
    canonical.extend(canonical_scheme);
    if !credentials.is_empty() {
        canonical.push(b' ');
        canonical.extend_from_slice(credentials);
    }
    std::borrow::Cow::Owned(canonical)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(auth: &[&'static str]) -> HeaderMap {
        let mut headers = HeaderMap::new();
        for value in auth {
            headers.append(header::AUTHORIZATION, http::HeaderValue::from_static(value));
        }
        headers
    }

    #[test]
    fn default_scope_hashes_credentials_and_never_holds_them() {
        assert_eq!(authorization_scope(&headers(&[])), None);
        let a = authorization_scope(&headers(&["Bearer a"]));
        let b = authorization_scope(&headers(&["Bearer b"]));
        assert_ne!(a, b);
        assert_eq!(a, authorization_scope(&headers(&["Bearer a"])));
        assert_ne!(
            authorization_scope(&headers(&["a", "b"])),
            authorization_scope(&headers(&["ab"]))
        );
        let a = a.unwrap();
        assert_eq!(a.len(), 64);
        assert!(!a.contains("Bearer"));
    }

    #[test]
    fn the_scheme_is_compared_as_http_does_and_the_credentials_exactly() {
        let canonical = |value: &str| canonical_credentials(value.as_bytes()).into_owned();
        for spelling in [
            "bearer tok",
            "Bearer tok",
            "BEARER  tok",
            " Bearer\ttok ",
            "bEaReR tok",
        ] {
            assert_eq!(canonical(spelling), b"Bearer tok", "{spelling:?}");
        }
        assert_eq!(canonical("Bearer TOK"), b"Bearer TOK");
        assert_eq!(canonical("negotiate"), b"Negotiate");
        assert_eq!(canonical("Basic  "), b"Basic");
        assert_eq!(canonical(""), b"");
        assert_eq!(canonical("   "), b"");
        assert_eq!(canonical("Digest a=1,  b=2"), b"Digest a=1,  b=2");
        // Already canonical: borrowed, and hashed exactly as the raw value always was.
        assert!(matches!(
            canonical_credentials(b"Bearer tok"),
            std::borrow::Cow::Borrowed(_)
        ));
        let mut raw = Sha256::new();
        raw.update(b"tower-idempotency/scope/authorization/v1");
        update_length_prefixed(&mut raw, b"Bearer tok");
        assert_eq!(
            authorization_scope(&headers(&["Bearer tok"])),
            Some(hex(&raw.finalize()))
        );
        assert_eq!(
            authorization_scope(&headers(&["BEARER  tok"])),
            authorization_scope(&headers(&["bearer tok"]))
        );
    }
}
