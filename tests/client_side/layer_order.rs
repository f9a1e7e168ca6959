//! A retrying layer outside the client `IdempotencyLayer` is refused before anything is
//! sent: its retries would each be a new visit to the ledger, judged by a layer that knows
//! nothing of the operation's doubt or the provider's keys.
#![cfg(feature = "test-util")]

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::testing::{Fault, SideEffectService};
use tower_idempotency::{
    FrozenRetryLayer, IdempotencyLayer, KeyHeader, OperationId, ProviderKeys, ResponseSource,
};

fn policy() -> RetryPolicy {
    RetryPolicy::builder()
        .attempt_timeout(Duration::from_secs(2))
        .no_budget()
        .build()
        .unwrap()
}

fn charge(step: &str) -> Request<Full<Bytes>> {
    let mut req = Request::post("http://payments.local/charges")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(br#"{"order_id":"order_42"}"#)))
        .unwrap();
    req.extensions_mut()
        .insert(OperationId::new("task-7", step));
    req
}

/// The stack upside down, against a provider that ignores keys and times out after
/// charging: every request is refused before the first send, with either provider choice,
/// and the provider is never called (it was only warned about, once, and sent). The right
/// order still charges once.
#[tokio::test(start_paused = true)]
async fn a_frozen_retry_layer_outside_the_idempotency_layer_is_refused_before_any_send() {
    for provider_keys in [ProviderKeys::Ignored, ProviderKeys::Deduplicates] {
        let provider = SideEffectService::builder().honour_keys(false).build();
        provider.push_fault(Fault::CommitThenTimeout);
        let upside_down = ServiceBuilder::new()
            .layer(FrozenRetryLayer::new(policy()))
            .layer(IdempotencyLayer::client(
                MemoryStore::new(),
                provider_keys,
                KeyHeader::ietf(),
            ))
            .service(provider.clone());
        for step in ["charge", "refund"] {
            let err = upside_down.clone().oneshot(charge(step)).await.unwrap_err();
            assert!(err.is_retry_outside(), "{err}");
            assert!(err.to_string().contains("build_stack"), "{err}");
        }
        assert_eq!(provider.calls(), 0, "{provider_keys:?}: something was sent");
        assert_eq!(provider.effects(), 0);
    }

    // The right order: one effect, the doubt reported rather than resent.
    let provider = SideEffectService::builder().honour_keys(false).build();
    provider.push_fault(Fault::CommitThenTimeout);
    let right = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Ignored,
            KeyHeader::ietf(),
        ))
        .layer(FrozenRetryLayer::new(policy()))
        .service(provider.clone());
    let err = right.clone().oneshot(charge("charge")).await.unwrap_err();
    assert!(err.is_in_doubt(), "{err}");
    assert_eq!(provider.effects(), 1);
    let fine = right.oneshot(charge("another")).await.unwrap();
    assert_eq!(ResponseSource::of(&fine), ResponseSource::Sent);
    assert_eq!(provider.effects(), 2);
}

/// A second `FrozenRetryLayer` under the first, against a provider that ignores keys and
/// times out after charging: the inner one would resend an attempt that may have charged,
/// judged without the provider's keys. It is refused before its first send, with either
/// provider choice, and the outer one does not retry the refusal.
#[tokio::test(start_paused = true)]
async fn a_second_frozen_retry_layer_inside_the_idempotency_layer_is_refused_before_any_send() {
    for provider_deduplicates in [false, true] {
        let provider = SideEffectService::builder().honour_keys(false).build();
        provider.push_fault(Fault::CommitThenTimeout);
        let doubled = ServiceBuilder::new()
            .layer(
                IdempotencyLayer::client_builder(MemoryStore::new())
                    .provider_deduplicates(provider_deduplicates)
                    .key_header(KeyHeader::ietf())
                    .build()
                    .unwrap(),
            )
            .layer(FrozenRetryLayer::new(policy()))
            .layer(FrozenRetryLayer::new(policy()))
            .service(provider.clone());
        for step in ["charge", "refund"] {
            let err = doubled.clone().oneshot(charge(step)).await.unwrap_err();
            assert!(err.is_retry_nested(), "{err}");
            assert!(!err.is_in_doubt(), "nothing was sent: {err}");
        }
        assert_eq!(provider.calls(), 0, "deduplicates {provider_deduplicates}");
        assert_eq!(provider.effects(), 0);
    }
}
