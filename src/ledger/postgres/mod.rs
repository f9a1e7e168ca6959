//! The PostgreSQL ledger: durable records, and a transactional server mode in which a
//! handler's own writes and its recorded outcome commit together.
//!
//! [`PostgresStore`] implements the [ledger protocol](crate::ledger) in SQL: one table and
//! one PL/pgSQL function per transition, created by [`PostgresStore::migrate`]. Every
//! process that talks to the same database shares one ledger, and a record acknowledged by
//! a commit survives whatever PostgreSQL's own durability survives.
//!
//! # Example
//!
//! ```no_run
//! use std::time::Duration;
//! use tower_idempotency::ledger::{Begin, BeginRequest, IdempotencyStore, LedgerKey, PostgresStore};
//! use tower_idempotency::Fingerprint;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
//! let store = PostgresStore::builder("postgres://app@127.0.0.1/payments")
//!     .schema("idempotency")
//!     .operation_timeout(Duration::from_millis(500))
//!     .connect()
//!     .await?;
//! // Creates the schema, or brings it up to this release's version; safe to run from
//! // every replica at start-up.
//! store.migrate().await?;
//!
//! let key = LedgerKey::from_bytes([7; 32]);
//! let fp = Fingerprint::of(&http::Method::POST, "/charges", b"{}");
//! let request = BeginRequest::new(key, fp, Duration::from_secs(30), Duration::from_secs(86_400));
//! match store.begin(request).await? {
//!     Begin::Acquired { .. } => { /* send the request, then `complete` */ }
//!     Begin::Replay(_) => { /* done before: return the recorded outcome */ }
//!     _ => { /* busy, resume or drift: see the ledger docs */ }
//! }
//! # Ok(())
//! # }
//! ```
//!
//! # How it works
//!
//! - **One row per record** in `<schema>.records`, keyed by the 32-byte [`LedgerKey`].
//! - **One statement per ledger call**, each a call of one function (`begin_op`,
//!   `complete_op`, …), prepared once per pooled connection: a fresh operation costs two
//!   round trips (`begin`, `complete`), a replay one.
//! - **An atomic claim.** `begin_op` inserts with `ON CONFLICT DO NOTHING` and, when the key
//!   exists, answers from a plain read (replays and busy answers lock and write nothing);
//!   every transition it makes is a conditional `UPDATE` that re-checks what it read. Two
//!   callers racing on a key never both acquire it.
//! - **Fencing.** `complete_op`, `abandon_op`, `mark_in_doubt_op` and `renew_op` only touch
//!   an in-flight record whose token is the caller's: a stale owner's write is refused
//!   ([fenced](super::StoreError::is_fenced)), never applied.
//! - **A release outlasts a late claim** (see the [ledger docs](crate::ledger)): a key
//!   `abandon_op` releases, or finds without a record, keeps a *marker* row for a minute
//!   (state `released`, the released tokens in the `released` column), and `begin_op`
//!   refuses those tokens. The marker is a row of the same table, so it meets a racing
//!   claim on the primary key, as two claims do; every other call reads it as no record.
//! - **The database's clock judges leases and retention** (`clock_timestamp()` inside each
//!   function), never the application hosts' clocks.
//! - **Retention.** A record past its retention is absent to every call (a new claim takes
//!   its place, writes to it are fenced, [`inspect`](super::IdempotencyStore::inspect) shows
//!   nothing) from that instant, whether or not it was deleted yet. A background
//!   [sweep](PostgresStoreBuilder::sweep_every) deletes such rows in small batches with
//!   `FOR UPDATE SKIP LOCKED`, so it never waits for a live operation nor holds one up.
//!   PostgreSQL has no memory budget to protect records from: every record is kept for its
//!   whole retention, so the [protected window](super::BeginRequest::protected) always holds.
//! - **Bounded and fail closed.** Every call, waiting for a pooled connection included, is
//!   bounded by the [operation timeout](PostgresStoreBuilder::operation_timeout) (1 s by
//!   default), and the store's connections carry it as their `statement_timeout`; a
//!   `begin` waiting on a record another transaction holds gives up after
//!   [`lock_wait`](PostgresStoreBuilder::lock_wait) and answers busy. When the database is
//!   unreachable or slow, calls fail with an [unavailable](super::StoreError::is_unavailable)
//!   or [timeout](super::StoreError::is_timeout) error, never a claim.
//!
//! An operator's [`forget`](super::IdempotencyStore::forget) is one conditional `DELETE` of
//! the record's row, which re-checks its state, fingerprint, attempts and, while in flight,
//! its lease on the row it locks (see [`forget`](super::forget)); the schema is unchanged.
//!
//! # The transactional server mode
//!
//! With [`IdempotencyLayer::transactional_server_builder`](crate::IdempotencyLayer::transactional_server_builder),
//! the server layer runs each keyed request in one database transaction: it claims the key
//! as that transaction's first statement (sent together with `BEGIN`: no extra round trip),
//! hands the transaction to the handler as a [`PostgresTransaction`] request extension, and
//! records the response in it, sent together with `COMMIT`. The handler's rows and the
//! recorded outcome commit together or not at all:
//!
//! - a process killed before the commit leaves nothing: PostgreSQL rolls the transaction
//!   back, claim included, and the retry runs the handler again, correctly, since nothing
//!   happened;
//! - after the commit the record exists, and the retry replays it;
//! - a handler that fails (a `5xx`, an error, a panic) or asks for a rollback
//!   ([`PostgresTransaction::set_rollback_only`]) leaves no record and none of its writes.
//!
//! While the transaction is open, its claim is an uncommitted row, and the transaction
//! holds the key's advisory lock (`pg_try_advisory_xact_lock`, taken by the claim without
//! waiting). A duplicate request finds the lock taken at once and is busy: answered `409`
//! under [`BusyPolicy::Fail`](crate::BusyPolicy::Fail), or, under
//! [`BusyPolicy::Wait`](crate::BusyPolicy::Wait), asks again (backing off, up to 200 ms
//! apart) until the first commits and it replays, or the bound runs out (then `409`). A
//! waiting duplicate holds no pooled connection between its tries, and counts against
//! [`max_waiters`](crate::idempotency::ServerBuilder::max_waiters). A `409` leaves no
//! error in PostgreSQL's log.
//!
//! # Durability, failover, clocks
//!
//! A record is as durable as a commit: with `synchronous_commit = on` (the default) it is
//! on the primary's disk before the store answers. With asynchronous streaming replication,
//! a failover may promote a standby that lacks the last commits; records there are lost
//! like any other row, and a lost record lets its operation run again. Use synchronous
//! replication (`synchronous_standby_names`, `synchronous_commit = on` or
//! `remote_apply`) for ledgers whose duplicates are expensive: the commit then waits for a
//! standby, and a promoted standby has every acknowledged record. Leases and retention are
//! judged by the database server's clock; after a failover that is the new primary's clock,
//! so keep the servers' clocks in sync (NTP): a standby whose clock runs ahead makes leases
//! expire early (an operation is resumed while its owner lives; the owner's writes are then
//! fenced) and one that runs behind keeps them longer.
//!
//! # Sizing
//!
//! One pooled connection per ledger call in flight, and in the transactional mode one per
//! request for its whole handler: size the pool (16 by default) for your concurrency times
//! handler time, and `max_connections` for the sum of every replica's pool. Storage grows
//! with rate × retention × (frozen request + response, each capped at 1 MiB by the layers);
//! the sweep keeps it there. `tokio-postgres` (with a `deadpool-postgres` pool) rather than
//! `sqlx`: it pipelines concurrent queries on one connection, which lets the transactional
//! mode send its claim with `BEGIN` and its record with `COMMIT` (no round trip added), and
//! it builds in a fraction of the time; the store works beside an application on `sqlx`.
//! Latencies are in the repository's `BENCHMARKS.md`.
//!
//! # Limits
//!
//! - PostgreSQL 12 or later (tested with 15); the transactional mode needs `READ COMMITTED`,
//!   PostgreSQL's default isolation.
//! - Connections are made without TLS unless [`PostgresStoreBuilder::tls`] gives a connector.
//! - Store operations run on the real clock: under a paused tokio clock the operation
//!   timeout fires as soon as the runtime idles waiting for the database.

mod transaction;

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::error::SqlState;
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::types::ToSql;
use tokio_postgres::{NoTls, Row, Socket};

pub(crate) use transaction::{CommitError, OpenTransaction};
pub use transaction::{PostgresTransaction, TransactionClient};

use super::{
    Begin, BeginRequest, IdempotencyStore, LeaseToken, LedgerKey, Outcome, RecordState, RecordView,
    StoreError, StoreFuture,
};
use crate::fingerprint::Fingerprint;
use crate::frozen::FrozenRequest;

/// The schema unless [`PostgresStoreBuilder::schema`] says otherwise.
const DEFAULT_SCHEMA: &str = "tower_idempotency";
const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(1);
const DEFAULT_CONNECTION_TIMEOUT: Duration = Duration::from_secs(2);
const DEFAULT_LOCK_WAIT: Duration = Duration::from_millis(100);
const DEFAULT_POOL_SIZE: usize = 16;
const DEFAULT_SWEEP_EVERY: Duration = Duration::from_secs(60);
/// Rows deleted per sweep statement: small enough that each statement is brief.
const SWEEP_BATCH: i32 = 1000;
/// Leases and retentions are clamped to about 139 years: far beyond any real use, and
/// well inside PostgreSQL's timestamp range.
const MAX_MS: u128 = 1 << 42;

/// The schema version this release creates and reads.
pub const SCHEMA_VERSION: i32 = 2;

/// Each version's migration, applied in order; `{schema}` is the store's schema.
const MIGRATIONS: &[&str] = &[include_str!("schema_v1.sql"), include_str!("schema_v2.sql")];

/// The durable ledger on PostgreSQL. See the [module docs](self) for how it works, the
/// transactional server mode and what durability to expect.
///
/// Cloning is cheap: clones share one connection pool.
///
/// # Example
///
/// ```no_run
/// use std::sync::Arc;
/// use tower_idempotency::ledger::{IdempotencyStore, PostgresStore};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
/// let store = PostgresStore::connect("postgres://app@127.0.0.1/payments").await?;
/// store.migrate().await?;
/// let shared: Arc<dyn IdempotencyStore> = Arc::new(store);
/// # let _ = shared;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct PostgresStore {
    inner: Arc<Inner>,
}

struct Inner {
    pool: Pool,
    schema: String,
    sql: Statements,
    operation_timeout: Duration,
    lock_wait: Duration,
}

/// The SQL of every call, with the schema filled in once.
struct Statements {
    begin: String,
    /// `begin` in the transactional mode: run only under the key's advisory lock, taken
    /// without waiting (the `InitPlan`'s one-time filter is checked before `begin_op` is
    /// called: no lock, no row, and no wait), and lifting the store's bounds for the
    /// handler's statements once it has answered.
    claim: String,
    complete: String,
    abandon: String,
    mark_in_doubt: String,
    renew: String,
    inspect: String,
    sweep: String,
}

impl Statements {
    fn new(schema: &str) -> Self {
        Self {
            begin: format!(
                "SELECT r_answer, r_wait_ms, r_fp, r_frozen, r_outcome \
                 FROM {schema}.begin_op($1, $2, $3, $4, $5, $6, $7)"
            ),
            claim: format!(
                "SELECT r_answer, r_wait_ms, r_fp, r_frozen, r_outcome, \
                 set_config('statement_timeout', '0', true), \
                 set_config('lock_timeout', '0', true) \
                 FROM {schema}.begin_op($1, $2, $3, $4, $5, $6, $7) \
                 WHERE (SELECT pg_try_advisory_xact_lock($8))"
            ),
            complete: format!("SELECT {schema}.complete_op($1, $2, $3, $4, $5, $6)"),
            abandon: format!("SELECT {schema}.abandon_op($1, $2, $3)"),
            mark_in_doubt: format!("SELECT {schema}.mark_in_doubt_op($1, $2, $3)"),
            renew: format!("SELECT {schema}.renew_op($1, $2, $3)"),
            inspect: format!(
                "SELECT r_state, r_fp, r_attempts, r_age_ms, r_lease_left_ms, \
                 r_retention_left_ms, r_sent, r_status FROM {schema}.inspect_op($1)"
            ),
            sweep: format!("SELECT {schema}.sweep_op($1)"),
        }
    }
}

type MakeManager = Box<dyn FnOnce(tokio_postgres::Config) -> Manager + Send>;

/// Builds a [`PostgresStore`]; from [`PostgresStore::builder`] or
/// [`PostgresStore::builder_with_config`].
///
/// # Example
///
/// ```no_run
/// use std::time::Duration;
/// use tower_idempotency::ledger::PostgresStore;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
/// let store = PostgresStore::builder("postgres://app@db.internal/payments")
///     .schema("billing_idempotency")
///     .pool_size(32)
///     .operation_timeout(Duration::from_millis(300))
///     .connect()
///     .await?;
/// # let _ = store;
/// # Ok(())
/// # }
/// ```
#[must_use = "a builder does nothing until `connect` is called"]
pub struct PostgresStoreBuilder {
    target: Target,
    schema: String,
    operation_timeout: Duration,
    connection_timeout: Duration,
    lock_wait: Duration,
    pool_size: usize,
    sweep_every: Option<Duration>,
    make_manager: Option<MakeManager>,
}

enum Target {
    // Parsed at `connect`, so the builder stays infallible and chainable.
    Url(String),
    Config(Box<tokio_postgres::Config>),
}

impl PostgresStore {
    /// Configure a store for the database at `url`
    /// (`postgres://[user[:password]@]host[:port]/database[?options]`, or the
    /// `key=value` form `tokio_postgres` accepts).
    ///
    /// ```
    /// # use tower_idempotency::ledger::PostgresStore;
    /// let builder = PostgresStore::builder("postgres://app@127.0.0.1/payments");
    /// # let _ = builder;
    /// ```
    pub fn builder(url: impl Into<String>) -> PostgresStoreBuilder {
        PostgresStoreBuilder::new(Target::Url(url.into()))
    }

    /// Configure a store from a [`tokio_postgres::Config`], for settings a URL cannot say.
    ///
    /// ```
    /// # use tower_idempotency::ledger::PostgresStore;
    /// let mut config = tokio_postgres::Config::new();
    /// config.host("127.0.0.1").user("app").dbname("payments");
    /// let builder = PostgresStore::builder_with_config(config);
    /// # let _ = builder;
    /// ```
    pub fn builder_with_config(config: tokio_postgres::Config) -> PostgresStoreBuilder {
        PostgresStoreBuilder::new(Target::Config(Box::new(config)))
    }

    /// Connect to the database at `url` with the default settings; short for
    /// `PostgresStore::builder(url).connect()`.
    ///
    /// ```no_run
    /// # use tower_idempotency::ledger::PostgresStore;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
    /// let store = PostgresStore::connect("postgres://app@127.0.0.1/payments").await?;
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect(url: impl Into<String>) -> Result<Self, StoreError> {
        Self::builder(url).connect().await
    }

    /// Create the ledger's schema, or bring it up to this release's version
    /// ([`SCHEMA_VERSION`]): the one call that prepares a database. Idempotent, and safe to
    /// run from many processes at once (they take turns under an advisory lock). Refuses a
    /// schema newer than this release, rather than misread it. Answers the version.
    ///
    /// ```no_run
    /// # use tower_idempotency::ledger::PostgresStore;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
    /// let store = PostgresStore::connect("postgres://app@127.0.0.1/payments").await?;
    /// assert_eq!(store.migrate().await?, tower_idempotency::ledger::postgres::SCHEMA_VERSION);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn migrate(&self) -> Result<i32, StoreError> {
        let schema = &self.inner.schema;
        // DDL may wait on locks longer than a ledger call: bound it by the connection
        // timeout plus a generous allowance instead.
        let bound = self.inner.operation_timeout.max(Duration::from_secs(30));
        let work = async {
            let mut client = self.inner.pool.get().await.map_err(from_pool)?;
            let tx = client.transaction().await.map_err(from_pg)?;
            tx.batch_execute("SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = 0")
                .await
                .map_err(from_pg)?;
            // One migrator at a time per schema; the others find the work done.
            tx.execute(
                "SELECT pg_advisory_xact_lock(7130412, hashtext($1))",
                &[&schema.as_str()],
            )
            .await
            .map_err(from_pg)?;
            tx.batch_execute(&format!(
                "CREATE SCHEMA IF NOT EXISTS {schema};
                 CREATE TABLE IF NOT EXISTS {schema}.schema_version (
                     singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
                     version integer NOT NULL);"
            ))
            .await
            .map_err(from_pg)?;
            let row = tx
                .query_opt(&format!("SELECT version FROM {schema}.schema_version"), &[])
                .await
                .map_err(from_pg)?;
            let found: i32 = row.map_or(0, |row| row.get(0));
            if found > SCHEMA_VERSION {
                return Err(StoreError::unavailable(format!(
                    "the ledger schema {schema} is at version {found}, newer than this \
                     release's {SCHEMA_VERSION}: upgrade the application"
                )));
            }
            for (index, migration) in MIGRATIONS.iter().enumerate().skip(found as usize) {
                let version = index as i32 + 1;
                tx.batch_execute(&migration.replace("{schema}", schema))
                    .await
                    .map_err(from_pg)?;
                tx.execute(
                    &format!(
                        "INSERT INTO {schema}.schema_version (version) VALUES ($1)
                         ON CONFLICT (singleton) DO UPDATE SET version = excluded.version"
                    ),
                    &[&version],
                )
                .await
                .map_err(from_pg)?;
                tracing::info!(schema, version, "ledger schema migrated");
            }
            tx.commit().await.map_err(from_pg)?;
            Ok(SCHEMA_VERSION)
        };
        tokio::time::timeout(bound, work)
            .await
            .map_err(|_elapsed| StoreError::timeout())?
    }

    /// The schema version the database holds (`None` before [`migrate`](Self::migrate)).
    ///
    /// ```no_run
    /// # use tower_idempotency::ledger::PostgresStore;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
    /// let store = PostgresStore::connect("postgres://app@127.0.0.1/payments").await?;
    /// if store.schema_version().await? != Some(tower_idempotency::ledger::postgres::SCHEMA_VERSION) {
    ///     store.migrate().await?;
    /// }
    /// # Ok(())
    /// # }
    /// ```
    pub async fn schema_version(&self) -> Result<Option<i32>, StoreError> {
        let schema = &self.inner.schema;
        self.bounded(async {
            let client = self.inner.pool.get().await.map_err(from_pool)?;
            let exists = client
                .query_one(
                    "SELECT to_regclass($1) IS NOT NULL",
                    &[&format!("{schema}.schema_version")],
                )
                .await
                .map_err(from_pg)?
                .get::<_, bool>(0);
            if !exists {
                return Ok(None);
            }
            let row = client
                .query_opt(&format!("SELECT version FROM {schema}.schema_version"), &[])
                .await
                .map_err(from_pg)?;
            Ok(row.map(|row| row.get(0)))
        })
        .await
    }

    /// Delete the records past their retention now, in batches; answers how many. The store
    /// also does this in the background (see [`PostgresStoreBuilder::sweep_every`]); expired
    /// records read as absent before they are deleted.
    ///
    /// ```no_run
    /// # use tower_idempotency::ledger::PostgresStore;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
    /// let store = PostgresStore::connect("postgres://app@127.0.0.1/payments").await?;
    /// let deleted = store.sweep().await?;
    /// # let _ = deleted;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn sweep(&self) -> Result<u64, StoreError> {
        let mut total = 0u64;
        loop {
            let row = self
                .query_one(&self.inner.sql.sweep, &[&SWEEP_BATCH])
                .await
                .map_err(StoreError::from)?;
            let deleted: i64 = row.get(0);
            total += deleted as u64;
            if deleted < i64::from(SWEEP_BATCH) {
                return Ok(total);
            }
        }
    }

    /// The connection pool: the application may run its own queries on the ledger's
    /// database through it. Its connections carry the store's `statement_timeout`.
    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }

    /// The schema holding the ledger's table and functions.
    pub fn schema(&self) -> &str {
        &self.inner.schema
    }

    async fn bounded<T>(
        &self,
        work: impl std::future::Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        tokio::time::timeout(self.inner.operation_timeout, work)
            .await
            .map_err(|_elapsed| StoreError::timeout())?
    }

    /// Run one prepared statement answering one row: one round trip once the connection
    /// has prepared it.
    async fn query_one(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<Row, PgFailure> {
        let work = async {
            let client = self
                .inner
                .pool
                .get()
                .await
                .map_err(|err| PgFailure(from_pool(err), false))?;
            let statement = client.prepare_cached(sql).await.map_err(classify)?;
            client.query_one(&statement, params).await.map_err(classify)
        };
        tokio::time::timeout(self.inner.operation_timeout, work)
            .await
            .map_err(|_elapsed| PgFailure(StoreError::timeout(), false))?
    }

    /// Run a fenced transition: `true` applied it, `false` means the token does not own
    /// the record. A lock wait that ran out is a timeout: the engine asks again.
    async fn settle(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<(), StoreError> {
        match self.query_one(sql, params).await {
            Ok(row) if row.get::<_, bool>(0) => Ok(()),
            Ok(_) => Err(StoreError::fenced()),
            Err(err) => Err(err.into()),
        }
    }

    fn spawn_sweeper(&self, every: Duration) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        // A weak handle: the sweeper ends when the last clone of the store is dropped.
        let weak = Arc::downgrade(&self.inner);
        runtime.spawn(async move {
            let mut ticks = tokio::time::interval(every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            ticks.tick().await;
            loop {
                ticks.tick().await;
                let Some(inner) = weak.upgrade() else {
                    return;
                };
                let store = PostgresStore { inner };
                match store.sweep().await {
                    Ok(0) => {}
                    Ok(deleted) => tracing::debug!(deleted, "swept expired ledger records"),
                    Err(err) => tracing::warn!(%err, "could not sweep expired ledger records"),
                }
            }
        });
    }
}

impl fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresStore")
            .field("schema", &self.inner.schema)
            .field("operation_timeout", &self.inner.operation_timeout)
            .field("lock_wait", &self.inner.lock_wait)
            .field("pool", &self.inner.pool.status())
            .finish_non_exhaustive()
    }
}

impl PostgresStoreBuilder {
    fn new(target: Target) -> Self {
        Self {
            target,
            schema: DEFAULT_SCHEMA.to_owned(),
            operation_timeout: DEFAULT_OPERATION_TIMEOUT,
            connection_timeout: DEFAULT_CONNECTION_TIMEOUT,
            lock_wait: DEFAULT_LOCK_WAIT,
            pool_size: DEFAULT_POOL_SIZE,
            sweep_every: Some(DEFAULT_SWEEP_EVERY),
            make_manager: None,
        }
    }

    /// The schema of the ledger's table and functions (default `tower_idempotency`):
    /// lowercase ASCII letters, digits and `_`, starting with a letter or `_`, at most 63
    /// bytes. Give each ledger sharing a database its own.
    ///
    /// ```
    /// # use tower_idempotency::ledger::PostgresStore;
    /// let builder = PostgresStore::builder("postgres://127.0.0.1/app").schema("billing_idem");
    /// # let _ = builder;
    /// ```
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// The most any store call may take, waiting for a pooled connection included (default
    /// 1 s); also the `statement_timeout` of the store's connections. Past it the call fails
    /// with a [timeout](StoreError::is_timeout) error, so a stalled database fails requests
    /// closed and fast.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::ledger::PostgresStore;
    /// let builder = PostgresStore::builder("postgres://127.0.0.1/app")
    ///     .operation_timeout(Duration::from_millis(300));
    /// # let _ = builder;
    /// ```
    pub fn operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout;
        self
    }

    /// How long making one connection may take (default 2 s).
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::ledger::PostgresStore;
    /// let builder = PostgresStore::builder("postgres://127.0.0.1/app")
    ///     .connection_timeout(Duration::from_secs(1));
    /// # let _ = builder;
    /// ```
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout;
        self
    }

    /// How long a call waits for a record another transaction holds (default 100 ms): the
    /// `lock_timeout` of the store's connections. A `begin` that waits longer answers busy.
    /// Only a transactional-mode request's open transaction holds a record that long, and
    /// a transactional-mode claim does not wait for one (see the
    /// [module docs](self#the-transactional-server-mode)).
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::ledger::PostgresStore;
    /// let builder = PostgresStore::builder("postgres://127.0.0.1/app")
    ///     .lock_wait(Duration::from_millis(50));
    /// # let _ = builder;
    /// ```
    pub fn lock_wait(mut self, wait: Duration) -> Self {
        self.lock_wait = wait;
        self
    }

    /// The most connections the pool opens (default 16). Each in-flight ledger call holds
    /// one for its round trip; each transactional-mode request holds one for its whole
    /// handler.
    ///
    /// ```
    /// # use tower_idempotency::ledger::PostgresStore;
    /// let builder = PostgresStore::builder("postgres://127.0.0.1/app").pool_size(64);
    /// # let _ = builder;
    /// ```
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size.max(1);
        self
    }

    /// How often the background sweep deletes records past their retention (default every
    /// minute); `None` turns it off (call [`PostgresStore::sweep`] yourself, or let one
    /// replica sweep for all).
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::ledger::PostgresStore;
    /// let builder = PostgresStore::builder("postgres://127.0.0.1/app")
    ///     .sweep_every(Some(Duration::from_secs(300)));
    /// # let _ = builder;
    /// ```
    pub fn sweep_every(mut self, every: Option<Duration>) -> Self {
        self.sweep_every = every;
        self
    }

    /// Connect with TLS through `tls` (e.g. `postgres-native-tls` or `tokio-postgres-rustls`
    /// connectors) instead of in plain text.
    ///
    /// ```
    /// # use tower_idempotency::ledger::PostgresStore;
    /// // `NoTls` stands in for a real connector here.
    /// let builder = PostgresStore::builder("postgres://127.0.0.1/app").tls(tokio_postgres::NoTls);
    /// # let _ = builder;
    /// ```
    pub fn tls<T>(mut self, tls: T) -> Self
    where
        T: MakeTlsConnect<Socket> + Clone + Sync + Send + 'static,
        T::Stream: Sync + Send,
        T::TlsConnect: Sync + Send,
        <T::TlsConnect as TlsConnect<Socket>>::Future: Send,
    {
        self.make_manager = Some(Box::new(move |config| {
            Manager::from_config(config, tls, manager_config())
        }));
        self
    }

    /// Make the pool and prove the database answers (one connection, one query).
    ///
    /// Fails with an [unavailable](StoreError::is_unavailable) error when the URL or schema
    /// name is invalid or the database cannot be reached within the connection timeout.
    /// Does not touch the schema: call [`PostgresStore::migrate`] for that.
    ///
    /// ```no_run
    /// # use tower_idempotency::ledger::PostgresStore;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// match PostgresStore::builder("postgres://app@127.0.0.1/payments").connect().await {
    ///     Ok(store) => drop(store), // migrate, then hand it to the layers
    ///     Err(err) => eprintln!("no ledger, refusing to start: {err}"),
    /// }
    /// # }
    /// ```
    pub async fn connect(self) -> Result<PostgresStore, StoreError> {
        validate_schema(&self.schema)?;
        let mut config = match self.target {
            Target::Url(url) => url
                .parse::<tokio_postgres::Config>()
                .map_err(|err| StoreError::unavailable(format!("invalid database URL: {err}")))?,
            Target::Config(config) => *config,
        };
        // Server-side bounds for every statement on the store's connections: a call the
        // client gave up on does not keep running, nor keep waiting on a lock.
        let options = format!(
            "-c statement_timeout={} -c lock_timeout={}",
            setting_millis(self.operation_timeout),
            setting_millis(self.lock_wait),
        );
        let options = match config.get_options() {
            Some(theirs) if !theirs.is_empty() => format!("{theirs} {options}"),
            _ => options,
        };
        config.options(options);
        config.connect_timeout(self.connection_timeout);
        let manager = match self.make_manager {
            Some(make) => make(config),
            None => Manager::from_config(config, NoTls, manager_config()),
        };
        let pool = Pool::builder(manager)
            .max_size(self.pool_size)
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(self.operation_timeout))
            .create_timeout(Some(self.connection_timeout))
            .recycle_timeout(Some(self.operation_timeout))
            .build()
            .map_err(StoreError::unavailable)?;
        let store = PostgresStore {
            inner: Arc::new(Inner {
                pool,
                sql: Statements::new(&self.schema),
                schema: self.schema,
                operation_timeout: self.operation_timeout,
                lock_wait: self.lock_wait,
            }),
        };
        let bound = self
            .connection_timeout
            .saturating_add(self.operation_timeout);
        let probe = async {
            let client = store.inner.pool.get().await.map_err(from_pool)?;
            client.simple_query("SELECT 1").await.map_err(from_pg)
        };
        match tokio::time::timeout(bound, probe).await {
            Ok(Ok(_)) => {}
            Ok(Err(err)) => return Err(err),
            Err(_elapsed) => {
                return Err(StoreError::unavailable(format!(
                    "could not reach the database within {bound:?}"
                )))
            }
        }
        if let Some(every) = self.sweep_every {
            store.spawn_sweeper(every);
        }
        Ok(store)
    }
}

impl fmt::Debug for PostgresStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The URL may carry a password: show only what kind of target it is.
        let target = match &self.target {
            Target::Url(_) => "url",
            Target::Config(_) => "config",
        };
        f.debug_struct("PostgresStoreBuilder")
            .field("target", &target)
            .field("schema", &self.schema)
            .field("operation_timeout", &self.operation_timeout)
            .field("connection_timeout", &self.connection_timeout)
            .field("lock_wait", &self.lock_wait)
            .field("pool_size", &self.pool_size)
            .field("sweep_every", &self.sweep_every)
            .field("tls", &self.make_manager.is_some())
            .finish()
    }
}

fn manager_config() -> ManagerConfig {
    // `Fast` trusts a connection that is not closed; a connection whose transaction was
    // left open is never returned to the pool (see `transaction.rs`), so nothing else needs
    // checking, and recycling costs no round trip.
    ManagerConfig {
        recycling_method: RecyclingMethod::Fast,
    }
}

/// The schema name is spliced into SQL text, so it must be a plain identifier.
fn validate_schema(schema: &str) -> Result<(), StoreError> {
    let mut chars = schema.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
    let rest_ok = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if first_ok && rest_ok && schema.len() <= 63 {
        Ok(())
    } else {
        Err(StoreError::unavailable(format!(
            "{schema:?} is not a valid ledger schema name: use lowercase ASCII letters, digits \
             and _, starting with a letter or _, at most 63 bytes"
        )))
    }
}

impl IdempotencyStore for PostgresStore {
    fn begin(&self, request: BeginRequest) -> StoreFuture<'_, Begin> {
        StoreFuture::new(async move {
            let token = request.token;
            let frozen = request.frozen.as_ref().map(FrozenRequest::encode);
            let answer = self
                .query_one(
                    &self.inner.sql.begin,
                    &begin_params(&request, &frozen).as_params(),
                )
                .await;
            match answer {
                Ok(row) => decode_begin(&row, token),
                Err(err) if err.is_lock_wait() => Ok(busy_behind_a_transaction(&request)),
                Err(err) => Err(err.into_store_error()),
            }
        })
    }

    fn complete(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        outcome: Outcome,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        StoreFuture::new(async move {
            let encoded = outcome.encode();
            let status = outcome_status(&outcome);
            let token = token_bytes(token);
            let retention = millis(retention, 1);
            self.settle(
                &self.inner.sql.complete,
                &[
                    &key.as_bytes().as_slice(),
                    &token.as_slice(),
                    &encoded,
                    &status,
                    &retention,
                    &false,
                ],
            )
            .await
        })
    }

    fn abandon(&self, key: LedgerKey, token: LeaseToken) -> StoreFuture<'_, ()> {
        StoreFuture::new(async move {
            let token = token_bytes(token);
            // How long the key stays released under the token (see the ledger docs).
            let released_ms = millis(super::RELEASED_TOKEN_TTL, 1);
            self.settle(
                &self.inner.sql.abandon,
                &[&key.as_bytes().as_slice(), &token.as_slice(), &released_ms],
            )
            .await
        })
    }

    fn mark_in_doubt(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        StoreFuture::new(async move {
            let token = token_bytes(token);
            let retention = millis(retention, 1);
            self.settle(
                &self.inner.sql.mark_in_doubt,
                &[&key.as_bytes().as_slice(), &token.as_slice(), &retention],
            )
            .await
        })
    }

    fn renew(&self, key: LedgerKey, token: LeaseToken, lease: Duration) -> StoreFuture<'_, ()> {
        StoreFuture::new(async move {
            let token = token_bytes(token);
            let lease = millis(lease, 1);
            self.settle(
                &self.inner.sql.renew,
                &[&key.as_bytes().as_slice(), &token.as_slice(), &lease],
            )
            .await
        })
    }

    fn forget(&self, key: LedgerKey, expected: super::Expected) -> StoreFuture<'_, super::Forget> {
        StoreFuture::new(async move {
            let answer = self.forget_record(key, expected).await;
            super::report_forget("postgres", &key, &expected, &answer);
            answer
        })
    }

    fn inspect(&self, key: LedgerKey) -> StoreFuture<'_, Option<RecordView>> {
        StoreFuture::new(async move {
            let rows = self
                .bounded(async {
                    let client = self.inner.pool.get().await.map_err(from_pool)?;
                    let statement = client
                        .prepare_cached(&self.inner.sql.inspect)
                        .await
                        .map_err(from_pg)?;
                    client
                        .query(&statement, &[&key.as_bytes().as_slice()])
                        .await
                        .map_err(from_pg)
                })
                .await?;
            rows.first().map(decode_inspect).transpose()
        })
    }
}

// An operator forgetting one record (see `ledger::forget`): one conditional `DELETE`, its
// own statement rather than a schema function, so the schema version stays as it is.
impl PostgresStore {
    /// Delete the record of `key` if it is still as `expected`. The `DELETE` re-checks its
    /// conditions on the row it locks (a concurrent transition makes it wait, then judge
    /// the new version), so the record is judged and removed in one atomic step. When
    /// nothing was deleted, a read says why; if the record matches by then (a lease ran
    /// out in between), the answer is `Changed`: nothing was forgotten, look again.
    async fn forget_record(
        &self,
        key: LedgerKey,
        expected: super::Expected,
    ) -> Result<super::Forget, StoreError> {
        let sql = format!(
            "DELETE FROM {schema}.records \
             WHERE key = $1 AND retain_until > clock_timestamp() \
               AND state = $2 AND fingerprint = $3 AND attempts = $4 \
               AND (state <> 'in_flight' OR $5 OR lease_until <= clock_timestamp()) \
             RETURNING state",
            schema = self.inner.schema
        );
        let attempts = i32::try_from(expected.attempts).unwrap_or(i32::MAX);
        let deleted = self
            .bounded(async {
                let client = self.inner.pool.get().await.map_err(from_pool)?;
                let statement = client.prepare_cached(&sql).await.map_err(from_pg)?;
                client
                    .query(
                        &statement,
                        &[
                            &key.as_bytes().as_slice(),
                            &expected.kind.as_str(),
                            &expected.fingerprint.as_bytes().as_slice(),
                            &attempts,
                            &expected.force,
                        ],
                    )
                    .await
                    .map_err(from_pg)
            })
            .await?;
        if !deleted.is_empty() {
            return Ok(super::Forget::Forgotten);
        }
        let current = self.inspect(key).await?;
        Ok(match expected.judge(current.as_ref()) {
            super::Forget::Forgotten => super::Forget::Changed,
            refused => refused,
        })
    }
}

/// `begin_op`'s parameters, owned so the same call can be made on a pooled connection or
/// inside a transaction.
pub(crate) struct BeginParams<'a> {
    key: &'a [u8],
    fingerprint: &'a [u8],
    token: Vec<u8>,
    lease_ms: i64,
    retention_ms: i64,
    take_over: bool,
    frozen: Option<&'a [u8]>,
}

impl BeginParams<'_> {
    pub(crate) fn as_params(&self) -> [&(dyn ToSql + Sync); 7] {
        [
            &self.key,
            &self.fingerprint,
            &self.token,
            &self.lease_ms,
            &self.retention_ms,
            &self.take_over,
            &self.frozen,
        ]
    }
}

pub(crate) fn begin_params<'a>(
    request: &'a BeginRequest,
    frozen: &'a Option<Vec<u8>>,
) -> BeginParams<'a> {
    BeginParams {
        key: request.key.as_bytes(),
        fingerprint: request.fingerprint.as_bytes(),
        token: token_bytes(request.token).to_vec(),
        lease_ms: millis(request.lease, 0),
        retention_ms: millis(request.retention, 1),
        take_over: request.take_over,
        frozen: frozen.as_deref(),
    }
}

/// A `begin` that waited its whole lock wait on a record another transaction holds (a
/// transactional-mode request still running): that operation is in flight.
pub(crate) fn busy_behind_a_transaction(request: &BeginRequest) -> Begin {
    Begin::Busy {
        retry_after: request.lease,
    }
}

/// Turn `begin_op`'s row into the protocol's answer; `token` is the one offered.
pub(crate) fn decode_begin(row: &Row, token: LeaseToken) -> Result<Begin, StoreError> {
    let answer: &str = row.get(0);
    Ok(match answer {
        "acquired" => Begin::Acquired { token },
        "busy" => Begin::Busy {
            retry_after: Duration::from_millis(
                row.get::<_, Option<i64>>(1).unwrap_or(0).max(0) as u64
            ),
        },
        "resume" => Begin::Resume {
            token,
            frozen: optional_frozen(row.get(3))?,
        },
        "in_doubt" => Begin::InDoubt,
        // The caller released this token before its `begin` arrived: refused, no claim.
        "released" => return Err(StoreError::fenced()),
        "replay" => match row.get::<_, Option<&[u8]>>(4) {
            Some(bytes) => Begin::Replay(Outcome::decode(bytes)?),
            None => return Err(StoreError::corrupt("completed record without an outcome")),
        },
        "drift" => Begin::Drift {
            stored: fingerprint(row.get(2))?,
            frozen: optional_frozen(row.get(3))?,
        },
        other => {
            return Err(StoreError::corrupt(format!(
                "unexpected answer from the ledger's begin: {other:?}"
            )))
        }
    })
}

fn decode_inspect(row: &Row) -> Result<RecordView, StoreError> {
    let ms = |index: usize| Duration::from_millis(row.get::<_, i64>(index).max(0) as u64);
    let state = match row.get::<_, &str>(0) {
        "in_flight" => RecordState::InFlight {
            lease_left: ms(4),
            may_have_been_sent: row.get(6),
        },
        "in_doubt" => RecordState::InDoubt,
        "completed" => {
            let status: Option<i16> = row.get(7);
            let status = status
                .and_then(|s| u16::try_from(s).ok())
                .and_then(|s| http::StatusCode::from_u16(s).ok())
                .ok_or_else(|| StoreError::corrupt("completed record without a valid status"))?;
            RecordState::Completed { status }
        }
        other => {
            return Err(StoreError::corrupt(format!(
                "unknown record state {other:?}"
            )))
        }
    };
    Ok(RecordView {
        state,
        fingerprint: fingerprint(row.get(1))?,
        attempts: u32::try_from(row.get::<_, i32>(2)).unwrap_or(0),
        age: ms(3),
        retention_left: ms(5),
    })
}

fn optional_frozen(bytes: Option<&[u8]>) -> Result<Option<FrozenRequest>, StoreError> {
    bytes.map(FrozenRequest::decode).transpose()
}

fn fingerprint(bytes: Option<&[u8]>) -> Result<Fingerprint, StoreError> {
    let bytes: [u8; 32] = bytes
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| StoreError::corrupt("stored fingerprint is not 32 bytes"))?;
    Ok(Fingerprint::from_bytes(bytes))
}

pub(crate) fn outcome_status(outcome: &Outcome) -> i16 {
    let status = match outcome {
        Outcome::Response(response) => response.status(),
        Outcome::Tombstone { status } => *status,
    };
    // Status codes are 100..=999: they fit.
    status.as_u16() as i16
}

/// Tokens travel as their 16 big-endian bytes.
pub(crate) fn token_bytes(token: LeaseToken) -> [u8; 16] {
    token.as_u128().to_be_bytes()
}

/// A duration in whole milliseconds, clamped to `[min, MAX_MS]`.
pub(crate) fn millis(duration: Duration, min: u128) -> i64 {
    // The clamp keeps the value below 2^42, so the cast is lossless.
    duration.as_millis().clamp(min, MAX_MS) as i64
}

/// A duration as the value of a millisecond setting (`statement_timeout`, `lock_timeout`):
/// at least 1 (0 turns the bound off) and at most `i32::MAX`, PostgreSQL's limit for them
/// (about 24.8 days). Past it the server refuses the setting, and with it every connection
/// or transaction: a longer bound is as good as that one.
pub(crate) fn setting_millis(duration: Duration) -> i64 {
    millis(duration, 1).min(i64::from(i32::MAX))
}

/// A database failure before it is given its place in the protocol.
pub(crate) struct PgFailure(StoreError, bool);

impl PgFailure {
    /// The statement gave up waiting for a lock (`lock_timeout`).
    pub(crate) fn is_lock_wait(&self) -> bool {
        self.1
    }

    pub(crate) fn into_store_error(self) -> StoreError {
        self.0
    }
}

impl From<PgFailure> for StoreError {
    fn from(failure: PgFailure) -> Self {
        failure.0
    }
}

/// Database errors: a statement or lock timeout is a timeout; a full disk is a full
/// store (fail closed: new claims are refused); a missing function names the fix;
/// everything else is unavailable.
pub(crate) fn from_pg(err: tokio_postgres::Error) -> StoreError {
    classify(err).0
}

pub(crate) fn classify(err: tokio_postgres::Error) -> PgFailure {
    let Some(code) = err.code() else {
        return PgFailure(StoreError::unavailable(err), false);
    };
    if *code == SqlState::LOCK_NOT_AVAILABLE {
        PgFailure(StoreError::timeout(), true)
    } else if *code == SqlState::QUERY_CANCELED {
        PgFailure(StoreError::timeout(), false)
    } else if *code == SqlState::DISK_FULL || *code == SqlState::INSUFFICIENT_RESOURCES {
        PgFailure(StoreError::full(), false)
    } else if *code == SqlState::UNDEFINED_FUNCTION
        || *code == SqlState::UNDEFINED_TABLE
        || *code == SqlState::INVALID_SCHEMA_NAME
    {
        PgFailure(
            StoreError::unavailable(format!(
                "the ledger schema is missing or outdated (call PostgresStore::migrate): {}",
                describe(&err)
            )),
            false,
        )
    } else {
        PgFailure(StoreError::unavailable(describe(&err)), false)
    }
}

/// `tokio_postgres::Error` displays a database error as "db error"; say what it was.
fn describe(err: &tokio_postgres::Error) -> String {
    match err.as_db_error() {
        Some(db) => format!("{} (SQLSTATE {})", db.message(), db.code().code()),
        None => err.to_string(),
    }
}

pub(crate) fn from_pool(err: deadpool_postgres::PoolError) -> StoreError {
    match err {
        deadpool_postgres::PoolError::Timeout(_) => StoreError::timeout(),
        deadpool_postgres::PoolError::Backend(err) => from_pg(err),
        other => StoreError::unavailable(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names_are_plain_identifiers() {
        assert!(validate_schema("tower_idempotency").is_ok());
        assert!(validate_schema("_t1").is_ok());
        assert!(validate_schema("").is_err());
        assert!(validate_schema("1abc").is_err());
        assert!(validate_schema("a; DROP TABLE x").is_err());
        assert!(validate_schema("Upper").is_err());
        assert!(validate_schema(&"a".repeat(64)).is_err());
    }

    #[test]
    fn durations_are_clamped() {
        assert_eq!(millis(Duration::ZERO, 1), 1);
        assert_eq!(millis(Duration::ZERO, 0), 0);
        assert_eq!(millis(Duration::MAX, 1), 1 << 42);
        assert_eq!(setting_millis(Duration::MAX), i64::from(i32::MAX));
        assert_eq!(setting_millis(Duration::ZERO), 1);
    }

    #[test]
    fn tokens_are_16_bytes_big_endian() {
        assert_eq!(token_bytes(LeaseToken::from_u128(1))[15], 1);
        assert_eq!(token_bytes(LeaseToken::from_u128(u128::MAX)), [0xff; 16]);
    }
}
