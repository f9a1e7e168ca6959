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
use tower_idempotency::{FrozenRetryLayer, IdempotencyLayer, OperationId};

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
