//! `idempotency-records`, the operator's terminal tool, against a real Redis and a real
//! PostgreSQL: it finds an operation left in doubt, shows its look, resolves it as not
//! applied with that look, and refuses the same look a second time.
#![cfg(all(feature = "redis", feature = "postgres"))]

use std::process::Output;
use std::time::Duration;

use crate::support::{postgres as postgres_support, redis as redis_support};
use tower_idempotency::ledger::{
    Begin, BeginRequest, IdempotencyStore, LedgerKey, PostgresStore, RedisStore,
};
use tower_idempotency::testing::conformance::sample_fingerprint;

const TOOL: &str = env!("CARGO_BIN_EXE_idempotency-records");

/// Run the tool off the test's runtime (it blocks), with `store` naming the ledger.
async fn run(store: &[String], command: &[&str]) -> Output {
    let args: Vec<String> = store
        .iter()
        .cloned()
        .chain(command.iter().map(|arg| arg.to_string()))
        .collect();
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(TOOL)
            .args(&args)
            .env("USER", "alice")
            .output()
            .expect("the tool runs")
    })
    .await
    .expect("the tool's thread")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// An operation left in doubt in `store`: its key.
async fn left_in_doubt(store: &dyn IdempotencyStore) -> LedgerKey {
    let mut bytes = [0u8; 32];
    bytes[..16].copy_from_slice(&fastrand::u128(..).to_be_bytes());
    bytes[16..].copy_from_slice(&fastrand::u128(..).to_be_bytes());
    let key = LedgerKey::from_bytes(bytes);
    let retention = Duration::from_secs(600);
    let request = BeginRequest::new(
        key,
        sample_fingerprint(),
        Duration::from_secs(30),
        retention,
    );
    let Begin::Acquired { token } = store.begin(request).await.expect("begin") else {
        panic!("a fresh key is acquired");
    };
    store
        .mark_in_doubt(key, token, retention)
        .await
        .expect("mark in doubt");
    key
}

/// The whole round on one store: summary, list, show, resolve, resolve again.
async fn resolve_from_the_terminal(store: &dyn IdempotencyStore, args: Vec<String>) {
    let key = left_in_doubt(store).await;
    let hex = key.to_hex();

    let summary = run(&args, &["summary"]).await;
    assert!(summary.status.success(), "{summary:?}");
    assert!(
        stdout(&summary).contains("operations in doubt"),
        "{}",
        stdout(&summary)
    );

    let listed = run(&args, &["list", "--state", "in_doubt", "--limit", "1000"]).await;
    assert!(listed.status.success(), "{listed:?}");
    assert!(stdout(&listed).contains(&hex), "{}", stdout(&listed));

    let shown = run(&args, &["show", &hex]).await;
    assert!(shown.status.success(), "{shown:?}");
    let shown = stdout(&shown);
    assert!(shown.contains("in doubt"), "{shown}");
    let look = shown
        .lines()
        .find_map(|line| line.strip_prefix("look"))
        .expect("show prints the record's look")
        .trim()
        .to_owned();

    let without_reason = run(&args, &["resolve-not-applied", &hex, "--look", &look]).await;
    assert_eq!(without_reason.status.code(), Some(2), "{without_reason:?}");
    assert!(store.inspect(key).await.expect("inspect").is_some());

    let reason = "no charge at the provider";
    let resolved = run(
        &args,
        &[
            "resolve-not-applied",
            &hex,
            "--look",
            &look,
            "--reason",
            reason,
        ],
    )
    .await;
    assert!(resolved.status.success(), "{resolved:?}");
    let audit = String::from_utf8_lossy(&resolved.stderr);
    assert!(
        audit.contains("operator=\"alice\"") && audit.contains(reason),
        "the action is logged with its operator and reason: {audit}"
    );
    assert!(
        store.inspect(key).await.expect("inspect").is_none(),
        "resolved as not applied: the record is gone, the next run sends"
    );

    let again = run(
        &args,
        &[
            "resolve-not-applied",
            &hex,
            "--look",
            &look,
            "--reason",
            reason,
        ],
    )
    .await;
    assert_eq!(again.status.code(), Some(3), "{again:?}");

    let forged = run(&args, &["show", "not-a-key"]).await;
    assert_eq!(forged.status.code(), Some(2), "{forged:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_resolves_an_operation_in_doubt_on_redis_from_a_terminal() {
    let Some(redis) = redis_support::redis_url().await else {
        return;
    };
    let prefix = format!("records-cli-{:016x}:", fastrand::u64(..));
    let store = RedisStore::builder(redis.url())
        .prefix(prefix.clone())
        .connect()
        .await
        .expect("connect");
    let args = vec![
        "--redis".to_owned(),
        redis.url().to_owned(),
        "--prefix".to_owned(),
        prefix,
    ];
    resolve_from_the_terminal(&store, args).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_resolves_an_operation_in_doubt_on_postgres_from_a_terminal() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let schema = postgres_support::fresh_schema();
    let store = PostgresStore::builder(pg.url())
        .schema(schema.clone())
        .connect()
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    let args = vec![
        "--postgres".to_owned(),
        pg.url().to_owned(),
        "--schema".to_owned(),
        schema,
    ];
    resolve_from_the_terminal(&store, args).await;
}
