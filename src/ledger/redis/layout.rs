//! Where a store keeps each record and its listing indexes: one set of keys on a single
//! Redis, sixteen hash-tagged buckets on a Redis Cluster.
//!
//! A Lua script may touch the keys of one slot only. On a single Redis every key is in the
//! one slot there is, so each transition updates its record and the three per-state
//! indexes together. On a cluster the store gives every record key a hash tag picked by
//! its bucket (the key's first hex digit), and keeps one set of indexes per bucket under
//! the same tag: a record and its index entries share a slot, so the same scripts keep them
//! in step atomically. A list merges the sixteen buckets (see `store.rs`).

use crate::ledger::{LedgerKey, RecordKind};

/// How many buckets a cluster ledger is spread over: one per first hex digit of a key.
#[cfg(feature = "redis-cluster")]
pub(super) const BUCKETS: usize = 16;

/// The hash tag of each bucket. Bucket `i`'s tag hashes to a slot in `[1024 i, 1024 (i+1))`
/// (checked by a test), so the buckets spread evenly over a cluster whose slots were
/// assigned in even ranges, as `redis-cli --cluster create` does: three primaries hold
/// five or six buckets each. Never change them: a record is found by its tag.
#[cfg(feature = "redis-cluster")]
const BUCKET_TAGS: [&str; BUCKETS] = [
    "0.13", "1.10", "2.3", "3.0", "4.63", "5.60", "6.43", "7.40", "8.20", "9.23", "a.60", "b.21",
    "c.2", "d.2", "e.10", "f.42",
];

/// The keys of one store: its prefix, and whether it spreads over buckets.
#[derive(Clone, Debug)]
pub(super) enum Layout {
    /// One Redis: `<prefix><64 hex>`, indexes `<prefix>index:<state>`.
    Single { prefix: std::sync::Arc<str> },
    /// A Redis Cluster: `<prefix>{<tag>}<64 hex>`, indexes `<prefix>{<tag>}index:<state>`.
    /// `legacy`: the ledger may still hold records an earlier release wrote at
    /// `<prefix><64 hex>` (no tag), which the store then looks for first (see
    /// [`cluster`](super::cluster)).
    #[cfg(feature = "redis-cluster")]
    Buckets {
        prefix: std::sync::Arc<str>,
        legacy: bool,
    },
}

impl Layout {
    /// The prefix the user configured.
    pub(super) fn prefix(&self) -> &str {
        match self {
            Self::Single { prefix } => prefix,
            #[cfg(feature = "redis-cluster")]
            Self::Buckets { prefix, .. } => prefix,
        }
    }

    /// What every key of `key`'s bucket starts with: the prefix, and its bucket's tag on a
    /// cluster.
    pub(super) fn base_of(&self, key: &LedgerKey) -> String {
        self.base(bucket_of(key))
    }

    /// What every key of `bucket` starts with (any bucket on a single Redis).
    #[cfg_attr(not(feature = "redis-cluster"), allow(unused_variables))]
    pub(super) fn base(&self, bucket: usize) -> String {
        match self {
            Self::Single { prefix } => prefix.to_string(),
            #[cfg(feature = "redis-cluster")]
            Self::Buckets { prefix, .. } => format!("{prefix}{{{}}}", BUCKET_TAGS[bucket]),
        }
    }

    /// The Redis key of `key`'s record.
    pub(super) fn record_key(&self, key: &LedgerKey) -> String {
        let mut out = self.base_of(key);
        out.push_str(&key.to_hex());
        out
    }

    /// Where an earlier release kept `key`'s record on a cluster, if the ledger may still
    /// hold such records.
    #[cfg_attr(not(feature = "redis-cluster"), allow(unused_variables))]
    pub(super) fn legacy_key(&self, key: &LedgerKey) -> Option<String> {
        match self {
            Self::Single { .. } => None,
            #[cfg(feature = "redis-cluster")]
            Self::Buckets { legacy: false, .. } => None,
            #[cfg(feature = "redis-cluster")]
            Self::Buckets {
                prefix,
                legacy: true,
            } => Some(format!("{prefix}{}", key.to_hex())),
        }
    }

    /// The buckets a list merges: one on a single Redis.
    pub(super) fn buckets(&self) -> usize {
        match self {
            Self::Single { .. } => 1,
            #[cfg(feature = "redis-cluster")]
            Self::Buckets { .. } => BUCKETS,
        }
    }
}

/// The index of the records in state `kind` among the keys starting with `base`.
pub(super) fn index_key(base: &str, kind: RecordKind) -> String {
    format!("{base}index:{}", kind.as_str())
}

/// The sweep's cursors among the keys starting with `base` (see `prelude.lua`).
pub(super) fn sweep_key(base: &str) -> String {
    format!("{base}index:sweep")
}

/// A key's bucket: its first hex digit. Keys are uniform hashes, so buckets are even.
fn bucket_of(key: &LedgerKey) -> usize {
    usize::from(key.as_bytes()[0] >> 4)
}

/// The key on a cluster whose value says the ledger holds no record of an earlier
/// release's layout (see [`cluster`](super::cluster)), in bucket 0's slot.
#[cfg(feature = "redis-cluster")]
pub(super) fn layout_marker(prefix: &str) -> String {
    format!("{prefix}{{{}}}layout", BUCKET_TAGS[0])
}

#[cfg(all(test, feature = "redis-cluster"))]
mod tests {
    use super::*;

    /// The slot Redis Cluster hashes `key` to.
    fn slot(key: &str) -> usize {
        use ::redis::cluster_routing::Slot;
        let wanted = Slot::for_key(key);
        (0..16384u16)
            .find(|slot| Slot::new(*slot) == Some(wanted))
            .map(usize::from)
            .expect("a slot")
    }

    #[test]
    fn each_bucket_tag_hashes_into_its_own_sixteenth_of_the_slots() {
        for (bucket, tag) in BUCKET_TAGS.iter().enumerate() {
            let slot = slot(tag);
            assert_eq!(slot / 1024, bucket, "tag {tag} hashes to slot {slot}");
        }
    }

    #[test]
    fn a_record_and_its_bucket_indexes_share_a_slot() {
        let layout = Layout::Buckets {
            prefix: "idem:".into(),
            legacy: false,
        };
        for first in 0..=255u8 {
            let key = LedgerKey::from_bytes([first; 32]);
            let record = layout.record_key(&key);
            let slot = slot(&record);
            let base = layout.base_of(&key);
            for kind in [
                RecordKind::InFlight,
                RecordKind::InDoubt,
                RecordKind::Completed,
            ] {
                let index = index_key(&base, kind);
                assert_eq!(self::slot(&index), slot);
            }
            assert_eq!(self::slot(&sweep_key(&base)), slot);
            assert!(record.ends_with(&key.to_hex()), "{record}");
        }
    }

    #[test]
    fn legacy_keys_are_the_untagged_layout() {
        let key = LedgerKey::from_bytes([0xab; 32]);
        let legacy = Layout::Buckets {
            prefix: "idem:".into(),
            legacy: true,
        };
        assert_eq!(
            legacy.legacy_key(&key),
            Some(format!("idem:{}", "ab".repeat(32)))
        );
        assert_eq!(
            legacy.record_key(&key),
            format!("idem:{{a.60}}{}", "ab".repeat(32))
        );
        let fresh = Layout::Buckets {
            prefix: "idem:".into(),
            legacy: false,
        };
        assert_eq!(fresh.legacy_key(&key), None);
    }
}
