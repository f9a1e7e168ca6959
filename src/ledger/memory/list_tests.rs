//! What a memory record keeps for a list (its scope, when it last changed state), and a
//! shard read in chunks: every record there throughout listed once, in order, however the
//! map changes between chunks.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::listing::CHUNK_RECORDS;
use super::MemoryStore;
use crate::fingerprint::Fingerprint;
use crate::ledger::{
    scope_id, Begin, BeginRequest, IdempotencyStore, LeaseToken, LedgerKey, ListQuery, Outcome,
    RecordKind, RecordView, MAX_PAGE,
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

/// A key of shard 0 (a key's first byte picks its shard), the rest of it random.
fn key_in_first_shard() -> LedgerKey {
    let mut bytes = [0u8; 32];
    fastrand::fill(&mut bytes[1..]);
    LedgerKey::from_bytes(bytes)
}

/// Every record of `query`'s list, following its cursors to the end.
async fn whole_list(store: &MemoryStore, query: ListQuery) -> Vec<LedgerKey> {
    let mut keys = Vec::new();
    let mut query = query;
    loop {
        let page = store.list(query.clone()).await.expect("list");
        keys.extend(page.records.iter().map(|record| record.key));
        match page.next {
            Some(cursor) => query = query.after(cursor),
            None => return keys,
        }
    }
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

#[tokio::test]
async fn a_shard_read_in_chunks_lists_each_record_once_in_order() {
    let store = MemoryStore::builder().max_bytes(1 << 30).build();
    let mut claimed = Vec::new();
    for n in 0..2 * CHUNK_RECORDS + 17 {
        let key = key_in_first_shard();
        let token = acquire(&store, request(key, "")).await;
        if n % 7 == 0 {
            store.mark_in_doubt(key, token, RETENTION).await.unwrap();
        }
        claimed.push((key, n % 7 == 0));
    }
    let oldest_first: Vec<LedgerKey> = claimed.iter().map(|(key, _)| *key).collect();
    let mut newest_first = oldest_first.clone();
    newest_first.reverse();
    assert_eq!(
        whole_list(&store, ListQuery::new().limit(MAX_PAGE)).await,
        newest_first
    );
    assert_eq!(
        whole_list(&store, ListQuery::new().limit(MAX_PAGE).oldest_first()).await,
        oldest_first
    );
    let in_doubt: Vec<LedgerKey> = claimed
        .iter()
        .rev()
        .filter(|(_, in_doubt)| *in_doubt)
        .map(|(key, _)| *key)
        .collect();
    assert_eq!(
        whole_list(
            &store,
            ListQuery::new().kind(RecordKind::InDoubt).limit(100)
        )
        .await,
        in_doubt
    );
}

/// Records claimed and dropped in the listed shard all the while (the map grows, shrinks
/// back by abandons, and rehashes): the records there throughout are listed, each once, in
/// order, list after list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_there_throughout_are_listed_once_while_the_map_changes() {
    let store = MemoryStore::builder().max_bytes(1 << 30).build();
    let mut stable = Vec::new();
    // Read in one chunk alone, in two or three once the churn adds its records.
    for _ in 0..CHUNK_RECORDS * 3 / 4 {
        let key = key_in_first_shard();
        acquire(&store, request(key, "stable")).await;
        stable.push(key);
    }
    stable.reverse();

    let stop = Arc::new(AtomicBool::new(false));
    let churn = {
        let (store, stop) = (store.clone(), stop.clone());
        tokio::spawn(async move {
            let mut held = Vec::new();
            let mut rounds = 0u64;
            while !stop.load(Ordering::Relaxed) {
                // Up to twice the stable records, then every one let go: a map that grows
                // past a chunk and a doubling, and empties again.
                for _ in 0..512 {
                    let key = key_in_first_shard();
                    held.push((key, acquire(&store, request(key, "churn")).await));
                }
                if held.len() >= CHUNK_RECORDS * 3 / 2 {
                    for (key, token) in held.drain(..) {
                        store.abandon(key, token).await.expect("abandon");
                    }
                }
                rounds += 1;
                tokio::task::yield_now().await;
            }
            rounds
        })
    };
    let mut lists = 0;
    while lists < 5 {
        let listed = whole_list(&store, ListQuery::new().scope("stable").limit(MAX_PAGE)).await;
        let unique: HashSet<&LedgerKey> = listed.iter().collect();
        assert_eq!(unique.len(), listed.len(), "a record listed twice");
        assert_eq!(
            listed, stable,
            "every record there throughout, once, in order"
        );
        lists += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let rounds = churn.await.expect("the churn");
    assert!(rounds > 0, "the map changed while it was listed");
}

/// Pages of every size, in both orders, under every filter the walk judges before a
/// record's view (kind, scope) and with records past their retention among them: page
/// after page is the records that pass, each once, in order, whatever the cursor and the
/// cut candidates pass over on their place alone.
#[tokio::test(start_paused = true)]
async fn pages_under_every_filter_list_the_records_that_pass_in_order() {
    let store = MemoryStore::builder().max_bytes(1 << 30).build();
    let mut claimed = Vec::new();
    for n in 0..600u32 {
        let mut bytes = [0u8; 32];
        fastrand::fill(&mut bytes);
        let key = LedgerKey::from_bytes(bytes);
        let scope = if n % 3 == 0 { "tenant-a" } else { "tenant-b" };
        // The first records have a short retention: past it when the lists are made.
        let retention = if n < 40 {
            Duration::from_secs(1)
        } else {
            RETENTION
        };
        let request = BeginRequest::new(key, fingerprint(), LEASE, retention).with_scope(scope);
        let token = acquire(&store, request).await;
        let kind = match n % 5 {
            0 => {
                store.mark_in_doubt(key, token, retention).await.unwrap();
                RecordKind::InDoubt
            }
            1 | 2 => {
                store.complete(key, token, done(), retention).await.unwrap();
                RecordKind::Completed
            }
            _ => RecordKind::InFlight,
        };
        if n >= 40 {
            claimed.push((key, kind, scope_id(scope)));
        }
    }
    tokio::time::advance(Duration::from_secs(2)).await;

    let kinds: [&[RecordKind]; 4] = [
        &[],
        &[RecordKind::InDoubt],
        &[RecordKind::Completed],
        &[RecordKind::InFlight, RecordKind::InDoubt],
    ];
    for kinds in kinds {
        for scope in [None, Some("tenant-a")] {
            for oldest_first in [false, true] {
                for limit in [1, 7, 100] {
                    let mut query = ListQuery::new().limit(limit);
                    for kind in kinds {
                        query = query.kind(*kind);
                    }
                    if let Some(scope) = scope {
                        query = query.scope(scope);
                    }
                    if oldest_first {
                        query = query.oldest_first();
                    }
                    let mut expected: Vec<LedgerKey> = claimed
                        .iter()
                        .filter(|(_, kind, id)| {
                            (kinds.is_empty() || kinds.contains(kind))
                                && scope.is_none_or(|scope| scope_id(scope) == *id)
                        })
                        .map(|(key, _, _)| *key)
                        .collect();
                    if !oldest_first {
                        expected.reverse();
                    }
                    assert_eq!(
                        whole_list(&store, query.clone()).await,
                        expected,
                        "{query:?}"
                    );
                }
            }
        }
    }
}

/// How long a listing holds a shard's lock at a million records: each chunk timed under
/// the lock, by the wall clock and in the thread's CPU time (the wall time less any
/// preemption), over ten pages of each kind the listing bench measures, alone and then
/// beside a thread that claims back to back. A claim on the shard waits at most one
/// chunk's hold: its CPU time, unless the listing thread is preempted while it holds the
/// lock. A measurement, meaningful in a release build: `cargo test --release
/// --all-features --lib chunk_holds -- --ignored --nocapture`.
#[tokio::test]
#[ignore = "a measurement: run in release with --ignored --nocapture"]
async fn chunk_holds_of_a_listing_at_a_million_records() {
    const RECORDS: u32 = 1_000_000;
    let store = MemoryStore::builder().max_bytes(8 << 30).build();
    for n in 0..RECORDS {
        let mut bytes = [0u8; 32];
        fastrand::fill(&mut bytes);
        let key = LedgerKey::from_bytes(bytes);
        let token = acquire(&store, request(key, "")).await;
        if n % 100 == 0 {
            store.mark_in_doubt(key, token, RETENTION).await.unwrap();
        } else {
            store.complete(key, token, done(), RETENTION).await.unwrap();
        }
    }
    let in_doubt = ListQuery::new().kind(RecordKind::InDoubt);
    let first = store.list_now(&in_doubt);
    let next = in_doubt.clone().after(first.next.expect("a next page"));
    let queries = [
        ("newest_first", ListQuery::new()),
        ("in_doubt", in_doubt),
        ("in_doubt_next_page", next),
    ];
    for beside_claims in [false, true] {
        let stop = Arc::new(AtomicBool::new(false));
        let claimer = beside_claims.then(|| {
            let (store, stop) = (store.clone(), stop.clone());
            std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .build()
                    .expect("a runtime");
                let mut claims = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let mut bytes = [0u8; 32];
                    fastrand::fill(&mut bytes);
                    let key = LedgerKey::from_bytes(bytes);
                    rt.block_on(async {
                        let token = acquire(&store, request(key, "")).await;
                        store.complete(key, token, done(), RETENTION).await.unwrap();
                    });
                    claims += 1;
                }
                claims
            })
        });
        let beside = if beside_claims { " beside claims" } else { "" };
        for (name, query) in &queries {
            chunk_holds_of(&store, &format!("{name}{beside}"), query);
        }
        stop.store(true, Ordering::Relaxed);
        if let Some(claimer) = claimer {
            let claims = claimer.join().expect("the claimer");
            assert!(claims > 0, "claims were made");
            println!(
                "claims made meanwhile: {claims}, the store grown to {} records",
                store.entry_count()
            );
        }
    }
}

/// Ten pages of `query`, each chunk's hold timed, and what they took.
fn chunk_holds_of(store: &MemoryStore, name: &str, query: &ListQuery) {
    use super::listing::holds::recorded;
    use super::shared::SHARDS;

    const PAGES: usize = 10;
    let holds = recorded(|| {
        for _ in 0..PAGES {
            assert_eq!(store.list_now(query).records.len(), 100, "a full page");
        }
    });
    assert!(
        holds.len() >= PAGES * SHARDS,
        "every shard's chunks timed: {}",
        holds.len()
    );
    let mut cpu: Vec<Duration> = holds.iter().map(|hold| hold.cpu).collect();
    cpu.sort_unstable();
    let wall = holds.iter().map(|hold| hold.wall).max().unwrap_or_default();
    let preempted = holds
        .iter()
        .filter(|hold| hold.wall > hold.cpu + Duration::from_millis(1))
        .count();
    println!(
        "{name}: {} chunks ({} a shard at most), cpu p50 {:.2?} max {:.2?}, wall max {wall:.2?}, \
         {preempted} held over 1 ms longer than they ran",
        holds.len(),
        holds
            .iter()
            .map(|hold| hold.chunks)
            .max()
            .unwrap_or_default(),
        cpu[cpu.len() / 2],
        cpu[cpu.len() - 1],
    );
}
