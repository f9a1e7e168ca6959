//! The eviction order of a [`MemoryStore`](super::MemoryStore): completed records by the end
//! of their protected window.
//!
//! A record's window ends a fixed time after it completes, so records arrive in this order
//! almost always (a store shared by layers with different windows is the exception). They
//! go to the back of a sorted deque when they land among its last few entries, which costs a
//! push where a search tree costs a descent, a node split now and then and a rebalance on
//! every pop; the rest go to a search tree beside it. The front of the order is the lesser
//! of the two fronts.

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
    sorted: VecDeque<(Place, LedgerKey)>,
    /// The records that arrived out of order.
    overflow: BTreeMap<Place, LedgerKey>,
}

impl EvictionIndex {
    pub(super) fn insert(&mut self, place: Place, key: LedgerKey) {
        let at = self.sorted.len() - self.back_run_after(place);
        if self.sorted.len() - at <= NEAR_BACK {
            self.sorted.insert(at, (place, key));
        } else {
            self.overflow.insert(place, key);
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
        if self
            .sorted
            .front()
            .is_some_and(|(front, _)| *front == place)
        {
            self.sorted.pop_front();
            self.give_back_room();
            return;
        }
        if self.overflow.remove(&place).is_some() {
            return;
        }
        if let Ok(at) = self.sorted.binary_search_by(|(entry, _)| entry.cmp(&place)) {
            self.sorted.remove(at);
            self.give_back_room();
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
            (Some((deque, _)), Some((tree, key))) if tree < deque => (*tree, *key),
            (Some((deque, key)), _) => (*deque, *key),
            (None, Some((tree, key))) => (*tree, *key),
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

    /// How many records the order holds, and how many of them left their protected window
    /// by `now`: a binary search in the deque, a walk of the (small) tree's ended front.
    pub(super) fn ended_by(&self, now: Stamp) -> (usize, usize) {
        let held = self.sorted.len() + self.overflow.len();
        let in_deque = self.sorted.partition_point(|(place, _)| place.0 <= now);
        let in_tree = self
            .overflow
            .keys()
            .take_while(|place| place.0 <= now)
            .count();
        (held, in_deque + in_tree)
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
        /// Insert a record whose window ends this many ms after the start.
        Insert(u16),
        /// Remove the n-th live record (modulo their number).
        Remove(u16),
        /// Pop what ended by this many ms after the start.
        Pop(u16),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            // Mostly in order (a window after a clock that moves on), sometimes not.
            4 => (0u16..2000).prop_map(Op::Insert),
            1 => any::<u16>().prop_map(Op::Remove),
            2 => (0u16..2000).prop_map(Op::Pop),
        ]
    }

    proptest! {
        /// Against a plain search tree, the reference: the same records pop in the same
        /// order, whatever mix of in-order and out-of-order inserts and removals.
        #[test]
        fn pops_in_the_order_of_a_search_tree(ops in proptest::collection::vec(op(), 0..400)) {
            let at = |ms: u16| Stamp(u64::from(ms) * 1_000_000);
            let mut index = EvictionIndex::default();
            let mut model: BTreeMap<Place, LedgerKey> = BTreeMap::new();
            let mut clock = 0u16;
            for (seq, op) in (0u64..).zip(ops) {
                match op {
                    Op::Insert(ms) => {
                        // The clock moves on; most windows end after everything before.
                        clock = clock.saturating_add(1);
                        let end = if ms % 5 == 0 { ms } else { clock.saturating_add(ms % 50) };
                        let key = LedgerKey::server("", &seq.to_string());
                        index.insert((at(end), seq), key);
                        model.insert((at(end), seq), key);
                    }
                    Op::Remove(n) => {
                        if let Some(place) = model.keys().nth(usize::from(n) % model.len().max(1)).copied() {
                            index.remove(place);
                            model.remove(&place);
                        }
                    }
                    Op::Pop(ms) => {
                        let now = at(ms);
                        let expected = match model.first_key_value() {
                            Some((place, _)) if place.0 <= now => {
                                model.pop_first().map(|((_, seq), key)| (key, seq))
                            }
                            _ => None,
                        };
                        prop_assert_eq!(index.pop_ended_by(now), expected);
                    }
                }
                prop_assert_eq!(index.len(), model.len());
            }
        }
    }

    #[test]
    fn a_drained_deque_gives_its_room_back() {
        let start = Stamp(0);
        let mut index = EvictionIndex::default();
        for seq in 0..100_000u64 {
            index.insert((start, seq), LedgerKey::server("", &seq.to_string()));
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
            index.insert((Stamp(seq / 3 * 1_000_000), seq), key);
        }
        assert!(index.overflow.is_empty());
        assert_eq!(index.sorted.len(), 10_000);
    }
}
