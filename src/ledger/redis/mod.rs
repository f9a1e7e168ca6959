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
//! use tower_idempotency::fingerprint::Fingerprint;
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
//!   default), and every script works on that key (on a single Redis, a transition also
//!   moves the record's entry in the [listing indexes](#listing), in the same step). A
//!   script is atomic, so `begin` is one step with no check-then-set, and the scripts stay
//!   valid under any key-slot sharding.
//! - **One round trip per ledger operation.** The eight scripts are loaded when the store
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
//!   [operation timeout](super::RedisStoreBuilder::operation_timeout) (1 s by default). When Redis
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
//! rather than stuck in flight and then in doubt; the release leaves the key released
//! under that token for a minute, so the `begin` itself, were it still on its way, claims
//! nothing when it lands.
//!
//! # Record layout
//!
//! Each record is a Redis hash:
//!
//! | field | value |
//! |---|---|
//! | `v` | record format version, `1` today |
//! | `fp` | the request [`Fingerprint`](crate::fingerprint::Fingerprint), 64 hex digits |
//! | `state` | `in_flight`, `in_doubt` or `completed` |
//! | `token` | the owner's token, 32 hex digits (only while `in_flight`) |
//! | `lease_until_ms` | end of the owner's lease, Redis time in ms since the epoch (only while `in_flight`) |
//! | `sent` | `1` once an attempt may have been sent (after a resume or an in-doubt mark), else `0`; `abandon` only releases a `0` record, and a `begin` recognising its own claim answers `resume` for a `1` one |
//! | `retention_ms` | the retention last asked for (for operators: no script reads it back) |
//! | `created_ms` | when the operation was first claimed, Redis time |
//! | `attempts` | how many times ownership was handed out (the first claim and each resume) |
//! | `gen` | the record's [`Generation`](super::Generation), 16 hex digits: drawn at random by the claim that creates it, never changed after (a record an earlier release wrote has none: its generation is its `created_ms`) |
//! | `scope` | the digest of the key's scope ([`scope_id`](super::scope_id)), 16 hex digits, for listing (a record an earlier release wrote has none: scope 0) |
//! | `touched_ms` | when the record last changed state (claimed, resumed, put in doubt, completed), Redis time (a record an earlier release wrote has none: its `created_ms`) |
//! | `origin` | what the record is of ([`Origin`](super::Origin)): the face that made it, `client`, `server` or `tool` (set by the claim that creates the record; a record an earlier release wrote, or one claimed without an origin, has none) |
//! | `target` | the origin's target, as [`Origin::target`](super::Origin::target) keeps it (with `origin`) |
//! | `task`, `step` | the `task_id` and `step_id` of the [`OperationId`](crate::OperationId) that named the operation (with `origin`, when one did) |
//! | `frozen` | the frozen request, [`FrozenRequest::encode`](crate::FrozenRequest::encode) (absent on the server side) |
//! | `outcome` | the recorded outcome, [`Outcome::encode`](super::Outcome::encode) (only when `completed`) |
//! | `status` | the outcome's HTTP status, so a look at a completed record need not read its outcome (only when `completed`; a record an earlier release completed has none, and its status is read from `outcome`) |
//!
//! A key without a record may hold a *released marker* instead (see "A release outlasts a
//! late claim" in the [ledger docs](crate::ledger)): a hash with `v`, `state` = `released`
//! and a field `released:<token>` (32 hex digits) per token the key was released under, its
//! `PX` TTL one minute from the last release. It lives in the record's own key, so each
//! script still touches one key, in one slot; `begin` under a released token answers
//! `released` (a [fenced](super::StoreError::is_fenced) error), any other `begin` replaces
//! the marker with its claim, and `inspect` and `forget` see no record. A token released
//! while a record holds the key (another caller's, or one put in doubt) is kept beside it:
//! its `released:<token>` field, and `released_until_ms` (Redis time, the end of every such
//! field of the key); a `begin` under it answers `released` whatever the record says, and
//! when the record leaves by a release or a forget the fields still live stay as the key's
//! marker. A record past its retention leaves with its key's TTL, fields and all (a token
//! released less than a minute before the end of a retention of hours is not remembered
//! past it).
//!
//! The key's TTL (`PTTL`) is the retention: set by the first claim, by a completion and by
//! an in-doubt mark (never shortened); a resume, an abandon, a renewal and a probe leave it
//! as it is, so retrying an in-doubt key never keeps it alive. A later release
//! reads version-1 records; `gen` was added within version 1, since an earlier release keeps
//! any field it does not know and an earlier release's record reads without it. This release
//! refuses a record with an unknown version (or one that
//! is not a hash written by it) as [corrupt](super::StoreError::is_corrupt) rather than
//! misread it.
//!
//! An operator's [`forget`](super::IdempotencyStore::forget) deletes the key, in a script
//! that first checks `gen`, `state`, `fp`, `attempts` and, while in flight, `lease_until_ms`
//! against what the operator saw (see [`Records`](super::Records)). An operator's
//! [`resolve`](super::IdempotencyStore::resolve) makes the same checks in its own script,
//! refuses a `completed` record, and completes the record as `complete` does (`outcome`,
//! `status`, `touched_ms`, the retention as the key's TTL; `token` and `lease_until_ms`
//! gone; `fp` and `frozen` kept), moving it to the completed index in the same step.
//!
//! # Listing
//!
//! [`list`](super::IdempotencyStore::list) reads three sorted sets under the prefix,
//! `<prefix>index:in_flight`, `<prefix>index:in_doubt` and `<prefix>index:completed`: one
//! member per record in that state (the key's 64 hex digits), scored by its `created_ms`,
//! the record's place in the list (ties ordered by key). Every transition moves its
//! record's member **in the same script** as it writes the record (those scripts declare
//! the indexes, and a cursor hash `<prefix>index:sweep`, after the record's key), so a
//! record and its index entry never disagree.
//!
//! - **A page costs a bounded amount.** One `list.lua` script walks the indexes of the
//!   states asked for, merged by position, from the cursor: at most ten entries per record
//!   the page may hold (the page's limit at least, 1000 at most), never `KEYS` or `SCAN`.
//!   A page that stops looking early comes back short with a cursor. Listing in doubt reads
//!   the in-doubt index only: its cost follows the records in doubt, not the whole ledger.
//!   The age filters are score ranges, so records outside them cost nothing; the scope,
//!   status and origin filters (target prefix, tool, task) are applied per entry, within
//!   the same bound (an origin filter reads three more fields of each entry's record).
//! - **Records leave by their TTL**, which no script sees. A list that meets a member whose
//!   record is gone removes it and goes on; and every fourth claim looks at the next eight
//!   members of every index (a cursor going round, by rank; one `EXISTS` for them all) and
//!   removes those of records gone, so an index holds at most about twice its live records
//!   whether or not anyone lists.
//! - **An in-flight record whose lease ran out** is listed in flight, with no lease left,
//!   as [`inspect`](super::IdempotencyStore::inspect) shows it.
//! - **Cost.** Inside the scripts, a claim adds a `ZADD` and an `HINCRBY` (and every
//!   fourth claim a sweep: `HMGET`, three `ZRANGE`, an `EXISTS`, an `HSET`), every other
//!   transition a `ZADD` and a `ZREM`; in memory, each record holds one index entry (about
//!   180 bytes with its 64-digit member) and three short fields.
//! - **Records written before this release** (or by a process of an earlier release still
//!   running) are not in the indexes until their next change of state; `inspect` still
//!   sees them.
//! - **On Redis Cluster**, a script may touch the keys of one slot only, so the indexes are
//!   kept per bucket (see [below](#redis-cluster)): a record's key and its bucket's
//!   indexes share a hash tag, so one slot, and every transition still updates both in one
//!   script. A page asks every bucket's `list.lua` at once (sixteen scripts, each bounded
//!   as above) for its share of the page with room to spare (21 records of a page of
//!   100), and merges them by place: it holds the records, in order, up to the earliest
//!   place at which a bucket stopped, and its cursor is a place, the same for every
//!   bucket. A page of 100 looks at no more than 16 × 210 index entries; it comes back
//!   short (with its cursor) when one bucket's share ran out before the page filled.
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
//! Redis Cluster through redis-rs's cluster client. The records are the same; each script
//! touches one record and the listing indexes of its bucket, declared in `KEYS` and all in
//! one slot, so the cluster runs every transition atomically on the primary that owns it.
//!
//! - **Buckets.** A record's key carries the hash tag of its bucket, one of sixteen picked
//!   by the key's first hex digit: `<prefix>{<tag>}<64 hex>`, beside
//!   `<prefix>{<tag>}index:<state>` and `<prefix>{<tag>}index:sweep`. The sixteen tags hash
//!   to slots a sixteenth of the slot range apart, so with slots assigned in even ranges
//!   (as `redis-cli --cluster create` does) each of three primaries holds five or six
//!   buckets. A ledger spreads over at most sixteen primaries.
//! - **Upgrading a cluster ledger in place.** Earlier releases kept each record at
//!   `<prefix><64 hex>`, without a tag (so in another slot) and without an index. When a
//!   store connects, it reads a marker (`<prefix>{0.13}layout`); unless the marker says no
//!   such key is left, it looks for one (`SCAN` on every primary, within the connect's time
//!   bound) and sets the marker when it finds none. While such records may be left, every
//!   operation first asks the old key (one `HGET`, or for `begin` the script itself, which
//!   answers only from a record already there): a record of the earlier release is found,
//!   replayed, resumed and completed where it is, and never made there again. They are not
//!   listed (they have no index entry). They leave by their retention; the next store to
//!   connect after the last one left sets the marker, and stores connected from then on
//!   ask nothing more. **Stop every process of the earlier release before the first
//!   process of this one starts:** a process of the earlier release still claiming at the
//!   old keys and one of this release claiming at the new ones could both claim one
//!   operation.
//!
//! - **Sharding.** Records spread over the primaries holding the sixteen buckets' slots;
//!   throughput and memory grow with the number of primaries, up to sixteen. Keep hash tags
//!   (`{…}`) out of the prefix: a tagged prefix puts the whole ledger in one slot (the store
//!   warns when it sees one).
//! - **Round trips.** The client keeps the slot map and sends each script straight to the
//!   key's primary: still two commands per fresh operation and one per replay (one more
//!   for each while records of an earlier release may be left: see above).
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
//! 20 in `tests/ledger/redis_cluster.rs`); with `min-replicas-to-write 1` the same fault refuses
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

pub(crate) mod builder;
#[cfg(feature = "redis-cluster")]
pub(crate) mod cluster;
mod codec;
mod connection;
mod errors;
mod layout;
mod pages;
mod scripts;
mod settings;
pub(crate) mod store;
#[cfg(feature = "redis-cluster")]
mod upgrade;

pub(crate) use self::store::RedisStore;
