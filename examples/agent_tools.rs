//! An orchestrator with three tools on one ledger: an HTTP API (the client face), an
//! SDK-like charge that ignores keys (the tool face, reconciled), and a read.
//! The orchestrator runs the agent's step twice (its first run failed after the charge
//! landed) and the model regenerates its calls; each effect still happens once.
//! `cargo run --example agent_tools`
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use serde_json::{json, Value};
use tower::{Layer, ServiceBuilder, ServiceExt};
use tower_idempotency::idempotency::{InDoubtOperation, Reconciled};
use tower_idempotency::ledger::{IdempotencyStore, MemoryStore};
use tower_idempotency::testing::{SideEffectService, ToolDouble, ToolFault};
use tower_idempotency::tool::{
    applied, frozen_arguments, ProviderKeys, ToolCall, ToolClass, ToolLayer,
};
use tower_idempotency::{
    retry::RetryPolicy, FrozenRetryLayer, IdempotencyLayer, KeyHeader, OperationId,
};

#[tokio::main]
async fn main() -> Result<(), tower::BoxError> {
    let ledger: Arc<dyn IdempotencyStore> = Arc::new(MemoryStore::new());

    // Tool 1, HTTP: a shipping API on loopback, through the client face.
    let shipping = SideEffectService::new();
    let server = shipping
        .clone()
        .serve(tokio::net::TcpListener::bind("127.0.0.1:0").await?)
        .await?;
    let policy = RetryPolicy::builder()
        .attempt_timeout(Duration::from_millis(500))
        .build()?;
    let http = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            ledger.clone(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .layer(FrozenRetryLayer::new(policy))
        .service(Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>());

    // Tool 2, SDK-like: a payments SDK that ignores keys. Its first call charges, then times
    // out; the provider's lookup (by order) answers whether a charge happened.
    let payments = ToolDouble::new().with_faults([ToolFault::CommitThenTimeout]);
    let lookup = payments.clone();
    let charge = ToolLayer::builder(ledger.clone(), "charge_customer", ProviderKeys::Ignored)
        .scope("billing-agent")
        .classify(ToolDouble::classifier())
        .reconcile(move |operation: InDoubtOperation| {
            let lookup = lookup.clone();
            async move {
                let args: Value = frozen_arguments(&operation)?;
                let op = OperationId::new(args["task"].as_str().unwrap_or_default(), "charge");
                Ok(match lookup.arguments_of(&op).first() {
                    Some(made) => applied(&json!({"receipt": "ch_found", "arguments": made}))?,
                    None => Reconciled::NotApplied,
                })
            }
        })
        .build()?
        .layer(payments.clone());

    // Tool 3, a read: straight through, never recorded.
    let orders = ToolDouble::new();
    let lookup_order = ToolLayer::builder(ledger.clone(), "lookup_order", ProviderKeys::Ignored)
        .class(ToolClass::Read)
        .build()?
        .layer(orders.clone());

    // The agent's step, run twice by the orchestrator; the model rewords its calls each time.
    for run in 1..=3 {
        let summary = format!("charge order 42 (wording #{run})");
        let order = lookup_order
            .clone()
            .oneshot(ToolCall::new(
                OperationId::new("task-42", "lookup"),
                json!({"order": 42}),
            ))
            .await?;
        let args =
            json!({"task": "task-42", "order_id": "o-42", "cents": 1999, "summary": summary});
        match charge
            .clone()
            .oneshot(ToolCall::new(OperationId::new("task-42", "charge"), args))
            .await
        {
            Ok(receipt) => println!(
                "run {run}: charge {:?} ({:?}; discarded fields: {:?})",
                receipt.value()["receipt"],
                receipt.source(),
                receipt.discarded().and_then(|d| d.changed_fields()),
            ),
            Err(err) => {
                println!("run {run}: charge failed ({err}); the orchestrator will retry the step");
                continue;
            }
        }
        let mut ship = Request::post(server.uri("/shipments"))
            .body(Full::new(Bytes::from_static(br#"{"order_id":"o-42"}"#)))?;
        ship.extensions_mut()
            .insert(OperationId::new("task-42", "ship"));
        let shipped = http.clone().oneshot(ship).await?;
        println!(
            "run {run}: read {:?}, shipment {}",
            order.source(),
            shipped.status()
        );
    }

    println!(
        "charges: {}, shipments: {}, order lookups: {}",
        payments.effects(),
        shipping.effects(),
        orders.effects()
    );
    assert_eq!(
        (payments.effects(), shipping.effects()),
        (1, 1),
        "each effect once"
    );
    Ok(())
}
