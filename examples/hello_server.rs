//! The server face in a few lines: an axum handler behind `IdempotencyLayer`, and a client
//! that sends the same keyed request twice. `cargo run --example hello_server`
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::{http::StatusCode, routing::post, Router};
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};

#[tokio::main]
async fn main() -> Result<(), tower::BoxError> {
    let charges = Arc::new(AtomicUsize::new(0));
    let counted = charges.clone();
    let charge = move || async move {
        let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
        (StatusCode::CREATED, format!(r#"{{"charge_id":"ch_{n}"}}"#))
    };
    // On the method router, around POST alone.
    let app = Router::new().route(
        "/charges",
        post(charge).route_layer(IdempotencyLayer::server(MemoryStore::new())),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });

    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    for _ in 0..2 {
        let req = Request::post(format!("http://{addr}/charges"))
            .header("authorization", "Bearer sk_test_merchant") // keys are scoped by it
            .header("idempotency-key", "\"order-42-charge\"")
            .body(Full::new(Bytes::from(r#"{"amount_cents":1999}"#)))?;
        let res = client.request(req).await?;
        let replayed = res.headers().contains_key("idempotent-replayed");
        let body = res.into_body().collect().await?.to_bytes();
        println!("{} replayed={replayed}", String::from_utf8_lossy(&body));
    }
    assert_eq!(charges.load(Ordering::SeqCst), 1, "the handler ran once");
    Ok(())
}
