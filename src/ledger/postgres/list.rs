//! Listing records (schema version 4): a page is one statement walking the records of the
//! states asked for in the order of their claims, from the query's cursor, on the index of
//! the states (`records_by_state`) or of the scope and states (`records_by_scope`).
//!
//! Each state is one range of its index in `(created_at, key)` order, from the cursor on;
//! the three ranges are merged (PostgreSQL's `Merge Append`), so a page reads the index
//! entries of the records it lists and stops. What the index cannot tell (a completed
//! record's status, a record past its retention not yet swept) is filtered as the walk
//! goes, and the walk stops after [`SCAN_BUDGET`] records whatever it found: a page's cost
//! is bounded, and a page cut short by the budget hands out the cursor after the last
//! record it looked at, so the next page goes on from there.

use std::time::{Duration, SystemTime};

use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use super::codec::{decode_inspect, scope_column};
use super::errors::{from_pg, from_pool};
use super::PostgresStore;
use crate::ledger::list::sort_in_order;
use crate::ledger::{
    LedgerKey, ListCursor, ListOrder, ListPage, ListQuery, ListedRecord, RecordKind, StoreError,
};

/// The most records one page looks at, listed or not: a page of a list whose filters few
/// records pass costs this much at most, and may come back short (with a cursor).
// Ten of the largest pages, so the index's own filters (state, scope, age, cursor) carry
// almost every page; the budget only meets a status filter over many records of other
// statuses, or a backlog of expired records the sweep has not deleted yet.
const SCAN_BUDGET: i64 = 10 * crate::ledger::MAX_PAGE as i64;

/// The states a list may walk, each its own range of the index, in the order of the flags
/// the statement takes (`$1`, `$2`, `$3`).
const STATES: [(RecordKind, &str); 3] = [
    (RecordKind::InFlight, "in_flight"),
    (RecordKind::InDoubt, "in_doubt"),
    (RecordKind::Completed, "completed"),
];

/// What a statement's text depends on (the values travel as parameters): a statement per
/// shape, prepared once per pooled connection, each planned on the index it walks.
#[derive(Clone, Copy)]
struct Shape {
    order: ListOrder,
    scoped: bool,
    from_cursor: bool,
}

/// The statement for one shape of query. Parameters: `$1`..`$3` whether each state is
/// listed, `$4` how many records to answer, `$5`..`$6` the statuses a completed record
/// must have, `$7` and `$8` the least and greatest age in milliseconds (NULL: no bound),
/// then the scope, then the cursor's claim time and key.
fn list_sql(schema: &str, shape: Shape) -> String {
    let (direction, after) = match shape.order {
        ListOrder::NewestFirst => ("DESC", "<"),
        ListOrder::OldestFirst => ("ASC", ">"),
    };
    let mut next_param = 9;
    let mut param = || {
        let name = format!("${next_param}");
        next_param += 1;
        name
    };
    let scope = if shape.scoped {
        format!("AND t.scope = {}", param())
    } else {
        String::new()
    };
    let cursor = if shape.from_cursor {
        let (position, key) = (param(), param());
        format!("AND (t.created_at, t.key) {after} ({position}, {key})")
    } else {
        String::new()
    };
    let branches: Vec<String> = STATES
        .iter()
        .enumerate()
        .map(|(index, (_, state))| {
            format!(
                "SELECT t.key, t.created_at, t.state, t.fingerprint, t.attempts, t.lease_until, \
                        t.retain_until, t.sent, t.status, t.generation, t.touched_at, t.scope, \
                        (t.retain_until > statement_timestamp() \
                         AND (t.state <> 'completed' OR t.status BETWEEN $5 AND $6)) AS passes \
                   FROM {schema}.records t \
                  WHERE ${flag} AND t.state = '{state}' {scope} \
                    AND t.created_at <= coalesce(statement_timestamp() - $7::bigint * interval '1 millisecond', 'infinity') \
                    AND t.created_at > coalesce(statement_timestamp() - $8::bigint * interval '1 millisecond', '-infinity') \
                    {cursor}",
                flag = index + 1,
            )
        })
        .collect();
    // The walk: the states' ranges merged in claim order, cut at the budget, each record
    // numbered as it comes. The page: the records that pass, and the budget's last one
    // (which says where a page cut short goes on), up to `$4`. Every step streams in the
    // walk's order, so the walk stops as soon as the page is full.
    format!(
        "SELECT w.state, w.fingerprint, w.attempts, \
                greatest(0, floor(extract(epoch FROM statement_timestamp() - w.created_at) * 1000))::bigint, \
                greatest(0, floor(extract(epoch FROM coalesce(w.lease_until, statement_timestamp()) - statement_timestamp()) * 1000))::bigint, \
                greatest(0, floor(extract(epoch FROM w.retain_until - statement_timestamp()) * 1000))::bigint, \
                w.sent, w.status, {schema}.generation_of(w.generation, w.created_at), \
                greatest(0, floor(extract(epoch FROM statement_timestamp() - coalesce(w.touched_at, w.created_at)) * 1000))::bigint, \
                w.scope, w.key, w.created_at, w.passes, w.seen = {SCAN_BUDGET} \
           FROM (SELECT s.*, row_number() OVER (ORDER BY s.created_at {direction}, s.key {direction}) AS seen \
                   FROM ({walk} ORDER BY 2 {direction}, 1 {direction} LIMIT {SCAN_BUDGET}) s) w \
          WHERE w.passes OR w.seen = {SCAN_BUDGET} \
          ORDER BY w.created_at {direction}, w.key {direction} \
          LIMIT $4",
        walk = branches.join(" UNION ALL "),
    )
}

/// A listed row: the record (when it passes the filters), and whether the walk's budget
/// ended on it.
struct Walked {
    listed: Option<ListedRecord>,
    place: ListCursor,
    last_of_budget: bool,
}

impl PostgresStore {
    /// [`list`](crate::ledger::IdempotencyStore::list): one statement, one round trip.
    pub(super) async fn list_records(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        let shape = Shape {
            order: query.order(),
            scoped: query.scope_filter().is_some(),
            from_cursor: query.cursor().is_some(),
        };
        let sql = list_sql(&self.inner.schema, shape);
        let listed = |kind| query.kinds().is_empty() || query.kinds().contains(&kind);
        let [in_flight, in_doubt, completed] = STATES.map(|(kind, _)| listed(kind));
        // One more than the page: whether the list goes on past it.
        let take = query.page_limit() as i64 + 1;
        let (low, high) = status_range(query);
        let (older, newer) = (
            query.older_than_filter().map(age_millis),
            query.newer_than_filter().map(age_millis),
        );
        let scope = query.scope_filter().map(scope_column);
        let cursor = query.cursor().map(|cursor| {
            (
                claim_time(cursor.position()),
                cursor.key().as_bytes().to_vec(),
            )
        });
        let mut params: Vec<&(dyn ToSql + Sync)> = vec![
            &in_flight, &in_doubt, &completed, &take, &low, &high, &older, &newer,
        ];
        if let Some(scope) = &scope {
            params.push(scope);
        }
        if let Some((position, key)) = &cursor {
            params.push(position);
            params.push(key);
        }
        let rows = self
            .bounded(async {
                let client = self.inner.pool.get().await.map_err(from_pool)?;
                let statement = client.prepare_cached(&sql).await.map_err(from_pg)?;
                client.query(&statement, &params).await.map_err(from_pg)
            })
            .await?;
        let walked = rows.iter().map(walked).collect::<Result<Vec<_>, _>>()?;
        Ok(page_of(query, walked))
    }
}

/// The page a walk's rows make: the records that passed, and where the list goes on.
fn page_of(query: &ListQuery, walked: Vec<Walked>) -> ListPage {
    let budget_ended_at = walked
        .iter()
        .find(|row| row.last_of_budget)
        .map(|row| row.place);
    let mut records: Vec<ListedRecord> = walked.into_iter().filter_map(|row| row.listed).collect();
    sort_in_order(query, &mut records);
    if records.len() > query.page_limit() {
        // More passed than the page holds: it goes on after its last record.
        records.truncate(query.page_limit());
        let next = records.last().map(ListedRecord::cursor);
        return ListPage::new(records, next);
    }
    // Every record that passed up to the walk's end is here: the list goes on after the
    // last record looked at if the budget stopped the walk, and ends if the records did.
    ListPage::new(records, budget_ended_at)
}

fn walked(row: &Row) -> Result<Walked, StoreError> {
    let key = ledger_key(row.get(11))?;
    let position = position_of(row.get(12));
    let listed = if row.get::<_, bool>(13) {
        Some(ListedRecord::new(key, decode_inspect(row)?, position))
    } else {
        None
    };
    Ok(Walked {
        listed,
        place: ListCursor::new(position, key),
        last_of_budget: row.get(14),
    })
}

fn ledger_key(bytes: &[u8]) -> Result<LedgerKey, StoreError> {
    let bytes: [u8; 32] = bytes
        .try_into()
        .map_err(|_| StoreError::corrupt("stored key is not 32 bytes"))?;
    Ok(LedgerKey::from_bytes(bytes))
}

/// A record's position: when it was claimed, in microseconds since the epoch (PostgreSQL's
/// own precision, so a position names one instant of the column exactly).
fn position_of(created_at: SystemTime) -> u64 {
    created_at
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_micros()).unwrap_or(u64::MAX)
        })
}

/// The claim time a cursor's position names.
fn claim_time(position: u64) -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_micros(position)
}

/// The statuses a completed record must have: every one without a status filter.
fn status_range(query: &ListQuery) -> (i16, i16) {
    let clamp = |status: u16| i16::try_from(status).unwrap_or(i16::MAX);
    query
        .status_filter()
        .map_or((i16::MIN, i16::MAX), |(low, high)| {
            (clamp(low), clamp(high))
        })
}

fn age_millis(age: Duration) -> i64 {
    i64::try_from(age.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_are_claim_times_to_the_microsecond() {
        let position = 1_765_000_000_123_456;
        assert_eq!(position_of(claim_time(position)), position);
        assert_eq!(position_of(SystemTime::UNIX_EPOCH), 0);
    }

    #[test]
    fn a_statement_per_shape_numbers_its_parameters_in_order() {
        let sql = list_sql(
            "ledger",
            Shape {
                order: ListOrder::OldestFirst,
                scoped: true,
                from_cursor: true,
            },
        );
        assert!(sql.contains("t.scope = $9"), "{sql}");
        assert!(sql.contains("(t.created_at, t.key) > ($10, $11)"), "{sql}");
        let unscoped = list_sql(
            "ledger",
            Shape {
                order: ListOrder::NewestFirst,
                scoped: false,
                from_cursor: true,
            },
        );
        assert!(
            unscoped.contains("(t.created_at, t.key) < ($9, $10)"),
            "{unscoped}"
        );
        assert!(!unscoped.contains("t.scope ="), "{unscoped}");
    }
}
