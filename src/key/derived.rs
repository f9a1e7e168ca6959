//! The 32-byte key derived from an operation's identity, and the encodings it shares with
//! the rest of the crate (hex, length-prefixed hashing, shared header values).

use std::fmt;

use http::header::HeaderValue;

use crate::digest::BodyDigest;
use sha2::{Digest, Sha256};

/// Domain-separation tag of the key derivation; part of the published derivation.
const KEY_DERIVATION_TAG: &[u8] = b"tower-idempotency/key/v1";

/// A 32-byte idempotency key derived from `(scope, task_id, step_id)`.
///
/// See the [module docs](crate::key) for the exact derivation.
///
/// ```
/// use tower_idempotency::IdempotencyKey;
///
/// let a = IdempotencyKey::derive("", "ab", "c");
/// let b = IdempotencyKey::derive("", "a", "bc");
/// assert_ne!(a, b);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey([u8; 32]);

impl IdempotencyKey {
    /// Derive the key of step `step_id` of task `task_id` within `scope`.
    pub fn derive(scope: &str, task_id: &str, step_id: &str) -> Self {
        Self(length_prefixed_sha256(
            KEY_DERIVATION_TAG,
            &[scope.as_bytes(), task_id.as_bytes(), step_id.as_bytes()],
        ))
    }

    /// Wrap raw key bytes (for stores decoding their own records).
    ///
    /// ```
    /// # use tower_idempotency::IdempotencyKey;
    /// let key = IdempotencyKey::derive("", "t", "s");
    /// assert_eq!(IdempotencyKey::from_bytes(*key.as_bytes()), key);
    /// ```
    pub const fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    /// The raw key bytes.
    pub const fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// The key as 64 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    /// The key as an `Idempotency-Key` header value: an RFC 8941 sf-string, `"<hex>"`.
    pub fn header_value(&self) -> HeaderValue {
        // Written on the stack, then moved whole into the header value's one allocation.
        shared_header_value(self.quoted())
    }

    /// The key's `Idempotency-Key` value and `digest`'s `Content-Digest` value
    /// (`sha-256=:<base64>:`), as the client face puts both on a keyed request: one
    /// allocation holds the two, shared by their clones (two calls of `header_value` make
    /// two).
    ///
    /// ```
    /// use tower_idempotency::{digest::BodyDigest, IdempotencyKey};
    ///
    /// let key = IdempotencyKey::derive("", "task-1", "charge");
    /// let digest = BodyDigest::of(b"{}");
    /// let (key_value, digest_value) = key.header_values_with(&digest);
    /// assert_eq!(key_value, key.header_value());
    /// assert_eq!(digest_value, digest.header_value());
    /// ```
    pub fn header_values_with(&self, digest: &BodyDigest) -> (HeaderValue, HeaderValue) {
        let mut both = [0u8; 66 + 54];
        both[..66].copy_from_slice(&self.quoted());
        both[66..].copy_from_slice(&digest.field());
        let both = bytes::Bytes::from_owner(both);
        (
            header_value_of(both.slice(..66)),
            header_value_of(both.slice(66..)),
        )
    }

    /// The header value's bytes, `"<hex>"`, written on the stack.
    pub(crate) fn quoted(&self) -> [u8; 66] {
        let mut quoted = [b'"'; 66];
        hex_into(&self.0, &mut quoted[1..65]);
        quoted
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IdempotencyKey({})", self.to_hex())
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// A header value owning `bytes` in one allocation that its clones share.
///
/// `HeaderValue::from_bytes` copies into a `Bytes` that allocates again the first time it
/// is cloned, and the values the layers make (a derived key, a `Content-Digest`) are cloned
/// at least once: into each attempt's request, into a record. This costs one allocation,
/// however often the value is cloned.
pub(crate) fn shared_header_value<const N: usize>(bytes: [u8; N]) -> HeaderValue {
    header_value_of(bytes::Bytes::from_owner(bytes))
}

/// A header value the layers built: visible ASCII by construction.
fn header_value_of(bytes: bytes::Bytes) -> HeaderValue {
    HeaderValue::from_maybe_shared(bytes)
        .expect("the layers only build visible-ASCII header values")
}

/// Feed `bytes` to `hasher` behind its length as a big-endian `u64`, so adjacent fields can
/// never run into each other.
pub(crate) fn update_length_prefixed(hasher: &mut Sha256, bytes: &[u8]) {
    hasher.update((bytes.len() as u64).to_be_bytes());
    hasher.update(bytes);
}

/// The SHA-256 of `tag` and then each of `fields` behind its length
/// ([`update_length_prefixed`]): how operation keys and record keys are derived.
///
/// A short message (a typical key: an operation's, a server's record key) is laid out on the stack
/// and hashed in one call: each of the hasher's `update`s copies into its block buffer
/// and keeps its counts, which for a key's five or seven small pieces costs more than
/// laying them out once. A longer one is fed piece by piece. The bytes hashed are the
/// same either way.
pub(crate) fn length_prefixed_sha256(tag: &[u8], fields: &[&[u8]]) -> [u8; 32] {
    const ON_STACK: usize = 256;
    let len = fields.iter().fold(tag.len(), |len, field| {
        len.saturating_add(size_of::<u64>() + field.len())
    });
    if len > ON_STACK {
        let mut hasher = Sha256::new();
        hasher.update(tag);
        for field in fields {
            update_length_prefixed(&mut hasher, field);
        }
        return hasher.finalize().into();
    }
    let mut message = [0u8; ON_STACK];
    let mut at = 0;
    let mut put = |bytes: &[u8]| {
        message[at..at + bytes.len()].copy_from_slice(bytes);
        at += bytes.len();
    };
    put(tag);
    for field in fields {
        put(&(field.len() as u64).to_be_bytes());
        put(field);
    }
    Sha256::digest(&message[..at]).into()
}

/// Lowercase hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut out = vec![0; bytes.len() * 2];
    hex_into(bytes, &mut out);
    String::from_utf8(out).expect("hex digits are ASCII")
}

/// The 32 bytes that 64 hex digits (either case) spell, the inverse of [`hex`]; `None` for
/// any other text (a sign, a space, another length).
pub(crate) fn from_hex32(text: &str) -> Option<[u8; 32]> {
    let digits = text.as_bytes();
    if digits.len() != 64 {
        return None;
    }
    let mut bytes = [0u8; 32];
    for (byte, pair) in bytes.iter_mut().zip(digits.chunks_exact(2)) {
        *byte = (hex_digit(pair[0])? << 4) | hex_digit(pair[1])?;
    }
    Some(bytes)
}

/// The number that 16 hex digits (either case) spell, as a `u64` is written in hex at its
/// full width; `None` for any other text.
pub(crate) fn from_hex16(text: &str) -> Option<u64> {
    let digits = text.as_bytes();
    if digits.len() != 16 {
        return None;
    }
    digits.iter().try_fold(0u64, |value, &digit| {
        Some(value << 4 | u64::from(hex_digit(digit)?))
    })
}

/// The value of one hex digit, `None` for any other byte.
fn hex_digit(digit: u8) -> Option<u8> {
    char::from(digit).to_digit(16).map(|value| value as u8)
}

/// Write `bytes` as lowercase hex into `out`, two digits per byte.
fn hex_into(bytes: &[u8], out: &mut [u8]) {
    // Both digits of a byte in one table load: keys are hex-encoded on every request.
    const PAIRS: [[u8; 2]; 256] = {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut pairs = [[0u8; 2]; 256];
        let mut i = 0;
        while i < 256 {
            pairs[i] = [DIGITS[i >> 4], DIGITS[i & 0xf]];
            i += 1;
        }
        pairs
    };
    for (byte, pair) in bytes.iter().zip(out.chunks_exact_mut(2)) {
        pair.copy_from_slice(&PAIRS[usize::from(*byte)]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys must never change between releases: these vectors pin the derivation.
    #[test]
    fn golden_vectors() {
        let cases = [
            (
                ("", "", ""),
                "1ef55a2246fd4c2819da17f38dd7433a0d7dc8196e18ba517c057f17d1446ed7",
            ),
            (
                ("billing", "task-42", "charge-customer"),
                "a8132c0660fe37ee2cabddd7e93ea8b818744b000741780cfaa0f66244deec64",
            ),
            (
                ("", "ab", "c"),
                "af5f1a25f6d4f42798508a38e83f5322cc8b8b2822fe4d9ecfe3d9198203c6e0",
            ),
        ];
        for ((scope, task, step), expected) in cases {
            assert_eq!(IdempotencyKey::derive(scope, task, step).to_hex(), expected);
        }
    }

    #[test]
    fn golden_vectors_match_an_independent_encoding() {
        // Re-encode by hand so the derivation documented in the module docs is what runs.
        let mut buf = Vec::new();
        buf.extend_from_slice(b"tower-idempotency/key/v1");
        for field in ["billing", "task-42", "charge-customer"] {
            buf.extend_from_slice(&(field.len() as u64).to_be_bytes());
            buf.extend_from_slice(field.as_bytes());
        }
        let expected: [u8; 32] = Sha256::digest(&buf).into();
        assert_eq!(
            IdempotencyKey::derive("billing", "task-42", "charge-customer").as_bytes(),
            &expected
        );
    }

    proptest::proptest! {
        /// Laid out on the stack or fed piece by piece, on either side of the bound between
        /// the two, a derivation hashes the same bytes as the documented encoding.
        #[test]
        fn a_derivation_hashes_the_encoding_either_side_of_the_bound(
            tag in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64),
            fields in proptest::collection::vec(
                proptest::collection::vec(proptest::prelude::any::<u8>(), 0..120),
                0..6,
            ),
        ) {
            let mut encoded = tag.clone();
            let mut hasher = Sha256::new();
            hasher.update(&tag);
            for field in &fields {
                encoded.extend_from_slice(&(field.len() as u64).to_be_bytes());
                encoded.extend_from_slice(field);
                update_length_prefixed(&mut hasher, field);
            }
            let fields: Vec<&[u8]> = fields.iter().map(Vec::as_slice).collect();
            let derived = length_prefixed_sha256(&tag, &fields);
            let expected: [u8; 32] = Sha256::digest(&encoded).into();
            proptest::prop_assert_eq!(derived, expected);
            let fed: [u8; 32] = hasher.finalize().into();
            proptest::prop_assert_eq!(derived, fed);
        }
    }

    /// Messages of exactly the bound and one byte past it (a tag and one field).
    #[test]
    fn a_derivation_at_the_bound_hashes_the_encoding() {
        for len in [255, 256, 257] {
            let tag = b"tag";
            let field = vec![b'f'; len - tag.len() - size_of::<u64>()];
            let mut encoded = tag.to_vec();
            encoded.extend_from_slice(&(field.len() as u64).to_be_bytes());
            encoded.extend_from_slice(&field);
            assert_eq!(encoded.len(), len);
            let expected: [u8; 32] = Sha256::digest(&encoded).into();
            assert_eq!(length_prefixed_sha256(tag, &[&field]), expected, "{len}");
        }
    }

    #[test]
    fn length_prefixes_keep_fields_apart() {
        assert_ne!(
            IdempotencyKey::derive("", "ab", "c"),
            IdempotencyKey::derive("", "a", "bc")
        );
        assert_ne!(
            IdempotencyKey::derive("a", "b", ""),
            IdempotencyKey::derive("", "ab", "")
        );
    }
}
