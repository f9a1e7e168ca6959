//! The default scope, a caller's credential, judged as HTTP reads it: the auth-scheme is
//! case-insensitive and may be followed by any run of spaces (RFC 9110, 11.4); the
//! credentials are compared byte for byte. Over loopback TCP, since spelling is the wire's.
#![cfg(feature = "axum")]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::IdempotencyLayer;

/// A counted charge handler behind the default server face, over loopback; its URI.
async fn serve_charges() -> (String, Arc<AtomicUsize>) {
    let effects = Arc::new(AtomicUsize::new(0));
    let handler = {
        let effects = effects.clone();
        post(move || async move {
            effects.fetch_add(1, Ordering::SeqCst);
            (StatusCode::CREATED, "ch_1")
        })
    };
    let app = Router::new().route(
        "/charges",
        handler.route_layer(IdempotencyLayer::server(MemoryStore::new())),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let uri = format!("http://{}/charges", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (uri, effects)
}

fn charge(uri: &str, authorization: &str) -> Request<Full<Bytes>> {
    Request::post(uri)
        .header("authorization", authorization)
        .header("idempotency-key", "\"order-42\"")
        .body(Full::new(Bytes::from_static(b"{\"amount_cents\":1999}")))
        .unwrap()
}

#[tokio::test]
async fn one_credential_spelled_with_any_scheme_case_and_spacing_is_one_caller() {
    let (uri, effects) = serve_charges().await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();

    for spelling in ["bearer tok", "Bearer tok", "BEARER  tok", "Bearer \ttok"] {
        let answer = client.request(charge(&uri, spelling)).await.unwrap();
        assert_eq!(answer.status(), StatusCode::CREATED, "{spelling:?}");
    }
    assert_eq!(effects.load(Ordering::SeqCst), 1, "the handler ran again");
}

#[tokio::test]
async fn credentials_that_differ_in_case_are_two_callers() {
    let (uri, effects) = serve_charges().await;
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();

    for spelling in ["Bearer tok", "Bearer TOK", "Basic tok"] {
        let answer = client.request(charge(&uri, spelling)).await.unwrap();
        assert_eq!(answer.status(), StatusCode::CREATED);
        assert!(
            !answer.headers().contains_key("idempotent-replayed"),
            "{spelling:?}"
        );
    }
    assert_eq!(effects.load(Ordering::SeqCst), 3);
}
