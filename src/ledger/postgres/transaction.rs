//! The transactional server mode's transaction: opened with the claim, shared with the
//! handler, committed with the record.

use std::fmt;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{ClientWrapper, Object};

use tokio_postgres::types::ToSql;

use super::codec::{
    begin_params, busy_behind_a_transaction, decode_begin, millis, outcome_status, token_bytes,
};
use super::errors::{classify, from_pg, from_pool, PgFailure};
use super::PostgresStore;
use crate::ledger::{Begin, BeginRequest, LeaseToken, LedgerKey, Outcome, StoreError};

/// The database transaction of one keyed request in the transactional server mode (see
/// the [module docs](super#the-transactional-server-mode)): the layer puts it in the
/// request's extensions, the handler makes its writes through it, and the layer commits
/// them together with the recorded response.
///
/// Cloning is cheap; clones share the one transaction. The handler must not commit or roll
/// back itself: the layer commits when the handler answers below `500`, and rolls back
/// (recording nothing) when it answers `5xx`, fails, panics, or called
/// [`set_rollback_only`](Self::set_rollback_only).
///
/// # Example
///
/// ```no_run
/// use axum::{http::StatusCode, routing::post, Router};
/// use tower_idempotency::ledger::{PostgresStore, PostgresTransaction};
/// use tower_idempotency::IdempotencyLayer;
///
/// async fn charge(tx: PostgresTransaction) -> Result<(StatusCode, String), StatusCode> {
///     let client = tx.client().await.map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
///     let row = client
///         .query_one("INSERT INTO charges (amount_cents) VALUES (1999) RETURNING id", &[])
///         .await
///         .map_err(|_| StatusCode::INTERNAL_SERVER_ERROR)?;
///     let id: i64 = row.get(0);
///     Ok((StatusCode::CREATED, format!("charge {id}")))
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// let store = PostgresStore::connect("postgres://app@127.0.0.1/payments").await?;
/// store.migrate().await?;
/// let layer = IdempotencyLayer::transactional_server_builder(store).unscoped().build()?;
/// let app: Router = Router::new().route("/charges", post(charge).route_layer(layer));
/// # let _ = app;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct PostgresTransaction {
    shared: Arc<Shared>,
}

/// The connection and the handler's wish, shared by the layer and the handler.
struct Shared {
    // An async mutex: the handler holds the connection across its awaits. It also orders the
    // handler's statements before the layer's record and `COMMIT`: the layer takes the
    // connection out (`None` from then on), so no handler statement can land after the
    // commit, in a transaction that is over or on a connection back in the pool.
    connection: tokio::sync::Mutex<Option<TxConnection>>,
    rollback_only: AtomicBool,
}

/// A pooled connection with an open transaction. Dropped while the transaction may still be
/// open, it is closed instead of returned to the pool: PostgreSQL then rolls back whatever
/// the transaction did, and no later user of the pool inherits it.
struct TxConnection {
    object: Option<Object>,
}

impl TxConnection {
    fn client(&self) -> &ClientWrapper {
        self.object.as_ref().expect("present until released")
    }

    /// The transaction is over (committed or rolled back): the connection may be reused.
    fn release(mut self) {
        drop(self.object.take());
    }
}

impl Drop for TxConnection {
    fn drop(&mut self) {
        if let Some(object) = self.object.take() {
            // Detached from the pool and dropped: the connection closes.
            drop(Object::take(object));
        }
    }
}

impl PostgresTransaction {
    /// The transaction's connection, for the handler's queries (`execute`, `query`,
    /// `prepare_cached`…). Only a shared borrow is handed out, so the handler cannot start
    /// a nested `transaction()` that would commit the layer's; use `SAVEPOINT` statements
    /// for partial rollbacks. Fails once the request's transaction is over.
    ///
    /// ```no_run
    /// # use tower_idempotency::ledger::PostgresTransaction;
    /// # async fn f(tx: PostgresTransaction) -> Result<(), Box<dyn std::error::Error>> {
    /// let client = tx.client().await?;
    /// client.execute("UPDATE accounts SET balance = balance - 10 WHERE id = 1", &[]).await?;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn client(&self) -> Result<TransactionClient<'_>, StoreError> {
        let guard = self.shared.connection.lock().await;
        if guard.is_none() {
            return Err(StoreError::unavailable(
                "the request's transaction is already over",
            ));
        }
        Ok(TransactionClient { guard })
    }

    /// Roll the transaction back when the handler returns, whatever it answers: none of its
    /// writes happen and no outcome is recorded, so a retry runs the handler again.
    ///
    /// ```no_run
    /// # use tower_idempotency::ledger::PostgresTransaction;
    /// # async fn f(tx: PostgresTransaction) {
    /// tx.set_rollback_only();
    /// assert!(tx.is_rollback_only());
    /// # }
    /// ```
    pub fn set_rollback_only(&self) {
        self.shared.rollback_only.store(true, Ordering::Relaxed);
    }

    /// Whether [`set_rollback_only`](Self::set_rollback_only) was called.
    pub fn is_rollback_only(&self) -> bool {
        self.shared.rollback_only.load(Ordering::Relaxed)
    }
}

impl fmt::Debug for PostgresTransaction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresTransaction")
            .field("rollback_only", &self.is_rollback_only())
            .finish_non_exhaustive()
    }
}

/// With feature `axum`, a handler takes the transaction as an argument. Outside a
/// transactional layer it is refused with `500`: the route is misconfigured, and running
/// it without its transaction would record nothing.
#[cfg(feature = "axum")]
impl<S: Send + Sync> axum::extract::FromRequestParts<S> for PostgresTransaction {
    type Rejection = (http::StatusCode, &'static str);

    async fn from_request_parts(
        parts: &mut http::request::Parts,
        _state: &S,
    ) -> Result<Self, Self::Rejection> {
        parts.extensions.get::<Self>().cloned().ok_or((
            http::StatusCode::INTERNAL_SERVER_ERROR,
            "this route is not behind a transactional idempotency layer",
        ))
    }
}

/// The transaction's connection, borrowed by the handler (see
/// [`PostgresTransaction::client`]). Dereferences to deadpool's [`ClientWrapper`], and
/// through it to [`tokio_postgres::Client`].
pub struct TransactionClient<'a> {
    guard: tokio::sync::MutexGuard<'a, Option<TxConnection>>,
}

impl Deref for TransactionClient<'_> {
    type Target = ClientWrapper;

    fn deref(&self) -> &ClientWrapper {
        self.guard.as_ref().expect("checked when borrowed").client()
    }
}

impl fmt::Debug for TransactionClient<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransactionClient").finish_non_exhaustive()
    }
}

/// A request's transaction as the layer holds it, from its claim to its commit.
///
/// Dropped without [`commit_with`](Self::commit_with) (a replay, a refused claim, a failed
/// handler), it rolls back: in a background task that returns the connection to the pool,
/// or by closing the connection when that cannot be done.
pub(crate) struct OpenTransaction {
    store: PostgresStore,
    shared: Arc<Shared>,
}

impl PostgresStore {
    /// Open a transaction whose first statement claims `request`'s key: `BEGIN` and the
    /// claim travel together, in one round trip, and the claim also lifts the store's
    /// bounds for the handler's own statements.
    ///
    /// A finished operation is answered first, from a plain read of its completed record,
    /// without the key's lock: a replay neither waits for nor is refused by a lock that
    /// an earlier request's transaction still holds (a replay's own transaction, whose
    /// `ROLLBACK` is sent from the background after its answer), and holds none itself.
    ///
    /// Otherwise the claim never waits for another open transaction holding the key: it
    /// takes the key's transaction-scoped advisory lock without waiting, and when another
    /// request's transaction holds it, `begin_op` is not run at all and the answer is busy.
    /// Waiting on the row lock instead would hold a pooled connection per waiting
    /// duplicate, and a wait cut off by `lock_timeout` leaves an error in PostgreSQL's
    /// log for every `409`. Brief row locks (a plain-mode call on the same key, the sweep)
    /// are still waited for, up to the store's [`lock_wait`](crate::ledger::PostgresStoreBuilder::lock_wait).
    pub(crate) async fn begin_in_transaction(
        &self,
        request: &BeginRequest,
    ) -> Result<(Begin, OpenTransaction), StoreError> {
        let frozen = request.frozen.as_ref().map(crate::FrozenRequest::encode);
        let origin = request.named_origin();
        let params = begin_params(request, &frozen, origin.as_ref());
        let lock = claim_lock(&self.inner.schema, request.key);
        let work = async {
            let object = self
                .inner
                .pool
                .get()
                .await
                .map_err(|err| PgFailure(from_pool(err), false))?;
            // From here on, a drop closes the connection unless the transaction ended.
            let connection = TxConnection {
                object: Some(object),
            };
            let client = connection.client();
            let statement = client
                .prepare_cached(&self.inner.sql.claim)
                .await
                .map_err(classify)?;
            let [key, fp, token, lease, retention, take_over, frozen, scope, face, target, task, step] =
                params.as_params();
            let params: [&(dyn ToSql + Sync); 13] = [
                key, fp, token, lease, retention, take_over, frozen, &lock, scope, face, target,
                task, step,
            ];
            // `join!` polls in the order written, and tokio-postgres queues a request on its
            // first poll, so `BEGIN` reaches the server before the claim: the claim is the
            // transaction's first statement, and both go in one round trip.
            let (opened, claimed) = tokio::join!(
                client.batch_execute("BEGIN"),
                client.query(&statement, &params),
            );
            let outcome = opened
                .map_err(classify)
                .and_then(|()| claimed.map_err(classify))
                .and_then(|rows| match rows.first() {
                    // No row: the key's lock is another open transaction's.
                    None => Ok(busy_behind_a_transaction(request)),
                    Some(row) => {
                        decode_begin(row, request.token).map_err(|err| PgFailure(err, false))
                    }
                });
            Ok::<_, PgFailure>((outcome, connection))
        };
        // Cut off here, `connection` drops with the future and closes: an open transaction
        // (and the claim in it) is rolled back by the server, never left to a later user.
        let (outcome, connection) = tokio::time::timeout(self.inner.operation_timeout, work)
            .await
            .map_err(|_elapsed| StoreError::timeout())?
            .map_err(PgFailure::into_store_error)?;
        let transaction = OpenTransaction {
            store: self.clone(),
            shared: Arc::new(Shared {
                connection: tokio::sync::Mutex::new(Some(connection)),
                rollback_only: AtomicBool::new(false),
            }),
        };
        match outcome {
            Ok(answer) => Ok((answer, transaction)),
            // Dropping `transaction` rolls the aborted transaction back. Only a transaction
            // that does not take the key's advisory lock (an older release's) holds a row
            // that long.
            Err(failure) if failure.is_lock_wait() => {
                Ok((busy_behind_a_transaction(request), transaction))
            }
            Err(failure) => Err(failure.into_store_error()),
        }
    }
}

/// The advisory lock a transactional-mode claim takes on its key: 64 bits of the key (a
/// SHA-256 already) mixed with the schema's name, so two ledgers sharing a database do not
/// hold up each other's keys. Every process must compute the same number, hence a fixed
/// hash (FNV-1a) rather than the standard library's.
fn claim_lock(schema: &str, key: LedgerKey) -> i64 {
    let schema = schema
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
        });
    let bytes = key.as_bytes();
    let key = u64::from_be_bytes(bytes[..8].try_into().expect("32 bytes"));
    i64::from_be_bytes((key ^ schema).to_be_bytes())
}

/// Why a request's transaction did not commit, as far as the layer can tell.
#[derive(Debug)]
pub(crate) enum CommitError {
    /// PostgreSQL answered, or the `COMMIT` was never sent: the transaction was rolled
    /// back, the handler's writes with it.
    RolledBack(StoreError),
    /// The answer was lost (the connection failed, or the bound ran out) after the
    /// `COMMIT` was sent: it may have committed.
    Unknown(StoreError),
}

impl std::fmt::Display for CommitError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::RolledBack(err) => write!(f, "rolled back: {err}"),
            Self::Unknown(err) => write!(f, "commit outcome unknown: {err}"),
        }
    }
}

/// A statement of a pipelined commit failed: PostgreSQL's own error ends the transaction
/// as a rollback; a lost connection leaves the commit unknown.
fn commit_failure(err: tokio_postgres::Error) -> CommitError {
    if err.as_db_error().is_some() {
        CommitError::RolledBack(from_pg(err))
    } else {
        CommitError::Unknown(from_pg(err))
    }
}

impl OpenTransaction {
    /// The handle the handler gets.
    pub(crate) fn handle(&self) -> PostgresTransaction {
        PostgresTransaction {
            shared: self.shared.clone(),
        }
    }

    /// Whether the handler asked for a rollback.
    pub(crate) fn is_rollback_only(&self) -> bool {
        self.shared.rollback_only.load(Ordering::Relaxed)
    }

    /// Roll back now, and only then let the answer go: a client that retries at once must
    /// find the key free, not still held by a `ROLLBACK` on its way (as after a drop, which
    /// can only send one in the background). Within the store's operation bound; past it,
    /// or while the handler still holds the connection, the drop's way is taken.
    pub(crate) async fn rollback(self) {
        let bound = self.store.inner.operation_timeout;
        let work = async {
            let Some(connection) = self.shared.connection.lock().await.take() else {
                return;
            };
            // Back to the pool only after a confirmed `ROLLBACK`, as on a drop.
            if let Ok(()) = connection.client().batch_execute("ROLLBACK").await {
                connection.release();
            }
        };
        // Out of time, the connection (if taken) drops closed: PostgreSQL rolls back.
        let _ = tokio::time::timeout(bound, work).await;
    }

    /// Record `outcome` under `token` and commit, the two sent together: one round trip.
    /// `Ok` means both the handler's writes and the record are committed. An error says
    /// whether they were rolled back or (the connection lost, or the bound run out, after
    /// the `COMMIT` was sent) it is unknown which: a retry then replays the record or,
    /// finding none, runs the handler again, and either is right.
    pub(crate) async fn commit_with(
        self,
        key: LedgerKey,
        token: LeaseToken,
        outcome: &Outcome,
        retention: Duration,
    ) -> Result<(), CommitError> {
        let encoded = outcome.encode();
        let status = outcome_status(outcome);
        let token = token_bytes(token);
        let retention = millis(retention, 1);
        let bound = self.store.inner.operation_timeout;
        let work = async {
            // The handler may still hold the connection (a guard kept past its response);
            // wait for it, within the bound.
            let Some(connection) = self.shared.connection.lock().await.take() else {
                return Err(CommitError::RolledBack(StoreError::unavailable(
                    "the request's transaction was already over",
                )));
            };
            let client = connection.client();
            // Nothing is committed without the `COMMIT`: a failure here is a rollback
            // (the connection, closed on drop, takes the transaction with it).
            let statement = client
                .prepare_cached(&self.store.inner.sql.complete)
                .await
                .map_err(|err| CommitError::RolledBack(from_pg(err)))?;
            // `p_strict`: a refused completion raises, so the transaction cannot commit
            // without its record; the `COMMIT` then ends it as a rollback.
            let key = key.as_bytes().as_slice();
            let token = token.as_slice();
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 6] =
                [&key, &token, &encoded, &status, &retention, &true];
            // Record, then `COMMIT`, queued in that order in one round trip (as `BEGIN` and
            // the claim are). Nothing can have moved the record since the claim: the key's
            // advisory lock keeps other transactional claims out, and the claim's own write
            // holds the row against plain calls until this commit.
            let (recorded, committed) = tokio::join!(
                client.query_one(&statement, &params),
                client.batch_execute("COMMIT"),
            );
            let result = match (recorded, committed) {
                (Ok(_), Ok(())) => Ok(()),
                (Err(err), _) | (Ok(_), Err(err)) => Err(commit_failure(err)),
            };
            if !connection.client().is_closed() {
                // Committed, or ended as a rollback by the failed statement: either way
                // no transaction is open any more.
                connection.release();
            }
            result
        };
        tokio::time::timeout(bound, work)
            .await
            .map_err(|_elapsed| CommitError::Unknown(StoreError::timeout()))?
    }
}

impl Drop for OpenTransaction {
    fn drop(&mut self) {
        // Still borrowed by the handler (a clone kept somewhere): the last `Shared` to go
        // closes the connection, rolling back.
        let Ok(mut slot) = self.shared.connection.try_lock() else {
            return;
        };
        let Some(connection) = slot.take() else {
            return;
        };
        drop(slot);
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return; // `connection` drops here, closing: PostgreSQL rolls back.
        };
        let bound = self.store.inner.operation_timeout;
        runtime.spawn(async move {
            let rolled_back =
                tokio::time::timeout(bound, connection.client().batch_execute("ROLLBACK")).await;
            // Back to the pool only after a confirmed `ROLLBACK`: a connection whose
            // transaction may still be open is closed on drop instead, so no later user of
            // the pool inherits the request's writes.
            if let Ok(Ok(())) = rolled_back {
                connection.release();
            }
        });
    }
}
