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
//! use tower_idempotency::fingerprint::Fingerprint;
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
//! - **One row per record** in `<schema>.records`, keyed by the 32-byte [`LedgerKey`](crate::ledger::LedgerKey).
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
//!   A token released while a record holds the key (another caller's, or one put in doubt)
//!   is kept in that record's row (`released`, and `released_until`, schema version 4),
//!   refused whatever the record says, and outlasts it: a release or a forget leaves a
//!   marker row of the tokens still remembered, and the sweep keeps a row past its
//!   retention while they last. Only a new claim of the key ends them.
//! - **The database's clock judges leases and retention** (`clock_timestamp()` inside each
//!   function), never the application hosts' clocks.
//! - **Retention.** A record past its retention is absent to every call (a new claim takes
//!   its place, writes to it are fenced, [`inspect`](super::IdempotencyStore::inspect) shows
//!   nothing) from that instant, whether or not it was deleted yet. A background
//!   [sweep](super::PostgresStoreBuilder::sweep_every) deletes such rows in small batches with
//!   `FOR UPDATE SKIP LOCKED`, so it never waits for a live operation nor holds one up.
//!   PostgreSQL has no memory budget to protect records from: every record is kept for its
//!   whole retention, so the [protected window](super::BeginRequest::protected) always holds.
//! - **Bounded and fail closed.** Every call, waiting for a pooled connection included, is
//!   bounded by the [operation timeout](super::PostgresStoreBuilder::operation_timeout) (1 s by
//!   default), and the store's connections carry it as their `statement_timeout`; a
//!   `begin` waiting on a record another transaction holds gives up after
//!   [`lock_wait`](super::PostgresStoreBuilder::lock_wait) and answers busy. When the database is
//!   unreachable or slow, calls fail with an [unavailable](super::StoreError::is_unavailable)
//!   or [timeout](super::StoreError::is_timeout) error, never a claim.
//!
//! An operator's [`forget`](super::IdempotencyStore::forget) is one conditional `DELETE` of
//! the record's row, which re-checks its state, fingerprint, attempts and, while in flight,
//! its lease on the row it locks (see [`Records`](super::Records)); the schema is unchanged.
//! An operator's [`resolve`](super::IdempotencyStore::resolve) is one conditional `UPDATE`
//! of it making the same checks (and that it is open), which completes it as `complete_op`
//! does: no schema change either.
//!
//! An operator's [`list`](super::IdempotencyStore::list) walks an index of each listed
//! state's records, or of one scope's (`(state, created_at, key)`, `(scope, state,
//! created_at, key)`), in claim order from the page's cursor, one statement per state sent
//! together, and merges the walks: a page reads about as many records as it shows, however
//! many the table holds, and never more than 5,000 per state (a filter the index cannot
//! apply, a completed record's status, may leave a page short, with a cursor to go on). A
//! listed record's position is its claim time in microseconds. Each record keeps its
//! claim's scope digest and when it last changed state, set by a trigger on the table, so
//! every transition keeps them (a previous release's too, during a rolling upgrade: its
//! claims are of no scope); [`inspect`](super::IdempotencyStore::inspect) shows both.
//! The same trigger keeps a new record's [origin](super::Origin) (schema version 5: the
//! nullable columns `origin_face`, `origin_target`, `origin_task` and `origin_step`, from
//! the claim's transaction; a record an earlier version wrote, or a previous release
//! claimed, has none), and a list filters by origin (a target's prefix, a tool, a task)
//! within the walk's bound, as by status.
//!
//! # The transactional server mode
//!
//! With [`IdempotencyLayer::transactional_server_builder`](crate::IdempotencyLayer::transactional_server_builder),
//! the server layer runs each keyed request in one database transaction: it claims the key
//! as that transaction's first statement (sent together with `BEGIN`: no extra round trip),
//! hands the transaction to the handler as a [`PostgresTransaction`](super::PostgresTransaction) request extension, and
//! records the response in it, sent together with `COMMIT`. The handler's rows and the
//! recorded outcome commit together or not at all:
//!
//! - a process killed before the commit leaves nothing: PostgreSQL rolls the transaction
//!   back, claim included, and the retry runs the handler again, correctly, since nothing
//!   happened;
//! - after the commit the record exists, and the retry replays it;
//! - a handler that fails (a `5xx`, an error, a panic) or asks for a rollback
//!   ([`PostgresTransaction::set_rollback_only`](super::PostgresTransaction::set_rollback_only)) leaves no record and none of its writes.
//!
//! A finished operation is always replayed: the claim reads a completed record before it
//! takes any lock, so a duplicate of a finished request is answered its replay whatever
//! transaction still holds the key's lock (the `ROLLBACK` that ends a replay's own
//! transaction is sent after its answer), and a replay takes no lock.
//!
//! While the transaction is open, its claim is an uncommitted row, and the transaction
//! holds the key's advisory lock (`pg_try_advisory_xact_lock`, taken by the claim without
//! waiting). A duplicate request finds the lock taken at once and is busy: answered `409`
//! under [`BusyPolicy::Fail`](crate::BusyPolicy::Fail), or, under
//! [`BusyPolicy::Wait`](crate::BusyPolicy::Wait), asks again (backing off, up to 200 ms
//! apart) until the first commits and it replays, or the bound runs out (then `409`). A
//! waiting duplicate holds no pooled connection between its tries, and counts against
//! [`max_waiters`](crate::server::Builder::max_waiters). A `409` leaves no
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
//! - Connections are made without TLS unless [`PostgresStoreBuilder::tls`](super::PostgresStoreBuilder::tls) gives a connector.
//! - Store operations run on the real clock: under a paused tokio clock the operation
//!   timeout fires as soon as the runtime idles waiting for the database.

pub(crate) mod builder;
mod codec;
mod errors;
mod list;
mod schema;
pub(crate) mod store;
pub(crate) mod transaction;

pub use schema::SCHEMA_VERSION;
pub(crate) use store::PostgresStore;
pub use transaction::TransactionClient;
pub(crate) use transaction::{CommitError, OpenTransaction};
