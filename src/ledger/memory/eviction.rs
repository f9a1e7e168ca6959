//! The eviction order of a [`MemoryStore`](super::MemoryStore): completed records by the end
//! of their protected window.
//!
//! A record's window ends a fixed time after it completes, so records arrive in this order
//! almost always (a store shared by layers with different windows is the exception). They
//! go to the back of a sorted deque when they land among its last few entries, which costs a
//! push where a search tree costs a descent, a node split now and then and a rebalance on
//! every pop; the rest go to a search tree beside it. The front of the order is the lesser
//! of the two fronts.
//!
//! Each entry keeps the bytes its record weighed when it entered, so the store can tell how
//! many bytes are still inside their protected window (the pressure a tenant's share is
//! judged by) by the bytes themselves: a count of records, scaled, reads one large record
//! past its window beside many small ones inside theirs as a store nearly all protected.
//! That reading is taken on every claim or completion that would take a scope past its
//! share, so it must stay cheap at a million records: the index keeps the bytes of the
//! deque's entries whose window ended by the latest look, and a new look only adds those
//! that ended since (a binary search, then the new ones), never sums the deque again.

use std::collections::{BTreeMap, VecDeque};

use super::record::Stamp;
use crate::ledger::LedgerKey;

/// Where a record stands in the order: the end of its protected window, as the record
/// holds it (no conversion to an `Instant` on the way in or out), then its sequence number
/// (unique per record).
pub(super) type Place = (Stamp, u64);

/// How far from the back of the deque a record may land and still be put there; further
/// in, moving the entries behind it would cost more than the tree.
const NEAR_BACK: usize = 32;

#[derive(Debug, Default)]
pub(super) struct EvictionIndex {
    /// In order, with no gaps: every entry here is before every later one.
    sorted: VecDeque<(Place, Entry)>,
    /// The records that arrived out of order.
    overflow: BTreeMap<Place, Entry>,
    /// The bytes of every entry of `sorted`.
    sorted_bytes: u64,
    /// The latest time the protected bytes were looked at (see
    /// [`protected_bytes_after`](Self::protected_bytes_after)).
    ended_by: Stamp,
    /// The bytes of the entries of `sorted` whose window ended by `ended_by`: kept by every
    /// insert and removal, so that a look only adds the entries that ended since the last.
    ended_bytes: u64,
}

/// A record in the order: its key, and the bytes it weighed when it entered.
#[derive(Clone, Copy, Debug)]
struct Entry {
    key: LedgerKey,
    weight: u64,
}

impl EvictionIndex {
    /// Put the record `key`, of `weight` bytes, in the order at `place`.
    pub(super) fn insert(&mut self, place: Place, key: LedgerKey, weight: u64) {
        let entry = Entry { key, weight };
        let at = self.sorted.len() - self.back_run_after(place);
        if self.sorted.len() - at <= NEAR_BACK {
            self.sorted.insert(at, (place, entry));
            self.count_in_deque(place, weight);
        } else {
            self.overflow.insert(place, entry);
        }
    }

    /// How many entries at the back of the deque come after `place` (counted up to one
    /// past [`NEAR_BACK`]).
    fn back_run_after(&self, place: Place) -> usize {
        self.sorted
            .iter()
            .rev()
            .take(NEAR_BACK + 1)
            .take_while(|(entry, _)| *entry > place)
            .count()
    }

    pub(super) fn remove(&mut self, place: Place) {
        // Evictions take the front: no search for it.
        let from_deque = if self
            .sorted
            .front()
            .is_some_and(|(front, _)| *front == place)
        {
            self.sorted.pop_front().map(|(_, entry)| entry)
        } else if self.overflow.remove(&place).is_some() {
            None
        } else {
            self.sorted
                .binary_search_by(|(entry, _)| entry.cmp(&place))
                .ok()
                .and_then(|at| self.sorted.remove(at))
                .map(|(_, entry)| entry)
        };
        if let Some(entry) = from_deque {
            self.uncount_in_deque(place, entry.weight);
            self.give_back_room();
        }
    }

    /// An entry of `weight` bytes at `place` entered the deque.
    fn count_in_deque(&mut self, place: Place, weight: u64) {
        self.sorted_bytes += weight;
        if place.0 <= self.ended_by {
            self.ended_bytes += weight;
        }
    }

    /// An entry of `weight` bytes at `place` left the deque.
    fn uncount_in_deque(&mut self, place: Place, weight: u64) {
        self.sorted_bytes -= weight;
        if place.0 <= self.ended_by {
            self.ended_bytes -= weight;
        }
    }

    /// The first record in the order, if its window ended by `now`: where it stands and its
    /// key, left in the order. An evicting caller takes it out ([`remove`](Self::remove))
    /// only once the record has left its shard, so that a caller looking for room meanwhile
    /// still sees that some is being made, and waits for it on the shard's lock instead of
    /// finding the order empty and refusing.
    pub(super) fn first_ended_by(&self, now: Stamp) -> Option<(Place, LedgerKey)> {
        let deque = self.sorted.front();
        let tree = self.overflow.first_key_value();
        let (place, key) = match (deque, tree) {
            (Some((deque, _)), Some((tree, entry))) if tree < deque => (*tree, entry.key),
            (Some((deque, entry)), _) => (*deque, entry.key),
            (None, Some((tree, entry))) => (*tree, entry.key),
            (None, None) => return None,
        };
        (place.0 <= now).then_some((place, key))
    }

    /// The first record in the order, if its window ended by `now`: taken out.
    #[cfg(test)]
    pub(super) fn pop_ended_by(&mut self, now: Stamp) -> Option<(LedgerKey, u64)> {
        let (place, key) = self.first_ended_by(now)?;
        self.remove(place);
        Some((key, place.1))
    }

    /// When the first record in the order leaves its protected window.
    pub(super) fn first_end(&self) -> Option<Stamp> {
        let deque = self.sorted.front().map(|(place, _)| place.0);
        let tree = self.overflow.first_key_value().map(|(place, _)| place.0);
        match (deque, tree) {
            (Some(deque), Some(tree)) => Some(deque.min(tree)),
            (one, other) => one.or(other),
        }
    }

    /// The bytes of the records still inside their protected window at `now`, as they
    /// weighed when they entered.
    ///
    /// For the deque, the bytes whose window ended are kept from the latest look
    /// (`ended_by`): a later look adds the entries that ended since (found by a binary
    /// search), so at a store's steady state a look costs a search and the few records
    /// that left their window meanwhile. A look from a moment before the latest (callers
    /// race to the lock) takes back the few that ended in between. The tree is small, and
    /// walked.
    pub(super) fn protected_bytes_after(&mut self, now: Stamp) -> u64 {
        if now > self.ended_by {
            self.ended_bytes += self.deque_bytes_ending_in(self.ended_by, now);
            self.ended_by = now;
        }
        let ended = self.ended_bytes - self.deque_bytes_ending_in(now, self.ended_by);
        let in_tree: u64 = self
            .overflow
            .iter()
            .filter(|(place, _)| place.0 > now)
            .map(|(_, entry)| entry.weight)
            .sum();
        self.sorted_bytes - ended + in_tree
    }

    /// The bytes of the deque's entries whose window ends after `after`, by `by`.
    fn deque_bytes_ending_in(&self, after: Stamp, by: Stamp) -> u64 {
        if by <= after {
            return 0;
        }
        let first = self.sorted.partition_point(|(place, _)| place.0 <= after);
        self.sorted
            .range(first..)
            .take_while(|(place, _)| place.0 <= by)
            .map(|(_, entry)| entry.weight)
            .sum()
    }

    /// A deque that grew for a burst keeps its room; give most of it back once it holds a
    /// quarter of it, as the tree it replaces freed its nodes.
    fn give_back_room(&mut self) {
        let (len, capacity) = (self.sorted.len(), self.sorted.capacity());
        if capacity > 1024 && len < capacity / 4 {
            self.sorted.shrink_to(len * 2);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.sorted.len() + self.overflow.len()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[derive(Clone, Debug)]
    enum Op {
        /// Insert a record whose window ends this many ms after the start, of this weight.
        Insert(u16, u32),
        /// Remove the n-th live record (modulo their number).
        Remove(u16),
        /// Pop what ended by this many ms after the start.
        Pop(u16),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            // Mostly in order (a window after a clock that moves on), sometimes not.
            4 => (0u16..2000, 0u32..100_000).prop_map(|(ms, weight)| Op::Insert(ms, weight)),
            1 => any::<u16>().prop_map(Op::Remove),
            2 => (0u16..2000).prop_map(Op::Pop),
        ]
    }

    proptest! {
        /// Against a plain search tree, the reference: the same records pop in the same
        /// order, whatever mix of in-order and out-of-order inserts and removals, and the
        /// bytes still protected at any time are the sum of their records' weights.
        #[test]
        fn pops_in_the_order_of_a_search_tree(
            ops in proptest::collection::vec(op(), 0..400),
            looks in proptest::collection::vec(0u16..2100, 8),
        ) {
            let at = |ms: u16| Stamp(u64::from(ms) * 1_000_000);
            let mut index = EvictionIndex::default();
            let mut model: BTreeMap<Place, LedgerKey> = BTreeMap::new();
            let mut weights: BTreeMap<Place, u64> = BTreeMap::new();
            let mut clock = 0u16;
            for (seq, op) in (0u64..).zip(ops) {
                match op {
                    Op::Insert(ms, weight) => {
                        // The clock moves on; most windows end after everything before.
                        clock = clock.saturating_add(1);
                        let end = if ms % 5 == 0 { ms } else { clock.saturating_add(ms % 50) };
                        let key = LedgerKey::server("", &seq.to_string());
                        index.insert((at(end), seq), key, u64::from(weight));
                        model.insert((at(end), seq), key);
                        weights.insert((at(end), seq), u64::from(weight));
                    }
                    Op::Remove(n) => {
                        if let Some(place) = model.keys().nth(usize::from(n) % model.len().max(1)).copied() {
                            index.remove(place);
                            model.remove(&place);
                            weights.remove(&place);
                        }
                    }
                    Op::Pop(ms) => {
                        let now = at(ms);
                        let expected = match model.first_key_value() {
                            Some((place, _)) if place.0 <= now => {
                                weights.pop_first();
                                model.pop_first().map(|((_, seq), key)| (key, seq))
                            }
                            _ => None,
                        };
                        prop_assert_eq!(index.pop_ended_by(now), expected);
                    }
                }
                prop_assert_eq!(index.len(), model.len());
                for look in &looks {
                    let now = at(*look);
                    let protected: u64 = weights
                        .iter()
                        .filter(|(place, _)| place.0 > now)
                        .map(|(_, weight)| weight)
                        .sum();
                    prop_assert_eq!(index.protected_bytes_after(now), protected);
                }
            }
        }
    }

    #[test]
    fn a_drained_deque_gives_its_room_back() {
        let start = Stamp(0);
        let mut index = EvictionIndex::default();
        for seq in 0..100_000u64 {
            index.insert((start, seq), LedgerKey::server("", &seq.to_string()), 1);
        }
        let grown = index.sorted.capacity();
        while index.sorted.len() > 10 {
            index.pop_ended_by(start).expect("every window ended");
        }
        assert!(
            index.sorted.capacity() < grown / 100,
            "{} of {grown}",
            index.sorted.capacity()
        );
    }

    #[test]
    fn records_in_order_never_reach_the_tree() {
        let mut index = EvictionIndex::default();
        for seq in 0..10_000u64 {
            let key = LedgerKey::server("", &seq.to_string());
            index.insert((Stamp(seq / 3 * 1_000_000), seq), key, 1);
        }
        assert!(index.overflow.is_empty());
        assert_eq!(index.sorted.len(), 10_000);
    }
}
