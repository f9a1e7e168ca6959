//! The client face as a reqwest-middleware `Middleware`, with `reqwest-retry` outside it,
//! against a loopback server (feature `reqwest-middleware`).
//!
//! The server charges, then answers after the caller's timeout. `reqwest-retry` retries
//! the timed-out attempt; the retry goes through the ledger, finds the operation in doubt
//! and resends the stored bytes under the same `Idempotency-Key`, so the server answers
//! it from its key table. The orchestrator's second run of the step is replayed from the
//! ledger without a request.
//!
//! ```text
//! cargo run --features reqwest-middleware --example reqwest_middleware
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use reqwest_middleware::ClientBuilder;
use reqwest_retry::policies::ExponentialBackoff;
use reqwest_retry::RetryTransientMiddleware;
use tower::BoxError;
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::reqwest_middleware::IdempotencyMiddleware;
use tower_idempotency::{IdempotencyLayer, KeyHeader, OperationId, ResponseSource};

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

    let retries = ExponentialBackoff::builder()
        .retry_bounds(Duration::from_millis(10), Duration::from_millis(100))
        .build_with_max_retries(3);
    let ledger = IdempotencyLayer::client_builder(MemoryStore::new())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        // Records must outlive reqwest-retry's whole schedule (here well under 5 s).
        .retry_policy(
            tower_idempotency::retry::RetryPolicy::builder()
                .max_elapsed(Duration::from_secs(5))
                .build()
                .unwrap(),
        )
        .build()?;
    // Redirects off: a followed redirect's failure would read as "never sent".
    let no_redirects = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()?;
    let client = ClientBuilder::new(no_redirects)
        // Outside: one retrying layer, each of its attempts a visit to the ledger.
        .with(RetryTransientMiddleware::new_with_policy(retries))
        .with(IdempotencyMiddleware::new(ledger))
        .build();

    for run in 1..=2 {
        let response = client
            .post(format!("http://{addr}/charges"))
            .header("content-type", "application/json")
            .body(r#"{"order_id":"order_42"}"#)
            .timeout(Duration::from_millis(200))
            .with_extension(OperationId::new("task-11", "charge_customer"))
            .send()
            .await?;
        let how = match ResponseSource::in_extensions(response.extensions()) {
            ResponseSource::Sent => "sent",
            ResponseSource::Resent => "resent the frozen bytes after a timeout",
            ResponseSource::Replayed => "replayed from the ledger, no request",
            _ => "unprotected",
        };
        println!("run {run}: {how}: {}", response.text().await?);
    }
    let charged = charges.lock().unwrap().len();
    println!(
        "requests that reached the server: {}, charges: {charged}",
        requests.load(Ordering::SeqCst)
    );
    assert_eq!(charged, 1);
    Ok(())
}
