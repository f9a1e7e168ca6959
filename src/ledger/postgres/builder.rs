//! [`PostgresStoreBuilder`]: the settings of a [`PostgresStore`], and connecting it.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::tls::{MakeTlsConnect, TlsConnect};
use tokio_postgres::{NoTls, Socket};

use super::codec::setting_millis;
use super::errors::{from_pg, from_pool};
use super::schema::validate_schema;
use super::store::{Inner, Statements};
use super::PostgresStore;
use crate::ledger::StoreError;

/// The schema unless [`PostgresStoreBuilder::schema`] says otherwise.
const DEFAULT_SCHEMA: &str = "tower_idempotency";
const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(1);
const DEFAULT_CONNECTION_TIMEOUT: Duration = Duration::from_secs(2);
const DEFAULT_LOCK_WAIT: Duration = Duration::from_millis(100);
const DEFAULT_POOL_SIZE: usize = 16;
const DEFAULT_SWEEP_EVERY: Duration = Duration::from_secs(60);

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

pub(super) enum Target {
    // Parsed at `connect`, so the builder stays infallible and chainable.
    Url(String),
    Config(Box<tokio_postgres::Config>),
}

impl PostgresStoreBuilder {
    pub(super) fn new(target: Target) -> Self {
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
    /// [module docs](super#the-transactional-server-mode)).
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
        // Ours after theirs: of two `-c` for one setting the later wins, so the ledger's
        // bounds hold even when the URL sets its own.
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
        // One connection made now: a wrong URL, credential or unreachable host fails here, at
        // start-up, rather than as a `503` on the first keyed request.
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
}
