//! The model's answers: each op applied to the records as the module docs' rules say.

use super::*;

impl Model {
    /// An empty ledger at time zero, whose ops ask for `lease` and `retention`.
    pub fn new(lease: Duration, retention: Duration) -> Self {
        Self {
            lease,
            retention,
            holds: false,
            now: Duration::ZERO,
            records: BTreeMap::new(),
            lives: BTreeMap::new(),
            released: BTreeMap::new(),
        }
    }

    /// The model of a store that [holds leases](crate::ledger::IdempotencyStore::hold_lease)
    /// (as `MemoryStore` does).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::testing::model::{Answer, Fp, Key, Model, Op, Token};
    ///
    /// let lease = Duration::from_secs(10);
    /// let mut model = Model::new(lease, Duration::from_secs(600)).holding();
    /// let begin = |token| Op::Begin { key: Key(0), fingerprint: Fp(0), token, take_over: true };
    /// model.apply(&begin(Token(1)));
    /// assert_eq!(model.apply(&Op::Hold { key: Key(0), token: Token(1) }), Answer::Held);
    /// model.apply(&Op::Advance(lease * 3));
    /// assert_eq!(model.apply(&begin(Token(2))), Answer::Busy { retry_after: lease });
    /// ```
    pub fn holding(mut self) -> Self {
        self.holds = true;
        self
    }

    /// The lease every `begin` and `renew` asks for.
    pub fn lease(&self) -> Duration {
        self.lease
    }

    /// The retention every `begin`, `complete` and `mark_in_doubt` asks for.
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// How much time has passed since the model was made.
    pub fn now(&self) -> Duration {
        self.now
    }

    /// The record held for `key`, if any (`None`: absent, or past its retention).
    pub fn record(&self, key: Key) -> Option<&Record> {
        self.records
            .get(&key)
            .filter(|record| record.retain_until > self.now)
    }

    /// Apply `op` and say what the protocol answers it.
    pub fn apply(&mut self, op: &Op) -> Answer {
        match *op {
            Op::Advance(by) => {
                self.now += by;
                Answer::Ok
            }
            Op::Begin {
                key,
                fingerprint,
                token,
                take_over,
            } => self.begin(key, fingerprint, token, take_over),
            Op::Complete {
                key,
                token,
                outcome,
            } => {
                let now = self.now;
                let retention = self.retention;
                let Some(record) = self.owned(key, token) else {
                    return Answer::Fenced;
                };
                record.state = State::Completed(outcome);
                record.retain_until = now + retention;
                Answer::Ok
            }
            Op::Abandon { key, token } => {
                // Whatever it finds, the token is released: a `begin` of it may still be on
                // its way, and must not claim the key (nor take it over) when it arrives,
                // even once the record another caller holds now has left.
                let answer = match self.owned(key, token) {
                    None => Answer::Fenced,
                    Some(record) => {
                        if let State::InFlight { resumed: true, .. } = record.state {
                            record.state = State::InDoubt;
                        } else {
                            self.records.remove(&key);
                        }
                        Answer::Ok
                    }
                };
                self.release(key, token);
                answer
            }
            Op::MarkInDoubt { key, token } => {
                let now = self.now;
                let retention = self.retention;
                let Some(record) = self.owned(key, token) else {
                    return Answer::Fenced;
                };
                record.state = State::InDoubt;
                record.retain_until = record.retain_until.max(now + retention);
                Answer::Ok
            }
            Op::Forget {
                key,
                life,
                kind,
                fingerprint,
                attempts,
                force,
            } => self.forget(key, (life, kind, fingerprint, attempts), force),
            Op::Renew { key, token } => {
                let lease_until = self.now + self.lease;
                let Some(record) = self.owned(key, token) else {
                    return Answer::Fenced;
                };
                if let State::InFlight {
                    lease_until: lease,
                    held,
                    ..
                } = &mut record.state
                {
                    *lease = lease_until;
                    *held = false;
                }
                Answer::Ok
            }
            Op::Hold { key, token } => {
                let holds = self.holds;
                match self.owned(key, token).map(|record| &mut record.state) {
                    Some(State::InFlight { held, .. }) if holds => {
                        *held = true;
                        Answer::Held
                    }
                    _ => Answer::NotHeld,
                }
            }
            Op::LetGo { key, token } => {
                let lease_until = self.now + self.lease;
                if let Some(State::InFlight {
                    lease_until: lease,
                    held: held @ true,
                    ..
                }) = self.owned(key, token).map(|record| &mut record.state)
                {
                    *lease = lease_until;
                    *held = false;
                }
                Answer::Ok
            }
        }
    }

    fn begin(&mut self, key: Key, fingerprint: Fp, token: Token, take_over: bool) -> Answer {
        self.forget_if_expired(key);
        if self.is_released(key, token) {
            return Answer::Fenced;
        }
        let now = self.now;
        let lease = self.lease;
        let Some(record) = self.records.get_mut(&key) else {
            self.released.remove(&key);
            let life = self.lives.entry(key).or_insert(0);
            *life += 1;
            let life = *life;
            self.records.insert(
                key,
                Record {
                    fingerprint,
                    state: State::InFlight {
                        token,
                        lease_until: now + lease,
                        resumed: false,
                        held: false,
                    },
                    retain_until: now + self.retention,
                    attempts: 1,
                    life,
                },
            );
            return Answer::Acquired { token };
        };
        if record.fingerprint != fingerprint {
            return Answer::Drift {
                stored: record.fingerprint,
            };
        }
        match record.state {
            State::Completed(outcome) => Answer::Replay(outcome),
            State::InFlight {
                token: owner,
                resumed,
                ..
            } if owner == token => {
                if resumed {
                    Answer::Resume {
                        token,
                        frozen: record.fingerprint,
                    }
                } else {
                    Answer::Acquired { token }
                }
            }
            State::InFlight { held: true, .. } => Answer::Busy {
                retry_after: held_lease(lease),
            },
            State::InFlight { lease_until, .. } if lease_until > now => Answer::Busy {
                retry_after: lease_until - now,
            },
            _ if !take_over => Answer::InDoubt,
            _ => {
                record.state = State::InFlight {
                    token,
                    lease_until: now + lease,
                    resumed: true,
                    held: false,
                };
                record.attempts += 1;
                Answer::Resume {
                    token,
                    frozen: record.fingerprint,
                }
            }
        }
    }

    /// `seen`: the life, state kind, fingerprint and attempts the operator saw.
    fn forget(
        &mut self,
        key: Key,
        (life, kind, fingerprint, attempts): (u32, RecordKind, Fp, u32),
        force: bool,
    ) -> Answer {
        self.forget_if_expired(key);
        let Some(record) = self.records.get(&key) else {
            return Answer::Absent;
        };
        let current = match record.state {
            State::InFlight { .. } => RecordKind::InFlight,
            State::InDoubt => RecordKind::InDoubt,
            State::Completed(_) => RecordKind::Completed,
        };
        if record.life != life
            || current != kind
            || record.fingerprint != fingerprint
            || record.attempts != attempts
        {
            return Answer::Changed;
        }
        match record.state {
            State::InFlight { held: true, .. } if !force => Answer::Live {
                lease_left: held_lease(self.lease),
            },
            State::InFlight { lease_until, .. } if lease_until > self.now && !force => {
                Answer::Live {
                    lease_left: lease_until - self.now,
                }
            }
            _ => {
                self.records.remove(&key);
                Answer::Forgotten
            }
        }
    }

    /// Mark `key` released under `token` (rule 0), every token it was released under until
    /// a minute from now.
    fn release(&mut self, key: Key, token: Token) {
        let until = self.now + RELEASED_FOR;
        let now = self.now;
        let released = self.released.entry(key).or_insert(Released {
            tokens: Vec::new(),
            until,
        });
        if released.until <= now {
            released.tokens.clear();
        }
        released.until = until;
        if !released.tokens.contains(&token) {
            released.tokens.push(token);
        }
    }

    /// Whether `key` is released under `token` now.
    fn is_released(&self, key: Key, token: Token) -> bool {
        self.released
            .get(&key)
            .is_some_and(|released| released.until > self.now && released.tokens.contains(&token))
    }

    /// The record of `key`, if `token` owns it (in flight under that token).
    fn owned(&mut self, key: Key, token: Token) -> Option<&mut Record> {
        self.forget_if_expired(key);
        self.records.get_mut(&key).filter(
            |record| matches!(record.state, State::InFlight { token: owner, .. } if owner == token),
        )
    }

    fn forget_if_expired(&mut self, key: Key) {
        if self
            .records
            .get(&key)
            .is_some_and(|record| record.retain_until <= self.now)
        {
            self.records.remove(&key);
        }
    }
}

/// The lease left of a held lease at every look: the whole lease, and never none (a held
/// lease of zero shows a nanosecond, so that it never reads as over).
fn held_lease(lease: Duration) -> Duration {
    lease.max(Duration::from_nanos(1))
}
