//! The client stack over real loopback HTTP: hyper-util's client, the testing kit's
//! provider served by hyper.
#![cfg(feature = "test-util")]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::phase::FailurePhase;
use tower_idempotency::retry::{Attempts, RetryPolicy};
use tower_idempotency::testing::{Fault, SideEffectService};
use tower_idempotency::ProviderKeys;
use tower_idempotency::{
    FrozenRetryLayer, IdempotencyLayer, KeyHeader, OperationId, ResponseSource,
};

fn hyper_client() -> HyperClient<HttpConnector, Full<Bytes>> {
    HyperClient::builder(TokioExecutor::new()).build_http()
}

/// Backoff kept tiny so the test spends its time on the wire, not asleep.
fn quick_retries() -> RetryPolicy {
    RetryPolicy::builder()
        .backoff(Duration::from_millis(1), Duration::from_millis(2))
        .attempt_timeout(Duration::from_millis(500))
        .no_budget()
        .build()
        .unwrap()
}

async fn serve(provider: &SideEffectService) -> tower_idempotency::testing::ServeHandle {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    provider.clone().serve(listener).await.unwrap()
}

fn charge(uri: http::Uri, body: String) -> Request<Full<Bytes>> {
    let mut req = Request::post(uri)
        .header("content-type", "application/json")
        .header("x-request-source", "orchestrator")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    req.extensions_mut()
        .insert(OperationId::new("task-77", "create-order"));
    req
}

#[tokio::test]
async fn every_attempt_carries_byte_identical_method_uri_headers_and_body() {
    let provider = SideEffectService::new().with_faults([
        Fault::ServerError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            commit: false,
        },
        Fault::ServerError {
            status: StatusCode::BAD_GATEWAY,
            commit: false,
        },
    ]);
    let server = serve(&provider).await;
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .layer(FrozenRetryLayer::new(quick_retries()))
        .service(hyper_client());

    // The agent produces its tool call once; a fresh intent id each time it would be asked.
    let intent = format!("fi_{:08x}", fastrand_u32());
    let body = format!(r#"{{"order_id":"ord_8f21c3","fulfillment_intent_id":"{intent}"}}"#);
    let response = client
        .oneshot(charge(server.uri("/orders?region=eu"), body.clone()))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(
        response.extensions().get::<Attempts>(),
        Some(&Attempts::new(3))
    );

    let attempts = provider.attempts();
    assert_eq!(attempts.len(), 3);
    let first = &attempts[0];
    assert_eq!(first.body(), body.as_bytes());
    for later in &attempts[1..] {
        assert_eq!(later.method(), first.method());
        assert_eq!(later.uri(), first.uri());
        assert_eq!(later.version(), first.version());
        assert_eq!(
            later.headers(),
            first.headers(),
            "every header, the key included"
        );
        assert_eq!(later.body(), first.body());
    }
    assert!(first.headers().contains_key("idempotency-key"));
    assert_eq!(provider.effects(), 1);
}

fn fastrand_u32() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u8(0);
    h.finish() as u32
}

#[tokio::test]
async fn commit_then_timeout_over_tcp_fires_once_and_ends_with_the_real_response() {
    let provider = SideEffectService::new().with_faults([Fault::CommitThenTimeout]);
    let server = serve(&provider).await;
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .layer(FrozenRetryLayer::new(quick_retries()))
        .service(hyper_client());
    let response = client
        .oneshot(charge(
            server.uri("/charges"),
            r#"{"amount_cents":1999}"#.into(),
        ))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(
        ResponseSource::of(&response),
        ResponseSource::Resent,
        "the timed-out attempt was resent"
    );
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert!(
        String::from_utf8_lossy(&body).contains("eff_1"),
        "the first commit's answer"
    );
    assert_eq!(provider.effects(), 1);
    assert_eq!(provider.attempts().len(), 2);
}

#[tokio::test]
async fn a_refused_connection_is_pre_write_and_releases_the_operation() {
    // A port nobody listens on: the connect fails before a byte is written.
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = closed.local_addr().unwrap();
    drop(closed);

    let store = Arc::new(MemoryStore::new());
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            store.clone(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .layer(FrozenRetryLayer::new(quick_retries()))
        .service(hyper_client());
    let uri: http::Uri = format!("http://{addr}/charges").parse().unwrap();
    let err = client
        .clone()
        .oneshot(charge(uri, "{}".into()))
        .await
        .unwrap_err();
    assert_eq!(err.phase(), Some(FailurePhase::PreWrite), "{err:?}");

    // Released: once the provider is up on that port, the next run is a first send.
    let provider = SideEffectService::new();
    let listener = TcpListener::bind(addr).await.unwrap();
    let server = provider.clone().serve(listener).await.unwrap();
    let response = client
        .oneshot(charge(server.uri("/charges"), "{}".into()))
        .await
        .unwrap();
    assert_eq!(ResponseSource::of(&response), ResponseSource::Sent);
    assert_eq!(provider.effects(), 1);
}
