//! Two servers over one PostgreSQL, and PostgreSQL killed, restarted and frozen under load,
//! in both server modes: the plain `PostgresStore` ledger, and the transactional mode.
//!
//! PostgreSQL is killed with `SIGKILL` (every process of it: no shutdown, no checkpoint) and
//! restarted after crash recovery, then frozen with `SIGSTOP` for 2 s, so calls in flight
//! time out. A commit it acknowledged survives; what the faults lose is *answers*: claims
//! that applied but never replied, completions and commits whose answer never came. Every
//! operation must end either replayable (its effect happened once) or runnable (it never
//! happened): never charged twice, never stuck answering `409` or `500 outcome-unknown`.
//!
//! The faults need a server of the test's own, so these tests always start one (see
//! `support/postgres.rs`), whatever `DATABASE_URL` says.
#![cfg(all(feature = "postgres", feature = "axum"))]

use crate::support::postgres as postgres_support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::task::JoinSet;
use tower_idempotency::ledger::{PostgresStore, PostgresTransaction};
use tower_idempotency::IdempotencyLayer;

use postgres_support::PostgresServer;

/// Operations started after the faults are over (before, the load runs as long as they do).
const OPERATIONS: usize = 240;
/// Operations in flight at once, across the two servers.
const IN_FLIGHT: usize = 16;
/// Each ledger call's bound: short, so the freeze makes calls time out.
const OPERATION_TIMEOUT: Duration = Duration::from_millis(300);
/// The lease of the plain mode's operations. A live owner renews it, and keeps trying to
/// record its outcome for as long as it lasts; a claim whose answer the faults lost is
/// released in the background before it runs out. It must outlast the faults (a restart
/// with crash recovery, then a 2 s freeze) and that recovery, with room for a loaded
/// machine: at 10 s, one run of the whole suite on a busy machine saw an operation end in
/// doubt (`500 outcome-unknown`), which a lease that runs out first makes of a claim or an
/// outcome the store had not taken back yet.
const LEASE: Duration = Duration::from_secs(20);

/// The two tests each run a PostgreSQL server and a load: one at a time, so neither makes
/// the other's timings on a small machine.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// What the clients saw.
#[derive(Default)]
struct Seen {
    /// Answers that told a client to come back (409, 503, a dropped connection).
    come_back: AtomicUsize,
    /// Operations that took over half a second to settle: proof the faults hit operations
    /// in flight (unhindered, one takes about 20 ms).
    slowed: AtomicUsize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// `IdempotencyLayer::server_builder(PostgresStore)`: the handler's effect is counted
    /// in memory, per key.
    Store,
    /// `IdempotencyLayer::transactional_server_builder`: the handler's effect is a row
    /// written in the request's transaction, counted per key in the database.
    Transactional,
}

/// Handler runs per key (the plain mode's effect).
type Runs = Arc<Mutex<HashMap<String, usize>>>;

#[derive(Clone)]
struct Charges {
    runs: Runs,
    schema: String,
}

fn key_of(headers: &HeaderMap) -> String {
    headers["idempotency-key"].to_str().unwrap().to_owned()
}

/// The plain mode's charge: 20 ms at the payment provider, then one more run of its key.
async fn charge(State(charges): State<Charges>, headers: HeaderMap) -> (StatusCode, String) {
    let key = key_of(&headers);
    tokio::time::sleep(Duration::from_millis(20)).await;
    let run = {
        let mut runs = charges.runs.lock().unwrap();
        let n = runs.entry(key.clone()).or_default();
        *n += 1;
        *n as u64
    };
    (
        StatusCode::CREATED,
        format!("{{\"key\":{key},\"run\":{run}}}"),
    )
}

/// The transactional mode's charge: a row with a run id of its own, written in the
/// request's transaction, then 20 ms at the payment provider. A failed write answers `503`:
/// the transaction rolls back, and the client's retry runs the charge again.
async fn charge_in_transaction(
    State(charges): State<Charges>,
    tx: PostgresTransaction,
    headers: HeaderMap,
) -> (StatusCode, String) {
    let key = key_of(&headers);
    let run = fastrand::i64(1..i64::MAX);
    let written = match tx.client().await {
        Ok(client) => client
            .execute(
                &format!(
                    "INSERT INTO {}.effects (key, run) VALUES ($1, $2)",
                    charges.schema
                ),
                &[&key, &run],
            )
            .await
            .map_err(|err| err.to_string()),
        Err(err) => Err(err.to_string()),
    };
    if let Err(err) = written {
        return (StatusCode::SERVICE_UNAVAILABLE, err);
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    (
        StatusCode::CREATED,
        format!("{{\"key\":{key},\"run\":{run}}}"),
    )
}

async fn store(url: &str, schema: &str) -> PostgresStore {
    PostgresStore::builder(url)
        .schema(schema)
        .operation_timeout(OPERATION_TIMEOUT)
        .connection_timeout(Duration::from_secs(1))
        .pool_size(12)
        .connect()
        .await
        .expect("connect to the ledger")
}

async fn replica(mode: Mode, url: &str, charges: Charges) -> SocketAddr {
    let store = store(url, &charges.schema).await;
    let route = match mode {
        Mode::Store => post(charge).route_layer(
            IdempotencyLayer::server_builder(store)
                .lease(LEASE)
                .build()
                .unwrap(),
        ),
        Mode::Transactional => post(charge_in_transaction).route_layer(
            IdempotencyLayer::transactional_server_builder(store)
                .build()
                .unwrap(),
        ),
    };
    let app = Router::new().route("/charges", route).with_state(charges);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

/// Send operation `n` until it gets a 201 (first run or replay), retrying what a client
/// would retry: 409 in-flight, 503 (the ledger unavailable, a commit unknown, the
/// handler's own failed write), a dropped connection. A `500` (outcome unknown) is a
/// failure of the guarantee, and fails the test.
async fn run_operation(
    client: HttpClient,
    replicas: [SocketAddr; 2],
    seen: Arc<Seen>,
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
                    if started.elapsed() > Duration::from_millis(500) {
                        seen.slowed.fetch_add(1, Ordering::Relaxed);
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
        seen.come_back.fetch_add(1, Ordering::Relaxed);
        assert!(
            tokio::time::Instant::now() < deadline,
            "operation {n} never settled"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    unreachable!()
}

/// The run id in a charge's answer.
fn run_of(body: &Bytes) -> i64 {
    let json: serde_json::Value = serde_json::from_slice(body).expect("a charge");
    json["run"].as_i64().expect("a run id")
}

async fn killed_restarted_and_frozen_under_load(mode: Mode) {
    let _alone = ONE_AT_A_TIME.lock().await;
    let Some(mut pg) = PostgresServer::spawn().await else {
        return;
    };
    let url = pg.url();
    let charges = Charges {
        runs: Runs::default(),
        schema: postgres_support::fresh_schema(),
    };
    {
        let setup = store(&url, &charges.schema).await;
        setup.migrate().await.expect("migrate");
        setup
            .pool()
            .get()
            .await
            .expect("a connection")
            .batch_execute(&format!(
                "CREATE TABLE {}.effects (key text NOT NULL, run bigint NOT NULL)",
                charges.schema
            ))
            .await
            .expect("create the effects table");
    }
    let replicas = [
        replica(mode, &url, charges.clone()).await,
        replica(mode, &url, charges.clone()).await,
    ];
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let seen = Arc::new(Seen::default());

    // The faults, while the load runs: PostgreSQL killed, and restarted a moment later
    // (crash recovery), then frozen for 2 s (a stalled disk, a paused VM).
    let faults = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        pg = tokio::task::spawn_blocking(move || {
            pg.kill();
            pg
        })
        .await
        .unwrap();
        tokio::time::sleep(Duration::from_millis(400)).await;
        pg.restart().await;
        tokio::time::sleep(Duration::from_millis(500)).await;
        pg.pause();
        tokio::time::sleep(Duration::from_secs(2)).await;
        pg.resume();
        pg
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
            load.spawn(run_operation(
                client.clone(),
                replicas,
                seen.clone(),
                started,
            ));
            started += 1;
        }
        match load.join_next().await {
            Some(finished) => done.push(finished.unwrap()),
            None if !more => break,
            None => {}
        }
    }
    let pg = faults.await.unwrap();
    assert_eq!(done.len(), started);
    let come_back = seen.come_back.load(Ordering::Relaxed);
    let slowed = seen.slowed.load(Ordering::Relaxed);
    eprintln!(
        "{mode:?}: {started} operations; {slowed} slowed by the faults; {come_back} answers \
         asked a client to come back"
    );
    assert!(slowed > 0, "the faults hit no operation in flight");

    // Each operation's effect happened exactly once, and its answer is that effect's.
    let effects: HashMap<String, Vec<i64>> = match mode {
        Mode::Store => charges
            .runs
            .lock()
            .unwrap()
            .iter()
            .map(|(key, runs)| (key.clone(), (1..=*runs as i64).collect()))
            .collect(),
        Mode::Transactional => {
            let (db, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .expect("connect");
            tokio::spawn(connection);
            let rows = db
                .query(
                    &format!("SELECT key, run FROM {}.effects", charges.schema),
                    &[],
                )
                .await
                .expect("read the effects");
            let mut effects: HashMap<String, Vec<i64>> = HashMap::new();
            for row in rows {
                effects.entry(row.get(0)).or_default().push(row.get(1));
            }
            effects
        }
    };
    assert_eq!(effects.len(), started, "every operation took effect");
    let twice: Vec<_> = effects.iter().filter(|(_, runs)| runs.len() != 1).collect();
    assert!(twice.is_empty(), "charged more than once: {twice:?}");
    for (key, body) in &done {
        assert_eq!(
            effects[key],
            [run_of(body)],
            "{key}: the answer is its one effect's"
        );
    }
    // Nothing is stranded: every operation now replays its one effect, through either
    // server.
    for (key, first) in &done {
        let n: usize = key.trim_matches('"')["op-".len()..].parse().unwrap();
        let (_, again) = run_operation(client.clone(), replicas, seen.clone(), n).await;
        assert_eq!(&again, first, "operation {n} replays its one effect");
    }
    drop(pg);
}

// After the freeze, a `begin` whose answer was lost can still be queued in PostgreSQL when
// the engine's background release of its claim is answered (the backends resume in no
// particular order). The release leaves the key released under the token, so the late
// `begin` is refused instead of making a claim nobody uses, which would read as in doubt
// (`500 outcome-unknown`) once its lease ran out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_killed_restarted_and_frozen_under_load_store_mode_charges_once() {
    killed_restarted_and_frozen_under_load(Mode::Store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_killed_restarted_and_frozen_under_load_transactional_mode_charges_once() {
    killed_restarted_and_frozen_under_load(Mode::Transactional).await;
}
