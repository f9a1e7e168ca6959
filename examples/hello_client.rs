//! The client face in a few lines: a provider that charges and then loses its answer, and
//! one charge on the retry. `cargo run --example hello_client`
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use tower::{Layer, ServiceExt};
use tower_idempotency::testing::{Fault, SideEffectService};
use tower_idempotency::{
    ledger::MemoryStore, retry::RetryPolicy, IdempotencyLayer, KeyHeader, OperationId,
};

#[tokio::main]
async fn main() -> Result<(), tower::BoxError> {
    // A payments provider on loopback that charges, then never answers the first time.
    let provider = SideEffectService::new().with_faults([Fault::CommitThenTimeout]);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let server = provider.clone().serve(listener).await?;

    let policy = RetryPolicy::builder()
        .attempt_timeout(Duration::from_millis(500))
        .build()?;
    // Once per operation outside, frozen retries inside: one service.
    let client = IdempotencyLayer::client_builder(MemoryStore::new())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .retry_policy(policy)
        .build_stack()?
        .layer(Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>());

    let mut charge = Request::post(server.uri("/charges")).body(Full::new(Bytes::from(
        r#"{"order_id":"order_42","amount_cents":1999}"#,
    )))?;
    charge
        .extensions_mut()
        .insert(OperationId::new("task-7", "charge_customer"));

    let response = client.oneshot(charge).await?;
    println!(
        "status {}, provider effects: {}",
        response.status(),
        provider.effects()
    );
    assert_eq!(
        provider.effects(),
        1,
        "charged once, though the first answer was lost"
    );
    Ok(())
}
