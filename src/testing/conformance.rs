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
    Begin, BeginRequest, Expected, Forget, IdempotencyStore, LeaseToken, LedgerKey, Outcome,
    RecordKind, StoredResponse,
};
use crate::FrozenRequest;

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
    renewal_is_fenced(&*store).await;
    settle_notifications_wake_listeners(&*store).await;
    forgetting_is_fenced(&*store, &clock).await;
}

/// [`forget`](IdempotencyStore::forget) removes a record only if it is still as an
/// [`inspect`](IdempotencyStore::inspect) showed it, and a live owner's only when forced:
/// an absent key is `Absent`; a live claim is `Live` (and still busy) until forced, and
/// its owner is fenced after; a look taken before a resume is `Changed` (and the record
/// stays); a record in doubt, completed, or in flight under a lease that ran out is
/// forgotten; a forgotten key is acquired afresh, with no frozen request left to resume.
pub async fn forgetting_is_fenced(store: &dyn IdempotencyStore, clock: &Clock) {
    const LIVE: Duration = Duration::from_secs(30);
    let look = |key| async move {
        let view = store.inspect(key).await.expect("inspect");
        Expected::of(&view.expect("forgetting_is_fenced: a record to look at"))
    };
    let forget = |key, expected| async move { store.forget(key, expected).await.expect("forget") };
    let req = frozen("{\"amount\":17}");
    let live =
        |key| BeginRequest::new(key, req.fingerprint(), LIVE, RETENTION).with_frozen(req.clone());

    let key = fresh_key();
    let expected = Expected::new(RecordKind::Completed, req.fingerprint(), 1);
    assert_eq!(
        forget(key, expected).await,
        Forget::Absent,
        "forgetting_is_fenced: absent"
    );

    // A live owner keeps its lease unless the operator forces it.
    let owner = acquire(store, live(key)).await;
    let seen = look(key).await;
    assert!(
        matches!(forget(key, seen).await, Forget::Live { lease_left } if lease_left <= LIVE),
        "forgetting_is_fenced: a live lease was not answered Live"
    );
    assert!(
        matches!(
            store.begin(live(key)).await.expect("begin"),
            Begin::Busy { .. }
        ),
        "forgetting_is_fenced: a refused forget changed the record"
    );
    assert_eq!(
        forget(key, seen.force()).await,
        Forget::Forgotten,
        "forgetting_is_fenced: forced"
    );
    assert!(
        store
            .complete(key, owner, response("late"), RETENTION)
            .await
            .unwrap_err()
            .is_fenced(),
        "forgetting_is_fenced: the forgotten owner's write applied"
    );
    acquire(store, live(key)).await;

    // A look taken before the operation moved on never removes it.
    let key = fresh_key();
    let owner = acquire(store, request(key, &req)).await;
    store
        .mark_in_doubt(key, owner, RETENTION)
        .await
        .expect("mark");
    let stale = look(key).await;
    assert_eq!(stale.kind, RecordKind::InDoubt);
    let (owner, _) = resume(store, request(key, &req)).await;
    store
        .mark_in_doubt(key, owner, RETENTION)
        .await
        .expect("mark");
    assert_eq!(
        forget(key, stale).await,
        Forget::Changed,
        "forgetting_is_fenced: a stale look"
    );
    let other = Expected {
        fingerprint: sample_fingerprint(),
        ..look(key).await
    };
    assert_eq!(
        forget(key, other).await,
        Forget::Changed,
        "forgetting_is_fenced: another payload"
    );
    // The record stayed: still in doubt, resumable with its bytes. Then forgotten as seen.
    resume(store, request(key, &req)).await;
    clock.advance(LEASE + Duration::from_millis(100)).await;
    let expired = look(key).await;
    assert_eq!(expired.kind, RecordKind::InFlight);
    assert_eq!(expired.attempts, 3);
    assert_eq!(
        forget(key, expired).await,
        Forget::Forgotten,
        "forgetting_is_fenced: expired lease"
    );
    assert!(store.inspect(key).await.expect("inspect").is_none());
    acquire(store, request(key, &req)).await;

    // In doubt, and completed.
    let key = fresh_key();
    let owner = acquire(store, request(key, &req)).await;
    store
        .mark_in_doubt(key, owner, RETENTION)
        .await
        .expect("mark");
    assert_eq!(
        forget(key, look(key).await).await,
        Forget::Forgotten,
        "forgetting_is_fenced: in doubt"
    );
    acquire(store, request(key, &req)).await;

    let key = fresh_key();
    let owner = acquire(store, request(key, &req)).await;
    store
        .complete(key, owner, response("401"), RETENTION)
        .await
        .expect("complete");
    let done = look(key).await;
    assert_eq!(done.kind, RecordKind::Completed);
    assert_eq!(
        forget(key, done).await,
        Forget::Forgotten,
        "forgetting_is_fenced: completed"
    );
    assert_eq!(
        forget(key, done).await,
        Forget::Absent,
        "forgetting_is_fenced: twice"
    );
    acquire(store, request(key, &req)).await;
}

/// A store that [notifies](IdempotencyStore::notify_settled) wakes a listener subscribed
/// before each settle — `complete`, `abandon`, `mark_in_doubt` — even when the listener
/// first polls after it. Skipped for stores that cannot notify (waiters poll them).
pub async fn settle_notifications_wake_listeners(store: &dyn IdempotencyStore) {
    const PATIENCE: Duration = Duration::from_secs(5);
    let key = fresh_key();
    let req = frozen("{\"amount\":15}");
    let owner = acquire(store, request(key, &req)).await;
    let Some(settled) = store.notify_settled(key) else {
        return;
    };
    store
        .mark_in_doubt(key, owner, RETENTION)
        .await
        .expect("mark");
    tokio::time::timeout(PATIENCE, settled)
        .await
        .expect("settle_notifications_wake_listeners: mark_in_doubt did not wake the listener");

    let (owner, _) = resume(store, request(key, &req)).await;
    let settled = store.notify_settled(key).expect("notifies");
    store
        .complete(key, owner, response("done"), RETENTION)
        .await
        .expect("complete");
    tokio::time::timeout(PATIENCE, settled)
        .await
        .expect("settle_notifications_wake_listeners: complete did not wake the listener");

    let key = fresh_key();
    let owner = acquire(store, request(key, &req)).await;
    let settled = store.notify_settled(key).expect("notifies");
    store.abandon(key, owner).await.expect("abandon");
    tokio::time::timeout(PATIENCE, settled)
        .await
        .expect("settle_notifications_wake_listeners: abandon did not wake the listener");
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

/// absent → Acquired; complete; → Replay.
pub async fn acquire_complete_replay(store: &dyn IdempotencyStore) {
    let key = fresh_key();
    let req = frozen("{\"amount\":1}");
    let token = acquire(store, request(key, &req)).await;
    store
        .complete(key, token, response("done"), RETENTION)
        .await
        .expect("complete");
    match store.begin(request(key, &req)).await.expect("begin") {
        Begin::Replay(Outcome::Response(stored)) => assert_eq!(stored.body().as_ref(), b"done"),
        other => panic!("acquire_complete_replay: expected Replay, got {other:?}"),
    }
}

/// 64 concurrent `begin`s on one absent key: exactly one Acquired, the rest Busy.
pub async fn concurrent_begin_has_one_owner(store: Arc<dyn IdempotencyStore>) {
    let key = fresh_key();
    let req = frozen("{\"amount\":2}");
    let tasks: Vec<_> = (0..64)
        .map(|_| {
            let store = store.clone();
            let request = request(key, &req);
            tokio::spawn(async move { store.begin(request).await.expect("begin") })
        })
        .collect();
    let mut acquired = 0;
    for task in tasks {
        match task.await.expect("task") {
            Begin::Acquired { .. } => acquired += 1,
            Begin::Busy { .. } => {}
            other => panic!("concurrent_begin_has_one_owner: unexpected {other:?}"),
        }
    }
    assert_eq!(acquired, 1, "concurrent_begin_has_one_owner: owners");
}

/// In flight under a live lease → Busy with a retry-after within the lease.
pub async fn busy_while_in_flight(store: &dyn IdempotencyStore) {
    let key = fresh_key();
    let req = frozen("{\"amount\":3}");
    acquire(store, request(key, &req)).await;
    match store.begin(request(key, &req)).await.expect("begin") {
        Begin::Busy { retry_after } => assert!(
            retry_after <= LEASE,
            "busy_while_in_flight: {retry_after:?}"
        ),
        other => panic!("busy_while_in_flight: expected Busy, got {other:?}"),
    }
}

/// A different fingerprint answers Drift (with the stored fingerprint and request) whether
/// the record is in flight, in doubt or completed (completed, the store may answer
/// `DriftFields` instead, with the digests of the request's fields).
pub async fn drift_in_every_state(store: &dyn IdempotencyStore) {
    let original = frozen("{\"summary\":\"a\"}");
    let regenerated = frozen("{\"summary\":\"b\"}");
    for state in ["in flight", "in doubt", "completed"] {
        let key = fresh_key();
        let token = acquire(store, request(key, &original)).await;
        match state {
            "in doubt" => store
                .mark_in_doubt(key, token, RETENTION)
                .await
                .expect("mark"),
            "completed" => store
                .complete(key, token, response("x"), RETENTION)
                .await
                .expect("complete"),
            _ => {}
        }
        match store
            .begin(request(key, &regenerated))
            .await
            .expect("begin")
        {
            Begin::Drift { stored, frozen } => {
                assert_eq!(
                    stored,
                    original.fingerprint(),
                    "drift_in_every_state ({state})"
                );
                let frozen = frozen.expect("drift_in_every_state: stored request");
                assert_eq!(
                    frozen.body(),
                    original.body(),
                    "drift_in_every_state ({state})"
                );
            }
            // A completed operation is never resent: a store may keep only the digests of its
            // request's fields, which must name the field that changed.
            Begin::DriftFields { stored, fields } if state == "completed" => {
                assert_eq!(
                    stored,
                    original.fingerprint(),
                    "drift_in_every_state ({state})"
                );
                assert_eq!(
                    fields.changed_fields(regenerated.body()).as_deref(),
                    Some(&["summary".to_owned()][..]),
                    "drift_in_every_state ({state})"
                );
            }
            other => panic!("drift_in_every_state ({state}): expected Drift, got {other:?}"),
        }
    }
}

/// Writes with a token that does not own the record are refused and change nothing.
pub async fn stale_owner_writes_are_fenced(store: &dyn IdempotencyStore) {
    let key = fresh_key();
    let req = frozen("{\"amount\":4}");
    let owner = acquire(store, request(key, &req)).await;
    let stranger = LeaseToken::generate();
    assert!(store
        .complete(key, stranger, response("no"), RETENTION)
        .await
        .unwrap_err()
        .is_fenced());
    assert!(store.abandon(key, stranger).await.unwrap_err().is_fenced());
    assert!(store
        .mark_in_doubt(key, stranger, RETENTION)
        .await
        .unwrap_err()
        .is_fenced());
    // Writes to a key with no record are fenced too.
    assert!(store
        .complete(fresh_key(), owner, response("no"), RETENTION)
        .await
        .unwrap_err()
        .is_fenced());
    // The owner is unaffected.
    store
        .complete(key, owner, response("yes"), RETENTION)
        .await
        .expect("owner completes");
    // And a completed record refuses its former owner.
    assert!(store
        .complete(key, owner, response("again"), RETENTION)
        .await
        .unwrap_err()
        .is_fenced());
    match store.begin(request(key, &req)).await.expect("begin") {
        Begin::Replay(Outcome::Response(stored)) => assert_eq!(stored.body().as_ref(), b"yes"),
        other => panic!("stale_owner_writes_are_fenced: expected Replay, got {other:?}"),
    }
}

/// In doubt → Resume with a new token and the bytes first stored.
pub async fn in_doubt_resumes_with_stored_bytes(store: &dyn IdempotencyStore) {
    let key = fresh_key();
    let req = frozen("{\"amount\":5}");
    let first = acquire(store, request(key, &req)).await;
    store
        .mark_in_doubt(key, first, RETENTION)
        .await
        .expect("mark");
    // The resuming caller brings only the fingerprint: the stored request is what it resends.
    let bare = BeginRequest::new(key, req.fingerprint(), LEASE, RETENTION);
    let (second, stored) = resume(store, bare).await;
    assert_ne!(
        first, second,
        "in_doubt_resumes_with_stored_bytes: new token"
    );
    let stored = stored.expect("in_doubt_resumes_with_stored_bytes: stored request");
    assert_eq!(stored.body(), req.body());
    assert_eq!(stored.headers(), req.headers());
    assert!(store
        .complete(key, first, response("stale"), RETENTION)
        .await
        .unwrap_err()
        .is_fenced());
    store
        .complete(key, second, response("ok"), RETENTION)
        .await
        .expect("complete");
}

/// An expired lease is in doubt, never absent: Resume; the old owner is fenced.
pub async fn expired_lease_resumes_and_fences_old_owner(
    store: &dyn IdempotencyStore,
    clock: &Clock,
) {
    let key = fresh_key();
    let req = frozen("{\"amount\":6}");
    let old = acquire(store, request(key, &req)).await;
    clock.advance(LEASE + Duration::from_millis(100)).await;
    let (new, stored) = resume(store, request(key, &req)).await;
    assert_eq!(stored.expect("stored request").body(), req.body());
    assert!(
        store
            .complete(key, old, response("stale"), RETENTION)
            .await
            .unwrap_err()
            .is_fenced(),
        "expired_lease_resumes_and_fences_old_owner: stale complete applied"
    );
    store
        .complete(key, new, response("fresh"), RETENTION)
        .await
        .expect("complete");
    match store.begin(request(key, &req)).await.expect("begin") {
        Begin::Replay(Outcome::Response(stored)) => assert_eq!(stored.body().as_ref(), b"fresh"),
        other => {
            panic!("expired_lease_resumes_and_fences_old_owner: expected Replay, got {other:?}")
        }
    }
}

/// `abandon` after a first pre-write failure releases the key; after a resume (an earlier
/// attempt may have been sent) it leaves the record in doubt.
pub async fn abandon_releases_only_unsent_operations(store: &dyn IdempotencyStore) {
    let key = fresh_key();
    let req = frozen("{\"amount\":7}");
    let token = acquire(store, request(key, &req)).await;
    store.abandon(key, token).await.expect("abandon");
    let token = acquire(store, request(key, &req)).await;
    store
        .mark_in_doubt(key, token, RETENTION)
        .await
        .expect("mark");
    let (token, _) = resume(store, request(key, &req)).await;
    store
        .abandon(key, token)
        .await
        .expect("abandon after resume");
    resume(store, request(key, &req)).await;
}

/// A `begin` that reaches the store after its caller released the claim it may have made
/// (its answer was lost, the caller left) claims nothing: whether the release found no
/// record (the `begin` was still on its way) or released the claim (a retried `begin` was
/// still queued), the released token's `begin` is refused as fenced, and the key stays
/// free for everyone else. Every token released on a key is remembered.
pub async fn a_release_outlasts_a_late_claim(store: &dyn IdempotencyStore) {
    let req = frozen("{\"amount\":71}");
    let refused = |what: &str, answer: Result<Begin, crate::ledger::StoreError>| match answer {
        Err(err) if err.is_fenced() => {}
        other => panic!("a_release_outlasts_a_late_claim: {what}: expected fenced, got {other:?}"),
    };

    // The release arrives first: nothing to release, yet the late `begin` is refused…
    let key = fresh_key();
    let late = request(key, &req);
    let _ = store.abandon(key, late.token).await;
    refused("a begin after its release", store.begin(late.clone()).await);
    refused("the same begin again", store.begin(late.clone()).await);
    // …and made no claim: another caller acquires the key.
    let other = acquire(store, request(key, &req)).await;
    store.abandon(key, other).await.expect("abandon");

    // The claim was made and released; a retried `begin` of it was still queued.
    let key = fresh_key();
    let claim = request(key, &req);
    let token = acquire(store, claim.clone()).await;
    store.abandon(key, token).await.expect("abandon");
    refused(
        "a retried begin after the release",
        store.begin(claim).await,
    );
    acquire(store, request(key, &req)).await;

    // Two callers released on one key before their `begin`s arrived: both refused.
    let key = fresh_key();
    let (first, second) = (request(key, &req), request(key, &req));
    let _ = store.abandon(key, first.token).await;
    let _ = store.abandon(key, second.token).await;
    refused("the first released begin", store.begin(first.clone()).await);
    refused("the second released begin", store.begin(second).await);
    let fresh = acquire(store, request(key, &req)).await;
    // A claim under another token ended the marker: the released token meets that claim.
    assert!(
        matches!(store.begin(first).await.expect("begin"), Begin::Busy { .. }),
        "a_release_outlasts_a_late_claim: a claim takes the marker's place"
    );
    store.abandon(key, fresh).await.expect("abandon");
}

/// A record past its retention is forgotten.
pub async fn retention_expiry_forgets(store: &dyn IdempotencyStore, clock: &Clock) {
    let key = fresh_key();
    let req = frozen("{\"amount\":8}");
    let retention = Duration::from_secs(1);
    let begin =
        BeginRequest::new(key, req.fingerprint(), LEASE, retention).with_frozen(req.clone());
    let token = acquire(store, begin.clone()).await;
    store
        .complete(key, token, response("old"), retention)
        .await
        .expect("complete");
    assert!(matches!(
        store.begin(begin.clone()).await.expect("begin"),
        Begin::Replay(_)
    ));
    clock.advance(retention + Duration::from_millis(200)).await;
    acquire(store, begin).await;
}

/// A tombstone replays as a tombstone with its status.
pub async fn tombstones_replay_as_tombstones(store: &dyn IdempotencyStore) {
    let key = fresh_key();
    let req = frozen("{\"amount\":9}");
    let token = acquire(store, request(key, &req)).await;
    let tomb = Outcome::Tombstone {
        status: StatusCode::OK,
    };
    store
        .complete(key, token, tomb, RETENTION)
        .await
        .expect("complete");
    match store.begin(request(key, &req)).await.expect("begin") {
        Begin::Replay(Outcome::Tombstone { status }) => assert_eq!(status, StatusCode::OK),
        other => panic!("tombstones_replay_as_tombstones: got {other:?}"),
    }
}

/// The replayed response has the recorded status, version, repeated headers and body bytes.
pub async fn replay_is_byte_identical(store: &dyn IdempotencyStore) {
    let key = fresh_key();
    let req = frozen("{\"amount\":10}");
    let token = acquire(store, request(key, &req)).await;
    let body: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    let mut headers = HeaderMap::new();
    headers.append("x-repeated", HeaderValue::from_static("1"));
    headers.append("x-repeated", HeaderValue::from_static("2"));
    headers.insert(
        "content-type",
        HeaderValue::from_static("application/octet-stream"),
    );
    let outcome = Outcome::Response(StoredResponse::new(
        StatusCode::ACCEPTED,
        Version::HTTP_2,
        headers.clone(),
        Bytes::from(body.clone()),
    ));
    store
        .complete(key, token, outcome, RETENTION)
        .await
        .expect("complete");
    match store.begin(request(key, &req)).await.expect("begin") {
        Begin::Replay(Outcome::Response(stored)) => {
            assert_eq!(stored.status(), StatusCode::ACCEPTED);
            assert_eq!(stored.version(), Version::HTTP_2);
            assert_eq!(stored.headers(), headers);
            assert_eq!(stored.body().as_ref(), &body[..]);
        }
        other => panic!("replay_is_byte_identical: got {other:?}"),
    }
}

/// A `begin` sent again with the same token (its reply was lost) answers the same claim
/// again, `Acquired` for a fresh claim and `Resume` for a resumed one; another token is
/// still `Busy`.
pub async fn a_repeated_begin_recognises_its_own_claim(store: &dyn IdempotencyStore) {
    let key = fresh_key();
    let req = frozen("{\"amount\":11}");
    let claim = request(key, &req);
    let token = acquire(store, claim.clone()).await;
    assert_eq!(token, claim.token, "a_repeated_begin: the caller's token");
    match store.begin(claim.clone()).await.expect("begin") {
        Begin::Acquired { token: again } => assert_eq!(again, token),
        other => panic!("a_repeated_begin: expected Acquired again, got {other:?}"),
    }
    assert!(matches!(
        store.begin(request(key, &req)).await.expect("begin"),
        Begin::Busy { .. }
    ));
    store
        .mark_in_doubt(key, token, RETENTION)
        .await
        .expect("mark");
    let resume_claim = request(key, &req);
    let (resumed, _) = resume(store, resume_claim.clone()).await;
    match store.begin(resume_claim).await.expect("begin") {
        Begin::Resume { token, frozen } => {
            assert_eq!(token, resumed, "a_repeated_begin: the resumed claim");
            assert_eq!(frozen.expect("stored request").body(), req.body());
        }
        other => panic!("a_repeated_begin: expected Resume again, got {other:?}"),
    }
}

/// A probe of an in-doubt operation (or one whose lease ran out) answers `InDoubt` and
/// changes nothing: the record can still be resumed, and the stale owner of an expired
/// lease can still complete it.
pub async fn probes_change_nothing(store: &dyn IdempotencyStore, clock: &Clock) {
    let key = fresh_key();
    let req = frozen("{\"amount\":12}");
    let token = acquire(store, request(key, &req)).await;
    store
        .mark_in_doubt(key, token, RETENTION)
        .await
        .expect("mark");
    for _ in 0..3 {
        match store
            .begin(request(key, &req).probe())
            .await
            .expect("begin")
        {
            Begin::InDoubt => {}
            other => panic!("probes_change_nothing: expected InDoubt, got {other:?}"),
        }
    }
    resume(store, request(key, &req)).await;

    let key = fresh_key();
    let owner = acquire(store, request(key, &req)).await;
    clock.advance(LEASE + Duration::from_millis(100)).await;
    assert!(matches!(
        store
            .begin(request(key, &req).probe())
            .await
            .expect("begin"),
        Begin::InDoubt
    ));
    // Nobody took the operation over: its owner may still record what it did.
    store
        .complete(key, owner, response("late"), RETENTION)
        .await
        .expect("probes_change_nothing: the owner completes after a probe");
}

/// An owner that renews is never overtaken, however long it works.
pub async fn renewal_keeps_a_live_owner(store: &dyn IdempotencyStore, clock: &Clock) {
    let key = fresh_key();
    let req = frozen("{\"amount\":13}");
    let owner = acquire(store, request(key, &req)).await;
    for _ in 0..3 {
        clock.advance(LEASE / 2).await;
        store.renew(key, owner, LEASE).await.expect("renew");
    }
    // Well past the first lease, the operation is still in flight.
    match store.begin(request(key, &req)).await.expect("begin") {
        Begin::Busy { .. } => {}
        other => panic!("renewal_keeps_a_live_owner: expected Busy, got {other:?}"),
    }
    store
        .complete(key, owner, response("slow"), RETENTION)
        .await
        .expect("complete");
}

/// `renew` is fenced: a stranger, a settled operation or a taken-over lease refuse it.
pub async fn renewal_is_fenced(store: &dyn IdempotencyStore) {
    let key = fresh_key();
    let req = frozen("{\"amount\":14}");
    let owner = acquire(store, request(key, &req)).await;
    assert!(store
        .renew(key, LeaseToken::generate(), LEASE)
        .await
        .unwrap_err()
        .is_fenced());
    store
        .mark_in_doubt(key, owner, RETENTION)
        .await
        .expect("mark");
    assert!(store
        .renew(key, owner, LEASE)
        .await
        .unwrap_err()
        .is_fenced());
    let (new_owner, _) = resume(store, request(key, &req)).await;
    assert!(store
        .renew(key, owner, LEASE)
        .await
        .unwrap_err()
        .is_fenced());
    store.renew(key, new_owner, LEASE).await.expect("renew");
    assert!(store
        .renew(fresh_key(), new_owner, LEASE)
        .await
        .unwrap_err()
        .is_fenced());
}

/// For stores that implement [`IdempotencyStore::inspect`]: the view follows the record
/// through every state, and looking changes nothing. Not part of [`run_all`], since
/// inspection is optional.
pub async fn inspection_follows_the_record(store: &dyn IdempotencyStore) {
    use crate::ledger::RecordState;
    let key = fresh_key();
    let req = frozen("{\"amount\":15}");
    assert_eq!(store.inspect(key).await.expect("inspect"), None);
    let token = acquire(store, request(key, &req)).await;
    let view = store
        .inspect(key)
        .await
        .expect("inspect")
        .expect("a record");
    assert_eq!(view.fingerprint, req.fingerprint());
    assert_eq!(view.attempts, 1);
    assert!(view.retention_left > RETENTION / 2, "{view:?}");
    match view.state {
        RecordState::InFlight {
            lease_left,
            may_have_been_sent,
        } => {
            assert!(lease_left <= LEASE, "{view:?}");
            assert!(!may_have_been_sent, "{view:?}");
        }
        other => panic!("inspection_follows_the_record: expected in flight, got {other:?}"),
    }
    store
        .mark_in_doubt(key, token, RETENTION)
        .await
        .expect("mark");
    let view = store
        .inspect(key)
        .await
        .expect("inspect")
        .expect("a record");
    assert_eq!(view.state, RecordState::InDoubt);
    let (token, _) = resume(store, request(key, &req)).await;
    let view = store
        .inspect(key)
        .await
        .expect("inspect")
        .expect("a record");
    assert_eq!(view.attempts, 2, "{view:?}");
    assert!(matches!(
        view.state,
        RecordState::InFlight {
            may_have_been_sent: true,
            ..
        }
    ));
    store
        .complete(key, token, response("done"), RETENTION)
        .await
        .expect("complete");
    let view = store
        .inspect(key)
        .await
        .expect("inspect")
        .expect("a record");
    assert_eq!(
        view.state,
        RecordState::Completed {
            status: StatusCode::CREATED
        }
    );
    // Looking changed nothing: the outcome still replays.
    match store.begin(request(key, &req)).await.expect("begin") {
        Begin::Replay(Outcome::Response(stored)) => assert_eq!(stored.body().as_ref(), b"done"),
        other => panic!("inspection_follows_the_record: expected Replay, got {other:?}"),
    }
}

/// The fingerprint of the suite's requests (for stores that want to seed records).
pub fn sample_fingerprint() -> Fingerprint {
    frozen("{}").fingerprint()
}
