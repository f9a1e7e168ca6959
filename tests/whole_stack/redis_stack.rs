//! The whole stack on a shared Redis ledger: crash and resume across real processes, and
//! Redis outages at the layer.
//!
//! Each test starts its own `redis-server` (see `support/redis.rs`); without one the tests
//! are skipped with a notice, and fail instead when `REQUIRE_REDIS=1`.
#![cfg(feature = "redis")]

use crate::support::redis as redis_support;

use crate::support::axum_server;

use std::process::{Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::RedisStore;
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::testing::{Fault, SideEffectService};
use tower_idempotency::ProviderKeys;
use tower_idempotency::{
    BusyPolicy, DriftPolicy, FrozenRetryLayer, IdempotencyLayer, KeyHeader, OperationId,
    ResponseSource,
};

use redis_support::RedisServer;

const CHILD_ENV: &str = "TOWER_IDEMPOTENCY_ORCHESTRATOR_CHILD";
const ORIGINAL: &str = r#"{"order_id":"ord_8f21c3","summary":"Restock: 200 units of SKU-4471, expedited freight","fulfillment_intent_id":"fi_9a7e21"}"#;
const REGENERATED: &str = r#"{"order_id":"ord_8f21c3","summary":"Restock order for 200 units of SKU-4471 - expediting after prior submission failed to confirm","fulfillment_intent_id":"fi_c02b6f"}"#;

/// The orchestrator process of [`crash_and_resume_across_processes`]: this test binary run
/// again with the child environment set. In a normal test run it does nothing.
#[tokio::test]
async fn orchestrator_child_process() {
    let Ok(role) = std::env::var(CHILD_ENV) else {
        return;
    };
    let env = |name: &str| std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"));
    let store = RedisStore::builder(env("CHILD_REDIS_URL"))
        .prefix(env("CHILD_PREFIX"))
        .connect()
        .await
        .expect("the child reaches Redis");
    let layer = IdempotencyLayer::client_builder(store)
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        // A short lease, so the survivor of a SIGKILL does not wait long for it to lapse.
        .lease(Duration::from_secs(2))
        .retry_policy(
            tower_idempotency::retry::RetryPolicy::builder()
                .max_elapsed(Duration::from_secs(1))
                .build()
                .unwrap(),
        )
        .retention(Duration::from_secs(3600))
        .drift_policy(DriftPolicy::ResendFrozen)
        .busy_policy(BusyPolicy::Wait(Duration::from_secs(20)))
        .build()
        .unwrap();
    let client = ServiceBuilder::new()
        .layer(layer)
        .layer(FrozenRetryLayer::new(
            RetryPolicy::builder()
                .max_elapsed(Duration::from_secs(1))
                .build()
                .unwrap(),
        ))
        .service(HyperClient::builder(TokioExecutor::new()).build_http::<Full<Bytes>>());
    let mut req = Request::post(env("CHILD_PROVIDER_URI"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(env("CHILD_BODY"))))
        .unwrap();
    req.extensions_mut()
        .insert(OperationId::new("task-crash", "create_order"));
    println!("CHILD {role} SENDING");
    let response = client
        .oneshot(req)
        .await
        .expect("the resumed call succeeds");
    let source = ResponseSource::of(&response);
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    println!(
        "CHILD {role} RESPONSE {} {source:?} {}",
        status.as_u16(),
        String::from_utf8_lossy(&body)
    );
}

fn spawn_child(
    role: &str,
    redis_url: &str,
    prefix: &str,
    provider: &str,
    body: &str,
) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            test_name("orchestrator_child_process").as_str(),
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, role)
        .env("CHILD_REDIS_URL", redis_url)
        .env("CHILD_PREFIX", prefix)
        .env("CHILD_PROVIDER_URI", provider)
        .env("CHILD_BODY", body)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn the orchestrator process")
}

/// Waits on something another process does; bounded, and only as long as it takes.
async fn eventually(what: &str, mut done: impl FnMut() -> bool) {
    for _ in 0..2000 {
        if done() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_and_resume_across_processes() {
    let Some(redis) = RedisServer::spawn().await else {
        return;
    };
    // The provider commits, then holds the response: the orchestrator never hears back.
    let provider = SideEffectService::new().with_faults([Fault::CommitThenTimeout]);
    let server = provider
        .clone()
        .serve(TcpListener::bind("127.0.0.1:0").await.unwrap())
        .await
        .unwrap();
    let uri = server.uri("/orders").to_string();
    let prefix = "crash-resume:";

    let mut doomed = spawn_child("first", &redis.url(), prefix, &uri, ORIGINAL);
    eventually("the first request to reach the provider", || {
        provider.effects() == 1
    })
    .await;
    doomed.kill().expect("SIGKILL the orchestrator"); // no destructor, no cleanup, nothing
    doomed.wait().unwrap();

    // A new process: the agent re-ran and produced a different payload for the same step.
    let survivor = spawn_child("second", &redis.url(), prefix, &uri, REGENERATED);
    let output = tokio::task::spawn_blocking(move || survivor.wait_with_output().unwrap())
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "the resumed process failed:\n{stdout}"
    );
    let line = stdout
        .lines()
        .find(|l| l.starts_with("CHILD second RESPONSE"))
        .unwrap_or_else(|| panic!("no response line in:\n{stdout}"));
    assert!(line.contains("RESPONSE 201 Resent"), "{line}");
    assert!(
        line.contains("\"effect_id\":\"eff_1\""),
        "the provider's real answer: {line}"
    );

    assert_eq!(provider.effects(), 1);
    let attempts = provider.attempts();
    assert_eq!(attempts.len(), 2, "the original send and the resend");
    assert!(
        attempts.iter().all(|a| a.body() == ORIGINAL.as_bytes()),
        "the resumed process resent the frozen bytes, not its regenerated payload"
    );
    assert_eq!(
        attempts[0].headers()["idempotency-key"],
        attempts[1].headers()["idempotency-key"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_outage_fails_closed_and_the_same_client_recovers() {
    let Some(mut redis) = RedisServer::spawn().await else {
        return;
    };
    let store = RedisStore::builder(redis.url())
        .prefix("outage:")
        .operation_timeout(Duration::from_millis(300))
        .connect()
        .await
        .unwrap();
    let provider = SideEffectService::new();
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            store,
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .service(provider.clone());
    let charge = |step: &str| {
        let mut req = Request::post("http://payments.local/charges")
            .body(Full::new(Bytes::from_static(b"{\"amount_cents\":1999}")))
            .unwrap();
        req.extensions_mut()
            .insert(OperationId::new("task-outage", step));
        req
    };

    redis.stop();
    let err = client.clone().oneshot(charge("during")).await.unwrap_err();
    assert!(err.is_store(), "{err}");
    assert_eq!(
        provider.calls(),
        0,
        "no side effect fires without the ledger"
    );

    redis.restart().await;
    let mut recovered = None;
    for _ in 0..50 {
        match client.clone().oneshot(charge("after")).await {
            Ok(response) => {
                recovered = Some(response);
                break;
            }
            Err(err) => {
                assert!(err.is_store(), "{err}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    let response = recovered.expect("the same client works once Redis is back");
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(provider.effects(), 1);
}

/// Two replicas of the payments service, each with its own connection to one Redis:
/// 64 identical requests split between them charge once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_sharing_redis_charge_once_for_sixty_four_concurrent_requests() {
    let Some(redis) = RedisServer::spawn().await else {
        return;
    };
    let mut replicas = Vec::new();
    for _ in 0..2 {
        let store = RedisStore::builder(redis.url())
            .prefix("replicas:")
            .connect()
            .await
            .unwrap();
        let app = axum_server::app(store, Duration::from_millis(200));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        replicas.push(addr);
    }
    let client = HyperClient::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let calls: Vec<_> = (0..64)
        .map(|i| {
            let (client, addr) = (client.clone(), replicas[i % 2]);
            tokio::spawn(async move {
                let req = Request::post(format!("http://{addr}/charges"))
                    .header("authorization", "tenant-a")
                    .header("idempotency-key", "\"order-42-charge\"")
                    .header("content-type", "application/json")
                    .body(Full::new(Bytes::from_static(
                        br#"{"order_id":"order_42","amount_cents":1999}"#,
                    )))
                    .unwrap();
                let response = client.request(req).await.unwrap();
                let replayed = response.headers().contains_key("idempotent-replayed");
                (response.status(), replayed)
            })
        })
        .collect();
    let mut fresh = 0;
    for call in calls {
        match call.await.unwrap() {
            (StatusCode::CREATED, false) => fresh += 1,
            (StatusCode::CREATED, true) | (StatusCode::CONFLICT, _) => {}
            other => panic!("unexpected answer {other:?}"),
        }
    }
    assert_eq!(fresh, 1, "one request ran the handler");

    let mut charges = 0;
    for addr in &replicas {
        let list = Request::get(format!("http://{addr}/charges?order_id=order_42"))
            .header("authorization", "tenant-a")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let body = client
            .request(list)
            .await
            .unwrap()
            .into_body()
            .collect()
            .await
            .unwrap();
        let listed: Vec<axum_server::Charge> = serde_json::from_slice(&body.to_bytes()).unwrap();
        charges += listed.len();
    }
    assert_eq!(charges, 1, "exactly one charge across both replicas");
}

/// The libtest name of a test in this module: its path inside the test binary, which the
/// binary's crate name does not prefix.
fn test_name(function: &str) -> String {
    let module = module_path!();
    let in_binary = module.split_once("::").map_or(module, |(_, rest)| rest);
    format!("{in_binary}::{function}")
}
