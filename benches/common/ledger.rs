//! The ledger alone, as the ledger bench and the instruction counts drive it: record keys,
//! a request's fingerprint, a small recorded response, and one claim-and-complete or replay.

use std::hint::black_box;
use std::time::Duration;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, LOCATION};
use http::{HeaderMap, HeaderValue, Method, StatusCode, Version};
use tower_idempotency::fingerprint::Fingerprint;
use tower_idempotency::ledger::{
    Begin, BeginRequest, IdempotencyStore, LedgerKey, Outcome, StoredResponse,
};

pub const LEASE: Duration = Duration::from_secs(60);
pub const RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

/// The key of record `i`. Keys are SHA-256 digests in real use; spreading `i` over the
/// bytes costs nothing here and the store hashes keys itself anyway.
pub fn key(i: u64) -> LedgerKey {
    let mut bytes = [0x5a; 32];
    bytes[..8].copy_from_slice(&i.to_le_bytes());
    bytes[24..].copy_from_slice(&i.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes());
    LedgerKey::from_bytes(bytes)
}

pub fn fingerprint() -> Fingerprint {
    Fingerprint::of(&Method::POST, "/charges", br#"{"order_id":"order_42"}"#)
}

pub fn outcome() -> Outcome {
    let mut headers = HeaderMap::new();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(LOCATION, HeaderValue::from_static("/charges/ch_1"));
    Outcome::Response(StoredResponse::new(
        StatusCode::CREATED,
        Version::HTTP_11,
        headers,
        Bytes::from_static(br#"{"id":"ch_1","status":"succeeded","amount_cents":1999}"#),
    ))
}

/// Claim and complete the new operation `key`.
pub async fn begin_complete<S: IdempotencyStore>(store: &S, key: LedgerKey, outcome: &Outcome) {
    let request = BeginRequest::new(key, fingerprint(), LEASE, RETENTION)
        .with_protected_window(Duration::ZERO);
    let Begin::Acquired { token } = store.begin(request).await.expect("begin") else {
        panic!("a fresh key must be acquired");
    };
    store
        .complete(key, token, outcome.clone(), RETENTION)
        .await
        .expect("complete");
}

/// `begin` on the completed operation `key`: its outcome.
pub async fn replay<S: IdempotencyStore>(store: &S, key: LedgerKey) {
    let request = BeginRequest::new(key, fingerprint(), LEASE, RETENTION)
        .with_protected_window(Duration::ZERO);
    match store.begin(request).await.expect("begin") {
        Begin::Replay(outcome) => {
            black_box(outcome);
        }
        other => panic!("expected a replay, got {other:?}"),
    }
}

/// xorshift64*: which prefilled record a replay reads.
pub struct Picker(pub u64);

impl Picker {
    pub fn next(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}
