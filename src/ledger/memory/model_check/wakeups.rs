//! Waiters and settles: every settle wakes the waiters on its key, a neighbour's wakes
//! them for nothing.

use super::*;

/// Wait for `key` as the layers do: subscribe, then ask; sleep until a settle while the
/// operation is busy. At most `rounds` answers.
fn wait_while_busy(caller: &mut Caller, key: Key, token: Token, rounds: usize) {
    for _ in 0..rounds {
        let settled = caller
            .store
            .notify_settled(ledger_key(key))
            .expect("the memory store notifies");
        match caller.begin(key, token) {
            Answer::Busy { .. } => wait(settled),
            _ => return,
        }
    }
}

fn busy_answers(calls: &[(Op, Answer)]) -> usize {
    calls
        .iter()
        .filter(|(_, answer)| matches!(answer, Answer::Busy { .. }))
        .count()
}

/// A caller waits for a busy operation while its owner settles it: whichever comes first,
/// the waiter is woken (no lost wake-up) and then finds the operation settled.
#[test]
fn a_waiter_is_woken_by_every_settle() {
    for settle in [Settle::Complete, Settle::Abandon, Settle::MarkInDoubt] {
        let name = format!("a_waiter_is_woken_by_every_settle({settle:?})");
        explore(&name, None, move || {
            let store = MemoryStore::new();
            let mut setup = Caller::new(&store, LONG);
            assert!(owns(&setup.begin(Key(0), Token(1))));
            let owner = spawn(Caller::new(&store, LONG), move |caller| {
                caller.settle(settle, Key(0), Token(1), OutcomeId(1));
            });
            let waiter = spawn(Caller::new(&store, LONG), |caller| {
                wait_while_busy(caller, Key(0), Token(2), 3);
            });
            let threads = join(vec![owner, waiter]);
            let waited = &threads[1];
            // One settle: woken by it, the waiter never finds the operation busy again.
            assert!(busy_answers(waited) <= 1, "{waited:?}");
            assert!(!matches!(waited.last(), Some((_, Answer::Busy { .. }))));
            assert_linearizable(LONG, &setup.history, &threads, &[]);
            assert_books_balance(&store);
        });
    }
}

/// A settle of another key in the same shard wakes a waiter for nothing: it asks again,
/// finds the operation still busy, sleeps again and is woken by the settle it waits for.
#[test]
fn a_neighbours_settle_wakes_a_waiter_for_nothing() {
    explore(
        "a_neighbours_settle_wakes_a_waiter_for_nothing",
        None,
        || {
            let (key, neighbour) = (Key(0), Key(64));
            let store = MemoryStore::new();
            let mut setup = Caller::new(&store, LONG);
            assert!(owns(&setup.begin(key, Token(1))));
            assert!(owns(&setup.begin(neighbour, Token(3))));
            let owner = spawn(Caller::new(&store, LONG), move |caller| {
                caller.settle(Settle::Complete, neighbour, Token(3), OutcomeId(3));
                caller.settle(Settle::Complete, key, Token(1), OutcomeId(1));
            });
            let waiter = spawn(Caller::new(&store, LONG), move |caller| {
                wait_while_busy(caller, key, Token(2), 3);
            });
            let threads = join(vec![owner, waiter]);
            let waited = &threads[1];
            assert!(busy_answers(waited) <= 2, "{waited:?}");
            assert!(!matches!(waited.last(), Some((_, Answer::Busy { .. }))));
            assert_linearizable(LONG, &setup.history, &threads, &[]);
            assert_books_balance(&store);
        },
    );
}
