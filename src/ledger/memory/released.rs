//! The tokens a shard's keys were released under.
//!
//! The ledger protocol's "a release outlasts a late claim": every `abandon` (whether it
//! releases its token's claim, finds the key without a record, or finds another caller's)
//! marks the key released under that token for [`RELEASED_TOKEN_TTL`], and a `begin` under
//! a released token is refused as fenced instead of claiming the key or taking it over. The
//! markers live beside the records, not in them, so they outlast any record that leaves;
//! only a new claim of the key ends them. In this process a `begin` is applied the moment it is
//! made, so none can reach the store after its own release; the markers are kept all the
//! same, so this store answers every sequence of calls as the protocol (and the reference
//! model) says.
//!
//! They are few and short-lived: not records, not counted against the byte budget, at most
//! [`PER_SHARD`] per shard (the one closest to its end goes first when a shard is full), and
//! an empty shard's list costs a length check on each claim.

use super::record::{HeldToken, Stamp};
use crate::ledger::{LeaseToken, LedgerKey, RELEASED_TOKEN_TTL};

/// At most this many markers per shard (64 shards: 4,096 in all, ~200 KiB).
const PER_SHARD: usize = 64;

/// One shard's markers. Lives behind the shard's lock, beside its records: a `begin` checks
/// them and claims in one step, and an `abandon` releases and marks in one step.
#[derive(Debug, Default)]
pub(super) struct Released(Vec<Marker>);

#[derive(Debug)]
struct Marker {
    key: LedgerKey,
    token: HeldToken,
    /// Until when `token` is refused (every marker of a key ends together: a minute after
    /// the key's last release).
    until: Stamp,
}

impl Released {
    /// Mark `key` released under `token` at `now`, until a minute from now, with every
    /// other token it was released under.
    pub(super) fn release(&mut self, key: LedgerKey, token: LeaseToken, now: Stamp) {
        let until = now + RELEASED_TOKEN_TTL;
        let token = HeldToken::from(token);
        self.0.retain(|marker| marker.until > now);
        let mut known = false;
        for marker in self.0.iter_mut().filter(|marker| marker.key == key) {
            marker.until = until;
            known |= marker.token == token;
        }
        if known {
            return;
        }
        if self.0.len() == PER_SHARD {
            let first_to_end = (0..self.0.len())
                .min_by_key(|&index| self.0[index].until)
                .expect("a full list");
            self.0.swap_remove(first_to_end);
        }
        self.0.push(Marker { key, token, until });
    }

    /// Whether `key` is released under `token` at `now`.
    pub(super) fn refuses(&self, key: &LedgerKey, token: LeaseToken, now: Stamp) -> bool {
        // The common case, no marker at all, is one length check.
        !self.0.is_empty() && {
            let token = HeldToken::from(token);
            self.0
                .iter()
                .any(|marker| marker.key == *key && marker.token == token && marker.until > now)
        }
    }

    /// A claim took `key`'s place: its markers end (see the ledger docs).
    pub(super) fn end(&mut self, key: &LedgerKey) {
        if !self.0.is_empty() {
            self.0.retain(|marker| marker.key != *key);
        }
    }
}
