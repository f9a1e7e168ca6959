//! What a call that reuses a key with another message is told: which top-level fields of
//! its message changed, by name, never by value.
//!
//! A method's input message is named field by field in the descriptor set
//! ([`Methods::from_descriptor_set`](super::Methods::from_descriptor_set)). The server layer
//! digests each top-level field of a guarded call's message (all of a repeated field's
//! occurrences, in order; a `map` field's entries as a multiset, since prost writes a map
//! in its hash order) and records the digests with the answer. A later call under the key
//! whose message differs has its own message digested the same way, and the fields whose
//! digests differ (or that one message has and the other lacks) are named in its
//! `FAILED_PRECONDITION`. A nested message is named by the top-level field that holds it.

use std::collections::BTreeMap;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use sha2::{Digest, Sha256};

use super::key::single_message;
use super::protowire::{fields, Value};

/// The top-level fields of a method's input message, by number: each one's name, and
/// whether it is a `map`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct MessageFields {
    by_number: BTreeMap<u32, Field>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Field {
    name: Box<str>,
    map: bool,
}

impl MessageFields {
    /// The fields `(number, name, is a map)`.
    pub(super) fn new(fields: impl IntoIterator<Item = (u32, String, bool)>) -> Self {
        Self {
            by_number: fields
                .into_iter()
                .map(|(number, name, map)| {
                    let name = name.into_boxed_str();
                    (number, Field { name, map })
                })
                .collect(),
        }
    }

    /// The name of field `number`; a field the descriptor does not know (a newer client's)
    /// by its number.
    fn name(&self, number: u32) -> String {
        match self.by_number.get(&number) {
            Some(field) => field.name.to_string(),
            None => number.to_string(),
        }
    }

    fn is_map(&self, number: u32) -> bool {
        self.by_number.get(&number).is_some_and(|field| field.map)
    }
}

/// Bytes kept of each field's SHA-256: enough to tell two values apart. Whether a message
/// changed at all is the fingerprint's call; a collision here could at worst leave a
/// changed field unnamed.
const DIGEST_LEN: usize = 8;

/// A digest of each top-level field of a message, by field number, in number order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct MessageDigests(Vec<(u32, [u8; DIGEST_LEN])>);

/// A guarded call's digests, in its request's extensions: the layer puts them there for
/// the service behind the face, which records them with the answer.
#[derive(Clone, Debug)]
pub(super) struct RequestDigests(pub(super) MessageDigests);

impl MessageDigests {
    /// The digests of the single message of a unary request `body` (its 5-byte gRPC
    /// prefix, then the message); `None` when it is compressed, not exactly one message, or
    /// not protobuf: such a message's fields are not named.
    pub(super) fn of_request(body: &Bytes, names: &MessageFields) -> Option<Self> {
        Self::of_message(single_message(body).ok()?, names)
    }

    /// The digests of the top-level fields of `message`.
    pub(super) fn of_message(message: Bytes, names: &MessageFields) -> Option<Self> {
        let mut occurrences: BTreeMap<u32, Vec<Vec<u8>>> = BTreeMap::new();
        for (number, value) in fields(message).ok()? {
            let number = u32::try_from(number).ok()?;
            occurrences
                .entry(number)
                .or_default()
                .push(occurrence(&value));
        }
        let digests = occurrences
            .into_iter()
            .map(|(number, mut each)| {
                if names.is_map(number) {
                    // A map's entries, whatever order the encoder wrote them in.
                    each.sort_unstable();
                }
                let mut hasher = Sha256::new();
                for one in &each {
                    hasher.update((one.len() as u64).to_be_bytes());
                    hasher.update(one);
                }
                let full: [u8; 32] = hasher.finalize().into();
                let mut digest = [0; DIGEST_LEN];
                digest.copy_from_slice(&full[..DIGEST_LEN]);
                (number, digest)
            })
            .collect();
        Some(Self(digests))
    }

    /// The names of the fields that differ between these digests and `new`'s (changed,
    /// added or removed), in field-number order.
    pub(super) fn changed(&self, new: &Self, names: &MessageFields) -> Vec<String> {
        let mut changed = Vec::new();
        let (mut old, mut new) = (self.0.iter().peekable(), new.0.iter().peekable());
        loop {
            let number = match (old.peek(), new.peek()) {
                (None, None) => break,
                (Some((a, x)), Some((b, y))) if a == b => {
                    let (number, differs) = (*a, x != y);
                    old.next();
                    new.next();
                    if !differs {
                        continue;
                    }
                    number
                }
                (Some((a, _)), Some((b, _))) if a > b => {
                    let number = *b;
                    new.next();
                    number
                }
                (Some((a, _)), _) => {
                    let number = *a;
                    old.next();
                    number
                }
                (None, Some((b, _))) => {
                    let number = *b;
                    new.next();
                    number
                }
            };
            changed.push(names.name(number));
        }
        changed
    }

    /// These digests as the recorded body carries them: a `u32` count, then each field's
    /// number (`u32`, big-endian) and digest.
    pub(super) fn write(&self, out: &mut BytesMut) {
        out.put_u32(u32::try_from(self.0.len()).unwrap_or(u32::MAX));
        for (number, digest) in &self.0 {
            out.put_u32(*number);
            out.put_slice(digest);
        }
    }

    /// Digests [`write`](Self::write) wrote at the start of `body`, taken off it; `None`
    /// if they are cut short.
    pub(super) fn read(body: &mut Bytes) -> Option<Self> {
        if body.remaining() < 4 {
            return None;
        }
        let count = body.get_u32() as usize;
        if body.remaining() / (4 + DIGEST_LEN) < count {
            return None;
        }
        let mut digests = Vec::with_capacity(count);
        for _ in 0..count {
            let number = body.get_u32();
            let mut digest = [0; DIGEST_LEN];
            body.copy_to_slice(&mut digest);
            digests.push((number, digest));
        }
        Some(Self(digests))
    }
}

/// One occurrence of a field as it is digested: its wire type, then its value (a varint
/// by its value, so that an over-long encoding of the same number is the same value).
fn occurrence(value: &Value) -> Vec<u8> {
    match value {
        Value::Varint(number) => {
            let mut out = vec![0];
            out.extend_from_slice(&number.to_le_bytes());
            out
        }
        Value::Delimited(bytes) => {
            let mut out = Vec::with_capacity(1 + bytes.len());
            out.push(2);
            out.extend_from_slice(bytes);
            out
        }
        Value::Fixed(bytes) => {
            let mut out = Vec::with_capacity(1 + bytes.len());
            out.push(if bytes.len() == 8 { 1 } else { 5 });
            out.extend_from_slice(bytes);
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `labels` (4) is a map; `order_id` (2), `amount_cents` (3) and `tags` (5, repeated
    /// string) are not.
    fn names() -> MessageFields {
        MessageFields::new([
            (1, "request_id".to_owned(), false),
            (2, "order_id".to_owned(), false),
            (3, "amount_cents".to_owned(), false),
            (4, "labels".to_owned(), true),
            (5, "tags".to_owned(), false),
        ])
    }

    fn tag(number: u8, wire_type: u8) -> u8 {
        (number << 3) | wire_type
    }

    fn string(number: u8, value: &str) -> Vec<u8> {
        let mut out = vec![tag(number, 2), value.len() as u8];
        out.extend_from_slice(value.as_bytes());
        out
    }

    fn entry(key: &str, value: &str) -> Vec<u8> {
        let mut inner = string(1, key);
        inner.extend(string(2, value));
        let mut out = vec![tag(4, 2), inner.len() as u8];
        out.extend(inner);
        out
    }

    fn message(parts: &[Vec<u8>]) -> Bytes {
        Bytes::from(parts.concat())
    }

    fn digests(parts: &[Vec<u8>]) -> MessageDigests {
        MessageDigests::of_message(message(parts), &names()).unwrap()
    }

    #[test]
    fn the_entries_of_a_map_in_another_order_change_no_field() {
        let first = digests(&[string(2, "o_1"), entry("a", "1"), entry("b", "2")]);
        let again = digests(&[string(2, "o_1"), entry("b", "2"), entry("a", "1")]);

        assert_eq!(first.changed(&again, &names()), Vec::<String>::new());
    }

    #[test]
    fn a_changed_map_entry_names_the_map() {
        let first = digests(&[entry("a", "1"), entry("b", "2")]);
        let again = digests(&[entry("b", "2"), entry("a", "9")]);

        assert_eq!(first.changed(&again, &names()), ["labels"]);
    }

    #[test]
    fn a_changed_repeated_element_or_order_names_the_field() {
        let first = digests(&[string(5, "x"), string(5, "y")]);
        let changed = digests(&[string(5, "x"), string(5, "z")]);
        let reordered = digests(&[string(5, "y"), string(5, "x")]);

        assert_eq!(first.changed(&changed, &names()), ["tags"]);
        // A repeated field's order is its value (it is no map).
        assert_eq!(first.changed(&reordered, &names()), ["tags"]);
    }

    #[test]
    fn fields_changed_added_and_removed_are_named_in_number_order_unknown_ones_by_number() {
        let first = digests(&[string(2, "o_1"), vec![tag(3, 0), 100], string(5, "x")]);
        let again = digests(&[
            string(1, "r"),
            string(2, "o_1"),
            vec![tag(3, 0), 101],
            vec![tag(9, 0), 1],
        ]);

        assert_eq!(
            first.changed(&again, &names()),
            ["request_id", "amount_cents", "tags", "9"]
        );
    }

    #[test]
    fn a_varint_written_over_long_is_the_same_value() {
        let first = digests(&[vec![tag(3, 0), 0x05]]);
        let again = digests(&[vec![tag(3, 0), 0x85, 0x00]]);

        assert_eq!(first, again);
    }

    #[test]
    fn digests_written_read_back_the_same_and_cut_short_are_refused() {
        let first = digests(&[string(2, "o_1"), vec![tag(3, 0), 100], entry("a", "1")]);
        let mut out = BytesMut::new();
        first.write(&mut out);
        out.put_slice(b"rest");
        let mut body = out.freeze();

        assert_eq!(MessageDigests::read(&mut body), Some(first));
        assert_eq!(body.as_ref(), b"rest");
        let mut short = Bytes::from_static(&[0, 0, 0, 2, 0, 0, 0, 1]);
        assert_eq!(MessageDigests::read(&mut short), None);
    }

    #[test]
    fn a_compressed_or_malformed_request_has_no_digests() {
        let compressed = Bytes::from_static(&[1, 0, 0, 0, 2, 0x18, 0x05]);
        let malformed = Bytes::from_static(&[0, 0, 0, 0, 1, 0x1a]);
        let plain = Bytes::from_static(&[0, 0, 0, 0, 2, 0x18, 0x05]);

        assert!(MessageDigests::of_request(&compressed, &names()).is_none());
        assert!(MessageDigests::of_request(&malformed, &names()).is_none());
        assert!(MessageDigests::of_request(&plain, &names()).is_some());
    }
}
