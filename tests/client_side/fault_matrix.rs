//! Every fault of the testing kit, against a provider that honours `Idempotency-Key` and
//! one that ignores it: the effect counts the crate documents, and never two where it
//! claims one.
//!
//! | fault | provider honours keys | provider ignores keys (`provider_deduplicates(false)`) |
//! |---|---|---|
//! | commit, then time out | 1 effect, the real `201` | 1 effect, a timeout, then in doubt |
//! | refuse before send | 1 effect, `201` | 1 effect, `201` |
//! | `500` after committing | 1 effect, `201` | 1 effect, the `500`, then in doubt |
//! | `503` without committing | 1 effect, `201` | 0 effects, the `503`, then in doubt |
//! | panic after committing | 1 effect, `201` on the next run | 1 effect, in doubt |
//! | panic before committing | 1 effect, `201` on the next run | 0 effects, in doubt |
//! | latency | 1 effect, `201` | 1 effect, `201` |
#![cfg(feature = "test-util")]

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{Layer, Service};
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::client::{ClientFace, StackService};
use tower_idempotency::idempotency::Idempotency;
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::retry::{FrozenRetry, RetryPolicy};
use tower_idempotency::testing::{Fault, SideEffectService};
use tower_idempotency::{
    Error, FrozenRetryLayer, IdempotencyLayer, KeyHeader, OperationId, ResponseSource,
};

/// The two layers stacked by hand: the frozen request handed on through the extensions.
type ByHand = Idempotency<FrozenRetry<SideEffectService>, ClientFace>;

fn policy() -> RetryPolicy {
    RetryPolicy::builder()
        .attempt_timeout(Duration::from_secs(5))
        .no_budget()
        .build()
        .unwrap()
}

fn by_hand(store: &Arc<MemoryStore>, provider: &SideEffectService, dedup: bool) -> ByHand {
    ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(store.clone())
                .provider_deduplicates(dedup)
                .key_header(KeyHeader::ietf())
                .key_header(KeyHeader::ietf())
                .build()
                .unwrap(),
        )
        .layer(FrozenRetryLayer::new(policy()))
        .service(provider.clone())
}

/// The stack as `build_stack()` builds it (the README's way): one service.
fn built(
    store: &Arc<MemoryStore>,
    provider: &SideEffectService,
    dedup: bool,
) -> StackService<SideEffectService> {
    IdempotencyLayer::client_builder(store.clone())
        .provider_deduplicates(dedup)
        .key_header(KeyHeader::ietf())
        .retry_policy(policy())
        .build_stack()
        .unwrap()
        .layer(provider.clone())
}

fn op() -> OperationId {
    OperationId::new("task-1", "charge-customer")
}

fn charge() -> Request<Full<Bytes>> {
    let mut req = Request::post("http://payments.local/charges")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(
            br#"{"order_id":"order_42","amount_cents":1999}"#,
        )))
        .unwrap();
    req.extensions_mut().insert(op());
    req
}

/// How one run of the operation ended.
#[derive(Debug, PartialEq)]
enum Ended {
    Status(StatusCode, ResponseSource),
    Timeout,
    InDoubt,
    Panicked,
}

async fn run<S, RB>(svc: &S) -> Ended
where
    S: Service<Request<Full<Bytes>>, Response = http::Response<RB>, Error = Error>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
    RB: http_body::Body + Send + 'static,
    RB::Error: std::fmt::Debug,
{
    let svc = svc.clone();
    let task = tokio::spawn(async move { svc.oneshot(charge()).await });
    match task.await {
        Err(join) if join.is_panic() => Ended::Panicked,
        Err(join) => panic!("task failed: {join}"),
        Ok(Ok(response)) => {
            let source = ResponseSource::of(&response);
            let status = response.status();
            response.into_body().collect().await.unwrap();
            Ended::Status(status, source)
        }
        Ok(Err(err)) if err.is_timeout() => Ended::Timeout,
        Ok(Err(err)) if err.is_unreconciled() => Ended::InDoubt,
        Ok(Err(err)) => panic!("unexpected error: {err}"),
    }
}

/// Run the operation, and — as an orchestrator would after a failure — once more; through
/// the stack as `build_stack()` builds it and through the layers stacked by hand, which
/// must end alike.
async fn run_twice(fault: Fault, honour: bool) -> (Ended, Option<Ended>, usize) {
    let (store, provider) = fresh(&fault, honour);
    let ended = run_twice_through(&built(&store, &provider, honour), &provider).await;
    let (store, provider) = fresh(&fault, honour);
    let by_hand = run_twice_through(&by_hand(&store, &provider, honour), &provider).await;
    assert_eq!(
        ended, by_hand,
        "{fault:?}: the built stack and the hand-made one differ"
    );
    ended
}

fn fresh(fault: &Fault, honour: bool) -> (Arc<MemoryStore>, SideEffectService) {
    let provider = SideEffectService::builder()
        .honour_keys(honour)
        .faults([fault.clone()])
        .build();
    (Arc::new(MemoryStore::new()), provider)
}

async fn run_twice_through<S, RB>(
    svc: &S,
    provider: &SideEffectService,
) -> (Ended, Option<Ended>, usize)
where
    S: Service<Request<Full<Bytes>>, Response = http::Response<RB>, Error = Error>
        + Clone
        + Send
        + 'static,
    S::Future: Send,
    RB: http_body::Body + Send + 'static,
    RB::Error: std::fmt::Debug,
{
    let first = run(svc).await;
    let second = match first {
        Ended::Status(StatusCode::CREATED, _) => None,
        _ => {
            // Let a lease abandoned by a panic settle (its guard settles in a task).
            tokio::time::sleep(Duration::from_millis(1)).await;
            Some(run(svc).await)
        }
    };
    let key = op().key("").to_hex();
    assert_eq!(
        provider.effects(),
        provider.effects_for_key(&key),
        "every effect carried the derived key"
    );
    (first, second, provider.effects())
}

const CREATED: Ended = Ended::Status(StatusCode::CREATED, ResponseSource::Sent);
const RESENT: Ended = Ended::Status(StatusCode::CREATED, ResponseSource::Resent);

#[tokio::test(start_paused = true)]
async fn commit_then_timeout() {
    assert_eq!(
        run_twice(Fault::CommitThenTimeout, true).await,
        (RESENT, None, 1)
    );
    assert_eq!(
        run_twice(Fault::CommitThenTimeout, false).await,
        (Ended::Timeout, Some(Ended::InDoubt), 1)
    );
}

#[tokio::test(start_paused = true)]
async fn refuse_before_send() {
    assert_eq!(
        run_twice(Fault::RefuseBeforeSend, true).await,
        (CREATED, None, 1)
    );
    assert_eq!(
        run_twice(Fault::RefuseBeforeSend, false).await,
        (CREATED, None, 1)
    );
}

#[tokio::test(start_paused = true)]
async fn server_error_after_commit() {
    let fault = || Fault::ServerError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        commit: true,
    };
    assert_eq!(run_twice(fault(), true).await, (RESENT, None, 1));
    assert_eq!(
        run_twice(fault(), false).await,
        (
            Ended::Status(StatusCode::INTERNAL_SERVER_ERROR, ResponseSource::Sent),
            Some(Ended::InDoubt),
            1
        )
    );
}

#[tokio::test(start_paused = true)]
async fn server_error_without_commit() {
    let fault = || Fault::ServerError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        commit: false,
    };
    assert_eq!(run_twice(fault(), true).await, (RESENT, None, 1));
    assert_eq!(
        run_twice(fault(), false).await,
        (
            Ended::Status(StatusCode::SERVICE_UNAVAILABLE, ResponseSource::Sent),
            Some(Ended::InDoubt),
            0
        )
    );
}

#[tokio::test(start_paused = true)]
async fn panic_after_commit() {
    let fault = || Fault::Panic { after_commit: true };
    assert_eq!(
        run_twice(fault(), true).await,
        (Ended::Panicked, Some(RESENT), 1)
    );
    assert_eq!(
        run_twice(fault(), false).await,
        (Ended::Panicked, Some(Ended::InDoubt), 1)
    );
}

#[tokio::test(start_paused = true)]
async fn panic_before_commit() {
    let fault = || Fault::Panic {
        after_commit: false,
    };
    assert_eq!(
        run_twice(fault(), true).await,
        (Ended::Panicked, Some(RESENT), 1)
    );
    assert_eq!(
        run_twice(fault(), false).await,
        (Ended::Panicked, Some(Ended::InDoubt), 0)
    );
}

#[tokio::test(start_paused = true)]
async fn latency() {
    let fault = || Fault::Latency(Duration::from_secs(2));
    assert_eq!(run_twice(fault(), true).await, (CREATED, None, 1));
    assert_eq!(run_twice(fault(), false).await, (CREATED, None, 1));
}

/// The same faults against the stack users write without us — `tower::retry` over a
/// buffered request, no ledger — fire the effect twice: the matrix above is not vacuous.
#[tokio::test(start_paused = true)]
async fn without_the_ledger_the_same_faults_charge_twice() {
    for fault in [
        Fault::CommitThenTimeout,
        Fault::ServerError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            commit: true,
        },
    ] {
        let provider = SideEffectService::builder()
            .honour_keys(false)
            .faults([fault.clone()])
            .build();
        for _ in 0..2 {
            let attempt =
                tokio::time::timeout(Duration::from_secs(5), provider.clone().oneshot(charge()))
                    .await;
            if matches!(attempt, Ok(Ok(ref r)) if r.status() == StatusCode::CREATED) {
                break;
            }
        }
        assert_eq!(provider.effects(), 2, "{fault:?}");
    }
}
