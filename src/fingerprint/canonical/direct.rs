//! Canonical JSON written straight from a `Serialize` value, without building a
//! `serde_json::Value` first: the same bytes as `to_value` followed by [`write`](super::write),
//! in one buffer.
//!
//! An object's entries are written in the order they come; when they end, their keys are
//! checked to be in order, and only if they are not are the entries moved into order (a
//! copy of the object's bytes, then each entry copied back in key order). Anything this
//! writer does not spell exactly as the `Value` path would (a key needing escapes, a
//! repeated key, an integer out of `i64`/`u64`, a float or non-string key, serde_json's own
//! private types, any error) makes it give up: the caller then takes the `Value` path, so
//! the bytes never differ from it.

use std::fmt;

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
    pub(super) out: Vec<u8>,
    /// The entries of every object still open, innermost last.
    entries: Vec<Entry>,
    /// A copy of the object being reordered.
    spare: Vec<u8>,
}

impl Writer {
    /// Clears the buffers for a new value (keeping their memory).
    pub(super) fn clear(&mut self) {
        self.out.clear();
        self.entries.clear();
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

    /// Puts the entries of the object whose bytes start at `start` (after its `{`) in key
    /// order; gives up on a repeated key (the `Value` path keeps only its last value).
    fn order(&mut self, start: usize, base: usize) -> Result {
        let Self {
            out,
            entries,
            spare,
        } = self;
        let key = |e: &Entry| &out[e.key + 1..e.quote];
        let entries = &mut entries[base..];
        let moved = if entries.len() <= SMALL_OBJECT {
            insertion_sort(entries, key)?
        } else {
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
            !sorted
        };
        if !moved {
            return Ok(());
        }
        spare.clear();
        spare.extend_from_slice(&out[start..]);
        out.truncate(start);
        for (i, entry) in entries.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(&spare[entry.key - start..entry.end - start]);
        }
        Ok(())
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
            match key(&entries[at - 1]).cmp(key(&entry)) {
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
        let quote = out.len() - 1;
        out.push(b':');
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
        self.writer.order(self.start, self.base)?;
        self.writer.entries.truncate(self.base);
        for _ in 0..self.closes {
            self.writer.out.push(b'}');
        }
        Ok(())
    }
}
