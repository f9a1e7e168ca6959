//! How a PostgreSQL failure becomes a [`StoreError`].

use tokio_postgres::error::SqlState;

use crate::ledger::StoreError;

/// A database failure before it is given its place in the protocol: the error, and whether
/// the statement gave up waiting for a lock (which `begin` answers as busy, not as a
/// failure).
pub(crate) struct PgFailure(pub(super) StoreError, pub(super) bool);

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
    // No SQLSTATE: the connection failed (closed, I/O), not the statement, and whether the
    // statement ran is unknown. Unavailable, like a timeout, is what the engine treats as
    // ambiguous: a `begin` is asked again under its token, never taken as "nothing claimed".
    let Some(code) = err.code() else {
        return PgFailure(StoreError::unavailable(err), false);
    };
    // `lock_timeout`: the key's row is held by another open transaction. Flagged apart
    // because for `begin` that is an answer (busy), not a failure.
    if *code == SqlState::LOCK_NOT_AVAILABLE {
        PgFailure(StoreError::timeout(), true)
    } else if *code == SqlState::QUERY_CANCELED {
        // `statement_timeout`, the server's copy of the operation timeout, cut the
        // statement off (or an operator cancelled it): the statement was rolled back.
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
