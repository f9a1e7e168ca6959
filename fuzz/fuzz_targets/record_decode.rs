//! The ledger record decoders: arbitrary bytes, as a corrupted or forged Redis record.
//!
//! Both decoders must answer `Ok` or a corrupt-record `StoreError`, never panic, and never
//! allocate from a forged length (libFuzzer's `-rss_limit_mb` / `-malloc_limit_mb` catch
//! that). What decodes must re-encode to a record that decodes to the same thing.
//!
//! A record with more than 24 576 distinct header names needs an input of ~340 KB: run with
//! `-max_len=400000` to reach that corner (it must be refused as corrupt).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tower_idempotency::ledger::Outcome;
use tower_idempotency::FrozenRequest;

fuzz_target!(|data: &[u8]| {
    match Outcome::decode(data) {
        Ok(outcome) => {
            let again = Outcome::decode(&outcome.encode()).expect("a re-encoded outcome decodes");
            match (&outcome, &again) {
                (Outcome::Response(a), Outcome::Response(b)) => {
                    assert_eq!(a.status(), b.status());
                    assert_eq!(a.version(), b.version());
                    assert_eq!(a.headers(), b.headers());
                    assert_eq!(a.body(), b.body());
                }
                (Outcome::Tombstone { status: a }, Outcome::Tombstone { status: b }) => {
                    assert_eq!(a, b)
                }
                (a, b) => panic!("{a:?} re-decoded as {b:?}"),
            }
        }
        Err(err) => assert!(err.is_corrupt(), "{err:?}"),
    }
    match FrozenRequest::decode(data) {
        Ok(request) => {
            let again =
                FrozenRequest::decode(&request.encode()).expect("a re-encoded request decodes");
            assert_eq!(request.method(), again.method());
            assert_eq!(request.uri(), again.uri());
            assert_eq!(request.version(), again.version());
            assert_eq!(request.headers(), again.headers());
            assert_eq!(request.body(), again.body());
            assert_eq!(request.fingerprint(), again.fingerprint());
        }
        Err(err) => assert!(err.is_corrupt(), "{err:?}"),
    }
});
