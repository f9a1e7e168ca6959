//! [`PostgresStore`]: the ledger protocol as one SQL function call per transition.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::Pool;
use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use super::codec::{
    begin_params, busy_behind_a_transaction, decode_begin, decode_inspect, generation_column,
    inspected_request, millis, outcome_status, token_bytes,
};
use super::errors::{classify, from_pg, from_pool, PgFailure};
use crate::ledger::{
    Begin, BeginRequest, IdempotencyStore, LeaseToken, LedgerKey, ListPage, ListQuery, Outcome,
    RecordView, StoreError, StoreFuture,
};
use crate::FrozenRequest;

/// Where the origin's columns start in `inspect_op`'s row.
const INSPECTED_ORIGIN_AT: usize = 11;

/// Rows deleted per sweep statement: small enough that each statement is brief.
// Each batch is its own statement and its own transaction, so the row locks a batch takes
// are released before the next: a live claim on an expired key waits at most one batch.
const SWEEP_BATCH: i32 = 1000;
/// The durable ledger on PostgreSQL. See the [module docs](super) for how it works, the
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
    pub(super) inner: Arc<Inner>,
}

/// What every clone of a store shares.
pub(super) struct Inner {
    pub(super) pool: Pool,
    pub(super) schema: String,
    pub(super) sql: Statements,
    pub(super) operation_timeout: Duration,
    pub(super) lock_wait: Duration,
}

/// The SQL of every call, with the schema filled in once.
pub(super) struct Statements {
    /// `begin_op` in the request's scope, of its origin (`origin_begin_op`).
    pub(super) begin: String,
    /// `begin` in the transactional mode (`claim_op`): a completed record answered from a
    /// plain read, without the key's lock; anything else only under the key's advisory
    /// lock, taken without waiting (another transaction's: no row, and no wait); lifting
    /// the store's bounds for the handler's statements once it has answered.
    pub(super) claim: String,
    pub(super) complete: String,
    pub(super) abandon: String,
    pub(super) mark_in_doubt: String,
    pub(super) renew: String,
    pub(super) inspect: String,
    pub(super) sweep: String,
}

impl Statements {
    pub(super) fn new(schema: &str) -> Self {
        Self {
            begin: format!(
                "SELECT r_answer, r_wait_ms, r_fp, r_frozen, r_outcome \
                 FROM {schema}.origin_begin_op($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)"
            ),
            claim: format!(
                "SELECT r_answer, r_wait_ms, r_fp, r_frozen, r_outcome, \
                 set_config('statement_timeout', '0', true), \
                 set_config('lock_timeout', '0', true) \
                 FROM {schema}.origin_claim_op($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)"
            ),
            complete: format!("SELECT {schema}.complete_op($1, $2, $3, $4, $5, $6)"),
            abandon: format!("SELECT {schema}.abandon_op($1, $2, $3)"),
            mark_in_doubt: format!("SELECT {schema}.mark_in_doubt_op($1, $2, $3)"),
            renew: format!("SELECT {schema}.renew_op($1, $2, $3)"),
            // The frozen request beside the view, for an open record only (nothing of a
            // completed one will be resent), and only of the life the view shows: the
            // function reads the row in a snapshot of its own.
            inspect: format!(
                "SELECT r_state, r_fp, r_attempts, r_age_ms, r_lease_left_ms, \
                 r_retention_left_ms, r_sent, r_status, r_generation, r_touched_ms, r_scope, \
                 r_origin, r_target, r_task, r_step, f.frozen AS r_frozen \
                 FROM {schema}.inspect_op($1) i \
                 LEFT JOIN {schema}.records f ON f.key = $1 \
                   AND i.r_state IN ('in_flight', 'in_doubt') \
                   AND {schema}.generation_of(f.generation, f.created_at) = i.r_generation"
            ),
            sweep: format!("SELECT {schema}.sweep_op($1)"),
        }
    }
}

impl PostgresStore {
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

    /// Delete the records past their retention now, in batches; answers how many. The store
    /// also does this in the background (see [`PostgresStoreBuilder::sweep_every`](crate::ledger::PostgresStoreBuilder::sweep_every)); expired
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
            // A short batch means no unlocked expired row was left; rows skipped because a
            // claim held them are that claim's to replace, or the next sweep's to delete.
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

    pub(super) async fn bounded<T>(
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
        // The bound covers the wait for a pooled connection too: an exhausted pool must fail
        // the call closed within the operation timeout, like a slow database.
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
        // A cut-off call may still commit on the server (the statement runs on without us):
        // the layers read a timeout as "may have applied", as they do for every store.
        tokio::time::timeout(self.inner.operation_timeout, work)
            .await
            .map_err(|_elapsed| PgFailure(StoreError::timeout(), false))?
    }

    /// Run a fenced transition: `true` applied it, `false` means the token does not own
    /// the record. A lock wait that ran out is a timeout: the engine asks again.
    async fn settle(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<(), StoreError> {
        // Each function re-checks the state and the token in the `WHERE` of the `UPDATE` that
        // writes (on the row it locks), so `false` means nothing was written.
        match self.query_one(sql, params).await {
            Ok(row) if row.get::<_, bool>(0) => Ok(()),
            Ok(_) => Err(StoreError::fenced()),
            Err(err) => Err(err.into()),
        }
    }

    pub(super) fn spawn_sweeper(&self, every: Duration) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        // A weak handle: the sweeper ends when the last clone of the store is dropped.
        let weak = Arc::downgrade(&self.inner);
        runtime.spawn(async move {
            // `Delay`: a sweep that overran its period (a large backlog) is followed by a
            // full pause, not by a burst of catch-up sweeps competing with live claims.
            let mut ticks = tokio::time::interval(every);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            // The first tick completes at once: skipped, so that no sweep runs at start-up,
            // when every replica connects (and would sweep) at the same moment.
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

impl IdempotencyStore for PostgresStore {
    fn begin(&self, request: BeginRequest) -> StoreFuture<'_, Begin> {
        StoreFuture::new(async move {
            let token = request.token;
            let frozen = request.frozen.as_ref().map(FrozenRequest::encode);
            let origin = request.named_origin();
            let answer = self
                .query_one(
                    &self.inner.sql.begin,
                    &begin_params(&request, &frozen, origin.as_ref()).as_params(),
                )
                .await;
            match answer {
                Ok(row) => decode_begin(&row, token),
                // `lock_timeout` ran out waiting on the key's row. Plain calls hold a row for
                // one statement; only a transactional-mode request holds it (an uncommitted
                // claim) for as long as its handler runs, and that operation is in flight.
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
                    // Not strict: a refused completion answers `false` (fenced) instead of
                    // raising; only the transactional mode needs it to abort a transaction.
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
            let released_ms = millis(crate::ledger::RELEASED_TOKEN_TTL, 1);
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

    fn forget(
        &self,
        key: LedgerKey,
        expected: crate::ledger::Expected,
    ) -> StoreFuture<'_, crate::ledger::Forget> {
        StoreFuture::new(async move {
            let answer = self.forget_record(key, expected).await;
            crate::ledger::report_forget("postgres", &key, &expected, &answer);
            answer
        })
    }

    fn resolve(
        &self,
        key: LedgerKey,
        expected: crate::ledger::Expected,
        outcome: Outcome,
        retention: Duration,
    ) -> StoreFuture<'_, crate::ledger::Resolve> {
        StoreFuture::new(async move {
            let answer = self
                .resolve_record(key, expected, &outcome, retention)
                .await;
            crate::ledger::report_resolve("postgres", &key, &expected, outcome.status(), &answer);
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
            // `inspect_op` answers no row for an absent, expired or released key.
            rows.first()
                .map(|row| {
                    Ok(decode_inspect(row, INSPECTED_ORIGIN_AT)?
                        .with_request(inspected_request(row)?))
                })
                .transpose()
        })
    }

    fn list(&self, query: ListQuery) -> StoreFuture<'_, ListPage> {
        StoreFuture::new(async move { self.list_records(&query).await })
    }
}

// An operator forgetting one record (see `ledger::forget`): one conditional `DELETE`, its
// own statement rather than a schema function. The generation is compared as
// `generation_of` derives it (schema version 3), so a row an earlier version wrote is
// judged by the generation `inspect_op` showed for it. Tokens released beside the record
// (schema version 4) outlast it: the same statement puts a marker row of them in its place
// while they last.
impl PostgresStore {
    /// Delete the record of `key` if it is still as `expected`. The `DELETE` re-checks its
    /// conditions on the row it locks (a concurrent transition makes it wait, then judge
    /// the new version), so the record is judged and removed in one atomic step. When
    /// nothing was deleted, a read says why; if the record matches by then (a lease ran
    /// out in between), the answer is `Changed`: nothing was forgotten, look again.
    async fn forget_record(
        &self,
        key: LedgerKey,
        expected: crate::ledger::Expected,
    ) -> Result<crate::ledger::Forget, StoreError> {
        let sql = format!(
            "WITH gone AS ( \
                 DELETE FROM {schema}.records \
                  WHERE key = $1 AND retain_until > clock_timestamp() \
                    AND {schema}.generation_of(generation, created_at) = $6 \
                    AND state = $2 AND fingerprint = $3 AND attempts = $4 \
                    AND (state <> 'in_flight' OR $5 OR lease_until <= clock_timestamp()) \
                 RETURNING state, released, released_until \
             ), kept AS ( \
                 INSERT INTO {schema}.records \
                     (key, fingerprint, state, created_at, retain_until, attempts, released, \
                      released_until) \
                 SELECT $1, '\\x'::bytea, 'released', clock_timestamp(), released_until, 0, \
                        released, released_until \
                   FROM gone WHERE released_until > clock_timestamp() \
             ) \
             SELECT state FROM gone",
            schema = self.inner.schema
        );
        let attempts = i32::try_from(expected.attempts).unwrap_or(i32::MAX);
        let generation = generation_column(expected.generation);
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
                            &generation,
                        ],
                    )
                    .await
                    .map_err(from_pg)
            })
            .await?;
        if !deleted.is_empty() {
            return Ok(crate::ledger::Forget::Forgotten);
        }
        let current = self.inspect(key).await?;
        Ok(match expected.judge(current.as_ref()) {
            crate::ledger::Forget::Forgotten => crate::ledger::Forget::Changed,
            refused => refused,
        })
    }
}

// An operator resolving one record as applied (see `ledger::resolve`): one conditional
// `UPDATE`, its own statement as a forget's is, completing the record as `complete_op`
// does (the fingerprint and frozen request stay, the token and lease go, the retention
// starts again from now; the touch trigger stamps the change). No schema change: the
// columns a completion writes are all there.
impl PostgresStore {
    /// Complete the record of `key` with `outcome` if it is still as `expected` and open.
    /// The `UPDATE` re-checks its conditions on the row it locks (a concurrent transition
    /// makes it wait, then judge the new version), so the record is judged and completed
    /// in one atomic step. When nothing was written, a read says why; if the record
    /// matches by then (a lease ran out in between), the answer is `Changed`: nothing was
    /// resolved, look again.
    async fn resolve_record(
        &self,
        key: LedgerKey,
        expected: crate::ledger::Expected,
        outcome: &Outcome,
        retention: Duration,
    ) -> Result<crate::ledger::Resolve, StoreError> {
        let sql = format!(
            "UPDATE {schema}.records \
                SET state = 'completed', outcome = $7, status = $8, token = NULL, \
                    lease_until = NULL, \
                    retain_until = clock_timestamp() + $9::bigint * interval '1 millisecond' \
              WHERE key = $1 AND retain_until > clock_timestamp() \
                AND {schema}.generation_of(generation, created_at) = $6 \
                AND state = $2 AND state IN ('in_flight', 'in_doubt') \
                AND fingerprint = $3 AND attempts = $4 \
                AND (state <> 'in_flight' OR $5 OR lease_until <= clock_timestamp()) \
             RETURNING state",
            schema = self.inner.schema
        );
        let attempts = i32::try_from(expected.attempts).unwrap_or(i32::MAX);
        let generation = generation_column(expected.generation);
        let encoded = outcome.encode();
        let status = outcome_status(outcome);
        let retention = millis(retention, 1);
        let resolved = self
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
                            &generation,
                            &encoded,
                            &status,
                            &retention,
                        ],
                    )
                    .await
                    .map_err(from_pg)
            })
            .await?;
        if !resolved.is_empty() {
            return Ok(crate::ledger::Resolve::Resolved);
        }
        let current = self.inspect(key).await?;
        Ok(match expected.judge_resolve(current.as_ref()) {
            crate::ledger::Resolve::Resolved => crate::ledger::Resolve::Changed,
            refused => refused,
        })
    }
}
