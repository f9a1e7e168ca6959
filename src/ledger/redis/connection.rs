//! The one connection type the store's engine talks through (a single Redis or a cluster),
//! and how one script call travels over it.
//!
//! The scripts, their replies and the timeouts are the same either way; only how a command
//! reaches the node that owns its key differs. An enum rather than a type parameter keeps
//! `RedisStore` one concrete type, so an application picks one Redis or a cluster at run
//! time (from its configuration) without generics leaking into its own types.

use ::redis::aio::{ConnectionLike, ConnectionManager};
use ::redis::{Cmd, ErrorKind, Pipeline, RedisFuture, RedisResult, Script, ServerErrorKind};
use ::redis::{ToRedisArgs, Value};

/// How many times one call may be sent again after a recoverable answer (`NOSCRIPT`, or
/// `ASK` on a cluster) before its last answer is taken as the result. A slot migration
/// moves a key at most once per call, and a lost script is loaded once.
const MAX_RESENDS: usize = 4;

#[derive(Clone)]
pub(super) enum Connection {
    /// One Redis, reconnected by the manager.
    Single(ConnectionManager),
    /// Redis Cluster: each command goes to the primary owning its key's slot; the client
    /// follows `MOVED` redirects, refreshes its slot map and reconnects to nodes.
    #[cfg(feature = "redis-cluster")]
    Cluster(::redis::cluster_async::ClusterConnection),
}

/// One ledger script applied to one key: `EVALSHA <sha> 1 <key> <args…>`.
pub(super) struct ScriptCall {
    script: &'static Script,
    command: Cmd,
}

impl ScriptCall {
    pub(super) fn new(script: &'static Script, key: String) -> Self {
        let mut command = ::redis::cmd("EVALSHA");
        command.arg(script.get_hash()).arg(1).arg(key);
        Self { script, command }
    }

    pub(super) fn arg(&mut self, arg: impl ToRedisArgs) -> &mut Self {
        self.command.arg(arg);
        self
    }
}

impl Connection {
    /// Run `call`: one `EVALSHA` when all is well. When the node has lost the script
    /// (a restart, `SCRIPT FLUSH`, a promoted replica) it is loaded and the call sent again.
    /// On a cluster, a key whose slot is migrating is answered with `ASK`; see
    /// [`Self::send_asking`] for why the store follows that redirect itself.
    pub(super) async fn run(&mut self, call: &ScriptCall) -> RedisResult<Value> {
        let mut reply = call.command.query_async::<Value>(self).await;
        for _ in 0..MAX_RESENDS {
            let err = match reply {
                Err(err) => err,
                ok => return ok,
            };
            // Both answers below mean the script did not run (the node did not know it, or
            // did not hold the key), so sending the call again cannot apply a transition
            // twice. Any other error may follow a run, and is the caller's to judge.
            reply = if err.kind() == ErrorKind::Server(ServerErrorKind::NoScript) {
                call.script.load_async(self).await?;
                call.command.query_async::<Value>(self).await
            } else if err.kind() == ErrorKind::Server(ServerErrorKind::Ask) {
                self.send_asking(&err, &call.command).await
            } else {
                return Err(err);
            };
        }
        reply
    }

    /// Send `command` to the node an `ASK` redirect named, right behind `ASKING`.
    ///
    /// `ASKING` lets only the *next* command on its connection reach a slot the node is
    /// still importing. redis-rs sends it and the redirected command as two requests over
    /// a multiplexed connection, so under concurrency another caller's command can slip in
    /// between, take the flag, and send the call back to the old owner (`MOVED`) until the
    /// client's retries run out. As one pipeline the two are written together, in order.
    #[cfg(feature = "redis-cluster")]
    async fn send_asking(
        &mut self,
        ask: &::redis::RedisError,
        command: &Cmd,
    ) -> RedisResult<Value> {
        use ::redis::cluster_routing::SingleNodeRoutingInfo;

        let Self::Cluster(cluster) = self else {
            return Err(ask.clone());
        };
        let Some((host, port)) = ask
            .redirect_node()
            .and_then(|(addr, _slot)| addr.rsplit_once(':'))
            .and_then(|(host, port)| Some((host.to_owned(), port.parse().ok()?)))
        else {
            return Err(ask.clone());
        };
        let mut pipeline = ::redis::pipe();
        pipeline.cmd("ASKING").add_command(command.clone());
        // Skip `ASKING`'s `OK`, keep the call's reply.
        let replies = cluster
            .route_pipeline(
                pipeline,
                1,
                1,
                SingleNodeRoutingInfo::ByAddress { host, port },
            )
            .await?;
        replies
            .into_iter()
            .next()
            .unwrap_or(Value::Nil)
            .extract_error()
    }

    #[cfg(not(feature = "redis-cluster"))]
    async fn send_asking(
        &mut self,
        ask: &::redis::RedisError,
        _command: &Cmd,
    ) -> RedisResult<Value> {
        // A single Redis never redirects.
        Err(ask.clone())
    }
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
