//! The Redis ledger: one record per operation, shared by every process that talks to the
//! same Redis.
//!
//! [`RedisStore`] implements the [ledger protocol](crate::ledger) with single-key Lua scripts,
//! so many replicas of a service share one ledger, and an orchestrator that crashes and
//! comes back finds its operations where it left them. Use [`MemoryStore`](super::MemoryStore)
//! when one process is all there is. With feature `redis-cluster` the same store runs over a
//! Redis Cluster ([`RedisStore::cluster_builder`]); see [Redis Cluster](#redis-cluster).
//!
//! # Example
//!
//! ```no_run
//! use std::time::Duration;
//! use tower_idempotency::ledger::{Begin, BeginRequest, IdempotencyStore, LedgerKey, RedisStore};
//! use tower_idempotency::Fingerprint;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
//! let store = RedisStore::builder("redis://127.0.0.1:6379/")
//!     .prefix("payments:idem:")
//!     .operation_timeout(Duration::from_millis(500))
//!     .connect()
//!     .await?;
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
//! - **One key per record**, `<prefix><64 hex digits of the LedgerKey>` (prefix `idem:` by
//!   default), and every script touches only that key. A script is atomic on its key, so
//!   `begin` is one step with no check-then-set, and the scripts stay valid under any
//!   key-slot sharding.
//! - **One round trip per ledger operation.** The seven scripts are loaded when the store
//!   connects and invoked by SHA (`EVALSHA`); if Redis has forgotten them (a restart,
//!   `SCRIPT FLUSH`, a failover) the call loads the script and retries once. A fresh
//!   operation costs two commands (`begin`, `complete`), a replay one.
//! - **Owner tokens** are 128 random bits made by the client, passed to `begin`, and
//!   compared by `complete`, `abandon` and `mark_in_doubt` inside their scripts: a stale
//!   owner's write is refused ([fenced](super::StoreError::is_fenced)), never applied.
//! - **Redis's clock judges leases.** `begin` reads `TIME` inside the script, so skew
//!   between application hosts cannot make a live lease look expired.
//! - **Two TTLs.** The key's `PX` TTL is the record's retention; the lease is a field inside
//!   the record. When a lease runs out the record is still there and reads as *in doubt*,
//!   never as absent.
//! - **Fail closed.** Every operation is bounded by the
//!   [operation timeout](RedisStoreBuilder::operation_timeout) (1 s by default). When Redis
//!   is unreachable or slow, each call returns an
//!   [unavailable](super::StoreError::is_unavailable) or [timeout](super::StoreError::is_timeout)
//!   error, never a claim. The connection is a [`redis::aio::ConnectionManager`], which
//!   reconnects by itself: when Redis comes back, the same store works again.
//!
//! A timed-out (or dropped) call may still have run on Redis. The layers ask again: a
//! `begin` sent again with its caller's token recognises the claim it made and answers it
//! again, and a `complete` whose answer was lost is retried inside the lease (a `fenced`
//! answer after a lost one means the first applied). A claim whose `begin` never got an
//! answer is released in the background once Redis is back, so the key is usable again
//! rather than stuck in flight and then in doubt.
//!
//! # Record layout
//!
//! Each record is a Redis hash:
//!
//! | field | value |
//! |---|---|
//! | `v` | record format version, `1` today |
//! | `fp` | the request [`Fingerprint`], 64 hex digits |
//! | `state` | `in_flight`, `in_doubt` or `completed` |
//! | `token` | the owner's token, 32 hex digits (only while `in_flight`) |
//! | `lease_until_ms` | end of the owner's lease, Redis time in ms since the epoch (only while `in_flight`) |
//! | `sent` | `1` once an attempt may have been sent (after a resume or an in-doubt mark), else `0`; `abandon` only releases a `0` record, and a `begin` recognising its own claim answers `resume` for a `1` one |
//! | `retention_ms` | the retention last asked for, reapplied when `abandon` keeps a record |
//! | `created_ms` | when the operation was first claimed, Redis time |
//! | `attempts` | how many times ownership was handed out (the first claim and each resume) |
//! | `frozen` | the frozen request, [`FrozenRequest::encode`](crate::FrozenRequest::encode) (absent on the server side) |
//! | `outcome` | the recorded outcome, [`Outcome::encode`](super::Outcome::encode) (only when `completed`) |
//!
//! A key without a record may hold a *released marker* instead (see "A release outlasts a
//! late claim" in the [ledger docs](crate::ledger)): a hash with `v`, `state` = `released`
//! and a field `released:<token>` (32 hex digits) per token the key was released under, its
//! `PX` TTL one minute from the last release. It lives in the record's own key, so each
//! script still touches one key, in one slot; `begin` under a released token answers
//! `released` (a [fenced](super::StoreError::is_fenced) error), any other `begin` replaces
//! the marker with its claim, and `inspect` and `forget` see no record.
//!
//! The key's TTL (`PTTL`) is the retention: set by the first claim, by a completion and by
//! an in-doubt mark (never shortened); a resume, an abandon, a renewal and a probe leave it
//! as it is, so retrying an in-doubt key never keeps it alive. A later release
//! reads version-1 records; this release refuses a record with an unknown version (or one that
//! is not a hash written by it) as [corrupt](super::StoreError::is_corrupt) rather than
//! misread it.
//!
//! An operator's [`forget`](super::IdempotencyStore::forget) deletes the key, in a script
//! that first checks `state`, `fp`, `attempts` and, while in flight, `lease_until_ms`
//! against what the operator saw (see [`forget`](super::forget)).
//!
//! # Durability
//!
//! The ledger is only as durable as the Redis behind it, and a lost record can mean an
//! operation runs twice: the next `begin` finds nothing and answers `Acquired`.
//!
//! - **Replication is asynchronous.** Redis acknowledges a write before its replicas have
//!   it. If the primary fails right after, the promoted replica may not have the record.
//!   Nothing on the client side can detect this.
//! - **Persistence is per node.** With snapshots only (RDB), a restart loses everything since
//!   the last snapshot. `appendonly yes` with `appendfsync always` fsyncs the log before
//!   Redis replies, so a restarted node keeps every record it acknowledged, at the price of
//!   an fsync per event-loop turn. `appendfsync everysec` bounds the loss to about the last
//!   second or two of acknowledged records (a crash of the Redis process alone usually loses
//!   nothing, the writes having reached the OS; a power or kernel failure loses that window).
//!   Neither helps when a failover promotes a replica that lagged. Without either (`save ""`
//!   and `appendonly no`) a restart forgets every record, and each operation retried after
//!   it runs again: the store reads `appendonly`, `appendfsync` and `save` when it connects
//!   (on a cluster, from every node) and logs a warning naming each node that keeps nothing.
//! - **`WAIT numreplicas timeout`** makes a client wait until its earlier writes reached that
//!   many replicas (in memory, not necessarily on disk). It narrows the failover window but
//!   does not close it: on timeout the write stays applied without the replicas, and the
//!   failover may promote a replica that did not acknowledge (`WAITAOF`, Redis 7.2, does the
//!   same for fsyncs, with the same limits). `RedisStore` does not issue either: they block
//!   the connection they are sent on, and this store multiplexes every operation over one
//!   connection, so one `WAIT` would stall them all; it would also add a round trip.
//! - **Eviction forgets.** Set `maxmemory-policy noeviction` on the ledger's Redis. Every
//!   record has a TTL, so the `volatile-*` policies, like the `allkeys-*` ones, may drop live
//!   records under memory pressure; the store reads the policy when it connects and logs a
//!   warning when it is not `noeviction`. With `noeviction` a full Redis refuses new claims
//!   (`OOM`, reported as a [full](super::StoreError::is_full) store: the layers fail closed)
//!   instead of forgetting old ones.
//!
//! - **`min-replicas-to-write 1`** (a server setting, with `min-replicas-max-lag`) makes a
//!   primary refuse writes while no replica has acknowledged it within the lag. The store
//!   then fails closed: a refused `begin` is an [unavailable](super::StoreError::is_unavailable)
//!   error, no claim is handed out and no side effect fires. It closes the window of a
//!   replica that is cut off or far behind, not the last `min-replicas-max-lag` seconds.
//!
//! For operations where a duplicate is expensive, run the ledger's Redis with
//! `appendonly yes` and `appendfsync always`, on a primary you fail over manually (or not at
//! all), and keep the downstream service's own idempotency key as the last line of defence:
//! this crate sends the same `Idempotency-Key` on every resume.
//!
//! # Redis Cluster
//!
//! [`RedisStore::cluster_builder`] (feature `redis-cluster`) connects the same store to a
//! Redis Cluster through redis-rs's cluster client. Nothing about the records changes: each
//! is one key, each script touches only that key and declares it in `KEYS`, so the cluster
//! runs every transition atomically on the primary that owns the key's slot.
//!
//! - **Sharding.** Records spread over every primary by key slot; throughput and memory grow
//!   with the number of primaries. Keep hash tags (`{…}`) out of the prefix: a tagged prefix
//!   puts the whole ledger in one slot (the store warns when it sees one).
//! - **Round trips.** The client keeps the slot map and sends each script straight to the
//!   key's primary: still two commands per fresh operation and one per replay.
//! - **Resharding.** A key whose slot moved answers `MOVED`; the client follows it and
//!   refreshes its map. A key whose slot is *migrating* and is not on the old owner any more
//!   answers `ASK`; the store then sends `ASKING` and the script to the new owner as one
//!   pipeline (redis-rs sends the two as separate requests over a multiplexed connection,
//!   where another caller's command can take the one-shot `ASKING` in between). Tested with
//!   a slot migrated key by key under load: nothing lost, no error.
//! - **Node loss and failover.** The client reconnects to nodes and relearns the slot map
//!   after a failover; operations meanwhile fail closed within the operation timeout. Reads
//!   go to primaries only: a replica may not have the latest claim.
//! - **Clocks.** Each primary judges the leases of its records by its own `TIME`. After a
//!   failover the promoted replica's clock takes over: keep the nodes' clocks in sync (NTP),
//!   as skew between them shortens or lengthens the leases that were running.
//! - **Durability** is that of asynchronous replication, as above. A coordinated failover
//!   (`CLUSTER FAILOVER` asked of the replica: the primary stops writing until the replica
//!   has caught up) loses nothing. A primary that dies before its replica received its last
//!   writes takes them along: the promoted replica does not have those records, and their
//!   operations read as never seen, so a retry runs them again. `min-replicas-to-write`
//!   on every primary turns the cut-off-replica case into refused claims instead.
//!   The store issues no `WAIT`, for the reasons above; on a cluster it would also have to
//!   follow each write to the same node over the same connection, which the cluster client
//!   does not promise (`WAIT` vouches only for its own connection's writes).
//!
//! **Sizing a cluster.** The ledger's memory is spread over the primaries: size each
//! primary's `maxmemory` (under `noeviction`) for your operation rate times the retention
//! times the record size, divided by the number of primaries, with room for one primary's
//! share more while a slot migrates or a replica resyncs. Give every primary a replica in
//! another failure domain, set `cluster-node-timeout` to what you accept as an outage before
//! an automatic failover (the store fails closed that long), and keep the operation timeout
//! above a redirect plus a reconnect (tens of milliseconds on a LAN). Measured: a primary
//! killed while its replica was cut off lost every record it had acknowledged since (20 of
//! 20 in `tests/redis_cluster.rs`); with `min-replicas-to-write 1` the same fault refuses
//! claims instead.
//!
//! # Sizing the lease and the retention
//!
//! - **Lease**: longer than the longest time one owner may hold an operation, that is its
//!   longest attempt *including every retry inside it* (the retry layer's maximum elapsed
//!   time plus a per-attempt timeout). A lease that runs out under a live owner lets another
//!   caller resume and resend the same bytes concurrently. A lease that is too long only
//!   delays the resume after an owner crashed: other callers see the operation busy.
//! - **Retention** (24 h by default in the layers): longer than the longest retry window
//!   *plus* the longest gap in which a crashed orchestrator may come back and re-run the
//!   same operation. A record that expires first is forgotten, and the re-run executes again.
//!   Redis memory grows with retention: each record holds its frozen request and response
//!   (each capped at 1 MiB by default), so size `maxmemory` for your rate times retention.
//!
//! # Limits
//!
//! - Redis 5 or later (multi-field `HSET`, script effects replication); tested with Redis 7.
//! - One Redis (or a proxy in front of one) with [`RedisStore::builder`]; a Redis Cluster with
//!   [`RedisStore::cluster_builder`] (feature `redis-cluster`). Not Sentinel.
//! - Store operations run on the real clock. Under a paused tokio clock
//!   (`start_paused = true`) the operation timeout fires as soon as the runtime idles waiting
//!   for Redis, so test code using `RedisStore` must use real time.

use std::fmt;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use ::redis::aio::{ConnectionManager, ConnectionManagerConfig};
use ::redis::{Client, RedisError, Script, Value};

use self::connection::{Connection, ScriptCall};

#[cfg(feature = "redis-cluster")]
mod cluster;
mod connection;

#[cfg(feature = "redis-cluster")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis-cluster")))]
pub use self::cluster::RedisClusterBuilder;

use super::{
    Begin, BeginRequest, IdempotencyStore, LeaseToken, LedgerKey, Outcome, StoreError, StoreFuture,
};
use crate::fingerprint::Fingerprint;
use crate::frozen::FrozenRequest;

/// The key prefix unless [`RedisStoreBuilder::prefix`] says otherwise.
const DEFAULT_PREFIX: &str = "idem:";
const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(1);
const DEFAULT_CONNECTION_TIMEOUT: Duration = Duration::from_secs(1);
const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(1);
/// The manager's reconnect backoff is exponential; capping it bounds how long after Redis
/// comes back the store notices. The default (uncapped, six retries) can sleep for seconds.
const DEFAULT_RECONNECT_MAX_DELAY: Duration = Duration::from_secs(1);
/// Lua numbers are doubles and `PEXPIRE` rejects times that overflow when added to the
/// clock: clamp leases and retentions to about 139 years, far beyond any real use.
const MAX_TTL_MS: u128 = 1 << 42;

// The scripts' sources. The prelude is prepended at compile time because Redis scripts
// cannot include files.
const BEGIN_LUA: &str = concat!(include_str!("prelude.lua"), include_str!("begin.lua"));
const COMPLETE_LUA: &str = concat!(include_str!("prelude.lua"), include_str!("complete.lua"));
const ABANDON_LUA: &str = concat!(include_str!("prelude.lua"), include_str!("abandon.lua"));
const MARK_IN_DOUBT_LUA: &str = concat!(
    include_str!("prelude.lua"),
    include_str!("mark_in_doubt.lua")
);
const RENEW_LUA: &str = concat!(include_str!("prelude.lua"), include_str!("renew.lua"));
const INSPECT_LUA: &str = concat!(include_str!("prelude.lua"), include_str!("inspect.lua"));
const FORGET_LUA: &str = concat!(include_str!("prelude.lua"), include_str!("forget.lua"));

/// Every script, for loading them all when the store connects.
const ALL_SCRIPTS: [&str; 7] = [
    BEGIN_LUA,
    COMPLETE_LUA,
    ABANDON_LUA,
    MARK_IN_DOUBT_LUA,
    RENEW_LUA,
    INSPECT_LUA,
    FORGET_LUA,
];

// Each script is hashed once per process; `Script` invokes by SHA and loads on NOSCRIPT.
static BEGIN: LazyLock<Script> = LazyLock::new(|| Script::new(BEGIN_LUA));
static COMPLETE: LazyLock<Script> = LazyLock::new(|| Script::new(COMPLETE_LUA));
static ABANDON: LazyLock<Script> = LazyLock::new(|| Script::new(ABANDON_LUA));
static MARK_IN_DOUBT: LazyLock<Script> = LazyLock::new(|| Script::new(MARK_IN_DOUBT_LUA));
static RENEW: LazyLock<Script> = LazyLock::new(|| Script::new(RENEW_LUA));
static INSPECT: LazyLock<Script> = LazyLock::new(|| Script::new(INSPECT_LUA));
static FORGET: LazyLock<Script> = LazyLock::new(|| Script::new(FORGET_LUA));

/// The distributed ledger on Redis. See the [module docs](self) for how it works, the record
/// layout and what durability to expect.
///
/// Cloning is cheap: clones share one multiplexed connection.
///
/// # Example
///
/// ```no_run
/// use std::sync::Arc;
/// use tower_idempotency::ledger::{IdempotencyStore, RedisStore};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
/// let store = RedisStore::connect("redis://127.0.0.1:6379/").await?;
/// // The layers take any store behind an `Arc`.
/// let shared: Arc<dyn IdempotencyStore> = Arc::new(store);
/// # let _ = shared;
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisStore {
    // One Redis (a `ConnectionManager`) or a cluster (redis-rs's cluster connection); both
    // are an `Arc` inside, and each operation clones it (no lock, no pool).
    connection: Connection,
    prefix: Arc<str>,
    operation_timeout: Duration,
    /// `host:port` for `Debug`, without the credentials a URL may carry.
    addr: Arc<str>,
}

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
enum Target {
    // Parsed at `connect`, so the builder stays infallible and chainable.
    Url(String),
    Client(Client),
}

impl RedisStore {
    /// Configure a store for the Redis at `url` (`redis://[user:password@]host[:port][/db]`,
    /// or `rediss://` when the `redis` crate is built with TLS).
    ///
    /// ```no_run
    /// # use tower_idempotency::ledger::RedisStore;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
    /// let store = RedisStore::builder("redis://127.0.0.1:6379/").connect().await?;
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder(url: impl Into<String>) -> RedisStoreBuilder {
        RedisStoreBuilder::new(Target::Url(url.into()))
    }

    /// Configure a store on an existing [`redis::Client`] (for connection settings a URL
    /// cannot express, e.g. built from a [`redis::ConnectionInfo`]).
    ///
    /// ```no_run
    /// # use tower_idempotency::ledger::RedisStore;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = redis::Client::open("redis://127.0.0.1:6379/")?;
    /// let store = RedisStore::builder_with_client(client).connect().await?;
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub fn builder_with_client(client: Client) -> RedisStoreBuilder {
        RedisStoreBuilder::new(Target::Client(client))
    }

    /// Connect to the Redis at `url` with the default settings (prefix `idem:`, 1 s
    /// operation timeout); short for `RedisStore::builder(url).connect()`.
    ///
    /// ```no_run
    /// # use tower_idempotency::ledger::RedisStore;
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
    /// let store = RedisStore::connect("redis://127.0.0.1:6379/").await?;
    /// # let _ = store;
    /// # Ok(())
    /// # }
    /// ```
    pub async fn connect(url: impl Into<String>) -> Result<Self, StoreError> {
        Self::builder(url).connect().await
    }

    /// The Redis key holding the record of `key`: the prefix and 64 hex digits. For operators
    /// and tests; the store computes it itself.
    ///
    /// ```no_run
    /// # use tower_idempotency::ledger::{LedgerKey, RedisStore};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
    /// let store = RedisStore::connect("redis://127.0.0.1:6379/").await?;
    /// let key = LedgerKey::from_bytes([0xab; 32]);
    /// assert_eq!(store.redis_key(&key), format!("idem:{}", "ab".repeat(32)));
    /// # Ok(())
    /// # }
    /// ```
    pub fn redis_key(&self, key: &LedgerKey) -> String {
        let mut out = String::with_capacity(self.prefix.len() + 64);
        out.push_str(&self.prefix);
        out.push_str(&key.to_hex());
        out
    }

    /// Run one script invocation: one `EVALSHA` (plus `SCRIPT LOAD` and a retry when Redis
    /// lost the script), bounded by the operation timeout.
    async fn invoke(&self, call: &ScriptCall) -> Result<Vec<Value>, StoreError> {
        // A clone per call is how both connections are meant to be shared: they are an `Arc`.
        let mut connection = self.connection.clone();
        let reply = tokio::time::timeout(self.operation_timeout, connection.run(call))
            .await
            .map_err(|_elapsed| StoreError::timeout())?
            .map_err(from_redis)?;
        match reply {
            Value::Array(items) if !items.is_empty() => Ok(items),
            other => Err(StoreError::corrupt(format!(
                "unexpected reply from a ledger script: {other:?}"
            ))),
        }
    }

    /// Run a transition that answers only `ok`, `fenced` or `corrupt`.
    async fn settle(&self, call: &ScriptCall) -> Result<(), StoreError> {
        let reply = self.invoke(call).await?;
        match tag(&reply)? {
            b"ok" => Ok(()),
            b"fenced" => Err(StoreError::fenced()),
            _ => Err(unexpected(&reply)),
        }
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("addr", &self.addr)
            .field("prefix", &self.prefix)
            .field("operation_timeout", &self.operation_timeout)
            .finish_non_exhaustive()
    }
}

impl RedisStoreBuilder {
    fn new(target: Target) -> Self {
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
            prefix: self.prefix.into(),
            operation_timeout: self.operation_timeout,
            addr: addr.into(),
        })
    }
}

/// Say so, loudly, when the server's `maxmemory-policy` may evict ledger keys: an evicted
/// record is a forgotten operation, and a forgotten operation runs again. Every record has
/// a TTL, so the `volatile-*` policies evict them as readily as the `allkeys-*` ones. A
/// server that refuses `CONFIG GET` (managed offerings often do) is not asked twice.
async fn warn_if_ledger_keys_can_be_evicted(connection: &Connection, addr: &str, bound: Duration) {
    let mut connection = connection.clone();
    let mut ask = ::redis::cmd("CONFIG");
    ask.arg("GET").arg("maxmemory-policy");
    let reply = tokio::time::timeout(bound, ask.query_async::<Vec<String>>(&mut connection)).await;
    match reply {
        Ok(Ok(pair)) => match pair.get(1).map(String::as_str) {
            Some("noeviction") | None => {}
            Some(policy) => tracing::warn!(
                %addr,
                policy,
                "the ledger's Redis may evict ledger records under memory pressure \
                 (maxmemory-policy {policy}); an evicted record lets its operation run again. \
                 Set maxmemory-policy noeviction: a full Redis then refuses new operations \
                 (fail closed) instead"
            ),
        },
        _ => tracing::debug!(%addr, "could not read maxmemory-policy; make sure it is noeviction"),
    }
}

/// The persistence settings of one Redis node: what of the ledger it keeps when it restarts.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Persistence {
    /// `appendonly`: the append-only file logs every write.
    appendonly: bool,
    /// `appendfsync`: when that log reaches the disk (`always`, `everysec` or `no`).
    appendfsync: String,
    /// `save`: the RDB snapshot schedule; empty when no snapshot is ever taken.
    save: String,
}

/// The three settings [`Persistence`] is read from, one `CONFIG GET` each (Redis before 7
/// takes one name per `CONFIG GET`).
const PERSISTENCE_SETTINGS: [&str; 3] = ["appendonly", "appendfsync", "save"];

impl Persistence {
    /// From the replies of `CONFIG GET` for each of [`PERSISTENCE_SETTINGS`], in order; `None`
    /// when one is missing (a server that hides its configuration).
    fn from_replies(replies: &[Vec<String>]) -> Option<Self> {
        let value = |i: usize| replies.get(i).and_then(|pair| pair.get(1)).cloned();
        Some(Self {
            appendonly: value(0)?.eq_ignore_ascii_case("yes"),
            appendfsync: value(1)?,
            save: value(2)?,
        })
    }

    /// Whether a record the node acknowledged may still be there after it restarts: it logs
    /// writes to an append-only file, or takes RDB snapshots.
    fn keeps_records(&self) -> bool {
        self.appendonly || !self.save.trim().is_empty()
    }
}

/// Say so, as loudly as for eviction, when `node` keeps nothing across a restart (no
/// append-only file, no snapshots): each record it held is gone when it comes back, and an
/// operation retried after that finds no record and runs again, charged twice.
fn warn_unless_records_survive_a_restart(node: &str, persistence: &Persistence) {
    if persistence.keeps_records() {
        return;
    }
    tracing::warn!(
        node,
        appendonly = "no",
        save = "",
        "the ledger's Redis at {node} keeps no record across a restart (appendonly no, \
         save \"\"): after a restart every operation it recorded is forgotten, and a retry of \
         one runs it again (charged twice). Set appendonly yes: with appendfsync always each \
         record is on disk before Redis acknowledges it; with appendfsync everysec a crash of \
         the host may lose the last second of records (and run those operations again); \
         RDB snapshots (save) alone lose everything since the last snapshot"
    );
}

/// Read one Redis's persistence settings and [warn](warn_unless_records_survive_a_restart)
/// when it would lose the ledger on a restart. A server that refuses `CONFIG GET` is not
/// asked twice.
async fn warn_if_records_do_not_survive_a_restart(
    connection: &Connection,
    addr: &str,
    bound: Duration,
) {
    let mut connection = connection.clone();
    let mut ask = ::redis::pipe();
    for setting in PERSISTENCE_SETTINGS {
        ask.cmd("CONFIG").arg("GET").arg(setting);
    }
    let reply =
        tokio::time::timeout(bound, ask.query_async::<Vec<Vec<String>>>(&mut connection)).await;
    match reply {
        Ok(Ok(replies)) => match Persistence::from_replies(&replies) {
            Some(persistence) => warn_unless_records_survive_a_restart(addr, &persistence),
            None => tracing::debug!(%addr, "could not read the persistence settings"),
        },
        _ => tracing::debug!(
            %addr,
            "could not read the persistence settings; make sure appendonly is yes"
        ),
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

impl IdempotencyStore for RedisStore {
    fn begin(&self, request: BeginRequest) -> StoreFuture<'_, Begin> {
        StoreFuture::new(async move {
            // The caller's token, not one made in the script: Redis has no good randomness
            // to offer scripts, and a `begin` sent again after a lost reply must bring the
            // same token to recognise its own claim.
            let token = request.token;
            let mut call = ScriptCall::new(&BEGIN, self.redis_key(&request.key));
            call.arg(request.fingerprint.to_hex())
                .arg(token_hex(token))
                .arg(millis(request.lease, 0))
                .arg(millis(request.retention, 1))
                .arg(if request.take_over { "1" } else { "0" });
            if let Some(frozen) = &request.frozen {
                call.arg(frozen.encode());
            }
            let reply = self.invoke(&call).await?;
            decode_begin(&reply, token)
        })
    }

    fn complete(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        outcome: Outcome,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        StoreFuture::new(async move {
            let mut call = ScriptCall::new(&COMPLETE, self.redis_key(&key));
            call.arg(token_hex(token))
                .arg(outcome.encode())
                .arg(millis(retention, 1));
            self.settle(&call).await
        })
    }

    fn abandon(&self, key: LedgerKey, token: LeaseToken) -> StoreFuture<'_, ()> {
        StoreFuture::new(async move {
            let mut call = ScriptCall::new(&ABANDON, self.redis_key(&key));
            call.arg(token_hex(token))
                .arg(millis(super::RELEASED_TOKEN_TTL, 1));
            self.settle(&call).await
        })
    }

    fn mark_in_doubt(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        StoreFuture::new(async move {
            let mut call = ScriptCall::new(&MARK_IN_DOUBT, self.redis_key(&key));
            call.arg(token_hex(token)).arg(millis(retention, 1));
            self.settle(&call).await
        })
    }

    fn inspect(&self, key: LedgerKey) -> StoreFuture<'_, Option<super::RecordView>> {
        StoreFuture::new(async move {
            let call = ScriptCall::new(&INSPECT, self.redis_key(&key));
            let reply = self.invoke(&call).await?;
            decode_inspect(&reply)
        })
    }

    fn renew(&self, key: LedgerKey, token: LeaseToken, lease: Duration) -> StoreFuture<'_, ()> {
        StoreFuture::new(async move {
            let mut call = ScriptCall::new(&RENEW, self.redis_key(&key));
            call.arg(token_hex(token)).arg(millis(lease, 1));
            self.settle(&call).await
        })
    }

    fn forget(&self, key: LedgerKey, expected: super::Expected) -> StoreFuture<'_, super::Forget> {
        StoreFuture::new(async move {
            let mut call = ScriptCall::new(&FORGET, self.redis_key(&key));
            call.arg(expected.kind.as_str())
                .arg(expected.fingerprint.to_hex())
                .arg(expected.attempts)
                .arg(if expected.force { "1" } else { "0" });
            let answer = match self.invoke(&call).await {
                Ok(reply) => decode_forget(&reply),
                Err(err) => Err(err),
            };
            super::report_forget("redis", &key, &expected, &answer);
            answer
        })
    }
}

/// Turn `forget`'s reply into the protocol's answer.
fn decode_forget(reply: &[Value]) -> Result<super::Forget, StoreError> {
    use super::Forget;
    match tag(reply)? {
        b"forgotten" => Ok(Forget::Forgotten),
        b"absent" => Ok(Forget::Absent),
        b"changed" => Ok(Forget::Changed),
        b"live" => match reply.get(1) {
            Some(Value::Int(ms)) => Ok(Forget::Live {
                lease_left: Duration::from_millis(u64::try_from(*ms).unwrap_or(0)),
            }),
            _ => Err(unexpected(reply)),
        },
        _ => Err(unexpected(reply)),
    }
}

/// Turn `begin`'s reply into the protocol's answer; `token` is the one offered to the script.
fn decode_begin(reply: &[Value], token: LeaseToken) -> Result<Begin, StoreError> {
    match tag(reply)? {
        b"acquired" => Ok(Begin::Acquired { token }),
        b"busy" => match reply.get(1) {
            Some(Value::Int(ms)) => Ok(Begin::Busy {
                retry_after: Duration::from_millis(u64::try_from(*ms).unwrap_or(0)),
            }),
            _ => Err(unexpected(reply)),
        },
        b"resume" => Ok(Begin::Resume {
            token,
            frozen: optional_frozen(reply.get(1))?,
        }),
        b"in_doubt" => Ok(Begin::InDoubt),
        // The caller released this token before its `begin` arrived: refused, no claim.
        b"released" => Err(StoreError::fenced()),
        b"replay" => match reply.get(1) {
            Some(Value::BulkString(bytes)) => Ok(Begin::Replay(Outcome::decode(bytes)?)),
            _ => Err(StoreError::corrupt("completed record without an outcome")),
        },
        b"drift" => {
            let stored = match reply.get(1) {
                Some(Value::BulkString(hex)) => parse_fingerprint(hex)?,
                _ => return Err(unexpected(reply)),
            };
            Ok(Begin::Drift {
                stored,
                frozen: optional_frozen(reply.get(2))?,
            })
        }
        _ => Err(unexpected(reply)),
    }
}

/// Turn `inspect`'s reply into a view.
fn decode_inspect(reply: &[Value]) -> Result<Option<super::RecordView>, StoreError> {
    use super::{RecordState, RecordView};
    if tag(reply)? == b"absent" {
        return Ok(None);
    }
    let text = |i: usize| match reply.get(i) {
        Some(Value::BulkString(bytes)) => Ok(bytes.as_slice()),
        _ => Err(unexpected(reply)),
    };
    let int = |i: usize| match reply.get(i) {
        Some(Value::Int(n)) => Ok(u64::try_from(*n).unwrap_or(0)),
        _ => Err(unexpected(reply)),
    };
    let ms = |i: usize| int(i).map(Duration::from_millis);
    let state = match text(1)? {
        b"in_flight" => RecordState::InFlight {
            lease_left: ms(5)?,
            may_have_been_sent: text(7)? == b"1",
        },
        b"in_doubt" => RecordState::InDoubt,
        b"completed" => RecordState::Completed {
            status: http::StatusCode::from_u16(u16::try_from(int(8)?).unwrap_or(0))
                .map_err(|err| StoreError::corrupt(err.to_string()))?,
        },
        _ => return Err(StoreError::corrupt("unknown record state")),
    };
    Ok(Some(RecordView {
        state,
        fingerprint: parse_fingerprint(text(2)?)?,
        attempts: u32::try_from(int(3)?).unwrap_or(u32::MAX),
        age: ms(4)?,
        retention_left: ms(6)?,
    }))
}

/// The reply's tag, with `corrupt` replies already turned into errors.
fn tag(reply: &[Value]) -> Result<&[u8], StoreError> {
    match reply.first() {
        Some(Value::BulkString(tag)) if tag == b"corrupt" => {
            let detail = match reply.get(1) {
                Some(Value::BulkString(detail)) => String::from_utf8_lossy(detail).into_owned(),
                _ => "unreadable record".to_owned(),
            };
            Err(StoreError::corrupt(detail))
        }
        Some(Value::BulkString(tag)) => Ok(tag),
        _ => Err(unexpected(reply)),
    }
}

fn unexpected(reply: &[Value]) -> StoreError {
    StoreError::corrupt(format!("unexpected reply from a ledger script: {reply:?}"))
}

fn optional_frozen(value: Option<&Value>) -> Result<Option<FrozenRequest>, StoreError> {
    match value {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::BulkString(bytes)) => FrozenRequest::decode(bytes).map(Some),
        Some(other) => Err(StoreError::corrupt(format!(
            "frozen request stored as {other:?}"
        ))),
    }
}

fn parse_fingerprint(hex: &[u8]) -> Result<Fingerprint, StoreError> {
    let mut bytes = [0u8; 32];
    if hex.len() != 64 {
        return Err(StoreError::corrupt(
            "stored fingerprint is not 64 hex digits",
        ));
    }
    for (byte, pair) in bytes.iter_mut().zip(hex.chunks_exact(2)) {
        *byte = (hex_digit(pair[0])? << 4) | hex_digit(pair[1])?;
    }
    Ok(Fingerprint::from_bytes(bytes))
}

fn hex_digit(digit: u8) -> Result<u8, StoreError> {
    match digit {
        b'0'..=b'9' => Ok(digit - b'0'),
        b'a'..=b'f' => Ok(digit - b'a' + 10),
        _ => Err(StoreError::corrupt(
            "stored fingerprint is not lowercase hex",
        )),
    }
}

/// Tokens travel as 32 hex digits: readable in `HGETALL`, compared as plain strings in Lua.
fn token_hex(token: LeaseToken) -> String {
    format!("{:032x}", token.as_u128())
}

/// A duration in whole milliseconds, clamped to `[min, MAX_TTL_MS]`. Retentions use a
/// minimum of 1 because `PEXPIRE key 0` deletes the key on the spot.
fn millis(duration: Duration, min: u128) -> u64 {
    // The clamp keeps the value below 2^42, so the cast is lossless.
    duration.as_millis().clamp(min, MAX_TTL_MS) as u64
}

/// Redis failures are `unavailable` (fail closed); a reply timeout is a timeout; a key of the
/// wrong type under our prefix is a record we cannot read.
fn from_redis(err: RedisError) -> StoreError {
    if err.code() == Some("WRONGTYPE") {
        StoreError::corrupt(err)
    } else if err.code() == Some("OOM") {
        // `maxmemory` reached under `noeviction`: Redis refuses the write rather than
        // forget a record, which is exactly the full store of the protocol.
        StoreError::full()
    } else if err.is_timeout() {
        StoreError::timeout()
    } else {
        StoreError::unavailable(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_round_trip_through_hex() {
        let fp = Fingerprint::of(&http::Method::POST, "/x", b"{}");
        assert_eq!(parse_fingerprint(fp.to_hex().as_bytes()).unwrap(), fp);
        assert!(parse_fingerprint(b"zz").unwrap_err().is_corrupt());
        assert!(parse_fingerprint(&[b'G'; 64]).unwrap_err().is_corrupt());
    }

    #[test]
    fn durations_are_clamped_for_lua_and_pexpire() {
        assert_eq!(millis(Duration::ZERO, 1), 1);
        assert_eq!(millis(Duration::ZERO, 0), 0);
        assert_eq!(millis(Duration::from_micros(1500), 1), 1);
        assert_eq!(millis(Duration::MAX, 1), 1 << 42);
    }

    #[test]
    fn tokens_are_32_hex_digits() {
        assert_eq!(token_hex(LeaseToken::from_u128(0xab)).len(), 32);
        assert_eq!(token_hex(LeaseToken::from_u128(u128::MAX)), "f".repeat(32));
    }

    #[test]
    fn corrupt_replies_become_corrupt_errors() {
        let reply = [
            Value::BulkString(b"corrupt".to_vec()),
            Value::BulkString(b"record format version 2".to_vec()),
        ];
        assert!(decode_begin(&reply, LeaseToken::generate())
            .unwrap_err()
            .is_corrupt());
        let garbage = [Value::Int(3)];
        assert!(decode_begin(&garbage, LeaseToken::generate())
            .unwrap_err()
            .is_corrupt());
    }
}
