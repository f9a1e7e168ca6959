//! Listing records: what an operator asks a store for ([`ListQuery`]) and what it answers
//! ([`ListPage`]), a page at a time.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use super::{LedgerKey, RecordKind, RecordState, RecordView};

/// The most records one page holds: a larger [`ListQuery::limit`] is cut to it.
pub const MAX_PAGE: usize = 1000;

/// The records a page holds when the query does not say.
pub const DEFAULT_PAGE: usize = 100;

/// In which order a list walks the records: by when each was first claimed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ListOrder {
    /// The latest claimed first (the default): what just went wrong.
    #[default]
    NewestFirst,
    /// The earliest claimed first: what has waited longest.
    OldestFirst,
}

/// Which records [`IdempotencyStore::list`](super::IdempotencyStore::list) answers, in
/// which order, and from where: every filter narrows the list, none set lists every
/// record, newest first, [`DEFAULT_PAGE`] at a time.
///
/// Filters a store answers from the record alone ([`matches`](Self::matches) applies them
/// all), so a store of your own filters as the built-in ones do: by state and status, age,
/// scope, and what a record is of (its [`Origin`](super::Origin): a target's prefix, a
/// tool, a task; a record of no known origin passes none of these).
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::ledger::{ListOrder, ListQuery, RecordKind};
///
/// // The operations in doubt for more than five minutes in tenant-a's scope, oldest first.
/// let query = ListQuery::new()
///     .kind(RecordKind::InDoubt)
///     .older_than(Duration::from_secs(300))
///     .scope("tenant-a")
///     .oldest_first()
///     .limit(50);
/// assert_eq!(query.order(), ListOrder::OldestFirst);
/// assert_eq!(query.page_limit(), 50);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ListQuery {
    kinds: Vec<RecordKind>,
    statuses: Option<(u16, u16)>,
    older_than: Option<Duration>,
    newer_than: Option<Duration>,
    scope: Option<u64>,
    /// The origin filters: kept out of line, so a query without them (the common one) is
    /// no larger.
    origin: Option<Box<OriginFilter>>,
    order: ListOrder,
    limit: usize,
    after: Option<ListCursor>,
}

impl Default for ListQuery {
    fn default() -> Self {
        Self::new()
    }
}

impl ListQuery {
    /// Every record, newest first, [`DEFAULT_PAGE`] at a time.
    pub fn new() -> Self {
        Self {
            kinds: Vec::new(),
            statuses: None,
            older_than: None,
            newer_than: None,
            scope: None,
            origin: None,
            order: ListOrder::NewestFirst,
            limit: DEFAULT_PAGE,
            after: None,
        }
    }

    /// Records in state `kind` too: each call adds one to the kinds listed; none listed
    /// means every kind.
    ///
    /// ```
    /// use tower_idempotency::ledger::{ListQuery, RecordKind};
    ///
    /// let query = ListQuery::new().kind(RecordKind::InDoubt).kind(RecordKind::InFlight);
    /// assert_eq!(query.kinds(), &[RecordKind::InDoubt, RecordKind::InFlight]);
    /// ```
    pub fn kind(mut self, kind: RecordKind) -> Self {
        if !self.kinds.contains(&kind) {
            self.kinds.push(kind);
        }
        self
    }

    /// Completed records whose recorded status is between `low` and `high` (both
    /// included): lists completed records too, as [`kind`](Self::kind) does, and only
    /// those of these statuses.
    ///
    /// ```
    /// use http::StatusCode;
    /// use tower_idempotency::ledger::{ListQuery, RecordKind};
    ///
    /// // Every client error recorded.
    /// let query = ListQuery::new().completed_with(StatusCode::BAD_REQUEST, StatusCode::from_u16(499).unwrap());
    /// assert_eq!(query.kinds(), &[RecordKind::Completed]);
    /// ```
    pub fn completed_with(mut self, low: http::StatusCode, high: http::StatusCode) -> Self {
        self.statuses = Some((low.as_u16(), high.as_u16()));
        self.kind(RecordKind::Completed)
    }

    /// Records first claimed at least `age` ago.
    pub fn older_than(mut self, age: Duration) -> Self {
        self.older_than = Some(age);
        self
    }

    /// Records first claimed less than `age` ago.
    pub fn newer_than(mut self, age: Duration) -> Self {
        self.newer_than = Some(age);
        self
    }

    /// Records of `scope` (a tenant or principal, as the layer was given it; `""` for the
    /// records of no scope), told apart by its digest ([`scope_id`](super::scope_id)).
    ///
    /// ```
    /// use tower_idempotency::ledger::{scope_id, ListQuery};
    ///
    /// assert_eq!(ListQuery::new().scope("tenant-a").scope_filter(), Some(scope_id("tenant-a")));
    /// ```
    pub fn scope(self, scope: &str) -> Self {
        self.scope_id(super::scope_id(scope))
    }

    /// [`scope`](Self::scope) by the scope's digest, as [`RecordView::scope`] shows it.
    pub fn scope_id(mut self, id: u64) -> Self {
        self.scope = Some(id);
        self
    }

    /// Records whose [origin](super::Origin)'s target starts with `prefix` (e.g.
    /// `POST https://payments.example/`), as kept (see [`Origin::target_starts_with`]).
    /// A record of no known origin is not listed.
    ///
    /// [`Origin::target_starts_with`]: super::Origin::target_starts_with
    ///
    /// ```
    /// use tower_idempotency::ledger::ListQuery;
    ///
    /// let query = ListQuery::new().target("POST https://payments.example/");
    /// assert_eq!(query.target_filter(), Some("POST https://payments.example/"));
    /// ```
    pub fn target(mut self, prefix: &str) -> Self {
        self.origin_filter().target = Some(prefix.to_owned());
        self
    }

    /// Records of calls of the tool `name`, by the tool face.
    ///
    /// ```
    /// use tower_idempotency::ledger::ListQuery;
    ///
    /// assert_eq!(ListQuery::new().tool("refund").tool_filter(), Some("refund"));
    /// ```
    pub fn tool(mut self, name: &str) -> Self {
        self.origin_filter().tool = Some(name.to_owned());
        self
    }

    /// Records of the operations of task `task_id` (its [`OperationId`](crate::OperationId)'s).
    ///
    /// ```
    /// use tower_idempotency::ledger::ListQuery;
    ///
    /// assert_eq!(ListQuery::new().task("task-42").task_filter(), Some("task-42"));
    /// ```
    pub fn task(mut self, task_id: &str) -> Self {
        self.origin_filter().task = Some(task_id.to_owned());
        self
    }

    fn origin_filter(&mut self) -> &mut OriginFilter {
        self.origin.get_or_insert_with(Default::default)
    }

    /// The target prefix records must have, if the query names one.
    pub fn target_filter(&self) -> Option<&str> {
        self.origin.as_ref()?.target.as_deref()
    }

    /// The tool records must be calls of, if the query names one.
    pub fn tool_filter(&self) -> Option<&str> {
        self.origin.as_ref()?.tool.as_deref()
    }

    /// The task records must be of, if the query names one.
    pub fn task_filter(&self) -> Option<&str> {
        self.origin.as_ref()?.task.as_deref()
    }

    /// The earliest claimed first.
    pub fn oldest_first(mut self) -> Self {
        self.order = ListOrder::OldestFirst;
        self
    }

    /// The latest claimed first (the default).
    pub fn newest_first(mut self) -> Self {
        self.order = ListOrder::NewestFirst;
        self
    }

    /// At most `limit` records a page, between 1 and [`MAX_PAGE`] (a value outside is
    /// brought to the nearer bound).
    ///
    /// ```
    /// use tower_idempotency::ledger::{ListQuery, MAX_PAGE};
    ///
    /// assert_eq!(ListQuery::new().limit(0).page_limit(), 1);
    /// assert_eq!(ListQuery::new().limit(1 << 20).page_limit(), MAX_PAGE);
    /// ```
    pub fn limit(mut self, limit: usize) -> Self {
        self.limit = limit.clamp(1, MAX_PAGE);
        self
    }

    /// Go on from where a page ended: the records after `cursor` in this order (a page's
    /// [`next`](ListPage::next)). The filters and the order must be the page's.
    pub fn after(mut self, cursor: ListCursor) -> Self {
        self.after = Some(cursor);
        self
    }

    /// The kinds listed; empty: every kind.
    pub fn kinds(&self) -> &[RecordKind] {
        &self.kinds
    }

    /// The scope digest records must have, if the query names a scope.
    pub fn scope_filter(&self) -> Option<u64> {
        self.scope
    }

    /// The order of the list.
    pub fn order(&self) -> ListOrder {
        self.order
    }

    /// How many records a page holds at most.
    pub fn page_limit(&self) -> usize {
        self.limit
    }

    /// Where the page starts: after this record, if the query goes on from a page.
    pub fn cursor(&self) -> Option<ListCursor> {
        self.after
    }

    /// Whether `view` passes every filter of the query (its kinds, statuses, age, scope and
    /// origin); the order and the cursor are the store's to apply.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::ledger::{Generation, ListQuery, RecordKind, RecordState, RecordView};
    /// # let fingerprint = tower_idempotency::fingerprint::Fingerprint::of(&http::Method::POST, "/charges", b"{}");
    ///
    /// let view = RecordView::new(RecordState::InDoubt, fingerprint, 1, Generation::from_u64(1),
    ///     Duration::from_secs(600), Duration::from_secs(3600));
    /// assert!(ListQuery::new().kind(RecordKind::InDoubt).older_than(Duration::from_secs(300)).matches(&view));
    /// assert!(!ListQuery::new().kind(RecordKind::Completed).matches(&view));
    /// assert!(!ListQuery::new().scope("tenant-a").matches(&view));
    /// ```
    pub fn matches(&self, view: &RecordView) -> bool {
        self.matches_kind(&view.state)
            && self.older_than.is_none_or(|age| view.age >= age)
            && self.newer_than.is_none_or(|age| view.age < age)
            && self.scope.is_none_or(|scope| view.scope == scope)
            && self.matches_origin(view.origin.as_ref())
    }

    /// Whether a record of `origin` passes the origin filters: always, without any.
    ///
    /// ```
    /// use tower_idempotency::ledger::{ListQuery, Origin};
    /// use tower_idempotency::OperationId;
    ///
    /// let origin = Origin::tool("refund").with_operation(&OperationId::new("task-42", "step-1"));
    /// assert!(ListQuery::new().tool("refund").task("task-42").matches_origin(Some(&origin)));
    /// assert!(!ListQuery::new().task("task-7").matches_origin(Some(&origin)));
    /// assert!(!ListQuery::new().tool("refund").matches_origin(None));
    /// assert!(ListQuery::new().matches_origin(None));
    /// ```
    pub fn matches_origin(&self, origin: Option<&super::Origin>) -> bool {
        let Some(filter) = self.origin.as_deref() else {
            return true;
        };
        let Some(origin) = origin else {
            return filter.is_empty();
        };
        filter
            .target
            .as_deref()
            .is_none_or(|prefix| origin.target_starts_with(prefix))
            && filter
                .tool
                .as_deref()
                .is_none_or(|name| origin.is_tool(name))
            && filter
                .task
                .as_deref()
                .is_none_or(|task| origin.task_id() == Some(task))
    }

    fn matches_kind(&self, state: &RecordState) -> bool {
        let kind = RecordKind::of(state);
        if !self.kinds.is_empty() && !self.kinds.contains(&kind) {
            return false;
        }
        match (state, self.statuses) {
            (RecordState::Completed { status }, Some((low, high))) => {
                (low..=high).contains(&status.as_u16())
            }
            _ => true,
        }
    }

    /// Whether a record at `position` (its place in the store's order of first claims) with
    /// key `key` comes after the query's cursor in its order: always, without a cursor.
    /// Ties in position are ordered by key, so no two records share a place.
    ///
    /// ```
    /// use tower_idempotency::ledger::{LedgerKey, ListCursor, ListQuery};
    ///
    /// let key = LedgerKey::from_bytes([1; 32]);
    /// let newest_first = ListQuery::new().after(ListCursor::new(10, key));
    /// assert!(newest_first.is_after_cursor(9, key));
    /// assert!(!newest_first.is_after_cursor(11, key));
    /// assert!(!newest_first.is_after_cursor(10, key)); // the cursor's own record
    /// assert!(newest_first.oldest_first().is_after_cursor(11, key));
    /// ```
    pub fn is_after_cursor(&self, position: u64, key: LedgerKey) -> bool {
        let Some(cursor) = self.after else {
            return true;
        };
        let place = (position, key);
        let from = (cursor.position, cursor.key);
        match self.order {
            ListOrder::NewestFirst => place < from,
            ListOrder::OldestFirst => place > from,
        }
    }
}

// What a store that filters in its own query language (SQL, a script) reads of a query;
// `matches` applies the same filters to a view. Only the Redis and PostgreSQL stores read
// it: unused in a build with neither.
#[cfg_attr(not(any(feature = "redis", feature = "postgres")), allow(dead_code))]
impl ListQuery {
    /// The least age a listed record has, if the query bounds it.
    pub(crate) fn older_than_filter(&self) -> Option<Duration> {
        self.older_than
    }

    /// The age every listed record is under, if the query bounds it.
    pub(crate) fn newer_than_filter(&self) -> Option<Duration> {
        self.newer_than
    }

    /// The statuses (both ends included) a listed completed record has, if the query
    /// narrows them.
    pub(crate) fn status_filter(&self) -> Option<(u16, u16)> {
        self.statuses
    }
}

/// The filters on a record's [origin](super::Origin) a query may have.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct OriginFilter {
    target: Option<String>,
    tool: Option<String>,
    task: Option<String>,
}

impl OriginFilter {
    fn is_empty(&self) -> bool {
        self.target.is_none() && self.tool.is_none() && self.task.is_none()
    }
}

/// Where a page of a list ended: the place of its last record in the store's order of
/// first claims, and its key. Handed back with [`ListQuery::after`] for the next page;
/// written as text (for a query string) with `to_string` and read back with `parse`.
///
/// ```
/// use tower_idempotency::ledger::{LedgerKey, ListCursor};
///
/// let cursor = ListCursor::new(42, LedgerKey::from_bytes([0xab; 32]));
/// let text = cursor.to_string();
/// assert_eq!(text.parse::<ListCursor>().unwrap(), cursor);
/// assert!("not-a-cursor".parse::<ListCursor>().is_err());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ListCursor {
    position: u64,
    key: LedgerKey,
}

impl ListCursor {
    /// The cursor after the record of `key` at `position` (the store's own measure of
    /// when it was first claimed, as its [`ListPage`] shows it).
    pub const fn new(position: u64, key: LedgerKey) -> Self {
        Self { position, key }
    }

    /// The last record's place in the store's order.
    pub const fn position(&self) -> u64 {
        self.position
    }

    /// The last record's key.
    pub const fn key(&self) -> LedgerKey {
        self.key
    }
}

/// Sixteen hex digits of position, a dot, sixty-four of key.
impl fmt::Display for ListCursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}.{}", self.position, self.key.to_hex())
    }
}

impl FromStr for ListCursor {
    type Err = CursorError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let (position, key) = text.split_once('.').ok_or(CursorError)?;
        let position = crate::key::derived::from_hex16(position).ok_or(CursorError)?;
        let key = LedgerKey::from_hex(key).ok_or(CursorError)?;
        Ok(Self::new(position, key))
    }
}

/// A text that is not a [`ListCursor`] (one a page handed out is always read back).
///
/// ```
/// use tower_idempotency::ledger::ListCursor;
///
/// // A sign is not a digit, though `u64::from_str_radix` would take it.
/// let signed = format!("+00000000000002a.{}", "ab".repeat(32));
/// assert!(signed.parse::<ListCursor>().is_err());
/// let err = "0000000000000001.zz".parse::<ListCursor>().unwrap_err();
/// assert_eq!(err.to_string(), "not a list cursor: expected 16 hex digits, a dot and 64 hex digits");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CursorError;

impl fmt::Display for CursorError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("not a list cursor: expected 16 hex digits, a dot and 64 hex digits")
    }
}

impl std::error::Error for CursorError {}

/// One record of a list: its key, its view, and its place in the store's order.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListedRecord {
    /// The record's key.
    pub key: LedgerKey,
    /// What the record shows, as [`inspect`](super::IdempotencyStore::inspect) would.
    pub view: RecordView,
    /// The record's place in the store's order of first claims (the [`ListCursor`]'s
    /// position after it).
    pub position: u64,
}

impl ListedRecord {
    /// The record of `key` at `position`, showing `view`.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::ledger::{Generation, LedgerKey, ListedRecord, RecordState, RecordView};
    /// # let fingerprint = tower_idempotency::fingerprint::Fingerprint::of(&http::Method::POST, "/charges", b"{}");
    /// let view = RecordView::new(RecordState::InDoubt, fingerprint, 1, Generation::from_u64(1),
    ///     Duration::ZERO, Duration::from_secs(60));
    /// let listed = ListedRecord::new(LedgerKey::from_bytes([2; 32]), view, 7);
    /// assert_eq!(listed.cursor().position(), 7);
    /// ```
    pub fn new(key: LedgerKey, view: RecordView, position: u64) -> Self {
        Self {
            key,
            view,
            position,
        }
    }

    /// The cursor a page ending with this record hands out.
    pub fn cursor(&self) -> ListCursor {
        ListCursor::new(self.position, self.key)
    }
}

/// A page of a list: up to the query's limit of records, in its order, and where to go on.
///
/// A store bounds the work of one page: it may answer fewer records than the limit (even
/// none) with a [`next`](Self::next) cursor when it stopped looking before the end. Only a
/// page without `next` ends the list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListPage {
    /// The records, in the query's order.
    pub records: Vec<ListedRecord>,
    /// Where the next page starts, `None` at the end of the list.
    pub next: Option<ListCursor>,
}

impl ListPage {
    /// A page of `records`, going on after `next` (`None`: the list ends here).
    ///
    /// ```
    /// use tower_idempotency::ledger::ListPage;
    ///
    /// let last = ListPage::new(Vec::new(), None);
    /// assert!(last.records.is_empty() && last.next.is_none());
    /// ```
    pub fn new(records: Vec<ListedRecord>, next: Option<ListCursor>) -> Self {
        Self { records, next }
    }

    /// The page a store that looked at every candidate answers: `candidates` (each passing
    /// the query's filters and after its cursor) sorted in the query's order and cut to its
    /// limit, going on after the last one kept if any were cut.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::ledger::{Generation, LedgerKey, ListPage, ListQuery, ListedRecord, RecordState, RecordView};
    /// # let fingerprint = tower_idempotency::fingerprint::Fingerprint::of(&http::Method::POST, "/charges", b"{}");
    /// let record = |n: u8| ListedRecord::new(LedgerKey::from_bytes([n; 32]),
    ///     RecordView::new(RecordState::InDoubt, fingerprint, 1, Generation::from_u64(n.into()),
    ///         Duration::ZERO, Duration::from_secs(60)), n.into());
    ///
    /// let page = ListPage::from_candidates(&ListQuery::new().limit(2), vec![record(1), record(3), record(2)]);
    /// let positions: Vec<u64> = page.records.iter().map(|r| r.position).collect();
    /// assert_eq!(positions, [3, 2]);
    /// assert_eq!(page.next.unwrap().position(), 2);
    /// ```
    pub fn from_candidates(query: &ListQuery, mut candidates: Vec<ListedRecord>) -> Self {
        sort_in_order(query, &mut candidates);
        let more = candidates.len() > query.page_limit();
        candidates.truncate(query.page_limit());
        let next = more
            .then(|| candidates.last().map(ListedRecord::cursor))
            .flatten();
        Self::new(candidates, next)
    }
}

/// Sort `records` in `query`'s order: by position, ties by key.
pub(crate) fn sort_in_order(query: &ListQuery, records: &mut [ListedRecord]) {
    let place = |record: &ListedRecord| (record.position, record.key);
    match query.order() {
        ListOrder::OldestFirst => records.sort_unstable_by_key(place),
        ListOrder::NewestFirst => {
            records.sort_unstable_by_key(|record| std::cmp::Reverse(place(record)))
        }
    }
}
