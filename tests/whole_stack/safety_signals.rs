//! Safety signals (an effect may repeat, or a payload was discarded) reach every face's
//! `on_outcome` hook and the `metrics` recorder, not only a `tracing` subscriber.
#![cfg(all(feature = "metrics", feature = "test-util"))]

use crate::support::{down, orders};

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::MetricKind;
use tower::{Layer, ServiceBuilder, ServiceExt};
use tower_idempotency::idempotency::{Decision, Face, OutcomeEvent, Signal};
use tower_idempotency::ledger::{
    Begin, BeginRequest, IdempotencyStore, LeaseToken, LedgerKey, MemoryStore, Outcome, StoreError,
    StoreFuture,
};
use tower_idempotency::testing::{SideEffectService, ToolDouble, ToolFault};
use tower_idempotency::tool::{ProviderKeys, ToolCall, ToolLayer};
use tower_idempotency::{DriftPolicy, IdempotencyLayer, KeyHeader, OperationId};

/// What a hook saw of one request: its face, decision and signals.
type Seen = (Face, Decision, Vec<Signal>);
type Log = Arc<Mutex<Vec<Seen>>>;

fn recording(log: &Log) -> impl Fn(&OutcomeEvent<'_>) + Send + Sync + 'static {
    let log = log.clone();
    move |event| {
        let signals = event.signals().collect();
        log.lock()
            .unwrap()
            .push((event.face(), event.decision(), signals));
    }
}

/// Run `scenario` (which builds its layers inside, so their metrics land here) with a
/// recorder of its own; how often each `(face, signal)` was counted.
fn counted_signals<F: Future<Output = ()>>(scenario: impl FnOnce() -> F) -> Vec<(String, u64)> {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || runtime.block_on(scenario()));
    let mut counted = Vec::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let (kind, key) = key.into_parts();
        if let (MetricKind::Counter, DebugValue::Counter(n)) = (kind, value) {
            if key.name() == "idempotency_safety_signals_total" {
                let mut labels: Vec<String> = key
                    .labels()
                    .map(|l| format!("{}={}", l.key(), l.value()))
                    .collect();
                labels.sort();
                counted.push((labels.join(","), n));
            }
        }
    }
    counted
}

fn taken(log: &Log) -> Vec<Seen> {
    std::mem::take(&mut *log.lock().unwrap())
}

#[test]
fn a_client_that_fails_open_says_so_to_the_hook_and_the_metrics() {
    let log = Log::default();
    let provider = SideEffectService::new();
    let counted = counted_signals(|| async {
        let client = ServiceBuilder::new()
            .layer(
                IdempotencyLayer::client_builder(down::DownStore)
                    .provider_deduplicates(true)
                    .key_header(KeyHeader::ietf())
                    .fail_open(true)
                    .on_outcome(recording(&log))
                    .build()
                    .unwrap(),
            )
            .service(provider.clone());
        client.oneshot(orders::post("{}")).await.unwrap();
    });
    assert_eq!(provider.effects(), 1, "sent unprotected");
    assert_eq!(
        taken(&log),
        [(Face::Client, Decision::Unavailable, vec![Signal::FailOpen])]
    );
    assert_eq!(counted, [("face=client,signal=fail_open".to_owned(), 1)]);
}

#[test]
fn a_client_payload_discarded_for_the_frozen_one_says_so_to_the_hook_and_the_metrics() {
    let log = Log::default();
    let provider = SideEffectService::new();
    let counted = counted_signals(|| async {
        let client = ServiceBuilder::new()
            .layer(
                IdempotencyLayer::client_builder(MemoryStore::new())
                    .provider_deduplicates(true)
                    .key_header(KeyHeader::ietf())
                    .drift_policy(DriftPolicy::ResendFrozen)
                    .on_outcome(recording(&log))
                    .build()
                    .unwrap(),
            )
            .service(provider.clone());
        client
            .clone()
            .oneshot(orders::post(r#"{"amount":10}"#))
            .await
            .unwrap();
        // The caller regenerated its payload: answered for the first, this one discarded.
        client
            .oneshot(orders::post(r#"{"amount":12}"#))
            .await
            .unwrap();
    });
    assert_eq!(provider.effects(), 1);
    assert_eq!(
        taken(&log),
        [
            (Face::Client, Decision::Acquired, vec![]),
            (
                Face::Client,
                Decision::Replayed,
                vec![Signal::PayloadDiscarded]
            ),
        ]
    );
    assert_eq!(
        counted,
        [("face=client,signal=payload_discarded".to_owned(), 1)]
    );
}

#[test]
fn a_server_that_fails_open_says_so_to_the_hook_and_the_metrics() {
    let log = Log::default();
    let runs = Arc::new(Mutex::new(0));
    let counted = counted_signals(|| async {
        let layer = IdempotencyLayer::server_builder(down::DownStore)
            .fail_open(true)
            .on_outcome(recording(&log))
            .build()
            .unwrap();
        let handler = {
            let runs = runs.clone();
            post(move || async move {
                *runs.lock().unwrap() += 1;
                "charged"
            })
        };
        let app = Router::new().route("/charges", handler.route_layer(layer));
        let request = http::Request::post("/charges")
            .header("authorization", "Bearer sk_alice")
            .header("idempotency-key", "\"order-42\"")
            .body(Body::from("{}"))
            .unwrap();
        let response = app.oneshot(request).await.unwrap();
        assert_eq!(response.headers()["idempotency-fail-open"], "true");
    });
    assert_eq!(*runs.lock().unwrap(), 1, "run unprotected");
    assert_eq!(
        taken(&log),
        [(Face::Server, Decision::Unavailable, vec![Signal::FailOpen])]
    );
    assert_eq!(counted, [("face=server,signal=fail_open".to_owned(), 1)]);
}

#[test]
fn the_tool_face_tells_its_hook_and_the_metrics_of_discarded_arguments() {
    let log = Log::default();
    let tool = ToolDouble::new();
    let counted = counted_signals(|| async {
        let layer = ToolLayer::builder(MemoryStore::new(), "refund", ProviderKeys::Ignored)
            .on_outcome(recording(&log))
            .build()
            .unwrap();
        let service = layer.layer(tool.clone());
        let op = OperationId::new("task-3", "refund");
        let first = ToolCall::new(op.clone(), serde_json::json!({"amount": 10}));
        service.clone().oneshot(first).await.unwrap();
        // Regenerated arguments: the first ones stand, these are discarded.
        let regenerated = ToolCall::new(op, serde_json::json!({"amount": 12}));
        let output = service.oneshot(regenerated).await.unwrap();
        assert!(output.discarded().is_some());
    });
    assert_eq!(tool.effects(), 1);
    assert_eq!(
        taken(&log),
        [
            (Face::Tool, Decision::Acquired, vec![]),
            (
                Face::Tool,
                Decision::Replayed,
                vec![Signal::PayloadDiscarded]
            ),
        ]
    );
    assert_eq!(
        counted,
        [("face=tool,signal=payload_discarded".to_owned(), 1)]
    );
}

/// A store that never holds leases (its owners renew them), and answers every renewal that
/// the operation was taken over: another run resumed it while its owner still works.
#[derive(Clone, Debug)]
struct TakenOverWhileWorking {
    inner: MemoryStore,
}

impl IdempotencyStore for TakenOverWhileWorking {
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
        self.inner.complete(key, token, outcome, retention)
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

    fn renew(&self, _: LedgerKey, _: LeaseToken, _: Duration) -> StoreFuture<'_, ()> {
        StoreFuture::ready(Err(StoreError::fenced()))
    }
}

/// The provider is slow, and the lease is taken over while the owner still waits for it:
/// another run may send the operation again, so its effect may repeat. The hook hears it
/// and the metrics count it, once, not only the `tracing` subscriber.
#[test]
fn a_client_whose_lease_is_taken_over_while_it_works_says_so_to_the_hook_and_the_metrics() {
    let log = Log::default();
    let provider = SideEffectService::builder()
        .latency(Duration::from_secs(30))
        .build();
    let counted = counted_signals(|| async {
        tokio::time::pause();
        let store = TakenOverWhileWorking {
            inner: MemoryStore::new(),
        };
        let client = ServiceBuilder::new()
            .layer(
                IdempotencyLayer::client_builder(store)
                    .provider_deduplicates(true)
                    .key_header(KeyHeader::ietf())
                    .lease(Duration::from_secs(3))
                    .on_outcome(recording(&log))
                    .build()
                    .unwrap(),
            )
            .service(provider.clone());
        // Whatever the answer, the record is no longer this owner's to write.
        let _ = client.oneshot(orders::post("{}")).await;
    });
    assert_eq!(provider.effects(), 1);
    let seen = taken(&log);
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].0, Face::Client);
    assert_eq!(seen[0].2, [Signal::LeaseLost], "{seen:?}");
    assert_eq!(counted, [("face=client,signal=lease_lost".to_owned(), 1)]);
}

/// reqwest follows a provider's `303` to its receipt page (its default): the answer is
/// handled as the redirect's, but with such a client a failure on a redirect's hop would
/// read as "never sent" and release an operation that ran. The hook hears it and the
/// metrics count it, over real loopback TCP, on the `ReqwestService` stack and on the
/// reqwest-middleware face.
#[cfg(feature = "reqwest-middleware")]
#[test]
fn a_followed_redirect_says_so_to_the_hook_and_the_metrics() {
    use axum::routing::get;
    use http::StatusCode;
    use tower_idempotency::reqwest::ReqwestService;
    use tower_idempotency::reqwest_middleware::IdempotencyMiddleware;

    let log = Log::default();
    let counted = counted_signals(|| async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let location = format!("{base}/receipt");
        let app = Router::new()
            .route(
                "/charges",
                post(move || async move { (StatusCode::SEE_OTHER, [("location", location)]) }),
            )
            .route("/receipt", get(|| async { "receipt" }));
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let layer = || {
            IdempotencyLayer::client_builder(MemoryStore::new())
                .provider_deduplicates(true)
                .key_header(KeyHeader::ietf())
                .on_outcome(recording(&log))
        };

        let stack = layer()
            .build_stack()
            .unwrap()
            .layer(ReqwestService::new(reqwest::Client::new()));
        let mut charge = http::Request::post(format!("{base}/charges"))
            .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
            .unwrap();
        charge
            .extensions_mut()
            .insert(OperationId::new("task-7", "charge"));
        let answer = stack.oneshot(charge).await.unwrap();
        assert_eq!(answer.status(), StatusCode::OK);

        let middleware = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
            .with(IdempotencyMiddleware::new(layer().build().unwrap()))
            .build();
        let answer = middleware
            .post(format!("{base}/charges"))
            .body("{}")
            .with_extension(OperationId::new("task-7", "charge"))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), StatusCode::OK);
    });
    assert_eq!(
        taken(&log),
        [
            (
                Face::Client,
                Decision::Acquired,
                vec![Signal::RedirectFollowed]
            ),
            (
                Face::Client,
                Decision::Acquired,
                vec![Signal::RedirectFollowed]
            ),
        ]
    );
    assert_eq!(
        counted,
        [("face=client,signal=redirect_followed".to_owned(), 2)]
    );
}

/// The server face: the handler is slow, and its lease is taken over while it works.
#[test]
fn a_server_whose_lease_is_taken_over_while_its_handler_works_says_so_to_the_hook_and_the_metrics()
{
    let log = Log::default();
    let counted = counted_signals(|| async {
        tokio::time::pause();
        let store = TakenOverWhileWorking {
            inner: MemoryStore::new(),
        };
        let layer = IdempotencyLayer::server_builder(store)
            .lease(Duration::from_secs(3))
            .on_outcome(recording(&log))
            .build()
            .unwrap();
        let handler = post(|| async {
            tokio::time::sleep(Duration::from_secs(30)).await;
            "charged"
        });
        let app = Router::new().route("/charges", handler.route_layer(layer));
        let request = http::Request::post("/charges")
            .header("authorization", "Bearer sk_alice")
            .header("idempotency-key", "\"order-42\"")
            .body(Body::from("{}"))
            .unwrap();
        let _ = app.oneshot(request).await.unwrap();
    });
    let seen = taken(&log);
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].0, Face::Server);
    assert_eq!(seen[0].2, [Signal::LeaseLost], "{seen:?}");
    assert_eq!(counted, [("face=server,signal=lease_lost".to_owned(), 1)]);
}

/// The tool face: the tool is slow, and the call's lease is taken over while it works.
#[test]
fn the_tool_face_tells_its_hook_and_the_metrics_of_a_lease_taken_over_while_it_works() {
    let log = Log::default();
    let tool = ToolDouble::new().with_faults([ToolFault::Latency(Duration::from_secs(30))]);
    let counted = counted_signals(|| async {
        tokio::time::pause();
        let store = TakenOverWhileWorking {
            inner: MemoryStore::new(),
        };
        let layer = ToolLayer::builder(store, "refund", ProviderKeys::Ignored)
            .lease(Duration::from_secs(3))
            .on_outcome(recording(&log))
            .build()
            .unwrap();
        let service = layer.layer(tool.clone());
        let call = ToolCall::new(
            OperationId::new("task-3", "refund"),
            serde_json::json!({"amount": 10}),
        );
        let _ = service.oneshot(call).await;
    });
    assert_eq!(tool.effects(), 1);
    let seen = taken(&log);
    assert_eq!(seen.len(), 1, "{seen:?}");
    assert_eq!(seen[0].0, Face::Tool);
    assert_eq!(seen[0].2, [Signal::LeaseLost], "{seen:?}");
    assert_eq!(counted, [("face=tool,signal=lease_lost".to_owned(), 1)]);
}

/// A store with room for an operation's claim but not for its 64 KiB answer.
fn no_room_for_the_answer() -> MemoryStore {
    MemoryStore::builder().max_bytes(32 * 1024).build()
}

/// A 64 KiB answer.
fn receipt() -> String {
    "r".repeat(64 * 1024)
}

/// The client face: the provider's answer does not fit the ledger, which keeps only a
/// tombstone of it; the effect is not run again, but a later run cannot be answered with
/// the response. The hook hears it and the metrics count it.
#[test]
fn a_client_answer_kept_only_as_a_tombstone_says_so_to_the_hook_and_the_metrics() {
    let log = Log::default();
    let effects = Arc::new(Mutex::new(0));
    let counted = counted_signals(|| async {
        let provider = tower::service_fn({
            let effects = effects.clone();
            move |_: http::Request<http_body_util::Full<bytes::Bytes>>| {
                *effects.lock().unwrap() += 1;
                let answer = http::Response::new(http_body_util::Full::new(receipt().into()));
                std::future::ready(Ok::<_, std::convert::Infallible>(answer))
            }
        });
        let client = ServiceBuilder::new()
            .layer(
                IdempotencyLayer::client_builder(no_room_for_the_answer())
                    .provider_deduplicates(true)
                    .key_header(KeyHeader::ietf())
                    .on_outcome(recording(&log))
                    .build()
                    .unwrap(),
            )
            .service(provider);
        let answer = client.clone().oneshot(orders::post("{}")).await.unwrap();
        assert_eq!(answer.status(), http::StatusCode::OK, "answered whole");
        let again = client.oneshot(orders::post("{}")).await.unwrap_err();
        assert!(again.is_replay_unavailable(), "{again}");
    });
    assert_eq!(*effects.lock().unwrap(), 1);
    assert_eq!(
        taken(&log),
        [
            (
                Face::Client,
                Decision::Acquired,
                vec![Signal::OutcomeDiscarded]
            ),
            (Face::Client, Decision::Replayed, vec![]),
        ]
    );
    assert_eq!(
        counted,
        [("face=client,signal=outcome_discarded".to_owned(), 1)]
    );
}

/// The server face: the handler's answer does not fit the ledger.
#[test]
fn a_server_answer_kept_only_as_a_tombstone_says_so_to_the_hook_and_the_metrics() {
    let log = Log::default();
    let runs = Arc::new(Mutex::new(0));
    let counted = counted_signals(|| async {
        let layer = IdempotencyLayer::server_builder(no_room_for_the_answer())
            .on_outcome(recording(&log))
            .build()
            .unwrap();
        let handler = {
            let runs = runs.clone();
            post(move || async move {
                *runs.lock().unwrap() += 1;
                receipt()
            })
        };
        let app = Router::new().route("/charges", handler.route_layer(layer));
        let request = || {
            http::Request::post("/charges")
                .header("authorization", "Bearer sk_alice")
                .header("idempotency-key", "\"order-42\"")
                .body(Body::from("{}"))
                .unwrap()
        };
        let answer = app.clone().oneshot(request()).await.unwrap();
        assert_eq!(answer.status(), http::StatusCode::OK);
        let again = app.oneshot(request()).await.unwrap();
        assert_eq!(
            again.status(),
            http::StatusCode::GONE,
            "a tombstone's answer"
        );
    });
    assert_eq!(*runs.lock().unwrap(), 1, "run once");
    let seen = taken(&log);
    assert_eq!(seen[0].0, Face::Server);
    assert_eq!(seen[0].2, [Signal::OutcomeDiscarded], "{seen:?}");
    assert!(seen[1].2.is_empty(), "{seen:?}");
    assert_eq!(
        counted,
        [("face=server,signal=outcome_discarded".to_owned(), 1)]
    );
}

/// The tool face: the tool's answer (which repeats its arguments) does not fit the ledger.
#[test]
fn the_tool_face_tells_its_hook_and_the_metrics_of_an_answer_kept_only_as_a_tombstone() {
    let log = Log::default();
    let tool = ToolDouble::new();
    let counted = counted_signals(|| async {
        let layer = ToolLayer::builder(
            MemoryStore::builder().max_bytes(32 * 1024).build(),
            "export",
            ProviderKeys::Ignored,
        )
        .on_outcome(recording(&log))
        .build()
        .unwrap();
        let service = layer.layer(tool.clone());
        let call = || {
            ToolCall::new(
                OperationId::new("task-3", "export"),
                serde_json::json!({"rows": "x".repeat(20 * 1024)}),
            )
        };
        service.clone().oneshot(call()).await.unwrap();
        let Err(again) = service.oneshot(call()).await else {
            panic!("a tombstone cannot be replayed");
        };
        assert!(
            again.idempotency_error().unwrap().is_replay_unavailable(),
            "{again:?}"
        );
    });
    assert_eq!(tool.effects(), 1);
    let seen = taken(&log);
    assert_eq!(seen[0].0, Face::Tool);
    assert_eq!(seen[0].2, [Signal::OutcomeDiscarded], "{seen:?}");
    assert_eq!(
        counted,
        [("face=tool,signal=outcome_discarded".to_owned(), 1)]
    );
}

/// A side effect without an `OperationId` passes through a client built with
/// `require_key(false)`: a retry of it runs it again. Counted every time (the `WARN` is
/// written once); the hook hears of requests that reached the ledger, and this one did not.
#[test]
fn every_unkeyed_side_effect_passed_through_is_counted() {
    let log = Log::default();
    let provider = SideEffectService::new();
    let counted = counted_signals(|| async {
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
            .service(provider.clone());
        for _ in 0..2 {
            let mut unkeyed = orders::post("{}");
            unkeyed.extensions_mut().clear();
            client.clone().oneshot(unkeyed).await.unwrap();
        }
    });
    assert_eq!(provider.effects(), 2, "sent unprotected");
    assert!(taken(&log).is_empty());
    assert_eq!(counted, [("face=client,signal=unkeyed".to_owned(), 2)]);
}

/// A `FrozenRetryLayer` inside that may retry for an hour, under a face told of the default
/// policy: the operation's record could expire while it is still retried. Each operation
/// raises the signal (the `WARN` is written once).
#[test]
fn a_retry_window_longer_than_the_layer_was_told_says_so_to_the_hook_and_the_metrics() {
    use tower_idempotency::retry::RetryPolicy;
    use tower_idempotency::FrozenRetryLayer;

    let log = Log::default();
    let provider = SideEffectService::new();
    let counted = counted_signals(|| async {
        let an_hour = RetryPolicy::builder()
            .max_elapsed(Duration::from_secs(3600))
            .build()
            .unwrap();
        let client = ServiceBuilder::new()
            .layer(
                IdempotencyLayer::client_builder(MemoryStore::new())
                    .provider_deduplicates(true)
                    .key_header(KeyHeader::ietf())
                    .on_outcome(recording(&log))
                    .build()
                    .unwrap(),
            )
            .layer(FrozenRetryLayer::new(an_hour))
            .service(provider.clone());
        for step in ["charge", "refund"] {
            let mut req = orders::post("{}");
            req.extensions_mut()
                .insert(OperationId::new("task-7", step));
            client.clone().oneshot(req).await.unwrap();
        }
    });
    assert_eq!(provider.effects(), 2);
    let seen = taken(&log);
    let exceeded = (
        Face::Client,
        Decision::Acquired,
        vec![Signal::RetryWindowExceeded],
    );
    assert_eq!(seen, [exceeded.clone(), exceeded]);
    assert_eq!(
        counted,
        [("face=client,signal=retry_window_exceeded".to_owned(), 2)]
    );
}

/// A provider said to deduplicate that does not (it ignores keys, or reads another header
/// than the one sent): the retry after a timeout that followed the charge charges again.
/// The face cannot tell, but it never hides the resend: the answer is marked `Resent`, the
/// hook hears `ResentInDoubt`, and the metrics count it, so the misconfiguration shows.
#[test]
fn a_resend_of_an_attempt_that_may_have_arrived_says_so_to_the_hook_the_metrics_and_the_answer() {
    use tower_idempotency::retry::RetryPolicy;
    use tower_idempotency::testing::Fault;
    use tower_idempotency::ResponseSource;

    let log = Log::default();
    let provider = SideEffectService::builder().honour_keys(false).build();
    let counted = counted_signals(|| async {
        tokio::time::pause();
        provider.push_fault(Fault::CommitThenTimeout);
        let client = IdempotencyLayer::client_builder(MemoryStore::new())
            .provider_deduplicates(true)
            .key_header(KeyHeader::ietf())
            .retry_policy(
                RetryPolicy::builder()
                    .attempt_timeout(Duration::from_secs(2))
                    .build()
                    .unwrap(),
            )
            .on_outcome(recording(&log))
            .build_stack()
            .unwrap()
            .layer(provider.clone());
        let mut req = orders::post("{}");
        req.extensions_mut()
            .insert(OperationId::new("task-7", "charge"));
        let response = client.oneshot(req).await.unwrap();
        assert_eq!(ResponseSource::of(&response), ResponseSource::Resent);
    });
    assert_eq!(
        provider.effects(),
        2,
        "the provider ignores keys, as it was not said"
    );
    assert_eq!(
        taken(&log),
        [(
            Face::Client,
            Decision::Acquired,
            vec![Signal::ResentInDoubt]
        )]
    );
    assert_eq!(
        counted,
        [("face=client,signal=resent_in_doubt".to_owned(), 1)]
    );
}
