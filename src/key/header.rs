//! A key read from an `Idempotency-Key` header, and why one was refused.

use std::fmt;

use http::header::{HeaderMap, HeaderValue};

use super::grammar::{bare_token, unescape_sf_string};
use super::{IDEMPOTENCY_KEY, MAX_KEY_LEN};

/// A key read from an `Idempotency-Key` header: 1 to 255 visible ASCII characters.
///
/// The IETF draft defines the header as one RFC 8941 sf-string (`"…"`); many clients send a
/// bare token instead (a UUID, `order-42`), so both are accepted. A bare token is made of
/// the characters of an RFC 8941 sf-token — letters, digits, ``!#$%&'*+-.^_`|~`` (RFC 9110
/// `tchar`), `:` and `/` — and may start with any of them (keys such as UUIDs start with a
/// digit). Anything else is an [`InvalidKey`]: in particular a bare value holding a comma,
/// which is what a proxy makes of two `Idempotency-Key` lines (RFC 9110 §5.3), or any
/// other delimiter (`;`, `=`, `"`, …), which a structured field parser would read as more
/// than one string. Quote such a key as an sf-string.
///
/// ```
/// use tower_idempotency::HeaderKey;
/// use http::HeaderValue;
///
/// let quoted = HeaderKey::parse(&HeaderValue::from_static("\"order-42\"")).unwrap();
/// let bare = HeaderKey::parse(&HeaderValue::from_static("order-42")).unwrap();
/// assert_eq!(quoted, bare);
/// assert_eq!(quoted.as_str(), "order-42");
/// assert!(HeaderKey::parse(&HeaderValue::from_static("\"\"")).is_err());
/// ```
#[derive(Clone)]
pub struct HeaderKey(KeyText);

/// The longest key held without an allocation: a UUID (36), a ULID (26) and the 64 hex
/// digits of a derived key all fit.
const INLINE_KEY_LEN: usize = 64;

/// A key's characters (visible ASCII, checked by [`HeaderKey::parse`]). Every keyed request
/// parses one, and the server hands it on to the handler: held inline, the common key
/// costs no allocation of its own.
#[derive(Clone)]
enum KeyText {
    Inline {
        len: u8,
        bytes: [u8; INLINE_KEY_LEN],
    },
    Heap(Box<str>),
}

impl KeyText {
    /// `ascii` is a key's characters, checked to be visible ASCII.
    fn new(ascii: &[u8]) -> Self {
        match u8::try_from(ascii.len()) {
            Ok(len) if ascii.len() <= INLINE_KEY_LEN => {
                let mut bytes = [0; INLINE_KEY_LEN];
                bytes[..ascii.len()].copy_from_slice(ascii);
                Self::Inline { len, bytes }
            }
            _ => Self::Heap(
                std::str::from_utf8(ascii)
                    .expect("a key is visible ASCII")
                    .into(),
            ),
        }
    }

    fn as_bytes(&self) -> &[u8] {
        match self {
            Self::Inline { len, bytes } => &bytes[..usize::from(*len)],
            Self::Heap(text) => text.as_bytes(),
        }
    }

    /// Checked again as UTF-8 (the crate forbids `unsafe`): hot paths take
    /// [`as_bytes`](Self::as_bytes).
    fn as_str(&self) -> &str {
        match self {
            Self::Inline { len, bytes } => std::str::from_utf8(&bytes[..usize::from(*len)])
                .expect("a key is visible ASCII, copied whole"),
            Self::Heap(text) => text,
        }
    }
}

impl HeaderKey {
    /// Parse one header value.
    pub fn parse(value: &HeaderValue) -> Result<Self, InvalidKey> {
        let bytes = value.as_bytes();
        // Every byte is checked against the rules below, so what they accept is visible
        // ASCII: the key needs no UTF-8 check of its own.
        let key = match bytes {
            [b'"', inner @ .., b'"'] => unescape_sf_string(inner)?,
            [b'"', ..] => return Err(InvalidKey::BadSfString),
            _ => bare_token(bytes)?,
        };
        if key.is_empty() {
            return Err(InvalidKey::Empty);
        }
        if key.len() > MAX_KEY_LEN {
            return Err(InvalidKey::TooLong { len: key.len() });
        }
        Ok(Self(KeyText::new(&key)))
    }

    /// Read the key from `headers`: `Ok(None)` when absent, an error when repeated or malformed.
    ///
    /// ```
    /// # use tower_idempotency::{HeaderKey, InvalidKey};
    /// let mut headers = http::HeaderMap::new();
    /// assert_eq!(HeaderKey::from_headers(&headers), Ok(None));
    /// headers.append("idempotency-key", "a".parse().unwrap());
    /// headers.append("idempotency-key", "b".parse().unwrap());
    /// assert_eq!(HeaderKey::from_headers(&headers), Err(InvalidKey::Repeated));
    /// ```
    pub fn from_headers(headers: &HeaderMap) -> Result<Option<Self>, InvalidKey> {
        Self::from_values(headers.get_all(&IDEMPOTENCY_KEY).iter())
    }

    /// The key of a request whose `Idempotency-Key` values are `values`, as
    /// [`from_headers`](Self::from_headers) reads them.
    pub(crate) fn from_values<'a>(
        mut values: impl Iterator<Item = &'a HeaderValue>,
    ) -> Result<Option<Self>, InvalidKey> {
        let Some(first) = values.next() else {
            return Ok(None);
        };
        if values.next().is_some() {
            return Err(InvalidKey::Repeated);
        }
        Self::parse(first).map(Some)
    }

    /// The key's characters, without quotes.
    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }

    /// The key's characters as bytes (ASCII): what the ledger's key is made of.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

impl PartialEq for HeaderKey {
    fn eq(&self, other: &Self) -> bool {
        self.as_bytes() == other.as_bytes()
    }
}

impl Eq for HeaderKey {}

impl std::hash::Hash for HeaderKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // As `str` hashes, so that a key hashes as its text does.
        self.as_str().hash(state);
    }
}

impl fmt::Debug for HeaderKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("HeaderKey").field(&self.as_str()).finish()
    }
}

impl fmt::Display for HeaderKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why an `Idempotency-Key` header was refused.
///
/// ```
/// # use tower_idempotency::{HeaderKey, InvalidKey};
/// let err = HeaderKey::parse(&http::HeaderValue::from_static("has space")).unwrap_err();
/// assert_eq!(err, InvalidKey::InvalidCharacter { byte: b' ' });
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum InvalidKey {
    /// The key has no characters.
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] characters.
    TooLong {
        /// Its length in bytes.
        len: usize,
    },
    /// The key holds a byte that is not visible ASCII (a space, a control, obs-text).
    InvalidCharacter {
        /// The first offending byte.
        byte: u8,
    },
    /// A value opening with `"` that is not a valid RFC 8941 sf-string.
    BadSfString,
    /// A bare (unquoted) key holding a delimiter: a byte that is visible ASCII but not a
    /// token character (see [`HeaderKey`]), such as the `,` of two values joined into one.
    /// Quote the key as an sf-string to send it.
    NotAToken {
        /// The first delimiter.
        byte: u8,
    },
    /// The header appears more than once.
    Repeated,
}

impl fmt::Display for InvalidKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => f.write_str("the Idempotency-Key is empty"),
            Self::TooLong { len } => write!(
                f,
                "the Idempotency-Key is {len} characters long; at most {MAX_KEY_LEN} are allowed"
            ),
            Self::InvalidCharacter { byte } => write!(
                f,
                "the Idempotency-Key holds byte 0x{byte:02x}; only visible ASCII is allowed"
            ),
            Self::BadSfString => f.write_str("the Idempotency-Key is not a valid RFC 8941 string"),
            Self::NotAToken { byte } => write!(
                f,
                "the Idempotency-Key holds {:?} outside quotes: it is not one key (two values \
                 joined by a comma?); send one RFC 8941 string, `\"…\"`",
                char::from(*byte)
            ),
            Self::Repeated => f.write_str("the Idempotency-Key header appears more than once"),
        }
    }
}

impl std::error::Error for InvalidKey {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::grammar::is_visible_ascii;
    use crate::key::grammar::tests::is_token_byte;
    use crate::IdempotencyKey;

    fn parse(raw: &[u8]) -> Result<HeaderKey, InvalidKey> {
        HeaderKey::parse(&HeaderValue::from_bytes(raw).unwrap())
    }

    #[test]
    fn accepts_sf_strings_and_bare_tokens() {
        assert_eq!(parse(b"\"abc\"").unwrap().as_str(), "abc");
        assert_eq!(parse(b"abc").unwrap().as_str(), "abc");
        assert_eq!(parse(br#""a\"b\\c""#).unwrap().as_str(), "a\"b\\c");
        let longest = "k".repeat(MAX_KEY_LEN);
        assert_eq!(parse(longest.as_bytes()).unwrap().as_str(), longest);
    }

    #[test]
    fn rejects_everything_else() {
        assert_eq!(parse(b""), Err(InvalidKey::Empty));
        assert_eq!(parse(b"\"\""), Err(InvalidKey::Empty));
        assert_eq!(
            parse("k".repeat(256).as_bytes()),
            Err(InvalidKey::TooLong { len: 256 })
        );
        assert_eq!(parse(b"\"abc"), Err(InvalidKey::BadSfString));
        assert_eq!(parse(br#""a\nb""#), Err(InvalidKey::BadSfString));
        assert_eq!(parse(br#""a"b""#), Err(InvalidKey::BadSfString));
        assert_eq!(
            parse(b"a b"),
            Err(InvalidKey::InvalidCharacter { byte: b' ' })
        );
        assert_eq!(
            parse(b"\"a b\""),
            Err(InvalidKey::InvalidCharacter { byte: b' ' })
        );
        assert_eq!(
            parse(b"a\tb"),
            Err(InvalidKey::InvalidCharacter { byte: b'\t' })
        );
        assert_eq!(
            parse(&[b'a', 0xe9]),
            Err(InvalidKey::InvalidCharacter { byte: 0xe9 })
        );
    }

    /// The rules read as plainly as they are written: the reference the fast paths of
    /// [`HeaderKey::parse`] are checked against.
    fn parse_by_the_rules(raw: &[u8]) -> Result<String, InvalidKey> {
        let key = match raw {
            [b'"', inner @ .., b'"'] => {
                let mut key = String::new();
                let mut bytes = inner.iter();
                while let Some(&byte) = bytes.next() {
                    match byte {
                        b'\\' => match bytes.next() {
                            Some(&escaped @ (b'"' | b'\\')) => key.push(char::from(escaped)),
                            _ => return Err(InvalidKey::BadSfString),
                        },
                        b'"' => return Err(InvalidKey::BadSfString),
                        byte if is_visible_ascii(byte) => key.push(char::from(byte)),
                        byte => return Err(InvalidKey::InvalidCharacter { byte }),
                    }
                }
                key
            }
            [b'"', ..] => return Err(InvalidKey::BadSfString),
            _ => {
                let mut key = String::new();
                for &byte in raw {
                    if !is_visible_ascii(byte) {
                        return Err(InvalidKey::InvalidCharacter { byte });
                    }
                    if !is_token_byte(byte) {
                        return Err(InvalidKey::NotAToken { byte });
                    }
                    key.push(char::from(byte));
                }
                key
            }
        };
        match key.len() {
            0 => Err(InvalidKey::Empty),
            len if len > MAX_KEY_LEN => Err(InvalidKey::TooLong { len }),
            _ => Ok(key),
        }
    }

    #[test]
    fn a_bare_value_with_a_delimiter_is_not_a_key() {
        // What a proxy makes of two field lines, with or without the space.
        assert_eq!(
            parse(b"key,with,commas"),
            Err(InvalidKey::NotAToken { byte: b',' })
        );
        assert_eq!(parse(b"a, b"), Err(InvalidKey::NotAToken { byte: b',' }));
        for delimiter in b"\"(),;<=>?@[\\]{}" {
            let raw = [b'a', *delimiter, b'b'];
            assert_eq!(
                parse(&raw),
                Err(InvalidKey::NotAToken { byte: *delimiter }),
                "{raw:?}"
            );
        }
        // Quoted, the same characters are one key.
        assert_eq!(
            parse(b"\"key,with,commas\"").unwrap().as_str(),
            "key,with,commas"
        );
        // Keys clients send bare stay keys: UUIDs, ULIDs, paths, URNs, base64url.
        for key in [
            "550e8400-e29b-41d4-a716-446655440000",
            "01ARZ3NDEKTSV4RRFFQ69G5FAV",
            "orders/42",
            "urn:order:42",
            "c2VjcmV0LWtleQ",
            "*",
        ] {
            assert_eq!(parse(key.as_bytes()).unwrap().as_str(), key);
        }
    }

    /// The grammar, written independently of the parser: one sf-string of 1 to 255
    /// visible ASCII characters (`\"` and `\\` escaped), or one bare token.
    fn is_one_key(raw: &[u8]) -> bool {
        let sf_string = || {
            let [b'"', inner @ .., b'"'] = raw else {
                return false;
            };
            let (mut len, mut i) = (0, 0);
            while i < inner.len() {
                match inner[i] {
                    b'\\' if matches!(inner.get(i + 1), Some(b'"' | b'\\')) => i += 2,
                    b'\\' | b'"' => return false,
                    0x21..=0x7e => i += 1,
                    _ => return false,
                }
                len += 1;
            }
            (1..=MAX_KEY_LEN).contains(&len)
        };
        let token =
            || (1..=MAX_KEY_LEN).contains(&raw.len()) && raw.iter().all(|&b| is_token_byte(b));
        sf_string() || token()
    }

    proptest::proptest! {
        /// Any value made of visible ASCII, spaces, commas, quotes and backslashes (the
        /// bytes the grammar turns on): accepted exactly when it is one sf-string or one
        /// bare token.
        #[test]
        fn a_value_is_a_key_exactly_when_it_is_one_sf_string_or_one_token(
            raw in proptest::collection::vec(
                proptest::prop_oneof![
                    4 => proptest::sample::select(b"ab7-_.:/*".to_vec()),
                    3 => proptest::sample::select(b"\",\\ ;=()".to_vec()),
                    2 => 0x20u8..=0x7e,
                    1 => proptest::prelude::any::<u8>(),
                ],
                0..12,
            ),
        ) {
            let parsed = HeaderValue::from_bytes(&raw).ok().map(|value| HeaderKey::parse(&value));
            if let Some(parsed) = parsed {
                proptest::prop_assert_eq!(parsed.is_ok(), is_one_key(&raw), "{:?}", String::from_utf8_lossy(&raw));
            }
        }
    }

    const PLAIN: &[&[u8]] = &[b"a", b"7", b"-"];
    const ESCAPES: &[&[u8]] = &[b"\\\"", b"\\\\"];
    const HOSTILE: &[&[u8]] = &[b"\"", b"\\", b" ", b"\t", b"\xc3\xa9", b"\xe9", b"\xff"];
    const PADS: &[usize] = &[
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        INLINE_KEY_LEN - 2,
        INLINE_KEY_LEN - 1,
        INLINE_KEY_LEN,
        INLINE_KEY_LEN + 1,
        MAX_KEY_LEN - 1,
        MAX_KEY_LEN,
    ];

    proptest::proptest! {
        /// Any header value, quoted or not, with escapes, spaces, tabs, and bytes that are
        /// or are not UTF-8: the same key, or the same refusal, as the rules say.
        #[test]
        fn parse_agrees_with_the_rules(
            quoted in proptest::bool::ANY,
            body in proptest::collection::vec(
                proptest::prop_oneof![
                    // Mostly what keys are made of, so that many cases are keys.
                    8 => proptest::sample::select(PLAIN),
                    2 => proptest::sample::select(ESCAPES),
                    1 => proptest::sample::select(HOSTILE),
                ],
                0..12,
            ),
            // Now and then a run of plain bytes that takes the key across the length it is
            // held inline up to, or past the longest a key may be.
            pad in proptest::sample::select(PADS),
        ) {
            let mut raw = body.concat();
            raw.extend(std::iter::repeat_n(b'k', pad));
            if quoted {
                raw.insert(0, b'"');
                raw.push(b'"');
            }
            let parsed = parse(&raw).map(|key| key.as_str().to_owned());
            proptest::prop_assert_eq!(parsed, parse_by_the_rules(&raw), "{:?}", raw);
        }
    }

    #[test]
    fn keys_held_inline_or_not_compare_hash_and_print_by_their_characters() {
        use std::collections::hash_map::DefaultHasher;
        use std::hash::{Hash, Hasher};
        let hash = |key: &HeaderKey| {
            let mut hasher = DefaultHasher::new();
            key.hash(&mut hasher);
            hasher.finish()
        };
        for len in [
            1,
            INLINE_KEY_LEN - 1,
            INLINE_KEY_LEN,
            INLINE_KEY_LEN + 1,
            MAX_KEY_LEN,
        ] {
            let text = "k".repeat(len);
            let bare = parse(text.as_bytes()).unwrap();
            let quoted = parse(format!("\"{text}\"").as_bytes()).unwrap();
            assert_eq!(bare.as_str(), text, "{len} characters");
            assert_eq!(bare, quoted);
            assert_eq!(hash(&bare), hash(&quoted));
            assert_eq!(bare.to_string(), text);
            assert_eq!(format!("{bare:?}"), format!("HeaderKey({text:?})"));
            let other = parse(format!("{}j", &text[1..]).as_bytes()).unwrap();
            assert_ne!(bare, other, "{len} characters, the last differs");
        }
        // An escaped key is copied out of its value; it equals the same characters sent
        // without escapes, and its characters are the key (a bare `a"b` is no key at all).
        let escaped = parse(br#""a\"b""#).unwrap();
        assert_eq!(escaped.as_str(), "a\"b");
        assert_eq!(escaped, HeaderKey(KeyText::new(b"a\"b")));
        assert_eq!(parse(br#"a"b"#), Err(InvalidKey::NotAToken { byte: b'"' }));
    }

    #[test]
    fn emitted_header_round_trips() {
        let key = IdempotencyKey::derive("s", "t", "u");
        let parsed = HeaderKey::parse(&key.header_value()).unwrap();
        assert_eq!(parsed.as_str(), key.to_hex());
    }
}
