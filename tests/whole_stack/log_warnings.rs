//! The warnings the client layers give once, in a test binary of its own: `tracing`'s
//! callsite interest is global, so captures must not share a process with tests that log
//! through the same callsites without a subscriber.
#![cfg(feature = "test-util")]

use crate::support::capture;

use crate::support::in_place;

use crate::support::orders;

use orders::{fast_policy, post, source, ORDERS};

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::{
    Begin, BeginRequest, IdempotencyStore, LeaseToken, LedgerKey, MemoryStore, Outcome, StoreError,
    StoreFuture,
};
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::testing::SideEffectService;
use tower_idempotency::ProviderKeys;
use tower_idempotency::{
    FrozenRetryLayer, IdempotencyLayer, KeyHeader, OperationId, ResponseSource,
};

const ORIGINAL: &str = r#"{"order_id":"ord_8f21c3"}"#;
/// Defect 14's second half: the TTLs are checked against the retry policy really stacked
/// inside, not only the window the builder was told.
#[tokio::test(start_paused = true)]
async fn a_retry_policy_longer_than_the_layer_was_told_is_reported_once() {
    let (logs, _default) = capture::warnings();
    let long = RetryPolicy::builder()
        .max_elapsed(Duration::from_secs(600))
        .build()
        .unwrap();
    let provider = SideEffectService::new();
    let told = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .layer(FrozenRetryLayer::new(long.clone()))
        .service(provider.clone());
    for step in ["a", "b"] {
        let mut req = post(ORIGINAL);
        req.extensions_mut().insert(OperationId::new("t", step));
        told.clone().oneshot(req).await.unwrap();
    }
    let logged = logs.text();
    assert_eq!(
        logged.matches("retry_policy(policy)").count(),
        1,
        "{logged}"
    );

    // Built from the real policy, it has nothing to say.
    logs.clear();
    let checked = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(MemoryStore::new())
                .provider_deduplicates(true)
                .key_header(KeyHeader::ietf())
                .retry_policy(long.clone())
                .build()
                .unwrap(),
        )
        .layer(FrozenRetryLayer::new(long))
        .service(provider);
    checked.oneshot(post(ORIGINAL)).await.unwrap();
    assert!(logs.text().is_empty());
}

#[tokio::test(start_paused = true)]
async fn an_unprotected_side_effect_is_marked_and_reported() {
    let (logs, _default) = capture::warnings();
    let provider = SideEffectService::new();
    let lenient = IdempotencyLayer::client_builder(MemoryStore::new())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .require_key(false)
        .build()
        .unwrap();
    let client = ServiceBuilder::new()
        .layer(lenient)
        .layer(FrozenRetryLayer::new(fast_policy(Duration::from_secs(1))))
        .service(provider);
    for _ in 0..2 {
        let keyless = Request::post(ORDERS)
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        let res = client.clone().oneshot(keyless).await.unwrap();
        assert_eq!(source(&res), ResponseSource::Unprotected);
    }
    assert_eq!(
        logs.text().matches("unprotected").count(),
        1,
        "{}",
        logs.text()
    );
    // A read is not a side effect: no marker, so it reads as sent.
    let read = Request::get(ORDERS).body(Full::new(Bytes::new())).unwrap();
    let res = client.oneshot(read).await.unwrap();
    assert!(res.extensions().get::<ResponseSource>().is_none());
    assert_eq!(source(&res), ResponseSource::Sent);
}

/// A store that answers in place, as `MemoryStore` does, and loses the reply of the first
/// `complete` it applied.
#[derive(Clone, Debug)]
struct LosesACompletionReply {
    inner: MemoryStore,
    lose: Arc<AtomicBool>,
}

impl IdempotencyStore for LosesACompletionReply {
    fn begin(&self, request: BeginRequest) -> StoreFuture<'_, Begin> {
        self.inner.begin(request)
    }

    fn complete(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        outcome: Outcome,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        let applied = in_place::at_once(self.inner.complete(key, token, outcome, retention));
        if self.lose.swap(false, Ordering::SeqCst) {
            return StoreFuture::ready(Err(StoreError::timeout()));
        }
        StoreFuture::ready(applied)
    }

    fn abandon(&self, key: LedgerKey, token: LeaseToken) -> StoreFuture<'_, ()> {
        self.inner.abandon(key, token)
    }

    fn mark_in_doubt(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        self.inner.mark_in_doubt(key, token, retention)
    }

    fn renew(&self, key: LedgerKey, token: LeaseToken, lease: Duration) -> StoreFuture<'_, ()> {
        self.inner.renew(key, token, lease)
    }
}

/// The layers take an in-place store's answer outside their retrying path; when that answer
/// is lost after the write applied, the retry is refused as fenced, which after a lost
/// answer means the write applied: nothing is reported as unrecorded, and the next run
/// replays.
#[tokio::test(start_paused = true)]
async fn a_lost_reply_to_an_applied_completion_is_not_reported_as_a_failure() {
    let (logs, _default) = capture::warnings();
    let store = LosesACompletionReply {
        inner: MemoryStore::new(),
        lose: Arc::new(AtomicBool::new(true)),
    };
    let provider = SideEffectService::new();
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            store.clone(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .service(provider.clone());
    let first = client.clone().oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(source(&first), ResponseSource::Sent);
    assert!(!store.lose.load(Ordering::SeqCst), "the reply was lost");
    assert!(!logs.text().contains("could not record"), "{}", logs.text());
    let again = client.oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(source(&again), ResponseSource::Replayed);
    assert_eq!(provider.effects(), 1);
}

/// A store made per call, not once: the first call's charge is left in doubt against a
/// provider that ignores keys, and the store that remembered it goes with the call. The
/// second call, against a new store, charges again: its doubt was forgotten. The crate
/// cannot see the second call is the same, but it says so when the doubt is dropped.
#[tokio::test(start_paused = true)]
async fn a_memory_store_dropped_with_an_operation_in_doubt_says_so() {
    use tower_idempotency::testing::Fault;

    let provider = SideEffectService::builder().honour_keys(false).build();
    provider.push_fault(Fault::CommitThenTimeout);
    let call = || {
        let per_call = MemoryStore::new();
        ServiceBuilder::new()
            .layer(IdempotencyLayer::client(
                per_call,
                ProviderKeys::Ignored,
                KeyHeader::ietf(),
            ))
            .layer(tower_idempotency::FrozenRetryLayer::new(fast_policy(
                Duration::from_secs(2),
            )))
            .service(provider.clone())
    };
    let (logs, _default) = capture::warnings();
    let err = call().oneshot(post("{}")).await.unwrap_err();
    assert!(err.is_in_doubt(), "{err}");
    let logged = logs.text();
    assert!(
        logged.contains("a MemoryStore was dropped holding operations in flight or in doubt")
            && logged.contains("open=1"),
        "{logged}"
    );
    assert_eq!(provider.effects(), 1);
}
