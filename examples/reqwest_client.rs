//! The same layers in front of reqwest, against a loopback server.
//!
//! reqwest's `Client` is a `tower::Service<reqwest::Request>`; the layers speak
//! `http::Request<Full<Bytes>>`. A ten-line adapter bridges them with reqwest's own
//! conversions, and a [`ClassifyPhase`] teaches the layers that a reqwest connect error
//! happened before anything was written.
//!
//! ```text
//! cargo run --example reqwest_client
//! ```

use std::collections::HashMap;
use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use tower::{BoxError, Service, ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::phase::FailurePhase;
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::{FrozenRetryLayer, IdempotencyLayer, OperationId, ResponseSource};

/// `http::Request<Full<Bytes>>` in, `http::Response<reqwest::Body>` out.
#[derive(Clone, Debug)]
struct Reqwest(reqwest::Client);

impl Service<http::Request<Full<Bytes>>> for Reqwest {
    type Response = http::Response<reqwest::Body>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Full<Bytes>>) -> Self::Future {
        let client = self.0.clone();
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            // A frozen body is one buffer: collecting it is a move, not a copy.
            let body = body.collect().await?.to_bytes();
            let req = reqwest::Request::try_from(http::Request::from_parts(parts, body))?;
            let response = client.execute(req).await?;
            Ok(http::Response::from(response))
        })
    }
}

/// reqwest reports connect failures (refused, DNS, TLS) apart from everything else.
fn reqwest_phases(error: &(dyn StdError + 'static)) -> Option<FailurePhase> {
    let error = error.downcast_ref::<reqwest::Error>()?;
    if error.is_connect() {
        Some(FailurePhase::PreWrite)
    } else {
        Some(FailurePhase::Unknown)
    }
}

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
        .classify_phase(reqwest_phases)
        .build()?;
    let client = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(MemoryStore::new())
                .classify_phase(reqwest_phases)
                .build()?,
        )
        .layer(FrozenRetryLayer::new(retry))
        .service(Reqwest(reqwest::Client::new()));

    for run in 1..=2 {
        let mut req = http::Request::post(format!("http://{addr}/charges"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(br#"{"order_id":"order_42"}"#)))?;
        req.extensions_mut()
            .insert(OperationId::new("task-11", "charge_customer"));
        let response = client.clone().oneshot(req).await?;
        let source = response.extensions().get::<ResponseSource>().copied();
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
