//! `MemoryStore`: its byte cap, its two clocks of expiry, and its use behind an `Arc`.
//!
//! These drive the ledger protocol directly (`begin`, `complete`, …) with distinct
//! `LedgerKey`s; the protocol itself is the conformance suite's business (tests/ledger/conformance.rs).

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, StatusCode, Version};
use tower_idempotency::ledger::{
    Begin, BeginRequest, Expected, Forget, IdempotencyStore, LeaseToken, LedgerKey, MemoryStore,
    Outcome, RecordKind, RecordState, StoredResponse,
};
use tower_idempotency::ProviderKeys;
use tower_idempotency::{fingerprint::Fingerprint, FrozenRequest, IdempotencyLayer, KeyHeader};

const KIB: usize = 1024;
const MIB: usize = 1024 * KIB;
const LEASE: Duration = Duration::from_secs(30);
const RETENTION: Duration = Duration::from_secs(24 * 60 * 60);
const MS: Duration = Duration::from_millis(1);

/// A distinct key per `n` (and per test, through `salt`).
fn key(salt: u8, n: u32) -> LedgerKey {
    let mut bytes = [salt; 32];
    bytes[..4].copy_from_slice(&n.to_be_bytes());
    LedgerKey::from_bytes(bytes)
}

fn fingerprint(n: u32) -> Fingerprint {
    Fingerprint::of(
        &Method::POST,
        "/charges",
        format!("{{\"n\":{n}}}").as_bytes(),
    )
}

/// A claim whose completion may be evicted as soon as room is needed (no protected
/// window): these tests are about the byte cap itself. The protected window has its own
/// tests (tests/ledger/ledger_pressure.rs).
fn begin_request(key: LedgerKey, n: u32) -> BeginRequest {
    BeginRequest::new(key, fingerprint(n), LEASE, RETENTION).with_protected_window(Duration::ZERO)
}

fn response(body: Bytes) -> Outcome {
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    Outcome::Response(StoredResponse::new(
        StatusCode::CREATED,
        Version::HTTP_11,
        headers,
        body,
    ))
}

async fn acquire(store: &impl IdempotencyStore, request: BeginRequest) -> LeaseToken {
    match store.begin(request).await.unwrap() {
        Begin::Acquired { token } => token,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

fn replayed_body(begin: Begin) -> Bytes {
    match begin {
        Begin::Replay(Outcome::Response(response)) => response.body().clone(),
        other => panic!("expected a replayed response, got {other:?}"),
    }
}

/// Complete `key` as `token` with `body`, then check that a repeat replays it.
async fn complete_and_replay(
    store: &impl IdempotencyStore,
    key: LedgerKey,
    token: LeaseToken,
    body: impl Into<Bytes>,
) {
    let body = body.into();
    store
        .complete(key, token, response(body.clone()), RETENTION)
        .await
        .unwrap();
    assert_eq!(
        replayed_body(store.begin(begin_request(key, 0)).await.unwrap()),
        body
    );
}

/// Claim and complete operations `0..ops` under `salt`, each with a zeroed body of
/// `body_len` bytes.
async fn complete_many(store: &impl IdempotencyStore, salt: u8, ops: u32, body_len: usize) {
    for n in 0..ops {
        let token = acquire(store, begin_request(key(salt, n), n)).await;
        let body = Bytes::from(vec![0; body_len]);
        store
            .complete(key(salt, n), token, response(body), RETENTION)
            .await
            .unwrap();
    }
}

// ---------------------------------------------------------------------------------------
// The byte cap
// ---------------------------------------------------------------------------------------

#[tokio::test]
async fn byte_cap_holds_after_ten_times_its_size_in_outcomes() {
    const OPS: u32 = 1000;
    const BODY: usize = 10 * KIB;
    let store = MemoryStore::builder().max_bytes(MIB as u64).build();

    for n in 0..OPS {
        let key = key(1, n);
        let token = acquire(&store, begin_request(key, n)).await;
        let body = Bytes::from(vec![(n % 251) as u8; BODY]);
        store
            .complete(key, token, response(body), RETENTION)
            .await
            .unwrap();
    }
    store.run_pending_tasks().await;

    // 10 MiB of outcomes went in; at most 1 MiB stays.
    let weight = store.weighted_size();
    assert!(
        weight <= MIB as u64,
        "weighted_size {weight} over the 1 MiB cap"
    );
    let entries = store.entry_count();
    assert!(
        entries <= (MIB / BODY) as u64,
        "{entries} records of more than {BODY} bytes each cannot fit in 1 MiB"
    );
    // LRU fills the budget rather than emptying the cache.
    assert!(entries >= 50, "only {entries} records kept");
    assert!(
        weight >= (entries as usize * BODY) as u64,
        "{weight} for {entries}"
    );

    // The most recent operations are still on record and replay their bodies.
    for n in OPS - 20..OPS {
        let body = replayed_body(store.begin(begin_request(key(1, n), n)).await.unwrap());
        assert_eq!(body.len(), BODY, "operation {n}");
        assert!(body.iter().all(|b| *b == (n % 251) as u8), "operation {n}");
    }
    // The oldest were evicted: to this store they are new operations.
    for n in 0..5 {
        acquire(&store, begin_request(key(1, n), n)).await;
    }
}

#[tokio::test]
async fn byte_pressure_never_hands_out_an_operation_still_in_flight() {
    let store = MemoryStore::builder().max_bytes(MIB as u64).build();
    let in_flight = key(15, u32::MAX);
    acquire(&store, begin_request(in_flight, 0)).await;

    // Other operations complete meanwhile, ten times the cap's worth.
    complete_many(&store, 15, 1000, 10 * KIB).await;
    store.run_pending_tasks().await;

    // The first owner's lease (30 s) is still live: nobody else may own the operation.
    match store.begin(begin_request(in_flight, 0)).await.unwrap() {
        Begin::Busy { .. } => {}
        other => panic!("a second owner for an operation in flight: {other:?}"),
    }
}

/// A completion makes its outcome's room before it looks at its lease: at the cap, one
/// whose lease was lost is still refused as fenced, and the operation's new owner records
/// and replays its own outcome.
#[tokio::test(start_paused = true)]
async fn at_the_cap_a_completion_by_a_lost_lease_is_fenced_and_the_new_owner_records() {
    const BODY: usize = 10 * KIB;
    let store = MemoryStore::builder().max_bytes(MIB as u64).build();
    complete_many(&store, 19, 200, BODY).await;
    let contested = key(19, u32::MAX);
    let first = acquire(&store, begin_request(contested, 0)).await;
    tokio::time::advance(LEASE + MS).await;
    let second = match store.begin(begin_request(contested, 0)).await.unwrap() {
        Begin::Resume { token, .. } => token,
        other => panic!("expected Resume after the lease ended, got {other:?}"),
    };

    let late = Bytes::from(vec![b'l'; BODY]);
    let stale = store
        .complete(contested, first, response(late), RETENTION)
        .await;
    assert!(stale.unwrap_err().is_fenced());
    // The new owner's outcome, whole.
    complete_and_replay(&store, contested, second, vec![b'o'; BODY]).await;
    let weight = store.weighted_size();
    assert!(weight <= MIB as u64, "weighted_size {weight} over the cap");
}

/// At the cap every new operation evicts one record; a completion that evicts also makes
/// the room the next claim needs, so claims evict nothing while completions can. With every
/// record protected, a completion that has the room for its outcome still records it whole,
/// evicting nothing.
#[tokio::test(start_paused = true)]
async fn at_the_cap_completions_evict_for_the_next_claim_too() {
    const BODY: usize = KIB;
    const LIVE: u64 = 50;
    // One completed record's weight, and a store holding exactly `LIVE` of them.
    let probe = MemoryStore::new();
    complete_many(&probe, 29, 10, BODY).await;
    let record = probe.weighted_size() / probe.entry_count();
    let store = MemoryStore::builder().max_bytes(LIVE * record).build();
    complete_many(&store, 30, LIVE as u32, BODY).await;
    // The last completion made the room for one more claim.
    assert_eq!(store.entry_count(), LIVE - 1);

    let mut claims_evicted = 0;
    let mut completions_evicted = 0;
    for n in 0..200 {
        let before = store.evictions();
        let token = acquire(&store, begin_request(key(31, n), 0)).await;
        let claimed = store.evictions();
        complete_and_replay(&store, key(31, n), token, vec![1; BODY]).await;
        claims_evicted += claimed - before;
        completions_evicted += store.evictions() - claimed;
        assert!(store.weighted_size() <= store.max_bytes());
    }
    // The first claim found the store full; from then on, completions made the room.
    assert!(
        claims_evicted <= 1,
        "claims evicted {claims_evicted} records"
    );
    assert!(
        (199..=201).contains(&completions_evicted),
        "completions evicted {completions_evicted} records"
    );
    assert!(
        store.entry_count() >= LIVE - 2,
        "{} live",
        store.entry_count()
    );

    // Every record protected: a completion that has room for its outcome records it whole,
    // and makes no room for a claim by evicting what the window protects.
    let protected = |key, n| {
        BeginRequest::new(key, fingerprint(n), LEASE, RETENTION)
            .with_protected_window(Duration::from_secs(3600))
    };
    let full = MemoryStore::builder().max_bytes(LIVE * record).build();
    let mut recorded = 0;
    for n in 0.. {
        let token = match full.begin(protected(key(32, n), 0)).await {
            Ok(Begin::Acquired { token }) => token,
            Ok(other) => panic!("expected Acquired, got {other:?}"),
            Err(err) if err.is_full() => break,
            Err(err) => panic!("{err}"),
        };
        complete_and_replay(&full, key(32, n), token, vec![2; BODY]).await;
        recorded += 1;
    }
    assert_eq!(full.evictions(), 0, "a protected record was evicted");
    assert!(recorded >= LIVE - 1, "only {recorded} recorded");
}

#[tokio::test]
async fn a_record_heavier_than_the_cap_is_never_forgotten_silently() {
    let store = MemoryStore::builder().max_bytes(MIB as u64).build();
    let frozen = frozen_of(2 * MIB);
    let request =
        BeginRequest::new(key(16, 0), frozen.fingerprint(), LEASE, RETENTION).with_frozen(frozen);
    match store.begin(request.clone()).await {
        // Refusing the claim up front is a fine answer: nothing was sent.
        Err(_) => {}
        Ok(Begin::Acquired { .. }) => {
            store.run_pending_tasks().await;
            let again = store.begin(request).await;
            assert!(
                !matches!(again, Ok(Begin::Acquired { .. })),
                "the operation was forgotten while its first owner holds it"
            );
        }
        Ok(other) => panic!("unexpected {other:?}"),
    }
}

/// A claim larger than the whole budget is refused without evicting anything for it, and
/// leaves no headroom behind: the next completion evicts what it and one ordinary claim
/// need, not every evictable record.
#[tokio::test]
async fn an_outsized_claim_evicts_nothing_and_completions_evict_what_they_need() {
    let store = MemoryStore::builder().max_bytes(MIB as u64).build();
    complete_many(&store, 42, 2000, KIB).await;
    let live = store.entry_count();
    let record = store.weighted_size() / live;
    let open = acquire(&store, begin_request(key(43, 0), 0)).await;
    let evicted = store.evictions();

    let frozen = frozen_of(2 * MIB);
    let outsized =
        BeginRequest::new(key(43, 1), frozen.fingerprint(), LEASE, RETENTION).with_frozen(frozen);
    let refused = store.begin(outsized).await.unwrap_err();
    assert!(refused.is_full(), "{refused}");
    assert_eq!(
        store.evictions(),
        evicted,
        "evicted for a claim that cannot fit"
    );

    complete_and_replay(&store, key(43, 0), open, vec![3; KIB]).await;
    let by_completion = store.evictions() - evicted;
    // Its own outcome and one claim's room (at most a sixteenth of the budget).
    let most = (MIB as u64 / 16) / record + 2;
    assert!(
        by_completion <= most,
        "one completion evicted {by_completion} of {live} records (at most {most})"
    );

    // A large claim that fits (a quarter of the budget) makes completions leave room for at
    // most a sixteenth of the budget, not for another one like it.
    let open = acquire(&store, begin_request(key(43, 2), 0)).await;
    let large = frozen_of(MIB / 4);
    let large =
        BeginRequest::new(key(43, 3), large.fingerprint(), LEASE, RETENTION).with_frozen(large);
    assert!(matches!(
        store.begin(large).await.unwrap(),
        Begin::Acquired { .. }
    ));
    let evicted = store.evictions();
    complete_and_replay(&store, key(43, 2), open, vec![4; KIB]).await;
    let by_completion = store.evictions() - evicted;
    assert!(
        by_completion <= most,
        "one completion evicted {by_completion} records after a large claim (at most {most})"
    );
}

// ---------------------------------------------------------------------------------------
// Lease and retention, on a paused clock
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn lease_reports_busy_until_its_last_millisecond() {
    let store = MemoryStore::new();
    let key = key(2, 0);
    acquire(&store, begin_request(key, 0)).await;

    tokio::time::advance(LEASE - MS).await;
    match store.begin(begin_request(key, 0)).await.unwrap() {
        Begin::Busy { retry_after } => assert_eq!(retry_after, MS),
        other => panic!("expected Busy 1 ms before the lease ends, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn expired_lease_resumes_with_the_frozen_bytes_never_acquires() {
    let store = MemoryStore::new();
    let key = key(3, 0);
    let frozen = FrozenRequest::from_parts(
        Method::POST,
        "http://payments.local/charges".parse().unwrap(),
        Version::HTTP_11,
        HeaderMap::new(),
        Bytes::from_static(b"{\"n\":0}"),
    );
    let first = acquire(&store, begin_request(key, 0).with_frozen(frozen.clone())).await;

    tokio::time::advance(LEASE + MS).await;
    let (second, resumed) = match store.begin(begin_request(key, 0)).await.unwrap() {
        Begin::Resume { token, frozen } => (token, frozen),
        other => panic!("expected Resume 1 ms after the lease ended, got {other:?}"),
    };
    assert_ne!(second, first, "the new owner has a new token");
    let resumed = resumed.expect("the frozen request was stored at begin");
    assert_eq!(resumed.body(), frozen.body());
    assert_eq!(resumed.fingerprint(), frozen.fingerprint());

    // The resumed operation holds a fresh lease…
    match store.begin(begin_request(key, 0)).await.unwrap() {
        Begin::Busy { retry_after } => assert_eq!(retry_after, LEASE),
        other => panic!("expected Busy under the new lease, got {other:?}"),
    }
    // …and the stale owner is fenced out.
    let stale = store
        .complete(key, first, response("late".into()), RETENTION)
        .await;
    assert!(stale.unwrap_err().is_fenced());
    complete_and_replay(&store, key, second, "ok").await;
}

#[tokio::test(start_paused = true)]
async fn lease_boundary_busy_at_minus_1ms_resume_at_plus_1ms() {
    let store = MemoryStore::new();
    let key = key(4, 0);
    acquire(&store, begin_request(key, 0)).await;

    tokio::time::advance(LEASE - MS).await;
    assert!(matches!(
        store.begin(begin_request(key, 0)).await.unwrap(),
        Begin::Busy { .. }
    ));
    tokio::time::advance(2 * MS).await;
    assert!(matches!(
        store.begin(begin_request(key, 0)).await.unwrap(),
        Begin::Resume { .. }
    ));
}

/// What another caller of operation 0 under `key` is answered.
async fn next_caller(store: &MemoryStore, key: LedgerKey) -> Begin {
    store.begin(begin_request(key, 0)).await.unwrap()
}

/// How long another caller is told to wait for `key`'s owner.
async fn busy_for(store: &MemoryStore, key: LedgerKey) -> Duration {
    match next_caller(store, key).await {
        Begin::Busy { retry_after } => retry_after,
        other => panic!("expected Busy, got {other:?}"),
    }
}

/// The lease left of `key`'s in-flight record, as `inspect` shows it.
async fn lease_left(store: &MemoryStore, key: LedgerKey) -> Duration {
    match store.inspect(key).await.unwrap().expect("a record").state {
        RecordState::InFlight { lease_left, .. } => lease_left,
        other => panic!("expected an in-flight record, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn a_held_lease_never_runs_out_and_is_never_forgotten_unforced() {
    let store = MemoryStore::new();
    let key = key(40, 0);
    let token = acquire(&store, begin_request(key, 0)).await;
    assert!(store.hold_lease(key, token, LEASE));

    // Ten leases on, with not one renewal: in flight, a whole lease left at every look.
    tokio::time::advance(LEASE * 10).await;
    assert_eq!(busy_for(&store, key).await, LEASE);
    assert_eq!(lease_left(&store, key).await, LEASE);
    let seen = store.inspect(key).await.unwrap().expect("the held claim");
    let expected = Expected::new(RecordKind::InFlight, fingerprint(0), 1, seen.generation);
    let refused = store.forget(key, expected).await.unwrap();
    assert_eq!(refused, Forget::Live { lease_left: LEASE });

    // The owner completes as usual, under its token; there is then nothing to let go.
    complete_and_replay(&store, key, token, "held").await;
    store.let_go(key, token, LEASE);
    assert!(matches!(next_caller(&store, key).await, Begin::Replay(_)));
}

/// A lease of zero (which the layers refuse, but a caller of the store may ask for) is
/// held like any other: a live owner is never overtaken.
#[tokio::test(start_paused = true)]
async fn a_held_lease_of_zero_is_still_held() {
    let store = MemoryStore::new();
    let key = key(44, 0);
    let token = acquire(&store, begin_request(key, 0)).await;
    assert!(store.hold_lease(key, token, Duration::ZERO));
    tokio::time::advance(LEASE * 2).await;
    assert!(matches!(next_caller(&store, key).await, Begin::Busy { .. }));
    // Let go, a zero lease is over at once.
    store.let_go(key, token, Duration::ZERO);
    assert!(matches!(
        next_caller(&store, key).await,
        Begin::Resume { .. }
    ));
}

/// The reference model agrees: a held lease of zero is busy, with a nanosecond left.
#[tokio::test(start_paused = true)]
async fn a_held_lease_of_zero_agrees_with_the_model() {
    use tower_idempotency::testing::model::{check, Fp, Key, Model, Op, Token};
    let begin = |token| Op::Begin {
        key: Key(0),
        fingerprint: Fp(0),
        token,
        take_over: true,
    };
    let ops = [
        begin(Token(1)),
        Op::Hold {
            key: Key(0),
            token: Token(1),
        },
        Op::Advance(LEASE * 2),
        begin(Token(2)),
        Op::LetGo {
            key: Key(0),
            token: Token(1),
        },
        begin(Token(2)),
    ];
    let model = Model::new(Duration::ZERO, Duration::from_secs(3600)).holding();
    check(&MemoryStore::new(), model, &ops, tokio::time::advance).await;
}

#[tokio::test(start_paused = true)]
async fn a_lease_let_go_runs_out_a_lease_later() {
    let store = MemoryStore::new();
    let key = key(41, 0);
    let first = acquire(&store, begin_request(key, 0)).await;
    assert!(store.hold_lease(key, first, LEASE));
    tokio::time::advance(LEASE * 3).await;

    // The owner goes without settling: as if it had renewed until then.
    store.let_go(key, first, LEASE);
    tokio::time::advance(LEASE - MS).await;
    assert_eq!(busy_for(&store, key).await, MS);
    tokio::time::advance(2 * MS).await;
    let second = match next_caller(&store, key).await {
        Begin::Resume { token, .. } => token,
        other => panic!("expected Resume once the lease ran out, got {other:?}"),
    };
    // The new owner's lease is its own: not held, it ends as claimed.
    assert_eq!(lease_left(&store, key).await, LEASE);
    // The old owner holds nothing any more, and letting go again changes nothing.
    assert!(!store.hold_lease(key, first, LEASE));
    store.let_go(key, first, LEASE);
    assert_eq!(lease_left(&store, key).await, LEASE);
    assert!(store
        .complete(key, first, response("late".into()), RETENTION)
        .await
        .unwrap_err()
        .is_fenced());
    complete_and_replay(&store, key, second, "resumed").await;
}

#[tokio::test(start_paused = true)]
async fn only_the_owning_token_of_an_open_record_is_held() {
    let store = MemoryStore::new();
    let (key, done) = (key(42, 0), key(42, 1));
    // No record.
    assert!(!store.hold_lease(key, LeaseToken::generate(), LEASE));
    let token = acquire(&store, begin_request(key, 0)).await;
    // Another token.
    assert!(!store.hold_lease(key, LeaseToken::generate(), LEASE));
    tokio::time::advance(LEASE + MS).await;
    assert!(matches!(
        next_caller(&store, key).await,
        Begin::Resume { .. }
    ));
    // Taken over: its old token no longer holds it.
    assert!(!store.hold_lease(key, token, LEASE));
    // Completed records are not held either.
    let token = acquire(&store, begin_request(done, 0)).await;
    complete_and_replay(&store, done, token, "done").await;
    assert!(!store.hold_lease(done, token, LEASE));
}

#[tokio::test(start_paused = true)]
async fn a_renewal_ends_a_hold_and_the_lease_runs_from_it() {
    let store = MemoryStore::new();
    let key = key(43, 0);
    let token = acquire(&store, begin_request(key, 0)).await;
    assert!(store.hold_lease(key, token, LEASE));
    tokio::time::advance(LEASE * 2).await;
    store.renew(key, token, LEASE).await.unwrap();
    assert_eq!(lease_left(&store, key).await, LEASE);
    tokio::time::advance(LEASE - MS).await;
    busy_for(&store, key).await;
    tokio::time::advance(2 * MS).await;
    assert!(matches!(
        next_caller(&store, key).await,
        Begin::Resume { .. }
    ));
    assert!(store
        .renew(key, token, LEASE)
        .await
        .unwrap_err()
        .is_fenced());
}

#[tokio::test(start_paused = true)]
async fn retention_replays_until_its_last_millisecond_then_forgets() {
    let retention = Duration::from_secs(600);
    let store = MemoryStore::new();
    let key = key(5, 0);
    let request = BeginRequest::new(key, fingerprint(0), LEASE, retention);
    let token = acquire(&store, request.clone()).await;
    store
        .complete(key, token, response("charged".into()), retention)
        .await
        .unwrap();

    tokio::time::advance(retention - MS).await;
    assert_eq!(
        replayed_body(store.begin(request.clone()).await.unwrap()),
        "charged"
    );

    tokio::time::advance(2 * MS).await;
    match store.begin(request).await.unwrap() {
        Begin::Acquired { .. } => {}
        other => panic!("expected Acquired 1 ms after retention ended, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn a_key_claimed_anew_after_its_retention_is_weighed_once() {
    // The record past its retention is replaced: its bytes leave the budget as the new
    // claim's enter it, and only the new record is held.
    let retention = Duration::from_secs(600);
    let store = MemoryStore::new();
    let key = key(17, 0);
    let request = BeginRequest::new(key, fingerprint(0), LEASE, retention);
    let token = acquire(&store, request.clone()).await;
    let claim_weight = store.weighted_size();
    store
        .complete(key, token, response("charged".into()), retention)
        .await
        .unwrap();
    let completed_weight = store.weighted_size();
    assert!(
        completed_weight > claim_weight,
        "{completed_weight} > {claim_weight}"
    );

    tokio::time::advance(retention + MS).await;
    let token = acquire(&store, request).await;
    assert_eq!(store.entry_count(), 1);
    assert_eq!(store.weighted_size(), claim_weight);
    store
        .complete(key, token, response("charged".into()), retention)
        .await
        .unwrap();
    assert_eq!(store.weighted_size(), completed_weight);
}

#[tokio::test]
async fn a_completion_whose_retention_overflows_is_kept_for_good() {
    // `retention` is the caller's: one past what an instant can hold neither panics nor
    // shortens the record's life.
    let store = MemoryStore::new();
    let key = key(18, 0);
    let token = acquire(&store, begin_request(key, 0)).await;
    store
        .complete(key, token, response("charged".into()), Duration::MAX)
        .await
        .unwrap();
    store.run_pending_tasks().await;
    assert_eq!(
        replayed_body(store.begin(begin_request(key, 0)).await.unwrap()),
        "charged"
    );
    assert_eq!(store.entry_count(), 1);
}

#[tokio::test(start_paused = true)]
async fn retention_counts_from_completion_not_from_begin() {
    let retention = Duration::from_secs(600);
    let store = MemoryStore::new();
    let key = key(6, 0);
    let request = BeginRequest::new(key, fingerprint(0), LEASE, retention);
    let token = acquire(&store, request.clone()).await;
    tokio::time::advance(Duration::from_secs(20)).await;
    store
        .complete(key, token, response("charged".into()), retention)
        .await
        .unwrap();

    // 600 s after begin, but only 580 s after completion: still on record.
    tokio::time::advance(retention - Duration::from_secs(20)).await;
    replayed_body(store.begin(request.clone()).await.unwrap());
    tokio::time::advance(Duration::from_secs(20)).await;
    assert!(matches!(
        store.begin(request).await.unwrap(),
        Begin::Acquired { .. }
    ));
}

#[tokio::test(start_paused = true)]
async fn in_doubt_operation_resumes_until_its_retention_ends() {
    let retention = Duration::from_secs(600);
    let store = MemoryStore::new();
    let key = key(7, 0);
    let request = BeginRequest::new(key, fingerprint(0), LEASE, retention);
    let token = acquire(&store, request.clone()).await;
    store.mark_in_doubt(key, token, retention).await.unwrap();

    tokio::time::advance(retention - MS).await;
    let token = match store.begin(request.clone()).await.unwrap() {
        Begin::Resume { token, .. } => token,
        other => panic!("expected Resume 1 ms before retention ends, got {other:?}"),
    };
    // Each write renews the retention from its own time.
    store.mark_in_doubt(key, token, retention).await.unwrap();
    tokio::time::advance(retention + MS).await;
    assert!(matches!(
        store.begin(request).await.unwrap(),
        Begin::Acquired { .. }
    ));
}

// ---------------------------------------------------------------------------------------
// Shared stores
// ---------------------------------------------------------------------------------------

/// The whole protocol round trip, through any store.
async fn round_trip(store: &impl IdempotencyStore, salt: u8) {
    let key = key(salt, 0);
    let token = acquire(store, begin_request(key, 0)).await;
    assert!(matches!(
        store.begin(begin_request(key, 0)).await.unwrap(),
        Begin::Busy { .. }
    ));
    complete_and_replay(store, key, token, "done").await;
    assert!(matches!(
        store.begin(begin_request(key, 1)).await.unwrap(),
        Begin::Drift { .. }
    ));
}

fn assert_store<S: IdempotencyStore + Clone>() {}

#[tokio::test]
async fn arc_of_memory_store_is_a_store_sharing_one_ledger() {
    assert_store::<Arc<MemoryStore>>();
    let store = Arc::new(MemoryStore::new());
    round_trip(&store, 8).await;

    // A clone of the Arc is the same ledger.
    let other = Arc::clone(&store);
    assert_eq!(
        replayed_body(other.begin(begin_request(key(8, 0), 0)).await.unwrap()),
        "done"
    );
    // And so is the store itself behind it.
    round_trip(&*store, 9).await;
    replayed_body(other.begin(begin_request(key(9, 0), 0)).await.unwrap());
}

#[tokio::test]
async fn arc_of_dyn_store_is_a_store_sharing_one_ledger() {
    assert_store::<Arc<dyn IdempotencyStore>>();
    let memory = Arc::new(MemoryStore::new());
    let store: Arc<dyn IdempotencyStore> = memory.clone();
    round_trip(&store, 10).await;
    replayed_body(memory.begin(begin_request(key(10, 0), 0)).await.unwrap());
}

#[test]
fn shared_stores_plug_into_the_client_layer() {
    let memory = Arc::new(MemoryStore::new());
    let dynamic: Arc<dyn IdempotencyStore> = memory.clone();
    let _ = IdempotencyLayer::client(
        memory.clone(),
        ProviderKeys::Deduplicates,
        KeyHeader::ietf(),
    );
    let _ = IdempotencyLayer::client(dynamic, ProviderKeys::Deduplicates, KeyHeader::ietf());
    let _ = IdempotencyLayer::client(
        MemoryStore::clone(&memory),
        ProviderKeys::Deduplicates,
        KeyHeader::ietf(),
    );
}

#[tokio::test]
async fn clones_of_a_memory_store_share_one_ledger() {
    let store = MemoryStore::new();
    let clone = store.clone();
    let token = acquire(&store, begin_request(key(11, 0), 0)).await;
    assert!(matches!(
        clone.begin(begin_request(key(11, 0), 0)).await.unwrap(),
        Begin::Busy { .. }
    ));
    clone
        .complete(key(11, 0), token, response("x".into()), RETENTION)
        .await
        .unwrap();
    replayed_body(store.begin(begin_request(key(11, 0), 0)).await.unwrap());
}

// ---------------------------------------------------------------------------------------
// Weights
// ---------------------------------------------------------------------------------------

fn frozen_of(body_len: usize) -> FrozenRequest {
    FrozenRequest::from_parts(
        Method::POST,
        "http://mail.local/send".parse().unwrap(),
        Version::HTTP_11,
        HeaderMap::new(),
        Bytes::from(vec![b'x'; body_len]),
    )
}

#[tokio::test]
async fn a_record_weighs_its_frozen_request_body_until_it_completes() {
    let store = MemoryStore::new();
    store.run_pending_tasks().await;
    assert_eq!(store.weighted_size(), 0);

    let key = key(12, 0);
    let frozen = frozen_of(100 * KIB);
    let request =
        BeginRequest::new(key, frozen.fingerprint(), LEASE, RETENTION).with_frozen(frozen);
    let token = acquire(&store, request).await;
    store.run_pending_tasks().await;
    let in_flight = store.weighted_size();
    assert!(
        in_flight > (100 * KIB) as u64,
        "a record holding a 100 KiB request weighs {in_flight}"
    );
    // Key, head and bookkeeping are counted too, but they are small.
    assert!(in_flight < (102 * KIB) as u64, "{in_flight}");

    // Completing it gives the request back (a completed operation is never resent) and
    // adds the recorded response's body.
    store
        .complete(
            key,
            token,
            response(Bytes::from(vec![0; 50 * KIB])),
            RETENTION,
        )
        .await
        .unwrap();
    store.run_pending_tasks().await;
    let completed = store.weighted_size();
    assert!(
        completed > (50 * KIB) as u64 && completed < (51 * KIB) as u64,
        "a response of 50 KiB, the request given back, weighs {completed}"
    );
    assert_eq!(store.entry_count(), 1);
}

/// A completed operation keeps only a digest of each top-level JSON field of its request:
/// light, and enough to name what a regenerated request changed.
#[tokio::test]
async fn a_completed_record_keeps_the_digests_of_its_fields_not_its_request() {
    let store = MemoryStore::new();
    let mut body = br#"{"order_id":"o_1","summary":""#.to_vec();
    body.resize(10 * KIB, b'x');
    body.extend_from_slice(br#"","total_cents":100}"#);
    let frozen = FrozenRequest::from_parts(
        Method::POST,
        "http://orders.local/orders".parse().unwrap(),
        Version::HTTP_11,
        HeaderMap::new(),
        Bytes::from(body),
    );
    let key = key(13, 0);
    let request = |frozen: &FrozenRequest| {
        BeginRequest::new(key, frozen.fingerprint(), LEASE, RETENTION).with_frozen(frozen.clone())
    };
    let token = acquire(&store, request(&frozen)).await;
    assert!(store.weighted_size() > (10 * KIB) as u64);
    store
        .complete(key, token, response(Bytes::from_static(b"{}")), RETENTION)
        .await
        .unwrap();
    let completed = store.weighted_size();
    assert!(
        completed < KIB as u64,
        "a completed record weighs {completed}"
    );

    let regenerated = FrozenRequest::from_parts(
        Method::POST,
        "http://orders.local/orders".parse().unwrap(),
        Version::HTTP_11,
        HeaderMap::new(),
        Bytes::from_static(br#"{"order_id":"o_1","summary":"short","total_cents":100}"#),
    );
    match store.begin(request(&regenerated)).await.unwrap() {
        Begin::DriftFields { stored, fields } => {
            assert_eq!(stored, frozen.fingerprint());
            assert_eq!(
                fields.changed_fields(regenerated.body()).unwrap(),
                ["summary"]
            );
            assert_eq!(
                fields.changed_fields(frozen.body()).unwrap(),
                Vec::<String>::new()
            );
        }
        other => panic!("expected DriftFields, got {other:?}"),
    }
    // The same payload still replays.
    assert!(matches!(
        store.begin(request(&frozen)).await.unwrap(),
        Begin::Replay(_)
    ));
}

#[tokio::test]
async fn a_record_without_bodies_weighs_little() {
    let store = MemoryStore::new();
    acquire(&store, begin_request(key(13, 0), 0)).await;
    store.run_pending_tasks().await;
    let weight = store.weighted_size();
    assert!(weight > 32 && weight < KIB as u64, "{weight}");
}

#[tokio::test]
async fn weights_add_up_over_records() {
    let store = MemoryStore::new();
    for n in 0..10 {
        let frozen = frozen_of(10 * KIB);
        let request = BeginRequest::new(key(14, n), frozen.fingerprint(), LEASE, RETENTION)
            .with_frozen(frozen);
        acquire(&store, request).await;
    }
    store.run_pending_tasks().await;
    assert_eq!(store.entry_count(), 10);
    let weight = store.weighted_size();
    assert!(
        // Each record: its 10 KiB body, its head and ~1.5 KiB of bookkeeping (map slot,
        // index entry, allocations: see `PER_RECORD_OVERHEAD`).
        weight > (100 * KIB) as u64 && weight < (116 * KIB) as u64,
        "{weight}"
    );
}

/// What a typical record weighs against the budget once completed: a server's (no request
/// kept, a ~50-byte JSON response with its content type and the request's digest) and a
/// client's (a 1 KiB JSON request, a ~40-byte response). The README's sizing table and the
/// default budget's sustainable rates rest on these.
#[tokio::test]
async fn typical_completed_records_weigh_a_few_hundred_bytes() {
    let request_body = {
        let mut body = br#"{"order_id":"order_000000000001","summary":""#.to_vec();
        body.resize(1022, b'x');
        body.extend_from_slice(br#""}"#);
        Bytes::from(body)
    };
    let mut headers = HeaderMap::new();
    headers.insert("content-type", HeaderValue::from_static("application/json"));
    headers.insert(
        tower_idempotency::digest::IDEMPOTENT_REQUEST_DIGEST.clone(),
        tower_idempotency::digest::BodyDigest::of(&request_body).header_value(),
    );
    let server_response = Outcome::Response(StoredResponse::new(
        StatusCode::CREATED,
        Version::HTTP_11,
        headers,
        Bytes::from_static(br#"{"id":"ch_000000000001","status":"succeeded","n":1}"#),
    ));
    let server = MemoryStore::new();
    let key = key(20, 0);
    let claim = begin_request(key, 0).with_origin(tower_idempotency::ledger::Origin::server(
        &Method::POST,
        "/charges",
    ));
    let token = acquire(&server, claim).await;
    server
        .complete(key, token, server_response, RETENTION)
        .await
        .unwrap();
    let server_record = server.weighted_size();
    // 600 bytes before records kept their origin (boxed in 64).
    assert!(
        server_record <= 664,
        "a server record weighs {server_record}"
    );

    let frozen = FrozenRequest::from_parts(
        Method::POST,
        "http://provider.local/charges".parse().unwrap(),
        Version::HTTP_11,
        HeaderMap::new(),
        request_body,
    )
    .with_operation(&tower_idempotency::OperationId::new("task-42", "charge"));
    let client = MemoryStore::new();
    let request =
        BeginRequest::new(key, frozen.fingerprint(), LEASE, RETENTION).with_frozen(frozen);
    let token = acquire(&client, request).await;
    let in_flight = client.weighted_size();
    client
        .complete(
            key,
            token,
            response(Bytes::from_static(br#"{"id":"ch_1","status":"ok"}"#)),
            RETENTION,
        )
        .await
        .unwrap();
    let client_record = client.weighted_size();
    // 700 bytes before records kept their origin: 64 for its box, which holds the
    // operation's ids too when they are short (`task-42` and `charge`).
    assert!(
        client_record <= 764,
        "a client record weighs {client_record}"
    );
    assert!(
        in_flight > 1500,
        "an open one holds its request: {in_flight}"
    );
    eprintln!(
        "server record {server_record} B, client record {client_record} B (open {in_flight} B)"
    );
}
