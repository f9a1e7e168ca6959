//! `RedisStore` over a real local Redis Cluster: the conformance suite, round trips, two
//! client stacks through different nodes, a slot migrated under load, and a primary lost
//! to a failover.
//!
//! The tests start their own clusters (see `support/redis_cluster.rs`): one shared cluster
//! of three primaries for the tests that leave its topology alone (each with a key prefix
//! of its own), and a private one for each test that reshards, kills or counts commands.
//! Without `redis-server` and `redis-cli` they are skipped with a notice
//! (`REQUIRE_REDIS=1` makes that a failure).
#![cfg(all(feature = "redis-cluster", feature = "test-util"))]

#[path = "support/redis_cluster.rs"]
mod cluster_support;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode, Version};
use tower_idempotency::ledger::{
    Begin, BeginRequest, IdempotencyStore, LedgerKey, Outcome, RedisStore, StoredResponse,
};
use tower_idempotency::testing::conformance::{inspection_follows_the_record, run_all, Clock};
use tower_idempotency::FrozenRequest;

use cluster_support::RedisCluster;

const RETENTION: Duration = Duration::from_secs(600);
const LEASE: Duration = Duration::from_secs(30);

/// A prefix of its own per test, so tests sharing the cluster never meet.
fn unique_prefix() -> String {
    format!("idem-cluster-test:{:016x}:", fastrand::u64(..))
}

fn fresh_key() -> LedgerKey {
    let mut bytes = [0u8; 32];
    fastrand::fill(&mut bytes);
    LedgerKey::from_bytes(bytes)
}

fn frozen(body: &'static str) -> FrozenRequest {
    FrozenRequest::from_parts(
        Method::POST,
        "http://provider.local/charges".parse().unwrap(),
        Version::HTTP_11,
        HeaderMap::new(),
        Bytes::from_static(body.as_bytes()),
    )
}

fn request(key: LedgerKey, frozen: &FrozenRequest) -> BeginRequest {
    BeginRequest::new(key, frozen.fingerprint(), LEASE, RETENTION).with_frozen(frozen.clone())
}

fn response(body: &'static str) -> Outcome {
    Outcome::Response(StoredResponse::new(
        StatusCode::CREATED,
        Version::HTTP_11,
        HeaderMap::new(),
        Bytes::from_static(body.as_bytes()),
    ))
}

async fn connect(nodes: &[String], prefix: &str) -> RedisStore {
    RedisStore::cluster_builder(nodes.iter().cloned())
        .prefix(prefix)
        .connect()
        .await
        .expect("connect to the cluster")
}

fn assert_replay(begin: Begin, body: &[u8]) {
    match begin {
        Begin::Replay(Outcome::Response(stored)) => assert_eq!(stored.body().as_ref(), body),
        other => panic!("expected Replay, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_store_passes_the_conformance_suite() {
    let Some(cluster) = RedisCluster::shared().await else {
        return;
    };
    let store = connect(&cluster.urls(), &unique_prefix()).await;
    inspection_follows_the_record(&store).await;
    // Each node judges leases and retention by its own clock, so the suite sleeps for real.
    run_all(Arc::new(store), Clock::real()).await;
}

#[tokio::test]
async fn records_spread_over_every_primary_and_any_node_reaches_them() {
    let Some(cluster) = RedisCluster::shared().await else {
        return;
    };
    let prefix = unique_prefix();
    let urls = cluster.urls();
    // Two stores, each told of one node only: the client learns the rest of the cluster.
    let first = connect(&urls[..1], &prefix).await;
    let second = connect(&urls[1..2], &prefix).await;
    let req = frozen("{\"amount\":1}");
    let mut keys = Vec::new();
    for _ in 0..32 {
        let key = fresh_key();
        let Begin::Acquired { token } = first.begin(request(key, &req)).await.unwrap() else {
            panic!("expected Acquired")
        };
        first
            .complete(key, token, response("done"), RETENTION)
            .await
            .unwrap();
        keys.push(key);
    }
    for key in &keys {
        assert_replay(second.begin(request(*key, &req)).await.unwrap(), b"done");
    }
    // Each primary holds some of them: the records are sharded, not pinned to one slot.
    for node in cluster.nodes() {
        let held: usize = cluster_support::cli(node.port(), &["dbsize"])
            .trim()
            .parse()
            .unwrap();
        assert!(held > 0, "node {} holds no record", node.port());
    }
}

#[tokio::test]
async fn connecting_to_no_cluster_fails_closed_and_fast() {
    // A loopback port nobody listens on (bound, then released).
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let started = std::time::Instant::now();
    let err = RedisStore::cluster_builder([format!("redis://127.0.0.1:{port}/")])
        .connection_timeout(Duration::from_millis(200))
        .operation_timeout(Duration::from_millis(300))
        .connect()
        .await
        .unwrap_err();
    assert!(err.is_unavailable() || err.is_timeout(), "{err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "took {:?}",
        started.elapsed()
    );
}
