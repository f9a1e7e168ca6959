//! The console's reason to exist, end to end: an operation left in doubt by a real failure,
//! found in the list, resolved as not applied with the look it was found with, and run
//! again by its caller, taking effect once.

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use serde_json::json;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::testing::{Fault, SideEffectService};
use tower_idempotency::{FrozenRetryLayer, IdempotencyLayer, OperationId, PayloadDiscarded};

use super::harness::{serve, PREFIX};

fn charge() -> Request<Full<Bytes>> {
    let mut request = Request::post("http://payments.local/charges")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(
            br#"{"order_id":"order_42","amount_cents":1999}"#,
        )))
        .unwrap();
    request
        .extensions_mut()
        .insert(OperationId::new("task-7", "charge_customer"));
    request
}

/// The provider does not deduplicate, so an operation in doubt is not sent again on its
/// own: it waits for an operator. Here the first attempt failed before the provider
/// committed (the operator checks with the provider and finds no charge), so resolving it
/// as not applied lets the caller's next run charge, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_in_doubt_resolved_as_not_applied_runs_again_and_takes_effect_once() {
    let provider = SideEffectService::new().with_faults([Fault::ServerError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        commit: false,
    }]);
    let policy = RetryPolicy::builder().max_attempts(1).build().unwrap();
    let layer = IdempotencyLayer::client_builder(Arc::new(MemoryStore::new()))
        .provider_deduplicates(false)
        .retry_policy(policy.clone())
        .build()
        .unwrap();
    let records = layer.records();
    let client = ServiceBuilder::new()
        .layer(layer)
        .layer(FrozenRetryLayer::new(policy))
        .service(provider.clone());

    // A 503 may come from a provider that charged before failing: the client cannot tell,
    // and leaves the operation in doubt.
    let unavailable = client.clone().oneshot(charge()).await.unwrap();
    assert_eq!(unavailable.status(), StatusCode::SERVICE_UNAVAILABLE);
    let err = client.clone().oneshot(charge()).await.unwrap_err();
    assert!(err.is_unreconciled(), "not sent again on its own: {err}");
    assert_eq!(
        provider.effects(),
        0,
        "the timed-out attempt never committed"
    );

    let console = serve(records.clone()).await;
    let key = records
        .operation_key(&OperationId::new("task-7", "charge_customer"))
        .to_hex();

    // The list of operations in doubt finds it, with the look to act by.
    let list = console
        .get_as(
            "alice",
            "act",
            &format!("{PREFIX}/api/records?state=in_doubt&order=oldest"),
        )
        .await;
    assert_eq!(list.status, StatusCode::OK, "{}", list.body);
    let list = list.json();
    let found = &list["records"][0];
    assert_eq!(found["key"], key.as_str());
    assert_eq!(found["state"], "in_doubt");
    assert_eq!(list["next"], serde_json::Value::Null);
    // What it is of: the step the orchestrator named, and the endpoint.
    assert_eq!(
        found["origin"],
        json!({
            "face": "client",
            "target": "POST http://payments.local/charges",
            "target_cut": false,
            "task_id": "task-7",
            "step_id": "charge_customer",
        })
    );
    let by_task = console
        .get_as(
            "alice",
            "act",
            &format!(
                "{PREFIX}/api/records?task=task-7&target=POST%20http%3A%2F%2Fpayments.local%2F"
            ),
        )
        .await;
    assert_eq!(by_task.json()["records"][0]["key"], key.as_str());

    let resolved = console
        .post_json(
            "alice",
            "act",
            &format!("{PREFIX}/api/records/{key}/resolve-not-applied"),
            &json!({"expected": found["look"], "reason": "INC-42: no charge at the provider"}),
        )
        .await;
    assert_eq!(resolved.status, StatusCode::OK, "{}", resolved.body);
    assert_eq!(resolved.json()["result"], "forgotten");

    let charged = client.clone().oneshot(charge()).await.unwrap();
    assert_eq!(charged.status(), StatusCode::CREATED);
    let replayed = client.oneshot(charge()).await.unwrap();
    assert_eq!(replayed.status(), StatusCode::CREATED);
    assert_eq!(provider.effects(), 1, "charged once, after the resolution");

    // The same look again finds nothing to resolve: the record is another life now.
    let again = console
        .post_json(
            "alice",
            "act",
            &format!("{PREFIX}/api/records/{key}/resolve-not-applied"),
            &json!({"expected": found["look"], "reason": "clicked twice"}),
        )
        .await;
    assert_eq!(again.status, StatusCode::CONFLICT, "{}", again.body);
    assert_eq!(again.json()["current"]["state"], "completed");
    assert_eq!(provider.effects(), 1);
}

/// The other way out: the first attempt charged before the provider failed, so the operator
/// finds the charge at the provider and resolves the operation as applied with its receipt.
/// The caller's next run replays the receipt: no second charge, ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_in_doubt_resolved_as_applied_replays_the_receipt_and_never_charges_again() {
    let provider = SideEffectService::new().with_faults([Fault::ServerError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        commit: true,
    }]);
    let policy = RetryPolicy::builder().max_attempts(1).build().unwrap();
    let layer = IdempotencyLayer::client_builder(Arc::new(MemoryStore::new()))
        .provider_deduplicates(false)
        .retry_policy(policy.clone())
        .build()
        .unwrap();
    let records = layer.records();
    let client = ServiceBuilder::new()
        .layer(layer)
        .layer(FrozenRetryLayer::new(policy))
        .service(provider.clone());

    let unavailable = client.clone().oneshot(charge()).await.unwrap();
    assert_eq!(unavailable.status(), StatusCode::SERVICE_UNAVAILABLE);
    let err = client.clone().oneshot(charge()).await.unwrap_err();
    assert!(err.is_unreconciled(), "not sent again on its own: {err}");
    assert_eq!(provider.effects(), 1, "the failed attempt charged");

    let console = serve(records.clone()).await;
    let key = records
        .operation_key(&OperationId::new("task-7", "charge_customer"))
        .to_hex();
    let list = console
        .get_as(
            "alice",
            "act",
            &format!("{PREFIX}/api/records?state=in_doubt"),
        )
        .await
        .json();
    let found = &list["records"][0];
    assert_eq!(found["key"], key.as_str());

    let receipt = r#"{"id":"ch_1","amount_cents":1999,"status":"succeeded"}"#;
    let resolved = console
        .post_json(
            "alice",
            "act",
            &format!("{PREFIX}/api/records/{key}/resolve-applied"),
            &json!({
                "expected": found["look"],
                "reason": "INC-51: charge ch_1 at the provider",
                "outcome": {"status": 201, "content_type": "application/json", "body": receipt},
            }),
        )
        .await;
    assert_eq!(resolved.status, StatusCode::OK, "{}", resolved.body);
    assert_eq!(resolved.json()["result"], "resolved");

    // The caller's next runs replay the receipt, byte for byte, and charge nothing.
    for _ in 0..2 {
        let replayed = client.clone().oneshot(charge()).await.unwrap();
        assert_eq!(replayed.status(), StatusCode::CREATED);
        assert_eq!(replayed.headers()["content-type"], "application/json");
        let body = http_body_util::BodyExt::collect(replayed.into_body())
            .await
            .unwrap()
            .to_bytes();
        assert_eq!(body.as_ref(), receipt.as_bytes());
    }
    assert_eq!(provider.effects(), 1, "no new effect after the resolve");

    // Another payload under the same operation drifts, as from any completed one: under an
    // `OperationId` the regenerated payload is discarded and the receipt replayed.
    let mut other = charge();
    *other.body_mut() = Full::new(Bytes::from_static(
        br#"{"order_id":"order_42","amount_cents":2999}"#,
    ));
    let drifted = client.clone().oneshot(other).await.unwrap();
    assert_eq!(drifted.status(), StatusCode::CREATED);
    let discarded = drifted
        .extensions()
        .get::<PayloadDiscarded>()
        .expect("the regenerated payload is named discarded");
    assert_eq!(
        discarded.changed_fields(),
        Some(&["amount_cents".to_owned()][..])
    );
    assert_eq!(provider.effects(), 1);
}
