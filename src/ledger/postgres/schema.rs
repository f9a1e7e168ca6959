//! The ledger's schema: its versions, and [`PostgresStore::migrate`], which brings a
//! database to this release's.

use std::time::Duration;

use super::errors::{from_pg, from_pool};
use super::PostgresStore;
use crate::ledger::StoreError;

/// The schema version this release creates and reads.
pub const SCHEMA_VERSION: i32 = 5;

/// Each version's migration, applied in order; `{schema}` is the store's schema.
const MIGRATIONS: &[&str] = &[
    include_str!("schema_v1.sql"),
    include_str!("schema_v2.sql"),
    include_str!("schema_v3.sql"),
    include_str!("schema_v4.sql"),
    include_str!("schema_v5.sql"),
];

impl PostgresStore {
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
        // DDL may wait on locks longer than a ledger call (an `ALTER TABLE` waits for every
        // call on the table to finish): bound it by the operation timeout, but never less
        // than 30 s.
        let bound = self.inner.operation_timeout.max(Duration::from_secs(30));
        let work = async {
            let mut client = self.inner.pool.get().await.map_err(from_pool)?;
            // Every step, and the version bump, in one transaction: a migrator that dies half
            // way leaves the previous version whole, and the next one starts from it.
            let tx = client.transaction().await.map_err(from_pg)?;
            // The pool's connections carry the ledger calls' `statement_timeout` and
            // `lock_timeout`, far too short for DDL; `LOCAL` lifts them for this transaction
            // only (the connection returns to the pool with its own), and `bound` still holds.
            tx.batch_execute("SET LOCAL statement_timeout = 0; SET LOCAL lock_timeout = 0")
                .await
                .map_err(from_pg)?;
            // One migrator at a time per schema; the others find the work done. Taken before
            // the `IF NOT EXISTS` statements below, which are not safe against each other:
            // two concurrent `CREATE TABLE IF NOT EXISTS` can both miss and one then fails.
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
}

/// The schema name is spliced into SQL text, so it must be a plain identifier.
pub(super) fn validate_schema(schema: &str) -> Result<(), StoreError> {
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
}
