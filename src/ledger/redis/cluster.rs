//! `RedisStore` over Redis Cluster: the same scripts and records, spread over the cluster's
//! primaries by key slot.

use std::fmt;
use std::time::Duration;

use ::redis::cluster::{ClusterClient, ClusterClientBuilder};
use ::redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo};
use ::redis::{IntoConnectionInfo, Value};

use super::builder::{
    DEFAULT_CONNECTION_TIMEOUT, DEFAULT_OPERATION_TIMEOUT, DEFAULT_PREFIX, DEFAULT_RESPONSE_TIMEOUT,
};
use super::connection::Connection;
use super::errors::from_redis;
use super::layout::Layout;
use super::scripts::ALL_SCRIPTS;
use super::settings::{
    warn_if_ledger_keys_can_be_evicted, warn_unless_records_survive_a_restart, Persistence,
    PERSISTENCE_SETTINGS,
};
use super::upgrade::may_hold_earlier_records;
use super::RedisStore;
use crate::ledger::StoreError;

/// The cluster client's default wait before retrying a refused or broken request starts at
/// 1.28 s, longer than a whole default operation. A failover or a resharding step is over in
/// milliseconds to seconds, so retry soon and often; the operation timeout bounds it all.
const RETRY_MIN_WAIT_MS: u64 = 10;
const RETRY_MAX_WAIT_MS: u64 = 200;

/// Builds a [`RedisStore`] over a Redis Cluster; from [`RedisStore::cluster_builder`].
///
/// The store sends each script to the primary that owns its record's key slot. redis-rs's
/// cluster client follows `MOVED` and `ASK` redirects while slots migrate, refreshes its
/// slot map after a failover and reconnects to nodes that come back. Reads are never sent
/// to replicas: a replica may not have the latest claim yet.
///
/// # Example
///
/// ```no_run
/// use std::time::Duration;
/// use tower_idempotency::ledger::RedisStore;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
/// let store = RedisStore::cluster_builder([
///     "redis://10.0.0.1:6379/",
///     "redis://10.0.0.2:6379/",
///     "redis://10.0.0.3:6379/",
/// ])
/// .prefix("orders:idem:")
/// .operation_timeout(Duration::from_millis(500))
/// .connect()
/// .await?;
/// # let _ = store;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
#[must_use = "a builder does nothing until `connect` is called"]
pub struct RedisClusterBuilder {
    nodes: Vec<String>,
    prefix: String,
    operation_timeout: Duration,
    connection_timeout: Duration,
    response_timeout: Duration,
}

impl RedisStore {
    /// Configure a store for the Redis Cluster reached through `nodes`
    /// (`redis://[user:password@]host:port/` each). Any reachable subset of the cluster's
    /// nodes will do: the client learns the rest, and the slot map, from them. Needs the
    /// `redis-cluster` feature.
    ///
    /// ```no_run
    /// # use tower_idempotency::ledger::RedisStore;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
    /// let store = RedisStore::cluster_builder(["redis://127.0.0.1:7000/", "redis://127.0.0.1:7001/"])
    ///     .connect()
    ///     .await?;
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub fn cluster_builder<I, S>(nodes: I) -> RedisClusterBuilder
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        RedisClusterBuilder {
            nodes: nodes.into_iter().map(Into::into).collect(),
            prefix: DEFAULT_PREFIX.to_owned(),
            operation_timeout: DEFAULT_OPERATION_TIMEOUT,
            connection_timeout: DEFAULT_CONNECTION_TIMEOUT,
            response_timeout: DEFAULT_RESPONSE_TIMEOUT,
        }
    }
}

impl RedisClusterBuilder {
    /// The prefix of every key the store writes (default `idem:`). Keep hash tags (`{…}`)
    /// out of it: a tagged prefix puts every record in one slot, so on one primary.
    ///
    /// ```
    /// # use tower_idempotency::ledger::RedisStore;
    /// let builder = RedisStore::cluster_builder(["redis://127.0.0.1:7000/"]).prefix("billing:idem:");
    /// # let _ = builder;
    /// ```
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// The most any store operation may take, redirects, retries and reconnections included
    /// (default 1 s). Past it the operation fails with a [timeout](StoreError::is_timeout)
    /// error, so a cluster in the middle of a failover fails requests closed instead of
    /// hanging them.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::ledger::RedisStore;
    /// let builder = RedisStore::cluster_builder(["redis://127.0.0.1:7000/"])
    ///     .operation_timeout(Duration::from_millis(300));
    /// # let _ = builder;
    /// ```
    pub fn operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = timeout;
        self
    }

    /// How long one attempt to connect to one node may take (default 1 s).
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::ledger::RedisStore;
    /// let builder = RedisStore::cluster_builder(["redis://127.0.0.1:7000/"])
    ///     .connection_timeout(Duration::from_millis(250));
    /// # let _ = builder;
    /// ```
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout;
        self
    }

    /// How long the client waits for one node's reply before it gives up on that attempt
    /// (default 1 s); it may then retry elsewhere within the operation timeout.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::ledger::RedisStore;
    /// let builder = RedisStore::cluster_builder(["redis://127.0.0.1:7000/"])
    ///     .response_timeout(Duration::from_millis(500));
    /// # let _ = builder;
    /// ```
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// Connect to the cluster, learn its slot map and load the ledger scripts on every
    /// primary.
    ///
    /// Fails with an [unavailable](StoreError::is_unavailable) error when a URL is invalid,
    /// or no node can be reached (and the scripts loaded) within the connection timeout plus
    /// the operation timeout. Once connected, the store follows the cluster by itself.
    ///
    /// ```no_run
    /// # use tower_idempotency::ledger::RedisStore;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// match RedisStore::cluster_builder(["redis://127.0.0.1:7000/"]).connect().await {
    ///     Ok(store) => drop(store), // hand it to the layers
    ///     Err(err) => eprintln!("no ledger, refusing to start: {err}"),
    /// }
    /// # }
    /// ```
    pub async fn connect(self) -> Result<RedisStore, StoreError> {
        let addr = self.addresses()?;
        if has_hash_tag(&self.prefix) {
            tracing::warn!(
                prefix = %self.prefix,
                "the ledger's key prefix holds a hash tag ({{…}}): every record hashes to one \
                 slot, so one primary holds the whole ledger"
            );
        }
        let client = self.client()?;
        let bound = self
            .connection_timeout
            .saturating_add(self.operation_timeout);
        let connect_and_load = async {
            let mut connection = Connection::Cluster(client.get_async_connection().await?);
            // `SCRIPT LOAD` goes to every primary: keyless commands of this kind are routed
            // to all of them. A primary that joins later (or a promoted replica that lost a
            // script) is covered by the `NOSCRIPT` fallback of each invocation.
            for code in ALL_SCRIPTS {
                ::redis::cmd("SCRIPT")
                    .arg("LOAD")
                    .arg(code)
                    .query_async::<::redis::Value>(&mut connection)
                    .await?;
            }
            Ok::<_, ::redis::RedisError>(connection)
        };
        let connection = match tokio::time::timeout(bound, connect_and_load).await {
            Ok(Ok(connection)) => connection,
            Ok(Err(err)) => return Err(from_redis(err)),
            Err(_elapsed) => {
                return Err(StoreError::unavailable(format!(
                    "could not reach the Redis Cluster at {addr} within {bound:?}"
                )))
            }
        };

        // Asks one node: the setting must be the same on every node of a ledger's cluster.
        warn_if_ledger_keys_can_be_evicted(&connection, &addr, bound).await;
        // Persistence is per node, and a replica promoted by a failover brings its own:
        // every node is asked, and each one that would forget the ledger is named.
        warn_if_nodes_do_not_keep_records(&connection, bound).await;

        // Records an earlier release wrote before the buckets must still be found.
        let legacy = may_hold_earlier_records(&connection, &self.prefix, bound).await;

        Ok(RedisStore {
            connection,
            layout: Layout::Buckets {
                prefix: self.prefix.into(),
                legacy,
            },
            operation_timeout: self.operation_timeout,
            addr: addr.into(),
        })
    }

    /// The seed nodes as `host:port, …`, without the credentials a URL may carry; an
    /// unparsable URL is refused here, before anything connects.
    fn addresses(&self) -> Result<String, StoreError> {
        if self.nodes.is_empty() {
            return Err(StoreError::unavailable(
                "a Redis Cluster store needs at least one node URL",
            ));
        }
        let mut out = Vec::with_capacity(self.nodes.len());
        for node in &self.nodes {
            let info = node.as_str().into_connection_info().map_err(from_redis)?;
            out.push(info.addr().to_string());
        }
        Ok(out.join(","))
    }

    fn client(&self) -> Result<ClusterClient, StoreError> {
        ClusterClientBuilder::new(self.nodes.iter().map(String::as_str))
            .connection_timeout(self.connection_timeout)
            .response_timeout(self.response_timeout)
            // Redirects and retries stop when the operation's own bound does. A script the
            // client resends after a broken connection may already have run, and that is
            // safe: `begin` recognises its own token's claim, and a settle that applied is
            // refused as `fenced` the second time, changing nothing (though the caller, not
            // knowing of the first send, then reads a write that applied as refused).
            .overall_response_timeout(Some(self.operation_timeout))
            .min_retry_wait(RETRY_MIN_WAIT_MS)
            .max_retry_wait(RETRY_MAX_WAIT_MS)
            .build()
            .map_err(from_redis)
    }
}

/// Redis hashes only the part between the first `{` and the next `}` when that part is not
/// empty: such a prefix would decide every record's slot.
/// Read the persistence settings of every node of the cluster (primaries and replicas) and
/// [warn](warn_unless_records_survive_a_restart) for each that would lose the ledger on a
/// restart. Nodes that refuse `CONFIG GET` are not asked twice.
async fn warn_if_nodes_do_not_keep_records(connection: &Connection, bound: Duration) {
    let Connection::Cluster(cluster) = connection else {
        return;
    };
    let mut cluster = cluster.clone();
    let ask_every_node = async {
        // Node address → its `CONFIG GET` reply for each setting, in order.
        let mut nodes: Vec<(String, Vec<Vec<String>>)> = Vec::new();
        for setting in PERSISTENCE_SETTINGS {
            let mut ask = ::redis::cmd("CONFIG");
            ask.arg("GET").arg(setting);
            let routing = RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllNodes, None));
            // Without a response policy the cluster client answers a map: address → reply.
            let Value::Map(replies) = cluster.route_command(ask, routing).await? else {
                continue;
            };
            for (node, reply) in replies {
                let node: String = ::redis::from_redis_value(node)?;
                let reply: Vec<String> = ::redis::from_redis_value(reply).unwrap_or_default();
                match nodes.iter_mut().find(|(known, _)| *known == node) {
                    Some((_, seen)) => seen.push(reply),
                    None => nodes.push((node, vec![reply])),
                }
            }
        }
        Ok::<_, ::redis::RedisError>(nodes)
    };
    match tokio::time::timeout(bound, ask_every_node).await {
        Ok(Ok(mut nodes)) => {
            nodes.sort();
            for (node, replies) in nodes {
                match Persistence::from_replies(&replies) {
                    Some(persistence) => warn_unless_records_survive_a_restart(&node, &persistence),
                    None => tracing::debug!(%node, "could not read the persistence settings"),
                }
            }
        }
        _ => tracing::debug!(
            "could not read the cluster nodes' persistence settings; make sure appendonly is yes"
        ),
    }
}

fn has_hash_tag(prefix: &str) -> bool {
    match prefix.find('{') {
        Some(open) => prefix[open + 1..].find('}').is_some_and(|close| close > 0),
        None => false,
    }
}

impl fmt::Debug for RedisClusterBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // URLs may carry a password: show only how many there are.
        f.debug_struct("RedisClusterBuilder")
            .field("nodes", &self.nodes.len())
            .field("prefix", &self.prefix)
            .field("operation_timeout", &self.operation_timeout)
            .field("connection_timeout", &self.connection_timeout)
            .field("response_timeout", &self.response_timeout)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_non_empty_braced_part_is_a_hash_tag() {
        assert!(has_hash_tag("{orders}:idem:"));
        assert!(has_hash_tag("idem:{x}"));
        assert!(!has_hash_tag("idem:"));
        assert!(!has_hash_tag("idem:{}:"));
        assert!(!has_hash_tag("idem:{"));
        assert!(!has_hash_tag("idem:}{"));
    }

    #[test]
    fn bad_urls_and_no_nodes_are_refused_before_connecting() {
        let none: [&str; 0] = [];
        let err = RedisStore::cluster_builder(none).addresses().unwrap_err();
        assert!(err.is_unavailable());
        let err = RedisStore::cluster_builder(["not a url"])
            .addresses()
            .unwrap_err();
        assert!(err.is_unavailable());
    }

    #[test]
    fn debug_output_never_shows_credentials() {
        let builder = RedisStore::cluster_builder(["redis://user:hunter2@127.0.0.1:7000/"]);
        assert!(!format!("{builder:?}").contains("hunter2"));
        assert_eq!(
            builder.addresses().unwrap(),
            "127.0.0.1:7000",
            "the address, without credentials"
        );
    }
}
