//! The same scenario against every store, with the same answer: what a store keeps of a
//! completed operation must judge a regenerated request as the others do.
//!
//! Each scenario runs on `MemoryStore` and on `RedisStore` (a private `redis-server`, see
//! `support/redis.rs`; skipped without one unless `REQUIRE_REDIS=1`).
#![cfg(feature = "test-util")]

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::fingerprint::PayloadFields;
use tower_idempotency::ledger::{IdempotencyStore, MemoryStore};
use tower_idempotency::testing::SideEffectService;
use tower_idempotency::{
    DriftPolicy, IdempotencyLayer, KeyHeader, OperationId, PayloadDiscarded, ResponseSource,
};

/// What the client face answered a request: replayed, sent, or an error (by kind).
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    Sent(StatusCode),
    Replayed { status: StatusCode, discarded: bool },
    Drift,
    Other(String),
}

/// A request of operation `step` (of one task) with `body`.
fn request(step: &str, content_type: &'static str, body: &'static str) -> Request<Full<Bytes>> {
    let mut request = Request::post("http://orders.local/orders")
        .header("content-type", content_type)
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap();
    request
        .extensions_mut()
        .insert(OperationId::new("task-parity", step));
    request
}

/// Send `first`, then `again` (a regenerated request of the same operation) through a
/// client face on `store`: what each was answered, and the effects the provider ran.
async fn first_then_regenerated(
    store: Arc<dyn IdempotencyStore>,
    content_type: &'static str,
    first: &'static str,
    again: &'static str,
) -> (Vec<Answer>, usize) {
    let layer = IdempotencyLayer::client_builder(store)
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf());
    first_then_regenerated_through(
        layer.build().unwrap(),
        "create-order",
        (content_type, first, again),
    )
    .await
}

/// [`first_then_regenerated`] through `layer`, as operation `step`.
async fn first_then_regenerated_through(
    layer: IdempotencyLayer<tower_idempotency::client::ClientFace>,
    step: &str,
    (content_type, first, again): (&'static str, &'static str, &'static str),
) -> (Vec<Answer>, usize) {
    let provider = SideEffectService::new();
    let client = ServiceBuilder::new().layer(layer).service(provider.clone());
    let mut answers = Vec::new();
    for body in [first, again] {
        let answer = match client
            .clone()
            .oneshot(request(step, content_type, body))
            .await
        {
            Ok(response) => match ResponseSource::of(&response) {
                ResponseSource::Replayed => Answer::Replayed {
                    status: response.status(),
                    discarded: response.extensions().get::<PayloadDiscarded>().is_some(),
                },
                _ => Answer::Sent(response.status()),
            },
            Err(err) if err.is_drift() => Answer::Drift,
            Err(err) => Answer::Other(err.to_string()),
        };
        answers.push(answer);
    }
    (answers, provider.effects())
}

/// A regenerated form body (no JSON: nothing of it can be named field by field) under the
/// same operation is the operation first sent: replayed, once, on every store.
async fn a_regenerated_form_body_replays(store: Arc<dyn IdempotencyStore>, name: &str) {
    let (answers, effects) = first_then_regenerated(
        store,
        "application/x-www-form-urlencoded",
        "amount=5&note=first+try",
        "amount=5&note=second+try",
    )
    .await;
    assert_eq!(
        answers,
        [
            Answer::Sent(StatusCode::CREATED),
            Answer::Replayed {
                status: StatusCode::CREATED,
                discarded: true
            }
        ],
        "{name}"
    );
    assert_eq!(effects, 1, "{name}");
}

#[tokio::test]
async fn a_regenerated_form_body_replays_on_the_memory_store() {
    a_regenerated_form_body_replays(Arc::new(MemoryStore::new()), "memory").await;
}

#[cfg(feature = "redis")]
#[test]
fn a_regenerated_form_body_replays_on_the_redis_store() {
    crate::support::redis::on_redis("parity-form", |store| {
        a_regenerated_form_body_replays(store, "redis")
    });
}

const CUSTOMER: &str = r#"{"customer":{"id":"cus_1","name":"Ada"},"amount_cents":500}"#;
const RENAMED: &str = r#"{"customer":{"id":"cus_1","name":"Ada Lovelace"},"amount_cents":500}"#;
const ANOTHER_CUSTOMER: &str = r#"{"customer":{"id":"cus_2","name":"Ada"},"amount_cents":500}"#;

/// `first` then `again`, as operation `step`, through a face that refuses drift but for a
/// change outside the nested defining field `/customer/id`.
async fn judged_by_a_nested_field(
    store: Arc<dyn IdempotencyStore>,
    step: &str,
    first: &'static str,
    again: &'static str,
) -> (Vec<Answer>, usize) {
    let layer = IdempotencyLayer::client_builder(store)
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .drift_policy(DriftPolicy::Reject)
        .defining_fields(PayloadFields::new(["/customer/id"]).unwrap());
    let request = ("application/json", first, again);
    first_then_regenerated_through(layer.build().unwrap(), step, request).await
}

/// A change beside a nested defining field is the same operation (replayed, once); a
/// change to it is drift: on every store.
async fn a_nested_defining_field_decides(store: Arc<dyn IdempotencyStore>, name: &str) {
    let (answers, effects) =
        judged_by_a_nested_field(store.clone(), "renamed", CUSTOMER, RENAMED).await;
    assert_eq!(
        answers,
        [
            Answer::Sent(StatusCode::CREATED),
            Answer::Replayed {
                status: StatusCode::CREATED,
                discarded: true
            }
        ],
        "{name}: the name changed, not the id"
    );
    assert_eq!(effects, 1, "{name}");
    let (answers, effects) =
        judged_by_a_nested_field(store, "another-customer", CUSTOMER, ANOTHER_CUSTOMER).await;
    assert_eq!(
        answers,
        [Answer::Sent(StatusCode::CREATED), Answer::Drift],
        "{name}: the id changed"
    );
    assert_eq!(effects, 1, "{name}");
}

#[tokio::test]
async fn a_nested_defining_field_decides_on_the_memory_store() {
    a_nested_defining_field_decides(Arc::new(MemoryStore::new()), "memory").await;
}

#[cfg(feature = "redis")]
#[test]
fn a_nested_defining_field_decides_on_the_redis_store() {
    crate::support::redis::on_redis("parity-nested", |store| {
        a_nested_defining_field_decides(store, "redis")
    });
}
