//! [`RedisStoreBuilder`]: the settings of a [`RedisStore`], and connecting it.

use std::fmt;
use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::Client;

use super::connection::Connection;
use super::errors::from_redis;
use super::scripts::ALL_SCRIPTS;
use super::settings::{
    warn_if_ledger_keys_can_be_evicted, warn_if_records_do_not_survive_a_restart,
};
use super::RedisStore;
use crate::ledger::StoreError;

/// The key prefix unless [`RedisStoreBuilder::prefix`] says otherwise.
pub(super) const DEFAULT_PREFIX: &str = "idem:";
pub(super) const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(1);
pub(super) const DEFAULT_CONNECTION_TIMEOUT: Duration = Duration::from_secs(1);
pub(super) const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(1);
/// The manager's reconnect backoff is exponential; capping it bounds how long after Redis
/// comes back the store notices. The default (uncapped, six retries) can sleep for seconds.
pub(super) const DEFAULT_RECONNECT_MAX_DELAY: Duration = Duration::from_secs(1);

/// Builds a [`RedisStore`]; from [`RedisStore::builder`] or
/// [`RedisStore::builder_with_client`].
///
/// # Example
///
/// ```no_run
/// use std::time::Duration;
/// use tower_idempotency::ledger::RedisStore;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
/// let store = RedisStore::builder("redis://ledger.internal:6379/0")
///     .prefix("orders:idem:")
///     .operation_timeout(Duration::from_millis(300))
///     .connection_timeout(Duration::from_millis(250))
///     .connect()
///     .await?;
/// # let _ = store;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
#[must_use = "a builder does nothing until `connect` is called"]
pub struct RedisStoreBuilder {
    target: Target,
    prefix: String,
    operation_timeout: Duration,
    connection_timeout: Duration,
    response_timeout: Duration,
    manager_config: Option<ConnectionManagerConfig>,
}

#[derive(Clone)]
pub(super) enum Target {
    // Parsed at `connect`, so the builder stays infallible and chainable.
    Url(String),
    Client(Client),
}

impl RedisStoreBuilder {
    pub(super) fn new(target: Target) -> Self {
        Self {
            target,
            prefix: DEFAULT_PREFIX.to_owned(),
            operation_timeout: DEFAULT_OPERATION_TIMEOUT,
            connection_timeout: DEFAULT_CONNECTION_TIMEOUT,
            response_timeout: DEFAULT_RESPONSE_TIMEOUT,
            manager_config: None,
        }
    }

    /// The prefix of every key the store writes (default `idem:`). Give each ledger sharing
    /// a Redis database its own prefix.
    ///
    /// ```
    /// # use tower_idempotency::ledger::RedisStore;
    /// let builder = RedisStore::builder("redis://127.0.0.1/").prefix("billing:idem:");
    /// # let _ = builder;
    /// ```
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The most any store operation may take, waiting for a connection included (default
    /// 1 s). Past it the operation fails with a [timeout](StoreError::is_timeout) error, so a
    /// stalled Redis fails requests closed and fast instead of hanging them.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::ledger::RedisStore;
    /// let builder = RedisStore::builder("redis://127.0.0.1/")
    ///     .operation_timeout(Duration::from_millis(200));
    /// # let _ = builder;
    /// ```
    pub fn operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout;
        self
    }

    /// How long one attempt to (re)connect may take (default 1 s). Reconnection runs in the
    /// background; operations meanwhile fail within their operation timeout.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::ledger::RedisStore;
    /// let builder = RedisStore::builder("redis://127.0.0.1/")
    ///     .connection_timeout(Duration::from_millis(250));
    /// # let _ = builder;
    /// ```
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout;
        self
    }

    /// How long the connection waits for one reply before failing it (default 1 s). The
    /// operation timeout bounds the whole operation anyway; this one frees the connection's
    /// bookkeeping for replies that never come.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::ledger::RedisStore;
    /// let builder = RedisStore::builder("redis://127.0.0.1/")
    ///     .response_timeout(Duration::from_millis(500));
    /// # let _ = builder;
    /// ```
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// Start from this connection manager configuration (reconnect backoff, concurrency
    /// limits, credentials providers…) instead of the store's defaults (reconnect backoff
    /// capped at 1 s). The [connection](Self::connection_timeout) and
    /// [response](Self::response_timeout) timeouts of this builder are applied on top.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::ledger::RedisStore;
    /// let config = redis::aio::ConnectionManagerConfig::new()
    ///     .set_max_delay(Duration::from_millis(500))
    ///     .set_number_of_retries(10);
    /// let builder = RedisStore::builder("redis://127.0.0.1/").connection_manager_config(config);
    /// # let _ = builder;
    /// ```
    pub fn connection_manager_config(mut self, config: ConnectionManagerConfig) -> Self {
        self.manager_config = Some(config);
        self
    }

    /// Connect and load the ledger scripts.
    ///
    /// Fails with an [unavailable](StoreError::is_unavailable) error when the URL is invalid
    /// or Redis cannot be reached (and have the scripts loaded) within the connection timeout
    /// plus the operation timeout. Once connected, the store reconnects by itself.
    ///
    /// ```no_run
    /// # use tower_idempotency::ledger::RedisStore;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// match RedisStore::builder("redis://127.0.0.1:6379/").connect().await {
    ///     Ok(store) => drop(store), // hand it to the layers
    ///     Err(err) => eprintln!("no ledger, refusing to start: {err}"),
    /// }
    /// # }
    /// ```
    pub async fn connect(self) -> Result<RedisStore, StoreError> {
        let client = match self.target {
            Target::Url(url) => Client::open(url.as_str()).map_err(from_redis)?,
            Target::Client(client) => client,
        };
        let addr = client.get_connection_info().addr().to_string();
        let config = self
            .manager_config
            .unwrap_or_else(|| {
                ConnectionManagerConfig::new().set_max_delay(DEFAULT_RECONNECT_MAX_DELAY)
            })
            .set_connection_timeout(Some(self.connection_timeout))
            .set_response_timeout(Some(self.response_timeout));
        // Lazy, so the first connection (and the manager's retry loop around it, which could
        // run for many seconds against a dead server) happens under our own bound below; if
        // that bound passes, dropping the manager cancels the loop.
        let manager =
            ConnectionManager::new_lazy_with_config(client, config).map_err(from_redis)?;

        // Loading the scripts up front proves the connection and keeps the `NOSCRIPT`
        // fallback off the hot path; it is one pipelined round trip.
        let mut load = ::redis::pipe();
        for code in ALL_SCRIPTS {
            load.cmd("SCRIPT").arg("LOAD").arg(code);
        }
        let bound = self
            .connection_timeout
            .saturating_add(self.operation_timeout);
        let mut connection = manager.clone();
        match tokio::time::timeout(bound, load.query_async::<Vec<String>>(&mut connection)).await {
            Ok(Ok(_shas)) => {}
            Ok(Err(err)) => return Err(from_redis(err)),
            Err(_elapsed) => {
                return Err(StoreError::unavailable(format!(
                    "could not reach Redis at {addr} within {bound:?}"
                )))
            }
        }

        let connection = Connection::Single(manager);
        warn_if_ledger_keys_can_be_evicted(&connection, &addr, bound).await;
        warn_if_records_do_not_survive_a_restart(&connection, &addr, bound).await;

        Ok(RedisStore {
            connection,
            layout: super::layout::Layout::Single {
                prefix: self.prefix.into(),
            },
            operation_timeout: self.operation_timeout,
            addr: addr.into(),
        })
    }
}

impl fmt::Debug for RedisStoreBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The URL may carry a password: show only where it points.
        let target = match &self.target {
            Target::Url(_) => "url",
            Target::Client(_) => "client",
        };
        f.debug_struct("RedisStoreBuilder")
            .field("target", &target)
            .field("prefix", &self.prefix)
            .field("operation_timeout", &self.operation_timeout)
            .field("connection_timeout", &self.connection_timeout)
            .field("response_timeout", &self.response_timeout)
            .field("manager_config", &self.manager_config)
            .finish()
    }
}
