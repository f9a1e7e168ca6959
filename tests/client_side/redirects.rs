//! reqwest follows redirects by default, at the end of a reqwest-middleware chain as in
//! `ReqwestService`: the answer the client face then sees is the redirect's request's, and
//! the operation's own request was answered before it. A provider that charges and answers
//! `303 See Other`, whose receipt page then answers `429` or `401`, must not have the
//! operation released to be charged again; a client built without redirects records the
//! `303` itself.
#![cfg(feature = "reqwest-middleware")]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::routing::{get, post};
use axum::Router;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use tokio::net::TcpListener;
use tower::{Layer, ServiceExt};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::reqwest::ReqwestService;
use tower_idempotency::reqwest_middleware::IdempotencyMiddleware;
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::{IdempotencyLayer, OperationId, ResponseSource};

const ORDER: &str = r#"{"order_id":"order_42","amount_cents":1999}"#;

/// A provider that ignores keys: `POST /charges` charges and answers `303` to its receipt
/// page; `GET /receipt` answers `receipt_status`. Its base URL and its charges.
async fn provider(receipt_status: StatusCode) -> (String, Arc<AtomicUsize>) {
    let charges = Arc::new(AtomicUsize::new(0));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let location = format!("{base}/receipt");
    let charge = {
        let charges = charges.clone();
        move || async move {
            charges.fetch_add(1, Ordering::SeqCst);
            (StatusCode::SEE_OTHER, [(http::header::LOCATION, location)])
        }
    };
    let app = Router::new()
        .route("/charges", post(charge))
        .route("/receipt", get(move || async move { receipt_status }));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (base, charges)
}

fn charge(base: &str) -> Request<Full<Bytes>> {
    let mut req = Request::post(format!("{base}/charges"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(ORDER.as_bytes())))
        .unwrap();
    req.extensions_mut()
        .insert(OperationId::new("task-7", "charge_customer"));
    req
}

/// Two runs of the operation through the stack over `ReqwestService` on `http`; the
/// charges made.
async fn through_reqwest_service(http: reqwest::Client, status: StatusCode) -> usize {
    let (base, charges) = provider(status).await;
    let client = IdempotencyLayer::client_builder(MemoryStore::new())
        .provider_deduplicates(false)
        .retry_policy(RetryPolicy::builder().no_budget().build().unwrap())
        .build_stack()
        .unwrap()
        .layer(ReqwestService::new(http));
    for _ in 0..2 {
        let _ = client.clone().oneshot(charge(&base)).await;
    }
    charges.load(Ordering::SeqCst)
}

/// Two runs of the operation through reqwest-middleware on `http`; the charges made.
async fn through_reqwest_middleware(http: reqwest::Client, status: StatusCode) -> usize {
    let (base, charges) = provider(status).await;
    let layer = IdempotencyLayer::client_builder(MemoryStore::new())
        .provider_deduplicates(false)
        .build()
        .unwrap();
    let client = reqwest_middleware::ClientBuilder::new(http)
        .with(IdempotencyMiddleware::new(layer))
        .build();
    for _ in 0..2 {
        let _ = client
            .post(format!("{base}/charges"))
            .header("content-type", "application/json")
            .body(ORDER)
            .with_extension(OperationId::new("task-7", "charge_customer"))
            .send()
            .await;
    }
    charges.load(Ordering::SeqCst)
}

#[tokio::test]
async fn a_redirects_429_or_401_does_not_release_the_operation() {
    for status in [StatusCode::TOO_MANY_REQUESTS, StatusCode::UNAUTHORIZED] {
        let charges = through_reqwest_service(reqwest::Client::new(), status).await;
        assert_eq!(
            charges, 1,
            "ReqwestService: released on the redirect's {status}"
        );
        let charges = through_reqwest_middleware(reqwest::Client::new(), status).await;
        assert_eq!(
            charges, 1,
            "reqwest-middleware: released on the redirect's {status}"
        );
    }
}

#[tokio::test]
async fn a_redirects_answer_is_recorded_and_replayed() {
    let charges = through_reqwest_service(reqwest::Client::new(), StatusCode::OK).await;
    assert_eq!(charges, 1);
    let charges = through_reqwest_middleware(reqwest::Client::new(), StatusCode::OK).await;
    assert_eq!(charges, 1);
}

/// As the module docs advise: a client that follows no redirect hands the `303` over as
/// the answer, recorded and replayed, whatever the receipt page would have said.
#[tokio::test]
async fn without_redirects_the_303_is_the_recorded_answer() {
    let http = || {
        reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap()
    };
    let status = StatusCode::TOO_MANY_REQUESTS;
    assert_eq!(through_reqwest_service(http(), status).await, 1);
    assert_eq!(through_reqwest_middleware(http(), status).await, 1);
}

/// `ReqwestService::from_builder` turns redirects off whatever the builder said: the
/// `303` is the operation's answer, recorded and replayed, and the receipt page's `429` is
/// never taken for it. One charge over two runs.
#[tokio::test]
async fn a_service_from_a_builder_records_the_redirect_itself() {
    let (base, charges) = provider(StatusCode::TOO_MANY_REQUESTS).await;
    let follows = reqwest::Client::builder().redirect(reqwest::redirect::Policy::limited(10));
    let client = IdempotencyLayer::client_builder(MemoryStore::new())
        .provider_deduplicates(false)
        .retry_policy(RetryPolicy::builder().no_budget().build().unwrap())
        .build_stack()
        .unwrap()
        .layer(ReqwestService::from_builder(follows).unwrap());
    let first = client.clone().oneshot(charge(&base)).await.unwrap();
    assert_eq!(first.status(), StatusCode::SEE_OTHER);
    assert_eq!(ResponseSource::of(&first), ResponseSource::Sent);
    let again = client.oneshot(charge(&base)).await.unwrap();
    assert_eq!(again.status(), StatusCode::SEE_OTHER);
    assert_eq!(ResponseSource::of(&again), ResponseSource::Replayed);
    assert_eq!(charges.load(Ordering::SeqCst), 1);
}
