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
pub(crate) fn authorization_scope(headers: &HeaderMap) -> Option<String> {
    let mut values = headers.get_all(header::AUTHORIZATION).iter().peekable();
    values.peek()?;
    let mut hasher = Sha256::new();
    hasher.update(b"tower-idempotency/scope/authorization/v1");
    for value in values {
        update_length_prefixed(&mut hasher, value.as_bytes());
    }
    Some(hex(&hasher.finalize()))
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
}
