//! The warnings the client layers give once, in a test binary of its own: `tracing`'s
//! callsite interest is global, so captures must not share a process with tests that log
//! through the same callsites without a subscriber.
#![cfg(feature = "test-util")]

#[path = "support/capture.rs"]
mod capture;

#[path = "support/orders.rs"]
mod orders;

use orders::{fast_policy, post, source, ORDERS};

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::testing::SideEffectService;
use tower_idempotency::{FrozenRetryLayer, IdempotencyLayer, OperationId, ResponseSource};

const ORIGINAL: &str = r#"{"order_id":"ord_8f21c3"}"#;
/// Defect 14's second half: the TTLs are checked against the retry policy really stacked
/// inside, not only the window the builder was told.
#[tokio::test(start_paused = true)]
async fn a_retry_policy_longer_than_the_layer_was_told_is_reported_once() {
    let (logs, _default) = capture::warnings();
    let long = RetryPolicy::builder()
        .max_elapsed(Duration::from_secs(600))
        .build()
        .unwrap();
    let provider = SideEffectService::new();
    let told = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(MemoryStore::new()))
        .layer(FrozenRetryLayer::new(long.clone()))
        .service(provider.clone());
    for step in ["a", "b"] {
        let mut req = post(ORIGINAL);
        req.extensions_mut().insert(OperationId::new("t", step));
        told.clone().oneshot(req).await.unwrap();
    }
    let logged = logs.text();
    assert_eq!(
        logged.matches("retry_policy(&policy)").count(),
        1,
        "{logged}"
    );

    // Built from the real policy, it has nothing to say.
    logs.clear();
    let checked = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(MemoryStore::new())
                .retry_policy(&long)
                .build()
                .unwrap(),
        )
        .layer(FrozenRetryLayer::new(long))
        .service(provider);
    checked.oneshot(post(ORIGINAL)).await.unwrap();
    assert!(logs.text().is_empty());
}

#[tokio::test(start_paused = true)]
async fn a_retry_layer_outside_the_idempotency_layer_is_reported_once() {
    let (logs, _default) = capture::warnings();
    let provider = SideEffectService::new();
    let wrong = ServiceBuilder::new()
        .layer(FrozenRetryLayer::new(fast_policy(Duration::from_secs(1))))
        .layer(IdempotencyLayer::client(MemoryStore::new()))
        .service(provider.clone());
    for step in ["a", "b"] {
        let mut req = post(ORIGINAL);
        req.extensions_mut().insert(OperationId::new("t", step));
        wrong.clone().oneshot(req).await.unwrap();
    }
    assert_eq!(
        logs.text().matches("client_stack").count(),
        1,
        "{}",
        logs.text()
    );

    // The right order says nothing.
    logs.clear();
    let policy = fast_policy(Duration::from_secs(1));
    let right = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(MemoryStore::new())
                .retry_policy(&policy)
                .build()
                .unwrap(),
        )
        .layer(FrozenRetryLayer::new(policy))
        .service(provider);
    right.oneshot(post(ORIGINAL)).await.unwrap();
    assert!(logs.text().is_empty(), "{}", logs.text());
}

#[tokio::test(start_paused = true)]
async fn an_unprotected_side_effect_is_marked_and_reported() {
    let (logs, _default) = capture::warnings();
    let provider = SideEffectService::new();
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(MemoryStore::new()))
        .layer(FrozenRetryLayer::new(fast_policy(Duration::from_secs(1))))
        .service(provider);
    for _ in 0..2 {
        let keyless = Request::post(ORDERS)
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        let res = client.clone().oneshot(keyless).await.unwrap();
        assert_eq!(source(&res), Some(ResponseSource::Unprotected));
    }
    assert_eq!(
        logs.text().matches("unprotected").count(),
        1,
        "{}",
        logs.text()
    );
    // A read is not a side effect: no marker.
    let read = Request::get(ORDERS).body(Full::new(Bytes::new())).unwrap();
    let res = client.oneshot(read).await.unwrap();
    assert_eq!(source(&res), None);
}
