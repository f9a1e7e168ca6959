//! What the server face's records are of: `METHOD /path` as the client sent it, without
//! its query string, nested routes included. Over loopback TCP with axum.
#![cfg(feature = "axum")]

use std::sync::Arc;

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower_idempotency::ledger::{IdempotencyStore, ListQuery, MemoryStore, OriginFace};
use tower_idempotency::IdempotencyLayer;

/// A received request's record shows the method and the path the client sent, never its
/// query string, and the list finds it by that target.
#[tokio::test]
async fn a_received_request_is_recorded_as_its_method_and_path() {
    let store = Arc::new(MemoryStore::new());
    let orders = Router::new().route(
        "/orders",
        post(|| async { (StatusCode::CREATED, "created") }).route_layer(
            IdempotencyLayer::server_builder(store.clone())
                .unscoped()
                .build()
                .unwrap(),
        ),
    );
    let app = Router::new().nest("/v1", orders);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let client = Client::builder(TokioExecutor::new()).build_http();
    let request = Request::post(format!("http://{addr}/v1/orders?token=secret"))
        .header("idempotency-key", "\"order-1\"")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    let answer = client.request(request).await.unwrap();
    assert_eq!(answer.status(), StatusCode::CREATED);

    let page = store
        .list(ListQuery::new().target("POST /v1/"))
        .await
        .unwrap();
    assert_eq!(page.records.len(), 1, "{page:?}");
    let origin = page.records[0].view.origin.clone().expect("an origin");
    assert_eq!(origin.face(), OriginFace::Server);
    assert_eq!(
        origin.target(),
        "POST /v1/orders",
        "the path as sent, no query"
    );
    assert_eq!(origin.task_id(), None);
}
