//! The same layers in front of reqwest, against a loopback server (feature `reqwest`).
//!
//! `tower_idempotency::reqwest::ReqwestService` bridges a `reqwest::Client` to the
//! `http::Request<Full<Bytes>>` the layers send, and with the feature on the layers know
//! that a reqwest connect error happened before anything was written.
//!
//! ```text
//! cargo run --features reqwest --example reqwest_client
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use tower::{BoxError, ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::reqwest::ReqwestService;
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::{
    FrozenRetryLayer, IdempotencyLayer, KeyHeader, OperationId, ResponseSource,
};

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    // A loopback payments API that deduplicates on `Idempotency-Key`, as Stripe does, and
    // whose first answer arrives after the caller has given up.
    let requests = Arc::new(AtomicUsize::new(0));
    let charges: Arc<Mutex<HashMap<String, String>>> = Arc::default();
    let app = Router::new().route(
        "/charges",
        post({
            let (requests, charges) = (requests.clone(), charges.clone());
            move |headers: http::HeaderMap| async move {
                let n = requests.fetch_add(1, Ordering::SeqCst);
                let key = headers
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("none")
                    .to_owned();
                let receipt = {
                    let mut charges = charges.lock().unwrap();
                    let next = charges.len() + 1;
                    charges
                        .entry(key)
                        .or_insert_with(|| format!("charge ch_{next}"))
                        .clone()
                };
                if n == 0 {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                (http::StatusCode::CREATED, receipt)
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });

    let retry = RetryPolicy::builder()
        .attempt_timeout(Duration::from_millis(200))
        .build()?;
    let client = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(MemoryStore::new())
                .provider_deduplicates(true)
                .key_header(KeyHeader::ietf())
                .retry_policy(retry.clone())
                .build()?,
        )
        .layer(FrozenRetryLayer::new(retry))
        // Redirects off: a followed redirect's failure would read as "never sent".
        .service(ReqwestService::from_builder(reqwest::Client::builder())?);

    for run in 1..=2 {
        let mut req = http::Request::post(format!("http://{addr}/charges"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(br#"{"order_id":"order_42"}"#)))?;
        req.extensions_mut()
            .insert(OperationId::new("task-11", "charge_customer"));
        let response = client.clone().oneshot(req).await?;
        let source = ResponseSource::of(&response);
        let body = response.into_body().collect().await?.to_bytes();
        println!("run {run}: {source:?}: {}", String::from_utf8_lossy(&body));
    }
    // The first attempt timed out and was retried with the same key and bytes (the server
    // answered it from its key table); the second run replayed the ledger without a request.
    let charged = charges.lock().unwrap().len();
    println!(
        "requests that reached the server: {}, charges: {charged}",
        requests.load(Ordering::SeqCst)
    );
    assert_eq!(charged, 1);
    Ok(())
}
