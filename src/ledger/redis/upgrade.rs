//! Records an earlier release wrote on a Redis Cluster, before records were spread over
//! hash-tagged buckets: whether the ledger may still hold some.
//!
//! Earlier releases kept a record at `<prefix><64 hex>`, in whatever slot that hashes to,
//! and kept no index. This release keeps it at `<prefix>{<tag>}<64 hex>` (see
//! `layout.rs`), another slot. A store that ignored the old keys would read an operation
//! claimed or completed before the upgrade as never seen, and run it again; so while the
//! ledger may hold old keys, every operation first asks the old key (one command more,
//! and `begin` answers from a record found there), and no record is ever made there again.
//!
//! Old records leave by their retention. When the store connects it reads a marker; if the
//! marker does not say that no old key is left, it looks for one (`SCAN` on every primary,
//! once per connect, within the connect's time bound) and sets the marker when none is
//! found: from then on, every store that connects skips both the looking and the asking.

use std::time::Duration;

use ::redis::cluster_routing::{MultipleNodeRoutingInfo, RoutingInfo, SingleNodeRoutingInfo};
use ::redis::{RedisError, Value};

use super::connection::Connection;
use super::layout::layout_marker;

/// What the marker holds once no record of the earlier layout is left.
const BUCKETS_ONLY: &str = "buckets-only";

/// Keys one `SCAN` step looks at on a node.
const SCAN_STEP: usize = 1000;

/// Whether the cluster behind `connection` may hold records at the earlier layout's keys
/// under `prefix`: `false` only when the marker says so, or a look over every primary found
/// none within `bound` (then the marker is set). Anything unsure answers `true`: the store
/// then asks the old keys, which costs a command, never a record.
pub(super) async fn may_hold_earlier_records(
    connection: &Connection,
    prefix: &str,
    bound: Duration,
) -> bool {
    let Connection::Cluster(cluster) = connection else {
        return false;
    };
    let mut cluster = cluster.clone();
    let marker = layout_marker(prefix);
    let look = async {
        let said: Option<String> = ::redis::cmd("GET")
            .arg(&marker)
            .query_async(&mut cluster)
            .await?;
        if said.as_deref() == Some(BUCKETS_ONLY) {
            return Ok(false);
        }
        if let Some(key) = first_earlier_key(&mut cluster, prefix).await? {
            tracing::warn!(
                %key,
                "the ledger holds records an earlier release wrote (before records were spread \
                 over hash-tagged buckets): every operation asks their keys first, one command \
                 more, until a store connects after the last of them has left by its retention"
            );
            return Ok(true);
        }
        ::redis::cmd("SET")
            .arg(&marker)
            .arg(BUCKETS_ONLY)
            .query_async::<()>(&mut cluster)
            .await?;
        Ok::<_, RedisError>(false)
    };
    match tokio::time::timeout(bound, look).await {
        Ok(Ok(may)) => may,
        Ok(Err(err)) => {
            tracing::warn!(
                error = %err,
                "could not tell whether the ledger holds records an earlier release wrote: \
                 every operation asks their keys first, one command more"
            );
            true
        }
        Err(_elapsed) => {
            tracing::warn!(
                "could not look for records an earlier release wrote within {bound:?}: every \
                 operation asks their keys first, one command more, until a store connects \
                 and finds none in time"
            );
            true
        }
    }
}

/// The first key under `prefix` with the earlier layout (the prefix and 64 lowercase hex
/// digits, no tag) on any primary.
async fn first_earlier_key(
    cluster: &mut ::redis::cluster_async::ClusterConnection,
    prefix: &str,
) -> Result<Option<String>, RedisError> {
    let pattern = earlier_key_pattern(prefix);
    // The first step on every primary at once; then each primary's cursor, node by node.
    let Value::Map(first) = cluster
        .route_command(
            scan("0", &pattern),
            RoutingInfo::MultiNode((MultipleNodeRoutingInfo::AllMasters, None)),
        )
        .await?
    else {
        return Err(RedisError::from((
            ::redis::ErrorKind::Client,
            "SCAN on every primary did not answer a map",
        )));
    };
    for (node, reply) in first {
        let node: String = ::redis::from_redis_value(node)?;
        let (mut cursor, keys): (String, Vec<String>) = ::redis::from_redis_value(reply)?;
        if let Some(key) = keys.into_iter().next() {
            return Ok(Some(key));
        }
        let Some((host, port)) = node
            .rsplit_once(':')
            .and_then(|(host, port)| Some((host.to_owned(), port.parse().ok()?)))
        else {
            continue;
        };
        while cursor != "0" {
            let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                host: host.clone(),
                port,
            });
            let reply = cluster
                .route_command(scan(&cursor, &pattern), route)
                .await?;
            let (next, keys): (String, Vec<String>) = ::redis::from_redis_value(reply)?;
            if let Some(key) = keys.into_iter().next() {
                return Ok(Some(key));
            }
            cursor = next;
        }
    }
    Ok(None)
}

fn scan(cursor: &str, pattern: &str) -> ::redis::Cmd {
    let mut cmd = ::redis::cmd("SCAN");
    cmd.arg(cursor)
        .arg("MATCH")
        .arg(pattern)
        .arg("COUNT")
        .arg(SCAN_STEP);
    cmd
}

/// A `SCAN` pattern of the earlier layout's keys: the prefix (its glob characters escaped)
/// and 64 hex digits.
fn earlier_key_pattern(prefix: &str) -> String {
    let mut pattern = String::with_capacity(prefix.len() * 2 + 64 * 8);
    for c in prefix.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            pattern.push('\\');
        }
        pattern.push(c);
    }
    for _ in 0..64 {
        pattern.push_str("[0-9a-f]");
    }
    pattern
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pattern_escapes_the_prefix_and_asks_for_64_hex_digits() {
        let pattern = earlier_key_pattern("a*b[c]:");
        assert!(pattern.starts_with("a\\*b\\[c\\]:[0-9a-f]"), "{pattern}");
        assert_eq!(pattern.matches("[0-9a-f]").count(), 64);
    }
}
