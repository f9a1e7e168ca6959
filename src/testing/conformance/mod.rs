//! The store conformance suite: the ledger protocol, checked against any store.
//!
//! Every [`IdempotencyStore`] must keep the rules in the [ledger docs](crate::ledger). Run
//! [`run_all`] against yours from a test; each check uses fresh random keys, so a shared
//! backend's existing data does not matter. Time-dependent checks (lease expiry, retention)
//! move time with a [`Clock`]: a paused tokio clock for stores that read tokio's time,
//! real sleeps for stores with their own clock (Redis).
//!
//! # Example
//!
//! ```
//! use std::sync::Arc;
//! use tower_idempotency::ledger::MemoryStore;
//! use tower_idempotency::testing::conformance::{run_all, Clock};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! run_all(Arc::new(MemoryStore::new()), Clock::tokio_paused()).await;
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, StatusCode, Version};

use crate::fingerprint::Fingerprint;
use crate::ledger::{
    Begin, BeginRequest, Expected, Forget, Generation, IdempotencyStore, LeaseToken, LedgerKey,
    Outcome, RecordKind, StoredResponse,
};
use crate::FrozenRequest;

mod claims;
mod fencing;
mod lifecycle;
mod listing;
mod resolving;

pub use claims::{
    a_repeated_begin_recognises_its_own_claim, acquire_complete_replay, busy_while_in_flight,
    completed_drift_keeps_a_request_to_judge_by, concurrent_begin_has_one_owner,
    drift_in_every_state, replay_is_byte_identical, tombstones_replay_as_tombstones,
};
pub use fencing::{
    a_held_lease_lasts_until_let_go, a_release_outlasts_a_late_claim,
    a_release_outlasts_another_callers_record, abandon_releases_only_unsent_operations,
    expired_lease_resumes_and_fences_old_owner, in_doubt_resumes_with_stored_bytes,
    renewal_is_fenced, renewal_keeps_a_live_owner, stale_owner_writes_are_fenced,
};
pub use lifecycle::{
    a_look_forgets_only_the_life_it_saw, forgetting_is_fenced, inspection_follows_the_record,
    inspection_shows_the_frozen_request, probes_change_nothing, retention_expiry_forgets,
    settle_notifications_wake_listeners,
};
pub use listing::listing_finds_what_it_asks_for;
pub use resolving::resolving_is_fenced;

/// The lease every check uses.
pub const LEASE: Duration = Duration::from_millis(300);

/// The retention every check uses, except the retention-expiry check.
pub const RETENTION: Duration = Duration::from_secs(600);

type Advance = dyn Fn(Duration) -> Pin<Box<dyn Future<Output = ()> + Send>> + Send + Sync;

/// How the suite lets time pass.
#[derive(Clone)]
pub struct Clock(Arc<Advance>);

impl Clock {
    /// Advance tokio's paused clock (`#[tokio::test(start_paused = true)]`).
    pub fn tokio_paused() -> Self {
        Self(Arc::new(|by| Box::pin(tokio::time::advance(by))))
    }

    /// Sleep for real, for stores whose clock the test cannot move.
    pub fn real() -> Self {
        Self(Arc::new(|by| Box::pin(tokio::time::sleep(by))))
    }

    async fn advance(&self, by: Duration) {
        (self.0)(by).await;
    }
}

impl fmt::Debug for Clock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Clock")
    }
}

/// Run every check, panicking with the failed rule's name.
pub async fn run_all(store: Arc<dyn IdempotencyStore>, clock: Clock) {
    acquire_complete_replay(&*store).await;
    concurrent_begin_has_one_owner(store.clone()).await;
    busy_while_in_flight(&*store).await;
    drift_in_every_state(&*store).await;
    completed_drift_keeps_a_request_to_judge_by(&*store).await;
    stale_owner_writes_are_fenced(&*store).await;
    in_doubt_resumes_with_stored_bytes(&*store).await;
    expired_lease_resumes_and_fences_old_owner(&*store, &clock).await;
    abandon_releases_only_unsent_operations(&*store).await;
    a_release_outlasts_a_late_claim(&*store).await;
    retention_expiry_forgets(&*store, &clock).await;
    tombstones_replay_as_tombstones(&*store).await;
    replay_is_byte_identical(&*store).await;
    a_repeated_begin_recognises_its_own_claim(&*store).await;
    probes_change_nothing(&*store, &clock).await;
    renewal_keeps_a_live_owner(&*store, &clock).await;
    a_held_lease_lasts_until_let_go(&*store, &clock).await;
    renewal_is_fenced(&*store).await;
    settle_notifications_wake_listeners(&*store).await;
    forgetting_is_fenced(&*store, &clock).await;
    a_look_forgets_only_the_life_it_saw(&*store, &clock).await;
    resolving_is_fenced(&*store, &clock).await;
    a_release_outlasts_another_callers_record(&*store).await;
}

fn fresh_key() -> LedgerKey {
    let mut bytes = [0u8; 32];
    bytes[..16].copy_from_slice(&fastrand::u128(..).to_be_bytes());
    bytes[16..].copy_from_slice(&fastrand::u128(..).to_be_bytes());
    LedgerKey::from_bytes(bytes)
}

fn frozen(body: &'static str) -> FrozenRequest {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    FrozenRequest::from_parts(
        Method::POST,
        "http://provider.local/charges".parse().expect("static URI"),
        Version::HTTP_11,
        headers,
        Bytes::from_static(body.as_bytes()),
    )
}

fn request(key: LedgerKey, frozen: &FrozenRequest) -> BeginRequest {
    BeginRequest::new(key, frozen.fingerprint(), LEASE, RETENTION).with_frozen(frozen.clone())
}

fn response(body: &'static str) -> Outcome {
    let mut headers = HeaderMap::new();
    headers.append("x-repeated", HeaderValue::from_static("1"));
    headers.append("x-repeated", HeaderValue::from_static("2"));
    Outcome::Response(StoredResponse::new(
        StatusCode::CREATED,
        Version::HTTP_11,
        headers,
        Bytes::from_static(body.as_bytes()),
    ))
}

async fn acquire(store: &dyn IdempotencyStore, request: BeginRequest) -> LeaseToken {
    match store.begin(request).await.expect("begin") {
        Begin::Acquired { token } => token,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

async fn resume(
    store: &dyn IdempotencyStore,
    request: BeginRequest,
) -> (LeaseToken, Option<FrozenRequest>) {
    match store.begin(request).await.expect("begin") {
        Begin::Resume { token, frozen } => (token, frozen),
        other => panic!("expected Resume, got {other:?}"),
    }
}

/// The fingerprint of the suite's requests (for stores that want to seed records).
pub fn sample_fingerprint() -> Fingerprint {
    frozen("{}").fingerprint()
}
