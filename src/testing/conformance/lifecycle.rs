//! A record over time and under an operator: retention, probes, inspection, forgetting,
//! settle notifications.

use super::*;

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
    let expected = Expected::new(
        RecordKind::Completed,
        req.fingerprint(),
        1,
        Generation::random(),
    );
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

/// A look only ever forgets the life of the key it saw. Each life has its own
/// [`Generation`], unchanged through claim, in doubt, resume and completion; a key whose
/// record was forgotten, or passed its retention, and was claimed and completed again
/// (the same request, on its first attempt: alike in everything else) is another life,
/// and a look at the earlier one is answered `Changed` and removes nothing: the later
/// outcome still replays.
pub async fn a_look_forgets_only_the_life_it_saw(store: &dyn IdempotencyStore, clock: &Clock) {
    let look = |key| async move {
        store
            .inspect(key)
            .await
            .expect("inspect")
            .expect("a_look_forgets_only_the_life_it_saw: a record to look at")
    };
    let req = frozen("{\"amount\":19}");

    // One life keeps its generation through every transition.
    let key = fresh_key();
    let owner = acquire(store, request(key, &req)).await;
    let first = look(key).await.generation;
    store
        .mark_in_doubt(key, owner, RETENTION)
        .await
        .expect("mark");
    let in_doubt = look(key).await.generation;
    let (owner, _) = resume(store, request(key, &req)).await;
    let resumed = look(key).await.generation;
    store
        .complete(key, owner, response("401"), RETENTION)
        .await
        .expect("complete");
    let completed = look(key).await;
    assert_eq!(
        [in_doubt, resumed, completed.generation],
        [first; 3],
        "a_look_forgets_only_the_life_it_saw: a transition changed the generation"
    );

    // Forgotten by one look, claimed and completed again: an older look is refused.
    let key = fresh_key();
    let owner = acquire(store, request(key, &req)).await;
    store
        .complete(key, owner, response("401"), RETENTION)
        .await
        .expect("complete");
    let seen = Expected::of(&look(key).await);
    assert_eq!(
        store.forget(key, seen).await.expect("forget"),
        Forget::Forgotten
    );
    let owner = acquire(store, request(key, &req)).await;
    store
        .complete(key, owner, response("201"), RETENTION)
        .await
        .expect("complete");
    let again = look(key).await;
    assert_ne!(
        again.generation, seen.generation,
        "a_look_forgets_only_the_life_it_saw: a life after a forget kept the generation"
    );
    assert_eq!(
        store.forget(key, seen).await.expect("forget"),
        Forget::Changed,
        "a_look_forgets_only_the_life_it_saw: a look at a forgotten life forgot the next"
    );
    replays(store, key, &req, b"201").await;

    // Past its retention, claimed and completed again: the same.
    let key = fresh_key();
    let retention = Duration::from_secs(1);
    let short =
        BeginRequest::new(key, req.fingerprint(), LEASE, retention).with_frozen(req.clone());
    let owner = acquire(store, short.clone()).await;
    store
        .complete(key, owner, response("401"), retention)
        .await
        .expect("complete");
    let seen = Expected::of(&look(key).await);
    clock.advance(retention + Duration::from_millis(200)).await;
    let owner = acquire(store, request(key, &req)).await;
    store
        .complete(key, owner, response("201"), RETENTION)
        .await
        .expect("complete");
    assert_eq!(
        store.forget(key, seen).await.expect("forget"),
        Forget::Changed,
        "a_look_forgets_only_the_life_it_saw: a look at an expired life forgot the next"
    );
    replays(store, key, &req, b"201").await;
}

/// `key`'s record replays the response whose body is `body`.
async fn replays(store: &dyn IdempotencyStore, key: LedgerKey, req: &FrozenRequest, body: &[u8]) {
    match store.begin(request(key, req)).await.expect("begin") {
        Begin::Replay(Outcome::Response(stored)) => assert_eq!(stored.body().as_ref(), body),
        other => panic!("expected the replay of {body:?}, got {other:?}"),
    }
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

/// For stores that implement [`IdempotencyStore::inspect`]: the view follows the record
/// through every state, in one [`Generation`], with the [`Origin`](crate::ledger::Origin)
/// its claim gave it (a resume's is not kept; a claim naming none: its frozen request's,
/// [`BeginRequest::named_origin`](crate::ledger::BeginRequest::named_origin)), and looking
/// changes nothing. Not part of [`run_all`], since inspection is optional.
pub async fn inspection_follows_the_record(store: &dyn IdempotencyStore) {
    use crate::ledger::{Origin, RecordState};
    let key = fresh_key();
    let req = frozen("{\"amount\":15}");
    assert_eq!(store.inspect(key).await.expect("inspect"), None);
    let origin = Origin::client(req.method(), req.uri())
        .with_operation(&crate::OperationId::new("task-é", "step-1"));
    let token = acquire(store, request(key, &req).with_origin(origin.clone())).await;
    let view = store
        .inspect(key)
        .await
        .expect("inspect")
        .expect("a record");
    assert_eq!(view.origin.as_ref(), Some(&origin), "{view:?}");
    assert_eq!(origin.target(), "POST http://provider.local/charges");
    assert_eq!(view.fingerprint, req.fingerprint());
    assert_eq!(view.attempts, 1);
    let generation = view.generation;
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
    let another = Origin::tool("another");
    let (token, _) = resume(store, request(key, &req).with_origin(another)).await;
    let view = store
        .inspect(key)
        .await
        .expect("inspect")
        .expect("a record");
    assert_eq!(view.attempts, 2, "{view:?}");
    assert_eq!(view.generation, generation, "{view:?}");
    assert_eq!(
        view.origin.as_ref(),
        Some(&origin),
        "a resume keeps the claim's origin"
    );
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
    assert_eq!(view.generation, generation, "{view:?}");
    assert_eq!(view.origin.as_ref(), Some(&origin), "{view:?}");
    // Looking changed nothing: the outcome still replays.
    match store.begin(request(key, &req)).await.expect("begin") {
        Begin::Replay(Outcome::Response(stored)) => assert_eq!(stored.body().as_ref(), b"done"),
        other => panic!("inspection_follows_the_record: expected Replay, got {other:?}"),
    }
    // A claim that names no origin of its own is of its frozen request, as the client
    // face's claims are (`BeginRequest::named_origin`).
    let unnamed = fresh_key();
    acquire(store, request(unnamed, &req)).await;
    let view = store
        .inspect(unnamed)
        .await
        .expect("inspect")
        .expect("a record");
    let origin = view.origin.expect("the frozen request's origin");
    assert_eq!(origin.target(), "POST http://provider.local/charges");
    assert_eq!(origin.face(), crate::ledger::OriginFace::Client);
}

/// For stores that implement [`IdempotencyStore::inspect`]: the frozen request a record was
/// made with, as [`RecordView::request`](crate::ledger::RecordView) shows it while the
/// operation is in flight and in doubt, is the very request stored by `begin`, byte for
/// byte (method, URI, headers in order, body), and a completed record shows none (nothing
/// of it will be resent). Showing it is optional: a store that answers `None` passes, and
/// the answer says whether the request was shown in doubt (the built-in stores show it).
/// Not part of [`run_all`], since inspection is optional.
///
/// ```
/// use tower_idempotency::ledger::MemoryStore;
/// use tower_idempotency::testing::conformance::inspection_shows_the_frozen_request;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// assert!(inspection_shows_the_frozen_request(&MemoryStore::new()).await);
/// # }
/// ```
pub async fn inspection_shows_the_frozen_request(store: &dyn IdempotencyStore) -> bool {
    let key = fresh_key();
    let req = frozen_with_head("{\"amount\":16,\"card\":{\"number\":\"4242\"}}");
    let token = acquire(store, request(key, &req)).await;
    let in_flight = store
        .inspect(key)
        .await
        .expect("inspect")
        .expect("a record");
    same_request_if_shown(&in_flight.request, &req, "in flight");
    store
        .mark_in_doubt(key, token, RETENTION)
        .await
        .expect("mark");
    let in_doubt = store
        .inspect(key)
        .await
        .expect("inspect")
        .expect("a record");
    same_request_if_shown(&in_doubt.request, &req, "in doubt");
    let (token, _) = resume(store, request(key, &req)).await;
    store
        .complete(key, token, response("done"), RETENTION)
        .await
        .expect("complete");
    let completed = store
        .inspect(key)
        .await
        .expect("inspect")
        .expect("a record");
    assert_eq!(
        completed.request, None,
        "inspection_shows_the_frozen_request: a completed record shows none"
    );
    in_doubt.request.is_some()
}

/// A request with a query, repeated headers and a key header: every part a store encodes.
fn frozen_with_head(body: &'static str) -> FrozenRequest {
    let mut headers = http::HeaderMap::new();
    headers.append(
        "content-type",
        http::HeaderValue::from_static("application/json"),
    );
    headers.append(
        "idempotency-key",
        http::HeaderValue::from_static("\"order-16\""),
    );
    headers.append("x-trace", http::HeaderValue::from_static("a"));
    headers.append("x-trace", http::HeaderValue::from_static("b"));
    FrozenRequest::from_parts(
        http::Method::PUT,
        "http://provider.local/charges/16?expand=card"
            .parse()
            .expect("static URI"),
        http::Version::HTTP_11,
        headers,
        bytes::Bytes::from_static(body.as_bytes()),
    )
}

fn same_request_if_shown(shown: &Option<FrozenRequest>, stored: &FrozenRequest, state: &str) {
    let Some(shown) = shown else { return };
    let context = format!("inspection_shows_the_frozen_request: {state}");
    assert_eq!(shown.method(), stored.method(), "{context}: method");
    assert_eq!(shown.uri(), stored.uri(), "{context}: URI");
    let pairs = |request: &FrozenRequest| -> Vec<(String, Vec<u8>)> {
        request
            .headers()
            .iter()
            .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
            .collect()
    };
    assert_eq!(pairs(shown), pairs(stored), "{context}: headers, in order");
    assert_eq!(shown.body(), stored.body(), "{context}: body");
    assert_eq!(shown, stored, "{context}");
}
