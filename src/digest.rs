//! `Content-Digest` (RFC 9530): one SHA-256 of a request body, shared by both faces.
//!
//! The client [`IdempotencyLayer`](crate::IdempotencyLayer) sends
//! `Content-Digest: sha-256=:<base64>:` with every keyed request, computed in the same
//! single pass over the frozen body as the [`Fingerprint`](crate::fingerprint::Fingerprint) (which is
//! derived from the method, the target and this digest, not from the body again).
//!
//! The server face verifies the `Content-Digest` of a keyed request (one that goes through
//! the ledger) when it carries one: a `sha-256`
//! or `sha-512` member that does not match the body received is a `400`
//! [`content-digest-mismatch`](crate::server::problem::CONTENT_DIGEST_MISMATCH)
//! before any lease is taken; members of other algorithms are ignored, as RFC 9530 §2
//! allows; a request without the field is fingerprinted all the same. The verified SHA-256
//! digest is the one the fingerprint is made of, so the body is hashed once.
//!
//! `Content-Digest` is over the content as sent, after content coding (RFC 9530 §2). Behind
//! request decompression (tower-http's `RequestDecompressionLayer` in front of the layer,
//! as when it wraps the router and the layer the method router) the layer sees the decoded
//! body, without `Content-Encoding` or `Content-Length`: a digest that matches it is
//! verified, one that does not (the gzip bytes' digest) cannot be checked and is left
//! unverified, and the decoded body is fingerprinted, the same on every retry. A body that
//! still has its framing (`Content-Length` or `Transfer-Encoding`) was not decoded, and its
//! digest must match. With the layer in front of decompression, it sees the gzip bytes and
//! their `Content-Encoding`, verifies the digest against them and fingerprints them.
//!
//! Replays carry the recorded request's digest in [`IDEMPOTENT_REQUEST_DIGEST`], in the
//! same syntax. Not in `Content-Digest` nor `Repr-Digest`: in a response those describe the
//! **response's** content and representation (RFC 9530 §2–3), and a cache, proxy or client
//! checking them would find a request's digest there to be a corrupted response. The
//! request's digest is about something else, so it gets a field of its own, named like the
//! `Idempotent-Replayed` field it travels with.
//!
//! # Example
//!
//! ```
//! use tower_idempotency::digest::{BodyDigest, ContentDigest};
//!
//! let digest = BodyDigest::of(b"{\"hello\": \"world\"}");
//! // RFC 9530, appendix B.1's example body and digest.
//! assert_eq!(
//!     digest.header_value(),
//!     "sha-256=:X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=:"
//! );
//!
//! // A peer's field: an algorithm we do not know is ignored, sha-256 is verified.
//! let field = http::HeaderValue::from_static(
//!     "unixsum=30637, sha-256=:X48E9qOokqqrvdts8nOJRJN3OWDUoyWxBf7kbu9DBPE=:",
//! );
//! let parsed = ContentDigest::parse([&field]).unwrap();
//! assert_eq!(parsed.verify(b"{\"hello\": \"world\"}").unwrap(), Some(digest));
//! assert!(parsed.verify(b"{}").unwrap_err().is_mismatch());
//! ```

use std::fmt;

use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig};
use base64::engine::DecodePaddingMode;
use base64::Engine;
use http::header::{HeaderName, HeaderValue};
use sha2::{Digest, Sha256, Sha512};

/// `Content-Digest` (RFC 9530 §2).
pub static CONTENT_DIGEST: HeaderName = HeaderName::from_static("content-digest");

/// The digest of the request a replay answers, on replays of the server face:
/// `Idempotent-Request-Digest: sha-256=:<base64>:` (the syntax of `Content-Digest`).
///
/// A client compares it with the `Content-Digest` it sent to check that the replay answers
/// **its** request. See the [module docs](self) for why it is not `Content-Digest`.
pub static IDEMPOTENT_REQUEST_DIGEST: HeaderName =
    HeaderName::from_static("idempotent-request-digest");

/// Standard base64 with padding on output; padded or not on input (RFC 8941 §3.3.5 asks
/// parsers to be lenient about padding).
const BASE64: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// The SHA-256 of a body: what `Content-Digest: sha-256` carries and what the
/// [`Fingerprint`](crate::fingerprint::Fingerprint) is derived from.
///
/// ```
/// use tower_idempotency::digest::BodyDigest;
///
/// let digest = BodyDigest::of(b"");
/// assert_eq!(BodyDigest::from_bytes(*digest.as_bytes()), digest);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct BodyDigest([u8; 32]);

impl BodyDigest {
    /// Hash `body`: the one pass over the bytes.
    pub fn of(body: &[u8]) -> Self {
        Self(Sha256::digest(body).into())
    }

    /// Wrap raw digest bytes.
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The raw digest.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The field value `sha-256=:<base64>:`.
    pub fn header_value(&self) -> HeaderValue {
        crate::key::shared_header_value(sha256_field(&self.0))
    }

    /// The field value's bytes, `sha-256=:<base64>:`, for a record's header block.
    pub(crate) fn field(&self) -> [u8; 54] {
        sha256_field(&self.0)
    }
}

/// The alphabet of standard base64 (RFC 4648 §4).
const BASE64_ALPHABET: &[u8; 64] =
    b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

/// `sha-256=:<base64 of digest>:`, 54 bytes, built in place: every keyed request and every
/// record carries one, and the general encoder's chunking and `String` cost more than the
/// encoding itself for a fixed 32 bytes.
fn sha256_field(digest: &[u8; 32]) -> [u8; 54] {
    const PREFIX: &[u8; 9] = b"sha-256=:";
    let mut field = [0u8; 54];
    field[..PREFIX.len()].copy_from_slice(PREFIX);
    let mut out = PREFIX.len();
    let sextet = |bits: u32, shift: u32| BASE64_ALPHABET[(bits >> shift & 0x3f) as usize];
    // Ten whole groups of three bytes, then two bytes left: three characters and one `=`.
    for group in digest[..30].chunks_exact(3) {
        let bits = u32::from(group[0]) << 16 | u32::from(group[1]) << 8 | u32::from(group[2]);
        field[out..out + 4].copy_from_slice(&[
            sextet(bits, 18),
            sextet(bits, 12),
            sextet(bits, 6),
            sextet(bits, 0),
        ]);
        out += 4;
    }
    let bits = u32::from(digest[30]) << 16 | u32::from(digest[31]) << 8;
    field[out..out + 4].copy_from_slice(&[
        sextet(bits, 18),
        sextet(bits, 12),
        sextet(bits, 6),
        b'=',
    ]);
    field[out + 4] = b':';
    field
}

impl fmt::Debug for BodyDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BodyDigest({})", crate::key::hex(&self.0))
    }
}

/// A parsed `Content-Digest` field: the members of the algorithms this crate verifies.
///
/// ```
/// use tower_idempotency::digest::{BodyDigest, ContentDigest};
///
/// let sent = BodyDigest::of(b"{}").header_value();
/// let field = ContentDigest::parse([&sent]).unwrap();
/// assert_eq!(field.verify(b"{}").unwrap(), Some(BodyDigest::of(b"{}")));
/// assert!(field.verify(b"{ }").unwrap_err().is_mismatch());
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContentDigest {
    sha256: Option<[u8; 32]>,
    sha512: Option<[u8; 64]>,
}

impl ContentDigest {
    /// Parse every line of a `Content-Digest` field (lines of a structured field combine
    /// as if joined with commas). Members of other algorithms are ignored; a `sha-256` or
    /// `sha-512` member that is not a byte sequence of the algorithm's length, or a field
    /// that is not a dictionary, is [malformed](DigestError::is_malformed).
    pub fn parse<'a>(
        lines: impl IntoIterator<Item = &'a HeaderValue>,
    ) -> Result<Self, DigestError> {
        let mut parsed = Self::default();
        for line in lines {
            // The one member this crate's client sends, as it writes it: decoded in place.
            // Any other line, or spelling, is parsed as a dictionary.
            if let Some(sha256) = sha256_of_field(line.as_bytes()) {
                parsed.sha256 = Some(sha256);
                continue;
            }
            let text = line.to_str().map_err(|_| DigestError::malformed())?;
            for member in text.split(',') {
                parsed.add_member(member.trim_matches([' ', '\t']))?;
            }
        }
        Ok(parsed)
    }

    /// The field of the request head `headers`.
    pub fn of_headers(headers: &http::HeaderMap) -> Result<Self, DigestError> {
        Self::parse(headers.get_all(&CONTENT_DIGEST))
    }

    fn add_member(&mut self, member: &str) -> Result<(), DigestError> {
        if member.is_empty() {
            // An empty field (or one made of empty lines) is an empty dictionary.
            return Ok(());
        }
        let (key, value) = member.split_once('=').unwrap_or((member, "?1"));
        if !is_sf_key(key) {
            return Err(DigestError::malformed());
        }
        // Parameters are allowed on any member; RFC 9530 defines none.
        let value = value.split(';').next().unwrap_or_default().trim_end();
        match key {
            "sha-256" => self.sha256 = Some(decode_exact(value)?),
            "sha-512" => self.sha512 = Some(decode_exact(value)?),
            _ => {} // RFC 9530 §2: unknown algorithms are ignored.
        }
        Ok(())
    }

    /// The `sha-256` member, if the field had one.
    pub fn sha256(&self) -> Option<BodyDigest> {
        self.sha256.map(BodyDigest)
    }

    /// Whether the field carries a member this crate verifies.
    pub fn is_empty(&self) -> bool {
        self.sha256.is_none() && self.sha512.is_none()
    }

    /// Check every verifiable member against `body`. Answers the body's SHA-256 when the
    /// field carried a (matching) `sha-256` member, so the caller need not hash it again.
    pub fn verify(&self, body: &[u8]) -> Result<Option<BodyDigest>, DigestError> {
        let mut verified = None;
        if let Some(sent) = self.sha256 {
            let actual = BodyDigest::of(body);
            if actual.0 != sent {
                return Err(DigestError::mismatch("sha-256"));
            }
            verified = Some(actual);
        }
        if let Some(sent) = self.sha512 {
            let actual: [u8; 64] = Sha512::digest(body).into();
            if actual != sent {
                return Err(DigestError::mismatch("sha-512"));
            }
        }
        Ok(verified)
    }
}

/// The 32 bytes of a `sha-256=:<base64>:` field written as [`BodyDigest::field`] writes it
/// (43 digits, one `=`, no stray bits: the one spelling of a digest), or `None` for any
/// other value. What the general decoder makes of that spelling, without its parsing and
/// its allocation.
pub(crate) fn sha256_of_field(value: &[u8]) -> Option<[u8; 32]> {
    let digits: &[u8; 44] = value
        .strip_prefix(b"sha-256=:")?
        .strip_suffix(b":")?
        .try_into()
        .ok()?;
    // Each digit's value, or `INVALID` (its top bits set): collected into `bad` and checked
    // once, rather than a branch a digit.
    let mut bad = 0u8;
    let mut value = |digit: u8| {
        let value = BASE64_VALUES[usize::from(digit)];
        bad |= value;
        u32::from(value)
    };
    let mut digest = [0u8; 32];
    for (group, bytes) in digits[..40]
        .chunks_exact(4)
        .zip(digest[..30].chunks_exact_mut(3))
    {
        let bits =
            value(group[0]) << 18 | value(group[1]) << 12 | value(group[2]) << 6 | value(group[3]);
        bytes.copy_from_slice(&bits.to_be_bytes()[1..]);
    }
    // Three digits and `=`: 18 bits for the last two bytes, the two left over zero.
    let bits = value(digits[40]) << 12 | value(digits[41]) << 6 | value(digits[42]);
    if bad & !0x3f != 0 || digits[43] != b'=' || bits & 0b11 != 0 {
        return None;
    }
    digest[30] = (bits >> 10) as u8;
    digest[31] = (bits >> 2) as u8;
    Some(digest)
}

/// [`BASE64_ALPHABET`] inverted: each digit's value, [`INVALID`] for any other byte.
const BASE64_VALUES: [u8; 256] = {
    let mut values = [INVALID; 256];
    let mut value = 0;
    while value < 64 {
        values[BASE64_ALPHABET[value] as usize] = value as u8;
        value += 1;
    }
    values
};

const INVALID: u8 = 0xff;

/// An RFC 8941 dictionary key: `( lcalpha / "*" ) *( lcalpha / DIGIT / "_" / "-" / "." / "*" )`.
fn is_sf_key(key: &str) -> bool {
    let mut bytes = key.bytes();
    matches!(bytes.next(), Some(b'a'..=b'z' | b'*'))
        && bytes.all(|b| matches!(b, b'a'..=b'z' | b'0'..=b'9' | b'_' | b'-' | b'.' | b'*'))
}

/// A byte sequence `:<base64>:` of exactly `N` bytes.
fn decode_exact<const N: usize>(value: &str) -> Result<[u8; N], DigestError> {
    let inner = value
        .strip_prefix(':')
        .and_then(|v| v.strip_suffix(':'))
        .ok_or_else(DigestError::malformed)?;
    let bytes = BASE64.decode(inner).map_err(|_| DigestError::malformed())?;
    bytes.try_into().map_err(|_| DigestError::malformed())
}

/// A `Content-Digest` that cannot be parsed or does not match the body.
///
/// ```
/// use tower_idempotency::digest::ContentDigest;
///
/// let bad = http::HeaderValue::from_static("sha-256=not-a-byte-sequence");
/// assert!(ContentDigest::parse([&bad]).unwrap_err().is_malformed());
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DigestError {
    /// The algorithm whose digest did not match; `None` for a malformed field.
    mismatched: Option<&'static str>,
}

impl DigestError {
    fn malformed() -> Self {
        Self { mismatched: None }
    }

    fn mismatch(algorithm: &'static str) -> Self {
        Self {
            mismatched: Some(algorithm),
        }
    }

    /// The field is not a dictionary, or a `sha-256`/`sha-512` member is not a byte
    /// sequence of the right length.
    pub fn is_malformed(&self) -> bool {
        self.mismatched.is_none()
    }

    /// A digest does not match the body.
    pub fn is_mismatch(&self) -> bool {
        self.mismatched.is_some()
    }

    /// The algorithm whose digest did not match.
    pub fn algorithm(&self) -> Option<&'static str> {
        self.mismatched
    }
}

impl fmt::Display for DigestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.mismatched {
            Some(algorithm) => write!(f, "the {algorithm} Content-Digest does not match the body"),
            None => f.write_str("the Content-Digest field is malformed"),
        }
    }
}

impl std::error::Error for DigestError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sha256_field_is_the_general_encoders() {
        let mut digest = [0u8; 32];
        for round in 0u32..2_000 {
            // Every byte value at every position, and mixed digests.
            for (i, byte) in digest.iter_mut().enumerate() {
                *byte = (round.wrapping_mul(31).wrapping_add(i as u32 * 97) >> (round % 5)) as u8;
            }
            digest[(round % 32) as usize] = (round % 256) as u8;
            let expected = format!("sha-256=:{}:", BASE64.encode(digest));
            let field = sha256_field(&digest);
            assert_eq!(std::str::from_utf8(&field).unwrap(), expected);
            assert_eq!(BodyDigest(digest).header_value(), expected.as_str());
        }
    }

    proptest::proptest! {
        /// The field's one spelling decodes as the general decoder decodes it; every other
        /// spelling of 54 bytes is left to the general parser (never decoded otherwise).
        #[test]
        fn a_field_in_its_one_spelling_decodes_as_the_general_decoder_does(
            digest in proptest::prelude::any::<[u8; 32]>(),
            at in 9usize..53,
            byte in proptest::prelude::any::<u8>(),
        ) {
            let field = sha256_field(&digest);
            proptest::prop_assert_eq!(sha256_of_field(&field), Some(digest));
            let mut other = field;
            other[at] = byte;
            let strict = base64::engine::general_purpose::STANDARD;
            let general = std::str::from_utf8(&other)
                .ok()
                .and_then(|text| text.strip_prefix("sha-256=:")?.strip_suffix(':'))
                .and_then(|digits| strict.decode(digits).ok())
                .and_then(|bytes| <[u8; 32]>::try_from(bytes).ok());
            proptest::prop_assert_eq!(sha256_of_field(&other), general);
            // Parsed as a field, the fast path and the dictionary agree.
            if let Ok(value) = HeaderValue::from_bytes(&other) {
                let parsed = ContentDigest::parse([&value]);
                if let Some(bytes) = general {
                    proptest::prop_assert_eq!(parsed.unwrap().sha256(), Some(BodyDigest(bytes)));
                }
            }
        }
    }

    fn field(text: &'static str) -> Result<ContentDigest, DigestError> {
        ContentDigest::parse([&HeaderValue::from_static(text)])
    }

    #[test]
    fn rfc_9530_examples_verify() {
        let body = b"{\"hello\": \"world\"}\n";
        // The example body of RFC 9530 appendix B, with its final newline.
        let sha512 = field(
            "sha-512=:YMAam51Jz/jOATT6/zvHrLVgOYTGFy1d6GJiOHTohq4yP+pgk4vf2aCsyRZOtw8MjkM7iw7yZ/WkppmM44T3qg==:",
        )
        .unwrap();
        assert_eq!(sha512.verify(body).unwrap(), None);
        let sha256 = field("sha-256=:RK/0qy18MlBSVnWgjwz6lZEWjP/lF5HF9bvEF8FabDg=:").unwrap();
        assert_eq!(sha256.verify(body).unwrap(), Some(BodyDigest::of(body)));
        assert!(sha256.verify(b"{}").unwrap_err().is_mismatch());
    }

    #[test]
    fn unknown_algorithms_and_parameters_are_ignored() {
        let parsed = field("unixsum=30637, id-sha-256=:AAAA:;x=1, md5").unwrap();
        assert!(parsed.is_empty());
        assert_eq!(parsed.verify(b"anything").unwrap(), None);
        assert!(field("").unwrap().is_empty());
    }

    #[test]
    fn malformed_members_of_known_algorithms_are_refused() {
        for text in [
            "sha-256=:AAAA:",        // too short for sha-256
            "sha-256=abc",           // not a byte sequence
            "sha-256",               // a boolean
            "SHA-256=:AAAA:",        // keys are lowercase
            "sha-512=:not base64!:", // not base64
        ] {
            assert!(field(text).unwrap_err().is_malformed(), "{text}");
        }
    }

    #[test]
    fn unpadded_base64_is_accepted() {
        let padded = BodyDigest::of(b"x").header_value();
        let unpadded = padded
            .to_str()
            .unwrap()
            .replace("=:", ":")
            .replacen(":", "=:", 1);
        let unpadded = HeaderValue::try_from(unpadded).unwrap();
        let parsed = ContentDigest::parse([&unpadded]).unwrap();
        assert_eq!(parsed.sha256(), Some(BodyDigest::of(b"x")));
    }
}
