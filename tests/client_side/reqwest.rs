//! The layers in front of reqwest (feature `reqwest`), over loopback TCP against the
//! testing kit's provider.
#![cfg(all(feature = "reqwest", feature = "test-util"))]

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use tokio::net::TcpListener;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::phase::FailurePhase;
use tower_idempotency::reqwest::ReqwestService;
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::testing::{Fault, SideEffectService};
use tower_idempotency::ProviderKeys;
use tower_idempotency::{
    FrozenRetryLayer, IdempotencyLayer, KeyHeader, OperationId, ResponseSource,
};

const ORDER: &str = r#"{"order_id":"order_42","amount_cents":1999}"#;

fn policy() -> RetryPolicy {
    RetryPolicy::builder()
        .attempt_timeout(Duration::from_millis(300))
        .backoff(Duration::from_millis(5), Duration::from_millis(20))
        .no_budget()
        .build()
        .unwrap()
}

fn charge(uri: http::Uri) -> Request<Full<Bytes>> {
    let mut req = Request::post(uri)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(ORDER.as_bytes())))
        .unwrap();
    req.extensions_mut()
        .insert(OperationId::new("task-7", "charge_customer"));
    req
}

#[tokio::test]
async fn commit_then_timeout_through_reqwest_charges_once_and_ends_with_the_real_answer() {
    let provider = SideEffectService::new().with_faults([Fault::CommitThenTimeout]);
    let server = provider
        .clone()
        .serve(TcpListener::bind("127.0.0.1:0").await.unwrap())
        .await
        .unwrap();
    let store = MemoryStore::new();
    let client = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(store)
                .provider_deduplicates(true)
                .key_header(KeyHeader::ietf())
                .retry_policy(policy().clone())
                .build()
                .unwrap(),
        )
        .layer(FrozenRetryLayer::new(policy()))
        .service(ReqwestService::new(reqwest::Client::new()));

    let response = client
        .clone()
        .oneshot(charge(server.uri("/charges")))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    // The attempt that timed out may have arrived: the answer is a resend's.
    assert_eq!(ResponseSource::of(&response), ResponseSource::Resent);
    let first = response.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(provider.effects(), 1, "charged once");
    let attempts = provider.attempts();
    assert_eq!(attempts.len(), 2, "the timed-out attempt was resent");
    assert_eq!(attempts[0].body(), attempts[1].body());
    assert_eq!(attempts[0].key(), attempts[1].key());

    // The orchestrator runs the step again: the recorded answer, no request.
    let again = client
        .oneshot(charge(server.uri("/charges")))
        .await
        .unwrap();
    assert_eq!(ResponseSource::of(&again), ResponseSource::Replayed);
    assert_eq!(again.into_body().collect().await.unwrap().to_bytes(), first);
    assert_eq!(provider.calls(), 2);
}

#[tokio::test]
async fn a_refused_connection_through_reqwest_is_pre_write_and_releases_the_operation() {
    // A port nobody listens on: reqwest's connect error, classified without any setting.
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = closed.local_addr().unwrap();
    drop(closed);
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .layer(FrozenRetryLayer::new(policy()))
        .service(ReqwestService::new(reqwest::Client::new()));
    let uri: http::Uri = format!("http://{addr}/charges").parse().unwrap();
    let err = client
        .clone()
        .oneshot(charge(uri.clone()))
        .await
        .unwrap_err();
    assert_eq!(err.phase(), Some(FailurePhase::PreWrite), "{err:?}");

    // Released: once the provider is up on that port, the same operation is sent, not resumed.
    let provider = SideEffectService::new();
    let _server = provider
        .clone()
        .serve(TcpListener::bind(addr).await.unwrap())
        .await
        .unwrap();
    let response = client.oneshot(charge(uri)).await.unwrap();
    assert_eq!(ResponseSource::of(&response), ResponseSource::Sent);
    assert_eq!(provider.effects(), 1);
}
