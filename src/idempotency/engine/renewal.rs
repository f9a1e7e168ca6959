//! Keeping a lease alive while its owner works: renewed every third of the lease, or held
//! by a store that holds leases until their owners let go.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering::Relaxed;
use std::task::{Context, Poll};
use std::time::Duration;

use pin_project_lite::pin_project;
use tokio::time::Instant;

use crate::idempotency::decision::{Signal, Track};
use crate::ledger::StoreError;

use super::observe::{observe, start, Started};
use super::{LeaseGuard, FIRST_STORE_RETRY};

pin_project! {
    /// [`LeaseGuard::renewing`]'s future: `work`, and the lease's [`Renewal`] while it is
    /// pending.
    pub(crate) struct Renewing<'a, F> {
        lease: &'a LeaseGuard,
        track: &'a Track,
        #[pin]
        work: F,
        #[pin]
        renewal: Renewal,
    }
}

impl<F: Future> Future for Renewing<'_, F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        if let Poll::Ready(output) = this.work.poll(cx) {
            return Poll::Ready(output);
        }
        match this.renewal.poll_renew(this.lease, this.track, cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(never) => match never {},
        }
    }
}

/// A store call renewing a lease: boxed, since it borrows the store and is made once per
/// third of a lease at most, never for work done within it.
type RenewCall = Pin<Box<dyn Future<Output = Result<(), StoreError>> + Send>>;

pin_project! {
    /// Renews a lease every third of it, for as long as it is polled (it never completes):
    /// poll it with its lease's guard whenever the work holding that lease is pending.
    ///
    /// Nothing happens before its first poll, so work that is ready at once never starts a
    /// timer. At the first poll, a store that
    /// [holds leases](crate::ledger::IdempotencyStore::hold_lease) (`MemoryStore`) is asked
    /// to hold this one until its guard lets go of it: then there is nothing to renew, and
    /// no timer is ever made. A renewal refused as fenced (the operation was taken over)
    /// stops it: later writes under the lost lease will be refused, never applied. A renewal
    /// that fails otherwise (the store is away, or its answer was lost) is tried again soon,
    /// the pause doubling up to a tenth of the lease, not a third of a lease later: two such
    /// misses in a row would let the lease run out under its live owner while the store was
    /// back.
    pub(crate) struct Renewal {
        #[pin]
        sleep: Option<tokio::time::Sleep>,
        call: Option<(RenewCall, Started)>,
        // The pause before the next try while renewals fail; `None` after a success.
        retry: Option<Duration>,
        // Nothing more to do: the lease was taken over, or the store holds it until its
        // guard lets go.
        stopped: bool,
    }
}

impl Renewal {
    pub(crate) fn new() -> Self {
        Self {
            sleep: None,
            call: None,
            retry: None,
            stopped: false,
        }
    }

    /// Drive the renewals of `lease`, raising on `track` (the request's) what the owner's
    /// caller must hear of. Never ready.
    pub(crate) fn poll_renew(
        self: Pin<&mut Self>,
        lease: &LeaseGuard,
        track: &Track,
        cx: &mut Context<'_>,
    ) -> Poll<std::convert::Infallible> {
        let mut this = self.project();
        // A third of the lease: one renewal may fail or be lost and the next still lands
        // before the lease ends, so a live owner is never taken for dead by one miss.
        let every = (lease.ledger.lease / 3).max(Duration::from_millis(1));
        loop {
            if *this.stopped {
                return Poll::Pending;
            }
            if let Some((call, started)) = this.call.as_mut() {
                let renewed = std::task::ready!(call.as_mut().poll(cx));
                observe("renew", *started, &renewed);
                *this.call = None;
                // The next renewal is a third of a lease after a success, and soon after a
                // failure.
                let next = match renewed {
                    Ok(()) => {
                        *this.retry = None;
                        every
                    }
                    // Taken over: renewing again would be refused every time. The work goes
                    // on, but every write under this token will be refused, never applied,
                    // so the new owner's record is safe.
                    // Another run may now send the operation again: the request's signal,
                    // so metrics and the outcome hook hear it, not only a subscriber.
                    Err(err) if err.is_fenced() => {
                        tracing::warn!("the lease was taken over while its owner was working");
                        track.signal(Signal::LeaseLost);
                        *this.stopped = true;
                        continue;
                    }
                    Err(err) => {
                        let pause = match *this.retry {
                            None => {
                                tracing::warn!(%err, "could not renew the lease; trying again");
                                FIRST_STORE_RETRY
                            }
                            Some(pause) => {
                                tracing::debug!(%err, "could not renew the lease; trying again");
                                (pause * 2).min(lease.ledger.max_retry_pause())
                            }
                        };
                        *this.retry = Some(pause);
                        pause.min(every)
                    }
                };
                if let Some(sleep) = this.sleep.as_mut().as_pin_mut() {
                    sleep.reset(Instant::now() + next);
                }
            }
            match this.sleep.as_mut().as_pin_mut() {
                None if lease.hold() => {
                    *this.stopped = true;
                    return Poll::Pending;
                }
                None => this.sleep.set(Some(tokio::time::sleep(every))),
                Some(sleep) => {
                    std::task::ready!(sleep.poll(cx));
                    *this.call = Some((lease.renew_call(), start()));
                }
            }
        }
    }
}

impl Renewal {
    /// Renew `lease` while one is held: pending either way, for the work holding it.
    pub(crate) fn poll_renew_while<T>(
        self: Pin<&mut Self>,
        lease: &Option<LeaseGuard>,
        track: &Track,
        cx: &mut Context<'_>,
    ) -> Poll<T> {
        if let Some(lease) = lease {
            if let Poll::Ready(never) = self.poll_renew(lease, track, cx) {
                match never {}
            }
        }
        Poll::Pending
    }
}

impl LeaseGuard {
    /// Run `work` while keeping the lease alive: renewed every third of the lease (or held
    /// by the store), so a slow but live owner is never taken for dead and overtaken. A lease
    /// taken over all the same is raised on `track`, the request's.
    pub(crate) fn renewing<'a, F: Future>(&'a self, track: &'a Track, work: F) -> Renewing<'a, F> {
        Renewing {
            lease: self,
            track,
            work,
            renewal: Renewal::new(),
        }
    }

    /// Whether the store holds this lease until this guard lets go of it (it is then never
    /// renewed): asked when the work holding it first waits.
    fn hold(&self) -> bool {
        let (store, lease) = (&self.ledger.store, self.ledger.lease);
        if !store.hold_lease(self.key, self.token, lease) {
            return false;
        }
        self.held.store(true, Relaxed);
        #[cfg(feature = "test-util")]
        crate::testing::crash::enlist(store, self.key, self.token, lease);
        true
    }

    fn renew_call(&self) -> RenewCall {
        let (store, key, token, lease) = (
            self.ledger.store.clone(),
            self.key,
            self.token,
            self.ledger.lease,
        );
        Box::pin(async move { store.renew(key, token, lease).await })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};

    use std::sync::Arc;

    use super::*;
    use crate::idempotency::engine::Ledger;
    use crate::ledger::{
        Begin, BeginRequest, IdempotencyStore, LeaseToken, LedgerKey, MemoryStore, Outcome,
        RecordView, StoreFuture,
    };

    /// A track no caller reads: these tests watch the store.
    fn unheard() -> Track {
        Track::new(crate::idempotency::decision::Face::Client, None)
    }

    /// Counts renewals; answers them `fenced` once told to.
    #[derive(Debug, Default)]
    struct Renewals {
        calls: AtomicUsize,
        fenced: AtomicBool,
    }

    impl IdempotencyStore for Renewals {
        fn begin(&self, _: BeginRequest) -> StoreFuture<'_, Begin> {
            unreachable!("only renewals are asked for")
        }
        fn complete(
            &self,
            _: LedgerKey,
            _: LeaseToken,
            _: Outcome,
            _: Duration,
        ) -> StoreFuture<'_, ()> {
            StoreFuture::ready(Ok(()))
        }
        fn abandon(&self, _: LedgerKey, _: LeaseToken) -> StoreFuture<'_, ()> {
            StoreFuture::ready(Ok(()))
        }
        fn mark_in_doubt(&self, _: LedgerKey, _: LeaseToken, _: Duration) -> StoreFuture<'_, ()> {
            StoreFuture::ready(Ok(()))
        }
        fn renew(&self, _: LedgerKey, _: LeaseToken, _: Duration) -> StoreFuture<'_, ()> {
            self.calls.fetch_add(1, SeqCst);
            if self.fenced.load(SeqCst) {
                return StoreFuture::ready(Err(StoreError::fenced()));
            }
            StoreFuture::ready(Ok(()))
        }
        fn inspect(&self, _: LedgerKey) -> StoreFuture<'_, Option<RecordView>> {
            StoreFuture::ready(Ok(None))
        }
    }

    fn lease_of(store: &Arc<Renewals>, lease: Duration) -> LeaseGuard {
        let store: Arc<dyn IdempotencyStore> = store.clone();
        let ledger = Ledger::new(store, lease, lease * 10, lease);
        ledger.hold(LedgerKey::server("", "k"), LeaseToken::generate())
    }

    /// Let the renewing future run on the paused clock for `time`, a millisecond at a time.
    async fn run_for<F: Future + Unpin>(work: &mut F, time: Duration) {
        let end = Instant::now() + time;
        while Instant::now() < end {
            let polled = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *work).poll(cx)));
            assert!(polled.await.is_pending(), "the work never completes");
            tokio::time::advance(Duration::from_millis(1)).await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn pending_work_renews_every_third_of_the_lease_until_fenced() {
        let store = Arc::new(Renewals::default());
        let lease = lease_of(&store, Duration::from_millis(300));
        let track = unheard();
        let mut work = Box::pin(lease.renewing(&track, std::future::pending::<()>()));
        run_for(&mut work, Duration::from_millis(1050)).await;
        assert_eq!(store.calls.load(SeqCst), 10, "one renewal per 100 ms");

        store.fenced.store(true, SeqCst);
        run_for(&mut work, Duration::from_millis(1000)).await;
        assert_eq!(
            store.calls.load(SeqCst),
            11,
            "a renewal refused as fenced is the last: the lease is someone else's"
        );
        drop(work);
        let _ = lease.hand_on();
    }

    /// The memory store, counting the renewals and the lettings go it is asked for; its
    /// `mark_in_doubt` never answers once told to.
    #[derive(Debug, Default)]
    struct CountedMemory {
        store: MemoryStore,
        renewals: AtomicUsize,
        lettings_go: AtomicUsize,
        stuck_settles: AtomicBool,
    }

    impl IdempotencyStore for CountedMemory {
        fn begin(&self, request: BeginRequest) -> StoreFuture<'_, Begin> {
            self.store.begin(request)
        }
        fn complete(
            &self,
            key: LedgerKey,
            token: LeaseToken,
            outcome: Outcome,
            retention: Duration,
        ) -> StoreFuture<'_, ()> {
            self.store.complete(key, token, outcome, retention)
        }
        fn abandon(&self, key: LedgerKey, token: LeaseToken) -> StoreFuture<'_, ()> {
            self.store.abandon(key, token)
        }
        fn mark_in_doubt(
            &self,
            key: LedgerKey,
            token: LeaseToken,
            retention: Duration,
        ) -> StoreFuture<'_, ()> {
            if self.stuck_settles.load(SeqCst) {
                return StoreFuture::new(std::future::pending());
            }
            self.store.mark_in_doubt(key, token, retention)
        }
        fn renew(&self, key: LedgerKey, token: LeaseToken, lease: Duration) -> StoreFuture<'_, ()> {
            self.renewals.fetch_add(1, SeqCst);
            self.store.renew(key, token, lease)
        }
        fn hold_lease(&self, key: LedgerKey, token: LeaseToken, lease: Duration) -> bool {
            self.store.hold_lease(key, token, lease)
        }
        fn let_go(&self, key: LedgerKey, token: LeaseToken, lease: Duration) {
            self.lettings_go.fetch_add(1, SeqCst);
            self.store.let_go(key, token, lease);
        }
    }

    /// A key claimed on a [`CountedMemory`], and the ledger its guards hold it through.
    struct Claimed {
        counted: Arc<CountedMemory>,
        ledger: Ledger,
        lease: Duration,
        key: LedgerKey,
        token: LeaseToken,
    }

    impl Claimed {
        async fn new(name: &str) -> Self {
            let counted = Arc::new(CountedMemory::default());
            let store: Arc<dyn IdempotencyStore> = counted.clone();
            let lease = Duration::from_millis(300);
            let ledger = Ledger::new(store, lease, lease * 100, lease);
            let key = LedgerKey::server("", name);
            let mut claimed = Self {
                counted,
                ledger,
                lease,
                key,
                token: LeaseToken::generate(),
            };
            let Begin::Acquired { token } = claimed.next_caller().await else {
                panic!("a fresh key is acquired");
            };
            claimed.token = token;
            claimed
        }

        /// What a caller with a token of its own is answered for the key.
        async fn next_caller(&self) -> Begin {
            let fingerprint = crate::fingerprint::Fingerprint::of(&http::Method::POST, "/", b"");
            let request = BeginRequest::new(self.key, fingerprint, self.lease, self.lease * 100);
            self.counted.begin(request).await.unwrap()
        }

        /// A guard of `token`'s lease, renewing (or holding) while its work waits for
        /// `time`; the work is dropped, the guard handed back.
        async fn held_for(&self, token: LeaseToken, time: Duration) -> LeaseGuard {
            let guard = self.ledger.hold(self.key, token);
            let track = unheard();
            let mut work = Box::pin(guard.renewing(&track, std::future::pending::<()>()));
            run_for(&mut work, time).await;
            drop(work);
            guard
        }

        /// Busy until a lease from now, then resumed: what a lease let go of now reads as.
        async fn runs_out_a_lease_from_now(&self) -> LeaseToken {
            tokio::time::advance(self.lease - Duration::from_millis(1)).await;
            assert!(matches!(self.next_caller().await, Begin::Busy { .. }));
            tokio::time::advance(Duration::from_millis(2)).await;
            match self.next_caller().await {
                Begin::Resume { token, .. } => token,
                other => panic!("expected Resume a lease after it was let go, got {other:?}"),
            }
        }
    }

    /// A guard dropped unsettled lets go of its held lease before it settles: a settle that
    /// must wait (a store that does not answer at once), and may never finish, leaves the
    /// lease to end a lease later, as a renewed one would, not held until its retention ends.
    #[tokio::test(start_paused = true)]
    async fn a_held_lease_dropped_unsettled_is_let_go_even_if_its_settle_never_finishes() {
        let claimed = Claimed::new("stuck").await;
        let guard = claimed.held_for(claimed.token, claimed.lease * 5).await;
        claimed.counted.stuck_settles.store(true, SeqCst);
        drop(guard);
        assert_eq!(
            claimed.counted.lettings_go.load(SeqCst),
            1,
            "let go as it went"
        );
        // Its settle still under way, the next caller resumes a lease later.
        claimed.runs_out_a_lease_from_now().await;
        assert_eq!(claimed.counted.renewals.load(SeqCst), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_store_that_holds_the_lease_is_never_asked_to_renew_and_is_let_go() {
        let claimed = Claimed::new("slow").await;
        let guard = claimed.held_for(claimed.token, claimed.lease * 10).await;
        assert_eq!(
            claimed.counted.renewals.load(SeqCst),
            0,
            "held, never renewed"
        );
        assert!(
            matches!(claimed.next_caller().await, Begin::Busy { .. }),
            "ten leases on, the live owner still holds it"
        );
        // The owner goes away: its guard settles the record as it goes (its request may
        // have left), so the next caller resumes at once.
        drop(guard);
        let Begin::Resume { token, .. } = claimed.next_caller().await else {
            panic!("a settled-in-doubt operation resumes at once");
        };

        // Handed on unsettled, a held lease is let go: it ends a lease later, unless the
        // next guard holds it again.
        let guard = claimed.held_for(token, claimed.lease * 3).await;
        let _ = guard.hand_on();
        claimed.runs_out_a_lease_from_now().await;
        assert_eq!(claimed.counted.renewals.load(SeqCst), 0);
    }

    /// A crash lets go of what the operations inside it held, however deeply their own
    /// `crash_after` nests them: the next caller resumes a lease later.
    #[tokio::test(start_paused = true)]
    async fn a_crash_lets_go_of_the_leases_held_inside_a_nested_crash_after() {
        let claimed = Claimed::new("nested").await;
        let (ledger, key, token) = (claimed.ledger.clone(), claimed.key, claimed.token);
        let operation = async move {
            let guard = ledger.hold(key, token);
            guard
                .renewing(&unheard(), std::future::pending::<()>())
                .await;
        };
        let inner = crate::testing::crash_after(operation, Duration::from_secs(3600));
        let crashed = crate::testing::crash_after(inner, Duration::from_millis(5)).await;
        assert!(crashed.is_none());
        assert_eq!(claimed.counted.lettings_go.load(SeqCst), 1);
        claimed.runs_out_a_lease_from_now().await;
    }

    #[tokio::test(start_paused = true)]
    async fn work_ready_at_once_never_starts_a_timer() {
        let store = Arc::new(Renewals::default());
        let lease = lease_of(&store, Duration::from_millis(300));
        assert_eq!(lease.renewing(&unheard(), async { 7 }).await, 7);
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(store.calls.load(SeqCst), 0);
        let _ = lease.hand_on();
    }
}
