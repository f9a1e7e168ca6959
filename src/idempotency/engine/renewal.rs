//! Keeping a lease alive while its owner works: renewed every third of the lease.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use pin_project_lite::pin_project;
use tokio::time::Instant;

use crate::ledger::StoreError;

use super::observe::{observe, start, Started};
use super::{LeaseGuard, FIRST_STORE_RETRY};

pin_project! {
    /// [`LeaseGuard::renewing`]'s future: `work`, and the lease's [`Renewal`] while it is
    /// pending.
    pub(crate) struct Renewing<'a, F> {
        lease: &'a LeaseGuard,
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
        match this.renewal.poll_renew(this.lease, cx) {
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
    /// timer. A renewal refused as fenced (the operation was taken over) stops it: later
    /// writes under the lost lease will be refused, never applied. A renewal that fails
    /// otherwise (the store is away, or its answer was lost) is tried again soon, the pause
    /// doubling up to a tenth of the lease, not a third of a lease later: two such misses
    /// in a row would let the lease run out under its live owner while the store was back.
    pub(crate) struct Renewal {
        #[pin]
        sleep: Option<tokio::time::Sleep>,
        call: Option<(RenewCall, Started)>,
        // The pause before the next try while renewals fail; `None` after a success.
        retry: Option<Duration>,
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

    /// Drive the renewals of `lease`. Never ready.
    pub(crate) fn poll_renew(
        self: Pin<&mut Self>,
        lease: &LeaseGuard,
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
                    Err(err) if err.is_fenced() => {
                        tracing::warn!("the lease was taken over while its owner was working");
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
        cx: &mut Context<'_>,
    ) -> Poll<T> {
        if let Some(lease) = lease {
            if let Poll::Ready(never) = self.poll_renew(lease, cx) {
                match never {}
            }
        }
        Poll::Pending
    }
}

impl LeaseGuard {
    /// Run `work` while keeping the lease alive: renewed every third of the lease, so a
    /// slow but live owner is never taken for dead and overtaken.
    pub(crate) fn renewing<F: Future>(&self, work: F) -> Renewing<'_, F> {
        Renewing {
            lease: self,
            work,
            renewal: Renewal::new(),
        }
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
        Begin, BeginRequest, IdempotencyStore, LeaseToken, LedgerKey, Outcome, RecordView,
        StoreFuture,
    };

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
        let mut work = Box::pin(lease.renewing(std::future::pending::<()>()));
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

    #[tokio::test(start_paused = true)]
    async fn work_ready_at_once_never_starts_a_timer() {
        let store = Arc::new(Renewals::default());
        let lease = lease_of(&store, Duration::from_millis(300));
        assert_eq!(lease.renewing(async { 7 }).await, 7);
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(store.calls.load(SeqCst), 0);
        let _ = lease.hand_on();
    }
}
