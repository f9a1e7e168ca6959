//! The demo server's PostgreSQL mode (`examples/axum_server.rs`, `LEDGER=postgres`): the
//! charge and its recorded response commit in one transaction.
//!
//! The crash test runs the demo in a real process: this test binary started again with
//! `DEMO_SERVER_DATABASE_URL` set runs only [`demo_server_process`], which serves the
//! example's `postgres::app` on a loopback port (no `cargo` needed at test time). It is
//! killed with `SIGKILL` after the charge is written and before the commit, restarted, and
//! the client's retry must charge once and get the real response.
#![cfg(all(feature = "postgres", feature = "axum"))]

use crate::support::axum_server;
use crate::support::postgres as postgres_support;

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower_idempotency::ledger::PostgresStore;

const CHILD_URL: &str = "DEMO_SERVER_DATABASE_URL";
const CHILD_SCHEMA: &str = "DEMO_SERVER_SCHEMA";
const CHILD_HOLD: &str = "DEMO_SERVER_HOLD_MS";

/// Not a test of its own: the body of the demo server process the crash test starts.
#[test]
fn demo_server_process() {
    let Ok(url) = std::env::var(CHILD_URL) else {
        return;
    };
    let schema = std::env::var(CHILD_SCHEMA).expect("schema");
    let hold = Duration::from_millis(
        std::env::var(CHILD_HOLD)
            .expect("hold")
            .parse()
            .expect("ms"),
    );
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    runtime.block_on(async move {
        let store = PostgresStore::builder(url)
            .schema(schema)
            .connect()
            .await
            .expect("connect");
        let app = axum_server::postgres::app(store, Duration::ZERO, hold)
            .await
            .expect("the demo app");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        println!("listening on {}", listener.local_addr().expect("address"));
        axum::serve(listener, app).await.expect("serve");
    });
}

/// A demo server process, its stdout lines arriving on `lines`.
struct DemoServer {
    child: Child,
    addr: SocketAddr,
    lines: mpsc::Receiver<String>,
}

impl DemoServer {
    fn start(url: &str, schema: &str, hold: Duration) -> Self {
        let mut child = Command::new(std::env::current_exe().expect("this test binary"))
            .args([
                test_name("demo_server_process").as_str(),
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_URL, url)
            .env(CHILD_SCHEMA, schema)
            .env(CHILD_HOLD, hold.as_millis().to_string())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the demo server process");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let mut server = Self {
            child,
            addr: "127.0.0.1:1".parse().expect("placeholder"),
            lines,
        };
        let listening = server.wait_for("listening on ");
        server.addr = listening.trim().parse().expect("an address");
        server
    }

    /// What follows `prefix` in the first line of the process's output that has it (the
    /// test harness may have printed the test's name before it on the same line).
    fn wait_for(&self, prefix: &str) -> String {
        loop {
            let line = self
                .lines
                .recv_timeout(Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("the demo server never printed {prefix:?}"));
            if let Some(at) = line.find(prefix) {
                return line[at + prefix.len()..].to_owned();
            }
        }
    }

    fn kill(&mut self) {
        // `Child::kill` is SIGKILL on Unix: no shutdown, no commit, no rollback by us.
        self.child.kill().expect("SIGKILL the demo server");
        self.child.wait().expect("reap it");
    }
}

impl Drop for DemoServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 exchange over a fresh loopback connection: the status, the headers and the
/// body, or `None` when the connection ended without a response.
async fn post_charge(addr: SocketAddr, key: &str, body: &str) -> Option<(u16, String, String)> {
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let request = format!(
        "POST /charges HTTP/1.1\r\nhost: {addr}\r\nauthorization: tenant-a\r\n\
         idempotency-key: \"{key}\"\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await.ok()?;
    let response = String::from_utf8(response).ok()?;
    let (head, body) = response.split_once("\r\n\r\n")?;
    let status = head.split(' ').nth(1)?.parse().ok()?;
    Some((status, head.to_ascii_lowercase(), body.to_owned()))
}

async fn charges_of(url: &str, order: &str) -> Vec<(i64, i64)> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("connect");
    tokio::spawn(connection);
    client
        .query(
            "SELECT charge_id, amount_cents FROM charges WHERE order_id = $1",
            &[&order],
        )
        .await
        .expect("read charges")
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_killed_between_the_charge_and_the_commit_charges_once_on_retry() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let url = pg.url().to_owned();
    let schema = postgres_support::fresh_schema();
    let order = format!("order-{:08x}", fastrand::u32(..));
    let body = format!("{{\"order_id\":\"{order}\",\"amount_cents\":1999}}");
    let key = format!("{order}-charge");

    let mut first = DemoServer::start(&url, &schema, Duration::from_secs(120));
    let addr = first.addr;
    let attempt = tokio::spawn({
        let (key, body) = (key.clone(), body.clone());
        async move { post_charge(addr, &key, &body).await }
    });
    let written = tokio::task::spawn_blocking(move || {
        let line = first.wait_for("charge ch_");
        first.kill();
        line
    })
    .await
    .expect("kill the server");
    assert!(written.ends_with("written, not committed"), "{written}");
    assert_eq!(
        attempt.await.expect("client task"),
        None,
        "the first attempt got no answer"
    );
    // PostgreSQL rolled the transaction back: neither the charge nor a record is left.
    assert!(charges_of(&url, &order).await.is_empty());

    let second = DemoServer::start(&url, &schema, Duration::ZERO);
    let (status, head, retried) = post_charge(second.addr, &key, &body)
        .await
        .expect("the retry is answered");
    assert_eq!(status, 201, "{head}\n{retried}");
    assert!(!head.contains("idempotent-replayed"), "{head}");
    let charges = charges_of(&url, &order).await;
    assert_eq!(charges.len(), 1, "one charge: {charges:?}");
    let charge: axum_server::Charge = serde_json::from_str(&retried).expect("a charge");
    assert_eq!(charge.charge_id, format!("ch_{}", charges[0].0));
    assert_eq!(charge.amount_cents, 1999);

    // And the retry after that replays the committed record: the same charge, no new row.
    let (status, head, replayed) = post_charge(second.addr, &key, &body)
        .await
        .expect("answered");
    assert_eq!(status, 201);
    assert!(head.contains("idempotent-replayed: true"), "{head}");
    assert_eq!(replayed, retried);
    assert_eq!(charges_of(&url, &order).await.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_duplicates_in_transactional_mode_charge_once() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let url = pg.url().to_owned();
    let store = PostgresStore::builder(&url)
        .schema(postgres_support::fresh_schema())
        .pool_size(24)
        .connect()
        .await
        .expect("connect");
    let app = axum_server::postgres::app(store, Duration::from_millis(50), Duration::ZERO)
        .await
        .expect("app");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move { axum::serve(listener, app).await });

    let order = format!("order-{:08x}", fastrand::u32(..));
    let body = format!("{{\"order_id\":\"{order}\",\"amount_cents\":500}}");
    let key = format!("{order}-charge");
    let attempts: Vec<_> = (0..16)
        .map(|_| {
            let (key, body) = (key.clone(), body.clone());
            tokio::spawn(async move { post_charge(addr, &key, &body).await })
        })
        .collect();
    let mut created = 0;
    for attempt in attempts {
        let (status, head, _) = attempt.await.expect("task").expect("answered");
        match status {
            201 => created += 1,
            409 => assert!(head.contains("retry-after"), "{head}"),
            other => panic!("unexpected {other}: {head}"),
        }
    }
    assert!(created >= 1, "the first request charged");
    assert_eq!(charges_of(&url, &order).await.len(), 1, "one charge");
    // Every 201 after the first was a replay of the one charge.
    let (status, head, _) = post_charge(addr, &key, &body).await.expect("answered");
    assert_eq!(status, 201);
    assert!(head.contains("idempotent-replayed: true"), "{head}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_payload_is_recorded_and_a_failed_handler_leaves_nothing() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let url = pg.url().to_owned();
    let store = PostgresStore::builder(&url)
        .schema(postgres_support::fresh_schema())
        .connect()
        .await
        .expect("connect");
    let app = axum_server::postgres::app(store.clone(), Duration::ZERO, Duration::ZERO)
        .await
        .expect("app");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move { axum::serve(listener, app).await });

    // A 4xx is an outcome: recorded and replayed, like in every other mode.
    let (status, _, _) = post_charge(addr, "bad-1", "{\"order_id\":1}")
        .await
        .expect("answered");
    assert_eq!(status, 400);
    let (status, head, _) = post_charge(addr, "bad-1", "{\"order_id\":1}")
        .await
        .expect("answered");
    assert_eq!(status, 400);
    assert!(head.contains("idempotent-replayed: true"), "{head}");

    // The insert fails (the amount does not fit a bigint after the table is narrowed):
    // the handler answers 500, the transaction rolls back, and nothing is recorded.
    let client = store.pool().get().await.expect("connection");
    client
        .batch_execute("ALTER TABLE charges ADD CONSTRAINT positive CHECK (amount_cents > 0)")
        .await
        .expect("constrain");
    let order = format!("order-{:08x}", fastrand::u32(..));
    let negative = format!("{{\"order_id\":\"{order}\",\"amount_cents\":-1}}");
    let (status, _, _) = post_charge(addr, "neg-1", &negative)
        .await
        .expect("answered");
    assert_eq!(status, 500);
    // Not recorded: the same key runs again (and fails again), never a replay.
    let (status, head, _) = post_charge(addr, "neg-1", &negative)
        .await
        .expect("answered");
    assert_eq!(status, 500);
    assert!(!head.contains("idempotent-replayed"), "{head}");
    assert!(charges_of(&url, &order).await.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_starting_together_on_a_fresh_database_all_start() {
    // A database of its own: fresh, with no `charges` table yet.
    let Some(server) = postgres_support::PostgresServer::spawn().await else {
        return;
    };
    let url = server.url();
    let schema = postgres_support::fresh_schema();
    // Started at the same instant, each migrates the ledger and creates the table.
    let replicas: Vec<_> = (0..3)
        .map(|_| {
            let (url, schema) = (url.clone(), schema.clone());
            std::thread::spawn(move || DemoServer::start(&url, &schema, Duration::ZERO))
        })
        .collect();
    let replicas: Vec<DemoServer> = replicas
        .into_iter()
        .map(|replica| replica.join().expect("every replica started"))
        .collect();
    // And they serve: a charge through one replays through another.
    let order = format!("order-{:08x}", fastrand::u32(..));
    let body = format!("{{\"order_id\":\"{order}\",\"amount_cents\":700}}");
    let (status, _, charged) = post_charge(replicas[0].addr, "together", &body)
        .await
        .expect("answered");
    assert_eq!(status, 201, "{charged}");
    let (status, head, replayed) = post_charge(replicas[2].addr, "together", &body)
        .await
        .expect("answered");
    assert_eq!(status, 201);
    assert!(head.contains("idempotent-replayed: true"), "{head}");
    assert_eq!(replayed, charged);
    assert_eq!(charges_of(&url, &order).await.len(), 1);
}

/// The libtest name of a test in this module: its path inside the test binary, which the
/// binary's crate name does not prefix.
fn test_name(function: &str) -> String {
    let module = module_path!();
    let in_binary = module.split_once("::").map_or(module, |(_, rest)| rest);
    format!("{in_binary}::{function}")
}
