//! Answers that refuse a request before processing it, for what its headers said or for
//! the server's load: released, not recorded, so the same key and bytes sent again once
//! fixed reach the handler. An axum extractor's rejection over loopback TCP, a rate limiter
//! inside the layer, and the opt-out.
#![cfg(feature = "axum")]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;
use axum::response::IntoResponse;
use axum::routing::post;
use axum::{Json, Router};
use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower::ServiceExt;
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::IdempotencyLayer;

const ORDER: &str = r#"{"order_id":"order-42","amount_cents":1999}"#;

/// A charge handler behind axum's `Json` extractor, counting its runs, with the server
/// face built by `layer` as a route layer.
fn charges(
    layer: IdempotencyLayer<tower_idempotency::server::ServerFace>,
) -> (Router, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        move |Json(_order): Json<serde_json::Value>| async move {
            runs.fetch_add(1, Ordering::SeqCst);
            (StatusCode::CREATED, "ch_1")
        }
    };
    let app = Router::new().route("/charges", post(handler).route_layer(layer));
    (app, runs)
}

fn charge(uri: &str, content_type: &str) -> Request<Full<Bytes>> {
    Request::post(uri)
        .header("authorization", "Bearer sk_alice")
        .header("idempotency-key", "\"order-42\"")
        .header("content-type", content_type)
        .body(Full::new(Bytes::from_static(ORDER.as_bytes())))
        .unwrap()
}

fn replayed<B>(response: &http::Response<B>) -> bool {
    response.headers().contains_key("idempotent-replayed")
}

#[tokio::test]
async fn an_extractors_rejection_is_released_and_the_corrected_request_runs() {
    let (app, runs) = charges(IdempotencyLayer::server(MemoryStore::new()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let uri = format!("http://{}/charges", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();

    // `Json` refuses a body it is not told is JSON: the handler never runs.
    let refused = client.request(charge(&uri, "text/plain")).await.unwrap();
    assert_eq!(refused.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
    // The caller fixes its header and sends the same key and bytes: it runs, once.
    let charged = client
        .request(charge(&uri, "application/json"))
        .await
        .unwrap();
    assert_eq!(charged.status(), StatusCode::CREATED);
    assert!(!replayed(&charged), "the first request's 415 was replayed");
    let again = client
        .request(charge(&uri, "application/json"))
        .await
        .unwrap();
    assert_eq!(again.status(), StatusCode::CREATED);
    assert!(replayed(&again));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_rate_limiters_429_inside_the_layer_is_released() {
    let runs = Arc::new(AtomicUsize::new(0));
    let limited = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        move || async move {
            runs.fetch_add(1, Ordering::SeqCst);
            StatusCode::CREATED
        }
    };
    // A limiter between the layer and the handler: the first request is turned away.
    let limiter = axum::middleware::from_fn(move |req, next: axum::middleware::Next| {
        let limited = limited.clone();
        async move {
            if limited.fetch_add(1, Ordering::SeqCst) == 0 {
                return StatusCode::TOO_MANY_REQUESTS.into_response();
            }
            next.run(req).await
        }
    });
    let app = Router::new().route(
        "/charges",
        post(handler)
            .route_layer(limiter)
            .route_layer(IdempotencyLayer::server(MemoryStore::new())),
    );
    let first = app
        .clone()
        .oneshot(charge("/charges", "application/json"))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::TOO_MANY_REQUESTS);
    let second = app
        .clone()
        .oneshot(charge("/charges", "application/json"))
        .await
        .unwrap();
    assert_eq!(second.status(), StatusCode::CREATED);
    assert!(!replayed(&second), "the 429 was replayed");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn with_no_released_statuses_every_answer_is_recorded() {
    let layer = IdempotencyLayer::server_builder(MemoryStore::new())
        .release_statuses([])
        .build()
        .unwrap();
    let (app, runs) = charges(layer);
    let refused = app
        .clone()
        .oneshot(charge("/charges", "text/plain"))
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
    let again = app
        .oneshot(charge("/charges", "application/json"))
        .await
        .unwrap();
    assert_eq!(again.status(), StatusCode::UNSUPPORTED_MEDIA_TYPE);
    assert!(replayed(&again));
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_success_is_recorded_whatever_the_released_statuses_say() {
    let layer = IdempotencyLayer::server_builder(MemoryStore::new())
        .release_statuses([StatusCode::CREATED])
        .build()
        .unwrap();
    let (app, runs) = charges(layer);
    let first = app
        .clone()
        .oneshot(charge("/charges", "application/json"))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let again = app
        .oneshot(charge("/charges", "application/json"))
        .await
        .unwrap();
    assert!(replayed(&again), "a success was released");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// A server of `handler` behind the default server face, over loopback TCP; its URI.
async fn serve(handler: axum::routing::MethodRouter) -> String {
    let app = Router::new().route(
        "/charges",
        handler.route_layer(IdempotencyLayer::server(MemoryStore::new())),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let uri = format!("http://{}/charges", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    uri
}

#[tokio::test]
async fn an_overloaded_handlers_503_with_retry_after_is_released_and_the_retry_runs() {
    let (calls, effects) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let handler = {
        let (calls, effects) = (calls.clone(), effects.clone());
        post(move || async move {
            // The first call is shed before anything happens; the next one charges.
            if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                return (
                    StatusCode::SERVICE_UNAVAILABLE,
                    [("retry-after", "2")],
                    "busy",
                )
                    .into_response();
            }
            effects.fetch_add(1, Ordering::SeqCst);
            (StatusCode::CREATED, "ch_1").into_response()
        })
    };
    let uri = serve(handler).await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();

    let shed = client
        .request(charge(&uri, "application/json"))
        .await
        .unwrap();
    assert_eq!(shed.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(shed.headers()["retry-after"], "2");
    let charged = client
        .request(charge(&uri, "application/json"))
        .await
        .unwrap();
    assert_eq!(
        charged.status(),
        StatusCode::CREATED,
        "the 503 was replayed"
    );
    assert!(!replayed(&charged));
    let again = client
        .request(charge(&uri, "application/json"))
        .await
        .unwrap();
    assert!(replayed(&again));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(effects.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn an_answer_marked_not_processed_is_released_whatever_its_status() {
    use tower_idempotency::server::NotProcessed;

    let (calls, effects) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let handler = {
        let (calls, effects) = (calls.clone(), effects.clone());
        post(move || async move {
            // A dependency was down before anything was written: the handler says so.
            if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                return (
                    StatusCode::BAD_GATEWAY,
                    axum::Extension(NotProcessed),
                    "ledger of accounts unreachable",
                )
                    .into_response();
            }
            effects.fetch_add(1, Ordering::SeqCst);
            (StatusCode::CREATED, "ch_1").into_response()
        })
    };
    let uri = serve(handler).await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();

    let refused = client
        .request(charge(&uri, "application/json"))
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::BAD_GATEWAY);
    let charged = client
        .request(charge(&uri, "application/json"))
        .await
        .unwrap();
    assert_eq!(
        charged.status(),
        StatusCode::CREATED,
        "the 502 was replayed"
    );
    let again = client
        .request(charge(&uri, "application/json"))
        .await
        .unwrap();
    assert!(replayed(&again));
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(effects.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_replayed_answer_keeps_the_retry_after_it_was_recorded_with() {
    let effects = Arc::new(AtomicUsize::new(0));
    let handler = {
        let effects = effects.clone();
        // Accepted for processing: the caller is told when to look again.
        post(move || async move {
            effects.fetch_add(1, Ordering::SeqCst);
            (StatusCode::ACCEPTED, [("retry-after", "2")], "queued")
        })
    };
    let uri = serve(handler).await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();

    let first = client
        .request(charge(&uri, "application/json"))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    let again = client
        .request(charge(&uri, "application/json"))
        .await
        .unwrap();
    assert!(replayed(&again));
    assert_eq!(again.status(), StatusCode::ACCEPTED);
    assert_eq!(
        again.headers().get("retry-after").map(|v| v.as_bytes()),
        Some(&b"2"[..])
    );
    assert_eq!(effects.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_request_the_ledger_can_never_hold_gets_no_retry_after() {
    use http_body_util::BodyExt;

    let (app, runs) = charges(IdempotencyLayer::server(
        crate::support::down::TooSmallStore,
    ));
    let refused = app
        .oneshot(charge("/charges", "application/json"))
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(
        refused.headers().get("retry-after").is_none(),
        "a Retry-After that can never help"
    );
    let body = refused.into_body().collect().await.unwrap().to_bytes();
    let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert!(problem["type"].as_str().unwrap().ends_with("#ledger-full"));
    assert!(
        problem["detail"].as_str().unwrap().contains("never fit"),
        "{problem}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 0);
}
