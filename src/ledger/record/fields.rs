//! What a completed record keeps of its request: a digest of each top-level JSON field.
//!
//! A completed operation is never resent, so its frozen request (head, headers, whole body)
//! is dead weight: what a later request under the same key still needs of it is the
//! fingerprint (kept apart) and, when that differs, the names of the fields that changed.
//! Those are found as well from a digest of each field's value as from the value itself.
//!
//! The body is scanned once, at completion, for the top level of a JSON object: names and
//! the byte span of each value, the end of a string found by `memchr`. A value written the
//! one way JSON allows (a string without escapes, an integer, `true`, `false`, `null`) is
//! digested as it stands; any other (a nested object or array, an escaped string, a number
//! with a fraction or an exponent) is parsed and digested in a canonical form (keys sorted,
//! no whitespace, strings and numbers re-encoded), so the fields named are those whose
//! values differ, as [`Drift::between`](crate::Drift::between) finds them: re-indenting or
//! re-escaping a payload changes no field. The common payload (flat, plain strings and
//! integers) is never parsed, and nothing is allocated but the summary.

use std::borrow::Cow;
use std::fmt;

use crate::swar::bytes_equal;

/// The top-level fields of a request body that is a JSON object, each by a 64-bit digest of
/// its value's bytes: what a [`MemoryStore`](crate::ledger::MemoryStore) keeps of a
/// completed operation's request, enough to name the fields a later request under the same
/// key changed ([`Begin::DriftFields`](crate::ledger::Begin::DriftFields)).
///
/// ```
/// use tower_idempotency::ledger::FieldDigests;
///
/// let first = FieldDigests::of(br#"{"order_id":"o_1","summary":"a"}"#).unwrap();
/// let again = br#"{"order_id":"o_1","summary":"b","note":1}"#;
/// assert_eq!(first.changed_fields(again).unwrap(), ["note", "summary"]);
/// assert!(FieldDigests::of(b"not json").is_none());
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct FieldDigests(Box<[u8]>);

/// An entry: the name's length (`u16` big-endian), the name as it appears between its
/// quotes (escapes kept), the value's digest (`u64` little-endian).
// 64 bits of a fast hash, not SHA-256: the digests only name the fields in a drift error.
// Whether a request drifted at all is the fingerprint's call, so a collision here can at
// worst leave a changed field unnamed; it can never make a replay or a run.
const DIGEST_LEN: usize = 8;

/// The buffer of [`FieldDigests::unnamed`]: shorter than any entry.
const UNNAMED: u8 = 0xff;

/// The first byte of the name of an entry that digests the value at a JSON pointer rather
/// than a top-level field ([`Gathered::of_pointers`]): a byte no UTF-8 string starts with,
/// so no field's name can be mistaken for one.
const POINTER: u8 = 0xff;

impl FieldDigests {
    /// The digests of `body`'s top-level fields, if it is a JSON object (`None` if not, or if
    /// a field name is over 64 KiB).
    pub fn of(body: &[u8]) -> Option<Self> {
        let mut out = Gather::new();
        gather_into(body, &mut out)?;
        Some(Self(out.finish()))
    }

    /// The digests whose entries ([`Gathered::entries`]) are `entries`.
    pub(crate) fn from_entries(entries: &[u8]) -> Self {
        Self(Box::from(entries))
    }

    /// The digests of a request whose fields cannot be named (its body is no JSON object,
    /// or digests of its fields would outweigh it): no field to compare, and none named.
    /// What a store that keeps digests answers for such a request once completed, so that
    /// a regenerated request drifts from it as from a store that kept the request whole
    /// (the faces judge by the fingerprints), never as from a record that kept nothing.
    pub(crate) fn unnamed() -> Self {
        // One byte: every buffer of entries is empty or holds an entry's 10 bytes at least.
        Self(Box::new([UNNAMED]))
    }

    /// Whether these are [`unnamed`](Self::unnamed).
    fn is_unnamed(&self) -> bool {
        self.0[..] == [UNNAMED]
    }

    /// Bytes held, for weighing: the entries and the allocation they are in.
    pub(crate) fn weight(&self) -> usize {
        Self::weight_of(self.0.len())
    }

    /// What digests whose entries take `len` bytes weigh, held on their own.
    pub(crate) fn weight_of(len: usize) -> usize {
        std::mem::size_of::<Self>() + len + 16
    }

    /// The top-level fields added, removed or changed in `body` against these, sorted; `None`
    /// when `body` is not a JSON object, or the first request's fields could not be named
    /// (its body was none).
    pub fn changed_fields(&self, body: &[u8]) -> Option<Vec<String>> {
        if self.is_unnamed() {
            return None;
        }
        let new = fields(body)?;
        let old = last_of_each(
            self.field_entries()
                .map(|(name, digest)| (Cow::Borrowed(name), digest))
                .collect(),
        );
        let mut old = old
            .iter()
            .map(|(name, digest)| (&name[..], *digest))
            .peekable();
        let mut new = new
            .iter()
            .map(|(name, digest)| (&name[..], *digest))
            .peekable();
        let mut changed = Vec::new();
        // Both sorted by name: a merge.
        loop {
            let name = match (old.peek(), new.peek()) {
                (None, None) => break,
                (Some((a, x)), Some((b, y))) if a == b => {
                    let differs = x != y;
                    let name = *a;
                    old.next();
                    new.next();
                    if !differs {
                        continue;
                    }
                    name
                }
                (Some((a, _)), Some((b, _))) if a > b => new.next()?.0,
                (Some(_), _) => old.next()?.0,
                (None, Some(_)) => new.next()?.0,
            };
            changed.push(String::from_utf8_lossy(name).into_owned());
        }
        Some(changed)
    }

    /// Whether the value at `pointer` differs in `new` from the first request's: `None`
    /// when it was not gathered (the face that recorded the operation judged by other
    /// fields, or the store made the digests itself).
    ///
    /// How a face that judges drift on [defining fields](crate::fingerprint::PayloadFields)
    /// sees into a top-level field that changed: the digests of the fields' values at
    /// their pointers ride with the outcome, as a store that keeps the whole request would
    /// find them in it.
    pub(crate) fn pointer_changed(&self, pointer: &str, new: &serde_json::Value) -> Option<bool> {
        let (_, digest) = self
            .pointer_entries()
            .find(|(name, _)| *name == pointer.as_bytes())?;
        Some(digest != pointer_digest(new.pointer(pointer)))
    }

    /// The entries of the top-level fields.
    fn field_entries(&self) -> impl Iterator<Item = (&[u8], u64)> {
        self.each_entry()
            .filter(|(name, _)| name.first() != Some(&POINTER))
    }

    /// The entries of the values at JSON pointers, by pointer.
    fn pointer_entries(&self) -> impl Iterator<Item = (&[u8], u64)> {
        self.each_entry()
            .filter_map(|(name, digest)| Some((name.strip_prefix(&[POINTER])?, digest)))
    }

    /// The entries, as [`from_entries`](Self::from_entries) reads them back.
    pub(crate) fn entries(&self) -> &[u8] {
        &self.0
    }

    /// Each entry's name and digest. Entries read back from a record cut short end the
    /// walk where they stop making sense, never panic.
    fn each_entry(&self) -> impl Iterator<Item = (&[u8], u64)> {
        let mut rest = &self.0[..];
        std::iter::from_fn(move || {
            let (len, tail) = rest.split_first_chunk::<2>()?;
            let (name, tail) = tail.split_at_checked(usize::from(u16::from_be_bytes(*len)))?;
            let (value, tail) = tail.split_first_chunk::<DIGEST_LEN>()?;
            rest = tail;
            Some((name, u64::from_le_bytes(*value)))
        })
    }
}

/// The entries of `body`'s top-level fields, into `out`; `None` if `body` is no JSON object
/// (or a name is over 64 KiB).
fn gather_into(body: &[u8], out: &mut Gather) -> Option<()> {
    // In the body's order (sorted when compared, a cold path): one pass, one buffer.
    scan_object(body, |name, value, plain| {
        let len = u16::try_from(name.len()).ok()?;
        let digest = match plain {
            Some(digest) => digest,
            None => value_digest(value)?,
        };
        out.push(len, &name, digest);
        Some(())
    })
}

/// A body's field digests gathered where they are made and not yet held anywhere: their
/// entries, on the stack unless there are many. A face that records an outcome writes them
/// into the record's own buffer ([`FieldDigests::from_entries`] reads them back).
pub(crate) struct Gathered(Gather);

impl Gathered {
    /// None yet.
    #[inline]
    pub(crate) fn new() -> Self {
        Self(Gather::new())
    }

    /// Gather the digests of `body`'s top-level fields, in place; `false` if `body` is no
    /// JSON object (what was gathered is then no answer).
    #[inline]
    pub(crate) fn of_body(&mut self, body: &[u8]) -> bool {
        gather_into(body, &mut self.0).is_some()
    }

    /// Gather, after the top-level fields, the digest of the value at each of `fields`'
    /// pointers in `body` (a JSON object, as [`of_body`](Self::of_body) found), so that a
    /// change beside a nested defining field can be told from one to it
    /// ([`FieldDigests::pointer_changed`]). Parses the body: only for a face that judges
    /// drift by defining fields.
    pub(crate) fn of_pointers(&mut self, body: &[u8], fields: &crate::fingerprint::PayloadFields) {
        let Ok(value) = serde_json::from_slice::<serde_json::Value>(body) else {
            return;
        };
        let mut name = Vec::new();
        for pointer in fields.pointers() {
            name.clear();
            name.push(POINTER);
            name.extend_from_slice(pointer.as_bytes());
            // A pointer too long to name is left out: judged as changed, never as the same.
            if let Ok(len) = u16::try_from(name.len()) {
                self.0
                    .push(len, &name, pointer_digest(value.pointer(pointer)));
            }
        }
    }

    /// The entries, in [`FieldDigests`]' layout.
    pub(crate) fn entries(&self) -> &[u8] {
        self.0.entries()
    }
}

/// Bytes [`Gather`] holds before it spills to the heap: the entries of a dozen short fields.
const GATHERED: usize = 256;

/// Entries gathered on the stack, then boxed at their exact size: one allocation, where a
/// growing `Vec` would allocate and then shrink.
struct Gather {
    stack: [u8; GATHERED],
    len: usize,
    spilled: Vec<u8>,
}

impl Gather {
    fn new() -> Self {
        Self {
            stack: [0; GATHERED],
            len: 0,
            spilled: Vec::new(),
        }
    }

    /// One entry (see [`DIGEST_LEN`]): the name's length, the name, the digest.
    fn push(&mut self, len: u16, name: &[u8], digest: u64) {
        let at = self.len;
        let end = at + 2 + name.len() + DIGEST_LEN;
        if self.spilled.is_empty() && end <= GATHERED {
            self.stack[at..at + 2].copy_from_slice(&len.to_be_bytes());
            self.stack[at + 2..end - DIGEST_LEN].copy_from_slice(name);
            self.stack[end - DIGEST_LEN..end].copy_from_slice(&digest.to_le_bytes());
            self.len = end;
            return;
        }
        if self.spilled.is_empty() {
            self.spilled.reserve(2 * end);
            self.spilled.extend_from_slice(&self.stack[..at]);
        }
        self.spilled.extend_from_slice(&len.to_be_bytes());
        self.spilled.extend_from_slice(name);
        self.spilled.extend_from_slice(&digest.to_le_bytes());
    }

    fn entries(&self) -> &[u8] {
        if self.spilled.is_empty() {
            &self.stack[..self.len]
        } else {
            &self.spilled
        }
    }

    fn finish(self) -> Box<[u8]> {
        if self.spilled.is_empty() {
            Box::from(&self.stack[..self.len])
        } else {
            self.spilled.into_boxed_slice()
        }
    }
}

/// The top-level fields of `body`, a JSON object: each name (unescaped) and the digest of its
/// value, sorted by name, the last of a repeated name kept (as a parser keeps it).
fn fields(body: &[u8]) -> Option<Vec<(Cow<'_, [u8]>, u64)>> {
    let mut fields = Vec::new();
    scan_object(body, |name, value, plain| {
        let digest = match plain {
            Some(digest) => digest,
            None => value_digest(value)?,
        };
        fields.push((name, digest));
        Some(())
    })?;
    Some(last_of_each(fields))
}

/// `fields` sorted by name, of a repeated name the last kept.
fn last_of_each(mut fields: Vec<(Cow<'_, [u8]>, u64)>) -> Vec<(Cow<'_, [u8]>, u64)> {
    // Stable: of a repeated name, the last comes last, and is the one kept.
    fields.sort_by(|(a, _), (b, _)| a.cmp(b));
    let mut kept: Vec<(Cow<'_, [u8]>, u64)> = Vec::with_capacity(fields.len());
    for field in fields {
        match kept.last_mut() {
            Some(last) if last.0 == field.0 => *last = field,
            _ => kept.push(field),
        }
    }
    kept
}

/// A name as written between its quotes, unescaped; `None` if it is no valid string.
/// `escaped`: the name holds a backslash (as its scan found).
#[inline]
fn field_name(raw: &[u8], escaped: bool) -> Option<Cow<'_, [u8]>> {
    if escaped {
        return Some(Cow::Owned(unescaped(raw)?.into_bytes()));
    }
    // Names are short and mostly ASCII: checked as such first, for less than UTF-8's setup.
    if !raw.is_ascii() {
        std::str::from_utf8(raw).ok()?;
    }
    Some(Cow::Borrowed(raw))
}

/// A string's contents as written between its quotes, unescaped.
fn unescaped(raw: &[u8]) -> Option<String> {
    let mut quoted = Vec::with_capacity(raw.len() + 2);
    quoted.push(b'"');
    quoted.extend_from_slice(raw);
    quoted.push(b'"');
    serde_json::from_slice(&quoted).ok()
}

/// Digests of strings (of their contents) and of other values (of their bytes) start apart,
/// so that `1` and `"1"` differ.
const STRING_SEED: u64 = 0x2545_f491_4f6c_dd1d;
const VALUE_SEED: u64 = 0x9e37_79b9_7f4a_7c15;

/// The digest of a value that is not a plain string (see [`plain_string`]): of its bytes if
/// they are the one way to write it, else of its canonical form; `None` if it is no JSON
/// value.
fn value_digest(value: &[u8]) -> Option<u64> {
    let canonical_already = match value {
        b"true" | b"false" | b"null" => true,
        [b'-', digits @ ..] | digits => {
            !digits.is_empty()
                && digits.iter().all(u8::is_ascii_digit)
                && (digits[0] != b'0' || digits.len() == 1)
        }
    };
    if canonical_already {
        return Some(digest(VALUE_SEED, value));
    }
    // Keys sorted (the map is ordered by key), no whitespace, one spelling of each string
    // and number.
    let parsed: serde_json::Value = serde_json::from_slice(value).ok()?;
    let canonical = serde_json::to_vec(&parsed).ok()?;
    Some(match (&parsed, &canonical[..]) {
        // As a plain string with these contents is digested.
        (serde_json::Value::String(_), [b'"', inside @ .., b'"']) => digest(STRING_SEED, inside),
        _ => digest(VALUE_SEED, &canonical),
    })
}

/// The digest of the value at a pointer (`None`: absent), canonically encoded, so that
/// whitespace and member order never count as a change.
fn pointer_digest(value: Option<&serde_json::Value>) -> u64 {
    match value {
        Some(value) => {
            let mut canonical = Vec::new();
            crate::fingerprint::canonical::write(value, &mut canonical);
            digest(VALUE_SEED, &canonical)
        }
        // No canonical value is empty: absent differs from every value.
        None => digest(VALUE_SEED, b""),
    }
}

impl fmt::Debug for FieldDigests {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(
                self.field_entries()
                    .map(|(name, _)| String::from_utf8_lossy(name).into_owned()),
            )
            .finish()
    }
}

const K: u64 = 0x9e37_79b9_7f4a_7c15;

/// One word into a digest: a multiply-rotate fold. Not cryptographic: two values that
/// collide would only go unnamed in a drift report, and the fingerprint (SHA-256) decides
/// whether a payload changed.
fn mix(hash: u64, word: u64) -> u64 {
    (hash ^ word).wrapping_mul(K)
}

fn finish(hash: u64, len: usize) -> u64 {
    let hash = (hash ^ len as u64).wrapping_mul(K);
    hash ^ (hash >> 29)
}

/// A 64-bit digest of `bytes`: 32 bytes at a time in four lanes, folded into one, then
/// the rest eight at a time, the last word padded with zeros (empty if the length is a
/// multiple of eight), then the length.
///
/// Four lanes because one chain of multiplies waits on each, and a string value is most of
/// a body: the four multiplies of a block overlap. (Only `MemoryStore` keeps these digests,
/// in memory: none is ever compared with one another release computed.)
#[inline]
fn digest(seed: u64, bytes: &[u8]) -> u64 {
    let mut blocks = bytes.chunks_exact(32);
    let mut hash = seed;
    if bytes.len() >= 32 {
        let mut lanes = [seed, seed ^ LANES[0], seed ^ LANES[1], seed ^ LANES[2]];
        for block in &mut blocks {
            let block: &[u8; 32] = block.try_into().expect("32 bytes");
            for (at, lane) in lanes.iter_mut().enumerate() {
                *lane = mix(*lane, word_at(&block[at * 8..at * 8 + 8]));
            }
        }
        hash = lanes[0]
            ^ lanes[1].rotate_left(16)
            ^ lanes[2].rotate_left(32)
            ^ lanes[3].rotate_left(48);
    }
    let mut words = blocks.remainder().chunks_exact(8);
    for word in &mut words {
        hash = mix(hash, word_at(word));
    }
    let mut last = [0u8; 8];
    last[..words.remainder().len()].copy_from_slice(words.remainder());
    finish(mix(hash, u64::from_le_bytes(last)), bytes.len())
}

/// What the three lanes after the first start from, besides the seed.
const LANES: [u64; 3] = [
    0x243f_6a88_85a3_08d3,
    0x1319_8a2e_0370_7344,
    0xa409_3822_299f_31d0,
];

fn word_at(word: &[u8]) -> u64 {
    u64::from_le_bytes(word.try_into().expect("eight bytes"))
}

/// Call `field` with each top-level name (unescaped) and value (its bytes) of the JSON
/// object `body`, and the value's digest if it is a plain string (found in the same
/// pass); `None` if `body` is not one, or if `field` says so.
fn scan_object<'a>(
    body: &'a [u8],
    mut field: impl FnMut(Cow<'a, [u8]>, &'a [u8], Option<u64>) -> Option<()>,
) -> Option<()> {
    let mut at = skip_space(body, 0);
    if body.get(at) != Some(&b'{') {
        return None;
    }
    at = skip_space(body, at + 1);
    if body.get(at) == Some(&b'}') {
        return (skip_space(body, at + 1) == body.len()).then_some(());
    }
    loop {
        if body.get(at) != Some(&b'"') {
            return None;
        }
        let (name_end, name_escaped) = string_close(body, at + 1)?;
        let name = field_name(&body[at + 1..name_end], name_escaped)?;
        at = skip_space(body, name_end + 1);
        if body.get(at) != Some(&b':') {
            return None;
        }
        let start = skip_space(body, at + 1);
        let (end, plain) = if body.get(start) == Some(&b'"') {
            let (quote, plain) = plain_string(body, start + 1)?;
            (quote + 1, plain)
        } else {
            (value_end(body, start)?, None)
        };
        field(name, &body[start..end], plain)?;
        at = skip_space(body, end);
        match body.get(at) {
            Some(b',') => at = skip_space(body, at + 1),
            Some(b'}') => return (skip_space(body, at + 1) == body.len()).then_some(()),
            _ => return None,
        }
    }
}

fn skip_space(body: &[u8], mut at: usize) -> usize {
    while matches!(body.get(at), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        at += 1;
    }
    at
}

/// Where the value starting at `start` ends (exclusive).
fn value_end(body: &[u8], start: usize) -> Option<usize> {
    match *body.get(start)? {
        b'"' => Some(string_close(body, start + 1)?.0 + 1),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut at = start;
            loop {
                match *body.get(at)? {
                    b'"' => at = string_close(body, at + 1)?.0,
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(at + 1);
                        }
                    }
                    _ => {}
                }
                at += 1;
            }
        }
        // A number, `true`, `false` or `null`: up to the next delimiter.
        _ => {
            let len = body[start..]
                .iter()
                .position(|byte| matches!(byte, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r'))
                .unwrap_or(body.len() - start);
            (len > 0).then_some(start + len)
        }
    }
}

/// The string whose contents start at `from`: the index of its closing quote and, if it
/// holds no escape (a plain string, the common value), the digest of its contents (a string
/// value is most of a body).
fn plain_string(body: &[u8], from: usize) -> Option<(usize, Option<u64>)> {
    let (end, escaped) = string_close(body, from)?;
    if escaped {
        return Some((end, None));
    }
    // As `value_digest` digests the same string written with escapes.
    Some((end, Some(digest(STRING_SEED, &body[from..end]))))
}

/// The string whose contents start at `from`: the index of its closing quote, and whether
/// it holds an escape. Names, and the strings inside a nested value, need no digest.
#[inline]
fn string_close(body: &[u8], from: usize) -> Option<(usize, bool)> {
    let first = from + quote_or_backslash(body.get(from..)?)?;
    if body[first] == b'\\' {
        return Some((string_end(body, first)?, true));
    }
    Some((first, false))
}

/// Bytes read eight at a time for a `"` or a `\` before `memchr` takes over: most strings
/// (names, ids, amounts) end within them, and `memchr`, which compares 16 or 32 bytes at
/// once with the vector instructions the machine has, costs more to set up than they take
/// to read.
const SHORT_STRING: usize = 32;

/// The first `"` or `\` in `bytes`.
#[inline]
fn quote_or_backslash(bytes: &[u8]) -> Option<usize> {
    let mut at = 0;
    while at + 8 <= bytes.len() && at < SHORT_STRING {
        let word = u64::from_le_bytes(bytes[at..at + 8].try_into().expect("eight bytes"));
        // The lowest mark of each is exact (see `crate::swar`), so the lowest of both is.
        let marks = bytes_equal(word, b'"') | bytes_equal(word, b'\\');
        if marks != 0 {
            return Some(at + marks.trailing_zeros() as usize / 8);
        }
        at += 8;
    }
    memchr::memchr2(b'"', b'\\', &bytes[at..]).map(|found| at + found)
}

/// The index of the quote that closes a string, looked for from `from` (inside it).
fn string_end(body: &[u8], mut from: usize) -> Option<usize> {
    loop {
        let quote = from + find_quote(body.get(from..)?)?;
        // Escaped if an odd number of backslashes runs up to it.
        let backslashes = body[..quote]
            .iter()
            .rev()
            .take_while(|byte| **byte == b'\\')
            .count();
        if backslashes % 2 == 0 {
            return Some(quote);
        }
        from = quote + 1;
    }
}

/// The first `"` in `bytes`, eight bytes at a time.
fn find_quote(bytes: &[u8]) -> Option<usize> {
    let mut words = bytes.chunks_exact(8);
    let mut at = 0;
    for word in &mut words {
        let quotes = bytes_equal(
            u64::from_le_bytes(word.try_into().expect("eight bytes")),
            b'"',
        );
        if quotes != 0 {
            return Some(at + quotes.trailing_zeros() as usize / 8);
        }
        at += 8;
    }
    words
        .remainder()
        .iter()
        .position(|byte| *byte == b'"')
        .map(|found| at + found)
}

#[cfg(test)]
mod tests;
