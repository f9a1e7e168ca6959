//! The bound on requests waiting for busy operations.

use std::sync::Arc;

/// A bound on the requests waiting for busy operations: under a storm of duplicates each
/// waiter holds its request (its body included), so past the bound a request is answered
/// busy at once instead of joining the queue.
#[derive(Clone, Debug)]
pub(crate) struct WaiterLimit {
    max: usize,
    waiting: Arc<std::sync::atomic::AtomicUsize>,
}

impl WaiterLimit {
    pub(crate) fn new(max: usize) -> Self {
        Self {
            max,
            waiting: Arc::default(),
        }
    }

    /// A place among the waiters, or `None` when they are all taken.
    pub(crate) fn try_enter(&self) -> Option<WaiterPermit> {
        // A counter, not a synchronisation point: relaxed is enough.
        use std::sync::atomic::Ordering::Relaxed;
        self.waiting
            .fetch_update(Relaxed, Relaxed, |n| (n < self.max).then_some(n + 1))
            .ok()?;
        Some(WaiterPermit(self.waiting.clone()))
    }
}

/// One place among the waiters, given back when the wait ends (however it ends).
pub(crate) struct WaiterPermit(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for WaiterPermit {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}
