//! A held lease racing the calls around it: the owner's hold against a caller taking over,
//! and its let-go against a caller waiting to take over.

use super::*;

/// An owner whose lease ran out asks the store to hold it while a rival tries to take the
/// operation over: either the hold comes first and the rival is told busy until the
/// owner's write, or the rival owns it and the hold is refused (the owner's later write
/// fenced), for every write the owner may make next. Never both: a held owner overtaken.
#[test]
fn a_hold_races_a_take_over() {
    for settle in [
        Settle::Complete,
        Settle::Abandon,
        Settle::MarkInDoubt,
        Settle::Renew,
    ] {
        let name = format!("a_hold_races_a_take_over({settle:?})");
        explore(&name, None, move || {
            let threads = race_a_rival(claim(false), move |caller| {
                caller.call(hold());
                caller.settle(settle, Key(0), Token(1), OutcomeId(1));
            });
            // Held, the owner cannot have been overtaken before its write.
            let held = threads[0][0].1 == Answer::Held;
            let fenced = threads[0][1].1 == Answer::Fenced;
            assert!(!(held && fenced), "held and taken over: {threads:?}");
        });
    }
}

/// A held owner lets go of its lease (a lease of zero: over the moment it is let go) and
/// then writes, while a rival tries to take over: before the let-go the rival is told
/// busy, after it the rival may own the operation and the owner's write is fenced; the
/// outcome replayed is the one of whoever owned the key last.
#[test]
fn a_let_go_races_a_take_over() {
    for settle in [Settle::Complete, Settle::Abandon, Settle::MarkInDoubt] {
        let name = format!("a_let_go_races_a_take_over({settle:?})");
        explore(&name, None, move || {
            race_a_rival(claim(true), move |caller| {
                caller.call(Op::LetGo {
                    key: Key(0),
                    token: Token(1),
                });
                caller.settle(settle, Key(0), Token(1), OutcomeId(1));
            });
        });
    }
}

/// The setup: `Token(1)` claims `Key(0)`, and holds it if `held`.
fn claim(held: bool) -> impl FnOnce(&mut Caller) {
    move |caller| {
        assert!(owns(&caller.begin(Key(0), Token(1))));
        if held {
            assert_eq!(caller.call(hold()), Answer::Held);
        }
    }
}

/// The owner's hold of `Key(0)` under `Token(1)`.
fn hold() -> Op {
    Op::Hold {
        key: Key(0),
        token: Token(1),
    }
}

/// A waiter that found a held operation busy is woken when its owner settles, whether the
/// owner lets go first (as a guard dropped unsettled does) or settles straight from the
/// hold (as a guard that settles does); either way the waiter finds it no longer busy.
#[test]
fn a_waiter_on_a_held_lease_is_woken_by_its_settle() {
    for let_go_first in [false, true] {
        let name = format!(
            "a_waiter_on_a_held_lease_is_woken_by_its_settle(let go first: {let_go_first})"
        );
        explore(&name, None, move || {
            let store = MemoryStore::new();
            let mut setup = Caller::new(&store, LONG);
            assert!(owns(&setup.begin(Key(0), Token(1))));
            assert_eq!(setup.call(hold()), Answer::Held);
            let owner = spawn(Caller::new(&store, LONG), move |caller| {
                if let_go_first {
                    caller.call(Op::LetGo {
                        key: Key(0),
                        token: Token(1),
                    });
                }
                caller.settle(Settle::Complete, Key(0), Token(1), OutcomeId(1));
            });
            let waiter = spawn(Caller::new(&store, LONG), |caller| {
                // As the layers wait: subscribe, then ask; sleep while busy. A let-go may
                // wake it for nothing (it asks again); the settle wakes it for good.
                for _ in 0..3 {
                    let settled = caller
                        .store
                        .notify_settled(ledger_key(Key(0)))
                        .expect("the memory store notifies");
                    match caller.probe(Key(0), Token(2)) {
                        Answer::Busy { .. } => wait(settled),
                        _ => break,
                    }
                }
            });
            let threads = join(vec![owner, waiter]);
            let last = threads[1].last().map(|(_, answer)| answer);
            assert_eq!(last, Some(&Answer::Replay(OutcomeId(1))), "{threads:?}");
            assert_linearizable(LONG, &setup.history, &threads, &[]);
            assert_books_balance(&store);
        });
    }
}
