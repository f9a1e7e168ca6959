//! A full budget: eviction spares open and protected records, and claims racing for one
//! eviction share or lose it as the model says.

use super::*;

/// The store of the eviction scenario, before its callers race: key 1 completed past its
/// protected window (the one record that may be evicted), key 2 completed inside it, key
/// 3 in flight. Key 1's outcome carries `padding` bytes, so that evicting it makes that much
/// more room.
fn fill_for_eviction(store: &MemoryStore, padding: usize) {
    let unprotected = request(Key(1), Token(1), LONG).with_protected_window(Duration::ZERO);
    ready(store.begin(unprotected)).expect("claim");
    ready(store.complete(
        ledger_key(Key(1)),
        lease_token(Token(1)),
        padded(padding),
        LONG,
    ))
    .expect("complete");
    ready(store.begin(request(Key(2), Token(2), LONG))).expect("claim");
    ready(store.complete(
        ledger_key(Key(2)),
        lease_token(Token(2)),
        outcome(OutcomeId(2)),
        LONG,
    ))
    .expect("complete");
    ready(store.begin(request(Key(3), Token(3), LONG))).expect("claim");
}

/// A budget (and key 1's padding) with room for exactly one new claim once key 1 is
/// evicted, and for none before, even once key 3 completes: a completion gives its frozen
/// request back, so it makes some room, less than a claim.
fn room_for_one_claim_by_evicting_key_1() -> (u64, usize) {
    let scratch = MemoryStore::new();
    ready(scratch.begin(request(Key(4), Token(4), LONG))).expect("claim");
    let claim = scratch.weighted_size();
    // Key 1 outweighs what completing key 3 frees (less than a claim).
    let padding = 2 * claim as usize;
    let scratch = MemoryStore::new();
    fill_for_eviction(&scratch, padding);
    let full = scratch.weighted_size();
    let alone = MemoryStore::new();
    let unprotected = request(Key(1), Token(1), LONG).with_protected_window(Duration::ZERO);
    ready(alone.begin(unprotected)).expect("claim");
    ready(alone.complete(
        ledger_key(Key(1)),
        lease_token(Token(1)),
        padded(padding),
        LONG,
    ))
    .expect("complete");
    let key_1 = alone.weighted_size();
    (full - key_1 + claim, padding)
}

fn padded(padding: usize) -> Outcome {
    Outcome::Response(StoredResponse::new(
        StatusCode::CREATED,
        Version::HTTP_11,
        HeaderMap::new(),
        Bytes::from(vec![b'.'; padding]),
    ))
}

fn state(store: &MemoryStore, key: Key) -> Option<RecordState> {
    ready(store.inspect(ledger_key(key)))
        .expect("inspect")
        .map(|view| view.state)
}

/// A full store, room for one more claim only by evicting key 1: a new key's claim, a
/// claim on key 1 itself and the completion of key 3 (which frees less than a claim) race
/// for it. Whatever the order, the protected record and the open one stay, one claim gets
/// the room, and the books balance.
#[test]
fn eviction_spares_open_and_protected_records() {
    explore(
        "eviction_spares_open_and_protected_records",
        Some(2),
        || {
            let (budget, padding) = room_for_one_claim_by_evicting_key_1();
            let store = MemoryStore::builder().max_bytes(budget).build();
            fill_for_eviction(&store, padding);
            let claimer = |key: Key, token: Token| {
                let store = store.clone();
                loom::thread::spawn(move || ready(store.begin(request(key, token, LONG))))
            };
            let newcomer = claimer(Key(4), Token(4));
            let reclaimer = claimer(Key(1), Token(5));
            let completer = {
                let store = store.clone();
                loom::thread::spawn(move || {
                    let key = ledger_key(Key(3));
                    ready(store.complete(key, lease_token(Token(3)), outcome(OutcomeId(3)), LONG))
                })
            };
            let newcomer = newcomer.join().expect("newcomer");
            let reclaimer = reclaimer.join().expect("reclaimer");
            completer
                .join()
                .expect("completer")
                .expect("a completion never fails for room");

            let acquired =
                |begin: &Result<Begin, StoreError>| matches!(begin, Ok(Begin::Acquired { .. }));
            let refused =
                |begin: &Result<Begin, StoreError>| matches!(begin, Err(err) if err.is_full());
            assert!(acquired(&newcomer) || refused(&newcomer), "{newcomer:?}");
            assert!(
                acquired(&reclaimer)
                    || refused(&reclaimer)
                    || matches!(&reclaimer, Ok(Begin::Replay(_))),
                "{reclaimer:?}"
            );
            // Evicting key 1 makes room for exactly one claim.
            assert_eq!(
                usize::from(acquired(&newcomer)) + usize::from(acquired(&reclaimer)),
                1,
                "newcomer {newcomer:?}, reclaimer {reclaimer:?}"
            );
            assert!(matches!(
                state(&store, Key(2)),
                Some(RecordState::Completed { .. })
            ));
            assert!(matches!(
                state(&store, Key(3)),
                Some(RecordState::Completed { .. })
            ));
            if acquired(&newcomer) {
                assert!(matches!(
                    state(&store, Key(4)),
                    Some(RecordState::InFlight { .. })
                ));
            }
            if acquired(&reclaimer) {
                assert!(matches!(
                    state(&store, Key(1)),
                    Some(RecordState::InFlight { .. })
                ));
            }
            assert!(store.evictions() <= 1);
            assert_books_balance(&store);
        },
    );
}

/// Two new claims race for the room that evicting key 1 makes: one of them gets it.
#[test]
fn two_claims_race_for_one_eviction() {
    explore("two_claims_race_for_one_eviction", None, || {
        let (budget, padding) = room_for_one_claim_by_evicting_key_1();
        let store = MemoryStore::builder().max_bytes(budget).build();
        fill_for_eviction(&store, padding);
        let claimer = |key: Key, token: Token| {
            let store = store.clone();
            loom::thread::spawn(move || ready(store.begin(request(key, token, LONG))))
        };
        let first = claimer(Key(4), Token(4));
        let second = claimer(Key(5), Token(5));
        let first = first.join().expect("first");
        let second = second.join().expect("second");
        let acquired =
            |begin: &Result<Begin, StoreError>| matches!(begin, Ok(Begin::Acquired { .. }));
        assert_eq!(
            usize::from(acquired(&first)) + usize::from(acquired(&second)),
            1,
            "first {first:?}, second {second:?}"
        );
        assert_books_balance(&store);
    });
}

/// Evicting key 1 makes room for two new claims, which race for it: both get it.
///
/// The schedule this guards against: one claim finds key 1 at the front of the eviction
/// order and is preempted before it takes key 1's shard to remove it; the other, were the
/// entry already gone from the order, would find it empty (key 2's window has not ended),
/// sweep, find nothing past its retention and refuse with a full error although the room it
/// needed was being made, leaving the budget half empty. An entry leaves the order only with
/// its record, under the record's shard lock, so the second claim waits on that lock for the
/// room instead.
#[test]
fn two_claims_share_one_eviction() {
    explore("two_claims_share_one_eviction", None, || {
        let scratch = MemoryStore::new();
        ready(scratch.begin(request(Key(4), Token(4), LONG))).expect("claim");
        let claim = scratch.weighted_size();
        let scratch = MemoryStore::new();
        fill_for_eviction(&scratch, 2 * claim as usize);
        let full = scratch.weighted_size();

        let store = MemoryStore::builder().max_bytes(full + claim / 2).build();
        fill_for_eviction(&store, 2 * claim as usize);
        let claimer = |key: Key, token: Token| {
            let store = store.clone();
            loom::thread::spawn(move || ready(store.begin(request(key, token, LONG))))
        };
        let first = claimer(Key(4), Token(4));
        let second = claimer(Key(5), Token(5));
        let first = first.join().expect("first");
        let second = second.join().expect("second");
        assert!(
            matches!(first, Ok(Begin::Acquired { .. }))
                && matches!(second, Ok(Begin::Acquired { .. })),
            "first {first:?}, second {second:?}"
        );
        assert_books_balance(&store);
    });
}
