//! A small payments service whose charges happen once per `Idempotency-Key`.
//!
//! ```text
//! cargo run --example axum_server            # PORT=3000, CHARGE_LATENCY_MS=20
//! # a duplicate of a charge in progress waits for its response instead of getting a 409:
//! IN_FLIGHT=wait cargo run --example axum_server
//! # several instances on one shared ledger:
//! LEDGER=redis REDIS_URL=redis://127.0.0.1:6379/ PORT=3001 cargo run --features redis --example axum_server
//! # or on a Redis Cluster (any of its nodes will do; more are tried if one is down):
//! LEDGER=redis-cluster REDIS_CLUSTER_URLS=redis://127.0.0.1:7000,redis://127.0.0.1:7001 \
//!     PORT=3002 cargo run --features redis-cluster --example axum_server
//! # the charges table and the ledger in one PostgreSQL database, committed together:
//! LEDGER=postgres DATABASE_URL=postgres://app@127.0.0.1/payments cargo run --features postgres --example axum_server
//! # or PostgreSQL as a plain shared ledger (charges kept in memory, as with Redis):
//! LEDGER=postgres-store DATABASE_URL=postgres://app@127.0.0.1/payments cargo run --features postgres --example axum_server
//!
//! curl -i localhost:3000/charges -H 'authorization: tenant-a' \
//!      -H 'idempotency-key: "order-42-charge"' -H 'content-type: application/json' \
//!      -d '{"order_id":"order-42","amount_cents":1999}'
//! # the same command again: the same 201, with `idempotent-replayed: true`
//! curl -s 'localhost:3000/charges?order_id=order-42' -H 'authorization: tenant-a'
//! ```
//!
//! - `POST /charges` takes `{"order_id", "amount_cents"}`, needs an `Idempotency-Key`,
//!   waits `CHARGE_LATENCY_MS` for the (simulated) payment provider, records the charge and
//!   answers `201` with `{"charge_id", "order_id", "amount_cents"}`.
//! - `GET /charges?order_id=X` lists the caller's charges for that order.
//! - The tenant is the `Authorization` header's value; without one, `401`.
//! - `IN_FLIGHT=409` (the default) answers a duplicate of a charge still in progress with
//!   `409` and `Retry-After`, as the IETF draft says; `IN_FLIGHT=wait` makes it wait (up to
//!   `IN_FLIGHT_WAIT_MS`, default 10 000) for the first request's response and replay it.
//!   Both apply with every `LEDGER`.
//!
//! Authentication runs **outside** the idempotency layer, so the layer can scope keys by
//! the authenticated tenant (one tenant's key never meets another's) and unauthenticated
//! requests never reach the ledger.
//!
//! With `LEDGER=postgres` ([`postgres::app`]) the charges live in a `charges` table of the
//! ledger's database, and the idempotency layer runs in transactional mode: the handler
//! inserts the charge in the request's transaction, and the layer records the response in
//! the same transaction before it commits. A crash before the commit leaves neither the
//! charge nor a record (the retry charges once); after it, the retry replays. Any number
//! of instances may start at once on a fresh database: the ledger's migration and the
//! `charges` table are each created by one of them while the others wait.
//! `LEDGER=postgres-store` uses the same database as a plain shared ledger instead
//! ([`PostgresStore`](tower_idempotency::ledger::PostgresStore) behind
//! [`app_with`]), with the charges in memory as in the other modes.
//!
//! The tests in `tests/server_side/server.rs` include this file and drive [`app`] over real TCP;
//! `tests/server_side/postgres_server.rs` runs the PostgreSQL mode in a real process and kills it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::rejection::JsonRejection;
use axum::extract::{Query, Request, State};
use axum::http::header::{AUTHORIZATION, WWW_AUTHENTICATE};
use axum::http::StatusCode;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use serde::{Deserialize, Serialize};
use tower_idempotency::ledger::{IdempotencyStore, MemoryStore};
use tower_idempotency::{BoxError, BusyPolicy, IdempotencyLayer};

/// The authenticated caller: here simply the `Authorization` header's value.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Tenant(pub String);

/// The body of `POST /charges`.
#[derive(Debug, Deserialize)]
pub struct NewCharge {
    pub order_id: String,
    pub amount_cents: i64,
}

/// A recorded charge, as `POST /charges` and `GET /charges` return it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Charge {
    pub charge_id: String,
    pub order_id: String,
    pub amount_cents: i64,
}

#[derive(Clone)]
struct Payments {
    charges: Arc<Mutex<HashMap<Tenant, Vec<Charge>>>>,
    next_id: Arc<AtomicU64>,
    provider_latency: Duration,
}

/// The whole service over an idempotency `store`; the payment provider takes
/// `provider_latency` per charge.
#[allow(dead_code)]
pub fn app(store: impl IdempotencyStore, provider_latency: Duration) -> Router {
    app_with(store, provider_latency, BusyPolicy::Fail)
}

/// [`app`], with duplicates of an in-flight charge handled per `in_flight`.
pub fn app_with(
    store: impl IdempotencyStore,
    provider_latency: Duration,
    in_flight: BusyPolicy,
) -> Router {
    let idempotency = IdempotencyLayer::server_builder(store)
        .busy_policy(in_flight)
        // Keys belong to the tenant the authentication middleware found.
        .scope(|parts| {
            parts
                .extensions
                .get::<Tenant>()
                .map(|t| t.0.clone())
                .unwrap_or_default()
        })
        .build()
        .expect("valid idempotency settings");
    let payments = Payments {
        charges: Arc::default(),
        next_id: Arc::new(AtomicU64::new(1)),
        provider_latency,
    };
    // The layers go on the method router, around the methods it serves: axum's own answers
    // (`404` for an unknown path, `405` for a method `/charges` does not serve) are given
    // outside them, untouched. Layered on the whole `Router`, the idempotency layer would
    // also wrap the `405` fallback: a keyless `PATCH` would get `400 key-missing`, and a
    // keyed one would have its `405` recorded and replayed.
    let charges = post(create_charge)
        // Only `POST` goes through the ledger.
        .route_layer(idempotency)
        .get(list_charges)
        // Added last, so it runs first, for every method served: no tenant, no ledger access.
        .route_layer(middleware::from_fn(authenticate));
    Router::new()
        .route("/charges", charges)
        .with_state(payments)
}

async fn authenticate(mut req: Request, next: Next) -> Response {
    let tenant = req
        .headers()
        .get(AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .filter(|value| !value.is_empty())
        .map(|value| Tenant(value.to_owned()));
    match tenant {
        Some(tenant) => {
            req.extensions_mut().insert(tenant);
            next.run(req).await
        }
        None => (
            StatusCode::UNAUTHORIZED,
            [(WWW_AUTHENTICATE, "Bearer")],
            "an Authorization header naming the tenant is required\n",
        )
            .into_response(),
    }
}

async fn create_charge(
    State(payments): State<Payments>,
    Extension(tenant): Extension<Tenant>,
    payload: Result<Json<NewCharge>, JsonRejection>,
) -> Result<(StatusCode, Json<Charge>), (StatusCode, String)> {
    let Json(new) =
        payload.map_err(|rejection| (StatusCode::BAD_REQUEST, rejection.body_text()))?;
    // The payment provider's round trip.
    tokio::time::sleep(payments.provider_latency).await;
    let charge = Charge {
        charge_id: format!("ch_{}", payments.next_id.fetch_add(1, Ordering::Relaxed)),
        order_id: new.order_id,
        amount_cents: new.amount_cents,
    };
    payments
        .charges
        .lock()
        .expect("no handler panics while holding the lock")
        .entry(tenant)
        .or_default()
        .push(charge.clone());
    Ok((StatusCode::CREATED, Json(charge)))
}

#[derive(Deserialize)]
struct ChargesOf {
    order_id: String,
}

async fn list_charges(
    State(payments): State<Payments>,
    Extension(tenant): Extension<Tenant>,
    Query(query): Query<ChargesOf>,
) -> Json<Vec<Charge>> {
    let charges = payments
        .charges
        .lock()
        .expect("no handler panics while holding the lock");
    let of_order = charges
        .get(&tenant)
        .into_iter()
        .flatten()
        .filter(|charge| charge.order_id == query.order_id)
        .cloned()
        .collect();
    Json(of_order)
}

/// The ledger: the one place that decides which store backs the service: the embedded
/// store for one process, or Redis (`LEDGER=redis` and `REDIS_URL`, with the `redis`
/// feature) so several instances share one ledger, or a Redis Cluster
/// (`LEDGER=redis-cluster` and `REDIS_CLUSTER_URLS`, with the `redis-cluster` feature), or
/// PostgreSQL (`LEDGER=postgres-store` and `DATABASE_URL`, with the `postgres` feature).
/// `LEDGER=postgres` is the transactional mode, served by [`postgres::app_with`] instead.
#[allow(dead_code)]
async fn ledger() -> Result<Arc<dyn IdempotencyStore>, BoxError> {
    match std::env::var("LEDGER").as_deref() {
        Ok("redis") => redis_ledger().await,
        Ok("redis-cluster") => redis_cluster_ledger().await,
        Ok("postgres-store") => postgres_ledger().await,
        Ok("memory") | Err(_) => Ok(Arc::new(MemoryStore::new())),
        Ok(other) => Err(format!(
            "LEDGER={other:?}: expected `memory`, `redis`, `redis-cluster`, `postgres` or \
             `postgres-store`"
        )
        .into()),
    }
}

#[allow(dead_code)]
#[cfg(feature = "redis")]
async fn redis_ledger() -> Result<Arc<dyn IdempotencyStore>, BoxError> {
    let url = std::env::var("REDIS_URL").map_err(|_| "LEDGER=redis needs REDIS_URL")?;
    let store = tower_idempotency::ledger::RedisStore::builder(url)
        .prefix("payments:idem:")
        .connect()
        .await?;
    Ok(Arc::new(store))
}

#[allow(dead_code)]
#[cfg(not(feature = "redis"))]
async fn redis_ledger() -> Result<Arc<dyn IdempotencyStore>, BoxError> {
    Err(
        "LEDGER=redis needs the `redis` feature: cargo run --features redis --example axum_server"
            .into(),
    )
}

/// `LEDGER=postgres-store`: the ledger's schema in `DATABASE_URL`'s database, migrated by
/// whichever instance gets there first.
#[allow(dead_code)]
#[cfg(feature = "postgres")]
async fn postgres_ledger() -> Result<Arc<dyn IdempotencyStore>, BoxError> {
    let url =
        std::env::var("DATABASE_URL").map_err(|_| "LEDGER=postgres-store needs DATABASE_URL")?;
    let store = tower_idempotency::ledger::PostgresStore::builder(url)
        .schema("payments_idem")
        .connect()
        .await?;
    store.migrate().await?;
    Ok(Arc::new(store))
}

#[allow(dead_code)]
#[cfg(not(feature = "postgres"))]
async fn postgres_ledger() -> Result<Arc<dyn IdempotencyStore>, BoxError> {
    Err(
        "LEDGER=postgres-store needs the `postgres` feature: cargo run --features postgres \
         --example axum_server"
            .into(),
    )
}

/// `LEDGER=redis-cluster`: `REDIS_CLUSTER_URLS` is a comma-separated list of node URLs.
#[allow(dead_code)]
#[cfg(feature = "redis-cluster")]
async fn redis_cluster_ledger() -> Result<Arc<dyn IdempotencyStore>, BoxError> {
    let urls = std::env::var("REDIS_CLUSTER_URLS")
        .map_err(|_| "LEDGER=redis-cluster needs REDIS_CLUSTER_URLS")?;
    let nodes: Vec<String> = urls
        .split(',')
        .map(str::trim)
        .filter(|url| !url.is_empty())
        .map(str::to_owned)
        .collect();
    let store = tower_idempotency::ledger::RedisStore::cluster_builder(nodes)
        .prefix("payments:idem:")
        .connect()
        .await?;
    Ok(Arc::new(store))
}

#[allow(dead_code)]
#[cfg(not(feature = "redis-cluster"))]
async fn redis_cluster_ledger() -> Result<Arc<dyn IdempotencyStore>, BoxError> {
    Err(
        "LEDGER=redis-cluster needs the `redis-cluster` feature: cargo run --features \
         redis-cluster --example axum_server"
            .into(),
    )
}

/// `IN_FLIGHT`: `409` (default) or `wait` (for `IN_FLIGHT_WAIT_MS`).
#[allow(dead_code)]
fn in_flight_policy() -> Result<BusyPolicy, BoxError> {
    match std::env::var("IN_FLIGHT").as_deref() {
        Ok("409") | Err(_) => Ok(BusyPolicy::Fail),
        Ok("wait") => Ok(BusyPolicy::Wait(Duration::from_millis(env_or(
            "IN_FLIGHT_WAIT_MS",
            10_000,
        )?))),
        Ok(other) => Err(format!("IN_FLIGHT={other:?}: expected `409` or `wait`").into()),
    }
}

#[allow(dead_code)]
fn env_or<T: std::str::FromStr>(name: &str, default: T) -> Result<T, BoxError> {
    match std::env::var(name) {
        Ok(value) => value
            .parse()
            .map_err(|_| format!("{name}={value:?} is not valid").into()),
        Err(_) => Ok(default),
    }
}

#[allow(dead_code)]
#[tokio::main]
async fn main() -> Result<(), BoxError> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,tower_idempotency=debug".into()),
        )
        .init();
    let port: u16 = env_or("PORT", 3000)?;
    let latency = Duration::from_millis(env_or("CHARGE_LATENCY_MS", 20)?);

    let router = match std::env::var("LEDGER").as_deref() {
        Ok("postgres") => postgres_app_from_env(latency, in_flight_policy()?).await?,
        _ => app_with(ledger().await?, latency, in_flight_policy()?),
    };
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
    println!("listening on http://{}", listener.local_addr()?);
    axum::serve(listener, router)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}

/// `LEDGER=postgres`: the transactional service on `DATABASE_URL`.
#[allow(dead_code)]
#[cfg(feature = "postgres")]
async fn postgres_app_from_env(
    latency: Duration,
    in_flight: BusyPolicy,
) -> Result<Router, BoxError> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "LEDGER=postgres needs DATABASE_URL")?;
    let store = tower_idempotency::ledger::PostgresStore::builder(url)
        .schema("payments_idem")
        .connect()
        .await?;
    // Test hook: wait this long after the charge is written, before answering (and so
    // before the commit), so a test can kill the process in between.
    let hold = Duration::from_millis(env_or("CHARGE_HOLD_AFTER_WRITE_MS", 0)?);
    postgres::app_with(store, latency, hold, in_flight).await
}

#[allow(dead_code)]
#[cfg(not(feature = "postgres"))]
async fn postgres_app_from_env(
    _latency: Duration,
    _in_flight: BusyPolicy,
) -> Result<Router, BoxError> {
    Err("LEDGER=postgres needs the `postgres` feature: cargo run --features postgres --example axum_server".into())
}

/// The PostgreSQL mode: charges and the ledger in one database, committed together.
#[cfg(feature = "postgres")]
pub mod postgres {
    use super::*;
    use tower_idempotency::ledger::{PostgresStore, PostgresTransaction};

    #[derive(Clone)]
    struct Charges {
        store: PostgresStore,
        provider_latency: Duration,
        hold_after_write: Duration,
    }

    /// The service on `store`'s database: migrates the ledger's schema and creates the
    /// `charges` table if needed. `hold_after_write` delays the answer after the charge is
    /// written (a test hook; zero in production). A duplicate of a charge in progress gets
    /// `409`.
    #[allow(dead_code)]
    pub async fn app(
        store: PostgresStore,
        provider_latency: Duration,
        hold_after_write: Duration,
    ) -> Result<Router, BoxError> {
        app_with(store, provider_latency, hold_after_write, BusyPolicy::Fail).await
    }

    /// [`app`], with duplicates of an in-flight charge handled per `in_flight`.
    pub async fn app_with(
        store: PostgresStore,
        provider_latency: Duration,
        hold_after_write: Duration,
        in_flight: BusyPolicy,
    ) -> Result<Router, BoxError> {
        store.migrate().await?;
        create_charges_table(&store).await?;
        let idempotency = IdempotencyLayer::transactional_server_builder(store.clone())
            .busy_policy(in_flight)
            .scope(|parts| {
                parts
                    .extensions
                    .get::<Tenant>()
                    .map(|t| t.0.clone())
                    .unwrap_or_default()
            })
            .build()?;
        let charges = Charges {
            store,
            provider_latency,
            hold_after_write,
        };
        // As in `app_with`: the layers on the method router, so axum's own 404 and 405
        // stay outside them.
        let route = post(create_charge)
            .route_layer(idempotency)
            .get(list_charges)
            .route_layer(middleware::from_fn(authenticate));
        Ok(Router::new().route("/charges", route).with_state(charges))
    }

    /// Create the `charges` table unless it exists. `CREATE TABLE IF NOT EXISTS` is not
    /// safe against itself: two instances starting together on a fresh database may both
    /// find the table missing, and the second then fails on the first's row type
    /// (`pg_type_typname_nsp_index`). So they take turns under a transaction-scoped
    /// advisory lock, as the ledger's own migration does.
    async fn create_charges_table(store: &PostgresStore) -> Result<(), BoxError> {
        let mut client = store.pool().get().await?;
        let tx = client.transaction().await?;
        // DDL may wait on the lock longer than a ledger call is allowed to take.
        tx.batch_execute("SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = 0")
            .await?;
        tx.execute(
            "SELECT pg_advisory_xact_lock(hashtext('payments demo: charges'))",
            &[],
        )
        .await?;
        tx.batch_execute(
            "CREATE TABLE IF NOT EXISTS charges (
                 charge_id    bigserial PRIMARY KEY,
                 tenant       text   NOT NULL,
                 order_id     text   NOT NULL,
                 amount_cents bigint NOT NULL)",
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    fn failed(err: impl std::fmt::Display) -> (StatusCode, String) {
        (StatusCode::INTERNAL_SERVER_ERROR, format!("{err}\n"))
    }

    /// The charge is one row, inserted in the request's transaction: it commits with the
    /// recorded response or not at all.
    async fn create_charge(
        State(charges): State<Charges>,
        Extension(tenant): Extension<Tenant>,
        tx: PostgresTransaction,
        payload: Result<Json<NewCharge>, JsonRejection>,
    ) -> Result<(StatusCode, Json<Charge>), (StatusCode, String)> {
        let Json(new) =
            payload.map_err(|rejection| (StatusCode::BAD_REQUEST, rejection.body_text()))?;
        tokio::time::sleep(charges.provider_latency).await;
        let client = tx.client().await.map_err(failed)?;
        let row = client
            .query_one(
                "INSERT INTO charges (tenant, order_id, amount_cents) VALUES ($1, $2, $3)
                 RETURNING charge_id",
                &[&tenant.0, &new.order_id, &new.amount_cents],
            )
            .await
            .map_err(failed)?;
        drop(client);
        let charge = Charge {
            charge_id: format!("ch_{}", row.get::<_, i64>(0)),
            order_id: new.order_id,
            amount_cents: new.amount_cents,
        };
        if !charges.hold_after_write.is_zero() {
            println!("charge {} written, not committed", charge.charge_id);
            tokio::time::sleep(charges.hold_after_write).await;
        }
        Ok((StatusCode::CREATED, Json(charge)))
    }

    async fn list_charges(
        State(charges): State<Charges>,
        Extension(tenant): Extension<Tenant>,
        Query(query): Query<ChargesOf>,
    ) -> Result<Json<Vec<Charge>>, (StatusCode, String)> {
        let client = charges.store.pool().get().await.map_err(failed)?;
        let rows = client
            .query(
                "SELECT charge_id, order_id, amount_cents FROM charges
                 WHERE tenant = $1 AND order_id = $2 ORDER BY charge_id",
                &[&tenant.0, &query.order_id],
            )
            .await
            .map_err(failed)?;
        Ok(Json(
            rows.iter()
                .map(|row| Charge {
                    charge_id: format!("ch_{}", row.get::<_, i64>(0)),
                    order_id: row.get(1),
                    amount_cents: row.get(2),
                })
                .collect(),
        ))
    }
}
