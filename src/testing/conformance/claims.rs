//! Claiming a key: one owner, busy while in flight, drift, replay, a repeated begin.

use super::*;

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

/// A completed operation whose body is no JSON object (a form, bytes) still answers a
/// regenerated request with a request to judge it by: the one first frozen
/// ([`Begin::Drift`] with it), or field digests ([`Begin::DriftFields`], naming no field).
/// A drift from no request at all is refused by every face, where the same operation on
/// another store would continue with the bytes first frozen and replay its outcome.
pub async fn completed_drift_keeps_a_request_to_judge_by(store: &dyn IdempotencyStore) {
    let original = frozen("amount=5&note=first+try");
    let regenerated = frozen("amount=5&note=second+try");
    let key = fresh_key();
    let token = acquire(store, request(key, &original)).await;
    store
        .complete(key, token, response("x"), RETENTION)
        .await
        .expect("complete");
    let name = "completed_drift_keeps_a_request_to_judge_by";
    match store
        .begin(request(key, &regenerated))
        .await
        .expect("begin")
    {
        Begin::Drift {
            stored,
            frozen: Some(frozen),
        } => {
            assert_eq!(stored, original.fingerprint(), "{name}");
            assert_eq!(frozen.body(), original.body(), "{name}");
        }
        Begin::DriftFields { stored, fields } => {
            assert_eq!(stored, original.fingerprint(), "{name}");
            assert_eq!(fields.changed_fields(regenerated.body()), None, "{name}");
        }
        other => panic!("{name}: expected a drift from the first request, got {other:?}"),
    }
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
