//! What the double remembers per key, and how one call changes it.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, RETRY_AFTER};
use http::request::Parts;
use http::{Response, StatusCode};
use http_body_util::Full;

use super::captured::CapturedRequest;
use super::fault::Fault;
use super::responses::{
    created, effect_body, injected_error, json_error, json_response, key_in_use,
};
use crate::key::KeyHeader;
// The mark payment providers (and the IETF draft's examples) put on a replayed answer:
// the one the server face writes.
use crate::server::IDEMPOTENT_REPLAYED;

pub(super) struct Shared {
    pub(super) honour_keys: bool,
    /// Where the provider reads the key.
    pub(super) key_header: KeyHeader,
    pub(super) latency: Duration,
    // A std mutex: every critical section is short and synchronous, and it is never held
    // across an await (the futures below take it, act, and release it before any sleep).
    pub(super) state: Mutex<State>,
}

#[derive(Default)]
pub(super) struct State {
    /// Bumped by `reset`, so work still in flight from before it cannot touch the new state.
    pub(super) generation: u64,
    pub(super) faults: VecDeque<Fault>,
    pub(super) calls: usize,
    pub(super) attempts: Vec<CapturedRequest>,
    pub(super) effects: usize,
    pub(super) effects_by_key: HashMap<String, usize>,
    pub(super) effects_without_key: usize,
    /// The body of the first commit under each key as it was sent (quotes and all, as a
    /// provider that stores the header it received keeps it), honoured or not: what a
    /// lookup finds.
    pub(super) committed_by_key: HashMap<String, Bytes>,
    pub(super) lookups: usize,
    /// What the provider remembers per key (its characters, as the IETF draft reads an
    /// sf-string and a bare token alike) when it honours keys.
    pub(super) keys: HashMap<String, KeyRecord>,
}

pub(super) enum KeyRecord {
    /// Claimed by a call still being processed.
    InProgress,
    /// Committed: the body's digest (to tell a repeat from a different request) and the
    /// body of the `201` to replay.
    Committed {
        body_sha256: [u8; 32],
        response_body: Bytes,
    },
}

impl Shared {
    pub(super) fn lock(&self) -> MutexGuard<'_, State> {
        // A panic never happens while the lock is held (faults panic after releasing it),
        // but a poisoned lock must not turn one failed test into a cascade.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Answer a lookup of `key` (never an effect, never an attempt).
    pub(super) fn look_up(&self, key: &str) -> (u64, Decision) {
        let state = self.lock();
        let answer = match state.committed_by_key.get(key) {
            Some(body) => json_response(StatusCode::OK, body.clone()),
            None => json_error(
                StatusCode::NOT_FOUND,
                "no_such_effect",
                "no effect was committed under this Idempotency-Key",
            ),
        };
        (state.generation, Decision::Answer(answer))
    }

    /// Record the attempt and decide, in one critical section so concurrent calls with the
    /// same key see each other's claims.
    pub(super) fn decide(
        &self,
        parts: Parts,
        body: Bytes,
        body_sha256: [u8; 32],
    ) -> (u64, Decision) {
        let key = self.key_header.read(&parts.headers).map(|key| {
            key.map(|key| SentKey {
                sent: self
                    .key_header
                    .sent_value(&parts.headers)
                    .and_then(|value| value.to_str().ok())
                    .expect("a key that parsed was sent as visible ASCII")
                    .to_owned(),
                chars: key.as_str().to_owned(),
            })
        });
        let mut state = self.lock();
        state.attempts.push(CapturedRequest {
            method: parts.method,
            uri: parts.uri,
            version: parts.version,
            headers: parts.headers,
            body,
            key: key
                .as_ref()
                .ok()
                .and_then(Option::as_ref)
                .map(|key| key.chars.clone()),
        });
        let generation = state.generation;
        let commit = |key: Option<SentKey>, claimed| Decision::Commit {
            key,
            claimed,
            body_sha256,
        };
        if !self.honour_keys {
            // A naive provider never looks at the header; a malformed one counts as no key.
            return (generation, commit(key.ok().flatten(), false));
        }
        let decision = match key {
            Err(invalid) => Decision::Answer(json_error(
                StatusCode::BAD_REQUEST,
                "invalid_idempotency_key",
                &invalid.to_string(),
            )),
            Ok(None) => commit(None, false),
            Ok(Some(key)) => match state.keys.entry(key.chars.clone()) {
                Entry::Vacant(vacant) => {
                    vacant.insert(KeyRecord::InProgress);
                    commit(Some(key), true)
                }
                Entry::Occupied(occupied) => match occupied.get() {
                    KeyRecord::InProgress => {
                        let mut res = json_error(
                            StatusCode::CONFLICT,
                            "idempotency_key_in_progress",
                            "a request with this Idempotency-Key is still being processed",
                        );
                        res.headers_mut()
                            .insert(RETRY_AFTER, HeaderValue::from_static("1"));
                        Decision::Answer(res)
                    }
                    KeyRecord::Committed {
                        body_sha256: stored,
                        response_body,
                    } if *stored == body_sha256 => {
                        let mut res = created(response_body.clone());
                        res.headers_mut().insert(
                            IDEMPOTENT_REPLAYED.clone(),
                            HeaderValue::from_static("true"),
                        );
                        Decision::Answer(res)
                    }
                    KeyRecord::Committed { .. } => Decision::Answer(json_error(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "idempotency_key_reused",
                        "this Idempotency-Key was used with a different request body",
                    )),
                },
            },
        };
        (generation, decision)
    }
}

/// A request's key: its characters (what the provider deduplicates on and counts effects
/// by, however it was spelled) and the header's value as it was sent (what it stores with
/// the effect, and what a lookup must name).
pub(super) struct SentKey {
    pub(super) chars: String,
    pub(super) sent: String,
}

/// What the provider decided for one call, before its latency and fault play out.
pub(super) enum Decision {
    /// An answer without an effect: a replay, a `409`, a `422` or a `400`.
    Answer(Response<Full<Bytes>>),
    /// Perform the effect. `claimed` when this call holds the key's `InProgress` record and
    /// must complete or release it.
    Commit {
        key: Option<SentKey>,
        claimed: bool,
        body_sha256: [u8; 32],
    },
}

/// What a fault does once the latency has passed (`Latency` and no fault both answer
/// normally; `RefuseBeforeSend` never gets this far).
#[derive(Clone, Copy)]
pub(super) enum Action {
    Normal,
    Hang,
    ServerError { status: StatusCode, commit: bool },
    Panic { commit: bool },
    KeyInUse,
}

/// How the caller's future ends.
pub(super) enum Ending {
    Answer(Response<Full<Bytes>>),
    Hang,
    Panic,
}

/// The part of a call that runs after its latency; it owns everything it needs, so it can
/// run on its own task and finish even when the caller gives up.
pub(super) struct Work {
    pub(super) shared: Arc<Shared>,
    pub(super) generation: u64,
    pub(super) decision: Decision,
    pub(super) action: Action,
}

impl Work {
    pub(super) fn must_finish(&self) -> bool {
        matches!(self.decision, Decision::Commit { .. })
    }

    pub(super) fn finish(self) -> Ending {
        let response = match self.decision {
            Decision::Answer(res) => Some(res),
            Decision::Commit {
                key,
                claimed,
                body_sha256,
            } => {
                let commit = match self.action {
                    Action::Normal | Action::Hang => true,
                    Action::ServerError { commit, .. } | Action::Panic { commit } => commit,
                    Action::KeyInUse => false,
                };
                let mut state = self.shared.lock();
                // Work started before a `reset` answers, but leaves the fresh state alone.
                let current = state.generation == self.generation;
                if commit {
                    let body = commit_effect(&mut state, current, key, claimed, body_sha256);
                    Some(created(body))
                } else {
                    if current && claimed {
                        // Nothing happened, so the key is free again: a retry runs normally.
                        if let Some(key) = &key {
                            state.keys.remove(&key.chars);
                        }
                    }
                    None
                }
            }
        };
        match self.action {
            Action::Normal => Ending::Answer(response.expect("a normal call answers or commits")),
            Action::Hang => Ending::Hang,
            Action::ServerError { status, .. } => Ending::Answer(injected_error(status)),
            Action::Panic { .. } => Ending::Panic,
            Action::KeyInUse => Ending::Answer(key_in_use()),
        }
    }
}

/// The side effect itself: count it, give it an id and, for a claimed key, remember the
/// answer to replay. Returns the body of the `201`.
pub(super) fn commit_effect(
    state: &mut State,
    current: bool,
    key: Option<SentKey>,
    claimed: bool,
    body_sha256: [u8; 32],
) -> Bytes {
    let effect_id = state.effects + 1;
    let chars = key.as_ref().map(|key| key.chars.as_str());
    let body = effect_body(effect_id, chars, &body_sha256);
    if !current {
        return body;
    }
    state.effects = effect_id;
    match key {
        Some(SentKey { chars, sent }) => {
            *state.effects_by_key.entry(chars.clone()).or_default() += 1;
            state
                .committed_by_key
                .entry(sent.clone())
                .or_insert_with(|| body.clone());
            if claimed {
                let record = KeyRecord::Committed {
                    body_sha256,
                    response_body: body.clone(),
                };
                state.keys.insert(chars, record);
            }
        }
        None => state.effects_without_key += 1,
    }
    body
}
