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

/// How many times a lost script is loaded for one call before its `NOSCRIPT` is taken as
/// the result: a node that loses it again at once is not one a reload will help.
const MAX_SCRIPT_LOADS: usize = 2;

/// The first pause before a call redirected again is resent, doubled each time up to
/// [`REDIRECT_PAUSE_MAX`]. The first redirect is followed at once; a call redirected again
/// and again is in the middle of a migration step (the slot flips between `MIGRATING`,
/// `IMPORTING` and its new owner in a few commands), which a short wait lets finish.
const REDIRECT_PAUSE_FIRST: std::time::Duration = std::time::Duration::from_millis(1);
const REDIRECT_PAUSE_MAX: std::time::Duration = std::time::Duration::from_millis(50);

#[derive(Clone)]
pub(super) enum Connection {
    /// One Redis, reconnected by the manager.
    Single(ConnectionManager),
    /// Redis Cluster: each command goes to the primary owning its key's slot; the client
    /// follows `MOVED` redirects, refreshes its slot map and reconnects to nodes.
    #[cfg(feature = "redis-cluster")]
    Cluster(::redis::cluster_async::ClusterConnection),
}

/// One ledger script applied to its keys: `EVALSHA <sha> <n> <keys…> <args…>`.
pub(super) struct ScriptCall {
    script: &'static Script,
    command: Cmd,
}

impl ScriptCall {
    /// The script on one key (the record).
    pub(super) fn new(script: &'static Script, key: String) -> Self {
        Self::with_keys(script, &[key])
    }

    /// The script on `keys`: the record first, then any the script declares after it (the
    /// listing indexes on a single Redis).
    pub(super) fn with_keys(script: &'static Script, keys: &[String]) -> Self {
        let mut command = ::redis::cmd("EVALSHA");
        command.arg(script.get_hash()).arg(keys.len()).arg(keys);
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
    ///
    /// On a cluster, a call that reaches a slot while it migrates is answered `ASK` (the key
    /// has left for the importing node), `MOVED` (the slot has a new owner, or the redirect
    /// met the end of the migration) or `TRYAGAIN`; the client's own retries can run out
    /// before a migration does. A routine resharding must not fail an operation, so the call
    /// follows these answers **for as long as they come**, pausing briefly once redirected
    /// twice: the caller's operation timeout ([`RedisStore::invoke`](super::RedisStore))
    /// is the one bound, as it is for every other wait of a call.
    pub(super) async fn run(&mut self, call: &ScriptCall) -> RedisResult<Value> {
        let mut reply = call.command.query_async::<Value>(self).await;
        let mut loads = 0;
        let mut pause = RedirectPause::default();
        loop {
            let err = match reply {
                Err(err) => err,
                ok => return ok,
            };
            // Every answer below means the script did not run (the node did not know it, or
            // did not hold the key), so sending the call again cannot apply a transition
            // twice. Any other error may follow a run, and is the caller's to judge.
            reply = match err.kind() {
                ErrorKind::Server(ServerErrorKind::NoScript) if loads < MAX_SCRIPT_LOADS => {
                    loads += 1;
                    call.script.load_async(self).await?;
                    call.command.query_async::<Value>(self).await
                }
                ErrorKind::Server(ServerErrorKind::Ask) => {
                    pause.before_resend().await;
                    self.send_redirected(&err, &call.command, Redirect::Ask)
                        .await
                }
                ErrorKind::Server(ServerErrorKind::Moved) => {
                    pause.before_resend().await;
                    self.send_redirected(&err, &call.command, Redirect::Moved)
                        .await
                }
                ErrorKind::Server(ServerErrorKind::TryAgain) => {
                    pause.before_resend().await;
                    call.command.query_async::<Value>(self).await
                }
                _ => return Err(err),
            };
        }
    }

    /// Send `command` to the node a redirect named: right behind `ASKING` for an `ASK`,
    /// on its own for a `MOVED`.
    ///
    /// `ASKING` lets only the *next* command on its connection reach a slot the node is
    /// still importing. redis-rs sends it and the redirected command as two requests over
    /// a multiplexed connection, so under concurrency another caller's command can slip in
    /// between, take the flag, and send the call back to the old owner (`MOVED`) until the
    /// client's retries run out. As one pipeline the two are written together, in order.
    ///
    /// A `MOVED` is sent straight to the node it names, not through the client's slot map:
    /// the map may not have caught up with the migration yet, and would send the call back
    /// to the node that just turned it away.
    #[cfg(feature = "redis-cluster")]
    async fn send_redirected(
        &mut self,
        redirected: &::redis::RedisError,
        command: &Cmd,
        redirect: Redirect,
    ) -> RedisResult<Value> {
        use ::redis::cluster_routing::SingleNodeRoutingInfo;

        let Self::Cluster(cluster) = self else {
            return Err(redirected.clone());
        };
        let Some((host, port)) = redirected
            .redirect_node()
            .and_then(|(addr, _slot)| addr.rsplit_once(':'))
            .and_then(|(host, port)| Some((host.to_owned(), port.parse().ok()?)))
        else {
            return Err(redirected.clone());
        };
        let mut pipeline = ::redis::pipe();
        if redirect == Redirect::Ask {
            pipeline.cmd("ASKING");
        }
        pipeline.add_command(command.clone());
        // Skip `ASKING`'s `OK`, if sent; keep the call's reply.
        let offset = usize::from(redirect == Redirect::Ask);
        let replies = cluster
            .route_pipeline(
                pipeline,
                offset,
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
    async fn send_redirected(
        &mut self,
        redirected: &::redis::RedisError,
        _command: &Cmd,
        _redirect: Redirect,
    ) -> RedisResult<Value> {
        // A single Redis never redirects.
        Err(redirected.clone())
    }
}

/// Which redirect a cluster node answered.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Redirect {
    /// `ASK`: this one call goes to the importing node, behind `ASKING`.
    Ask,
    /// `MOVED`: the slot is the named node's now.
    Moved,
}

/// The pauses between resends of one redirected call: none before the first, then from
/// [`REDIRECT_PAUSE_FIRST`] doubling to [`REDIRECT_PAUSE_MAX`].
#[derive(Default)]
struct RedirectPause {
    next: Option<std::time::Duration>,
}

impl RedirectPause {
    async fn before_resend(&mut self) {
        match self.next {
            None => self.next = Some(REDIRECT_PAUSE_FIRST),
            Some(pause) => {
                tokio::time::sleep(pause).await;
                self.next = Some((pause * 2).min(REDIRECT_PAUSE_MAX));
            }
        }
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
