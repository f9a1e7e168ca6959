//! `begin`: claiming a key, or answering what its record says.

use std::collections::hash_map::Entry;
use std::time::Duration;

use tokio::time::Instant;

use super::record::{lease_end, Record, Stamp, State};
use super::shared::{lock, Shard};
use super::store::MemoryStore;
use super::sync::Ordering;
use crate::ledger::{Begin, BeginRequest, LedgerKey, StoreError};

impl MemoryStore {
    pub(super) fn begin_now(&self, request: BeginRequest) -> Result<Begin, StoreError> {
        let now = Instant::now();
        let at = self.stamp(now);
        let mut shard = lock(self.shard(&request.key));
        if self.refuses_released(&shard, &request, at) {
            return Err(StoreError::fenced());
        }
        // One lookup for the common answers: a new claim, or what the record says.
        let record = match shard.records.entry(request.key) {
            Entry::Occupied(entry) if entry.get().retain_until > at => {
                return Ok(self.begin_on_existing(entry.into_mut(), request, at));
            }
            Entry::Occupied(entry) => {
                // Past its retention: gone, and claimed anew.
                let expired = entry.remove();
                self.forget(&expired);
                let record = Record::claim(&request, at, self.seq());
                if let Some(never) = self.never_fits(record.weight) {
                    return Err(never);
                }
                if self.over_share(record.bucket(), record.weight, at) {
                    drop(shard);
                    return Err(self.refuse(now));
                }
                let weight = record.weight;
                match self.insert_if_room(&mut shard, request.key, record) {
                    None => {
                        shard.released.end(&request.key);
                        drop(shard);
                        self.claimed(weight, &request, now, at);
                        return Ok(acquired(&request));
                    }
                    Some(record) => record,
                }
            }
            Entry::Vacant(entry) => {
                // Absent: a new claim, if the budget has room for it and its scope is not
                // over its share of a store under pressure.
                let record = Record::claim(&request, at, self.seq());
                if let Some(never) = self.never_fits(record.weight) {
                    return Err(never);
                }
                if self.over_share(record.bucket(), record.weight, at) {
                    drop(shard);
                    return Err(self.refuse(now));
                }
                match self.claim_vacant(entry, record) {
                    None => {
                        shard.released.end(&request.key);
                        drop(shard);
                        self.note_claim(&request, now, at);
                        return Ok(acquired(&request));
                    }
                    Some(record) => record,
                }
            }
        };
        // No room: evict what may be evicted, then try again.
        let needed = record.weight;
        drop(shard);
        if self.make_room(needed, now, at) {
            let mut shard = lock(self.shard(&request.key));
            // Released while this claim made room: refused as it would have been at first.
            if self.refuses_released(&shard, &request, at) {
                return Err(StoreError::fenced());
            }
            match shard.records.entry(request.key) {
                Entry::Occupied(_) => {
                    // Someone claimed it meanwhile: answer as that record says.
                    drop(shard);
                    return self.begin_now(request);
                }
                Entry::Vacant(entry) => {
                    if self.claim_vacant(entry, record).is_none() {
                        shard.released.end(&request.key);
                        drop(shard);
                        self.note_claim(&request, now, at);
                        return Ok(acquired(&request));
                    }
                }
            }
        }
        Err(self.refuse(now))
    }

    /// Whether `request` is the late `begin` of a caller that released its token on the key:
    /// it must claim nothing, and take nothing over, whatever the key holds now.
    pub(super) fn refuses_released(
        &self,
        shard: &Shard,
        request: &BeginRequest,
        at: Stamp,
    ) -> bool {
        shard.released.refuses(&request.key, request.token, at)
    }

    /// Put a new claim in `entry`'s place (one lookup: a claim holds no outcome, so it is
    /// never in the eviction index) if the budget has room for it; hand it back if not.
    #[must_use]
    pub(super) fn claim_vacant(
        &self,
        entry: std::collections::hash_map::VacantEntry<'_, LedgerKey, Box<Record>>,
        record: Box<Record>,
    ) -> Option<Box<Record>> {
        debug_assert!(matches!(record.state, State::InFlight { .. }));
        if !self.reweigh(0, record.weight) {
            return Some(record);
        }
        self.inner.last_claim.store(
            record.weight.min(self.inner.max_bytes / 16),
            Ordering::Relaxed,
        );
        self.inner.gauges.added(record.weight);
        self.scoped(record.bucket(), 0, record.weight);
        entry.insert(record);
        None
    }

    /// A claim of `weight` bytes was taken: the room a completion that evicts leaves for
    /// the next one (see `complete_now`), never more than a sixteenth of the budget, so an
    /// outsized claim cannot make completions empty the eviction index.
    pub(super) fn claimed(&self, weight: u64, request: &BeginRequest, now: Instant, at: Stamp) {
        let headroom = weight.min(self.inner.max_bytes / 16);
        self.inner.last_claim.store(headroom, Ordering::Relaxed);
        self.note_claim(request, now, at);
    }

    /// What every new claim tells the store, after its shard lock is released: when the
    /// open record may end (for the sweep's floor), its protected window (for the pressure
    /// warning), and a look at the pressure when one is due. `at` is `now` as a stamp.
    pub(super) fn note_claim(&self, request: &BeginRequest, now: Instant, at: Stamp) {
        let ends = (at + request.retention).micros();
        self.inner
            .open_expiry_floor
            .fetch_min(ends, Ordering::Relaxed);
        let window = request.protected_window().as_micros() as u64;
        if self.inner.last_window_us.load(Ordering::Relaxed) != window {
            self.inner.last_window_us.store(window, Ordering::Relaxed);
        }
        self.check_pressure(now, at.micros());
    }

    pub(super) fn begin_on_existing(
        &self,
        record: &mut Record,
        request: BeginRequest,
        now: Stamp,
    ) -> Begin {
        if record.fingerprint != request.fingerprint {
            return match record.field_digests() {
                Some(fields) => Begin::DriftFields {
                    stored: record.fingerprint,
                    fields,
                },
                None => Begin::Drift {
                    stored: record.fingerprint,
                    frozen: record.kept.frozen(),
                },
            };
        }
        let lease_left = match &record.state {
            State::InFlight {
                lease_until, held, ..
            } => lease_end(*lease_until, *held, now).since(now),
            _ => Duration::ZERO,
        };
        match &mut record.state {
            State::Completed { outcome, .. } => Begin::Replay(outcome.clone()),
            // Our own claim, asked again after a lost reply: the same answer.
            State::InFlight { token, resumed, .. } if *token == request.token.into() => {
                if *resumed {
                    Begin::Resume {
                        token: (*token).into(),
                        frozen: record.kept.frozen(),
                    }
                } else {
                    acquired(&request)
                }
            }
            State::InFlight { .. } if !lease_left.is_zero() => Begin::Busy {
                retry_after: lease_left,
            },
            // In doubt, or in flight under an expired lease (the owner may have sent and
            // died). A probe is told so and changes nothing.
            _ if !request.take_over => Begin::InDoubt,
            state => {
                // Hand the operation over under the caller's token, with the bytes first
                // frozen. Its retention is not extended: only a completion starts a new life.
                *state = State::InFlight {
                    token: request.token.into(),
                    lease_until: now + request.lease,
                    resumed: true,
                    held: false,
                };
                record.touched = now;
                record.attempts += 1;
                Begin::Resume {
                    token: request.token,
                    frozen: record.kept.frozen(),
                }
            }
        }
    }
}

fn acquired(request: &BeginRequest) -> Begin {
    Begin::Acquired {
        token: request.token,
    }
}
