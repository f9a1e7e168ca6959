//! What an `Idempotency-Key` value must look like, on both faces: one RFC 8941 sf-string or
//! one bare token. A bare value with a comma is two keys joined (what a proxy makes of two
//! field lines, RFC 9110 §5.3), refused like the two lines themselves.
#![cfg(feature = "test-util")]

use std::net::SocketAddr;

use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::server::problem;
use tower_idempotency::testing::SideEffectService;
use tower_idempotency::ProviderKeys;
use tower_idempotency::{IdempotencyLayer, InvalidKey, KeyHeader};

/// An axum app whose `POST /orders` goes through the server layer, on a loopback port.
async fn serve() -> SocketAddr {
    let layer = IdempotencyLayer::server_builder(MemoryStore::new())
        .unscoped()
        .build()
        .unwrap();
    let app = Router::new().route(
        "/orders",
        post(|| async { (StatusCode::CREATED, "created") }).route_layer(layer),
    );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// Send `POST /orders` with these raw `Idempotency-Key` field lines, byte for byte; the
/// status and the body of the answer.
async fn post_with_key_lines(addr: SocketAddr, lines: &[&str]) -> (StatusCode, Bytes) {
    let mut head = String::from("POST /orders HTTP/1.1\r\nHost: orders.local\r\n");
    for line in lines {
        head.push_str(&format!("Idempotency-Key: {line}\r\n"));
    }
    head.push_str(
        "Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}",
    );
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.unwrap();
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").unwrap();
    let status_line = std::str::from_utf8(&raw[..split])
        .unwrap()
        .lines()
        .next()
        .unwrap();
    let status: u16 = status_line.split(' ').nth(1).unwrap().parse().unwrap();
    (
        StatusCode::from_u16(status).unwrap(),
        Bytes::copy_from_slice(&raw[split + 4..]),
    )
}

fn reason(body: &[u8]) -> (String, String) {
    let problem: Value = serde_json::from_slice(body).unwrap();
    (
        problem["type"].as_str().unwrap().to_owned(),
        problem["reason"].as_str().unwrap().to_owned(),
    )
}

#[tokio::test]
async fn a_bare_key_with_commas_is_refused_like_two_field_lines() {
    let addr = serve().await;
    let invalid = |why: &str| (problem::KEY_INVALID.to_owned(), why.to_owned());

    // Two field lines, and the one line a proxy joins them into, with or without a space.
    let (status, body) = post_with_key_lines(addr, &["key", "with"]).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(reason(&body), invalid("repeated"));
    for joined in ["key,with,commas", "key, with", "a,b"] {
        let (status, body) = post_with_key_lines(addr, &[joined]).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{joined}");
        assert_eq!(reason(&body), invalid("not-a-token"), "{joined}");
    }
    // Another delimiter a structured field parser would split on.
    let (status, body) = post_with_key_lines(addr, &["key;v=1"]).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(reason(&body), invalid("not-a-token"));

    // One sf-string holding commas is one key; so is a bare token.
    for key in [
        "\"key,with,commas\"",
        "550e8400-e29b-41d4-a716-446655440000",
    ] {
        let (status, body) = post_with_key_lines(addr, &[key]).await;
        assert_eq!(status, StatusCode::CREATED, "{key}");
        assert_eq!(&body[..], b"created");
    }
}

#[tokio::test]
async fn a_callers_own_bare_key_with_a_comma_is_a_clear_error_and_nothing_is_sent() {
    let provider = SideEffectService::new();
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .service(provider.clone());
    let request = |key: &'static str| {
        Request::post("http://orders.local/orders")
            .header("authorization", "Bearer sk_test") // a caller's key is scoped by it
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    };
    let err = client
        .clone()
        .oneshot(request("key,with,commas"))
        .await
        .unwrap_err();
    assert!(err.is_invalid_key(), "{err}");
    assert_eq!(
        err.invalid_key(),
        Some(&InvalidKey::NotAToken { byte: b',' })
    );
    assert!(err.to_string().contains("nothing was sent"), "{err}");
    assert_eq!(provider.calls(), 0);

    let sent = client
        .oneshot(request("\"key,with,commas\""))
        .await
        .unwrap();
    assert!(sent.status().is_success());
    assert_eq!(provider.effects(), 1);
}
