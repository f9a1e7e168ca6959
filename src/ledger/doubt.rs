//! What an alert on operations in doubt is built on: how many there are, and how long the
//! oldest has waited ([`DoubtSummary`]), read from a store's list and, with feature
//! `metrics`, kept in gauges.

use std::time::Duration;

use super::{ListQuery, RecordKind, Records, StoreError, MAX_PAGE};

/// The most operations in doubt a [`DoubtSummary`] counts, one by one: past it, the count
/// stops and says so ([`DoubtSummary::counted_all`]). Ten thousand operations in doubt is
/// an incident whichever the exact number.
pub const MOST_COUNTED: u64 = 10_000;

/// How many operations of a store are in doubt, and how long the oldest has been: what
/// an operator's alert watches (an operation in doubt waits for a person, or for a
/// reconciler, and stays until one acts).
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::ledger::{Begin, BeginRequest, IdempotencyStore, LedgerKey, MemoryStore, Records};
/// # use tower_idempotency::fingerprint::Fingerprint;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
/// let store = std::sync::Arc::new(MemoryStore::new());
/// let records = Records::new(store.clone());
/// assert_eq!(records.doubt_summary().await?.count, 0);
///
/// # let fp = Fingerprint::of(&http::Method::POST, "/charges", b"{}");
/// let key = LedgerKey::from_bytes([1; 32]);
/// let request = BeginRequest::new(key, fp, Duration::from_secs(10), Duration::from_secs(3600));
/// let Begin::Acquired { token } = store.begin(request).await? else { unreachable!() };
/// store.mark_in_doubt(key, token, Duration::from_secs(3600)).await?;
///
/// let summary = records.doubt_summary().await?;
/// assert_eq!(summary.count, 1);
/// assert!(summary.oldest.is_some() && summary.counted_all);
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DoubtSummary {
    /// Operations in doubt, up to [`MOST_COUNTED`].
    pub count: u64,
    /// How long ago the oldest of them was first claimed; `None` when there is none.
    pub oldest: Option<Duration>,
    /// Whether `count` is every operation in doubt (`false`: there are more than
    /// [`MOST_COUNTED`]).
    pub counted_all: bool,
}

impl Records {
    /// How many operations of the store are in doubt, and how long ago the oldest was
    /// claimed: one list page for the oldest, and pages of [`MAX_PAGE`] to count them, up to
    /// [`MOST_COUNTED`]. An operation whose owner's lease ran out reads as in doubt only
    /// from the next claim of its key on, so it is counted from then.
    ///
    /// A store that cannot [list](super::IdempotencyStore::list) answers its error.
    pub async fn doubt_summary(&self) -> Result<DoubtSummary, StoreError> {
        let in_doubt = || ListQuery::new().kind(RecordKind::InDoubt);
        let oldest = self
            .list(in_doubt().oldest_first().limit(1))
            .await?
            .records
            .first()
            .map(|record| record.view.age);
        let mut query = in_doubt().limit(MAX_PAGE);
        let mut count = 0;
        loop {
            let page = self.list(query.clone()).await?;
            count += page.records.len() as u64;
            match page.next {
                Some(_) if count >= MOST_COUNTED => {
                    return Ok(DoubtSummary {
                        count: MOST_COUNTED,
                        oldest,
                        counted_all: false,
                    });
                }
                Some(cursor) => query = query.after(cursor),
                None => {
                    return Ok(DoubtSummary {
                        count,
                        oldest,
                        counted_all: true,
                    })
                }
            }
        }
    }

    /// Keep two gauges, labelled `store` = `store_label`, at the store's
    /// [`doubt_summary`](Self::doubt_summary), read every `every`:
    /// `idempotency_in_doubt_operations` (the count) and
    /// `idempotency_in_doubt_oldest_seconds` (`0` when none is in doubt). A read that fails
    /// leaves them as they were and is logged. The task runs until the handle is aborted
    /// or dropped with its runtime. Give each store its own bounded label (`"payments"`,
    /// `"redis"`), never one per request or tenant.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::ledger::{MemoryStore, Records};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let records = Records::new(MemoryStore::new());
    /// let gauges = records.publish_doubt_gauges("payments", Duration::from_secs(30));
    /// gauges.abort();
    /// # }
    /// ```
    #[cfg(feature = "metrics")]
    pub fn publish_doubt_gauges(
        &self,
        store_label: &'static str,
        every: Duration,
    ) -> tokio::task::JoinHandle<()> {
        let records = self.clone();
        let count = metrics::gauge!("idempotency_in_doubt_operations", "store" => store_label);
        let oldest = metrics::gauge!("idempotency_in_doubt_oldest_seconds", "store" => store_label);
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(every.max(Duration::from_millis(1)));
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                match records.doubt_summary().await {
                    Ok(summary) => {
                        count.set(summary.count as f64);
                        oldest.set(summary.oldest.unwrap_or_default().as_secs_f64());
                    }
                    Err(err) => {
                        tracing::warn!(%err, store = store_label, "could not count the operations in doubt; the gauges keep their last reading");
                    }
                }
            }
        })
    }
}
