//! Throughput of the demo payments service (`examples/axum_server.rs`) with `LEDGER=memory`
//! against `LEDGER=postgres` (transactional mode, charges in a table), in one run.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo bench --features postgres --bench demo_throughput
//! ```
//!
//! Both services run in this process on one runtime, on loopback, and are driven in
//! alternating rounds (memory, postgres, memory, …) by a hyper-util client keeping
//! `DEMO_CONCURRENCY` (default 32) requests in flight for `DEMO_SECS` (default 2) per round.
//! Every request is a new charge under a new key (a fresh operation: claim, charge, record).
//! The provider's simulated latency is zero, so the numbers are the services' own cost.
//! Prints requests per second per round, and the medians. The memory ledger gets a budget
//! no run fills.

#[path = "../examples/axum_server.rs"]
#[allow(dead_code)]
mod axum_server;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tower_idempotency::ledger::{MemoryStore, PostgresStore};
use tower_idempotency::BoxError;

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let concurrency: usize = env_or("DEMO_CONCURRENCY", 32);
    let secs: f64 = env_or("DEMO_SECS", 2.0);
    let rounds: usize = env_or("DEMO_ROUNDS", 3);

    // A budget no run fills: the memory ledger must not refuse claims (it would, rightly,
    // once full of records inside their protected window).
    let memory_store = MemoryStore::builder().max_bytes(4 << 30).build();
    let memory = serve(axum_server::app(memory_store, Duration::ZERO)).await?;
    let store = PostgresStore::builder(url)
        .schema(format!("demo_{:08x}", fastrand::u32(..)))
        .pool_size(concurrency + 4)
        .connect()
        .await?;
    let postgres =
        serve(axum_server::postgres::app(store, Duration::ZERO, Duration::ZERO).await?).await?;

    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let mut results: Vec<(&str, Vec<f64>)> = vec![("memory", Vec::new()), ("postgres", Vec::new())];
    for round in 0..rounds {
        for (index, addr) in [memory, postgres].into_iter().enumerate() {
            let rps = drive(&client, addr, concurrency, Duration::from_secs_f64(secs)).await?;
            eprintln!("round {round} {}: {rps:.0} req/s", results[index].0);
            results[index].1.push(rps);
        }
    }
    for (name, mut samples) in results {
        samples.sort_by(f64::total_cmp);
        println!(
            "LEDGER={name:<9} median {:>7.0} req/s over {rounds} rounds of {secs} s, {concurrency} in flight",
            samples[samples.len() / 2]
        );
    }
    Ok(())
}

async fn serve(app: axum::Router) -> Result<SocketAddr, BoxError> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok(addr)
}

/// Keep `concurrency` fresh charges in flight for `time`; answers completed requests per second.
async fn drive(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>>,
    addr: SocketAddr,
    concurrency: usize,
    time: Duration,
) -> Result<f64, BoxError> {
    let done = Arc::new(AtomicU64::new(0));
    let deadline = Instant::now() + time;
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (client, done) = (client.clone(), done.clone());
            tokio::spawn(async move {
                while Instant::now() < deadline {
                    let order = format!("order-{:016x}", fastrand::u64(..));
                    let body = format!("{{\"order_id\":\"{order}\",\"amount_cents\":1999}}");
                    let request = http::Request::post(format!("http://{addr}/charges"))
                        .header("authorization", "tenant-a")
                        .header("idempotency-key", format!("\"{order}\""))
                        .header("content-type", "application/json")
                        .body(Full::new(Bytes::from(body)))?;
                    let response = client.request(request).await?;
                    let status = response.status();
                    response.into_body().collect().await?;
                    if status != http::StatusCode::CREATED {
                        return Err::<(), BoxError>(format!("unexpected {status}").into());
                    }
                    done.fetch_add(1, Ordering::Relaxed);
                }
                Ok(())
            })
        })
        .collect();
    let started = Instant::now();
    for worker in workers {
        worker.await??;
    }
    Ok(done.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}

fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|value| value.parse().ok())
        .unwrap_or(default)
}
