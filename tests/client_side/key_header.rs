//! The key under each provider's header and form: a charge whose answer is lost and
//! retried over loopback HTTP is one effect at a provider that reads the key where its
//! preset says, from the client stack, the retry layer alone, and a reconciler.

use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::idempotency::{record_or_not_found, LookupReconciler};
use tower_idempotency::key::{KeyForm, KeyHeader};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::testing::{Fault, SideEffectService, LOOKUP_PATH};
use tower_idempotency::{FrozenRetryLayer, IdempotencyLayer, OperationId, ResponseSource};

const BODY: &[u8] = br#"{"order_id":"order-42","amount_cents":1999}"#;

fn hyper_client() -> HyperClient<HttpConnector, Full<Bytes>> {
    HyperClient::builder(TokioExecutor::new()).build_http()
}

fn presets() -> [(&'static str, KeyHeader); 5] {
    [
        ("ietf", KeyHeader::ietf()),
        ("stripe", KeyHeader::stripe()),
        ("adyen", KeyHeader::adyen()),
        ("checkout_com", KeyHeader::checkout_com()),
        ("paypal", KeyHeader::paypal()),
    ]
}

/// Three attempts, millisecond backoff, 300 ms per attempt: long enough for a loopback
/// answer, short enough that a lost one is retried at once.
fn retrying() -> RetryPolicy {
    RetryPolicy::builder()
        .max_attempts(3)
        .backoff(Duration::from_millis(1), Duration::from_millis(5))
        .attempt_timeout(Duration::from_millis(300))
        .no_budget()
        .build()
        .unwrap()
}

/// A provider that deduplicates on `header`, served on loopback.
async fn provider_reading(
    header: &KeyHeader,
    honour_keys: bool,
) -> (SideEffectService, tower_idempotency::testing::ServeHandle) {
    let provider = SideEffectService::builder()
        .key_header(header.clone())
        .honour_keys(honour_keys)
        .build();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = provider.clone().serve(listener).await.unwrap();
    (provider, server)
}

#[tokio::test]
async fn each_presets_provider_counts_one_charge_after_a_timeout_and_a_retry() {
    for (name, header) in presets() {
        let (provider, server) = provider_reading(&header, true).await;
        provider.push_fault(Fault::CommitThenTimeout);
        let stack = IdempotencyLayer::client_builder(MemoryStore::new())
            .provider_deduplicates(true)
            .key_header(header.clone())
            .retry_policy(retrying())
            .build_stack()
            .unwrap();
        let client = ServiceBuilder::new().layer(stack).service(hyper_client());
        let op = OperationId::new("task-7", "charge");
        let mut req = Request::post(server.uri("/charges"))
            .body(Full::new(Bytes::from_static(BODY)))
            .unwrap();
        req.extensions_mut().insert(op.clone());

        let response = client.oneshot(req).await.unwrap();
        assert_eq!(response.status(), StatusCode::CREATED, "{name}");
        assert_eq!(provider.effects(), 1, "{name}: one charge");
        assert_eq!(provider.effects_for_operation(&op, ""), 1, "{name}");
        let attempts = provider.attempts();
        assert_eq!(attempts.len(), 2, "{name}: the lost answer was retried");
        let hex = op.key("").to_hex();
        let sent = match header.form() {
            KeyForm::SfString => format!("\"{hex}\""),
            _ => hex,
        };
        for attempt in &attempts {
            assert_eq!(attempt.headers()[header.name()], sent.as_str(), "{name}");
            if header.name() != "idempotency-key" {
                assert!(
                    !attempt.headers().contains_key("idempotency-key"),
                    "{name}: only the provider's own header"
                );
            }
        }
        server.shutdown().await;
    }
}

/// The retry layer alone, in front of a provider reading `PayPal-Request-Id`: the caller's
/// key under that header makes the charge safe to resend; under the default setting the
/// layer does not see it, and a charge whose answer is lost is not resent.
#[tokio::test]
async fn the_retry_layer_alone_tells_a_keyed_request_by_the_configured_header() {
    for (configured, resent) in [(KeyHeader::paypal(), true), (KeyHeader::ietf(), false)] {
        let (provider, server) = provider_reading(&KeyHeader::paypal(), true).await;
        provider.push_fault(Fault::CommitThenTimeout);
        let policy = RetryPolicy::builder()
            .max_attempts(3)
            .backoff(Duration::from_millis(1), Duration::from_millis(5))
            .attempt_timeout(Duration::from_millis(300))
            .no_budget()
            .key_header(configured.clone())
            .build()
            .unwrap();
        let client = ServiceBuilder::new()
            .layer(FrozenRetryLayer::new(policy))
            .service(hyper_client());
        let req = Request::post(server.uri("/charges"))
            .header("paypal-request-id", "order-42-charge")
            .body(Full::new(Bytes::from_static(BODY)))
            .unwrap();

        let result = client.oneshot(req).await;
        assert_eq!(result.is_ok(), resent, "{configured:?}");
        assert_eq!(provider.effects_for_key("order-42-charge"), 1);
        assert_eq!(provider.attempts().len(), if resent { 2 } else { 1 });
        server.shutdown().await;
    }
}

/// A provider that ignores keys but stores them as sent, under a token preset: the
/// reconciler looks the charge up by the bare value the header carried.
#[tokio::test]
async fn a_reconciler_looks_up_the_key_in_the_presets_form() {
    let header = KeyHeader::checkout_com();
    let (provider, server) = provider_reading(&header, false).await;
    let ledger = MemoryStore::new();
    let op = OperationId::new("task-7", "charge");
    let request = || {
        let mut req = Request::post(server.uri("/charges"))
            .body(Full::new(Bytes::from_static(BODY)))
            .unwrap();
        req.extensions_mut().insert(op.clone());
        req
    };

    provider.push_fault(Fault::CommitThenTimeout);
    let first = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(ledger.clone())
                .provider_deduplicates(false)
                .key_header(header.clone())
                .build()
                .unwrap(),
        )
        .service(hyper_client());
    let gave_up = tokio::time::timeout(Duration::from_millis(300), first.oneshot(request())).await;
    assert!(gave_up.is_err());

    let resumed = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(ledger.clone())
                .provider_deduplicates(false)
                .key_header(header.clone())
                .reconcile(
                    LookupReconciler::by_key(
                        hyper_client(),
                        LOOKUP_PATH,
                        "idempotency_key",
                        record_or_not_found,
                    )
                    .applied_status(StatusCode::CREATED),
                )
                .build()
                .unwrap(),
        )
        .service(hyper_client());
    let response = resumed.oneshot(request()).await.unwrap();
    assert_eq!(ResponseSource::of(&response), ResponseSource::Reconciled);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert!(body.starts_with(b"{\"effect_id\":\"eff_1\""));
    assert_eq!(provider.effects(), 1);
    assert_eq!(provider.lookups(), 1);
    server.shutdown().await;
}
