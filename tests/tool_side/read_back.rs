//! Arguments that cannot be read back: refused before the first call, nothing run, the
//! operation released, since no retry or resume could call the tool with them.
#![cfg(feature = "test-util")]

use serde::{Deserialize, Serialize};
use tower::{Layer, ServiceExt};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::testing::ToolDouble;
use tower_idempotency::tool::{ProviderKeys, ToolCall, ToolError, ToolLayer, ToolSource};
use tower_idempotency::OperationId;

fn op() -> OperationId {
    OperationId::new("task-3", "transfer")
}

#[derive(Serialize, Deserialize)]
struct Transfer {
    account: String,
    amount: f64,
}

fn transfer(amount: f64) -> ToolCall<Transfer> {
    ToolCall::new(
        op(),
        Transfer {
            account: "acc_1".into(),
            amount,
        },
    )
}

/// `f64::INFINITY` freezes as `null`, which no resume can read back as an `f64`: the call
/// is refused naming the value, the tool never called, and the operation released, so the
/// corrected call runs, once.
#[tokio::test]
async fn a_float_that_is_not_finite_is_refused_and_the_operation_released() {
    for provider in [ProviderKeys::Ignored, ProviderKeys::Deduplicates] {
        let layer = ToolLayer::builder(MemoryStore::new(), "transfer", provider)
            .build()
            .unwrap();
        let bank = ToolDouble::new();
        let tool = layer.layer(bank.clone());

        let refused = tool
            .clone()
            .oneshot(transfer(f64::INFINITY))
            .await
            .expect_err("an infinite amount cannot be frozen faithfully");
        let ToolError::NotReadBack(refused) = refused else {
            panic!("{provider:?}: {refused}");
        };
        assert_eq!(refused.pointer(), Some("/amount"));
        assert_eq!(refused.frozen(), Some("null"));
        assert!(
            refused.to_string().contains("\"/amount\" froze as null"),
            "{refused}"
        );
        assert_eq!(bank.calls(), 0, "{provider:?}: nothing ran");

        let done = tool.oneshot(transfer(25.0)).await.unwrap();
        assert_eq!(done.source(), ToolSource::Called, "{provider:?}: released");
        assert_eq!(bank.effects_of(&op()), 1);
    }
}

/// Arguments whose `Deserialize` reads back other values than were frozen (here a field
/// skipped when read): the first call is refused, naming the value that changed.
#[tokio::test]
async fn arguments_that_read_back_otherwise_are_refused() {
    #[derive(Serialize, Deserialize)]
    struct Lossy {
        account: String,
        #[serde(skip_deserializing)]
        priority: u8,
    }
    let layer = ToolLayer::builder(MemoryStore::new(), "transfer", ProviderKeys::Ignored)
        .build()
        .unwrap();
    let bank = ToolDouble::new();
    let tool = layer.layer(bank.clone());
    let call = ToolCall::new(
        op(),
        Lossy {
            account: "acc_1".into(),
            priority: 7,
        },
    );
    let refused = tool.oneshot(call).await.expect_err("refused");
    let ToolError::NotReadBack(refused) = refused else {
        panic!("{refused}");
    };
    assert_eq!(refused.pointer(), Some("/priority"));
    assert_eq!(refused.frozen(), Some("7"));
    assert!(refused.to_string().contains("reads back as 0"), "{refused}");
    assert_eq!(bank.calls(), 0);
}
