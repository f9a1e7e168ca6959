//! [`RedisStore`]: the ledger protocol over single-key Lua scripts.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use ::redis::{Client, Value};

use super::builder::{RedisStoreBuilder, Target};
use ::redis::Script;

use super::codec::{
    decode_begin, decode_forget, decode_inspect, decode_inspected_request, decode_resolve,
    generation_hex, millis, tag, token_hex, u64_hex, unexpected,
};
use super::connection::{Connection, ScriptCall};
use super::errors::from_redis;
use super::layout::{index_key, sweep_key, Layout};
use super::pages::INDEXED_KINDS;
use super::scripts::{ABANDON, BEGIN, COMPLETE, FORGET, INSPECT, MARK_IN_DOUBT, RENEW, RESOLVE};
use crate::ledger::{
    Begin, BeginRequest, Generation, IdempotencyStore, LeaseToken, LedgerKey, ListPage, ListQuery,
    Origin, Outcome, StoreError, StoreFuture,
};

/// Where a record lives: where this release keeps it, or (on a cluster that may hold them)
/// where an earlier release did, at the key named.
enum Place {
    Current,
    Legacy(String),
}

/// The distributed ledger on Redis. See the [module docs](super) for how it works, the record
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
    pub(super) connection: Connection,
    /// The prefix, and on a cluster the buckets records are spread over.
    pub(super) layout: Layout,
    pub(super) operation_timeout: Duration,
    /// `host:port` for `Debug`, without the credentials a URL may carry.
    pub(super) addr: Arc<str>,
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

    /// The Redis key holding the record of `key`: the prefix and 64 hex digits (on a Redis
    /// Cluster, with its bucket's hash tag between them: see the [module
    /// docs](super#redis-cluster)). For operators and tests; the store computes it itself.
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
        self.layout.record_key(key)
    }

    /// A transition of `key`'s record where it lives (see [`Place`]): the record, then its
    /// bucket's listing indexes and sweep cursors, which the script keeps in step with the
    /// record. A record an earlier release wrote on a cluster has no indexes beside it.
    fn transition_at(&self, script: &'static Script, key: &LedgerKey, place: &Place) -> ScriptCall {
        match place {
            Place::Current => {
                let base = self.layout.base_of(key);
                let mut keys = vec![self.layout.record_key(key)];
                keys.extend(INDEXED_KINDS.map(|kind| index_key(&base, kind)));
                keys.push(sweep_key(&base));
                ScriptCall::with_keys(script, &keys)
            }
            Place::Legacy(legacy) => ScriptCall::new(script, legacy.clone()),
        }
    }

    /// Where `key`'s record lives: where this release keeps it, unless the ledger may still
    /// hold a record an earlier release wrote on a cluster and does (one `HGET` more). Such a
    /// record is never made anew (`begin` makes records only where this release keeps
    /// them), so once gone it stays gone, and the answer goes stale only by the record
    /// leaving, which the script then sees.
    async fn place(&self, key: &LedgerKey) -> Result<Place, StoreError> {
        let Some(legacy) = self.layout.legacy_key(key) else {
            return Ok(Place::Current);
        };
        let mut connection = self.connection.clone();
        let mut ask = ::redis::cmd("HGET");
        ask.arg(&legacy).arg("state");
        let state: Option<String> =
            tokio::time::timeout(self.operation_timeout, ask.query_async(&mut connection))
                .await
                .map_err(|_elapsed| StoreError::timeout())?
                .map_err(from_redis)?;
        // A released marker is no record: the key's next life is made where this release
        // keeps records.
        Ok(match state {
            Some(state) if state != "released" => Place::Legacy(legacy),
            _ => Place::Current,
        })
    }

    /// The key of `key`'s record, wherever it lives.
    async fn located_key(&self, key: &LedgerKey) -> Result<String, StoreError> {
        Ok(match self.place(key).await? {
            Place::Current => self.layout.record_key(key),
            Place::Legacy(legacy) => legacy,
        })
    }

    /// A transition of `key`'s record, wherever it lives.
    async fn transition(
        &self,
        script: &'static Script,
        key: &LedgerKey,
    ) -> Result<ScriptCall, StoreError> {
        Ok(self.transition_at(script, key, &self.place(key).await?))
    }

    /// Run one script invocation: one `EVALSHA` (plus `SCRIPT LOAD` and a retry when Redis
    /// lost the script), bounded by the operation timeout.
    pub(super) async fn invoke(&self, call: &ScriptCall) -> Result<Vec<Value>, StoreError> {
        // A clone per call is how both connections are meant to be shared: they are an `Arc`.
        let mut connection = self.connection.clone();
        // The timeout bounds our wait, not Redis: a script cut off here may still run, and
        // run whole (a script is atomic). The layers therefore read a timeout as "may have
        // applied": `begin` is asked again under the same token, and a retried `complete`
        // reads a `fenced` as "the first one applied" (see the module docs).
        let reply = tokio::time::timeout(self.operation_timeout, connection.run(call))
            .await
            .map_err(|_elapsed| StoreError::timeout())?
            .map_err(from_redis)?;
        // Every script answers a tagged array, refusals included (see `prelude.lua`). Anything
        // else is no ledger script's answer: refuse to read it as one.
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
        // The script compared the token and wrote in one atomic step, so `fenced` means
        // nothing was written: another owner holds the record, it was settled already, or it
        // is gone.
        match tag(&reply)? {
            b"ok" => Ok(()),
            b"fenced" => Err(StoreError::fenced()),
            _ => Err(unexpected(&reply)),
        }
    }
}

/// The arguments of `begin.lua` for `request`, in its order; `only_existing` for the ask at
/// the key an earlier release kept the record at.
fn begin_args(call: &mut ScriptCall, request: &BeginRequest, only_existing: bool) {
    // The lease may be 0 (a claim born lapsed is legal): it is a field
    // compared with Redis's clock. The retention is the key's `PX` TTL, where 0 would
    // delete the record in the step that writes it, hence the floor of 1 ms.
    call.arg(request.fingerprint.to_hex())
        .arg(token_hex(request.token))
        .arg(millis(request.lease, 0))
        .arg(millis(request.retention, 1))
        .arg(if request.take_over { "1" } else { "0" })
        // Drawn here, not in the script (Redis has no good randomness to offer
        // scripts): kept only by the ask that creates the record.
        .arg(generation_hex(Generation::random()));
    // Sent on every client-side ask, stored only by the ask that creates the record:
    // a resume or a retried `begin` never replaces the bytes first frozen.
    // Empty on the server side (nothing frozen), so the scope can follow it.
    match &request.frozen {
        Some(frozen) => call.arg(frozen.encode()),
        None => call.arg(""),
    };
    call.arg(u64_hex(request.scope))
        .arg(if only_existing { "1" } else { "" });
    push_origin(call, request.named_origin().as_ref());
}

/// The origin's arguments of `begin.lua`: its face (`` for none), its target, and the
/// operation's task and step ids when one named it.
fn push_origin(call: &mut ScriptCall, origin: Option<&Origin>) {
    let Some(origin) = origin else {
        call.arg("");
        return;
    };
    call.arg(origin.face().as_str()).arg(origin.target());
    if let (Some(task), Some(step)) = (origin.task_id(), origin.step_id()) {
        call.arg(task).arg(step);
    }
}

impl fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisStore")
            .field("addr", &self.addr)
            .field("prefix", &self.layout.prefix())
            .field("operation_timeout", &self.operation_timeout)
            .finish_non_exhaustive()
    }
}

impl IdempotencyStore for RedisStore {
    fn begin(&self, request: BeginRequest) -> StoreFuture<'_, Begin> {
        StoreFuture::new(async move {
            // The caller's token, not one made in the script: Redis has no good randomness
            // to offer scripts, and a `begin` sent again after a lost reply must bring the
            // same token to recognise its own claim.
            let token = request.token;
            let key = request.key;
            // A record an earlier release wrote on a cluster is asked first, and only if it
            // is there does it answer: a claim is made only where this release keeps records.
            if let Some(legacy) = self.layout.legacy_key(&key) {
                let mut call = self.transition_at(&BEGIN, &key, &Place::Legacy(legacy));
                begin_args(&mut call, &request, true);
                let reply = self.invoke(&call).await?;
                if tag(&reply)? != b"elsewhere" {
                    return decode_begin(&reply, token);
                }
            }
            let mut call = self.transition_at(&BEGIN, &key, &Place::Current);
            begin_args(&mut call, &request, false);
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
            // The retention travels with the outcome: a completion starts the record's
            // retention again from now, so a replay stays available a full retention after
            // the operation finished, however long it was in flight or in doubt before.
            let mut call = self.transition(&COMPLETE, &key).await?;
            call.arg(token_hex(token))
                .arg(outcome.encode())
                .arg(millis(retention, 1));
            self.settle(&call).await
        })
    }

    fn abandon(&self, key: LedgerKey, token: LeaseToken) -> StoreFuture<'_, ()> {
        StoreFuture::new(async move {
            // No retention: a released claim leaves only the released marker, which expires on
            // its own clock, and a record kept in doubt keeps the TTL it had.
            let mut call = self.transition(&ABANDON, &key).await?;
            call.arg(token_hex(token))
                .arg(millis(crate::ledger::RELEASED_TOKEN_TTL, 1));
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
            let mut call = self.transition(&MARK_IN_DOUBT, &key).await?;
            call.arg(token_hex(token)).arg(millis(retention, 1));
            self.settle(&call).await
        })
    }

    fn inspect(&self, key: LedgerKey) -> StoreFuture<'_, Option<crate::ledger::RecordView>> {
        StoreFuture::new(async move {
            let call = ScriptCall::new(&INSPECT, self.located_key(&key).await?);
            let reply = self.invoke(&call).await?;
            let request = decode_inspected_request(&reply)?;
            Ok(decode_inspect(&reply)?.map(|view| view.with_request(request)))
        })
    }

    /// A page from the listing indexes (see the [module docs](super#listing)): one script
    /// per bucket (one on a single Redis, sixteen on a cluster), each looking at no more
    /// than ten index entries per record the page may hold (at least the page's limit, at
    /// most 1000 otherwise), so a page costs the same however many records the store holds.
    fn list(&self, query: ListQuery) -> StoreFuture<'_, ListPage> {
        StoreFuture::new(async move {
            let mut page = self.list_page(&query).await?;
            // The scripts filtered already; the shared rule has the last word, so every
            // store agrees on what a filter means.
            page.records.retain(|record| query.matches(&record.view));
            Ok(page)
        })
    }

    fn renew(&self, key: LedgerKey, token: LeaseToken, lease: Duration) -> StoreFuture<'_, ()> {
        StoreFuture::new(async move {
            // Only the lease field moves; the key's TTL is untouched, so an owner renewing in a
            // loop cannot stretch the record's retention.
            let mut call = ScriptCall::new(&RENEW, self.located_key(&key).await?);
            call.arg(token_hex(token)).arg(millis(lease, 1));
            self.settle(&call).await
        })
    }

    fn forget(
        &self,
        key: LedgerKey,
        expected: crate::ledger::Expected,
    ) -> StoreFuture<'_, crate::ledger::Forget> {
        StoreFuture::new(async move {
            let mut call = self.transition(&FORGET, &key).await?;
            call.arg(expected.kind.as_str())
                .arg(expected.fingerprint.to_hex())
                .arg(expected.attempts)
                .arg(if expected.force { "1" } else { "0" })
                .arg(generation_hex(expected.generation))
                .arg(expected.generation.as_u64());
            let answer = match self.invoke(&call).await {
                Ok(reply) => decode_forget(&reply),
                Err(err) => Err(err),
            };
            // Reported whatever the answer, errors included: an operator's deletion is audited
            // even when it did not happen.
            crate::ledger::report_forget("redis", &key, &expected, &answer);
            answer
        })
    }

    fn resolve(
        &self,
        key: LedgerKey,
        expected: crate::ledger::Expected,
        outcome: Outcome,
        retention: Duration,
    ) -> StoreFuture<'_, crate::ledger::Resolve> {
        StoreFuture::new(async move {
            // One script judges the look and completes the record, moving it to the
            // completed index (on a single Redis) in the same step.
            let mut call = self.transition(&RESOLVE, &key).await?;
            call.arg(expected.kind.as_str())
                .arg(expected.fingerprint.to_hex())
                .arg(expected.attempts)
                .arg(if expected.force { "1" } else { "0" })
                .arg(generation_hex(expected.generation))
                .arg(expected.generation.as_u64())
                .arg(outcome.encode())
                .arg(millis(retention, 1));
            let answer = match self.invoke(&call).await {
                Ok(reply) => decode_resolve(&reply),
                Err(err) => Err(err),
            };
            // Audited whatever the answer, as a forget is.
            crate::ledger::report_resolve("redis", &key, &expected, outcome.status(), &answer);
            answer
        })
    }
}
