//! Listing records (schema version 4; origins 5): a page is one statement per state listed, each
//! walking that state's records in the order of their claims from the query's cursor, on
//! the index of the states (`records_by_state`) or of the scope and states
//! (`records_by_scope`); the walks go together, in one round trip, and their answers are
//! merged here.
//!
//! A walk reads the index entries of the records it lists and stops. What the index cannot
//! tell (a completed record's status, a record past its retention not yet swept) is
//! filtered as the walk goes, and a walk stops after [`SCAN_BUDGET`] records whatever it
//! found: a page's cost is bounded, and a page cut short by the budget hands out the
//! cursor after the last record looked at, so the next page goes on from there.
//!
//! One statement per state rather than one `UNION ALL` of the three: PostgreSQL (15) plans
//! such a union as an append of the three ranges and a sort of all of them, never as a
//! merge of the ordered index scans, so one page would read every record.

use std::cmp::Ordering;
use std::time::{Duration, SystemTime};

use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use super::codec::{decode_inspect, scope_column};
use super::errors::{from_pg, from_pool};
use super::PostgresStore;
use crate::ledger::list::sort_in_order;
use crate::ledger::{
    LedgerKey, ListCursor, ListOrder, ListPage, ListQuery, ListedRecord, Origin, RecordKind,
    StoreError,
};

/// The most records one state's walk looks at for a page, listed or not: a page of a list
/// whose filters few records pass costs this much at most per state, and may come back
/// short (with a cursor).
// Five of the largest pages: the index's own filters (state, scope, age, cursor) carry
// almost every page, and the budget only meets a status filter over many records of other
// statuses, or a backlog of expired records the sweep has not deleted yet. At 5,000 records
// such a walk takes about 15-30 ms on a million records (`benches/postgres_list_cost.rs`).
const SCAN_BUDGET: i64 = 5 * crate::ledger::MAX_PAGE as i64;

/// The states a list may walk, each its own range of the index.
const STATES: [(RecordKind, &str); 3] = [
    (RecordKind::InFlight, "in_flight"),
    (RecordKind::InDoubt, "in_doubt"),
    (RecordKind::Completed, "completed"),
];

/// What a statement's text depends on (the values travel as parameters).
#[derive(Clone, Copy)]
struct Shape {
    order: ListOrder,
    scoped: bool,
    from_cursor: bool,
}

/// The statement walking one state for one shape of query. Parameters: `$1` the state,
/// `$2` how many records to answer, `$3` and `$4` the statuses a completed record must
/// have, `$5` and `$6` the least and greatest age in milliseconds (NULL: no bound), `$7`
/// the origin's target prefix, `$8` its tool and `$9` its task (NULL: any; schema version
/// 5), then the scope, then the cursor's claim time and key.
fn list_sql(schema: &str, shape: Shape) -> String {
    let (direction, after) = match shape.order {
        ListOrder::NewestFirst => ("DESC", "<"),
        ListOrder::OldestFirst => ("ASC", ">"),
    };
    let mut next_param = 10;
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
    // The walk: the state's range in claim order, cut at the budget, each record numbered
    // as it comes. The page: the records that pass, and the budget's last one (which says
    // where a page cut short goes on), up to `$2`. Every step streams in the walk's order
    // (no sort), so the walk stops as soon as the page is full. The view is `inspect_op`'s.
    format!(
        "SELECT w.state, w.fingerprint, w.attempts, \
                greatest(0, floor(extract(epoch FROM statement_timestamp() - w.created_at) * 1000))::bigint, \
                greatest(0, floor(extract(epoch FROM coalesce(w.lease_until, statement_timestamp()) - statement_timestamp()) * 1000))::bigint, \
                greatest(0, floor(extract(epoch FROM w.retain_until - statement_timestamp()) * 1000))::bigint, \
                w.sent, w.status, {schema}.generation_of(w.generation, w.created_at), \
                greatest(0, floor(extract(epoch FROM statement_timestamp() - coalesce(w.touched_at, w.created_at)) * 1000))::bigint, \
                w.scope, w.key, w.created_at, w.passes, w.seen = {SCAN_BUDGET}, \
                w.origin_face, w.origin_target, w.origin_task, w.origin_step \
           FROM (SELECT s.*, row_number() OVER (ORDER BY s.created_at {direction}, s.key {direction}) AS seen \
                   FROM (SELECT t.key, t.created_at, t.state, t.fingerprint, t.attempts, \
                                t.lease_until, t.retain_until, t.sent, t.status, t.generation, \
                                t.touched_at, t.scope, t.origin_face, t.origin_target, \
                                t.origin_task, t.origin_step, \
                                (t.retain_until > statement_timestamp() \
                                 AND (t.state <> 'completed' OR t.status BETWEEN $3 AND $4) \
                                 AND ($7::text IS NULL \
                                      OR coalesce(left(t.origin_target, length($7::text)) = $7::text, false)) \
                                 AND ($8::text IS NULL \
                                      OR coalesce(t.origin_face = 'tool' AND t.origin_target = $8::text, false)) \
                                 AND ($9::text IS NULL OR coalesce(t.origin_task = $9::text, false))) AS passes \
                           FROM {schema}.records t \
                          WHERE t.state = $1 {scope} \
                            AND t.created_at <= coalesce(statement_timestamp() - $5::bigint * interval '1 millisecond', 'infinity') \
                            AND t.created_at > coalesce(statement_timestamp() - $6::bigint * interval '1 millisecond', '-infinity') \
                            {cursor} \
                          ORDER BY t.created_at {direction}, t.key {direction} \
                          LIMIT {SCAN_BUDGET}) s) w \
          WHERE w.passes OR w.seen = {SCAN_BUDGET} \
          ORDER BY w.created_at {direction}, w.key {direction} \
          LIMIT $2"
    )
}

/// A row of a walk: the record (when it passes the filters), its place, and whether the
/// walk's budget ended on it.
struct Walked {
    listed: Option<ListedRecord>,
    place: ListCursor,
    last_of_budget: bool,
}

impl PostgresStore {
    /// [`list`](crate::ledger::IdempotencyStore::list): a statement prepared, then run for
    /// each state listed, the runs sent together on one connection: two round trips.
    pub(super) async fn list_records(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        let shape = Shape {
            order: query.order(),
            scoped: query.scope_filter().is_some(),
            from_cursor: query.cursor().is_some(),
        };
        let sql = list_sql(&self.inner.schema, shape);
        let [in_flight, in_doubt, completed] = STATES.map(|(kind, state)| {
            (query.kinds().is_empty() || query.kinds().contains(&kind)).then_some(state)
        });
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
        // As an origin keeps them: a longer text is matched on its kept part.
        let target = query.target_filter().map(Origin::kept_target);
        let tool = query.tool_filter().map(Origin::kept_tool);
        let task = query.task_filter();
        let mut rest: Vec<&(dyn ToSql + Sync)> =
            vec![&take, &low, &high, &older, &newer, &target, &tool, &task];
        if let Some(scope) = &scope {
            rest.push(scope);
        }
        if let Some((position, key)) = &cursor {
            rest.push(position);
            rest.push(key);
        }
        let walks = self
            .bounded(async {
                let client = self.inner.pool.get().await.map_err(from_pool)?;
                // Prepared afresh for each page, never cached: PostgreSQL then plans each
                // walk for its own values (a statement run fewer than five times is never
                // given a generic plan), so a scope holding many records is walked in index
                // order and one holding few is fetched and sorted, as its statistics say.
                // A cached statement would soon run one plan for every scope, and a plan that
                // sorts a small scope's records would sort all of a large one's. One more
                // round trip, for an operator's page.
                let statement = client.prepare(&sql).await.map_err(from_pg)?;
                let walk = |state: Option<&'static str>| {
                    let (client, statement, rest) = (&client, &statement, &rest);
                    async move {
                        let Some(state) = state else {
                            return Ok(Vec::new());
                        };
                        let mut params: Vec<&(dyn ToSql + Sync)> = vec![&state];
                        params.extend(rest.iter().copied());
                        client.query(statement, &params).await
                    }
                };
                // tokio-postgres pipelines the queries of one connection polled together:
                // they travel in one round trip, and each answers in turn.
                let (in_flight, in_doubt, completed) =
                    tokio::join!(walk(in_flight), walk(in_doubt), walk(completed));
                Ok::<_, StoreError>([
                    in_flight.map_err(from_pg)?,
                    in_doubt.map_err(from_pg)?,
                    completed.map_err(from_pg)?,
                ])
            })
            .await?;
        let walks = walks
            .iter()
            .map(|rows| rows.iter().map(walked).collect::<Result<Vec<_>, _>>())
            .collect::<Result<Vec<_>, _>>()?;
        Ok(page_of(query, walks))
    }
}

/// The page the walks of the states make. Each walk is complete up to where it stopped:
/// its last record if it filled the page, the last record it looked at if the budget
/// stopped it, nowhere if the state's records ran out. The page holds what every walk saw
/// up to the first of those stops in the list's order (past it, a walk that stopped may
/// have records it did not look at), and goes on from there.
fn page_of(query: &ListQuery, walks: impl IntoIterator<Item = Vec<Walked>>) -> ListPage {
    let take = query.page_limit() + 1;
    let mut stops = Vec::new();
    let mut records = Vec::new();
    for walk in walks {
        let budget_ended_at = walk
            .iter()
            .find(|row| row.last_of_budget)
            .map(|row| row.place);
        let listed: Vec<ListedRecord> = walk.into_iter().filter_map(|row| row.listed).collect();
        if listed.len() >= take {
            stops.extend(listed.last().map(ListedRecord::cursor));
        } else if let Some(place) = budget_ended_at {
            stops.push(place);
        }
        records.extend(listed);
    }
    let stop = stops.into_iter().min_by(|a, b| in_list_order(query, a, b));
    if let Some(stop) = &stop {
        records.retain(|record| in_list_order(query, &record.cursor(), stop) != Ordering::Greater);
    }
    sort_in_order(query, &mut records);
    if records.len() > query.page_limit() {
        // More passed than the page holds: it goes on after its last record.
        records.truncate(query.page_limit());
        let next = records.last().map(ListedRecord::cursor);
        return ListPage::new(records, next);
    }
    // Every record up to the first stop is here: the list goes on after that stop, or
    // ends if every walk ran out of records.
    ListPage::new(records, stop)
}

/// How two places compare in the list's order: `Less` comes first.
fn in_list_order(query: &ListQuery, a: &ListCursor, b: &ListCursor) -> Ordering {
    let (a, b) = ((a.position(), a.key()), (b.position(), b.key()));
    match query.order() {
        ListOrder::OldestFirst => a.cmp(&b),
        ListOrder::NewestFirst => b.cmp(&a),
    }
}

fn walked(row: &Row) -> Result<Walked, StoreError> {
    let key = ledger_key(row.get(11))?;
    let position = position_of(row.get(12));
    let listed = if row.get::<_, bool>(13) {
        Some(ListedRecord::new(key, decode_inspect(row, 15)?, position))
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
        assert!(sql.contains("$7::text IS NULL"), "the target prefix: {sql}");
        assert!(sql.contains("$9::text IS NULL"), "the task: {sql}");
        assert!(sql.contains("t.scope = $10"), "{sql}");
        assert!(sql.contains("(t.created_at, t.key) > ($11, $12)"), "{sql}");
        let unscoped = list_sql(
            "ledger",
            Shape {
                order: ListOrder::NewestFirst,
                scoped: false,
                from_cursor: true,
            },
        );
        assert!(
            unscoped.contains("(t.created_at, t.key) < ($10, $11)"),
            "{unscoped}"
        );
        assert!(!unscoped.contains("t.scope ="), "{unscoped}");
    }

    fn fingerprint() -> crate::fingerprint::Fingerprint {
        crate::fingerprint::Fingerprint::of(&http::Method::POST, "/charges", b"{}")
    }

    /// A row of a walk at `position`: listed if `passes`, the budget's last if `last`.
    fn row(position: u64, passes: bool, last: bool) -> Walked {
        let key = LedgerKey::from_bytes([position as u8; 32]);
        let view = crate::ledger::RecordView::new(
            crate::ledger::RecordState::InDoubt,
            fingerprint(),
            1,
            crate::ledger::Generation::from_u64(position),
            Duration::ZERO,
            Duration::from_secs(60),
        );
        Walked {
            listed: passes.then(|| ListedRecord::new(key, view, position)),
            place: ListCursor::new(position, key),
            last_of_budget: last,
        }
    }

    fn positions(page: &ListPage) -> Vec<u64> {
        page.records.iter().map(|record| record.position).collect()
    }

    #[test]
    fn a_walk_the_budget_stopped_stops_the_page_where_it_stopped() {
        let query = ListQuery::new().limit(10);
        // Newest first: one state's walk looked at 90..=50 and found 80, the budget ending
        // at 50; another's found 70, 40 and 30 and ran out.
        let stopped = vec![row(80, true, false), row(50, false, true)];
        let ran_out = vec![
            row(70, true, false),
            row(40, true, false),
            row(30, true, false),
        ];
        let page = page_of(&query, [stopped, ran_out]);
        assert_eq!(positions(&page), [80, 70], "nothing past the first stop");
        assert_eq!(page.next.map(|next| next.position()), Some(50));

        let page = page_of(
            &query,
            [vec![row(80, true, false)], vec![row(70, true, false)]],
        );
        assert_eq!(positions(&page), [80, 70]);
        assert_eq!(page.next, None, "every walk ran out: the list ends");
    }

    #[test]
    fn a_full_walk_stops_the_page_at_its_last_record() {
        let query = ListQuery::new().limit(2).oldest_first();
        let full = vec![
            row(1, true, false),
            row(5, true, false),
            row(9, true, false),
        ];
        let other = vec![row(2, true, false), row(3, true, false)];
        let page = page_of(&query, [full, other]);
        assert_eq!(positions(&page), [1, 2]);
        assert_eq!(page.next.map(|next| next.position()), Some(2));
    }
}
