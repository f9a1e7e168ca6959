//! A `MemoryStore` under pressure: it says how much of its budget it may not evict, warns
//! before it refuses, and tells a refused caller when room frees up.
//!
//! A binary of its own: one test captures a warning, and `tracing`'s callsite interest is
//! global (see tests/whole_stack/log_warnings.rs), so every test here logs through a capture.
#![cfg(feature = "test-util")]

use crate::support::capture;

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode, Version};
use http_body_util::Full;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::{
    Begin, BeginRequest, IdempotencyStore, LeaseToken, LedgerKey, MemoryStore, Outcome,
    StoredResponse,
};
use tower_idempotency::testing::SideEffectService;
use tower_idempotency::{fingerprint::Fingerprint, IdempotencyLayer, KeyHeader};

const LEASE: Duration = Duration::from_secs(10);
const RETENTION: Duration = Duration::from_secs(24 * 60 * 60);
const WINDOW: Duration = Duration::from_secs(120);

fn key(salt: u8, n: u32) -> LedgerKey {
    let mut bytes = [salt; 32];
    bytes[..4].copy_from_slice(&n.to_be_bytes());
    LedgerKey::from_bytes(bytes)
}

fn protected(key: LedgerKey, window: Duration) -> BeginRequest {
    let fingerprint = Fingerprint::of(&Method::POST, "/charges", b"{}");
    BeginRequest::new(key, fingerprint, LEASE, RETENTION).with_protected_window(window)
}

fn outcome() -> Outcome {
    Outcome::Response(StoredResponse::new(
        StatusCode::CREATED,
        Version::HTTP_11,
        HeaderMap::new(),
        Bytes::from_static(br#"{"id":"ch_1"}"#),
    ))
}

/// Claim and complete `key`; `false` if the store refused the claim for room.
async fn record(store: &MemoryStore, key: LedgerKey, window: Duration) -> bool {
    let token: LeaseToken = match store.begin(protected(key, window)).await {
        Ok(Begin::Acquired { token }) => token,
        Err(err) if err.is_full() => return false,
        other => panic!("expected a claim, got {other:?}"),
    };
    store
        .complete(key, token, outcome(), RETENTION)
        .await
        .unwrap();
    true
}

/// The weight of one completed record of these tests.
async fn one_record() -> u64 {
    let store = MemoryStore::new();
    assert!(record(&store, key(0, 0), WINDOW).await);
    store.weighted_size()
}

#[tokio::test(start_paused = true)]
async fn a_refused_claim_is_told_when_the_first_protected_record_ends() {
    // Every test of this binary logs through a subscriber (see the module docs).
    let (_logs, _default) = capture::warnings();
    let store = MemoryStore::builder()
        .max_bytes(4 * one_record().await)
        .build();
    let mut n = 0;
    while record(&store, key(1, n), WINDOW).await {
        n += 1;
        tokio::time::advance(Duration::from_secs(1)).await;
    }
    assert_eq!(n, 4, "four records fill the budget");
    // The first record completed 4 s ago: its window ends in 116 s.
    let err = store
        .begin(protected(key(1, 99), WINDOW))
        .await
        .unwrap_err();
    assert!(err.is_full(), "{err}");
    assert_eq!(err.retry_after(), Some(WINDOW - Duration::from_secs(4)));

    // Then the first record may go, and the claim finds room.
    tokio::time::advance(WINDOW - Duration::from_secs(4)).await;
    assert!(record(&store, key(1, 99), WINDOW).await);
    assert_eq!(store.evictions(), 1);
}

#[tokio::test(start_paused = true)]
async fn ledger_full_answers_retry_after_until_room_frees_up() {
    // Every test of this binary logs through a subscriber (see the module docs).
    let (_logs, _default) = capture::warnings();
    // Room for a few server records, each protected for two minutes.
    let store = MemoryStore::builder().max_bytes(8 * 1024).build();
    let provider = SideEffectService::new();
    let server = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::server_builder(store.clone())
                .unscoped()
                .protected_window(WINDOW)
                .build()
                .unwrap(),
        )
        .service(provider.clone());
    let mut statuses = Vec::new();
    for n in 0..64 {
        let request = Request::post("/charges")
            .header("idempotency-key", format!("\"k-{n}\""))
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        let response = server.clone().oneshot(request).await.unwrap();
        if response.status() == StatusCode::SERVICE_UNAVAILABLE {
            // Nothing has moved the clock: the first record's window ends in all of it.
            assert_eq!(
                response.headers()["retry-after"],
                WINDOW.as_secs().to_string(),
                "after {n} requests"
            );
            assert!(store.refused_claims() > 0);
            return;
        }
        statuses.push(response.status());
    }
    panic!("the store never filled: {statuses:?}");
}

#[tokio::test(start_paused = true)]
async fn protected_bytes_are_the_records_inside_their_window() {
    // Every test of this binary logs through a subscriber (see the module docs).
    let (_logs, _default) = capture::warnings();
    let store = MemoryStore::new();
    for n in 0..10 {
        assert!(record(&store, key(2, n), WINDOW).await);
    }
    // An open claim is protected too.
    let open = store.begin(protected(key(2, 10), WINDOW)).await.unwrap();
    assert!(matches!(open, Begin::Acquired { .. }));
    assert_eq!(store.protected_bytes(), store.weighted_size());

    tokio::time::advance(WINDOW + Duration::from_secs(1)).await;
    let open_weight = {
        let alone = MemoryStore::new();
        alone.begin(protected(key(2, 10), WINDOW)).await.unwrap();
        alone.weighted_size()
    };
    assert_eq!(
        store.protected_bytes(),
        open_weight,
        "only the open claim is left protected"
    );
}

#[tokio::test(start_paused = true)]
async fn a_store_past_its_high_water_mark_warns_with_the_rate_it_sustains() {
    let (logs, _default) = capture::warnings();
    let per_record = one_record().await;
    let store = MemoryStore::builder().max_bytes(100 * per_record).build();
    for n in 0..79 {
        assert!(record(&store, key(3, n), WINDOW).await);
    }
    // Under the mark: a look at the pressure (due once a second) says nothing.
    tokio::time::advance(Duration::from_secs(2)).await;
    assert!(record(&store, key(3, 79), WINDOW).await);
    assert!(logs.text().is_empty(), "{}", logs.text());

    // 81 of 100: past it, a second later.
    assert!(record(&store, key(3, 80), WINDOW).await);
    tokio::time::advance(Duration::from_secs(2)).await;
    assert!(record(&store, key(3, 81), WINDOW).await);
    let logged = logs.text();
    assert!(logged.contains("protected records hold 8"), "{logged}");
    // 100 records' budget over a 120 s window: under one new operation a second.
    assert!(
        logged.contains("sustains about 1 new operations"),
        "{logged}"
    );
    assert_eq!(store.refused_claims(), 0, "warned before any refusal");

    // Rate-limited: not again at the next look.
    logs.clear();
    tokio::time::advance(Duration::from_secs(2)).await;
    assert!(record(&store, key(3, 82), WINDOW).await);
    assert!(logs.text().is_empty(), "{}", logs.text());
}

#[tokio::test(start_paused = true)]
async fn one_tenant_flooding_a_shared_store_leaves_room_for_the_others() {
    let (_logs, _default) = capture::warnings();
    // The default scope: one per `Authorization`, so every tenant has a share.
    let store = MemoryStore::builder().max_bytes(128 * 1024).build();
    let server = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::server_builder(store.clone())
                .protected_window(WINDOW)
                .build()
                .unwrap(),
        )
        .service(SideEffectService::new());
    let request = |tenant: &str, n: u32| {
        Request::post("/charges")
            .header("authorization", format!("Bearer {tenant}"))
            .header("idempotency-key", format!("\"{tenant}-{n}\""))
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    };
    // The flood: new keys, as fast as the store takes them, until it refuses them.
    let mut flooded = 0;
    loop {
        let response = server
            .clone()
            .oneshot(request("flood", flooded))
            .await
            .unwrap();
        if response.status() == StatusCode::SERVICE_UNAVAILABLE {
            break;
        }
        assert_eq!(response.status(), StatusCode::CREATED);
        flooded += 1;
        assert!(flooded < 1000, "the flood was never refused");
        tokio::time::advance(Duration::from_millis(100)).await;
    }
    assert!(flooded > 10, "{flooded}");
    // Another tenant is still served, inside everyone's protected window.
    for n in 0..5 {
        let response = server.clone().oneshot(request("quiet", n)).await.unwrap();
        assert_eq!(response.status(), StatusCode::CREATED, "quiet request {n}");
    }
    // And the flood stays refused.
    let response = server
        .clone()
        .oneshot(request("flood", 9999))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(store.evictions(), 0, "nothing protected was evicted");

    // Once the flood's records leave their window, the pressure is gone and the flooding
    // tenant is served again, from its first request: the pressure is read when judged.
    tokio::time::advance(WINDOW + Duration::from_millis(1)).await;
    let response = server
        .clone()
        .oneshot(request("flood", 10_000))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
}

/// Claim and complete `key` in `scope` with a body of `size` bytes, protected for
/// `window`; `false` if the store refused the claim for room.
async fn record_in(
    store: &MemoryStore,
    scope: &str,
    n: u32,
    size: usize,
    window: Duration,
) -> bool {
    let key = LedgerKey::server(scope, &n.to_string());
    let token = match store.begin(protected(key, window).with_scope(scope)).await {
        Ok(Begin::Acquired { token }) => token,
        Err(err) if err.is_full() => return false,
        other => panic!("expected a claim, got {other:?}"),
    };
    let body = Bytes::from(vec![b'y'; size]);
    let outcome = StoredResponse::new(
        StatusCode::CREATED,
        Version::HTTP_11,
        HeaderMap::new(),
        body,
    );
    store
        .complete(key, token, Outcome::Response(outcome), RETENTION)
        .await
        .unwrap();
    true
}

/// The pressure a tenant's share is judged by is the bytes still protected, not a count of
/// records scaled: one large record past its window beside many small ones inside theirs
/// is a store with room, and every tenant is served.
#[tokio::test(start_paused = true)]
async fn a_large_record_past_its_window_is_not_counted_as_protected() {
    let (_logs, _default) = capture::warnings();
    let store = MemoryStore::builder().max_bytes(100_000).build();
    // Tenant X: one large response, whose protected window then ends.
    assert!(record_in(&store, "tenant-x", 0, 85_000, Duration::from_secs(10)).await);
    tokio::time::advance(Duration::from_secs(11)).await;
    // Tenant Y: small responses, protected; the last claim looks at the pressure.
    for n in 0..9 {
        assert!(record_in(&store, "tenant-y", n, 50, WINDOW).await);
    }
    tokio::time::advance(Duration::from_millis(1100)).await;
    assert!(record_in(&store, "tenant-y", 9, 50, WINDOW).await);
    let protected = store.protected_bytes();
    assert!(protected < 10_000, "{protected} bytes read as protected");
    // Tenant X's new operation is served (its old record may be evicted for it).
    assert!(
        record_in(&store, "tenant-x", 1, 50, WINDOW).await,
        "tenant X refused for its share, {protected} of {} bytes protected",
        store.max_bytes()
    );
}

#[tokio::test(start_paused = true)]
async fn without_a_scope_a_store_is_shared_first_come() {
    let (_logs, _default) = capture::warnings();
    // Claims without a scope (the client face, an unscoped server) have no share: one
    // caller may fill the whole budget.
    let store = MemoryStore::builder()
        .max_bytes(8 * one_record().await)
        .build();
    let mut n = 0;
    while record(&store, key(5, n), WINDOW).await {
        n += 1;
        tokio::time::advance(Duration::from_secs(1)).await;
    }
    assert_eq!(n, 8);
}

/// The bytes of the receipts in the flood tests below: 1 MiB holds about 40 of them.
const RECEIPT: usize = 24 * 1024;

/// Tenant `scope`'s claim of operation `n`, protected for [`WINDOW`].
fn claim_in(scope: &str, n: u32) -> BeginRequest {
    protected(LedgerKey::server(scope, &n.to_string()), WINDOW).with_scope(scope)
}

/// What a `begin` of tenant `scope`'s operation `n` answers now, as a word.
async fn answer_of(store: &MemoryStore, scope: &str, n: u32) -> &'static str {
    match store.begin(claim_in(scope, n).probe()).await {
        Ok(Begin::Replay(Outcome::Response(_))) => "replay",
        Ok(Begin::Replay(Outcome::Tombstone { .. })) => "tombstone",
        Ok(Begin::Acquired { .. }) => "acquired",
        Ok(_) => "other",
        Err(_) => "error",
    }
}

/// A tenant that fills the store between two looks at the pressure (the clock never moves
/// here) is refused once protected records reach the mark, on the reading of that moment:
/// the rest of the budget stays for the others. Until the mark, it is not capped.
#[tokio::test(start_paused = true)]
async fn a_flood_inside_one_second_is_judged_on_a_current_reading() {
    let (_logs, _default) = capture::warnings();
    let store = MemoryStore::builder().max_bytes(1 << 20).build();
    let mut flooded = 0;
    while record_in(&store, "flood", flooded, RECEIPT, WINDOW).await {
        flooded += 1;
        assert!(flooded < 100, "the flood was never refused");
    }
    let held = store.weighted_size();
    assert!(
        held > store.max_bytes() / 4,
        "below the mark a lone tenant is not held to its share: {held} bytes"
    );
    assert!(
        held * 100 <= store.max_bytes() * 80 + (RECEIPT as u64 + 1024) * 100,
        "the flood passed the mark by more than one receipt: {held} of {}",
        store.max_bytes()
    );
    // The quiet tenant is served, inside everyone's protected window.
    for n in 0..20 {
        assert!(
            record_in(&store, "quiet", n, 1024, WINDOW).await,
            "quiet operation {n} refused; the flood holds {held} bytes"
        );
    }
    // Every operation of the flood that ran is answered, never run again.
    for n in 0..flooded {
        assert_ne!(answer_of(&store, "flood", n).await, "acquired", "flood {n}");
    }
    assert_eq!(store.evictions(), 0, "nothing protected was evicted");
}

/// Claims are small and their outcomes large: a tenant under its share at every claim can
/// still have enough open operations to fill the store when they complete. Under pressure,
/// a completion that would take its scope past its share is recorded as done (a tombstone:
/// never run again) without taking the others' room; below the mark, and within the share,
/// outcomes are kept whole.
#[tokio::test(start_paused = true)]
async fn completions_past_a_share_under_pressure_never_take_the_others_room() {
    let (_logs, _default) = capture::warnings();
    let store = MemoryStore::builder().max_bytes(1 << 20).build();
    // The flood opens 200 operations at once: a claim holds a few hundred bytes, so every
    // one of them is taken.
    let mut open = Vec::new();
    for n in 0..200 {
        match store.begin(claim_in("flood", n)).await.unwrap() {
            Begin::Acquired { token } => open.push((n, token)),
            other => panic!("flood claim {n}: {other:?}"),
        }
    }
    // Each effect happened: every completion is recorded, whatever the pressure.
    for (n, token) in open {
        let key = LedgerKey::server("flood", &n.to_string());
        let body = Bytes::from(vec![b'r'; RECEIPT]);
        let receipt = StoredResponse::new(
            StatusCode::CREATED,
            Version::HTTP_11,
            HeaderMap::new(),
            body,
        );
        store
            .complete(key, token, Outcome::Response(receipt), RETENTION)
            .await
            .unwrap_or_else(|err| panic!("flood completion {n}: {err}"));
    }
    let mut answers = std::collections::BTreeMap::<&str, u32>::new();
    for n in 0..200 {
        *answers
            .entry(answer_of(&store, "flood", n).await)
            .or_default() += 1;
    }
    assert_eq!(
        answers.get("replay").copied().unwrap_or(0)
            + answers.get("tombstone").copied().unwrap_or(0),
        200,
        "every completed operation is answered, none run again: {answers:?}"
    );
    assert!(
        answers.get("replay").copied().unwrap_or(0) >= 20,
        "receipts are kept whole up to the mark: {answers:?}"
    );
    // The quiet tenant is served.
    for n in 0..20 {
        assert!(
            record_in(&store, "quiet", n, 1024, WINDOW).await,
            "quiet operation {n} refused ({} of {} bytes held; {answers:?})",
            store.weighted_size(),
            store.max_bytes()
        );
    }
    assert_eq!(store.evictions(), 0, "nothing protected was evicted");
}

#[tokio::test(start_paused = true)]
async fn a_request_heavier_than_the_whole_budget_is_told_it_can_never_fit() {
    let (_logs, _default) = capture::warnings();
    // 16 KiB of ledger: room for many operations, never for one that freezes 64 KiB.
    let store = MemoryStore::builder().max_bytes(16 * 1024).build();
    let provider = SideEffectService::new();
    let client = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(store.clone())
                .provider_deduplicates(true)
                .key_header(KeyHeader::ietf())
                .build()
                .unwrap(),
        )
        .service(provider.clone());
    let charge = |task: &str, body: Bytes| {
        let mut request = Request::post("http://payments.local/charges")
            .body(Full::new(body))
            .unwrap();
        request
            .extensions_mut()
            .insert(tower_idempotency::OperationId::new(task, "charge"));
        request
    };
    // A completed operation: the store knows when its protected window ends.
    client
        .clone()
        .oneshot(charge("small", Bytes::from_static(b"{}")))
        .await
        .unwrap();

    let heavy = Bytes::from(format!(r#"{{"note":"{}"}}"#, "x".repeat(64 * 1024)));
    let err = client.oneshot(charge("heavy", heavy)).await.unwrap_err();
    assert!(err.is_ledger_full(), "{err:?}");
    assert_eq!(err.retry_after(), None, "a wait that can never help");
    assert!(err.to_string().contains("never fit"), "{err}");
    assert_eq!(provider.effects(), 1, "only the small operation ran");
}
