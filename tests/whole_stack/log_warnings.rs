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
use tower_idempotency::testing::{Fault, SideEffectService};
use tower_idempotency::{FrozenRetryLayer, IdempotencyLayer, OperationId, ResponseSource};

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
        .layer(IdempotencyLayer::client(MemoryStore::new()))
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
                .retry_policy(long.clone())
                .build()
                .unwrap(),
        )
        .layer(FrozenRetryLayer::new(long))
        .service(provider);
    checked.oneshot(post(ORIGINAL)).await.unwrap();
    assert!(logs.text().is_empty());
}

/// A client face not told whether its provider deduplicates on `Idempotency-Key` assumes
/// it does, and resends after a timeout. Against a provider that ignores keys (a service
/// behind no server layer) that is a second effect, and the layer says so, once, naming the
/// choice, whether built as one stack or by hand (where the retry layer reports through
/// the hand-off). Told either way, it says nothing: told `true`, the provider deduplicates
/// and the effect happens once; told `false`, nothing that may have arrived is sent again.
#[tokio::test(start_paused = true)]
async fn a_resend_relying_on_assumed_deduplication_is_reported_once() {
    let (logs, _default) = capture::warnings();
    let warning = "one effect only if the provider deduplicates on Idempotency-Key";
    let charge = |task: &str| {
        let mut req = post(ORIGINAL);
        req.extensions_mut()
            .insert(OperationId::new(task, "charge"));
        req
    };
    // The client face told `told` (or nothing), with one second an attempt.
    let face = |told: Option<bool>| {
        let builder = IdempotencyLayer::client_builder(MemoryStore::new())
            .retry_policy(fast_policy(Duration::from_secs(1)));
        match told {
            Some(deduplicates) => builder.provider_deduplicates(deduplicates),
            None => builder,
        }
    };
    let stack = |told: Option<bool>, provider: &SideEffectService| {
        let layer = face(told).build_stack().unwrap();
        ServiceBuilder::new().layer(layer).service(provider.clone())
    };

    // Not told: healthy calls say nothing; then two charges at a provider that ignores
    // keys, and the warning, once.
    let ignores_keys = SideEffectService::builder().honour_keys(false).build();
    let assumed = stack(None, &ignores_keys);
    for task in ["t0", "t00"] {
        assumed.clone().oneshot(charge(task)).await.unwrap();
    }
    assert!(logs.text().is_empty(), "{}", logs.text());
    for task in ["t1", "t2"] {
        ignores_keys.push_fault(Fault::CommitThenTimeout);
        let response = assumed.clone().oneshot(charge(task)).await.unwrap();
        assert_eq!(response.status(), http::StatusCode::CREATED);
    }
    assert_eq!(
        ignores_keys.effects(),
        2 + 4,
        "the resends were second effects"
    );
    assert_eq!(logs.text().matches(warning).count(), 1, "{}", logs.text());

    // The same stacked by hand: once more, once, for this layer.
    let ignores_keys = SideEffectService::builder().honour_keys(false).build();
    let by_hand = ServiceBuilder::new()
        .layer(face(None).build().unwrap())
        .layer(FrozenRetryLayer::new(fast_policy(Duration::from_secs(1))))
        .service(ignores_keys.clone());
    ignores_keys.push_fault(Fault::CommitThenTimeout);
    by_hand.oneshot(charge("t3")).await.unwrap();
    assert_eq!(ignores_keys.effects(), 2);
    assert_eq!(logs.text().matches(warning).count(), 2, "{}", logs.text());

    // Told it deduplicates: no warning (and one effect per operation).
    logs.clear();
    let honours = SideEffectService::new();
    honours.push_fault(Fault::CommitThenTimeout);
    stack(Some(true), &honours)
        .oneshot(charge("t4"))
        .await
        .unwrap();
    assert_eq!(honours.effects(), 1);

    // Told it does not: nothing resent, the doubt reported as an error, no warning.
    let ignores_keys = SideEffectService::builder().honour_keys(false).build();
    ignores_keys.push_fault(Fault::CommitThenTimeout);
    let err = stack(Some(false), &ignores_keys)
        .oneshot(charge("t5"))
        .await
        .unwrap_err();
    assert!(err.is_in_doubt(), "{err}");
    assert_eq!(ignores_keys.effects(), 1);
    assert!(!logs.text().contains(warning), "{}", logs.text());
}

#[tokio::test(start_paused = true)]
async fn a_retry_layer_outside_the_idempotency_layer_is_reported_once() {
    let (logs, _default) = capture::warnings();
    let provider = SideEffectService::new();
    let wrong = ServiceBuilder::new()
        .layer(FrozenRetryLayer::new(fast_policy(Duration::from_secs(1))))
        .layer(IdempotencyLayer::client(MemoryStore::new()))
        .service(provider.clone());
    for step in ["a", "b"] {
        let mut req = post(ORIGINAL);
        req.extensions_mut().insert(OperationId::new("t", step));
        wrong.clone().oneshot(req).await.unwrap();
    }
    assert_eq!(
        logs.text().matches("build_stack").count(),
        1,
        "{}",
        logs.text()
    );

    // The right order says nothing.
    logs.clear();
    let policy = fast_policy(Duration::from_secs(1));
    let right = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(MemoryStore::new())
                .retry_policy(policy.clone())
                .build()
                .unwrap(),
        )
        .layer(FrozenRetryLayer::new(policy))
        .service(provider);
    right.oneshot(post(ORIGINAL)).await.unwrap();
    assert!(logs.text().is_empty(), "{}", logs.text());
}

#[tokio::test(start_paused = true)]
async fn an_unprotected_side_effect_is_marked_and_reported() {
    let (logs, _default) = capture::warnings();
    let provider = SideEffectService::new();
    let lenient = IdempotencyLayer::client_builder(MemoryStore::new())
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
        .layer(IdempotencyLayer::client(store.clone()))
        .service(provider.clone());
    let first = client.clone().oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(source(&first), ResponseSource::Sent);
    assert!(!store.lose.load(Ordering::SeqCst), "the reply was lost");
    assert!(!logs.text().contains("could not record"), "{}", logs.text());
    let again = client.oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(source(&again), ResponseSource::Replayed);
    assert_eq!(provider.effects(), 1);
}
