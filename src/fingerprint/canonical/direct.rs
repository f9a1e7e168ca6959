//! Canonical JSON written straight from a `Serialize` value, without building a
//! `serde_json::Value` first: the same bytes as `to_value` followed by [`write`](super::write),
//! in one buffer.
//!
//! An object's entries are written in the order they come, each remembered as the byte
//! range of its key and of the whole entry; when the object ends its keys are checked to be
//! in order, and only if they are not are the entries moved into order (a copy of the
//! object's bytes, then each entry copied back in key order; for the outermost object, as
//! the bytes are copied out). Anything this writer does not spell exactly as the `Value`
//! path would (a key needing escapes, a repeated key, an integer out of `i64`/`u64`, a
//! float key or a key of no scalar kind, serde_json's own private types, any error) makes
//! it give up: the caller then takes the `Value` path, so the bytes never differ from it.

use std::fmt;

use bytes::Bytes;
use serde::ser::{self, Serialize};

use super::write_string;

mod key;
#[cfg(test)]
mod tests;
mod value;

use key::Key;

/// The writer gave up: take the `Value` path.
#[derive(Debug)]
pub(super) struct GiveUp;

impl fmt::Display for GiveUp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("not written directly")
    }
}

impl std::error::Error for GiveUp {}

impl ser::Error for GiveUp {
    fn custom<T: fmt::Display>(_: T) -> Self {
        GiveUp
    }
}

type Result<T = ()> = std::result::Result<T, GiveUp>;

/// One object entry written: `"key":value` is `out[key..end]`, the key's own bytes (its
/// text, unescaped as it needs no escapes) `out[key + 1..quote]`.
#[derive(Clone, Copy)]
struct Entry {
    key: usize,
    /// Where the key's closing quote is.
    quote: usize,
    end: usize,
}

/// The output and the scratch space of objects that need reordering; kept between calls
/// so that a steady stream of calls allocates nothing here.
#[derive(Default)]
pub(super) struct Writer {
    out: Vec<u8>,
    /// The entries of every object still open, innermost last.
    entries: Vec<Entry>,
    /// A copy of the object being reordered.
    spare: Vec<u8>,
    /// The value is an object whose entries are the first this many, sorted, but whose
    /// bytes are in the order written: it is put in order as it is copied out (one copy
    /// rather than the two of a rewrite, then a third).
    unordered: Option<usize>,
}

impl Writer {
    /// Clears the buffers for a new value (keeping their memory).
    pub(super) fn clear(&mut self) {
        self.out.clear();
        self.entries.clear();
        self.unordered = None;
    }

    /// Gives back memory one unusually large value made the buffers hold.
    pub(super) fn trim(&mut self, keep: usize) {
        for buffer in [&mut self.out, &mut self.spare] {
            if buffer.capacity() > keep {
                *buffer = Vec::new();
            }
        }
        if self.entries.capacity() > keep / 16 {
            self.entries = Vec::new();
        }
    }

    fn open_object(&mut self) -> Object<'_> {
        self.out.push(b'{');
        let start = self.out.len();
        let base = self.entries.len();
        Object {
            writer: self,
            start,
            base,
            closes: 1,
        }
    }

    /// `{"variant":` ... closed by the compound's end with one more `}`.
    fn open_variant(&mut self, variant: &str) {
        self.out.push(b'{');
        write_string(variant, &mut self.out);
        self.out.push(b':');
    }

    /// Sorts the entries of the object whose bytes start at `start` (after its `{`) by key,
    /// answering whether any moved; gives up on a repeated key (the `Value` path keeps
    /// only its last value).
    fn order(&mut self, base: usize) -> Result<bool> {
        let out = &self.out;
        let key = |e: &Entry| &out[e.key + 1..e.quote];
        let entries = &mut self.entries[base..];
        if entries.len() <= SMALL_OBJECT {
            return insertion_sort(entries, key);
        }
        let sorted = entries.is_sorted_by(|a, b| key(a) < key(b));
        if !sorted {
            entries.sort_unstable_by(|a, b| key(a).cmp(key(b)));
        }
        if entries
            .windows(2)
            .any(|pair| key(&pair[0]) == key(&pair[1]))
        {
            return Err(GiveUp);
        }
        Ok(!sorted)
    }

    /// Rewrites the object whose bytes start at `start` with its entries (from `base`) in
    /// their sorted order.
    fn rewrite(&mut self, start: usize, base: usize) {
        let Self {
            out,
            entries,
            spare,
            ..
        } = self;
        spare.clear();
        spare.extend_from_slice(&out[start..]);
        out.truncate(start);
        for (i, entry) in entries[base..].iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(&spare[entry.key - start..entry.end - start]);
        }
    }

    /// The bytes written, in a buffer of their own of exactly their size. An outermost
    /// object left unordered is put in order here, as it is copied out.
    pub(super) fn finish(&self) -> Bytes {
        let Some(count) = self.unordered else {
            return Bytes::copy_from_slice(&self.out);
        };
        let mut bytes = Vec::with_capacity(self.out.len());
        bytes.push(b'{');
        for (i, entry) in self.entries[..count].iter().enumerate() {
            if i > 0 {
                bytes.push(b',');
            }
            bytes.extend_from_slice(&self.out[entry.key..entry.end]);
        }
        bytes.push(b'}');
        debug_assert_eq!(bytes.len(), self.out.len());
        Bytes::from(bytes)
    }

    fn number(&mut self, number: impl Serialize) {
        serde_json::to_writer(&mut self.out, &number).expect("writing to a Vec never fails");
    }
}

/// Objects up to this many entries are sorted by insertion: already in order (a struct
/// declaring its fields sorted, a sorted map), that is one comparison per entry, which also
/// finds a repeated key (it ends up next to its twin), so nothing else walks the entries.
const SMALL_OBJECT: usize = 16;

/// Sorts `entries` by `key`, answering whether any moved; gives up on a repeated key.
fn insertion_sort<'k>(entries: &mut [Entry], key: impl Fn(&Entry) -> &'k [u8]) -> Result<bool> {
    let mut moved = false;
    for i in 1..entries.len() {
        let entry = entries[i];
        let mut at = i;
        while at > 0 {
            match compare(key(&entries[at - 1]), key(&entry)) {
                std::cmp::Ordering::Less => break,
                std::cmp::Ordering::Equal => return Err(GiveUp),
                std::cmp::Ordering::Greater => {
                    entries[at] = entries[at - 1];
                    at -= 1;
                }
            }
        }
        if at != i {
            entries[at] = entry;
            moved = true;
        }
    }
    Ok(moved)
}

/// Byte order of two keys, by their first bytes alone when those differ (keys mostly do):
/// no call for the whole comparison.
fn compare(a: &[u8], b: &[u8]) -> std::cmp::Ordering {
    match (a.first(), b.first()) {
        (Some(x), Some(y)) if x != y => x.cmp(y),
        _ => a.cmp(b),
    }
}

/// An open array: its elements so far.
pub(super) struct Array<'w> {
    writer: &'w mut Writer,
    first: bool,
    /// `]` then this many `}` (a tuple variant's wrapping object).
    closes: usize,
}

impl Array<'_> {
    fn element<T: ?Sized + Serialize>(&mut self, value: &T) -> Result {
        if !std::mem::take(&mut self.first) {
            self.writer.out.push(b',');
        }
        value.serialize(&mut *self.writer)
    }

    fn close(self) -> Result {
        self.writer.out.push(b']');
        for _ in 0..self.closes {
            self.writer.out.push(b'}');
        }
        Ok(())
    }
}

/// An open object: where its bytes start and where its entries start.
pub(super) struct Object<'w> {
    writer: &'w mut Writer,
    start: usize,
    base: usize,
    /// How many `}` close it (two for a struct variant's wrapping object).
    closes: usize,
}

impl Object<'_> {
    fn key<T: ?Sized + Serialize>(&mut self, key: &T) -> Result {
        let out = &mut self.writer.out;
        if self.writer.entries.len() > self.base {
            out.push(b',');
        }
        let at = out.len();
        key.serialize(Key(&mut *out))?;
        let quote = out.len() - 2;
        self.writer.entries.push(Entry {
            key: at,
            quote,
            end: out.len(),
        });
        Ok(())
    }

    fn value<T: ?Sized + Serialize>(&mut self, value: &T) -> Result {
        value.serialize(&mut *self.writer)?;
        let end = self.writer.out.len();
        if let Some(entry) = self.writer.entries.last_mut() {
            entry.end = end;
        }
        Ok(())
    }

    fn close(self) -> Result {
        let writer = self.writer;
        if writer.order(self.base)? {
            // The outermost value (nothing before its `{`): left for `finish`.
            if self.start == 1 {
                writer.unordered = Some(writer.entries.len());
                writer.out.push(b'}');
                return Ok(());
            }
            writer.rewrite(self.start, self.base);
        }
        writer.entries.truncate(self.base);
        for _ in 0..self.closes {
            writer.out.push(b'}');
        }
        Ok(())
    }
}
