//! `RedisStore` over a real local Redis Cluster: the conformance suite, round trips and
//! latency against one Redis, two client stacks through different nodes, a slot migrated
//! under load, a frozen primary against the operation timeout, and primaries lost to
//! failovers.
//!
//! The tests start their own clusters (see `support/redis_cluster.rs`): one shared cluster
//! of three primaries for the tests that leave its topology alone (each with a key prefix
//! of its own), and a private one for each test that reshards, kills or counts commands.
//! Without `redis-server` and `redis-cli` they are skipped with a notice
//! (`REQUIRE_REDIS=1` makes that a failure).
#![cfg(all(feature = "redis-cluster", feature = "test-util"))]

use crate::support::redis_cluster as cluster_support;

use crate::support::redis as redis_support;

use crate::support::orders;

use crate::support::capture;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode, Version};
use http_body_util::BodyExt;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::client::ClientFace;
use tower_idempotency::idempotency::Idempotency;
use tower_idempotency::ledger::{
    Begin, BeginRequest, IdempotencyStore, LedgerKey, ListQuery, Outcome, RecordKind, RedisStore,
    StoreError, StoredResponse,
};
use tower_idempotency::retry::FrozenRetry;
use tower_idempotency::testing::conformance::{
    inspection_follows_the_record, listing_finds_what_it_asks_for, run_all, Clock,
};
use tower_idempotency::testing::SideEffectService;
use tower_idempotency::ProviderKeys;
use tower_idempotency::{FrozenRequest, FrozenRetryLayer, IdempotencyLayer, KeyHeader};

use orders::{fast_policy, post};

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

/// A new operation of `req` begun and completed with `body`: its key.
async fn record_fresh(store: &RedisStore, req: &FrozenRequest, body: &'static str) -> LedgerKey {
    let key = fresh_key();
    let Begin::Acquired { token } = store.begin(request(key, req)).await.unwrap() else {
        panic!("expected Acquired")
    };
    store
        .complete(key, token, response(body), RETENTION)
        .await
        .unwrap();
    key
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
    run_all(Arc::new(store.clone()), Clock::real()).await;
    listing_finds_what_it_asks_for(&store, &Clock::real()).await;
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
        let key = record_fresh(&first, &req, "done").await;
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

/// `INFO commandstats` of one node, as `command -> calls`.
fn command_calls(port: u16) -> HashMap<String, u64> {
    cluster_support::cli(port, &["info", "commandstats"])
        .lines()
        .filter_map(|line| line.strip_prefix("cmdstat_"))
        .filter_map(|line| {
            let (name, fields) = line.split_once(':')?;
            let calls = fields.split(',').find_map(|kv| kv.strip_prefix("calls="))?;
            Some((name.to_owned(), calls.trim().parse().ok()?))
        })
        .collect()
}

/// The commands that reached the cluster from the store since the last reset, summed over
/// every node: everything but what the scripts run inside Redis and the test's own `INFO`.
fn store_commands(cluster: &RedisCluster) -> Vec<(String, u64)> {
    // What the scripts call (the record's fields, and its bucket's listing indexes).
    const INSIDE_SCRIPTS: [&str; 13] = [
        "hmget", "hget", "exists", "time", "hset", "hdel", "hincrby", "pexpire", "del", "zadd",
        "zrem", "zrange", "zcount",
    ];
    let mut total: HashMap<String, u64> = HashMap::new();
    for node in cluster.nodes() {
        for (name, calls) in command_calls(node.port()) {
            if !INSIDE_SCRIPTS.contains(&name.as_str())
                && name != "info"
                && name != "config|resetstat"
            {
                *total.entry(name).or_default() += calls;
            }
        }
    }
    let mut sorted: Vec<_> = total.into_iter().collect();
    sorted.sort();
    sorted
}

fn reset_stats(cluster: &RedisCluster) {
    for node in cluster.nodes() {
        cluster_support::cli(node.port(), &["config", "resetstat"]);
    }
}

/// Hole 13, on a cluster: persistence is per node, so each node that would forget the
/// ledger on a restart is named, and only those.
#[tokio::test(flavor = "current_thread")]
async fn connecting_warns_for_each_node_that_keeps_no_record_across_a_restart() {
    // A private cluster: the test changes its nodes' configuration. Its nodes start with
    // `save ""` and `appendonly no`.
    let Some(cluster) = RedisCluster::spawn(3, 0).await else {
        return;
    };
    let ports: Vec<u16> = cluster.nodes().iter().map(|node| node.port()).collect();
    let named = |logged: &str, port: u16| logged.contains(&format!("127.0.0.1:{port}"));
    let (logs, _default) = capture::warnings();

    connect(&cluster.urls(), "idem:").await;
    let logged = logs.text();
    assert_eq!(
        logged.matches("keeps no record across a restart").count(),
        3,
        "{logged}"
    );
    assert!(ports.iter().all(|port| named(&logged, *port)), "{logged}");

    // The first node logs its writes now: the two others are still named.
    let reply = cluster_support::cli(ports[0], &["config", "set", "appendonly", "yes"]);
    assert_eq!(reply.trim(), "OK");
    logs.clear();
    connect(&cluster.urls(), "idem:").await;
    let logged = logs.text();
    assert_eq!(
        logged.matches("keeps no record across a restart").count(),
        2,
        "{logged}"
    );
    assert!(!named(&logged, ports[0]), "{logged}");
    assert!(
        named(&logged, ports[1]) && named(&logged, ports[2]),
        "{logged}"
    );

    for port in &ports[1..] {
        let reply = cluster_support::cli(*port, &["config", "set", "appendonly", "yes"]);
        assert_eq!(reply.trim(), "OK");
    }
    logs.clear();
    connect(&cluster.urls(), "idem:").await;
    assert!(logs.text().is_empty(), "{}", logs.text());
}

#[tokio::test]
async fn one_round_trip_per_ledger_operation_on_the_cluster() {
    // A private cluster: anyone else's commands would spoil the counts.
    let Some(cluster) = RedisCluster::spawn(3, 0).await else {
        return;
    };
    let store = connect(&cluster.urls(), "idem:").await;
    let req = frozen("{\"amount\":1}");

    // Warm up on keys of every primary: connections made, scripts cached, slot map known.
    let mut keys = Vec::new();
    for _ in 0..12 {
        let key = record_fresh(&store, &req, "warm").await;
        keys.push(key);
    }

    // Fresh operations: begin + complete = two EVALSHA each, sent straight to the key's
    // primary (no redirect, no topology query).
    reset_stats(&cluster);
    for _ in 0..10 {
        record_fresh(&store, &req, "done").await;
    }
    let fresh = store_commands(&cluster);
    eprintln!("10 fresh operations: {fresh:?}");
    assert_eq!(fresh, [("evalsha".to_owned(), 20)], "fresh: {fresh:?}");

    // Replays: one EVALSHA each.
    reset_stats(&cluster);
    for key in &keys[..10] {
        assert_replay(store.begin(request(*key, &req)).await.unwrap(), b"warm");
    }
    let replays = store_commands(&cluster);
    eprintln!("10 replays: {replays:?}");
    assert_eq!(
        replays,
        [("evalsha".to_owned(), 10)],
        "replays: {replays:?}"
    );
}

type Stack = Idempotency<FrozenRetry<SideEffectService>, ClientFace>;

/// A client stack as an orchestrator builds it, over `store`, calling `provider`.
fn client_stack(store: RedisStore, provider: &SideEffectService) -> Stack {
    ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            store,
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .layer(FrozenRetryLayer::new(fast_policy(Duration::from_secs(5))))
        .service(provider.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_identical_operations_from_two_stacks_on_different_nodes_fire_one_effect() {
    let Some(cluster) = RedisCluster::shared().await else {
        return;
    };
    let prefix = unique_prefix();
    let urls = cluster.urls();
    // Each stack knows the cluster through a different node.
    let stacks = [
        client_stack(connect(&urls[..1], &prefix).await, &PROVIDER),
        client_stack(connect(&urls[1..2], &prefix).await, &PROVIDER),
    ];
    let barrier = Arc::new(tokio::sync::Barrier::new(64));
    let callers: Vec<_> = (0..64)
        .map(|i| {
            let (stack, barrier) = (stacks[i % 2].clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let response = stack.oneshot(post(BODY)).await.unwrap();
                let status = response.status();
                let body = response.into_body().collect().await.unwrap().to_bytes();
                (status, body)
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for caller in callers {
        outcomes.push(caller.await.unwrap());
    }
    // The provider does not dedupe (keys not honoured): only the ledger stands between
    // 64 callers and 64 charges.
    assert_eq!(
        PROVIDER.effects(),
        1,
        "one effect for 64 identical operations"
    );
    assert_eq!(
        PROVIDER.calls(),
        1,
        "the other 63 never reached the provider"
    );
    assert_eq!(outcomes[0].0, StatusCode::CREATED);
    assert!(
        outcomes.iter().all(|outcome| outcome == &outcomes[0]),
        "every caller got the one outcome"
    );
}

/// The provider of the 64-caller test: slow enough that the callers overlap, and naive
/// (it would charge again for the same key).
static PROVIDER: LazyLock<SideEffectService> = LazyLock::new(|| {
    SideEffectService::builder()
        .honour_keys(false)
        .latency(Duration::from_millis(150))
        .build()
});

const BODY: &str = r#"{"order_id":"ord_8f21c3","total_cents":184200}"#;

/// The id of the node on `port`.
fn node_id(port: u16) -> String {
    cluster_support::cli(port, &["cluster", "myid"])
        .trim()
        .to_owned()
}

/// One operation run to the end: claimed, completed, then replayed.
async fn fresh_operation(store: &RedisStore, key: LedgerKey) -> Result<(), StoreError> {
    let req = frozen("{\"amount\":7}");
    let Begin::Acquired { token } = store.begin(request(key, &req)).await? else {
        panic!("a fresh key was not acquired")
    };
    tokio::time::sleep(Duration::from_millis(2)).await;
    store
        .complete(key, token, response("charged"), RETENTION)
        .await?;
    assert_replay(store.begin(request(key, &req)).await?, b"charged");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_migrated_under_load_loses_nothing() {
    let Some(cluster) = RedisCluster::spawn(3, 0).await else {
        return;
    };
    // A hash tag in the prefix puts every record of this store in one slot: the one the
    // test migrates (the store warns about such prefixes; here it is the point).
    let prefix = "{migrating}:idem:";
    let store = connect(&cluster.urls(), prefix).await;
    let any = cluster.nodes()[0].port();
    let slot = cluster_support::cli(any, &["cluster", "keyslot", "{migrating}"])
        .trim()
        .to_owned();

    // Records settled before the migration: each must survive it.
    let mut before = Vec::new();
    for _ in 0..40 {
        let key = fresh_key();
        fresh_operation(&store, key).await.unwrap();
        before.push(key);
    }
    let owner = cluster
        .nodes()
        .iter()
        .map(|node| node.port())
        .find(|port| {
            cluster_support::cli(*port, &["cluster", "countkeysinslot", &slot]).trim() != "0"
        })
        .expect("a node holds the slot's records");
    let target = cluster
        .nodes()
        .iter()
        .map(|node| node.port())
        .find(|port| *port != owner)
        .unwrap();

    // Load: operations start, settle and replay on the migrating slot all along.
    let done = Arc::new(AtomicBool::new(false));
    let mut load = tokio::task::JoinSet::new();
    for _ in 0..4 {
        let (store, done) = (store.clone(), done.clone());
        load.spawn(async move {
            let mut settled = Vec::new();
            while !done.load(Ordering::Relaxed) {
                let key = fresh_key();
                fresh_operation(&store, key).await?;
                settled.push(key);
            }
            Ok::<_, StoreError>(settled)
        });
    }

    // The migration, as `redis-cli --cluster reshard` does it, a few keys at a time.
    let (owner_id, target_id) = (node_id(owner), node_id(target));
    cluster_support::cli(
        target,
        &["cluster", "setslot", &slot, "importing", &owner_id],
    );
    cluster_support::cli(
        owner,
        &["cluster", "setslot", &slot, "migrating", &target_id],
    );
    let mut batches = 0;
    loop {
        let keys = cluster_support::cli(owner, &["cluster", "getkeysinslot", &slot, "5"]);
        let keys: Vec<&str> = keys.lines().filter(|key| !key.is_empty()).collect();
        if keys.is_empty() {
            break;
        }
        let port = target.to_string();
        let mut migrate = vec!["migrate", "127.0.0.1", &port, "", "0", "5000", "keys"];
        migrate.extend(keys);
        let reply = cluster_support::cli(owner, &migrate);
        assert!(
            reply.trim() == "OK" || reply.trim() == "NOKEY",
            "MIGRATE: {reply}"
        );
        batches += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The new owner first, then the old one, then the rest, as `CLUSTER SETSLOT`'s
    // documentation orders it (and `redis-cli --cluster reshard` does): told the other way
    // round, the old owner redirects to a node still importing, which redirects back
    // (`MOVED` both ways) until it is told, and a client's retries can run out in between.
    let others = cluster
        .nodes()
        .iter()
        .map(|node| node.port())
        .filter(|port| *port != target && *port != owner);
    for port in [target, owner].into_iter().chain(others) {
        cluster_support::cli(port, &["cluster", "setslot", &slot, "node", &target_id]);
    }
    // Keep the load on a little while the clients learn the new owner (MOVED).
    tokio::time::sleep(Duration::from_millis(100)).await;
    done.store(true, Ordering::Relaxed);
    let mut during = Vec::new();
    while let Some(worker) = load.join_next().await {
        during.extend(
            worker
                .unwrap()
                .expect("no store error during the migration"),
        );
    }
    let asked = command_calls(target).get("asking").copied().unwrap_or(0);
    eprintln!(
        "migrated slot {slot} from {owner} to {target} in {batches} batches; {} operations \
         under load, {asked} ASK redirects followed",
        during.len()
    );
    assert!(
        asked > 0,
        "the load met the migration: some operations were redirected with ASK"
    );

    // Nothing lost: every operation settled before or during the migration replays, now
    // from the new owner.
    let req = frozen("{\"amount\":7}");
    for key in before.iter().chain(&during) {
        assert_replay(store.begin(request(*key, &req)).await.unwrap(), b"charged");
    }
    // Every record, and its bucket's indexes, on the new owner (the tagged prefix put the
    // sixteen buckets in the one slot).
    let moved = cluster_support::cli(target, &["cluster", "countkeysinslot", &slot]);
    let moved: Vec<String> =
        cluster_support::cli(target, &["cluster", "getkeysinslot", &slot, moved.trim()])
            .lines()
            .filter(|key| !key.contains("index:") && !key.ends_with("layout"))
            .map(str::to_owned)
            .collect();
    assert_eq!(
        moved.len(),
        before.len() + during.len(),
        "every record is on the new owner"
    );
    let page = store.list(ListQuery::new().limit(1000)).await.unwrap();
    assert_eq!(
        page.records.len(),
        before.len() + during.len(),
        "and listed from there"
    );
}

/// `field:value` of `INFO <section>` on `port`.
fn info_field(port: u16, section: &str, field: &str) -> Option<String> {
    cluster_support::cli(port, &["info", section])
        .lines()
        .find_map(|line| line.strip_prefix(&format!("{field}:")).map(str::to_owned))
}

/// Wait until the replica on `replica` has everything its primary on `primary` wrote.
async fn wait_until_replicated(primary: u16, replica: u16) {
    let offset = |port, field| {
        info_field(port, "replication", field)
            .and_then(|value| value.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    let written = offset(primary, "master_repl_offset");
    for _ in 0..200 {
        if offset(replica, "slave_repl_offset") >= written {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the replica on {replica} did not catch up with {primary}");
}

/// The primary holding `slot` (asked of `from`) and its replica.
fn owner_and_replica(cluster: &RedisCluster, slot: &str, from: u16) -> (u16, u16) {
    let owner = cluster
        .primaries(from)
        .into_iter()
        .find(|port| {
            cluster_support::cli(*port, &["cluster", "countkeysinslot", slot]).trim() != "0"
        })
        .expect("a primary holds the slot's records");
    let replica = cluster
        .replica_of(owner, from)
        .expect("the primary has a replica");
    (owner, replica)
}

/// A store whose records all share one slot (the hash tag in the prefix), so one primary
/// and its replica hold them all; and that slot.
async fn store_on_one_slot(cluster: &RedisCluster, tag: &str) -> (RedisStore, String) {
    let store = connect(&cluster.urls(), &format!("{{{tag}}}:idem:")).await;
    let any = cluster.nodes()[0].port();
    let slot = cluster_support::cli(any, &["cluster", "keyslot", &format!("{{{tag}}}")])
        .trim()
        .to_owned();
    (store, slot)
}

/// Settle `n` fresh operations; their keys.
async fn settle(store: &RedisStore, n: usize) -> Vec<LedgerKey> {
    let mut keys = Vec::with_capacity(n);
    for _ in 0..n {
        let key = fresh_key();
        fresh_operation(store, key).await.unwrap();
        keys.push(key);
    }
    keys
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinated_failover_under_load_loses_nothing() {
    let Some(cluster) = RedisCluster::spawn(3, 1).await else {
        return;
    };
    let (store, slot) = store_on_one_slot(&cluster, "coordinated").await;
    let before = settle(&store, 20).await;
    let any = cluster.nodes()[0].port();
    let (primary, replica) = owner_and_replica(&cluster, &slot, any);

    let done = Arc::new(AtomicBool::new(false));
    let mut load = tokio::task::JoinSet::new();
    for _ in 0..4 {
        let (store, done) = (store.clone(), done.clone());
        load.spawn(async move {
            let (mut settled, mut refused) = (Vec::new(), 0);
            while !done.load(Ordering::Relaxed) {
                let key = fresh_key();
                match fresh_operation(&store, key).await {
                    Ok(()) => settled.push(key),
                    // Fail closed while the roles switch: an error, never a wrong answer.
                    Err(err) if err.is_unavailable() || err.is_timeout() => refused += 1,
                    Err(err) => panic!("unexpected error during the failover: {err:?}"),
                }
            }
            (settled, refused)
        });
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    // A manual failover: the primary stops taking writes, the replica catches up, then
    // takes over. Asked of the replica, as an operator (or an orchestrator) does.
    let started = std::time::Instant::now();
    let reply = cluster_support::cli(replica, &["cluster", "failover"]);
    assert_eq!(reply.trim(), "OK", "CLUSTER FAILOVER: {reply}");
    while !cluster.primaries(replica).contains(&replica) {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the replica on {replica} was never promoted"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let switched = started.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await;
    done.store(true, Ordering::Relaxed);
    let (mut during, mut refused) = (Vec::new(), 0);
    while let Some(worker) = load.join_next().await {
        let (settled, errors) = worker.unwrap();
        during.extend(settled);
        refused += errors;
    }
    eprintln!(
        "coordinated failover of {primary} to {replica} in {switched:?}: {} operations \
         settled under load, {refused} refused while the roles switched",
        during.len()
    );
    let req = frozen("{\"amount\":7}");
    for key in before.iter().chain(&during) {
        assert_replay(store.begin(request(*key, &req)).await.unwrap(), b"charged");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_lost_before_its_replica_caught_up_loses_what_was_not_replicated() {
    let Some(mut cluster) = RedisCluster::spawn(3, 1).await else {
        return;
    };
    let (store, slot) = store_on_one_slot(&cluster, "lost").await;
    let replicated = settle(&store, 20).await;
    let any = cluster.nodes()[0].port();
    let (primary, replica) = owner_and_replica(&cluster, &slot, any);
    wait_until_replicated(primary, replica).await;

    // The replica falls behind: frozen, and its replication link dropped, so nothing the
    // primary acknowledges from now on reaches it.
    cluster.pause(replica);
    cluster_support::cli(primary, &["client", "kill", "type", "replica"]);

    // With `min-replicas-to-write 1` the primary refuses writes it cannot replicate: the
    // store fails closed, no claim is handed out, no side effect can fire.
    cluster_support::cli(primary, &["config", "set", "min-replicas-to-write", "1"]);
    let req = frozen("{\"amount\":7}");
    let refused = store.begin(request(fresh_key(), &req)).await;
    match &refused {
        Err(err) => assert!(err.is_unavailable(), "{err:?}"),
        Ok(begin) => panic!("an unreplicated claim was handed out: {begin:?}"),
    }

    // Without it (the default), the primary acknowledges what only it holds.
    cluster_support::cli(primary, &["config", "set", "min-replicas-to-write", "0"]);
    let unreplicated = settle(&store, 20).await;

    // The primary dies; the replica, back, is promoted without waiting for it.
    let killed = std::time::Instant::now();
    cluster.kill(primary);
    cluster.resume(replica);
    let reply = cluster_support::cli(replica, &["cluster", "failover", "takeover"]);
    assert_eq!(reply.trim(), "OK", "CLUSTER FAILOVER TAKEOVER: {reply}");

    // The same store finds the new primary by itself; until then it fails closed.
    let mut failed_closed = 0;
    loop {
        match store.begin(request(replicated[0], &req)).await {
            Ok(begin) => {
                assert_replay(begin, b"charged");
                break;
            }
            Err(err) => {
                assert!(err.is_unavailable() || err.is_timeout(), "{err:?}");
                failed_closed += 1;
                assert!(
                    killed.elapsed() < Duration::from_secs(15),
                    "the store never found the promoted replica"
                );
            }
        }
    }
    let recovered = killed.elapsed();

    // What was replicated survived; what the primary alone held is gone: its operations
    // read as never seen, and a retry of one would run it again.
    for key in &replicated {
        assert_replay(store.begin(request(*key, &req)).await.unwrap(), b"charged");
    }
    let mut lost = 0;
    for key in &unreplicated {
        if store.inspect(*key).await.unwrap().is_none() {
            lost += 1;
        }
    }
    eprintln!(
        "primary {primary} killed, replica {replica} promoted: the store answered again after \
         {recovered:?} ({failed_closed} calls failed closed meanwhile); {} of {} replicated \
         operations kept, {lost} of {} acknowledged but unreplicated operations lost",
        replicated.len(),
        replicated.len(),
        unreplicated.len()
    );
    assert_eq!(
        lost,
        unreplicated.len(),
        "asynchronous replication: every acknowledged write the replica never received is lost"
    );
}

/// The median and the 99th percentile of `samples`.
fn percentiles(mut samples: Vec<Duration>) -> (Duration, Duration) {
    samples.sort();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

/// Per-operation latency of `store`: `n` fresh operations (begin + complete), then a replay
/// of each.
async fn latencies(store: &RedisStore, n: usize) -> [(Duration, Duration); 2] {
    let req = frozen("{\"amount\":1}");
    let (mut fresh, mut replay, mut keys) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..n {
        let started = std::time::Instant::now();
        let key = record_fresh(store, &req, "done").await;
        fresh.push(started.elapsed());
        keys.push(key);
    }
    for key in keys {
        let started = std::time::Instant::now();
        assert_replay(store.begin(request(key, &req)).await.unwrap(), b"done");
        replay.push(started.elapsed());
    }
    [percentiles(fresh), percentiles(replay)]
}

#[tokio::test]
async fn an_operation_on_the_cluster_costs_what_it_costs_on_one_redis() {
    // Both in one run, on the same machine: one private single-node Redis, one private
    // cluster, the same operations, one after the other.
    let Some(single) = redis_support::RedisServer::spawn().await else {
        return;
    };
    let Some(cluster) = RedisCluster::spawn(3, 0).await else {
        return;
    };
    let single_store = RedisStore::builder(single.url())
        .prefix(unique_prefix())
        .connect()
        .await
        .unwrap();
    let cluster_store = connect(&cluster.urls(), &unique_prefix()).await;
    // Warm both up (connections, slot map), then measure.
    latencies(&single_store, 20).await;
    latencies(&cluster_store, 20).await;
    let n = 300;
    let [single_fresh, single_replay] = latencies(&single_store, n).await;
    let [cluster_fresh, cluster_replay] = latencies(&cluster_store, n).await;
    eprintln!(
        "{n} operations each (median / p99): fresh single {:?} / {:?}, cluster {:?} / {:?}; \
         replay single {:?} / {:?}, cluster {:?} / {:?}",
        single_fresh.0,
        single_fresh.1,
        cluster_fresh.0,
        cluster_fresh.1,
        single_replay.0,
        single_replay.1,
        cluster_replay.0,
        cluster_replay.1
    );
    // The same round trips (two, one), straight to the key's primary: no more than the
    // cluster client's own bookkeeping on top. Loose bounds: the machine is shared.
    let slack = Duration::from_millis(1);
    assert!(
        cluster_fresh.0 <= single_fresh.0 * 2 + slack,
        "fresh: cluster {cluster_fresh:?} against single {single_fresh:?}"
    );
    assert!(
        cluster_replay.0 <= single_replay.0 * 2 + slack,
        "replay: cluster {cluster_replay:?} against single {single_replay:?}"
    );
}

#[tokio::test]
async fn a_frozen_primary_trips_the_operation_timeout_and_the_same_store_recovers() {
    let Some(cluster) = RedisCluster::spawn(3, 0).await else {
        return;
    };
    let store = RedisStore::cluster_builder(cluster.urls())
        .prefix("{frozen}:idem:")
        .operation_timeout(Duration::from_millis(300))
        .connect()
        .await
        .unwrap();
    let settled = settle(&store, 1).await;
    let slot = cluster_support::cli(
        cluster.nodes()[0].port(),
        &["cluster", "keyslot", "{frozen}"],
    )
    .trim()
    .to_owned();
    let owner = cluster
        .nodes()
        .iter()
        .map(|node| node.port())
        .find(|port| {
            cluster_support::cli(*port, &["cluster", "countkeysinslot", &slot]).trim() != "0"
        })
        .unwrap();

    // Frozen: connections stay open, nothing is answered. Each call gives up at the
    // operation timeout, closed: an error, never a claim.
    cluster.pause(owner);
    let req = frozen("{\"amount\":7}");
    for _ in 0..3 {
        let started = std::time::Instant::now();
        match store.begin(request(fresh_key(), &req)).await {
            Err(err) => assert!(err.is_timeout() || err.is_unavailable(), "{err:?}"),
            Ok(begin) => panic!("answered {begin:?} while the slot's primary was frozen"),
        }
        assert!(
            started.elapsed() < Duration::from_millis(800),
            "took {:?}",
            started.elapsed()
        );
    }

    // Back: the same store works again, and what was settled is still there.
    cluster.resume(owner);
    let started = std::time::Instant::now();
    loop {
        match store.begin(request(settled[0], &req)).await {
            Ok(begin) => {
                assert_replay(begin, b"charged");
                break;
            }
            Err(_) if started.elapsed() < Duration::from_secs(10) => {}
            Err(err) => panic!("the store did not recover: {err:?}"),
        }
    }
    fresh_operation(&store, fresh_key()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_store_shows_the_frozen_request_it_keeps() {
    let Some(cluster) = RedisCluster::shared().await else {
        return;
    };
    let store = connect(&cluster.urls(), &unique_prefix()).await;
    assert!(
        tower_idempotency::testing::conformance::inspection_shows_the_frozen_request(&store).await,
        "the Redis Cluster store shows a record's frozen request in doubt"
    );
}

/// The primary of the shared cluster that holds `redis_key`: the one that answers for it
/// instead of redirecting.
fn holder(cluster: &RedisCluster, redis_key: &str) -> u16 {
    cluster
        .nodes()
        .iter()
        .map(|node| node.port())
        .find(|port| cluster_support::cli(*port, &["exists", redis_key]).trim() == "1")
        .unwrap_or_else(|| panic!("no node holds {redis_key}"))
}

#[tokio::test]
async fn a_list_pages_through_records_held_by_every_primary() {
    let Some(cluster) = RedisCluster::shared().await else {
        return;
    };
    let store = connect(&cluster.urls(), &unique_prefix()).await;
    let scope = format!("paging-{:016x}", fastrand::u64(..));
    // Forty records of one scope, one state in three each; claimed a millisecond or more
    // apart, so the order by claim time is the order made.
    let mut made = Vec::new();
    for i in 0..40 {
        let key = fresh_key();
        let req = frozen("{\"amount\":7}");
        let Begin::Acquired { token } = store
            .begin(request(key, &req).with_scope(&scope))
            .await
            .unwrap()
        else {
            panic!("a fresh key is acquired")
        };
        match i % 3 {
            0 => store.mark_in_doubt(key, token, RETENTION).await.unwrap(),
            1 => store
                .complete(key, token, response("done"), RETENTION)
                .await
                .unwrap(),
            _ => {}
        }
        made.push(key);
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let holders: std::collections::HashSet<u16> = made
        .iter()
        .map(|key| holder(cluster, &store.redis_key(key)))
        .collect();
    assert_eq!(holders.len(), 3, "the records sit on every primary");

    for (query, expected) in [
        (
            ListQuery::new().scope(&scope).limit(7),
            made.iter().rev().copied().collect::<Vec<_>>(),
        ),
        (
            ListQuery::new().scope(&scope).limit(3).oldest_first(),
            made.clone(),
        ),
        (
            ListQuery::new()
                .scope(&scope)
                .kind(RecordKind::InDoubt)
                .limit(4),
            made.iter()
                .enumerate()
                .rev()
                .filter(|(i, _)| i % 3 == 0)
                .map(|(_, key)| *key)
                .collect(),
        ),
    ] {
        let mut listed = Vec::new();
        let mut query = query;
        let mut pages = 0;
        loop {
            let page = store.list(query.clone()).await.unwrap();
            assert!(page.records.len() <= query.page_limit());
            pages += 1;
            assert!(pages < 100, "the list ends");
            listed.extend(page.records.iter().map(|record| record.key));
            match page.next {
                Some(cursor) => query = query.after(cursor),
                None => break,
            }
        }
        assert_eq!(listed, expected, "every record once, in order");
    }
}

/// A cluster ledger of an earlier release kept its records at `<prefix><64 hex>`, without
/// a bucket's hash tag: after the upgrade they are found where they are (a completed one
/// replays, one in doubt resumes with its frozen bytes and completes in place), no record
/// is made there again, and once they are gone a store that connects stops asking there.
#[tokio::test]
async fn records_of_the_earlier_untagged_layout_are_found_after_the_upgrade() {
    let Some(cluster) = RedisCluster::shared().await else {
        return;
    };
    let prefix = unique_prefix();
    let store = connect(&cluster.urls(), &prefix).await;
    let req = frozen("{\"amount\":8}");
    let completed = record_fresh(&store, &req, "charged").await;
    let in_doubt = fresh_key();
    let Begin::Acquired { token } = store.begin(request(in_doubt, &req)).await.unwrap() else {
        panic!("a fresh key is acquired")
    };
    store
        .mark_in_doubt(in_doubt, token, RETENTION)
        .await
        .unwrap();

    // Move both records to the earlier layout's keys, byte for byte (DUMP and RESTORE, TTL
    // kept), and forget that the ledger was ever checked for such keys.
    let mut admin = ::redis::cluster::ClusterClient::new(cluster.urls())
        .unwrap()
        .get_async_connection()
        .await
        .unwrap();
    for key in [completed, in_doubt] {
        move_to_the_earlier_layout(&mut admin, &store, &prefix, key).await;
    }
    let marker_keys: Vec<String> = cluster_support::cli(cluster.nodes()[0].port(), &["--scan"])
        .lines()
        .chain(cluster_support::cli(cluster.nodes()[1].port(), &["--scan"]).lines())
        .chain(cluster_support::cli(cluster.nodes()[2].port(), &["--scan"]).lines())
        .filter(|key| key.starts_with(&prefix) && key.ends_with("layout"))
        .map(str::to_owned)
        .collect();
    assert_eq!(marker_keys.len(), 1, "the first store marked the ledger");
    let () = ::redis::cmd("DEL")
        .arg(&marker_keys[0])
        .query_async(&mut admin)
        .await
        .unwrap();

    // The upgraded store finds both where the earlier release left them.
    let upgraded = connect(&cluster.urls(), &prefix).await;
    assert_replay(
        upgraded.begin(request(completed, &req)).await.unwrap(),
        b"charged",
    );
    let view = upgraded.inspect(in_doubt).await.unwrap().expect("found");
    assert_eq!(view.state, tower_idempotency::ledger::RecordState::InDoubt);
    let token = match upgraded.begin(request(in_doubt, &req)).await.unwrap() {
        Begin::Resume { token, frozen } => {
            assert_eq!(frozen.expect("frozen bytes").body(), req.body());
            token
        }
        other => panic!("expected Resume, got {other:?}"),
    };
    upgraded
        .complete(in_doubt, token, response("resumed"), RETENTION)
        .await
        .unwrap();
    assert_replay(
        upgraded.begin(request(in_doubt, &req)).await.unwrap(),
        b"resumed",
    );
    assert_eq!(
        cluster_support::cli(
            holder(cluster, &format!("{prefix}{}", in_doubt.to_hex())),
            &["hget", &format!("{prefix}{}", in_doubt.to_hex()), "state"]
        )
        .trim(),
        "completed",
        "completed where it was"
    );
    // A new operation is claimed where this release keeps records, never at the old key.
    let fresh = record_fresh(&upgraded, &req, "new").await;
    holder(cluster, &upgraded.redis_key(&fresh));
    let old_fresh = format!("{prefix}{}", fresh.to_hex());
    for node in cluster.nodes() {
        assert_ne!(
            cluster_support::cli(node.port(), &["exists", &old_fresh]).trim(),
            "1"
        );
    }

    // Once the old records are gone, a store that connects marks the ledger again (and
    // stops asking the old keys).
    for key in [completed, in_doubt] {
        let () = ::redis::cmd("DEL")
            .arg(format!("{prefix}{}", key.to_hex()))
            .query_async(&mut admin)
            .await
            .unwrap();
    }
    let later = connect(&cluster.urls(), &prefix).await;
    let marker: Option<String> = ::redis::cmd("GET")
        .arg(&marker_keys[0])
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(marker.is_some(), "the ledger is marked again");
    assert!(matches!(
        later.begin(request(completed, &req)).await.unwrap(),
        Begin::Acquired { .. }
    ));
}

/// `EVALSHA`s since the last reset, summed over every node: Redis's own microseconds and
/// the calls; and every other command's calls (what the scripts ran inside).
fn script_stats(cluster: &RedisCluster) -> (f64, u64, HashMap<String, u64>) {
    let (mut usec, mut calls, mut inside) = (0.0, 0, HashMap::new());
    for node in cluster.nodes() {
        for line in cluster_support::cli(node.port(), &["info", "commandstats"]).lines() {
            let Some((name, fields)) = line
                .strip_prefix("cmdstat_")
                .and_then(|line| line.split_once(':'))
            else {
                continue;
            };
            let field = |key: &str| {
                fields
                    .split(',')
                    .find_map(|kv| kv.strip_prefix(key))
                    .and_then(|v| v.trim().parse::<f64>().ok())
                    .unwrap_or(0.0)
            };
            if name == "evalsha" {
                usec += field("usec=");
                calls += field("calls=") as u64;
            } else if name != "info" && name != "config|resetstat" {
                *inside.entry(name.to_owned()).or_default() += field("calls=") as u64;
            }
        }
    }
    (usec, calls, inside)
}

/// What the per-bucket listing indexes cost on a cluster: Redis's own time per claim and
/// per completion (`INFO commandstats` of every node) with the indexes and without them
/// (the same scripts on the record's key alone, as earlier releases ran them on a
/// cluster), in alternating rounds; the commands the scripts ran inside; and the wall time
/// of a `begin` + `complete` each way. A measurement, not a check: run with
/// `cargo test --all-features --test ledger what_the_bucket -- --ignored --nocapture`.
#[tokio::test]
#[ignore = "a measurement: run with --ignored --nocapture"]
async fn what_the_bucket_indexes_cost() {
    const ROUNDS: usize = 10;
    const PER_ROUND: usize = 300;
    let Some(cluster) = RedisCluster::spawn(3, 0).await else {
        return;
    };
    let store = connect(&cluster.urls(), "idem:").await;
    let mut admin = ::redis::cluster::ClusterClient::new(cluster.urls())
        .unwrap()
        .get_async_connection()
        .await
        .unwrap();
    let unindexed = super::redis_store::Unindexed::new();
    let req = frozen("{\"amount\":1}");
    // (Redis µs, calls) of claims and completions, with the index then without; wall time
    // of whole operations each way; the commands run inside the indexed scripts.
    let (mut with, mut without) = ([(0.0, 0u64); 2], [(0.0, 0u64); 2]);
    let (mut wall_with, mut wall_without) = (Duration::ZERO, Duration::ZERO);
    let mut inside_with: HashMap<String, u64> = HashMap::new();
    for round in 0..ROUNDS {
        let keys: Vec<LedgerKey> = (0..PER_ROUND).map(|_| fresh_key()).collect();
        let mut tokens = Vec::new();
        reset_stats(&cluster);
        let started = std::time::Instant::now();
        for key in &keys {
            let Begin::Acquired { token } = store.begin(request(*key, &req)).await.unwrap() else {
                panic!("expected Acquired")
            };
            tokens.push(token);
        }
        let claims_took = started.elapsed();
        let (usec, calls, inside) = script_stats(&cluster);
        with[0].0 += usec;
        with[0].1 += calls;
        for (name, n) in inside {
            *inside_with.entry(name).or_default() += n;
        }
        reset_stats(&cluster);
        let started = std::time::Instant::now();
        for (key, token) in keys.iter().zip(tokens) {
            store
                .complete(*key, token, response("done"), RETENTION)
                .await
                .unwrap();
        }
        wall_with += claims_took + started.elapsed();
        let (usec, calls, inside) = script_stats(&cluster);
        with[1].0 += usec;
        with[1].1 += calls;
        for (name, n) in inside {
            *inside_with.entry(name).or_default() += n;
        }

        let plain: Vec<String> = (0..PER_ROUND)
            .map(|i| format!("unindexed:{round}:{i:064}"))
            .collect();
        reset_stats(&cluster);
        let started = std::time::Instant::now();
        for key in &plain {
            unindexed.claim(&mut admin, key, &req).await;
        }
        let claims_took = started.elapsed();
        let (usec, calls, _) = script_stats(&cluster);
        without[0].0 += usec;
        without[0].1 += calls;
        reset_stats(&cluster);
        let started = std::time::Instant::now();
        for key in &plain {
            unindexed.complete(&mut admin, key).await;
        }
        wall_without += claims_took + started.elapsed();
        let (usec, calls, _) = script_stats(&cluster);
        without[1].0 += usec;
        without[1].1 += calls;
    }
    let per_call = |(usec, calls): (f64, u64)| usec / calls.max(1) as f64;
    for (i, what) in ["claim", "completion"].iter().enumerate() {
        eprintln!(
            "{what}: {:.2} us in Redis with the bucket's index, {:.2} us without ({} calls each)",
            per_call(with[i]),
            per_call(without[i]),
            with[i].1
        );
    }
    let operations = (ROUNDS * PER_ROUND) as u32;
    eprintln!(
        "begin + complete, wall: {:.1?} with the index, {:.1?} without",
        wall_with / operations,
        wall_without / operations
    );
    let mut inside: Vec<_> = inside_with.into_iter().collect();
    inside.sort();
    eprintln!(
        "commands inside the scripts, per operation: {}",
        inside
            .iter()
            .map(|(name, n)| format!("{name} {:.2}", *n as f64 / f64::from(operations)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let page = std::time::Instant::now();
    let listed = store.list(ListQuery::new()).await.unwrap();
    eprintln!(
        "a page of {} from {} records: {:.1?}",
        listed.records.len(),
        ROUNDS * PER_ROUND,
        page.elapsed()
    );
}

/// Move the record of `key` from where this release keeps it to where an earlier release
/// kept it on a cluster (`<prefix><64 hex>`), byte for byte and with its TTL.
async fn move_to_the_earlier_layout(
    admin: &mut ::redis::cluster_async::ClusterConnection,
    store: &RedisStore,
    prefix: &str,
    key: LedgerKey,
) {
    let current = store.redis_key(&key);
    let dump: Vec<u8> = ::redis::cmd("DUMP")
        .arg(&current)
        .query_async(admin)
        .await
        .unwrap();
    let ttl: i64 = ::redis::cmd("PTTL")
        .arg(&current)
        .query_async(admin)
        .await
        .unwrap();
    let () = ::redis::cmd("RESTORE")
        .arg(format!("{prefix}{}", key.to_hex()))
        .arg(ttl)
        .arg(dump)
        .query_async(admin)
        .await
        .unwrap();
    let () = ::redis::cmd("DEL")
        .arg(&current)
        .query_async(admin)
        .await
        .unwrap();
}

/// An operation completed before the upgrade, when the ledger kept records without a
/// bucket's tag, is sent again by sixteen callers at once after it, through two client
/// stacks on different nodes: the provider (which ignores keys) still counts one effect,
/// and every caller gets the recorded response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_completed_before_the_upgrade_is_not_run_again_after_it() {
    let Some(cluster) = RedisCluster::shared().await else {
        return;
    };
    let prefix = unique_prefix();
    let urls = cluster.urls();
    let provider = SideEffectService::builder().honour_keys(false).build();
    let before = connect(&urls, &prefix).await;
    let first = client_stack(before.clone(), &provider)
        .oneshot(post(BODY))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let first = first.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(provider.effects(), 1);

    // The ledger as the earlier release left it: its one record at the untagged key, and
    // no marker.
    let listed = before.list(ListQuery::new()).await.unwrap();
    assert_eq!(listed.records.len(), 1);
    let mut admin = ::redis::cluster::ClusterClient::new(urls.clone())
        .unwrap()
        .get_async_connection()
        .await
        .unwrap();
    move_to_the_earlier_layout(&mut admin, &before, &prefix, listed.records[0].key).await;
    for node in cluster.nodes() {
        for key in cluster_support::cli(
            node.port(),
            &["--scan", "--pattern", &format!("{prefix}*layout")],
        )
        .lines()
        {
            cluster_support::cli(node.port(), &["del", key]);
        }
    }

    let stacks = [
        client_stack(connect(&urls[..1], &prefix).await, &provider),
        client_stack(connect(&urls[1..2], &prefix).await, &provider),
    ];
    let barrier = Arc::new(tokio::sync::Barrier::new(16));
    let callers: Vec<_> = (0..16)
        .map(|i| {
            let (stack, barrier) = (stacks[i % 2].clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                let response = stack.oneshot(post(BODY)).await.unwrap();
                let status = response.status();
                (
                    status,
                    response.into_body().collect().await.unwrap().to_bytes(),
                )
            })
        })
        .collect();
    for caller in callers {
        let (status, body) = caller.await.unwrap();
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(body, first, "the recorded response, replayed");
    }
    assert_eq!(
        provider.effects(),
        1,
        "one effect, before and after the upgrade"
    );
    assert_eq!(provider.calls(), 1, "no caller reached the provider again");
}
