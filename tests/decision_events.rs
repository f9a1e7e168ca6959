//! The decision events of both faces, in a test binary of its own: `tracing`'s level
//! filter and callsite interest are global, so a `DEBUG` capture must not share a process
//! with tests that log through the same callsites under other subscribers, or none.
#![cfg(feature = "test-util")]

mod support;

use support::capture;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::routing::post as route_post;
use axum::Router;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::ProviderKeys;
use tower_idempotency::{IdempotencyLayer, KeyHeader, OperationId};

fn op() -> OperationId {
    OperationId::new("task-9", "create-order")
}

/// A handler that counts its runs.
fn counting_handler(
    runs: Arc<AtomicUsize>,
) -> impl Fn() -> std::future::Ready<(StatusCode, String)> + Clone + Send + Sync + 'static {
    move || {
        let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
        std::future::ready((StatusCode::CREATED, format!("{{\"run\":{n}}}")))
    }
}

/// One event per ledger decision, on both faces, joinable by one key digest that is neither
/// the key nor a credential.
#[tokio::test(flavor = "current_thread")]
async fn both_faces_log_each_decision_under_one_key_digest() {
    let (logs, _default) = capture::events(tracing::Level::DEBUG);
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route("/orders", route_post(counting_handler(runs.clone())))
        .route_layer(IdempotencyLayer::server(MemoryStore::new()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .service(http);
    let order = || {
        let mut req = Request::post(format!("http://{addr}/orders"))
            .header("authorization", "Bearer sk_live_secret")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        req.extensions_mut().insert(op());
        req
    };
    client.clone().oneshot(order()).await.unwrap();
    client.oneshot(order()).await.unwrap();

    let text = logs.text();
    let decisions: Vec<&str> = text
        .lines()
        .filter(|line| line.contains("idempotency decision"))
        .collect();
    let digest_of = |line: &str| {
        let at = line.find("idempotency.key.digest=").expect("a digest") + 23;
        line[at..at + 16].to_owned()
    };
    assert_eq!(decisions.len(), 3, "{text}");
    assert!(
        decisions[0].contains("idempotency.face=\"client\"")
            && decisions[0].contains("\"acquired\""),
        "{text}"
    );
    assert!(
        decisions[1].contains("idempotency.face=\"server\"")
            && decisions[1].contains("\"acquired\""),
        "{text}"
    );
    assert!(
        decisions[2].contains("idempotency.face=\"client\"")
            && decisions[2].contains("\"replayed\""),
        "{text}"
    );
    let digest = digest_of(decisions[0]);
    assert!(
        decisions.iter().all(|line| digest_of(line) == digest),
        "{text}"
    );
    // Never the key, never the credential.
    let key = op().key("").to_hex();
    assert!(
        !text.contains(&key) && !text.contains("sk_live_secret"),
        "{text}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
