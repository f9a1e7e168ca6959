//! Cross-site request forgery: the console's forms carry a token only the console can make,
//! and a POST a browser says came from another site is refused whatever it carries.

use http::header::{HOST, ORIGIN};
use http::HeaderMap;
use sha2::{Digest, Sha256};

use crate::key::hex;

/// SHA-256's block size, which HMAC pads its key to (RFC 2104).
const BLOCK: usize = 64;

/// Keeps tokens of this console apart from any other HMAC made with the same secret.
const TOKEN_TAG: &[u8] = b"tower-idempotency/console/csrf/v1\0";

/// The console's CSRF secret: a form token is HMAC-SHA256(secret, operator id), so it is
/// bound to the operator the authorizer names and cannot be made without the secret.
#[derive(Clone)]
pub(crate) struct CsrfKey([u8; 32]);

impl CsrfKey {
    /// A key drawn from the operating system's generator: a token must be unguessable,
    /// which a seeded generator does not promise.
    pub(crate) fn random() -> Self {
        let mut secret = [0u8; 32];
        getrandom::fill(&mut secret)
            .expect("the operating system's random generator is unavailable");
        Self(secret)
    }

    pub(crate) fn from_secret(secret: [u8; 32]) -> Self {
        Self(secret)
    }

    /// The token of the operator `operator_id`, as 64 hex digits.
    pub(crate) fn token(&self, operator_id: &str) -> String {
        hex(&hmac_sha256(&self.0, &[TOKEN_TAG, operator_id.as_bytes()]))
    }

    /// Whether `token` is `operator_id`'s, compared in constant time so its bytes cannot be
    /// found one by one from how long a refusal takes.
    pub(crate) fn verifies(&self, operator_id: &str, token: &str) -> bool {
        constant_time_eq(self.token(operator_id).as_bytes(), token.as_bytes())
    }
}

/// HMAC-SHA256 of the concatenation of `message`, by RFC 2104's formula:
/// `H((K ^ opad) || H((K ^ ipad) || message))`.
fn hmac_sha256(key: &[u8; 32], message: &[&[u8]]) -> [u8; 32] {
    // A 32-byte key is shorter than the block: padded with zeros, never hashed first.
    let mut padded = [0u8; BLOCK];
    padded[..key.len()].copy_from_slice(key);
    let inner_pad = padded.map(|byte| byte ^ 0x36);
    let outer_pad = padded.map(|byte| byte ^ 0x5c);
    let mut inner = Sha256::new();
    inner.update(inner_pad);
    for part in message {
        inner.update(part);
    }
    let mut outer = Sha256::new();
    outer.update(outer_pad);
    outer.update(inner.finalize());
    outer.finalize().into()
}

/// Equal in length and bytes, looking at every byte whatever the first difference.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |diff, (x, y)| diff | (x ^ y)) == 0
}

/// Which header says a request came from another site, if one does.
///
/// Browsers send `Sec-Fetch-Site` with every request: only `same-origin` (a page of this
/// site) and `none` (typed in, a bookmark) are trusted; `same-site` is a sibling
/// subdomain, which may be anyone's. Without it (an older browser), an `Origin` must name
/// the host the request was sent to. A request with neither is not a browser's
/// cross-site one: a command-line client or a script, which the token and the JSON
/// content type guard.
pub(crate) fn cross_site_header(headers: &HeaderMap) -> Option<&'static str> {
    if let Some(site) = headers.get("sec-fetch-site") {
        return match site.as_bytes() {
            b"same-origin" | b"none" => None,
            _ => Some("sec-fetch-site"),
        };
    }
    let origin = headers.get(ORIGIN)?;
    let host = headers.get(HOST).map(|host| host.as_bytes());
    let origin_host = origin
        .to_str()
        .ok()
        .and_then(|origin| origin.split_once("://"))
        .map(|(_, authority)| authority.as_bytes());
    match (origin_host, host) {
        (Some(origin_host), Some(host)) if origin_host.eq_ignore_ascii_case(host) => None,
        _ => Some("origin"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unhex(text: &str) -> Vec<u8> {
        (0..text.len())
            .step_by(2)
            .map(|at| u8::from_str_radix(&text[at..at + 2], 16).unwrap())
            .collect()
    }

    /// RFC 4231 test case 2 has a 4-byte key: padded to 32 bytes with zeros, it is the same
    /// HMAC key (RFC 2104 pads every short key with zeros to the block).
    #[test]
    fn hmac_matches_rfc_4231_test_case_2() {
        let mut key = [0u8; 32];
        key[..4].copy_from_slice(b"Jefe");
        let mac = hmac_sha256(&key, &[b"what do ya want ", b"for nothing?"]);
        assert_eq!(
            mac.to_vec(),
            unhex("5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843")
        );
    }

    #[test]
    fn a_token_is_bound_to_its_operator_and_its_secret() {
        let key = CsrfKey::from_secret([7; 32]);
        let token = key.token("alice");
        assert!(key.verifies("alice", &token));
        assert!(!key.verifies("mallory", &token));
        assert!(!CsrfKey::from_secret([8; 32]).verifies("alice", &token));
        assert!(!key.verifies("alice", &token[..63]));
        assert!(!key.verifies("alice", ""));
    }

    #[test]
    fn cross_site_requests_are_told_by_fetch_metadata_then_origin() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut map = HeaderMap::new();
            for (name, value) in pairs {
                map.insert(*name, value.parse().unwrap());
            }
            map
        };
        assert_eq!(cross_site_header(&headers(&[])), None);
        assert_eq!(
            cross_site_header(&headers(&[("sec-fetch-site", "same-origin")])),
            None
        );
        assert_eq!(
            cross_site_header(&headers(&[("sec-fetch-site", "cross-site")])),
            Some("sec-fetch-site")
        );
        assert_eq!(
            cross_site_header(&headers(&[("sec-fetch-site", "same-site")])),
            Some("sec-fetch-site")
        );
        let same = [
            ("host", "ops.local:8080"),
            ("origin", "https://ops.local:8080"),
        ];
        assert_eq!(cross_site_header(&headers(&same)), None);
        let other = [("host", "ops.local"), ("origin", "https://evil.example")];
        assert_eq!(cross_site_header(&headers(&other)), Some("origin"));
        let opaque = [("host", "ops.local"), ("origin", "null")];
        assert_eq!(cross_site_header(&headers(&opaque)), Some("origin"));
    }
}
