//! The one connection type the store's engine talks through: a single Redis or a cluster.
//!
//! The scripts, their replies and the timeouts are the same either way; only how a command
//! reaches the node that owns its key differs. An enum rather than a type parameter keeps
//! `RedisStore` one concrete type, so an application picks one Redis or a cluster at run
//! time (from its configuration) without generics leaking into its own types.

use ::redis::aio::{ConnectionLike, ConnectionManager};
use ::redis::{Cmd, Pipeline, RedisFuture, Value};

#[derive(Clone)]
pub(super) enum Connection {
    /// One Redis, reconnected by the manager.
    Single(ConnectionManager),
    /// Redis Cluster: each command goes to the primary owning its key's slot; the client
    /// follows `MOVED` and `ASK` redirects, refreshes its slot map and reconnects to nodes.
    #[cfg(feature = "redis-cluster")]
    Cluster(::redis::cluster_async::ClusterConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(connection) => connection.req_packed_command(cmd),
            #[cfg(feature = "redis-cluster")]
            Self::Cluster(connection) => connection.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(connection) => connection.req_packed_commands(cmd, offset, count),
            #[cfg(feature = "redis-cluster")]
            Self::Cluster(connection) => connection.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(connection) => connection.get_db(),
            #[cfg(feature = "redis-cluster")]
            Self::Cluster(connection) => connection.get_db(),
        }
    }
}
