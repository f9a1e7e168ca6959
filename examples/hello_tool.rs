//! The tool face in a few lines: an SDK-like charge tool that charges and then times out,
//! and a re-run step whose model regenerated the call. One charge, the regenerated words
//! discarded and named. `cargo run --example hello_tool`
use tower::{Layer, ServiceExt};
use tower_idempotency::testing::{ToolDouble, ToolFault};
use tower_idempotency::tool::{ProviderKeys, ToolCall, ToolLayer};
use tower_idempotency::{ledger::MemoryStore, OperationId};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // An SDK that runs each idempotency key once, and whose first answer never arrives.
    let sdk = ToolDouble::deduplicating().with_faults([ToolFault::CommitThenTimeout]);
    // The key reaches the SDK (`ToolCall::key`), so a resend is safe: `Deduplicates`.
    let layer = ToolLayer::builder(MemoryStore::new(), "charge", ProviderKeys::Deduplicates)
        .classify(ToolDouble::classifier())
        .build()?;
    let charge = layer.layer(sdk.clone());

    // The orchestrator's identity for this step, the same on every run of it.
    let step = OperationId::new("task-7", "charge_customer");
    let first = serde_json::json!({"order_id": "o-42", "cents": 1999, "summary": "Charge o-42"});
    let output = charge
        .clone()
        .oneshot(ToolCall::new(step.clone(), first))
        .await?;
    println!("first run: {:?} {}", output.source(), output.value());

    // The step runs again and the model words its call anew: the frozen call is kept.
    let regenerated =
        serde_json::json!({"order_id": "o-42", "cents": 1999, "summary": "Bill order o-42"});
    let output = charge
        .oneshot(ToolCall::new(step.clone(), regenerated))
        .await?;
    let discarded = output.discarded().and_then(|d| d.changed_fields());
    println!("re-run: {:?}, discarded {discarded:?}", output.source());

    assert_eq!(sdk.effects_of(&step), 1, "charged once");
    Ok(())
}
