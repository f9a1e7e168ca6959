//! What a memory record keeps for a list: its scope, and when it last changed state.

use std::time::Duration;

use super::MemoryStore;
use crate::fingerprint::Fingerprint;
use crate::ledger::{
    scope_id, Begin, BeginRequest, IdempotencyStore, LeaseToken, LedgerKey, Outcome, RecordView,
};

const LEASE: Duration = Duration::from_secs(10);
const RETENTION: Duration = Duration::from_secs(3600);

fn fingerprint() -> Fingerprint {
    Fingerprint::of(&http::Method::POST, "/charges", b"{}")
}

fn request(key: LedgerKey, scope: &str) -> BeginRequest {
    BeginRequest::new(key, fingerprint(), LEASE, RETENTION).with_scope(scope)
}

fn done() -> Outcome {
    Outcome::Tombstone {
        status: http::StatusCode::CREATED,
    }
}

async fn acquire(store: &MemoryStore, request: BeginRequest) -> LeaseToken {
    match store.begin(request).await.expect("begin") {
        Begin::Acquired { token } | Begin::Resume { token, .. } => token,
        other => panic!("expected ownership, got {other:?}"),
    }
}

async fn view(store: &MemoryStore, key: LedgerKey) -> RecordView {
    store
        .inspect(key)
        .await
        .expect("inspect")
        .expect("a record")
}

#[tokio::test(start_paused = true)]
async fn a_record_keeps_its_scope_and_when_it_last_changed_state() {
    let store = MemoryStore::new();
    let key = LedgerKey::from_bytes([1; 32]);
    let first = acquire(&store, request(key, "tenant-a")).await;
    let seen = view(&store, key).await;
    assert_eq!(seen.scope, scope_id("tenant-a"));
    assert_eq!(seen.touched, Duration::ZERO);

    // A renewal is not a change of state.
    tokio::time::advance(Duration::from_secs(5)).await;
    store.renew(key, first, LEASE).await.expect("renew");
    assert!(store.hold_lease(key, first, LEASE));
    store.let_go(key, first, LEASE);
    assert_eq!(view(&store, key).await.touched, Duration::from_secs(5));

    tokio::time::advance(Duration::from_secs(2)).await;
    store
        .mark_in_doubt(key, first, RETENTION)
        .await
        .expect("mark");
    tokio::time::advance(Duration::from_secs(3)).await;
    let seen = view(&store, key).await;
    assert_eq!(
        (seen.age, seen.touched),
        (Duration::from_secs(10), Duration::from_secs(3))
    );

    let second = acquire(&store, request(key, "tenant-a")).await;
    assert_eq!(view(&store, key).await.touched, Duration::ZERO, "resumed");
    tokio::time::advance(Duration::from_secs(1)).await;
    store.abandon(key, second).await.expect("abandon");
    assert_eq!(
        view(&store, key).await.touched,
        Duration::ZERO,
        "a resumed operation let go is in doubt again"
    );

    let third = acquire(&store, request(key, "tenant-a")).await;
    tokio::time::advance(Duration::from_secs(4)).await;
    store
        .complete(key, third, done(), RETENTION)
        .await
        .expect("complete");
    tokio::time::advance(Duration::from_secs(6)).await;
    let seen = view(&store, key).await;
    assert_eq!(
        (seen.age, seen.touched),
        (Duration::from_secs(21), Duration::from_secs(6))
    );
    assert_eq!(
        seen.scope,
        scope_id("tenant-a"),
        "kept through every change"
    );
}

#[tokio::test(start_paused = true)]
async fn a_completion_kept_as_a_tombstone_keeps_its_scope_and_is_touched() {
    // A store with no room for an outcome of this size: the completion falls back to a
    // tombstone, a record made anew from the claim.
    let store = MemoryStore::builder().max_bytes(4096).build();
    let key = LedgerKey::from_bytes([2; 32]);
    let token = acquire(&store, request(key, "tenant-b")).await;
    tokio::time::advance(Duration::from_secs(2)).await;
    let large = Outcome::Response(crate::ledger::StoredResponse::new(
        http::StatusCode::CREATED,
        http::Version::HTTP_11,
        http::HeaderMap::new(),
        bytes::Bytes::from(vec![b'x'; 8192]),
    ));
    store
        .complete(key, token, large, RETENTION)
        .await
        .expect("complete");
    tokio::time::advance(Duration::from_secs(1)).await;
    let seen = view(&store, key).await;
    assert!(matches!(
        seen.state,
        crate::ledger::RecordState::Completed { .. }
    ));
    assert_eq!(
        (seen.age, seen.touched),
        (Duration::from_secs(3), Duration::from_secs(1))
    );
    assert_eq!(seen.scope, scope_id("tenant-b"));
}
