//! Forgetting one record on purpose, as an operator does: through a built layer's
//! `records()` handle, keyed as the layer keys its requests, fenced by what `inspect`
//! showed, and leaving a trace (a `WARN` event, and a counter with feature `metrics`).
//! The store side of `forget` is checked on every store by the conformance suite and the
//! model-based tests.
#![cfg(feature = "test-util")]

use crate::support::capture;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::body::Body;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::{Expected, Forget, MemoryStore, RecordState};
use tower_idempotency::testing::SideEffectService;
use tower_idempotency::ProviderKeys;
use tower_idempotency::{IdempotencyLayer, KeyHeader, OperationId};

fn charge(key: &str) -> Request<Body> {
    Request::post("/charges")
        .header("authorization", "Bearer tenant-1")
        .header("idempotency-key", format!("\"{key}\""))
        .body(Body::from("{}"))
        .unwrap()
}

/// Hole 9: a recorded `401` the caller can never get past (the handler refused a token
/// that was fixed since) is forgotten by its key and credentials, and the next request
/// runs the handler again. The act is logged with the key's digest and the state.
#[tokio::test(flavor = "current_thread")]
async fn a_recorded_401_is_forgotten_by_request_head_and_the_key_runs_again() {
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = {
        let runs = runs.clone();
        move || async move {
            match runs.fetch_add(1, Ordering::SeqCst) {
                0 => (StatusCode::UNAUTHORIZED, "token expired"),
                _ => (StatusCode::CREATED, "charged"),
            }
        }
    };
    let layer = IdempotencyLayer::server(MemoryStore::new());
    let app = Router::new().route("/charges", post(handler).route_layer(layer.clone()));

    for _ in 0..2 {
        let res = app.clone().oneshot(charge("order-17")).await.unwrap();
        assert_eq!(res.status(), StatusCode::UNAUTHORIZED);
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the 401 was recorded and replayed"
    );

    let records = layer.records();
    let (head, _) = charge("order-17").into_parts();
    let key = records.request_key(&head).expect("keyed and scoped");
    // Another caller's credentials lead to another record: nothing there.
    let (other, _) = Request::post("/charges")
        .header("authorization", "Bearer tenant-2")
        .header("idempotency-key", "\"order-17\"")
        .body(())
        .unwrap()
        .into_parts();
    assert_ne!(records.request_key(&other), Some(key));

    let view = records
        .inspect(key)
        .await
        .unwrap()
        .expect("the recorded 401");
    assert_eq!(
        view.state,
        RecordState::Completed {
            status: StatusCode::UNAUTHORIZED
        }
    );
    let (logs, _default) = capture::warnings();
    assert_eq!(
        records.forget(key, Expected::of(&view)).await.unwrap(),
        Forget::Forgotten
    );
    let logged = logs.text();
    assert!(
        logged.contains("WARN")
            && logged.contains("forgotten on purpose")
            && logged.contains(&key.to_hex())
            && logged.contains("state=\"completed\""),
        "{logged}"
    );

    let res = app.clone().oneshot(charge("order-17")).await.unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// Hole 9, client face: an operation's record is found by its `OperationId`, in the
/// layer's scope, and forgotten as seen; the operation then runs again. A look that no
/// longer matches the record is refused and changes nothing.
#[tokio::test(flavor = "current_thread")]
async fn an_operation_is_forgotten_by_operation_id_and_a_stale_look_is_refused() {
    let provider = SideEffectService::new();
    let layer = IdempotencyLayer::client_builder(MemoryStore::new())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .scope("billing-agent")
        .build()
        .unwrap();
    let client = ServiceBuilder::new()
        .layer(layer.clone())
        .service(provider.clone());
    let op = OperationId::new("task-7", "charge");
    let send = || {
        let mut req = Request::post("http://payments.local/charges")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        req.extensions_mut().insert(op.clone());
        client.clone().oneshot(req)
    };
    send().await.unwrap();
    send().await.unwrap();
    assert_eq!(provider.calls(), 1, "the second send replayed");

    let records = layer.records();
    let key = records.operation_key(&op);
    let seen = records
        .inspect(key)
        .await
        .unwrap()
        .expect("the layer's record");
    assert!(matches!(seen.state, RecordState::Completed { .. }));
    // Another scope keys the same operation elsewhere.
    let other = IdempotencyLayer::client(
        MemoryStore::new(),
        ProviderKeys::Deduplicates,
        KeyHeader::ietf(),
    )
    .records();
    assert_ne!(other.operation_key(&op), key);

    // Not the record as it is now (another payload, or another attempt): refused.
    let mut wrong = Expected::of(&seen);
    wrong.fingerprint =
        tower_idempotency::fingerprint::Fingerprint::of(&http::Method::POST, "/x", b"{}");
    assert_eq!(records.forget(key, wrong).await.unwrap(), Forget::Changed);
    let mut stale = Expected::of(&seen);
    stale.attempts += 1;
    assert_eq!(records.forget(key, stale).await.unwrap(), Forget::Changed);
    let still = records.inspect(key).await.unwrap().expect("still recorded");
    assert_eq!(Expected::of(&still), Expected::of(&seen));

    assert_eq!(
        records.forget(key, Expected::of(&seen)).await.unwrap(),
        Forget::Forgotten
    );
    send().await.unwrap();
    assert_eq!(provider.calls(), 2, "the forgotten operation ran afresh");
}

/// A look only ever forgets the record it saw. An operator looks at a recorded `401` to
/// release it; meanwhile the record passes its retention, the caller's retry runs the
/// handler again and `201` is recorded: the same request, completed on its first attempt,
/// so alike in everything but its life. The operator's forget, made from the old look, is
/// refused, and the next retry replays the `201` instead of charging a third time.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_look_at_an_earlier_life_of_the_key_never_forgets_the_next() {
    const RETENTION: std::time::Duration = std::time::Duration::from_secs(120);
    let charges = Arc::new(AtomicUsize::new(0));
    let handler = {
        let charges = charges.clone();
        move || async move {
            match charges.fetch_add(1, Ordering::SeqCst) {
                0 => (StatusCode::UNAUTHORIZED, "token expired"),
                _ => (StatusCode::CREATED, "charged"),
            }
        }
    };
    let layer = IdempotencyLayer::server_builder(MemoryStore::new())
        .retention(RETENTION)
        .build()
        .unwrap();
    let app = Router::new().route("/charges", post(handler).route_layer(layer.clone()));
    let send = || app.clone().oneshot(charge("order-18"));

    assert_eq!(send().await.unwrap().status(), StatusCode::UNAUTHORIZED);
    let records = layer.records();
    let (head, _) = charge("order-18").into_parts();
    let key = records.request_key(&head).expect("keyed and scoped");
    let seen = records
        .inspect(key)
        .await
        .unwrap()
        .expect("the recorded 401");

    // The 401 leaves (past its retention); the retry charges and records a 201.
    tokio::time::advance(RETENTION + std::time::Duration::from_secs(1)).await;
    assert_eq!(send().await.unwrap().status(), StatusCode::CREATED);
    assert_eq!(charges.load(Ordering::SeqCst), 2);
    let now = records
        .inspect(key)
        .await
        .unwrap()
        .expect("the recorded 201");
    assert_eq!(
        now.state,
        RecordState::Completed {
            status: StatusCode::CREATED
        }
    );

    assert_eq!(
        records.forget(key, Expected::of(&seen)).await.unwrap(),
        Forget::Changed,
        "a look at the 401 forgot the 201"
    );
    let replayed = send().await.unwrap();
    assert_eq!(replayed.status(), StatusCode::CREATED);
    assert_eq!(
        charges.load(Ordering::SeqCst),
        2,
        "the retry after the forget charged again"
    );
}

/// With feature `metrics`, each forget is counted by store, expected state and result.
#[cfg(feature = "metrics")]
#[test]
fn forgets_are_counted() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use tower_idempotency::ledger::{Generation, IdempotencyStore, LedgerKey, RecordKind};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let store = MemoryStore::new();
            let fp =
                tower_idempotency::fingerprint::Fingerprint::of(&http::Method::POST, "/x", b"{}");
            let expected = Expected::new(RecordKind::InDoubt, fp, 1, Generation::random());
            let answer = store.forget(LedgerKey::from_bytes([1; 32]), expected).await;
            assert_eq!(answer.unwrap(), Forget::Absent);
        })
    });
    let counted: Vec<_> = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .filter_map(|(key, _, _, value)| {
            let key = key.key().clone();
            (key.name() == "idempotency_ledger_forget_total").then(|| {
                let labels: Vec<String> = key
                    .labels()
                    .map(|l| format!("{}={}", l.key(), l.value()))
                    .collect();
                (labels, value)
            })
        })
        .collect();
    assert_eq!(counted.len(), 1, "{counted:?}");
    let (labels, value) = &counted[0];
    assert!(
        labels.contains(&"store=memory".to_owned())
            && labels.contains(&"state=in_doubt".to_owned())
            && labels.contains(&"result=absent".to_owned()),
        "{labels:?}"
    );
    assert!(matches!(value, DebugValue::Counter(1)), "{value:?}");
}
