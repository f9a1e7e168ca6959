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
use tower_idempotency::ledger::{IdempotencyStore, MemoryStore};
use tower_idempotency::testing::SideEffectService;
use tower_idempotency::{IdempotencyLayer, OperationId, PayloadDiscarded, ResponseSource};

/// What the client face answered a request: replayed, sent, or an error (by kind).
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    Sent(StatusCode),
    Replayed { status: StatusCode, discarded: bool },
    Drift,
    Other(String),
}

/// A request of one operation (the same `OperationId` every time) with `body`.
fn request(content_type: &'static str, body: &'static str) -> Request<Full<Bytes>> {
    let mut request = Request::post("http://orders.local/orders")
        .header("content-type", content_type)
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap();
    request
        .extensions_mut()
        .insert(OperationId::new("task-parity", "create-order"));
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
    let provider = SideEffectService::new();
    let layer = IdempotencyLayer::client_builder(store)
        .provider_deduplicates(true)
        .build()
        .unwrap();
    let client = ServiceBuilder::new().layer(layer).service(provider.clone());
    let mut answers = Vec::new();
    for body in [first, again] {
        let answer = match client.clone().oneshot(request(content_type, body)).await {
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
