//! Operation identities, idempotency keys and how one is derived from the other.
//!
//! An orchestrator owns two identifiers that never change across retries of one logical
//! step: the task it is running and the step within it. [`OperationId`] carries them in a
//! request's extensions; [`IdempotencyKey`] is the 32-byte key derived from them.
//!
//! # Derivation (stable across releases)
//!
//! ```text
//! key = SHA-256( "tower-idempotency/key/v1"
//!                || u64_be(len(scope))   || scope
//!                || u64_be(len(task_id)) || task_id
//!                || u64_be(len(step_id)) || step_id )
//! ```
//!
//! Every field is prefixed with its length in bytes as a big-endian `u64`, so no two
//! different triples encode to the same bytes: `("ab", "c")` and `("a", "bc")` differ.
//! The leading version tag lets a future derivation coexist with this one. The key is
//! shown as 64 lowercase hex digits and sent as an RFC 8941 sf-string:
//! `Idempotency-Key: "<hex>"`.
//!
//! # Example
//!
//! ```
//! use tower_idempotency::{IdempotencyKey, OperationId};
//!
//! let op = OperationId::new("task-7", "charge-customer");
//! let key = op.key("billing");
//! assert_eq!(key, IdempotencyKey::derive("billing", "task-7", "charge-customer"));
//! assert_eq!(key.to_hex().len(), 64);
//! assert_eq!(key.header_value().to_str().unwrap(), format!("\"{}\"", key.to_hex()));
//! ```

use std::borrow::Cow;
use std::fmt;

use http::header::{HeaderMap, HeaderName, HeaderValue};
use sha2::{Digest, Sha256};

/// The `Idempotency-Key` header name (draft-ietf-httpapi-idempotency-key-header).
pub static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// Domain-separation tag of the key derivation; part of the published derivation.
const KEY_DERIVATION_TAG: &[u8] = b"tower-idempotency/key/v1";

/// The longest key accepted from a header, per the IETF draft's guidance.
pub const MAX_KEY_LEN: usize = 255;

/// The identity of one logical operation, owned by the orchestrator.
///
/// Insert it into a request's extensions; the client
/// [`IdempotencyLayer`](crate::IdempotencyLayer) derives the request's key from it. Never
/// build it from the payload, a timestamp or anything a model produced: a retry must
/// arrive at the same identity.
///
/// # Example
///
/// ```
/// use tower_idempotency::OperationId;
///
/// let mut req = http::Request::post("http://payments.local/charges").body(()).unwrap();
/// req.extensions_mut().insert(OperationId::new("task-42", "step-3"));
/// assert_eq!(req.extensions().get::<OperationId>().unwrap().step_id(), "step-3");
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct OperationId {
    /// `task_id` then `step_id`, in one shared allocation: an operation id travels in every
    /// attempt's extensions, so a clone must cost a reference count, not two strings.
    ids: std::sync::Arc<str>,
    /// Where `task_id` ends.
    split: usize,
}

impl OperationId {
    /// Identify step `step_id` of task `task_id`.
    pub fn new(task_id: impl Into<String>, step_id: impl Into<String>) -> Self {
        let mut ids = task_id.into();
        let split = ids.len();
        ids.push_str(&step_id.into());
        Self {
            ids: ids.into(),
            split,
        }
    }

    /// The task this operation belongs to.
    pub fn task_id(&self) -> &str {
        &self.ids[..self.split]
    }

    /// The step within the task.
    pub fn step_id(&self) -> &str {
        &self.ids[self.split..]
    }

    /// The idempotency key of this operation within `scope`.
    ///
    /// ```
    /// # use tower_idempotency::OperationId;
    /// let op = OperationId::new("t", "s");
    /// assert_ne!(op.key("tenant-a"), op.key("tenant-b"));
    /// ```
    pub fn key(&self, scope: &str) -> IdempotencyKey {
        IdempotencyKey::derive(scope, self.task_id(), self.step_id())
    }
}

impl fmt::Debug for OperationId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OperationId")
            .field("task_id", &self.task_id())
            .field("step_id", &self.step_id())
            .finish()
    }
}

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
        let mut hasher = Sha256::new();
        hasher.update(KEY_DERIVATION_TAG);
        for field in [scope, task_id, step_id] {
            update_length_prefixed(&mut hasher, field.as_bytes());
        }
        Self(hasher.finalize().into())
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
        let mut quoted = [b'"'; 66];
        hex_into(&self.0, &mut quoted[1..65]);
        shared_header_value(quoted)
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
    HeaderValue::from_maybe_shared(bytes::Bytes::from_owner(bytes))
        .expect("the layers only build visible-ASCII header values")
}

/// Feed `bytes` to `hasher` behind its length as a big-endian `u64`, so adjacent fields can
/// never run into each other.
pub(crate) fn update_length_prefixed(hasher: &mut Sha256, bytes: &[u8]) {
    hasher.update((bytes.len() as u64).to_be_bytes());
    hasher.update(bytes);
}

/// Lowercase hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    let mut out = vec![0; bytes.len() * 2];
    hex_into(bytes, &mut out);
    String::from_utf8(out).expect("hex digits are ASCII")
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

fn is_visible_ascii(byte: u8) -> bool {
    (0x21..=0x7e).contains(&byte)
}

/// The bytes an sf-string key holds as they are: visible ASCII but `"` and `\\`. A table,
/// because every keyed request scans its key byte by byte.
const SF_PLAIN: [bool; 256] = {
    let mut plain = [false; 256];
    let mut byte = 0x21;
    while byte <= 0x7e {
        plain[byte] = byte != b'"' as usize && byte != b'\\' as usize;
        byte += 1;
    }
    plain
};

/// The bytes a bare token key is made of: RFC 9110 `tchar` (letters, digits and
/// ``!#$%&'*+-.^_`|~``) and the `:` and `/` an RFC 8941 sf-token also allows. Every other
/// visible byte is a delimiter of some structured field or list syntax: `,` above all,
/// which joins two field lines into one value (RFC 9110 §5.3). A table, because every
/// keyed request scans its key byte by byte.
const TOKEN: [bool; 256] = {
    let mut token = [false; 256];
    let mut byte = 0;
    while byte < 256 {
        let b = byte as u8;
        token[byte] = b.is_ascii_alphanumeric()
            || matches!(
                b,
                b'!' | b'#'
                    | b'$'
                    | b'%'
                    | b'&'
                    | b'\''
                    | b'*'
                    | b'+'
                    | b'-'
                    | b'.'
                    | b'^'
                    | b'_'
                    | b'`'
                    | b'|'
                    | b'~'
                    | b':'
                    | b'/'
            );
        byte += 1;
    }
    token
};

/// A bare token: [`TOKEN`] bytes only. A byte that is not visible ASCII (a space, a
/// control, obs-text) is an invalid character; a visible delimiter says the value is not
/// one bare key.
fn bare_token(bytes: &[u8]) -> Result<Cow<'_, [u8]>, InvalidKey> {
    if let Some(&byte) = bytes.iter().find(|&&b| !TOKEN[usize::from(b)]) {
        return Err(if is_visible_ascii(byte) {
            InvalidKey::NotAToken { byte }
        } else {
            InvalidKey::InvalidCharacter { byte }
        });
    }
    Ok(Cow::Borrowed(bytes))
}

/// Whether each of the eight bytes of `word` is one an sf-string key holds as it is
/// ([`SF_PLAIN`]), checked at once: no byte below `!` or above `~` (which takes in every
/// byte that is not ASCII), none equal to `"` or `\`. Each test is the classic
/// "has a byte less than / greater than / equal to" word trick; a borrow or carry can only
/// mark a byte next to one that is marked already, so the answer for the word is exact.
fn all_plain(word: u64) -> bool {
    const ONES: u64 = u64::from_ne_bytes([0x01; 8]);
    const HIGH: u64 = ONES * 0x80;
    let has_zero_byte = |v: u64| v.wrapping_sub(ONES) & !v & HIGH;
    let below_visible = word.wrapping_sub(ONES * 0x21) & !word & HIGH;
    let above_visible = (word.wrapping_add(ONES) | word) & HIGH;
    let quote = has_zero_byte(word ^ (ONES * u64::from(b'"')));
    let backslash = has_zero_byte(word ^ (ONES * u64::from(b'\\')));
    below_visible | above_visible | quote | backslash == 0
}

/// Eight bytes as one word (any byte order: [`all_plain`] tests each byte alike).
fn word(eight: &[u8]) -> u64 {
    u64::from_ne_bytes(eight.try_into().expect("eight bytes"))
}

/// How many bytes `inner` starts with that an sf-string key holds as they are. A word at
/// a time (a key is tens of bytes); a plain key's last bytes as its last eight, which
/// overlap what was checked; byte by byte only from the first word that is not all plain.
fn plain_run(inner: &[u8]) -> usize {
    let whole = inner
        .chunks_exact(8)
        .take_while(|&eight| all_plain(word(eight)))
        .count()
        * 8;
    let rest = &inner[whole..];
    if rest.len() < 8 && inner.len() >= 8 && all_plain(word(&inner[inner.len() - 8..])) {
        return inner.len();
    }
    whole
        + rest
            .iter()
            .position(|&b| !SF_PLAIN[usize::from(b)])
            .unwrap_or(rest.len())
}

/// The inside of an RFC 8941 sf-string: `\"` and `\\` escapes, every other escape invalid.
/// The key itself must still be visible ASCII, so the space an sf-string permits is refused.
fn unescape_sf_string(inner: &[u8]) -> Result<Cow<'_, [u8]>, InvalidKey> {
    // Keys seldom hold escapes: validate the run before the first one in a single scan, and
    // when it is the whole key, borrow it: a plain key costs one pass and no copy here.
    let plain = plain_run(inner);
    let (head, rest) = inner.split_at(plain);
    if rest.is_empty() {
        return Ok(Cow::Borrowed(head));
    }
    let mut out = Vec::with_capacity(inner.len());
    out.extend_from_slice(head);
    let mut bytes = rest.iter();
    while let Some(&byte) = bytes.next() {
        match byte {
            b'\\' => match bytes.next() {
                Some(&escaped @ (b'"' | b'\\')) => out.push(escaped),
                _ => return Err(InvalidKey::BadSfString),
            },
            b'"' => return Err(InvalidKey::BadSfString),
            byte if is_visible_ascii(byte) => out.push(byte),
            byte => return Err(InvalidKey::InvalidCharacter { byte }),
        }
    }
    Ok(Cow::Owned(out))
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

    #[test]
    fn operation_ids_keep_their_two_parts_apart() {
        let (a, b) = (OperationId::new("ab", "c"), OperationId::new("a", "bc"));
        assert_ne!(a, b);
        assert_eq!((a.task_id(), a.step_id()), ("ab", "c"));
        assert_eq!((b.task_id(), b.step_id()), ("a", "bc"));
        assert_eq!(a.clone(), a);
        assert_eq!(
            format!("{a:?}"),
            r#"OperationId { task_id: "ab", step_id: "c" }"#
        );
    }

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
    fn the_plain_byte_table_is_visible_ascii_but_quote_and_backslash() {
        for byte in 0..=255u8 {
            let plain = is_visible_ascii(byte) && byte != b'"' && byte != b'\\';
            assert_eq!(SF_PLAIN[usize::from(byte)], plain, "byte {byte:#04x}");
        }
    }

    /// Words of bytes drawn mostly from the edges of the plain range (where the word
    /// tests' borrows and carries are), so that plain words and words with one odd byte
    /// both come often.
    fn edgy_bytes() -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
        use proptest::prelude::*;
        let byte = prop_oneof![
            6 => proptest::sample::select(vec![0x20u8, 0x21, 0x22, 0x23, 0x5b, 0x5c, 0x5d, 0x7e, 0x7f, 0x80, 0xff, 0x00, 0x01]),
            10 => 0x21u8..=0x7e,
            1 => any::<u8>(),
        ];
        proptest::collection::vec(byte, 0..40)
    }

    proptest::proptest! {
        /// The word-at-a-time scan finds the first byte the table refuses, wherever it is
        /// and whatever is next to it.
        #[test]
        fn plain_run_agrees_with_the_table(inner in edgy_bytes()) {
            let expected = inner
                .iter()
                .position(|&b| !SF_PLAIN[usize::from(b)])
                .unwrap_or(inner.len());
            proptest::prop_assert_eq!(plain_run(&inner), expected);
            for eight in inner.windows(8) {
                let plain = eight.iter().all(|&b| SF_PLAIN[usize::from(b)]);
                proptest::prop_assert_eq!(all_plain(word(eight)), plain, "{:02x?}", eight);
            }
        }
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

    /// RFC 9110 `tchar`, and the `:` and `/` of an RFC 8941 sf-token, as the RFCs list them.
    fn is_token_byte(byte: u8) -> bool {
        byte.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/".contains(&byte)
    }

    #[test]
    fn the_token_table_is_the_grammar() {
        for byte in 0..=255u8 {
            assert_eq!(
                TOKEN[usize::from(byte)],
                is_token_byte(byte),
                "byte {byte:#04x}"
            );
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
    fn the_plain_run_ends_at_the_first_byte_that_is_not_plain_wherever_it_is() {
        for len in 0..40 {
            assert_eq!(plain_run(&vec![b'k'; len]), len, "all plain, {len} bytes");
            for at in 0..len {
                // Every byte the table refuses, next to plain ones on both sides.
                for stop in (0..=255u8).filter(|&b| !SF_PLAIN[usize::from(b)]) {
                    let mut bytes = vec![b'k'; len];
                    bytes[at] = stop;
                    assert_eq!(plain_run(&bytes), at, "{stop:#04x} at {at} of {len}");
                }
            }
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
