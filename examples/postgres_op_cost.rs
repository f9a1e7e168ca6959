//! What a ledger call costs on PostgreSQL: round trips and latency per fresh operation
//! (`begin` + `complete`) and per replay (`begin`), against `DATABASE_URL`.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo run --release --features postgres --example postgres_op_cost
//! ```
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
use tower_idempotency::{BoxError, Fingerprint};

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
        (middle - before - 2) as f64 / OPS as f64,
    );
    report(
        "replay (begin)",
        &mut replays,
        (after - middle - 2) as f64 / OPS as f64,
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

fn report(what: &str, samples: &mut [Duration], statements: f64) {
    samples.sort();
    let mean = samples.iter().sum::<Duration>() / samples.len() as u32;
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    println!(
        "{what:<26} {statements:.2} statements/op   mean {mean:>9.1?}   p50 {:>9.1?}   p99 {:>9.1?}",
        at(0.5),
        at(0.99)
    );
}
