//! Both faces together over real TCP: the client stack (idempotency outside, frozen retry
//! inside, hyper-util) against the demo payments service (axum with the server layer).

use crate::support::axum_server;

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::retry::{Attempts, RetryPolicy};
use tower_idempotency::ProviderKeys;
use tower_idempotency::{
    FrozenRetryLayer, IdempotencyLayer, KeyHeader, OperationId, ResponseSource,
};

use axum_server::Charge;

async fn serve(app: axum::Router) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// The provider charges (taking 400 ms), the client gives up on each attempt after 150 ms:
/// commit, then time out. The retry carries the same key and bytes; the server answers
/// "in progress" (409 + Retry-After) until the first charge is recorded, then replays it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_then_timeout_charges_once_and_the_client_ends_with_the_real_response() {
    let server = serve(axum_server::app(
        MemoryStore::new(),
        Duration::from_millis(400),
    ))
    .await;
    let hyper = HyperClient::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .layer(FrozenRetryLayer::new(
            RetryPolicy::builder()
                .attempt_timeout(Duration::from_millis(150))
                .max_attempts(5)
                .no_budget()
                .build()
                .unwrap(),
        ))
        .service(hyper.clone());

    let mut charge = Request::post(format!("http://{server}/charges"))
        .header("authorization", "tenant-a")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(
            br#"{"order_id":"order_42","amount_cents":1999}"#,
        )))
        .unwrap();
    charge
        .extensions_mut()
        .insert(OperationId::new("task-1", "charge_customer"));
    let response = client.oneshot(charge).await.expect("the real response");

    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(
        ResponseSource::of(&response),
        ResponseSource::Resent,
        "the timed-out attempt was resent"
    );
    let attempts = response.extensions().get::<Attempts>().unwrap().get();
    assert!(
        attempts >= 2,
        "the first attempt timed out ({attempts} attempts)"
    );
    assert_eq!(response.headers()["idempotent-replayed"], "true");
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let charged: Charge = serde_json::from_slice(&body).unwrap();
    assert_eq!(charged.order_id, "order_42");

    let list = Request::get(format!("http://{server}/charges?order_id=order_42"))
        .header("authorization", "tenant-a")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let listed = hyper.request(list).await.unwrap();
    let body = listed.into_body().collect().await.unwrap().to_bytes();
    let charges: Vec<Charge> = serde_json::from_slice(&body).unwrap();
    assert_eq!(
        charges,
        vec![charged],
        "exactly one charge, the one the client received"
    );
}
