//! A provider's `409` "key in use" is never the operation's outcome: over loopback HTTP, a
//! provider that refuses a charge twice while its key is in use and then answers `201`
//! charges once, and the `201` is what is recorded and replayed.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, StatusCode as AxumStatus};
use axum::routing::post;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::{IdempotencyLayer, KeyHeader, OperationId, ResponseSource};

/// How the provider says the key is in use.
#[derive(Clone, Copy, Debug)]
enum Refusal {
    /// Stripe's error object, no `Retry-After`: told by its body alone.
    Stripe,
    /// The IETF draft's `409` with `Retry-After`.
    RetryAfter,
}

/// A provider whose first `refusals` charges are refused as "key in use"; the next one
/// charges (counted in `effects`) and answers `201`.
async fn provider(refusal: Refusal, refusals: usize, effects: Arc<AtomicUsize>) -> String {
    let calls = Arc::new(AtomicUsize::new(0));
    let charge = move || {
        let (calls, effects) = (calls.clone(), effects.clone());
        async move {
            let mut headers = HeaderMap::new();
            headers.insert("content-type", "application/json".parse().unwrap());
            if calls.fetch_add(1, Ordering::SeqCst) < refusals {
                let body = match refusal {
                    Refusal::Stripe => {
                        r#"{"error":{"type":"idempotency_error","message":"There is currently another in-progress request using this Idempotent Key."}}"#
                    }
                    Refusal::RetryAfter => r#"{"error":"in progress"}"#,
                };
                if let Refusal::RetryAfter = refusal {
                    headers.insert("retry-after", "0".parse().unwrap());
                }
                return (AxumStatus::CONFLICT, headers, body.to_owned());
            }
            let n = effects.fetch_add(1, Ordering::SeqCst) + 1;
            (
                AxumStatus::CREATED,
                headers,
                format!(r#"{{"charge":"ch_{n}"}}"#),
            )
        }
    };
    let app = axum::Router::new().route("/charges", post(charge));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}/charges")
}

fn stack(
    ledger: &MemoryStore,
) -> impl tower::Service<
    Request<Full<Bytes>>,
    Response = http::Response<
        impl http_body::Body<Data = Bytes, Error = impl std::fmt::Debug> + std::fmt::Debug,
    >,
    Error = tower_idempotency::Error,
> + Clone {
    let policy = RetryPolicy::builder()
        .max_attempts(3)
        .backoff(Duration::from_millis(1), Duration::from_millis(5))
        .no_budget()
        .build()
        .unwrap();
    let layers = IdempotencyLayer::client_builder(ledger.clone())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .retry_policy(policy)
        .build_stack()
        .unwrap();
    ServiceBuilder::new()
        .layer(layers)
        .service(HyperClient::builder(TokioExecutor::new()).build_http())
}

fn charge(uri: &str) -> Request<Full<Bytes>> {
    let mut req = Request::post(uri)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(br#"{"amount_cents":1999}"#)))
        .unwrap();
    req.extensions_mut()
        .insert(OperationId::new("task-12", "charge-card"));
    req
}

#[tokio::test]
async fn a_refusal_told_by_its_body_is_never_recorded_and_the_real_answer_is() {
    let effects = Arc::new(AtomicUsize::new(0));
    let uri = provider(Refusal::Stripe, 2, effects.clone()).await;
    let ledger = MemoryStore::new();

    // Twice refused: not final, never recorded, the operation left open.
    for run in 1..=2 {
        let err = stack(&ledger).oneshot(charge(&uri)).await.unwrap_err();
        assert!(err.is_key_in_use(), "run {run}: {err}");
        assert!(err.is_in_doubt(), "run {run}: not a final answer");
        assert_eq!(effects.load(Ordering::SeqCst), 0);
    }

    // The next run resends the frozen charge and records the provider's real answer.
    let resumed = stack(&ledger).oneshot(charge(&uri)).await.unwrap();
    assert_eq!(resumed.status(), StatusCode::CREATED);
    assert_eq!(ResponseSource::of(&resumed), ResponseSource::Resent);
    let first = resumed.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(first, r#"{"charge":"ch_1"}"#);

    let replayed = stack(&ledger).oneshot(charge(&uri)).await.unwrap();
    assert_eq!(ResponseSource::of(&replayed), ResponseSource::Replayed);
    assert_eq!(replayed.status(), StatusCode::CREATED);
    assert_eq!(
        replayed.into_body().collect().await.unwrap().to_bytes(),
        first
    );
    assert_eq!(effects.load(Ordering::SeqCst), 1, "charged exactly once");
}

#[tokio::test]
async fn a_refusal_with_retry_after_is_retried_within_the_policy() {
    let effects = Arc::new(AtomicUsize::new(0));
    let uri = provider(Refusal::RetryAfter, 2, effects.clone()).await;
    let ledger = MemoryStore::new();

    let answered = stack(&ledger).oneshot(charge(&uri)).await.unwrap();
    assert_eq!(answered.status(), StatusCode::CREATED);
    let first = answered.into_body().collect().await.unwrap().to_bytes();
    let replayed = stack(&ledger).oneshot(charge(&uri)).await.unwrap();
    assert_eq!(ResponseSource::of(&replayed), ResponseSource::Replayed);
    assert_eq!(
        replayed.into_body().collect().await.unwrap().to_bytes(),
        first
    );
    assert_eq!(effects.load(Ordering::SeqCst), 1);

    // Still refused when the policy is spent: not final, and the operation stays open.
    let effects = Arc::new(AtomicUsize::new(0));
    let uri = provider(Refusal::RetryAfter, 3, effects.clone()).await;
    let ledger = MemoryStore::new();
    let err = stack(&ledger).oneshot(charge(&uri)).await.unwrap_err();
    assert!(err.is_key_in_use() && err.is_in_doubt(), "{err}");
    assert_eq!(err.retry_after(), Some(Duration::ZERO));
    let resumed = stack(&ledger).oneshot(charge(&uri)).await.unwrap();
    assert_eq!(ResponseSource::of(&resumed), ResponseSource::Resent);
    assert_eq!(resumed.status(), StatusCode::CREATED);
    assert_eq!(effects.load(Ordering::SeqCst), 1);
}
