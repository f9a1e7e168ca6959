//! Claims racing on one key, and a lapsed owner racing the caller that takes over.

use super::*;

/// Three callers race to claim one key: one owns it, the others are told it is busy (or
/// replayed, once the owner is done), and the owner's outcome is what is replayed.
#[test]
fn racing_claims_leave_one_owner() {
    explore("racing_claims_leave_one_owner", None, || {
        let store = MemoryStore::new();
        let racers = (1..=3u8)
            .map(|n| {
                spawn(Caller::new(&store, LONG), move |caller| {
                    let token = Token(n.into());
                    if owns(&caller.begin(Key(0), token)) {
                        caller.settle(Settle::Complete, Key(0), token, OutcomeId(n));
                    }
                })
            })
            .collect();
        let threads = join(racers);
        let owners = threads.iter().filter(|calls| owns(&calls[0].1)).count();
        assert_eq!(owners, 1, "{threads:?}");
        let mut reader = Caller::new(&store, LONG);
        reader.probe(Key(0), Token(9));
        assert_linearizable(LONG, &[], &threads, &reader.history);
        assert_books_balance(&store);
    });
}

/// An owner whose lease ran out writes while another caller takes the operation over: the
/// write lands before the take-over or is fenced, never after it, for every write and
/// whether the lapsed owner held a first claim or a resume.
#[test]
fn a_lapsed_owner_races_a_take_over() {
    for settle in [
        Settle::Complete,
        Settle::Abandon,
        Settle::MarkInDoubt,
        Settle::Renew,
    ] {
        for resumed in [false, true] {
            let name = format!("a_lapsed_owner_races_a_take_over({settle:?}, resumed: {resumed})");
            explore(&name, None, move || {
                let setup = move |caller: &mut Caller| {
                    if resumed {
                        caller.begin(Key(0), Token(0));
                    }
                    assert!(owns(&caller.begin(Key(0), Token(1))));
                };
                race_a_rival(setup, move |caller| {
                    caller.settle(settle, Key(0), Token(1), OutcomeId(1));
                });
            });
        }
    }
}
