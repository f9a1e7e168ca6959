//! A recorded response's headers, held in one buffer.
//!
//! A record is written on every operation and read only by its replays, most never. A
//! `HeaderMap` costs its writer two allocations and a hash of every name (the crate's own
//! names are long custom ones, hashed byte by byte); a block costs one exact-size buffer
//! and no hashing, and its replay builds the map it answers with.
//!
//! Layout, entry after entry in the order they were recorded (repeated names kept):
//! `flags: u8` (bit 0: the value is sensitive), `name length: u16` big-endian, `value
//! length: u32` big-endian, the name, the value (the fixed part first, written at once).
//! Every block is checked when it is made (names and values valid, lengths in bounds), so
//! reading one cannot fail.
//!
//! One entry is held shorter in a record ([`HeaderBlock::of_followed_by`]):
//! `Idempotent-Request-Digest: sha-256=:<base64>:`, which every server record carries, is
//! held as its 32 digest bytes under flag bit 1 with no name (39 bytes instead of 86), and
//! rendered again when read.

use std::borrow::Cow;
use std::fmt;
use std::ops::Range;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue};

use crate::digest::{BodyDigest, IDEMPOTENT_REQUEST_DIGEST};

/// Bytes an entry takes besides its name and value: flags, the two lengths.
const ENTRY_OVERHEAD: usize = 1 + 2 + 4;

/// `flags` bit: the value is sensitive (`HeaderValue::is_sensitive`).
const SENSITIVE: u8 = 1;

/// `flags` bit: the entry is `Idempotent-Request-Digest: sha-256=:<base64>:`, held as the
/// digest's 32 bytes, with no name.
const REQUEST_DIGEST: u8 = 2;

/// Bytes a request digest held short takes in a block
/// ([`BlockWriter::push_request_digest`]).
pub(crate) const REQUEST_DIGEST_SIZE: usize = ENTRY_OVERHEAD + 32;

/// The most entries a map is sized for up front: a block may hold far more values than a
/// `HeaderMap` may be presized for (it bounds distinct names, not values).
const PRESIZED: usize = 64;

/// A recorded response's headers (see the module docs), and on a client's record the
/// response body after them. Cloning is a reference-count increment.
#[derive(Clone)]
pub(crate) struct HeaderBlock {
    /// The entries, then the body recorded with them ([`with_body`](Self::with_body)).
    bytes: Bytes,
    len: u32,
    /// Bytes after the body: on a client's record, its request's field digests, gathered
    /// before the record was handed to the store ([`with_body_and_tail`](Self::with_body_and_tail)).
    tail: u32,
    /// Where the entries end and the body begins.
    end: usize,
}

/// One entry of a [`HeaderBlock`], borrowed.
pub(crate) struct Entry<'a> {
    pub(crate) name: &'a [u8],
    value: Range<usize>,
    sensitive: bool,
    /// The value is held as a digest's 32 bytes (see [`REQUEST_DIGEST`]).
    digest: bool,
}

impl HeaderBlock {
    /// Every header of `headers`, in order, sensitivity kept.
    pub(crate) fn of(headers: &HeaderMap) -> Self {
        let mut block = BlockWriter::with_capacity(entries_size(headers.iter()));
        block.push_all(headers);
        block.finish()
    }

    /// Every header of `headers` (as [`of`](Self::of)) and a copy of `body` after them
    /// ([`body`](Self::body)), in one exact-size buffer of their own: what a client records
    /// of a response.
    ///
    /// A body or header value sliced out of a transport's read buffer (hyper hands out both
    /// so) would otherwise keep that whole buffer alive for the retention, unseen by the
    /// store's budget. One buffer rather than two: a record's allocations are freed cold,
    /// when it is evicted, and one costs less than two there. The buffer is not sliced
    /// here: the first slice of a `Bytes` made from a `Vec` allocates its shared handle,
    /// which a record that is never replayed (most are not) then never needs.
    pub(crate) fn with_body(headers: &HeaderMap, body: &[u8]) -> Self {
        Self::with_body_and_tail(headers, body, &[])
    }

    /// [`with_body`](Self::with_body), and `tail` after the body, in the same buffer
    /// ([`tail`](Self::tail)): what a record keeps besides the response (its request's
    /// field digests) costs no allocation of its own. `tail` must be under 4 GiB.
    pub(crate) fn with_body_and_tail(headers: &HeaderMap, body: &[u8], tail: &[u8]) -> Self {
        let size = entries_size(headers.iter()) + body.len() + tail.len();
        let mut block = BlockWriter::with_capacity(size);
        block.push_all(headers);
        block.finish_with_body(body, tail)
    }

    /// Every header of `headers`, in order, and a copy of `body` after them, written once
    /// into one exact-size buffer, with the first `Idempotent-Request-Digest` held short
    /// when its value is in the one spelling [`BodyDigest::field`] renders (see
    /// [`REQUEST_DIGEST`]): what a record keeps of a response with a small body. Any other
    /// spelling is kept as written, because a replay must carry the bytes that were
    /// recorded, and rendering it again would not.
    pub(crate) fn of_followed_by(headers: &HeaderMap, body: &[u8]) -> Self {
        let (size, short) = record_layout(headers);
        let mut block = BlockWriter::with_capacity(size + body.len());
        for (at, (name, value)) in headers.iter().enumerate() {
            match &short {
                Some(short) if short.index == at => {
                    block.push_short_digest(&short.digest, value.is_sensitive());
                }
                _ => block.push(name, value),
            }
        }
        block.finish_with_body(body, &[])
    }

    /// The body held after the entries: empty unless the block was made
    /// [`with_body`](Self::with_body). Shares the block's buffer.
    pub(crate) fn body(&self) -> Bytes {
        self.bytes.slice(self.end..self.body_end())
    }

    /// The body held after the entries, as it is held.
    pub(crate) fn body_bytes(&self) -> &[u8] {
        &self.bytes[self.end..self.body_end()]
    }

    /// What is held after the body ([`with_body_and_tail`](Self::with_body_and_tail)):
    /// empty unless the block was made so.
    pub(crate) fn tail(&self) -> &[u8] {
        &self.bytes[self.body_end()..]
    }

    fn body_end(&self) -> usize {
        self.bytes.len() - self.tail as usize
    }

    /// How many headers the block holds.
    pub(crate) fn len(&self) -> usize {
        self.len as usize
    }

    /// Bytes held: the entries, the body and the tail after them.
    pub(crate) fn weight(&self) -> usize {
        self.bytes.len()
    }

    /// The entries, in the order they were recorded.
    pub(crate) fn entries(&self) -> Entries<'_> {
        Entries {
            rest: &self.bytes[..self.end],
            at: 0,
        }
    }

    /// The entry's name, without allocating for this crate's own (custom) names.
    pub(crate) fn name(entry: &Entry<'_>) -> HeaderName {
        match entry.name {
            b"idempotent-request-digest" => IDEMPOTENT_REQUEST_DIGEST.clone(),
            // `server::IDEMPOTENT_REPLAYED`, made here so the ledger never imports the server
            // face; a static name allocates nothing either way.
            b"idempotent-replayed" => HeaderName::from_static("idempotent-replayed"),
            name => HeaderName::from_bytes(name).expect("checked when the block was made"),
        }
    }

    /// The entry's value, sharing the block's bytes (a request digest, rendered).
    pub(crate) fn value(&self, entry: &Entry<'_>) -> HeaderValue {
        let mut value = match self.digest(entry) {
            Some(digest) => digest.header_value(),
            None => HeaderValue::from_maybe_shared(self.bytes.slice(entry.value.clone()))
                .expect("checked when the block was made"),
        };
        value.set_sensitive(entry.sensitive);
        value
    }

    /// The entry's value's bytes (a request digest, rendered).
    pub(crate) fn value_bytes(&self, entry: &Entry<'_>) -> Cow<'_, [u8]> {
        match self.digest(entry) {
            Some(digest) => Cow::Owned(digest.field().to_vec()),
            None => Cow::Borrowed(&self.bytes[entry.value.clone()]),
        }
    }

    /// The digest an entry holds in place of its value, if it does.
    fn digest(&self, entry: &Entry<'_>) -> Option<BodyDigest> {
        if !entry.digest {
            return None;
        }
        let raw = self.bytes[entry.value.clone()]
            .try_into()
            .expect("32 bytes, checked when the block was made");
        Some(BodyDigest::from_bytes(raw))
    }

    /// This block's entries followed by `body`, in one exact-size buffer of their own, with
    /// the first request digest held short (see [`REQUEST_DIGEST`]): the reference
    /// [`of_followed_by`](Self::of_followed_by) is held to, which writes the same bytes once
    /// rather than a block and then a copy of it.
    #[cfg(test)]
    pub(crate) fn followed_by(&self, body: &[u8]) -> Self {
        let entries = &self.bytes[..self.end];
        // Where the digest's entry is, and its 32 bytes. Only a value in the one spelling
        // `BodyDigest::field` renders is shortened: any other is kept as written, because a
        // replay must carry the bytes that were recorded, and rendering it again would not.
        let digest = self
            .entries()
            .find(|entry| {
                entry.name == IDEMPOTENT_REQUEST_DIGEST.as_str().as_bytes() && !entry.digest
            })
            .and_then(|entry| {
                let held = entry.value.start - entry.name.len() - ENTRY_OVERHEAD..entry.value.end;
                let flags = entries[held.start];
                Some((
                    held,
                    flags,
                    crate::digest::sha256_of_field(&self.bytes[entry.value.clone()])?,
                ))
            });
        let short = REQUEST_DIGEST_SIZE;
        let size = match &digest {
            Some((held, ..)) => entries.len() - held.len() + short,
            None => entries.len(),
        };
        let mut bytes = Vec::with_capacity(size + body.len());
        match digest {
            Some((held, flags, digest)) => {
                bytes.extend_from_slice(&entries[..held.start]);
                // No name (the flag names it) and a 32-byte value: the digest itself.
                bytes.extend_from_slice(&[flags | REQUEST_DIGEST, 0, 0, 0, 0, 0, 32]);
                bytes.extend_from_slice(&digest);
                bytes.extend_from_slice(&entries[held.end..]);
            }
            None => bytes.extend_from_slice(entries),
        }
        bytes.extend_from_slice(body);
        Self {
            bytes: Bytes::from(bytes),
            len: self.len,
            tail: 0,
            end: size,
        }
    }

    /// An empty map with room for this block's entries and `more`, up to a bound.
    pub(crate) fn map_sized_for<T>(&self, more: usize) -> HeaderMap<T> {
        HeaderMap::with_capacity((self.len() + more).min(PRESIZED))
    }

    /// The headers as a map, every one of them.
    pub(crate) fn to_map(&self) -> HeaderMap {
        let mut map = self.map_sized_for(0);
        for entry in self.entries() {
            // A block read from a store was checked to hold no more distinct names than a
            // map does (`DistinctNames`), so this never stops early; it never panics either,
            // whatever the map's limits become.
            if map
                .try_append(Self::name(&entry), self.value(&entry))
                .is_err()
            {
                break;
            }
        }
        map
    }

    /// A block of pairs read from a store, each name parsed, each value checked (see
    /// [`is_valid_value`]) and the distinct names counted by the reader (see
    /// [`DistinctNames`]); sensitivity is not stored. `body` is held after them (as
    /// [`with_body`](Self::with_body) does), or empty.
    /// `tail` is held after the body ([`with_body_and_tail`](Self::with_body_and_tail)).
    pub(crate) fn of_checked_pairs(
        pairs: &[(HeaderName, &[u8])],
        body: &[u8],
        tail: &[u8],
    ) -> Self {
        let size: usize = pairs
            .iter()
            .map(|(name, value)| entry_size(name.as_str().len(), value.len()))
            .sum();
        let mut block = BlockWriter::with_capacity(size + body.len() + tail.len());
        // Not `push`: the values are bytes read from the store, checked, not `HeaderValue`s.
        for (name, value) in pairs {
            block.push_checked(name.as_str().as_bytes(), value, false);
        }
        block.finish_with_body(body, tail)
    }
}

impl fmt::Debug for HeaderBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.to_map(), f)
    }
}

/// The entries of a [`HeaderBlock`].
pub(crate) struct Entries<'a> {
    rest: &'a [u8],
    at: usize,
}

impl<'a> Iterator for Entries<'a> {
    type Item = Entry<'a>;

    fn next(&mut self) -> Option<Entry<'a>> {
        let (fixed, rest) = self.rest.split_first_chunk::<ENTRY_OVERHEAD>()?;
        let flags = fixed[0];
        let name_len = usize::from(u16::from_be_bytes([fixed[1], fixed[2]]));
        let value_len = u32::from_be_bytes([fixed[3], fixed[4], fixed[5], fixed[6]]) as usize;
        let (name, rest) = rest.split_at(name_len);
        let start = self.at + ENTRY_OVERHEAD + name_len;
        self.rest = &rest[value_len..];
        self.at = start + value_len;
        let digest = flags & REQUEST_DIGEST != 0;
        Some(Entry {
            name: if digest {
                IDEMPOTENT_REQUEST_DIGEST.as_str().as_bytes()
            } else {
                name
            },
            value: start..start + value_len,
            sensitive: flags & SENSITIVE != 0,
            digest,
        })
    }
}

/// Writes a [`HeaderBlock`] into one buffer of exactly its size: a `Vec` filled to its
/// capacity becomes `Bytes` without a second allocation.
pub(crate) struct BlockWriter {
    bytes: Vec<u8>,
    len: u32,
}

impl BlockWriter {
    /// A writer with room for `size` bytes (see [`entries_size`]).
    pub(crate) fn with_capacity(size: usize) -> Self {
        Self {
            bytes: Vec::with_capacity(size),
            len: 0,
        }
    }

    /// Add a header.
    pub(crate) fn push(&mut self, name: &HeaderName, value: &HeaderValue) {
        self.push_checked(
            name.as_str().as_bytes(),
            value.as_bytes(),
            value.is_sensitive(),
        );
    }

    /// Add every header of `headers`, in order.
    fn push_all(&mut self, headers: &HeaderMap) {
        for (name, value) in headers {
            self.push(name, value);
        }
    }

    /// Add `Idempotent-Request-Digest: sha-256=:<base64>:` for `digest`, held as its 32
    /// bytes (see [`REQUEST_DIGEST`]; [`REQUEST_DIGEST_SIZE`] bytes): what
    /// [`HeaderBlock::of_followed_by`] makes of the rendered field, without rendering it
    /// to decode it again.
    pub(crate) fn push_request_digest(&mut self, digest: &BodyDigest) {
        self.push_short_digest(digest.as_bytes(), false);
    }

    /// Add a request digest held as its 32 bytes (see [`REQUEST_DIGEST`]): no name (the
    /// flag names it), the digest as the value.
    fn push_short_digest(&mut self, digest: &[u8; 32], sensitive: bool) {
        let flags = REQUEST_DIGEST | if sensitive { SENSITIVE } else { 0 };
        self.bytes.extend_from_slice(&[flags, 0, 0, 0, 0, 0, 32]);
        self.bytes.extend_from_slice(digest);
        self.len += 1;
    }

    /// Add a header whose name and value the caller knows to be valid.
    pub(crate) fn push_checked(&mut self, name: &[u8], value: &[u8], sensitive: bool) {
        debug_assert!(HeaderName::from_bytes(name).is_ok());
        debug_assert!(HeaderValue::from_bytes(value).is_ok());
        let name_len = u16::try_from(name.len()).expect("a header name is under 64 KiB");
        let value_len = u32::try_from(value.len()).expect("records are far below 4 GiB");
        let [n0, n1] = name_len.to_be_bytes();
        let [v0, v1, v2, v3] = value_len.to_be_bytes();
        let flags = if sensitive { SENSITIVE } else { 0 };
        self.bytes
            .extend_from_slice(&[flags, n0, n1, v0, v1, v2, v3]);
        self.bytes.extend_from_slice(name);
        self.bytes.extend_from_slice(value);
        self.len += 1;
    }

    /// The block written, `body` and then `tail` after its entries (see
    /// [`HeaderBlock::with_body_and_tail`]).
    #[inline]
    pub(crate) fn finish_with_body(mut self, body: &[u8], tail: &[u8]) -> HeaderBlock {
        let end = self.bytes.len();
        self.bytes.extend_from_slice(body);
        self.bytes.extend_from_slice(tail);
        let mut block = self.finish();
        block.end = end;
        block.tail = u32::try_from(tail.len()).expect("a record's tail is under 4 GiB");
        block
    }

    /// The block written.
    pub(crate) fn finish(self) -> HeaderBlock {
        debug_assert_eq!(self.bytes.len(), self.bytes.capacity(), "sized exactly");
        let end = self.bytes.len();
        HeaderBlock {
            bytes: Bytes::from(self.bytes),
            len: self.len,
            tail: 0,
            end,
        }
    }
}

/// Counts the distinct names of headers read from a store: a `HeaderMap` holds a bounded
/// number of them and panics past it, so a forged record must be refused before a replay
/// builds its map. (Values of one name are not bounded.)
pub(crate) struct DistinctNames(HeaderMap<()>);

impl Default for DistinctNames {
    /// Sized as the maps replays build ([`HeaderBlock::map_sized_for`]), so that both grow
    /// alike.
    fn default() -> Self {
        Self(HeaderMap::with_capacity(PRESIZED))
    }
}

impl DistinctNames {
    /// Count `name`; `false` once there are more than a `HeaderMap` holds.
    pub(crate) fn admit(&mut self, name: &HeaderName) -> bool {
        self.0.try_append(name, ()).is_ok()
    }
}

/// The first request digest of a map, held short in a record: its index among the map's
/// entries, and its 32 bytes.
struct ShortDigest {
    index: usize,
    digest: [u8; 32],
}

/// How `headers` are laid out in a record's block ([`HeaderBlock::of_followed_by`]): the
/// bytes they take, and the request digest held short there, if one is. Both are found in
/// one pass, so that the block is written once, at its size.
fn record_layout(headers: &HeaderMap) -> (usize, Option<ShortDigest>) {
    let mut size = 0;
    let mut short = None;
    let mut seen = false;
    for (index, (name, value)) in headers.iter().enumerate() {
        if !seen && *name == IDEMPOTENT_REQUEST_DIGEST {
            // Only the first: as a replay renders it, the others are kept as written.
            seen = true;
            if let Some(digest) = crate::digest::sha256_of_field(value.as_bytes()) {
                short = Some(ShortDigest { index, digest });
                size += REQUEST_DIGEST_SIZE;
                continue;
            }
        }
        size += entry_size(name.as_str().len(), value.len());
    }
    (size, short)
}

/// Bytes an entry of a name and a value of these lengths takes in a block.
pub(crate) fn entry_size(name_len: usize, value_len: usize) -> usize {
    ENTRY_OVERHEAD + name_len + value_len
}

/// Bytes these headers take in a block.
pub(crate) fn entries_size<'h>(
    headers: impl Iterator<Item = (&'h HeaderName, &'h HeaderValue)>,
) -> usize {
    headers
        .map(|(name, value)| entry_size(name.as_str().len(), value.len()))
        .sum()
}

/// Whether `value` is a valid header value (`HeaderValue::from_bytes`' rule), without
/// copying it.
pub(crate) fn is_valid_value(value: &[u8]) -> bool {
    value.iter().all(|&b| b == b'\t' || (b >= 32 && b != 127))
}

#[cfg(test)]
mod tests;
