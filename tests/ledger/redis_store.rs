//! `RedisStore` against real Redis servers: the conformance suite, round trips, outages,
//! latency, fencing, sharing between instances, record versioning and listing.
//!
//! Each test starts its own `redis-server` (see `support/redis.rs`), or uses `REDIS_URL` for
//! the tests that do not kill, pause or count commands on the server. Without
//! `redis-server` they are skipped with a notice (`REQUIRE_REDIS=1` makes that a failure).
#![cfg(feature = "redis")]

use crate::support::redis as redis_support;

use crate::support::capture;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode, Version};
use redis::aio::MultiplexedConnection;
use tower_idempotency::ledger::{
    Begin, BeginRequest, Expected, Forget, Generation, IdempotencyStore, LeaseToken, LedgerKey,
    ListPage, ListQuery, Outcome, RecordKind, RedisStore, StoreError, StoredResponse,
};
use tower_idempotency::FrozenRequest;

use redis_support::{redis_url, RedisServer};

const RETENTION: Duration = Duration::from_secs(600);
const LEASE: Duration = Duration::from_secs(30);

/// A prefix of its own per test, so tests sharing a `REDIS_URL` never meet.
fn unique_prefix() -> String {
    format!("idem-test:{:016x}:", fastrand::u64(..))
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

fn request(key: LedgerKey, frozen: &FrozenRequest, lease: Duration) -> BeginRequest {
    BeginRequest::new(key, frozen.fingerprint(), lease, RETENTION).with_frozen(frozen.clone())
}

fn response(body: &'static str) -> Outcome {
    Outcome::Response(StoredResponse::new(
        StatusCode::CREATED,
        Version::HTTP_11,
        HeaderMap::new(),
        Bytes::from_static(body.as_bytes()),
    ))
}

async fn connect(url: &str, prefix: &str) -> RedisStore {
    RedisStore::builder(url)
        .prefix(prefix)
        .connect()
        .await
        .expect("connect")
}

async fn admin(url: &str) -> MultiplexedConnection {
    redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("admin connection")
}

fn assert_replay(begin: Begin, body: &[u8]) {
    match begin {
        Begin::Replay(Outcome::Response(stored)) => assert_eq!(stored.body().as_ref(), body),
        other => panic!("expected Replay, got {other:?}"),
    }
}

fn assert_failed_closed(result: Result<Begin, StoreError>, what: &str) {
    match result {
        Err(err) => assert!(
            err.is_unavailable() || err.is_timeout(),
            "{what}: unexpected error kind {err:?}"
        ),
        Ok(begin) => panic!("{what}: the store answered {begin:?} without Redis"),
    }
}

#[cfg(feature = "test-util")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_passes_the_conformance_suite() {
    use tower_idempotency::testing::conformance::{
        inspection_follows_the_record, listing_finds_what_it_asks_for, run_all, Clock,
    };

    let Some(redis) = redis_url().await else {
        return;
    };
    let store = connect(redis.url(), &unique_prefix()).await;
    inspection_follows_the_record(&store).await;
    // Redis judges leases and retention by its own clock, so the suite sleeps for real.
    listing_finds_what_it_asks_for(&store, &Clock::real()).await;
    run_all(Arc::new(store), Clock::real()).await;
}

/// `INFO commandstats` as `command -> (calls, failed_calls)`.
async fn command_stats(admin: &mut MultiplexedConnection) -> HashMap<String, (u64, u64)> {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(admin)
        .await
        .unwrap();
    info.lines()
        .filter_map(|line| line.strip_prefix("cmdstat_"))
        .filter_map(|line| {
            let (name, fields) = line.split_once(':')?;
            let field = |wanted: &str| {
                fields
                    .split(',')
                    .filter_map(|kv| kv.split_once('='))
                    .find(|(k, _)| *k == wanted)
                    .and_then(|(_, v)| v.trim().parse::<u64>().ok())
                    .unwrap_or(0)
            };
            Some((name.to_owned(), (field("calls"), field("failed_calls"))))
        })
        // The test's own bookkeeping commands are not the store's.
        .filter(|(name, _)| name != "info" && !name.starts_with("config"))
        .collect()
}

/// The commands the scripts run inside Redis: counted by `INFO commandstats`, but never
/// sent over the network.
const SCRIPT_COMMANDS: [&str; 12] = [
    "hmget", "hget", "exists", "time", "hset", "hdel", "hincrby", "pexpire", "del", "zadd", "zrem",
    "zrange",
];

/// The commands that came over the network, sorted.
fn network(stats: &HashMap<String, (u64, u64)>) -> Vec<(&str, (u64, u64))> {
    let mut sent: Vec<_> = stats
        .iter()
        .filter(|(name, _)| !SCRIPT_COMMANDS.contains(&name.as_str()))
        .map(|(name, counts)| (name.as_str(), *counts))
        .collect();
    sent.sort();
    sent
}

async fn reset_stats(admin: &mut MultiplexedConnection) {
    let () = redis::cmd("CONFIG")
        .arg("RESETSTAT")
        .query_async(admin)
        .await
        .unwrap();
}

#[tokio::test]
async fn one_round_trip_per_ledger_operation() {
    // A private server: anyone else's commands would spoil the counts.
    let Some(server) = RedisServer::spawn().await else {
        return;
    };
    let store = connect(&server.url(), "idem:").await;
    let mut admin = admin(&server.url()).await;
    let req = frozen("{\"amount\":1}");

    // Warm up: the connection is made and the scripts are cached (connect loads them).
    let key = fresh_key();
    let Begin::Acquired { token } = store.begin(request(key, &req, LEASE)).await.unwrap() else {
        panic!("expected Acquired")
    };
    store
        .complete(key, token, response("warm"), RETENTION)
        .await
        .unwrap();

    // Fresh operation: begin + complete = two EVALSHA, nothing else over the network.
    reset_stats(&mut admin).await;
    let key = fresh_key();
    let Begin::Acquired { token } = store.begin(request(key, &req, LEASE)).await.unwrap() else {
        panic!("expected Acquired")
    };
    store
        .complete(key, token, response("done"), RETENTION)
        .await
        .unwrap();
    let stats = command_stats(&mut admin).await;
    eprintln!("fresh operation: {stats:?}");
    assert_eq!(network(&stats), [("evalsha", (2, 0))], "fresh: {stats:?}");
    // And what the two scripts did inside Redis: begin reads, finds nothing (EXISTS tells a
    // missing record from one without a version), reads the clock, writes and sets the TTL;
    // complete reads, writes, drops the lease fields and refreshes the TTL. Each moves the
    // record's member between the listing indexes (a ZADD, and the completion a ZREM from
    // the in-flight index), and the claim counts claims for the sweep (HINCRBY; this second
    // claim does not sweep).
    let inside: HashMap<&str, u64> = stats
        .iter()
        .filter(|(name, _)| name.as_str() != "evalsha")
        .map(|(name, (calls, _))| (name.as_str(), *calls))
        .collect();
    let expected = [
        ("hmget", 2),
        ("exists", 1),
        ("time", 2),
        ("hset", 2),
        ("hdel", 1),
        ("pexpire", 2),
        ("zadd", 2),
        ("zrem", 1),
        ("hincrby", 1),
    ];
    assert_eq!(inside, HashMap::from(expected), "fresh: {stats:?}");

    // Replay: one EVALSHA, which reads the record, the clock and the outcome.
    reset_stats(&mut admin).await;
    assert_replay(
        store.begin(request(key, &req, LEASE)).await.unwrap(),
        b"done",
    );
    let stats = command_stats(&mut admin).await;
    eprintln!("replay: {stats:?}");
    assert_eq!(network(&stats), [("evalsha", (1, 0))], "replay: {stats:?}");
    assert_eq!(stats.get("hget"), Some(&(1, 0)), "replay: {stats:?}");
    assert_eq!(
        stats.get("hset"),
        None,
        "a replay writes nothing: {stats:?}"
    );

    // Cold path: Redis forgot the scripts (restart, failover, SCRIPT FLUSH). Each script
    // answers NOSCRIPT once, is loaded, and the call is retried; then it is warm again.
    let () = redis::cmd("SCRIPT")
        .arg("FLUSH")
        .query_async(&mut admin)
        .await
        .unwrap();
    reset_stats(&mut admin).await;
    let key = fresh_key();
    let Begin::Acquired { token } = store.begin(request(key, &req, LEASE)).await.unwrap() else {
        panic!("expected Acquired after SCRIPT FLUSH")
    };
    store
        .complete(key, token, response("cold"), RETENTION)
        .await
        .unwrap();
    assert_replay(
        store.begin(request(key, &req, LEASE)).await.unwrap(),
        b"cold",
    );
    let stats = command_stats(&mut admin).await;
    eprintln!("cold path: {stats:?}");
    // begin: NOSCRIPT, load, retry; complete: the same; the replay is warm.
    assert_eq!(
        network(&stats),
        [("evalsha", (5, 2)), ("script|load", (2, 0))],
        "cold: {stats:?}"
    );
}

#[tokio::test]
async fn fails_closed_while_redis_is_down_and_recovers_when_it_returns() {
    let Some(mut server) = RedisServer::spawn().await else {
        return;
    };
    let timeout = Duration::from_millis(500);
    let store = RedisStore::builder(server.url())
        .operation_timeout(timeout)
        .connection_timeout(Duration::from_millis(200))
        .connect()
        .await
        .unwrap();
    let req = frozen("{\"amount\":2}");
    let before = fresh_key();
    let Begin::Acquired { token } = store.begin(request(before, &req, LEASE)).await.unwrap() else {
        panic!("expected Acquired")
    };

    server.stop();
    for attempt in 0..3 {
        let started = Instant::now();
        let result = store.begin(request(fresh_key(), &req, LEASE)).await;
        let elapsed = started.elapsed();
        assert!(
            elapsed < timeout + Duration::from_millis(250),
            "attempt {attempt} took {elapsed:?}"
        );
        assert_failed_closed(result, "begin while Redis is down");
    }
    let err = store
        .complete(before, token, response("lost"), RETENTION)
        .await
        .unwrap_err();
    assert!(err.is_unavailable() || err.is_timeout(), "{err:?}");

    // Same port, same store: the connection manager reconnects by itself.
    server.restart().await;
    let restarted = Instant::now();
    let deadline = restarted + Duration::from_secs(15);
    let key = fresh_key();
    let token = loop {
        match store.begin(request(key, &req, LEASE)).await {
            Ok(Begin::Acquired { token }) => {
                eprintln!("recovered {:?} after the restart", restarted.elapsed());
                break token;
            }
            Ok(other) => panic!("expected Acquired after the restart, got {other:?}"),
            Err(err) => {
                assert!(err.is_unavailable() || err.is_timeout(), "{err:?}");
                assert!(
                    Instant::now() < deadline,
                    "the store did not recover: {err}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    store
        .complete(key, token, response("back"), RETENTION)
        .await
        .unwrap();
    assert_replay(
        store.begin(request(key, &req, LEASE)).await.unwrap(),
        b"back",
    );
}

#[tokio::test]
async fn a_stalled_redis_trips_the_operation_timeout_fast() {
    let Some(server) = RedisServer::spawn().await else {
        return;
    };
    let timeout = Duration::from_millis(200);
    let store = RedisStore::builder(server.url())
        .operation_timeout(timeout)
        .connect()
        .await
        .unwrap();
    let req = frozen("{\"amount\":3}");
    store
        .begin(request(fresh_key(), &req, LEASE))
        .await
        .unwrap();

    server.pause();
    for _ in 0..2 {
        let started = Instant::now();
        let err = store
            .begin(request(fresh_key(), &req, LEASE))
            .await
            .expect_err("no answer while Redis is stopped");
        let elapsed = started.elapsed();
        assert!(err.is_timeout(), "{err:?}");
        assert!(
            elapsed >= timeout && elapsed < timeout + Duration::from_millis(300),
            "timed out after {elapsed:?}"
        );
    }
    server.resume();

    // The late replies of the abandoned calls must not be handed to later ones.
    let key = fresh_key();
    assert!(matches!(
        store.begin(request(key, &req, LEASE)).await.unwrap(),
        Begin::Acquired { .. }
    ));
    assert!(matches!(
        store.begin(request(key, &req, LEASE)).await.unwrap(),
        Begin::Busy { .. }
    ));
}

#[tokio::test]
async fn a_stale_owner_is_fenced_after_its_lease_is_taken_over() {
    let Some(redis) = redis_url().await else {
        return;
    };
    let store = connect(redis.url(), &unique_prefix()).await;
    let req = frozen("{\"amount\":4}");
    let key = fresh_key();
    let lease = Duration::from_millis(200);

    let Begin::Acquired { token: stale } = store.begin(request(key, &req, lease)).await.unwrap()
    else {
        panic!("expected Acquired")
    };
    match store.begin(request(key, &req, lease)).await.unwrap() {
        Begin::Busy { retry_after } => assert!(retry_after <= lease, "{retry_after:?}"),
        other => panic!("expected Busy, got {other:?}"),
    }
    tokio::time::sleep(lease + Duration::from_millis(100)).await;

    let Begin::Resume {
        token: current,
        frozen,
    } = store.begin(request(key, &req, LEASE)).await.unwrap()
    else {
        panic!("expected Resume after the lease ran out")
    };
    assert_eq!(frozen.expect("stored request").body(), req.body());
    assert_ne!(stale, current);

    // Every write of the stale owner is refused and changes nothing.
    let fenced = store
        .complete(key, stale, response("stale"), RETENTION)
        .await;
    assert!(fenced.unwrap_err().is_fenced());
    assert!(store
        .mark_in_doubt(key, stale, RETENTION)
        .await
        .unwrap_err()
        .is_fenced());
    assert!(store.abandon(key, stale).await.unwrap_err().is_fenced());
    assert!(matches!(
        store.begin(request(key, &req, LEASE)).await.unwrap(),
        Begin::Busy { .. }
    ));

    store
        .complete(key, current, response("current"), RETENTION)
        .await
        .unwrap();
    assert_replay(
        store.begin(request(key, &req, LEASE)).await.unwrap(),
        b"current",
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_store_instances_share_one_ledger() {
    let Some(redis) = redis_url().await else {
        return;
    };
    let prefix = unique_prefix();
    // Two connects: two connection managers, two TCP connections, as two processes would.
    let a = connect(redis.url(), &prefix).await;
    let b = connect(redis.url(), &prefix).await;
    let req = frozen("{\"amount\":5}");

    let key = fresh_key();
    let Begin::Acquired { token } = a.begin(request(key, &req, LEASE)).await.unwrap() else {
        panic!("expected Acquired")
    };
    assert!(matches!(
        b.begin(request(key, &req, LEASE)).await.unwrap(),
        Begin::Busy { .. }
    ));
    a.complete(key, token, response("from a"), RETENTION)
        .await
        .unwrap();
    assert_replay(b.begin(request(key, &req, LEASE)).await.unwrap(), b"from a");

    let key = fresh_key();
    let stores = [Arc::new(a), Arc::new(b)];
    let tasks: Vec<_> = (0..64)
        .map(|i| {
            let store = stores[i % 2].clone();
            let request = request(key, &req, LEASE);
            tokio::spawn(async move { store.begin(request).await.unwrap() })
        })
        .collect();
    let (mut acquired, mut busy) = (0, 0);
    for task in tasks {
        match task.await.unwrap() {
            Begin::Acquired { .. } => acquired += 1,
            Begin::Busy { .. } => busy += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((acquired, busy), (1, 63));
}

#[tokio::test]
async fn records_of_an_unknown_version_are_corrupt_not_misread() {
    let Some(redis) = redis_url().await else {
        return;
    };
    let store = connect(redis.url(), &unique_prefix()).await;
    let mut admin = admin(redis.url()).await;
    let req = frozen("{\"amount\":6}");

    // A record as a later release might write it: same field names, version 2.
    let key = fresh_key();
    let redis_key = store.redis_key(&key);
    let () = redis::cmd("HSET")
        .arg(&redis_key)
        .arg(&[
            ("v", "2"),
            ("fp", req.fingerprint().to_hex().as_str()),
            ("state", "completed"),
        ])
        .query_async(&mut admin)
        .await
        .unwrap();
    let err = store.begin(request(key, &req, LEASE)).await.unwrap_err();
    assert!(err.is_corrupt(), "{err:?}");
    assert!(err.to_string().contains("version 2"), "{err}");
    let token = LeaseToken::generate();
    let err = store
        .complete(key, token, response("x"), RETENTION)
        .await
        .unwrap_err();
    assert!(err.is_corrupt(), "{err:?}");
    assert!(store.abandon(key, token).await.unwrap_err().is_corrupt());
    assert!(store
        .mark_in_doubt(key, token, RETENTION)
        .await
        .unwrap_err()
        .is_corrupt());
    // Untouched.
    let v: String = redis::cmd("HGET")
        .arg(&redis_key)
        .arg("v")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(v, "2");

    // A hash that is not ours, and a key of another type, are refused the same way.
    let key = fresh_key();
    let () = redis::cmd("HSET")
        .arg(store.redis_key(&key))
        .arg("something")
        .arg("else")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(store
        .begin(request(key, &req, LEASE))
        .await
        .unwrap_err()
        .is_corrupt());
    let key = fresh_key();
    let () = redis::cmd("SET")
        .arg(store.redis_key(&key))
        .arg("a string")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(store
        .begin(request(key, &req, LEASE))
        .await
        .unwrap_err()
        .is_corrupt());
}

/// A record the previous release wrote has no `gen`: it is read, its generation is its
/// `created_ms`, a look at it forgets it, and a look at it never forgets the record the key
/// gets next.
#[tokio::test]
async fn a_record_without_a_generation_reads_as_its_creation_time() {
    let Some(redis) = redis_url().await else {
        return;
    };
    let store = connect(redis.url(), &unique_prefix()).await;
    let mut admin = admin(redis.url()).await;
    let req = frozen("{\"amount\":9}");
    let created_ms = 1_765_000_000_123_u64;
    // The fields the previous release's `begin` and `complete` wrote: no `gen`.
    let key = fresh_key();
    let redis_key = store.redis_key(&key);
    let fields = [
        ("v", b"1".to_vec()),
        ("fp", req.fingerprint().to_hex().into_bytes()),
        ("state", b"completed".to_vec()),
        ("sent", b"0".to_vec()),
        (
            "retention_ms",
            RETENTION.as_millis().to_string().into_bytes(),
        ),
        ("created_ms", created_ms.to_string().into_bytes()),
        ("attempts", b"1".to_vec()),
        ("outcome", response("earlier release").encode()),
    ];
    let () = redis::cmd("HSET")
        .arg(&redis_key)
        .arg(&fields)
        .query_async(&mut admin)
        .await
        .unwrap();
    let () = redis::cmd("PEXPIRE")
        .arg(&redis_key)
        .arg(RETENTION.as_millis() as u64)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_replay(
        store.begin(request(key, &req, LEASE)).await.unwrap(),
        b"earlier release",
    );
    let seen = store
        .inspect(key)
        .await
        .unwrap()
        .expect("the earlier record");
    assert_eq!(seen.generation, Generation::from_u64(created_ms));
    assert_eq!(
        store.forget(key, Expected::of(&seen)).await.unwrap(),
        Forget::Forgotten
    );

    // Forgotten, claimed and completed again by this release: another life.
    let Begin::Acquired { token } = store.begin(request(key, &req, LEASE)).await.unwrap() else {
        panic!("expected Acquired")
    };
    store
        .complete(key, token, response("this release"), RETENTION)
        .await
        .unwrap();
    assert_ne!(
        store.inspect(key).await.unwrap().unwrap().generation,
        seen.generation
    );
    assert_eq!(
        store.forget(key, Expected::of(&seen)).await.unwrap(),
        Forget::Changed
    );
    assert_replay(
        store.begin(request(key, &req, LEASE)).await.unwrap(),
        b"this release",
    );
}

#[tokio::test]
async fn records_have_the_documented_layout_and_the_lease_is_not_the_ttl() {
    let Some(redis) = redis_url().await else {
        return;
    };
    let store = connect(redis.url(), &unique_prefix()).await;
    let mut admin = admin(redis.url()).await;
    let req = frozen("{\"amount\":7}");
    let key = fresh_key();
    let lease = Duration::from_millis(100);

    let Begin::Acquired { token } = store.begin(request(key, &req, lease)).await.unwrap() else {
        panic!("expected Acquired")
    };
    let redis_key = store.redis_key(&key);
    assert!(redis_key.ends_with(&key.to_hex()));
    let fields: HashMap<String, Vec<u8>> = redis::cmd("HGETALL")
        .arg(&redis_key)
        .query_async(&mut admin)
        .await
        .unwrap();
    let text = |name: &str| String::from_utf8(fields[name].clone()).unwrap();
    assert_eq!(text("v"), "1");
    assert_eq!(text("state"), "in_flight");
    assert_eq!(text("fp"), req.fingerprint().to_hex());
    assert_eq!(text("token"), format!("{:032x}", token.as_u128()));
    assert_eq!(text("sent"), "0");
    assert_eq!(text("attempts"), "1");
    assert_eq!(text("retention_ms"), RETENTION.as_millis().to_string());
    let generation = store.inspect(key).await.unwrap().unwrap().generation;
    assert_eq!(text("gen"), generation.to_string());
    assert_eq!(
        FrozenRequest::decode(&fields["frozen"]).unwrap().body(),
        req.body()
    );
    assert!(!fields.contains_key("outcome"));

    // The key lives for the retention, not the lease: after the lease the record is still
    // there, and reads as in doubt.
    tokio::time::sleep(lease + Duration::from_millis(100)).await;
    let ttl: i64 = redis::cmd("PTTL")
        .arg(&redis_key)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(
        ttl > (RETENTION - Duration::from_secs(60)).as_millis() as i64,
        "PTTL {ttl}"
    );
    let Begin::Resume { token, .. } = store.begin(request(key, &req, lease)).await.unwrap() else {
        panic!("expected Resume")
    };
    store
        .complete(key, token, response("done"), RETENTION)
        .await
        .unwrap();
    let fields: HashMap<String, Vec<u8>> = redis::cmd("HGETALL")
        .arg(&redis_key)
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(fields["state"], b"completed");
    assert_eq!(fields["sent"], b"1");
    assert_eq!(fields["attempts"], b"2");
    assert_eq!(
        fields["gen"],
        generation.to_string().as_bytes(),
        "one life, one generation"
    );
    assert!(!fields.contains_key("token") && !fields.contains_key("lease_until_ms"));
    assert!(matches!(
        Outcome::decode(&fields["outcome"]).unwrap(),
        Outcome::Response(_)
    ));
}

#[tokio::test]
async fn connecting_to_nothing_fails_closed_and_fast() {
    // No server needed: a loopback port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let started = Instant::now();
    let err = RedisStore::builder(format!("redis://127.0.0.1:{port}/"))
        .operation_timeout(Duration::from_millis(200))
        .connection_timeout(Duration::from_millis(200))
        .connect()
        .await
        .unwrap_err();
    assert!(err.is_unavailable(), "{err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );

    let err = RedisStore::builder("not a url")
        .connect()
        .await
        .unwrap_err();
    assert!(err.is_unavailable(), "{err:?}");
}

#[test]
fn debug_output_never_shows_credentials() {
    let builder = RedisStore::builder("redis://:hunter2@127.0.0.1:6379/");
    let shown = format!("{builder:?}");
    assert!(!shown.contains("hunter2"), "{shown}");
}

#[tokio::test(flavor = "current_thread")]
async fn connecting_warns_when_redis_may_evict_ledger_records() {
    // A private server: the test changes its configuration.
    let Some(server) = RedisServer::spawn().await else {
        return;
    };
    let mut admin = admin(&server.url()).await;
    let (logs, _default) = capture::warnings();

    connect(&server.url(), "idem:").await;
    assert!(
        !logs.text().contains("maxmemory-policy"),
        "noeviction (redis-server's default) is what the ledger needs: no warning"
    );

    for policy in ["allkeys-lru", "volatile-ttl"] {
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory-policy")
            .arg(policy)
            .query_async(&mut admin)
            .await
            .unwrap();
        logs.clear();
        connect(&server.url(), "idem:").await;
        let logged = logs.text();
        assert!(
            logged.contains("WARN") && logged.contains(policy) && logged.contains("noeviction"),
            "{policy}: {logged}"
        );
    }
}

/// Hole 13: a Redis without persistence forgets every record when it restarts, and each
/// operation retried after that runs again. Connecting to one says so; connecting to one
/// with an append-only file does not.
#[tokio::test(flavor = "current_thread")]
async fn connecting_warns_when_redis_keeps_no_record_across_a_restart() {
    // Private servers: one as `RedisServer::spawn` starts it (`save ""`, `appendonly no`),
    // one with `appendonly yes`.
    let Some(forgetful) = RedisServer::spawn().await else {
        return;
    };
    let Some(durable) = RedisServer::spawn_durable().await else {
        return;
    };
    let (logs, _default) = capture::warnings();

    connect(&forgetful.url(), "idem:").await;
    let logged = logs.text();
    let node = format!("127.0.0.1:{}", forgetful.port());
    assert!(
        logged.contains("WARN")
            && logged.contains(&node)
            && logged.contains("keeps no record across a restart")
            && logged.contains("charged twice")
            && logged.contains("appendonly yes")
            && logged.contains("appendfsync everysec"),
        "{logged}"
    );

    logs.clear();
    connect(&durable.url(), "idem:").await;
    assert!(logs.text().is_empty(), "{}", logs.text());

    // Snapshots alone keep the records up to the last one: not "nothing survives".
    let mut admin = admin(&forgetful.url()).await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("save")
        .arg("60 1")
        .query_async(&mut admin)
        .await
        .unwrap();
    logs.clear();
    connect(&forgetful.url(), "idem:").await;
    assert!(logs.text().is_empty(), "{}", logs.text());
}

#[tokio::test]
async fn a_full_redis_under_noeviction_refuses_claims_as_a_full_store() {
    let Some(server) = RedisServer::spawn().await else {
        return;
    };
    let mut admin = admin(&server.url()).await;
    let _: () = redis::cmd("CONFIG")
        .arg("SET")
        .arg("maxmemory")
        .arg("4mb")
        .query_async(&mut admin)
        .await
        .unwrap();
    let store = connect(&server.url(), "idem:").await;
    let body: &'static str = Box::leak("x".repeat(64 * 1024).into_boxed_str());
    let big = frozen(body);
    let mut kept = Vec::new();
    let refused = loop {
        let key = fresh_key();
        match store.begin(request(key, &big, LEASE)).await {
            Ok(Begin::Acquired { token }) => kept.push((key, token)),
            Ok(other) => panic!("unexpected {other:?}"),
            Err(err) => break err,
        }
        assert!(
            kept.len() < 1000,
            "4 MiB held {} records of 64 KiB",
            kept.len()
        );
    };
    assert!(refused.is_full(), "{refused:?}");
    // Nothing already claimed was forgotten to make room.
    for (key, token) in kept {
        store.renew(key, token, LEASE).await.expect("still claimed");
    }
}

/// Claim `key` in `scope` and record an outcome, kept for `retention`.
async fn completed_in(store: &RedisStore, key: LedgerKey, scope: &str, retention: Duration) {
    let req = frozen("{\"listed\":true}");
    let claim = BeginRequest::new(key, req.fingerprint(), LEASE, retention)
        .with_frozen(req)
        .with_scope(scope);
    let Begin::Acquired { token } = store.begin(claim).await.unwrap() else {
        panic!("expected Acquired")
    };
    store
        .complete(key, token, response("done"), retention)
        .await
        .unwrap();
}

/// Claim `key` in `scope` and leave it in doubt.
async fn in_doubt_in(store: &RedisStore, key: LedgerKey, scope: &str, retention: Duration) {
    let req = frozen("{\"listed\":\"doubt\"}");
    let claim = BeginRequest::new(key, req.fingerprint(), LEASE, retention)
        .with_frozen(req)
        .with_scope(scope);
    let Begin::Acquired { token } = store.begin(claim).await.unwrap() else {
        panic!("expected Acquired")
    };
    store.mark_in_doubt(key, token, retention).await.unwrap();
}

/// How many members the listing index of `kind` holds.
async fn index_size(admin: &mut MultiplexedConnection, prefix: &str, kind: RecordKind) -> u64 {
    redis::cmd("ZCARD")
        .arg(format!("{prefix}index:{}", kind.as_str()))
        .query_async(admin)
        .await
        .unwrap()
}

/// Every page of `query`, following the cursors to the end (at most `most` pages).
async fn every_page(store: &RedisStore, query: ListQuery, most: usize) -> Vec<ListPage> {
    let mut pages = Vec::new();
    let mut query = query;
    for _ in 0..most {
        let page = store.list(query.clone()).await.expect("list");
        let next = page.next;
        pages.push(page);
        match next {
            Some(cursor) => query = query.after(cursor),
            None => return pages,
        }
    }
    panic!("the list did not end within {most} pages");
}

#[tokio::test]
async fn records_that_leave_by_their_ttl_leave_the_list_and_the_index() {
    let Some(redis) = redis_url().await else {
        return;
    };
    let prefix = unique_prefix();
    let store = connect(redis.url(), &prefix).await;
    let mut admin = admin(redis.url()).await;
    let scope = "ttl-leavers";
    let short = Duration::from_millis(300);

    let (done, doubt) = (fresh_key(), fresh_key());
    completed_in(&store, done, scope, short).await;
    // A millisecond of its own: records claimed in the same one are ordered by key.
    tokio::time::sleep(Duration::from_millis(5)).await;
    in_doubt_in(&store, doubt, scope, short).await;
    let listed = store.list(ListQuery::new().scope(scope)).await.unwrap();
    let keys: Vec<LedgerKey> = listed.records.iter().map(|r| r.key).collect();
    assert_eq!(keys, [doubt, done], "listed newest first while they last");
    assert_eq!(
        listed.records[1].view.scope,
        tower_idempotency::ledger::scope_id(scope)
    );

    tokio::time::sleep(short + Duration::from_millis(200)).await;
    // A list that meets them drops their members and goes on.
    let listed = store.list(ListQuery::new().scope(scope)).await.unwrap();
    assert!(
        listed.records.is_empty() && listed.next.is_none(),
        "{listed:?}"
    );
    assert_eq!(
        index_size(&mut admin, &prefix, RecordKind::Completed).await,
        0
    );
    assert_eq!(
        index_size(&mut admin, &prefix, RecordKind::InDoubt).await,
        0
    );

    // Without a list, claims sweep them: every fourth looks at the next eight members of
    // every index.
    for _ in 0..10 {
        completed_in(&store, fresh_key(), scope, short).await;
    }
    in_doubt_in(&store, fresh_key(), scope, short).await;
    tokio::time::sleep(short + Duration::from_millis(200)).await;
    for _ in 0..16 {
        let req = frozen("{\"sweeper\":1}");
        let claim = BeginRequest::new(fresh_key(), req.fingerprint(), LEASE, RETENTION);
        assert!(matches!(
            store.begin(claim).await.unwrap(),
            Begin::Acquired { .. }
        ));
    }
    assert_eq!(
        index_size(&mut admin, &prefix, RecordKind::Completed).await,
        0,
        "claims swept the members of expired records"
    );
    assert_eq!(
        index_size(&mut admin, &prefix, RecordKind::InDoubt).await,
        0
    );
    assert_eq!(
        index_size(&mut admin, &prefix, RecordKind::InFlight).await,
        16
    );
}

#[tokio::test]
async fn a_page_looks_at_a_bounded_number_of_records_and_the_cursors_reach_the_end() {
    let Some(redis) = redis_url().await else {
        return;
    };
    let store = connect(redis.url(), &unique_prefix()).await;
    // The one record asked for is the oldest, behind 200 that do not match.
    let wanted = fresh_key();
    completed_in(&store, wanted, "rare", RETENTION).await;
    // A millisecond of its own: records claimed in the same one are ordered by key.
    tokio::time::sleep(Duration::from_millis(5)).await;
    let doubt = fresh_key();
    in_doubt_in(&store, doubt, "common", RETENTION).await;
    for _ in 0..200 {
        completed_in(&store, fresh_key(), "common", RETENTION).await;
    }

    // A page of one looks at ten entries: short pages with a cursor, until the end.
    let pages = every_page(&store, ListQuery::new().scope("rare").limit(1), 100).await;
    assert!(
        pages[0].records.is_empty() && pages[0].next.is_some(),
        "the first page stopped looking early: {:?}",
        pages[0]
    );
    assert!(pages.len() >= 20, "{} pages", pages.len());
    let found: Vec<LedgerKey> = pages
        .iter()
        .flat_map(|page| page.records.iter().map(|r| r.key))
        .collect();
    assert_eq!(found, [wanted]);

    // Oldest first, it is the first entry looked at.
    let page = store
        .list(ListQuery::new().scope("rare").limit(1).oldest_first())
        .await
        .unwrap();
    assert_eq!(page.records.len(), 1);
    assert_eq!(page.records[0].key, wanted);

    // The in-doubt list reads the in-doubt index only: one page, whatever the rest holds.
    let page = store
        .list(ListQuery::new().kind(RecordKind::InDoubt).limit(1))
        .await
        .unwrap();
    let keys: Vec<LedgerKey> = page.records.iter().map(|r| r.key).collect();
    assert_eq!((keys, page.next), (vec![doubt], None));

    // Pages of a hundred follow one another without a gap or a repeat.
    let pages = every_page(&store, ListQuery::new().limit(100), 10).await;
    let mut keys: Vec<LedgerKey> = pages
        .iter()
        .flat_map(|page| page.records.iter().map(|r| r.key))
        .collect();
    assert_eq!(keys.len(), 202);
    keys.sort();
    keys.dedup();
    assert_eq!(keys.len(), 202, "no record listed twice");
}

/// `INFO commandstats`'s microseconds per call of `command`, and its calls.
async fn server_time(admin: &mut MultiplexedConnection, command: &str) -> (f64, u64) {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(admin)
        .await
        .unwrap();
    let line = info
        .lines()
        .find_map(|line| line.strip_prefix(&format!("cmdstat_{command}:")))
        .unwrap_or_default()
        .to_owned();
    let field = |name: &str| {
        line.split(',')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == name)
            .and_then(|(_, v)| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (field("usec_per_call"), field("calls") as u64)
}

async fn memory_usage(admin: &mut MultiplexedConnection, key: &str) -> u64 {
    redis::cmd("MEMORY")
        .arg("USAGE")
        .arg(key)
        .arg("SAMPLES")
        .arg(0)
        .query_async::<Option<u64>>(admin)
        .await
        .unwrap()
        .unwrap_or(0)
}

/// The ledger's own scripts, run by hand without the listing indexes (one key, as on a
/// cluster): the same work but the index's, for comparing.
pub(super) struct Unindexed {
    begin: redis::Script,
    complete: redis::Script,
}

impl Unindexed {
    pub(super) fn new() -> Self {
        const PRELUDE: &str = include_str!("../../src/ledger/redis/prelude.lua");
        let script = |body: &str| redis::Script::new(&format!("{PRELUDE}{body}"));
        Self {
            begin: script(include_str!("../../src/ledger/redis/begin.lua")),
            complete: script(include_str!("../../src/ledger/redis/complete.lua")),
        }
    }

    pub(super) async fn claim(
        &self,
        admin: &mut impl redis::aio::ConnectionLike,
        key: &str,
        req: &FrozenRequest,
    ) {
        let reply: Vec<redis::Value> = self
            .begin
            .key(key)
            .arg(req.fingerprint().to_hex())
            .arg(format!("{:032x}", 7u128))
            .arg(LEASE.as_millis() as u64)
            .arg(RETENTION.as_millis() as u64)
            .arg("0")
            .arg(format!("{:016x}", fastrand::u64(..)))
            .arg(req.encode())
            .arg(format!("{:016x}", 5u64))
            .invoke_async(admin)
            .await
            .unwrap();
        assert_eq!(reply[0], redis::Value::BulkString(b"acquired".to_vec()));
    }

    pub(super) async fn complete(&self, admin: &mut impl redis::aio::ConnectionLike, key: &str) {
        let reply: Vec<redis::Value> = self
            .complete
            .key(key)
            .arg(format!("{:032x}", 7u128))
            .arg(response("done").encode())
            .arg(RETENTION.as_millis() as u64)
            .invoke_async(admin)
            .await
            .unwrap();
        assert_eq!(reply[0], redis::Value::BulkString(b"ok".to_vec()));
    }
}

/// Redis's own microseconds for `EVALSHA`s since the last reset, and their count.
async fn evalsha_time(admin: &mut MultiplexedConnection) -> (f64, u64) {
    let (per_call, calls) = server_time(admin, "evalsha").await;
    (per_call * calls as f64, calls)
}

/// What the listing indexes cost: Redis's own time per claim and per completion (from
/// `INFO commandstats`, so the client's speed does not count) with the indexes and
/// without them (the same scripts on the record's key alone, as on a cluster), in
/// alternating rounds so both meet the same load; the memory of an index entry and of a
/// record; the time of a page. A measurement, not a check: run with
/// `cargo test --all-features --test ledger what_the_listing -- --ignored --nocapture`.
#[tokio::test]
#[ignore = "a measurement: run with --ignored --nocapture"]
async fn what_the_listing_index_costs() {
    const ROUNDS: usize = 10;
    const PER_ROUND: usize = 500;
    let Some(server) = RedisServer::spawn().await else {
        return;
    };
    let prefix = "idem:";
    let store = connect(&server.url(), prefix).await;
    let mut admin = admin(&server.url()).await;
    let unindexed = Unindexed::new();
    let req = frozen("{\"amount\":1}");
    // (claims, completions) of Redis time and calls: with the index, then without.
    let mut with = [(0.0, 0u64); 2];
    let mut without = [(0.0, 0u64); 2];
    let add = |into: &mut (f64, u64), (time, calls): (f64, u64)| {
        into.0 += time;
        into.1 += calls;
    };
    let mut owners = Vec::new();
    for round in 0..ROUNDS {
        let mut claimed = Vec::with_capacity(PER_ROUND);
        reset_stats(&mut admin).await;
        for i in 0..PER_ROUND {
            let key = fresh_key();
            let claim = request(key, &req, LEASE).with_scope(&format!("tenant-{}", i % 10));
            let Begin::Acquired { token } = store.begin(claim).await.unwrap() else {
                panic!("expected Acquired")
            };
            claimed.push((key, token));
        }
        add(&mut with[0], evalsha_time(&mut admin).await);
        reset_stats(&mut admin).await;
        for (i, (key, token)) in claimed.iter().enumerate() {
            if i % 50 == 0 {
                store.mark_in_doubt(*key, *token, RETENTION).await.unwrap();
            } else {
                store
                    .complete(*key, *token, response("done"), RETENTION)
                    .await
                    .unwrap();
            }
        }
        add(&mut with[1], evalsha_time(&mut admin).await);
        owners.extend(claimed);

        let keys: Vec<String> = (0..PER_ROUND)
            .map(|i| format!("unindexed:{round}:{i:064}"))
            .collect();
        reset_stats(&mut admin).await;
        for key in &keys {
            unindexed.claim(&mut admin, key, &req).await;
        }
        add(&mut without[0], evalsha_time(&mut admin).await);
        reset_stats(&mut admin).await;
        for key in &keys {
            unindexed.complete(&mut admin, key).await;
        }
        add(&mut without[1], evalsha_time(&mut admin).await);
    }
    let per_call = |(time, calls): (f64, u64)| time / calls.max(1) as f64;
    for (i, what) in ["claim", "completion"].iter().enumerate() {
        eprintln!(
            "{what}: {:.2} us in Redis with the index, {:.2} us without ({} calls each)",
            per_call(with[i]),
            per_call(without[i]),
            with[i].1
        );
    }
    const N: usize = ROUNDS * PER_ROUND;

    let completed = memory_usage(&mut admin, &format!("{prefix}index:completed")).await;
    let in_doubt = memory_usage(&mut admin, &format!("{prefix}index:in_doubt")).await;
    let record = memory_usage(&mut admin, &store.redis_key(&owners[1].0)).await;
    eprintln!(
        "index: {completed} bytes for {} completed ({:.1} per entry), {in_doubt} bytes for {} in doubt; a completed record: {record} bytes",
        N - N / 50,
        completed as f64 / (N - N / 50) as f64,
        N / 50
    );

    for (name, query) in [
        (
            "in doubt, 100 a page",
            ListQuery::new().kind(RecordKind::InDoubt),
        ),
        ("everything, 100 a page", ListQuery::new()),
        (
            "a scope of none, 100 a page (1000 entries looked at)",
            ListQuery::new().scope("nobody"),
        ),
    ] {
        reset_stats(&mut admin).await;
        let started = Instant::now();
        let page = store.list(query).await.unwrap();
        let wall = started.elapsed();
        let (usec, _) = server_time(&mut admin, "evalsha").await;
        eprintln!(
            "list {name}: {} records, {usec:.0} us in Redis, {wall:?} a round trip",
            page.records.len()
        );
    }
}

#[tokio::test]
async fn a_listed_record_shows_its_scope_its_last_change_and_a_lapsed_lease_in_flight() {
    use tower_idempotency::ledger::{scope_id, RecordState};

    let Some(redis) = redis_url().await else {
        return;
    };
    let prefix = unique_prefix();
    let store = connect(redis.url(), &prefix).await;
    let mut admin = admin(redis.url()).await;
    let scope = "shown";

    // Claimed, then put in doubt a while later: touched since the mark, aged since the claim.
    let doubt = fresh_key();
    let req = frozen("{\"shown\":1}");
    let claim = BeginRequest::new(doubt, req.fingerprint(), LEASE, RETENTION)
        .with_frozen(req)
        .with_scope(scope);
    let Begin::Acquired { token } = store.begin(claim).await.unwrap() else {
        panic!("expected Acquired")
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    store.mark_in_doubt(doubt, token, RETENTION).await.unwrap();
    let view = store.inspect(doubt).await.unwrap().unwrap();
    assert_eq!(view.scope, scope_id(scope));
    assert!(
        view.age >= Duration::from_millis(300) && view.touched < Duration::from_millis(200),
        "{view:?}"
    );

    // An in-flight record whose lease ran out: still listed in flight, with no lease left,
    // as inspect shows it.
    let lapsed = fresh_key();
    let req = frozen("{\"shown\":2}");
    let claim = BeginRequest::new(
        lapsed,
        req.fingerprint(),
        Duration::from_millis(50),
        RETENTION,
    )
    .with_frozen(req)
    .with_scope(scope);
    assert!(matches!(
        store.begin(claim).await.unwrap(),
        Begin::Acquired { .. }
    ));
    tokio::time::sleep(Duration::from_millis(100)).await;
    let page = store
        .list(ListQuery::new().kind(RecordKind::InFlight).scope(scope))
        .await
        .unwrap();
    assert_eq!(page.records.len(), 1);
    assert_eq!(page.records[0].key, lapsed);
    assert!(
        matches!(
            page.records[0].view.state,
            RecordState::InFlight { lease_left, .. } if lease_left.is_zero()
        ),
        "{:?}",
        page.records[0].view
    );

    // A record an earlier release wrote keeps neither field: scope 0, last touched when
    // claimed. It is still listed once in an index (here, by its own change of state).
    let () = redis::cmd("HDEL")
        .arg(store.redis_key(&doubt))
        .arg("scope")
        .arg("touched_ms")
        .query_async(&mut admin)
        .await
        .unwrap();
    let view = store.inspect(doubt).await.unwrap().unwrap();
    assert_eq!((view.scope, view.touched), (0, view.age), "{view:?}");
    let page = store
        .list(ListQuery::new().kind(RecordKind::InDoubt).scope_id(0))
        .await
        .unwrap();
    let keys: Vec<LedgerKey> = page.records.iter().map(|r| r.key).collect();
    assert_eq!(keys, [doubt]);
}

#[tokio::test]
async fn a_key_claimed_again_after_its_record_expired_is_listed_once_in_its_new_state() {
    let Some(redis) = redis_url().await else {
        return;
    };
    let prefix = unique_prefix();
    let store = connect(redis.url(), &prefix).await;
    let mut admin = admin(redis.url()).await;
    let key = fresh_key();
    let short = Duration::from_millis(200);
    completed_in(&store, key, "again", short).await;
    tokio::time::sleep(short + Duration::from_millis(150)).await;

    // A new life of the key, in flight: its earlier life's completed entry is stale.
    let req = frozen("{\"again\":2}");
    let claim = BeginRequest::new(key, req.fingerprint(), LEASE, RETENTION).with_scope("again");
    assert!(matches!(
        store.begin(claim).await.unwrap(),
        Begin::Acquired { .. }
    ));
    let listed = store.list(ListQuery::new().scope("again")).await.unwrap();
    let states: Vec<RecordKind> = listed
        .records
        .iter()
        .map(|r| RecordKind::of(&r.view.state))
        .collect();
    assert_eq!(states, [RecordKind::InFlight], "{listed:?}");
    assert_eq!(listed.records[0].key, key);
    assert_eq!(
        index_size(&mut admin, &prefix, RecordKind::Completed).await,
        0,
        "the list dropped the earlier life's entry"
    );
}

#[cfg(feature = "test-util")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_store_shows_the_frozen_request_it_keeps() {
    let Some(redis) = redis_url().await else {
        return;
    };
    let store = connect(redis.url(), &unique_prefix()).await;
    assert!(
        tower_idempotency::testing::conformance::inspection_shows_the_frozen_request(&store).await,
        "the Redis store shows a record's frozen request in doubt"
    );
}
