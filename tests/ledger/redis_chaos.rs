//! Two servers over one Redis, and Redis killed, restarted and frozen under load.
//!
//! The ledger's Redis runs with `appendfsync always` (as its docs recommend), so a restart
//! keeps every record it acknowledged; what the faults lose is *answers*: `begin`s that
//! applied but never replied, completions that failed while Redis was away. Every operation
//! must end either replayable (its handler ran once) or runnable (its handler never ran):
//! never charged twice, never stuck answering `409` or `500 outcome-unknown`.
#![cfg(feature = "redis")]

use crate::support::redis as redis_support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::task::JoinSet;
use tower_idempotency::ledger::RedisStore;
use tower_idempotency::IdempotencyLayer;

use redis_support::RedisServer;

/// Operations started after the faults are over (before, the load runs as long as they do).
const OPERATIONS: usize = 240;
/// Answers that told a client to come back (409, 503, a dropped connection).
static COME_BACK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// Operations that took over half a second to settle: proof the faults hit operations in
/// flight (unhindered, one takes about 20 ms).
static SLOWED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
const IN_FLIGHT: usize = 16;
/// Operations answered `201` so far: the faults wait for the load to flow again after the
/// restart before they freeze Redis.
static SETTLED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

type Runs = Arc<Mutex<HashMap<String, usize>>>;

/// A charge handler that takes 20 ms (the provider's round trip) and counts its runs per key.
async fn charge(State(runs): State<Runs>, headers: HeaderMap) -> (StatusCode, String) {
    let key = headers["idempotency-key"].to_str().unwrap().to_owned();
    tokio::time::sleep(Duration::from_millis(20)).await;
    let n = {
        let mut runs = runs.lock().unwrap();
        let n = runs.entry(key.clone()).or_default();
        *n += 1;
        *n
    };
    (
        StatusCode::CREATED,
        format!("{{\"key\":{key},\"run\":{n}}}"),
    )
}

async fn replica(url: &str, runs: Runs) -> SocketAddr {
    let store = RedisStore::builder(url)
        .prefix("chaos:")
        .operation_timeout(Duration::from_millis(300))
        .connect()
        .await
        .expect("connect to the ledger");
    let app = Router::new()
        .route("/charges", post(charge))
        .route_layer(
            IdempotencyLayer::server_builder(store)
                .lease(Duration::from_secs(3))
                .build()
                .unwrap(),
        )
        .with_state(runs);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// Send operation `n` until it gets a 201 (first run or replay), retrying what a client
/// would retry: 409 in-flight, 503 ledger-unavailable, a dropped connection. A `500`
/// (outcome unknown) is a failure of the guarantee, and fails the test.
async fn run_operation(
    client: Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    replicas: [SocketAddr; 2],
    n: usize,
) -> (String, Bytes) {
    let key = format!("\"op-{n}\"");
    let started = tokio::time::Instant::now();
    let deadline = started + Duration::from_secs(60);
    for attempt in 0usize.. {
        let addr = replicas[(n + attempt) % 2];
        let req = Request::post(format!("http://{addr}/charges"))
            .header("authorization", "Bearer tenant-1")
            .header("idempotency-key", &key)
            .body(Full::new(Bytes::from(format!("{{\"op\":{n}}}"))))
            .unwrap();
        if let Ok(res) = client.request(req).await {
            let status = res.status();
            let body = res.into_body().collect().await.unwrap().to_bytes();
            match status {
                StatusCode::CREATED => {
                    SETTLED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if started.elapsed() > Duration::from_millis(500) {
                        SLOWED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    }
                    return (key, body);
                }
                StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE => {}
                other => panic!(
                    "operation {n} got {other}: {}",
                    String::from_utf8_lossy(&body)
                ),
            }
        }
        COME_BACK.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        assert!(
            tokio::time::Instant::now() < deadline,
            "operation {n} never settled"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    unreachable!()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_restarted_and_frozen_under_load_charges_each_operation_once() {
    let Some(mut redis) = RedisServer::spawn_durable().await else {
        return;
    };
    let runs = Runs::default();
    let replicas = [
        replica(&redis.url(), runs.clone()).await,
        replica(&redis.url(), runs.clone()).await,
    ];
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();

    // The faults, while the load runs: a crash of Redis and a restart a moment later, then
    // Redis frozen for 2 s (a long fork, a stalled disk) so replies time out. Each is
    // shorter than the 3 s lease, the bound inside which an owner's outcome must land; so
    // the freeze waits until the restarted Redis serves the load again (the servers have
    // reconnected: what the crash left pending can land) rather than a fixed time, which
    // on a loaded machine may not cover the restart and the reconnection.
    let faults = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        redis.stop();
        tokio::time::sleep(Duration::from_millis(400)).await;
        redis.restart().await;
        let restarted = SETTLED.load(std::sync::atomic::Ordering::Relaxed);
        let waited = tokio::time::Instant::now();
        while SETTLED.load(std::sync::atomic::Ordering::Relaxed) < restarted + IN_FLIGHT {
            assert!(
                waited.elapsed() < Duration::from_secs(30),
                "the load never flowed again after the restart"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        redis.pause();
        tokio::time::sleep(Duration::from_secs(2)).await;
        redis.resume();
        redis
    });

    let mut load = JoinSet::new();
    let mut started = 0;
    let mut done = Vec::new();
    let mut after_faults = None;
    loop {
        if after_faults.is_none() && faults.is_finished() {
            after_faults = Some(started + OPERATIONS / 4);
        }
        let more = after_faults.is_none_or(|last| started < last);
        while more && load.len() < IN_FLIGHT {
            load.spawn(run_operation(client.clone(), replicas, started));
            started += 1;
        }
        match load.join_next().await {
            Some(finished) => done.push(finished.unwrap()),
            None if !more => break,
            None => {}
        }
    }
    let _redis = faults.await.unwrap();
    assert_eq!(done.len(), started);
    let come_back = COME_BACK.load(std::sync::atomic::Ordering::Relaxed);
    let slowed = SLOWED.load(std::sync::atomic::Ordering::Relaxed);
    eprintln!(
        "{started} operations; {slowed} slowed by the faults; {come_back} answers asked a client to come back"
    );
    assert!(slowed > 0, "the faults hit no operation in flight");

    // Each operation's handler ran exactly once, and every retry now replays it.
    let runs = runs.lock().unwrap().clone();
    assert_eq!(runs.len(), started, "every operation ran");
    let twice: Vec<_> = runs.iter().filter(|(_, n)| **n != 1).collect();
    assert!(twice.is_empty(), "charged more than once: {twice:?}");
    for (key, body) in &done {
        assert!(
            std::str::from_utf8(body).unwrap().contains("\"run\":1"),
            "{key}: {body:?}"
        );
    }
    for n in [0, started / 3, started / 2, started - 1] {
        let (_, again) = run_operation(client.clone(), replicas, n).await;
        let first = &done
            .iter()
            .find(|(k, _)| *k == format!("\"op-{n}\""))
            .unwrap()
            .1;
        assert_eq!(&again, first, "operation {n} replays its one run");
    }
}
