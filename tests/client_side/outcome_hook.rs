//! The `on_outcome` hook of both faces: one event per request that reached the ledger, with
//! its last decision, the status when there was one, the key's digest and the time taken.
#![cfg(feature = "test-util")]

use crate::support::orders;
use tower_idempotency::KeyHeader;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::idempotency::{Decision, Face, OutcomeEvent};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::testing::{Fault, SideEffectService};
use tower_idempotency::IdempotencyLayer;
use tower_idempotency::ProviderKeys;

/// What a hook saw of one request.
#[derive(Clone, Debug, PartialEq)]
struct Seen {
    face: Face,
    decision: Decision,
    status: Option<StatusCode>,
    digest: String,
    elapsed: Duration,
}

type Log = Arc<Mutex<Vec<Seen>>>;

fn recording(log: &Log) -> impl Fn(&OutcomeEvent<'_>) + Send + Sync + 'static {
    let log = log.clone();
    move |event| {
        log.lock().unwrap().push(Seen {
            face: event.face(),
            decision: event.decision(),
            status: event.status(),
            digest: event.key_digest(),
            elapsed: event.elapsed(),
        })
    }
}

fn taken(log: &Log) -> Vec<Seen> {
    std::mem::take(&mut *log.lock().unwrap())
}

#[tokio::test(start_paused = true)]
async fn the_client_hook_hears_each_operation_once_with_its_last_decision() {
    let log = Log::default();
    let provider = SideEffectService::builder()
        .latency(Duration::from_millis(40))
        .build();
    let client = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(MemoryStore::new())
                .provider_deduplicates(true)
                .key_header(KeyHeader::ietf())
                // A regenerated payload is refused, so the hook hears a drift.
                .drift_policy(tower_idempotency::DriftPolicy::Reject)
                .on_outcome(recording(&log))
                .build()
                .unwrap(),
        )
        .service(provider.clone());

    client.clone().oneshot(orders::post("{}")).await.unwrap();
    let sent = taken(&log);
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(sent[0].face, Face::Client);
    assert_eq!(sent[0].decision, Decision::Acquired);
    assert_eq!(sent[0].status, Some(StatusCode::CREATED));
    assert_eq!(
        sent[0].elapsed,
        Duration::from_millis(40),
        "the provider's latency"
    );
    assert_eq!(sent[0].digest.len(), 16);

    client.clone().oneshot(orders::post("{}")).await.unwrap();
    let replayed = taken(&log);
    assert_eq!(replayed.len(), 1, "{replayed:?}");
    assert_eq!(replayed[0].decision, Decision::Replayed);
    assert_eq!(replayed[0].status, Some(StatusCode::CREATED));
    assert_eq!(
        replayed[0].digest, sent[0].digest,
        "one operation, one digest"
    );
    assert_eq!(replayed[0].elapsed, Duration::ZERO, "nothing was sent");

    // A regenerated payload under the same operation: refused, no status.
    client
        .clone()
        .oneshot(orders::post(r#"{"a":1}"#))
        .await
        .unwrap_err();
    let drift = taken(&log);
    assert_eq!(drift.len(), 1, "{drift:?}");
    assert_eq!(drift[0].decision, Decision::Drift);
    assert_eq!(drift[0].status, None);
    assert_eq!(provider.effects(), 1);
}

#[tokio::test(start_paused = true)]
async fn an_acquired_operation_that_times_out_is_reported_in_doubt() {
    let log = Log::default();
    let provider = SideEffectService::new().with_faults([Fault::CommitThenTimeout]);
    let client = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(MemoryStore::new())
                .provider_deduplicates(true)
                .key_header(KeyHeader::ietf())
                .on_outcome(recording(&log))
                .build()
                .unwrap(),
        )
        .timeout(Duration::from_secs(2))
        .service(provider.clone());
    client.oneshot(orders::post("{}")).await.unwrap_err();
    let seen = taken(&log);
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(
        seen[0].decision,
        Decision::InDoubt,
        "the last decision, not `acquired`"
    );
    assert_eq!(seen[0].status, None);
    assert_eq!(seen[0].elapsed, Duration::from_secs(2));
}

#[tokio::test(start_paused = true)]
async fn a_resent_operation_is_reported_by_what_its_resend_came_to() {
    // The retry of an operation in doubt resumes it and resends the frozen bytes; the
    // resend times out again. The hook hears the decision taken inside the resend (in
    // doubt once more), not the `resumed` that led to it.
    let log = Log::default();
    let provider =
        SideEffectService::new().with_faults([Fault::CommitThenTimeout, Fault::CommitThenTimeout]);
    let client = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(MemoryStore::new())
                .provider_deduplicates(true)
                .key_header(KeyHeader::ietf())
                .on_outcome(recording(&log))
                .build()
                .unwrap(),
        )
        .timeout(Duration::from_secs(2))
        .service(provider.clone());
    client
        .clone()
        .oneshot(orders::post("{}"))
        .await
        .unwrap_err();
    assert_eq!(taken(&log)[0].decision, Decision::InDoubt);

    client.oneshot(orders::post("{}")).await.unwrap_err();
    let resent = taken(&log);
    assert_eq!(resent.len(), 1, "{resent:?}");
    assert_eq!(
        resent[0].decision,
        Decision::InDoubt,
        "the resend's own decision, not `resumed`"
    );
    assert_eq!(
        provider.effects(),
        1,
        "the provider deduplicated the resend"
    );
}

#[tokio::test(start_paused = true)]
async fn requests_outside_the_ledger_are_not_reported() {
    let log = Log::default();
    let client = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(MemoryStore::new())
                .provider_deduplicates(true)
                .key_header(KeyHeader::ietf())
                .require_key(false)
                .on_outcome(recording(&log))
                .build()
                .unwrap(),
        )
        .service(SideEffectService::new());
    let keyless = Request::post(orders::ORDERS)
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    client.clone().oneshot(keyless).await.unwrap();
    let read = Request::get(orders::ORDERS)
        .body(Full::new(Bytes::new()))
        .unwrap();
    client.oneshot(read).await.unwrap();
    assert_eq!(taken(&log), []);
}

/// Over loopback: the client's and the server's hooks hear one operation under one digest,
/// so the two sides' own observability can be joined, as their logs can.
#[tokio::test]
async fn both_faces_report_one_operation_under_one_digest() {
    let (client_log, server_log) = (Log::default(), Log::default());
    let server_layer = IdempotencyLayer::server_builder(MemoryStore::new())
        .on_outcome(recording(&server_log))
        .build()
        .unwrap();
    let app = Router::new().route(
        "/orders",
        post(|| async { (StatusCode::CREATED, "{}") }).route_layer(server_layer),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let client = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(MemoryStore::new())
                .provider_deduplicates(true)
                .key_header(KeyHeader::ietf())
                .on_outcome(recording(&client_log))
                .build()
                .unwrap(),
        )
        .service(http);
    let order = || {
        let mut req = Request::post(format!("http://{addr}/orders"))
            .header("authorization", "Bearer sk_live_secret")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        req.extensions_mut().insert(orders::op());
        req
    };
    client.clone().oneshot(order()).await.unwrap();
    // A second client (another process) without the first one's ledger: the server replays.
    let fresh_client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .service(
            hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
                .build_http::<Full<Bytes>>(),
        );
    fresh_client.oneshot(order()).await.unwrap();

    let client_seen = taken(&client_log);
    let server_seen = taken(&server_log);
    assert_eq!(client_seen.len(), 1, "{client_seen:?}");
    let decisions: Vec<_> = server_seen
        .iter()
        .map(|s| (s.face, s.decision, s.status))
        .collect();
    assert_eq!(
        decisions,
        [
            (Face::Server, Decision::Acquired, Some(StatusCode::CREATED)),
            (Face::Server, Decision::Replayed, Some(StatusCode::CREATED)),
        ]
    );
    assert!(server_seen
        .iter()
        .all(|s| s.digest == client_seen[0].digest));
    for seen in client_seen.iter().chain(&server_seen) {
        assert!(!seen.digest.contains("sk_live"), "never a credential");
    }
}

#[tokio::test]
async fn the_server_hook_is_not_called_for_requests_refused_before_the_ledger() {
    let log = Log::default();
    let layer = IdempotencyLayer::server_builder(MemoryStore::new())
        .on_outcome(recording(&log))
        .build()
        .unwrap();
    let app = Router::new().route(
        "/orders",
        post(|| async { (StatusCode::CREATED, "{}") }).route_layer(layer),
    );
    // Keyless, and keyed without a principal to scope it by.
    let keyless = Request::post("/orders")
        .body(axum::body::Body::empty())
        .unwrap();
    let unscoped = Request::post("/orders")
        .header("idempotency-key", "\"k\"")
        .body(axum::body::Body::empty())
        .unwrap();
    assert_eq!(
        app.clone().oneshot(keyless).await.unwrap().status(),
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        app.oneshot(unscoped).await.unwrap().status(),
        StatusCode::BAD_REQUEST
    );
    assert_eq!(taken(&log), []);
}
