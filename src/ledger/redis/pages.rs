//! Listing over the indexes: one `list.lua` call per bucket, and the merge of their pages
//! into one.
//!
//! Every bucket's page is ordered by place (claim time, then key), the order of the whole
//! list, and a cursor is a place: the same cursor starts every bucket's page. A bucket
//! whose page stops before its end (full, or having looked at all it may) has a
//! *frontier*, the place it stopped at: past it, that bucket's records are unseen. So the
//! merged page holds the records, in order, up to the earliest frontier, and goes on from
//! there (or from its last record, when it is full first). Each page moves past at least
//! one entry of the bucket whose frontier is earliest, so a list always ends. A bucket is
//! asked for its share of a page, with room to spare, not for a whole page: a page of 100
//! asks each of sixteen buckets for 21 records.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use super::codec::{decode_list, millis, u64_hex};
use super::connection::ScriptCall;
use super::layout::index_key;
use super::scripts::LIST;
use super::store::RedisStore;
use crate::ledger::{ListCursor, ListOrder, ListPage, ListQuery, Origin, RecordKind, StoreError};

/// The states a record is listed by, each with an index (a sorted set) of its own.
pub(super) const INDEXED_KINDS: [RecordKind; 3] = [
    RecordKind::InFlight,
    RecordKind::InDoubt,
    RecordKind::Completed,
];

/// Index entries one bucket's page may look at, per record it may hold...
const LOOKED_AT_PER_RECORD: usize = 10;
/// ...and at most (unless the page's limit is larger): a script blocks its Redis while it
/// runs, and a page passing over this many entries takes it a few milliseconds.
const MOST_LOOKED_AT: usize = 1000;

/// Beyond its even share of a page, the records a bucket is asked for: keys are uniform
/// hashes, so each bucket holds about an even share of any stretch of the list, give or
/// take a few. Asked for twice its share and this many more, the bucket that stops first
/// seldom stops before the page is full; when it does, the page comes back short, with its
/// cursor. Asking every bucket for a whole page would cost sixteen pages' work.
const SLACK_PER_BUCKET: usize = 8;

type BucketPage<'a> = Pin<Box<dyn Future<Output = Result<ListPage, StoreError>> + Send + 'a>>;

impl RedisStore {
    /// A page of `query`'s list: every bucket's page, asked for at once, merged.
    pub(super) async fn list_page(&self, query: &ListQuery) -> Result<ListPage, StoreError> {
        let buckets = self.layout.buckets();
        if buckets == 1 {
            return self.bucket_page(query, 0).await;
        }
        let pages: Vec<BucketPage<'_>> = (0..buckets)
            .map(|bucket| Box::pin(self.bucket_page(query, bucket)) as BucketPage<'_>)
            .collect();
        Ok(merge(query, all(pages).await?))
    }

    async fn bucket_page(&self, query: &ListQuery, bucket: usize) -> Result<ListPage, StoreError> {
        let reply = self.invoke(&self.list_call(query, bucket)).await?;
        decode_list(&reply)
    }

    /// The call of `list.lua` for `query` in `bucket`: the bucket's indexes of the kinds it
    /// lists, then its filters, order, limit (its share of the page) and cursor.
    fn list_call(&self, query: &ListQuery, bucket: usize) -> ScriptCall {
        let base = self.layout.base(bucket);
        let buckets = self.layout.buckets();
        let kinds: &[RecordKind] = if query.kinds().is_empty() {
            &INDEXED_KINDS
        } else {
            query.kinds()
        };
        let indexes: Vec<String> = kinds.iter().map(|kind| index_key(&base, *kind)).collect();
        let mut call = ScriptCall::with_keys(&LIST, &indexes);
        let limit = if buckets == 1 {
            query.page_limit()
        } else {
            query
                .page_limit()
                .min(2 * query.page_limit().div_ceil(buckets) + SLACK_PER_BUCKET)
        };
        let budget = (limit * LOOKED_AT_PER_RECORD)
            .min(MOST_LOOKED_AT)
            .max(limit);
        let cursor = query.cursor();
        let (older, newer) = (query.older_than_filter(), query.newer_than_filter());
        let optional_ms = |age: Option<Duration>| age.map(|age| millis(age, 0).to_string());
        let (low, high) = query.status_filter().unzip();
        call.arg(&base)
            .arg(match query.order() {
                ListOrder::OldestFirst => "oldest",
                _ => "newest",
            })
            .arg(limit)
            .arg(budget)
            .arg(cursor.map(|c| c.position().to_string()).unwrap_or_default())
            .arg(cursor.map(|c| c.key().to_hex()).unwrap_or_default())
            .arg(optional_ms(older).unwrap_or_default())
            .arg(optional_ms(newer).unwrap_or_default())
            .arg(low.map(|s| s.to_string()).unwrap_or_default())
            .arg(high.map(|s| s.to_string()).unwrap_or_default())
            .arg(query.scope_filter().map(u64_hex).unwrap_or_default())
            .arg(origin_filter(
                query.target_filter().map(Origin::kept_target).as_deref(),
            ))
            .arg(origin_filter(query.tool_filter().map(Origin::kept_tool)))
            .arg(origin_filter(query.task_filter()));
        call
    }
}

/// An origin filter as `list.lua` reads it: `=` and the value, `` for none.
fn origin_filter(value: Option<&str>) -> String {
    value.map(|value| format!("={value}")).unwrap_or_default()
}

/// Every future's output, in order, driven together (the buckets live on several nodes: a
/// page waits for the slowest, not for their sum); the first error ends the wait.
async fn all(mut pending: Vec<BucketPage<'_>>) -> Result<Vec<ListPage>, StoreError> {
    let mut done: Vec<Option<ListPage>> = pending.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut waiting = false;
        for (future, out) in pending.iter_mut().zip(done.iter_mut()) {
            if out.is_some() {
                continue;
            }
            match future.as_mut().poll(cx) {
                Poll::Ready(Ok(value)) => *out = Some(value),
                Poll::Ready(Err(err)) => return Poll::Ready(Err(err)),
                Poll::Pending => waiting = true,
            }
        }
        if waiting {
            Poll::Pending
        } else {
            Poll::Ready(Ok(()))
        }
    })
    .await?;
    Ok(done.into_iter().flatten().collect())
}

/// One page of `query` from the pages of every bucket (see the module docs).
fn merge(query: &ListQuery, pages: Vec<ListPage>) -> ListPage {
    let frontier = pages.iter().filter_map(|page| page.next).reduce(|a, b| {
        if comes_before(query, b, a) {
            b
        } else {
            a
        }
    });
    let mut records: Vec<_> = pages
        .into_iter()
        .flat_map(|page| page.records)
        .filter(|record| frontier.is_none_or(|edge| !comes_before(query, edge, record.cursor())))
        .collect();
    crate::ledger::list::sort_in_order(query, &mut records);
    if records.len() > query.page_limit() {
        records.truncate(query.page_limit());
        let next = records.last().map(|record| record.cursor());
        return ListPage::new(records, next);
    }
    ListPage::new(records, frontier)
}

/// Whether place `a` comes before place `b` in `query`'s order.
fn comes_before(query: &ListQuery, a: ListCursor, b: ListCursor) -> bool {
    let (a, b) = ((a.position(), a.key()), (b.position(), b.key()));
    match query.order() {
        ListOrder::NewestFirst => a > b,
        ListOrder::OldestFirst => a < b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::ledger::{Generation, LedgerKey, ListedRecord, RecordState, RecordView};

    fn record(position: u64, key: u8) -> ListedRecord {
        let view = RecordView::new(
            RecordState::InDoubt,
            Fingerprint::from_bytes([0; 32]),
            1,
            Generation::from_u64(1),
            Duration::ZERO,
            Duration::from_secs(60),
        );
        ListedRecord::new(LedgerKey::from_bytes([key; 32]), view, position)
    }

    /// A model of a list over buckets: records at random places spread over buckets, each
    /// bucket's page cut at a random budget; following the merged cursors must list every
    /// record once, in order.
    #[test]
    fn merged_pages_list_every_record_once_in_order() {
        for seed in 0..300 {
            let mut rng = fastrand::Rng::with_seed(seed);
            let order_newest = rng.bool();
            let buckets = rng.usize(1..6);
            let limit = rng.usize(1..8);
            let all: Vec<(usize, ListedRecord)> = (0..rng.usize(0..60))
                .map(|i| (rng.usize(..buckets), record(rng.u64(0..20), i as u8)))
                .collect();
            let mut query = ListQuery::new().limit(limit);
            if !order_newest {
                query = query.oldest_first();
            }
            let mut listed = Vec::new();
            for _ in 0..1000 {
                let pages = (0..buckets)
                    .map(|bucket| {
                        let mut mine: Vec<ListedRecord> = all
                            .iter()
                            .filter(|(b, r)| {
                                *b == bucket && query.is_after_cursor(r.position, r.key)
                            })
                            .map(|(_, r)| r.clone())
                            .collect();
                        crate::ledger::list::sort_in_order(&query, &mut mine);
                        // A bucket stops when full, or early, as a script out of budget does.
                        let stop = rng.usize(1..=limit).min(mine.len());
                        let next = (mine.len() > stop).then(|| mine[stop - 1].cursor());
                        mine.truncate(stop);
                        ListPage::new(mine, next)
                    })
                    .collect();
                let page = merge(&query, pages);
                assert!(page.records.len() <= limit);
                listed.extend(page.records);
                match page.next {
                    Some(cursor) => query = query.after(cursor),
                    None => break,
                }
            }
            let mut expected: Vec<ListedRecord> = all.into_iter().map(|(_, r)| r).collect();
            crate::ledger::list::sort_in_order(&query, &mut expected);
            assert_eq!(
                listed.iter().map(|r| r.cursor()).collect::<Vec<_>>(),
                expected.iter().map(|r| r.cursor()).collect::<Vec<_>>(),
                "seed {seed}"
            );
        }
    }
}
