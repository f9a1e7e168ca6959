//! What a ledger call costs on PostgreSQL: round trips and latency per fresh operation
//! (`begin` + `complete`) and per replay (`begin`), against `DATABASE_URL`.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo bench --features postgres --bench postgres_op_cost
//! ```
//!
//! Then the transactional server mode: a handler inserting one row through the request's
//! transaction behind `IdempotencyLayer::transactional_server_builder` (called in process,
//! no HTTP), against the same handler running its own `BEGIN` / `INSERT` / `COMMIT` with no
//! layer: the difference is what the ledger adds to the handler's transaction.
//!
//! Then the transactional server mode: a handler inserting one row through the request's
//! transaction behind `IdempotencyLayer::transactional_server_builder` (called in process,
//! no HTTP), against the same insert in its own `BEGIN` / `INSERT` / `COMMIT` with no layer:
//! the difference is what the ledger adds to the handler's transaction.
//! `OP_COST_ONLY=transactional` runs only this part (e.g. under `strace -c` to count the
//! socket writes per request).
//!
//! Round trips are counted by the server: each ledger call is one statement in its own
//! transaction, so the growth of `pg_stat_database.xact_commit` per operation is its
//! number of statements (the store's own connections, prepared once, send one message
//! train per statement). Add `?options=-c%20synchronous_commit%3Doff` to the URL to see the
//! cost without waiting for the disk.

use std::time::{Duration, Instant};

use tower_idempotency::ledger::{
    Begin, BeginRequest, IdempotencyStore, LedgerKey, Outcome, PostgresStore, StoredResponse,
};
use tower_idempotency::{fingerprint::Fingerprint, BoxError};

const OPS: usize = 2000;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let store = PostgresStore::builder(url)
        .schema(format!("op_cost_{:08x}", fastrand::u32(..)))
        .pool_size(1)
        .sweep_every(None)
        .connect()
        .await?;
    store.migrate().await?;
    let fp = Fingerprint::of(&http::Method::POST, "/charges", b"{}");
    let outcome = Outcome::Response(StoredResponse::new(
        http::StatusCode::CREATED,
        http::Version::HTTP_11,
        http::HeaderMap::new(),
        bytes::Bytes::from(vec![b'x'; 1024]),
    ));
    let keys: Vec<LedgerKey> = (0..OPS)
        .map(|_| {
            let mut bytes = [0u8; 32];
            bytes[..16].copy_from_slice(&fastrand::u128(..).to_be_bytes());
            LedgerKey::from_bytes(bytes)
        })
        .collect();
    let request =
        |key| BeginRequest::new(key, fp, Duration::from_secs(10), Duration::from_secs(3600));
    // Warm the pool's connection and its prepared statements.
    let Begin::Acquired { token } = store.begin(request(LedgerKey::from_bytes([1; 32]))).await?
    else {
        return Err("warm-up key was taken".into());
    };
    store
        .complete(
            LedgerKey::from_bytes([1; 32]),
            token,
            outcome.clone(),
            Duration::from_secs(3600),
        )
        .await?;

    if std::env::var("OP_COST_ONLY").as_deref() == Ok("transactional") {
        return transactional(&store).await;
    }
    let before = commits(&store).await?;
    let mut fresh = Vec::with_capacity(OPS);
    for key in &keys {
        let started = Instant::now();
        let Begin::Acquired { token } = store.begin(request(*key)).await? else {
            return Err("fresh key was taken".into());
        };
        store
            .complete(*key, token, outcome.clone(), Duration::from_secs(3600))
            .await?;
        fresh.push(started.elapsed());
    }
    let middle = commits(&store).await?;
    let mut replays = Vec::with_capacity(OPS);
    for key in &keys {
        let started = Instant::now();
        let Begin::Replay(_) = store.begin(request(*key)).await? else {
            return Err("expected a replay".into());
        };
        replays.push(started.elapsed());
    }
    let after = commits(&store).await?;
    // Each `commits` call ends two transactions, counted by the next call.
    report(
        "fresh (begin + complete)",
        &mut fresh,
        format!(
            "{:.2} statements/op",
            (middle - before - 2) as f64 / OPS as f64
        ),
    );
    report(
        "replay (begin)",
        &mut replays,
        format!(
            "{:.2} statements/op",
            (after - middle - 2) as f64 / OPS as f64
        ),
    );
    transactional(&store).await
}

type Body = http_body_util::Full<bytes::Bytes>;

/// The handler's own transaction with and without the transactional layer around it.
async fn transactional(store: &PostgresStore) -> Result<(), BoxError> {
    use tower::{Layer, ServiceExt};
    use tower_idempotency::ledger::PostgresTransaction;
    use tower_idempotency::server::RequestBody;
    use tower_idempotency::IdempotencyLayer;

    let table = format!("{}.rows", store.schema());
    let client = store.pool().get().await?;
    client
        .batch_execute(&format!("CREATE TABLE {table} (n bigint)"))
        .await?;
    let insert = format!("INSERT INTO {table} (n) VALUES (1)");
    let statement = client.prepare_cached(&insert).await?;

    // Baseline: the handler's own transaction, three round trips.
    let mut bare = Vec::with_capacity(OPS);
    for _ in 0..OPS {
        let started = Instant::now();
        client.batch_execute("BEGIN").await?;
        client.execute(&statement, &[]).await?;
        client.batch_execute("COMMIT").await?;
        bare.push(started.elapsed());
    }
    drop(client);

    let handler = tower::service_fn(move |request: http::Request<RequestBody<Body>>| {
        let insert = insert.clone();
        async move {
            let tx = request
                .extensions()
                .get::<PostgresTransaction>()
                .cloned()
                .ok_or("no transaction")?;
            let client = tx.client().await?;
            let statement = client.prepare_cached(&insert).await?;
            client.execute(&statement, &[]).await?;
            let response = http::Response::builder()
                .status(201)
                .body(Body::new(bytes::Bytes::from_static(b"ok")))?;
            Ok::<_, BoxError>(response)
        }
    });
    let layer = IdempotencyLayer::transactional_server_builder(store.clone())
        .unscoped()
        .build()?;
    let service = layer.layer(handler);
    let mut layered = Vec::with_capacity(OPS);
    for n in 0..OPS {
        let key = format!("\"row-{n}-{:08x}\"", fastrand::u32(..));
        let request = http::Request::post("/rows")
            .header("idempotency-key", key)
            .body(Body::new(bytes::Bytes::from_static(b"{}")))?;
        let started = Instant::now();
        let response = service.clone().oneshot(request).await?;
        if response.status() != 201 {
            return Err(format!("unexpected {}", response.status()).into());
        }
        layered.push(started.elapsed());
    }
    // BEGIN, INSERT, COMMIT: three round trips either way; the layer sends its claim with
    // the first and its record with the last.
    report(
        "handler tx, no layer",
        &mut bare,
        "3 round trips".to_owned(),
    );
    report(
        "handler tx, transactional",
        &mut layered,
        "3 round trips (pipelined)".to_owned(),
    );
    Ok(())
}

async fn commits(store: &PostgresStore) -> Result<i64, BoxError> {
    let client = store.pool().get().await?;
    // A backend flushes its statistics at most once a second; make this transaction's end
    // flush them, so the next read counts every transaction before it.
    client
        .batch_execute("SELECT pg_stat_force_next_flush()")
        .await?;
    let row = client
        .query_one(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
            &[],
        )
        .await?;
    Ok(row.get(0))
}

fn report(what: &str, samples: &mut [Duration], count: String) {
    samples.sort();
    let mean = samples.iter().sum::<Duration>() / samples.len() as u32;
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    println!(
        "{what:<26} {count:<28} mean {mean:>9.1?}   p50 {:>9.1?}   p99 {:>9.1?}",
        at(0.5),
        at(0.99)
    );
}
