//! An operator resolving an operation in doubt as applied: completed with the outcome they
//! supply, fenced by what they saw.

use super::*;
use crate::ledger::{RecordState, Resolve};

/// The operator's receipt: a status the checks' own responses never have, and a body.
fn receipt(body: &'static str) -> Outcome {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    Outcome::Response(StoredResponse::new(
        StatusCode::ACCEPTED,
        Version::HTTP_11,
        headers,
        Bytes::from_static(body.as_bytes()),
    ))
}

async fn look(store: &dyn IdempotencyStore, key: LedgerKey) -> Expected {
    let view = store.inspect(key).await.expect("inspect");
    Expected::of(&view.expect("resolving: a record to look at"))
}

async fn resolve(
    store: &dyn IdempotencyStore,
    key: LedgerKey,
    expected: Expected,
    body: &'static str,
) -> Resolve {
    store
        .resolve(key, expected, receipt(body), RETENTION)
        .await
        .expect("resolve")
}

/// The next `begin` with `req` replays the receipt `body`, status and headers alike.
async fn replays_receipt(
    store: &dyn IdempotencyStore,
    key: LedgerKey,
    req: &FrozenRequest,
    body: &str,
    rule: &str,
) {
    match store.begin(request(key, req)).await.expect("begin") {
        Begin::Replay(Outcome::Response(stored)) => {
            assert_eq!(stored.status(), StatusCode::ACCEPTED, "{rule}: status");
            assert_eq!(stored.body().as_ref(), body.as_bytes(), "{rule}: body");
            assert_eq!(
                stored.headers().get("content-type"),
                Some(&HeaderValue::from_static("application/json")),
                "{rule}: headers"
            );
        }
        other => panic!("{rule}: expected the replay of the operator's receipt, got {other:?}"),
    }
}

/// A record in doubt: claimed with `req`, marked in doubt. Answers the claim's token.
async fn in_doubt(store: &dyn IdempotencyStore, key: LedgerKey, req: &FrozenRequest) -> LeaseToken {
    let owner = acquire(store, request(key, req)).await;
    store
        .mark_in_doubt(key, owner, RETENTION)
        .await
        .expect("mark");
    owner
}

/// [`resolve`](IdempotencyStore::resolve) completes a record with the operator's outcome
/// only if it is still the open record an [`inspect`](IdempotencyStore::inspect) showed:
/// an absent key is `Absent`; a record in doubt is resolved, and the next `begin` with the
/// same request replays the receipt (one with another request drifts; the old owner is
/// fenced; a listener is woken, on a store that notifies); a second resolve of the same
/// look is `Changed`; a look at a completed record is `NotInDoubt` and its outcome stays; a
/// look at an earlier life of the key is `Changed` and the new life stays in doubt; a live
/// lease is `Live` (still busy) until forced; a lease that ran out is resolved.
pub async fn resolving_is_fenced(store: &dyn IdempotencyStore, clock: &Clock) {
    const LIVE: Duration = Duration::from_secs(30);
    const PATIENCE: Duration = Duration::from_secs(5);
    let req = frozen("{\"amount\":21}");

    let key = fresh_key();
    let nobody = Expected::new(
        RecordKind::InDoubt,
        req.fingerprint(),
        1,
        Generation::random(),
    );
    assert_eq!(
        resolve(store, key, nobody, "{}").await,
        Resolve::Absent,
        "resolving_is_fenced: absent"
    );
    assert!(
        store.inspect(key).await.expect("inspect").is_none(),
        "resolving_is_fenced: resolving an absent key made a record"
    );

    // In doubt: resolved, replayed, drift for another payload, the old owner fenced.
    let owner = in_doubt(store, key, &req).await;
    let seen = look(store, key).await;
    let settled = store.notify_settled(key);
    assert_eq!(
        resolve(store, key, seen, "{\"id\":\"ch_1\"}").await,
        Resolve::Resolved,
        "resolving_is_fenced: in doubt"
    );
    if let Some(settled) = settled {
        tokio::time::timeout(PATIENCE, settled)
            .await
            .expect("resolving_is_fenced: a resolve did not wake the listener");
    }
    let view = store
        .inspect(key)
        .await
        .expect("inspect")
        .expect("resolving_is_fenced: the resolved record");
    assert_eq!(
        view.state,
        RecordState::Completed {
            status: StatusCode::ACCEPTED
        },
        "resolving_is_fenced: resolved is completed with the receipt's status"
    );
    assert_eq!(
        (view.generation, view.fingerprint, view.attempts),
        (seen.generation, seen.fingerprint, seen.attempts),
        "resolving_is_fenced: a resolve keeps the record's life, fingerprint and attempts"
    );
    replays_receipt(store, key, &req, "{\"id\":\"ch_1\"}", "resolving_is_fenced").await;
    match store
        .begin(request(key, &frozen("{\"amount\":22}")))
        .await
        .expect("begin")
    {
        Begin::Drift { stored, .. } | Begin::DriftFields { stored, .. } => assert_eq!(
            stored,
            req.fingerprint(),
            "resolving_is_fenced: drift names the fingerprint on record"
        ),
        other => panic!("resolving_is_fenced: another payload must drift, got {other:?}"),
    }
    assert!(
        store
            .complete(key, owner, response("late"), RETENTION)
            .await
            .unwrap_err()
            .is_fenced(),
        "resolving_is_fenced: the old owner's write applied over a resolve"
    );
    assert_eq!(
        resolve(store, key, seen, "{\"id\":\"ch_2\"}").await,
        Resolve::Changed,
        "resolving_is_fenced: the same look twice"
    );
    // A look at the completed record: never resolved over.
    assert_eq!(
        resolve(store, key, look(store, key).await, "{\"id\":\"ch_3\"}").await,
        Resolve::NotInDoubt,
        "resolving_is_fenced: completed"
    );
    replays_receipt(
        store,
        key,
        &req,
        "{\"id\":\"ch_1\"}",
        "resolving_is_fenced: completed",
    )
    .await;

    // A look at an earlier life of the key, alike in all else, changes nothing.
    let key = fresh_key();
    in_doubt(store, key, &req).await;
    let earlier = look(store, key).await;
    assert_eq!(
        store.forget(key, earlier).await.expect("forget"),
        Forget::Forgotten
    );
    in_doubt(store, key, &req).await;
    let now = look(store, key).await;
    assert_ne!(
        now.generation, earlier.generation,
        "resolving_is_fenced: a new life kept the generation"
    );
    assert_eq!(
        resolve(store, key, earlier, "{\"id\":\"stale\"}").await,
        Resolve::Changed,
        "resolving_is_fenced: a look at an earlier life"
    );
    assert_eq!(
        look(store, key).await,
        now,
        "resolving_is_fenced: a refused resolve changed the record"
    );
    let probe = BeginRequest::new(key, req.fingerprint(), LEASE, RETENTION).probe();
    assert!(
        matches!(store.begin(probe).await.expect("begin"), Begin::InDoubt),
        "resolving_is_fenced: after a refused resolve, still in doubt"
    );

    // A live owner keeps its operation unless the operator forces it.
    let key = fresh_key();
    let live = BeginRequest::new(key, req.fingerprint(), LIVE, RETENTION).with_frozen(req.clone());
    let owner = acquire(store, live.clone()).await;
    let seen = look(store, key).await;
    assert!(
        matches!(
            resolve(store, key, seen, "{\"id\":\"live\"}").await,
            Resolve::Live { lease_left } if lease_left <= LIVE
        ),
        "resolving_is_fenced: a live lease was not answered Live"
    );
    assert!(
        matches!(
            store
                .begin(BeginRequest::new(key, req.fingerprint(), LIVE, RETENTION))
                .await
                .expect("begin"),
            Begin::Busy { .. }
        ),
        "resolving_is_fenced: a refused resolve changed a live record"
    );
    assert_eq!(
        resolve(store, key, seen.force(), "{\"id\":\"forced\"}").await,
        Resolve::Resolved,
        "resolving_is_fenced: forced"
    );
    assert!(
        store
            .complete(key, owner, response("late"), RETENTION)
            .await
            .unwrap_err()
            .is_fenced(),
        "resolving_is_fenced: the overridden owner's write applied"
    );
    replays_receipt(
        store,
        key,
        &req,
        "{\"id\":\"forced\"}",
        "resolving_is_fenced: forced",
    )
    .await;

    // A lease that ran out protects nobody: resolved as seen.
    let key = fresh_key();
    acquire(store, request(key, &req)).await;
    clock.advance(LEASE + Duration::from_millis(100)).await;
    let expired = look(store, key).await;
    assert_eq!(expired.kind, RecordKind::InFlight);
    assert_eq!(
        resolve(store, key, expired, "{\"id\":\"expired\"}").await,
        Resolve::Resolved,
        "resolving_is_fenced: expired lease"
    );
    replays_receipt(
        store,
        key,
        &req,
        "{\"id\":\"expired\"}",
        "resolving_is_fenced: expired",
    )
    .await;
}
