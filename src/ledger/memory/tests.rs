//! The store and the field digests a face gathers for it: a record completed with digests
//! gathered outside the store answers as one whose digests the store made itself.

use std::time::Duration;

use http::{HeaderMap, StatusCode, Version};
use proptest::prelude::*;
use serde_json::{Map, Value};

use super::MemoryStore;
use crate::frozen::test_post;
use crate::ledger::{
    Begin, BeginRequest, GatheredFields, IdempotencyStore, LedgerKey, Outcome, RequestFields,
    StoredResponse,
};
use crate::FrozenRequest;

const LEASE: Duration = Duration::from_secs(10);
const RETENTION: Duration = Duration::from_secs(3600);

fn begin(key: LedgerKey, request: &FrozenRequest) -> BeginRequest {
    BeginRequest::new(key, request.fingerprint(), LEASE, RETENTION).with_frozen(request.clone())
}

/// How a record's outcome is made: with the request's digests gathered by the face, or
/// left for the store to make.
#[derive(Clone, Copy, Debug)]
enum Recorder {
    Gathers,
    LeavesToStore,
}

fn outcome(recorder: Recorder, request: &FrozenRequest) -> Outcome {
    let gathered = GatheredFields::of(match recorder {
        Recorder::Gathers => Some(request),
        Recorder::LeavesToStore => None,
    });
    Outcome::Response(StoredResponse::with_request_fields(
        StatusCode::CREATED,
        Version::HTTP_11,
        &HeaderMap::new(),
        br#"{"id":"ch_1"}"#,
        &gathered,
    ))
}

/// Complete `first` as `recorder` does, then ask with `again`: what the store answers, and
/// the store's weight once completed.
async fn drift_after(
    recorder: Recorder,
    first: &FrozenRequest,
    again: &FrozenRequest,
) -> (Begin, u64) {
    let store = MemoryStore::new();
    let key = LedgerKey::from_bytes([7; 32]);
    let Begin::Acquired { token } = store.begin(begin(key, first)).await.unwrap() else {
        panic!("a new key is acquired");
    };
    store
        .complete(key, token, outcome(recorder, first), RETENTION)
        .await
        .unwrap();
    let weight = store.weighted_size();
    (store.begin(begin(key, again)).await.unwrap(), weight)
}

/// What a drift answer names: the fields changed, when the store kept digests.
fn named(answer: &Begin, again: &FrozenRequest) -> Option<Vec<String>> {
    match answer {
        Begin::DriftFields { fields, .. } => fields.changed_fields(again.body()),
        Begin::Drift { .. } => None,
        Begin::Replay(_) => Some(Vec::new()),
        other => panic!("a completed record answers a drift or a replay, not {other:?}"),
    }
}

fn payload() -> impl Strategy<Value = Map<String, Value>> {
    let value = prop_oneof![
        "[a-z ]{0,40}".prop_map(Value::from),
        any::<i32>().prop_map(Value::from),
        any::<bool>().prop_map(Value::from),
        proptest::collection::vec(any::<u8>(), 0..3).prop_map(Value::from),
    ];
    proptest::collection::btree_map("[a-z]{1,6}", value, 0..6)
        .prop_map(|map| map.into_iter().collect())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
}

proptest! {
    /// A payload regenerated with some fields changed (or not a JSON object at all) reads
    /// the same from a record whose digests the face gathered as from one whose digests the
    /// store made: the same answer, the same fields named. The gathered record weighs no
    /// more.
    #[test]
    fn gathered_digests_answer_as_the_stores_own(
        first in payload(),
        changes in proptest::collection::btree_map("[a-z]{1,6}", "[a-z]{0,8}", 0..3),
        first_is_json in any::<bool>(),
    ) {
        let first_body = if first_is_json {
            serde_json::to_vec(&first).unwrap()
        } else {
            b"not json".to_vec()
        };
        let mut again = first.clone();
        for (name, value) in changes {
            again.insert(name, Value::from(value));
        }
        let first = test_post(first_body);
        let again = test_post(serde_json::to_vec(&again).unwrap());
        // The face's path is the one taken: an object's digests ride in the record.
        let gathered_fields = GatheredFields::of(Some(&first));
        prop_assert_eq!(
            matches!(gathered_fields.fields(), RequestFields::Entries(_)),
            first_is_json
        );
        let rt = runtime();
        let (gathered, gathered_weight) =
            rt.block_on(drift_after(Recorder::Gathers, &first, &again));
        let (made, made_weight) =
            rt.block_on(drift_after(Recorder::LeavesToStore, &first, &again));
        prop_assert_eq!(
            std::mem::discriminant(&gathered),
            std::mem::discriminant(&made)
        );
        prop_assert_eq!(named(&gathered, &again), named(&made, &again));
        prop_assert!(gathered_weight <= made_weight);
    }
}

#[tokio::test]
async fn digests_heavier_than_the_request_are_not_kept() {
    // Many one-letter fields: each entry (name and digest) outweighs its `"a":1,`.
    let body: String = (0..2000)
        .map(|n| format!("\"{}\":1", char::from(b'a' + (n % 26) as u8)))
        .collect::<Vec<_>>()
        .join(",");
    let request = test_post(format!("{{{body}}}").into_bytes());
    let again = test_post(&br#"{"a":2}"#[..]);
    for recorder in [Recorder::Gathers, Recorder::LeavesToStore] {
        let (answer, _) = drift_after(recorder, &request, &again).await;
        // Still a drift from a request, which the faces may continue with; naming no field.
        match answer {
            Begin::DriftFields { fields, .. } => {
                assert_eq!(fields.changed_fields(again.body()), None, "{recorder:?}");
            }
            other => panic!("{recorder:?}: {other:?}"),
        }
    }
}
