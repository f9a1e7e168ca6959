//! The owner's token: stale writes fenced, doubt resumed with the stored bytes, releases,
//! renewals, held leases.

use super::*;

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

/// A `begin` whose answer was lost is released by its caller while *another* caller holds
/// the key: the release finds nothing of its token's (fenced), yet the token stays released,
/// so the late `begin`, whenever it lands in the minute after, claims nothing and takes
/// nothing over: not while the other caller's record is there, in whatever state, nor once
/// that record has left (released, or forgotten by an operator). Only a new claim of the key
/// by someone else ends the marker.
pub async fn a_release_outlasts_another_callers_record(store: &dyn IdempotencyStore) {
    let req = frozen("{\"amount\":72}");
    let refused = |what: &str, answer: Result<Begin, crate::ledger::StoreError>| match answer {
        Err(err) if err.is_fenced() => {}
        other => panic!(
            "a_release_outlasts_another_callers_record: {what}: expected fenced, got {other:?}"
        ),
    };

    // The other caller releases its own claim: the key is absent, the late `begin` refused.
    let key = fresh_key();
    let late = request(key, &req);
    let holder = acquire(store, request(key, &req)).await;
    assert!(
        store
            .abandon(key, late.token)
            .await
            .unwrap_err()
            .is_fenced(),
        "a_release_outlasts_another_callers_record: nothing of the late token's to release"
    );
    refused(
        "a late begin while the other caller holds the key",
        store.begin(late.clone()).await,
    );
    store.abandon(key, holder).await.expect("abandon");
    refused(
        "a late begin once the holder released the key",
        store.begin(late.clone()).await,
    );
    let fresh = acquire(store, request(key, &req)).await;
    store.abandon(key, fresh).await.expect("abandon");

    // The other caller's record goes in doubt: the late `begin` does not take it over.
    let key = fresh_key();
    let late = request(key, &req);
    let holder = acquire(store, request(key, &req)).await;
    let _ = store.abandon(key, late.token).await;
    store
        .mark_in_doubt(key, holder, RETENTION)
        .await
        .expect("mark");
    refused(
        "a late begin on an operation in doubt",
        store.begin(late.clone()).await,
    );
    let (owner, _) = resume(store, request(key, &req)).await;
    refused(
        "a late begin on the resumed operation",
        store.begin(late).await,
    );
    store
        .complete(key, owner, response("resumed"), RETENTION)
        .await
        .expect("complete");

    // The other caller completes, and an operator forgets the record: still refused.
    let key = fresh_key();
    let late = request(key, &req);
    let holder = acquire(store, request(key, &req)).await;
    let _ = store.abandon(key, late.token).await;
    store
        .complete(key, holder, response("held"), RETENTION)
        .await
        .expect("complete");
    refused(
        "a late begin on a completed operation",
        store.begin(late.clone()).await,
    );
    let seen = store
        .inspect(key)
        .await
        .expect("inspect")
        .expect("a_release_outlasts_another_callers_record: a record to look at");
    assert!(
        matches!(
            store
                .forget(key, Expected::of(&seen))
                .await
                .expect("forget"),
            Forget::Forgotten
        ),
        "a_release_outlasts_another_callers_record: the record was not forgotten"
    );
    refused(
        "a late begin once the record was forgotten",
        store.begin(late.clone()).await,
    );
    // A new claim under another token ends the marker: the late token meets that claim.
    let fresh = acquire(store, request(key, &req)).await;
    assert!(
        matches!(store.begin(late).await.expect("begin"), Begin::Busy { .. }),
        "a_release_outlasts_another_callers_record: a new claim ends the marker"
    );
    store.abandon(key, fresh).await.expect("abandon");
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

/// A store that [holds leases](IdempotencyStore::hold_lease) keeps a held one in flight
/// however long its owner works, holds only for the owning token of an open record, and lets
/// a lease let go end a lease later. (A store that does not hold has nothing to check.)
pub async fn a_held_lease_lasts_until_let_go(store: &dyn IdempotencyStore, clock: &Clock) {
    let key = fresh_key();
    let req = frozen("{\"amount\":15}");
    let owner = acquire(store, request(key, &req)).await;
    assert!(
        !store.hold_lease(key, LeaseToken::generate(), LEASE),
        "a_held_lease_lasts_until_let_go: a stranger's token is not held"
    );
    if !store.hold_lease(key, owner, LEASE) {
        store.abandon(key, owner).await.expect("abandon");
        return;
    }
    clock.advance(LEASE * 2).await;
    match store.begin(request(key, &req)).await.expect("begin") {
        Begin::Busy { .. } => {}
        other => panic!("a_held_lease_lasts_until_let_go: expected Busy, got {other:?}"),
    }
    // Let go, it runs a lease from now: still in flight at once, in doubt a lease later.
    store.let_go(key, owner, LEASE);
    match store.begin(request(key, &req)).await.expect("begin") {
        Begin::Busy { .. } => {}
        other => panic!(
            "a_held_lease_lasts_until_let_go: expected Busy just after it was let go, got {other:?}"
        ),
    }
    clock.advance(LEASE + Duration::from_millis(50)).await;
    let (new_owner, _) = resume(store, request(key, &req)).await;
    assert!(
        !store.hold_lease(key, owner, LEASE),
        "a_held_lease_lasts_until_let_go: the overtaken owner holds nothing"
    );
    store
        .complete(key, new_owner, response("held"), RETENTION)
        .await
        .expect("complete");
    assert!(
        !store.hold_lease(key, new_owner, LEASE),
        "a_held_lease_lasts_until_let_go: a completed record is not held"
    );
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
