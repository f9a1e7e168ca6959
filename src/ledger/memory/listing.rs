//! `list`: a page of records, looked for shard by shard in chunks short enough that a claim
//! never waits long behind a listing, keeping only the page's best candidates.
//!
//! A shard's records are looked at under its lock, one cache miss for each record's box:
//! read in one go, a shard of many records would hold the lock for milliseconds, and every
//! claim on the shard's keys would wait. So a shard of more than [`CHUNK_RECORDS`] (a store
//! of over a million records) is read a chunk at a time, the lock released in between: a
//! chunk is the records whose keys fall in one range of key prefixes. The range is the
//! resume point, and it stays right however the map changes between chunks (it grows,
//! rehashes, loses records): a record there throughout has one key, in one range, so it is
//! looked at exactly once. A record claimed or removed while the list is made may be in it
//! or not, as it would be between two shards.
//!
//! Most records cannot make the page, and cost only that cache miss: a record whose
//! generation falls outside the window between the cursor and the worst candidate kept is
//! passed over on it alone, before its retention, kind and scope are read (with no key
//! copied, nothing compared but two numbers), and a view is built only for a record that
//! passes them all and may still make the page: some 20 instructions a record, the same
//! for a first page and the pages after a cursor.

use std::ops::RangeInclusive;

use tokio::time::Instant;

use super::record::{Record, Stamp};
use super::shared::{lock, Shard};
use super::store::MemoryStore;
use super::sync::Mutex;
use crate::ledger::list::sort_in_order;
use crate::ledger::{LedgerKey, ListOrder, ListPage, ListQuery, ListedRecord, RecordKind};

/// The most records a chunk holds, on average. Each costs a cache miss for its box, and
/// each chunk a walk over its whole shard's slots (to pick out its keys): at a million
/// records (some 15,600 a shard, one chunk each) a page takes 20–35 ms of CPU, any page
/// (`benches/listing.rs`), a shard 0.3–0.45 ms under its lock at the median and 1.2 ms at
/// the most, in CPU time (`chunk_holds_of_a_listing_at_a_million_records`). The walk over
/// the slots grows with the shard: at 3.7 million records (four chunks a shard) a chunk
/// took 1.5 ms at the median, 4 ms at the most. With the walk of the time (then ~40 ms a
/// page), chunks of 8,192 took ~55 ms, of 4,096 ~80 ms.
pub(super) const CHUNK_RECORDS: usize = 16384;

/// Key prefixes (a key's second and third bytes; its first picks the shard) split into
/// chunks.
const PREFIXES: usize = 1 << 16;

impl MemoryStore {
    /// A page of [`list`](crate::ledger::IdempotencyStore::list): every shard looked
    /// through, a chunk at a time. A record's place is its generation, the store's count of
    /// claims when it was made.
    pub(super) fn list_now(&self, query: &ListQuery) -> ListPage {
        let now = self.stamp(Instant::now());
        let mut best = Best::new(query);
        for shard in self.inner.shards.iter() {
            look_through(shard, &mut best, now);
        }
        best.into_page()
    }
}

/// Offer every record of `shard` to `best`, a chunk of key prefixes at a time, each under
/// the lock on its own.
fn look_through(shard: &Mutex<Shard>, best: &mut Best<'_>, now: Stamp) {
    // Counted once: a shard that grows meanwhile only makes its chunks larger.
    let chunks = lock(shard).records.len().div_ceil(CHUNK_RECORDS).max(1);
    for chunk in 0..chunks {
        let prefixes = chunk * PREFIXES / chunks..(chunk + 1) * PREFIXES / chunks;
        let shard = lock(shard);
        #[cfg(test)]
        let held = holds::Held::start();
        for (key, record) in &shard.records {
            // The key is in the map's slot, the record behind its box: the chunk's range
            // first, then the record's place, one read of its first line.
            if (chunks == 1 || prefixes.contains(&prefix(key)))
                && best.window.contains(&record.generation)
            {
                best.offer(key, record, now);
            }
        }
        #[cfg(test)]
        held.end(chunks);
    }
}

/// Which chunk a key falls in: keys are uniform hashes, so chunks are even.
fn prefix(key: &LedgerKey) -> usize {
    let bytes = key.as_bytes();
    usize::from(u16::from_be_bytes([bytes[1], bytes[2]]))
}

/// The candidates for a page so far: at most twice the page (and one, to know whether
/// another page follows) between cuts to the best, so a list costs memory for its page, not
/// for every record that passes its filters.
struct Best<'q> {
    query: &'q ListQuery,
    /// The kinds listed, a bit each (`1 << kind`): every bit when the query names none.
    kinds: u8,
    kept: Vec<ListedRecord>,
    /// Once the candidates were cut: the worst place kept. A record not before it in the
    /// query's order can no longer make the page, and is passed over without a look at its
    /// state.
    bar: Option<(u64, LedgerKey)>,
    /// The generations that may still make the page, both ends included: between the
    /// cursor's and the bar's. Most records fall outside, and are passed over on their
    /// generation alone; the ends themselves are judged with their keys by
    /// [`offer`](Self::offer).
    window: RangeInclusive<u64>,
}

impl<'q> Best<'q> {
    fn new(query: &'q ListQuery) -> Self {
        let kinds = match query.kinds() {
            [] => u8::MAX,
            kinds => kinds.iter().fold(0, |bits, kind| bits | kind_bit(*kind)),
        };
        let mut best = Self {
            query,
            kinds,
            kept: Vec::with_capacity(2 * Self::wanted(query)),
            bar: None,
            window: 0..=u64::MAX,
        };
        best.narrow();
        best
    }

    /// The page and one more: whether the list goes on.
    fn wanted(query: &ListQuery) -> usize {
        query.page_limit() + 1
    }

    /// Keep `record` of `key` if it passes the query at `now` and may make the page.
    fn offer(&mut self, key: &LedgerKey, record: &Record, now: Stamp) {
        if record.retain_until <= now
            || self.kinds & kind_bit(record.kind()) == 0
            || self
                .query
                .scope_filter()
                .is_some_and(|scope| scope != record.scope)
            || !self.query.matches_origin(record.origin.as_deref())
            || !self.query.is_after_cursor(record.generation, *key)
            || self
                .bar
                .is_some_and(|bar| !self.comes_before((record.generation, *key), bar))
        {
            return;
        }
        let view = record.view(now);
        if !self.query.matches(&view) {
            return;
        }
        self.kept
            .push(ListedRecord::new(*key, view, record.generation));
        if self.kept.len() >= 2 * Self::wanted(self.query) {
            self.cut();
        }
    }

    /// Whether `place` comes before `other` in the query's order.
    fn comes_before(&self, place: (u64, LedgerKey), other: (u64, LedgerKey)) -> bool {
        match self.query.order() {
            ListOrder::NewestFirst => place > other,
            ListOrder::OldestFirst => place < other,
        }
    }

    /// Keep the best candidates only, and raise the bar to the worst of them.
    fn cut(&mut self) {
        sort_in_order(self.query, &mut self.kept);
        self.kept.truncate(Self::wanted(self.query));
        self.bar = self.kept.last().map(|record| (record.position, record.key));
        self.narrow();
    }

    /// The window of generations between the cursor and the bar.
    fn narrow(&mut self) {
        let cursor = self.query.cursor().map(|cursor| cursor.position());
        let bar = self.bar.map(|(position, _)| position);
        self.window = match self.query.order() {
            ListOrder::NewestFirst => bar.unwrap_or(0)..=cursor.unwrap_or(u64::MAX),
            ListOrder::OldestFirst => cursor.unwrap_or(0)..=bar.unwrap_or(u64::MAX),
        };
    }

    fn into_page(self) -> ListPage {
        ListPage::from_candidates(self.query, self.kept)
    }
}

/// `kind`'s bit in [`Best::kinds`].
fn kind_bit(kind: RecordKind) -> u8 {
    match kind {
        RecordKind::InFlight => 1,
        RecordKind::InDoubt => 2,
        RecordKind::Completed => 4,
    }
}

/// Test builds time each chunk under its shard's lock, on a thread that asks
/// ([`holds::recorded`]): how long a claim on the shard may wait behind a listing.
#[cfg(test)]
pub(super) mod holds {
    use std::cell::RefCell;
    use std::time::{Duration, Instant};

    /// One chunk, looked through under its shard's lock.
    #[derive(Clone, Copy, Debug)]
    pub(crate) struct Hold {
        /// The time the lock was held, by the clock on the wall.
        pub(crate) wall: Duration,
        /// The thread's CPU time meanwhile: the wall time less any preemption.
        pub(crate) cpu: Duration,
        /// The shard's chunks.
        pub(crate) chunks: usize,
    }

    thread_local! {
        static HOLDS: RefCell<Option<Vec<Hold>>> = const { RefCell::new(None) };
    }

    /// The chunks `list` looks through on this thread, each timed.
    pub(crate) fn recorded(list: impl FnOnce()) -> Vec<Hold> {
        HOLDS.with(|holds| *holds.borrow_mut() = Some(Vec::new()));
        list();
        HOLDS.with(|holds| holds.borrow_mut().take().unwrap_or_default())
    }

    fn cpu_now() -> Duration {
        let time = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
        Duration::new(time.tv_sec as u64, time.tv_nsec as u32)
    }

    /// A chunk's timing, started once its lock is held: nothing unless recording.
    pub(super) struct Held(Option<(Instant, Duration)>);

    impl Held {
        pub(super) fn start() -> Self {
            let recording = HOLDS.with(|holds| holds.borrow().is_some());
            Self(recording.then(|| (Instant::now(), cpu_now())))
        }

        /// The chunk is looked through: its lock is released next.
        pub(super) fn end(self, chunks: usize) {
            if let Some((wall, cpu)) = self.0 {
                let hold = Hold {
                    wall: wall.elapsed(),
                    cpu: cpu_now().saturating_sub(cpu),
                    chunks,
                };
                HOLDS.with(|holds| holds.borrow_mut().as_mut().map(|holds| holds.push(hold)));
            }
        }
    }
}
