//! What the store reads of a Redis's settings when it connects, and warns about: settings
//! under which Redis may forget a ledger record (eviction, no persistence), and with it the
//! fact that an operation ran.

use std::time::Duration;

use super::connection::Connection;

/// Say so, loudly, when the server's `maxmemory-policy` may evict ledger keys: an evicted
/// record is a forgotten operation, and a forgotten operation runs again. Every record has
/// a TTL, so the `volatile-*` policies evict them as readily as the `allkeys-*` ones. A
/// server that refuses `CONFIG GET` (managed offerings often do) is not asked twice.
pub(super) async fn warn_if_ledger_keys_can_be_evicted(
    connection: &Connection,
    addr: &str,
    bound: Duration,
) {
    let mut connection = connection.clone();
    let mut ask = ::redis::cmd("CONFIG");
    ask.arg("GET").arg("maxmemory-policy");
    let reply = tokio::time::timeout(bound, ask.query_async::<Vec<String>>(&mut connection)).await;
    // A warning, never a refusal: managed Redis services often rename or forbid `CONFIG`,
    // and an operator may know the setting is right. The store works either way; only
    // what it can promise differs.
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
pub(super) struct Persistence {
    /// `appendonly`: the append-only file logs every write.
    appendonly: bool,
    /// `appendfsync`: when that log reaches the disk (`always`, `everysec` or `no`).
    appendfsync: String,
    /// `save`: the RDB snapshot schedule; empty when no snapshot is ever taken.
    save: String,
}

/// The three settings [`Persistence`] is read from, one `CONFIG GET` each (Redis before 7
/// takes one name per `CONFIG GET`).
pub(super) const PERSISTENCE_SETTINGS: [&str; 3] = ["appendonly", "appendfsync", "save"];

impl Persistence {
    /// From the replies of `CONFIG GET` for each of [`PERSISTENCE_SETTINGS`], in order; `None`
    /// when one is missing (a server that hides its configuration).
    pub(super) fn from_replies(replies: &[Vec<String>]) -> Option<Self> {
        let value = |i: usize| replies.get(i).and_then(|pair| pair.get(1)).cloned();
        Some(Self {
            appendonly: value(0)?.eq_ignore_ascii_case("yes"),
            appendfsync: value(1)?,
            save: value(2)?,
        })
    }

    /// Whether a record the node acknowledged may still be there after it restarts: it logs
    /// writes to an append-only file, or takes RDB snapshots.
    pub(super) fn keeps_records(&self) -> bool {
        self.appendonly || !self.save.trim().is_empty()
    }
}

/// Say so, as loudly as for eviction, when `node` keeps nothing across a restart (no
/// append-only file, no snapshots): each record it held is gone when it comes back, and an
/// operation retried after that finds no record and runs again, charged twice.
pub(super) fn warn_unless_records_survive_a_restart(node: &str, persistence: &Persistence) {
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
pub(super) async fn warn_if_records_do_not_survive_a_restart(
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
