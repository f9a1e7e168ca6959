//! Whether the provider deduplicates on `Idempotency-Key` is a choice every client build
//! states: left out, the build is refused, saying what each choice means; told the
//! provider ignores keys, a timeout after the effect never becomes a second effect.
#![cfg(feature = "test-util")]

use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use tower::{Layer, ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::testing::{Fault, SideEffectService};
use tower_idempotency::{
    ConfigError, FrozenRetryLayer, IdempotencyLayer, KeyHeader, OperationId, ProviderKeys,
};

fn policy() -> RetryPolicy {
    RetryPolicy::builder()
        .attempt_timeout(Duration::from_secs(2))
        .no_budget()
        .build()
        .unwrap()
}

fn charge() -> Request<Full<Bytes>> {
    let mut req = Request::post("http://payments.local/charges")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(br#"{"order_id":"order_42"}"#)))
        .unwrap();
    req.extensions_mut()
        .insert(OperationId::new("task-7", "charge_customer"));
    req
}

/// The refusal names both choices and what each does with an operation in doubt, so the
/// one reading it can choose without the docs.
fn assert_names_both_choices(err: &ConfigError) {
    let message = err.to_string();
    assert!(err.is_choice_missing(), "{message}");
    assert!(message.contains("ProviderKeys::Deduplicates"), "{message}");
    assert!(message.contains("ProviderKeys::Ignored"), "{message}");
    assert!(message.contains("resent with the same key"), "{message}");
    assert!(message.contains("never resent blind"), "{message}");
}

#[test]
fn a_build_that_leaves_the_provider_choice_out_is_refused_naming_both_choices() {
    // A newcomer's first build: the layer, and the stack as the docs build it.
    let layer = IdempotencyLayer::client_builder(MemoryStore::new()).build();
    assert_names_both_choices(&layer.unwrap_err());
    let stack = IdempotencyLayer::client_builder(MemoryStore::new())
        .retry_policy(policy())
        .build_stack();
    assert_names_both_choices(&stack.expect_err("refused"));

    // Either choice, said either way, builds: a provider that deduplicates with the
    // header it reads, one that ignores keys with or without one.
    for provider in [ProviderKeys::Deduplicates, ProviderKeys::Ignored] {
        let told = IdempotencyLayer::client_builder(MemoryStore::new())
            .provider_keys(provider)
            .key_header(KeyHeader::paypal());
        assert!(told.build().is_ok());
    }
    for deduplicates in [true, false] {
        let told = IdempotencyLayer::client_builder(MemoryStore::new())
            .provider_deduplicates(deduplicates)
            .key_header(KeyHeader::stripe());
        assert!(told.build_stack().is_ok());
    }
    let ignored = IdempotencyLayer::client_builder(MemoryStore::new()).provider_deduplicates(false);
    assert!(ignored.build().is_ok());
}

/// A provider that deduplicates reads the key from one header: a key sent under another is
/// never seen, and every resend of an operation in doubt charges again. So the header is a
/// choice too, and a build told the provider deduplicates but not where it reads the key
/// is refused, naming the presets (the layer, the stack, said either way).
#[test]
fn a_provider_that_deduplicates_needs_the_header_it_reads_named() {
    let refusals = [
        IdempotencyLayer::client_builder(MemoryStore::new())
            .provider_deduplicates(true)
            .build()
            .map(drop),
        IdempotencyLayer::client_builder(MemoryStore::new())
            .provider_keys(ProviderKeys::Deduplicates)
            .retry_policy(policy())
            .build_stack()
            .map(drop),
    ];
    for refused in refusals {
        let err = refused.expect_err("refused without the header");
        let message = err.to_string();
        assert!(err.is_choice_missing(), "{message}");
        for preset in [
            "KeyHeader::ietf()",
            "KeyHeader::stripe()",
            "KeyHeader::paypal()",
        ] {
            assert!(message.contains(preset), "{message}");
        }
    }
}

/// Told the provider ignores keys, a charge that landed and then timed out is never sent
/// again: not by the retry layer inside, not by the next run of the operation. Both stay
/// one effect, the doubt reported as an error for a reconciler or a person.
#[tokio::test(start_paused = true)]
async fn told_the_provider_ignores_keys_a_timeout_after_the_effect_is_one_effect() {
    // Stacked by hand, the layer from the constructor that takes the choice.
    let provider = SideEffectService::builder().honour_keys(false).build();
    provider.push_fault(Fault::CommitThenTimeout);
    let by_hand = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Ignored,
            KeyHeader::ietf(),
        ))
        .layer(FrozenRetryLayer::new(policy()))
        .service(provider.clone());
    let err = by_hand.clone().oneshot(charge()).await.unwrap_err();
    assert!(err.is_in_doubt(), "{err}");
    let again = by_hand.oneshot(charge()).await.unwrap_err();
    assert!(again.is_in_doubt(), "{again}");
    assert_eq!(
        provider.effects(),
        1,
        "an operation in doubt was resent blind"
    );

    // Built as one stack, told through the builder.
    let provider = SideEffectService::builder().honour_keys(false).build();
    provider.push_fault(Fault::CommitThenTimeout);
    let built = IdempotencyLayer::client_builder(MemoryStore::new())
        .provider_keys(ProviderKeys::Ignored)
        .retry_policy(policy())
        .build_stack()
        .unwrap()
        .layer(provider.clone());
    let err = built.clone().oneshot(charge()).await.unwrap_err();
    assert!(err.is_in_doubt(), "{err}");
    let again = built.oneshot(charge()).await.unwrap_err();
    assert!(again.is_in_doubt(), "{again}");
    assert_eq!(
        provider.effects(),
        1,
        "an operation in doubt was resent blind"
    );
}
