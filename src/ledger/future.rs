//! [`StoreFuture`]: what every store method returns, ready at once or boxed.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use super::{Begin, RecordView, StoreError};
#[cfg(doc)]
use super::{IdempotencyStore, MemoryStore};

/// The future every [`IdempotencyStore`] method returns: either an answer the store already
/// has (no allocation) or a boxed future that still has work to do.
///
/// A store that answers in place, without awaiting anything (like [`MemoryStore`]), builds
/// it with [`StoreFuture::ready`]; one that talks to a server wraps its `async` block with
/// [`StoreFuture::new`]. An already boxed future converts with [`From`] (`.into()`).
///
/// Polling a ready one again after it completed panics ("StoreFuture polled after
/// completion"), as futures do; a boxed one does what its future does.
///
/// Like an `async` block, a boxed one must do nothing until it is first polled: the layers
/// take a ready answer as it is, and drop a boxed future unpolled to make the same call
/// through their waiting and retrying path instead.
///
/// ```
/// use tower_idempotency::ledger::{StoreError, StoreFuture};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), StoreError> {
/// let at_once: StoreFuture<'_, u32> = StoreFuture::ready(Ok(7));
/// let later: StoreFuture<'_, u32> = StoreFuture::new(async move {
///     tokio::task::yield_now().await;
///     Ok(8)
/// });
/// assert_eq!(at_once.await? + later.await?, 15);
/// # Ok(())
/// # }
/// ```
#[must_use = "futures do nothing unless awaited or polled"]
pub struct StoreFuture<'a, T> {
    inner: StoreFutureInner<'a, T>,
}

/// A boxed store future, as [`StoreFuture::new`] makes and [`From`] accepts.
type BoxedStoreFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>;

enum StoreFutureInner<'a, T> {
    /// The answer, until it is taken by the poll that completes the future.
    Ready(Option<Result<T, StoreError>>),
    /// Work still to do.
    Boxed(BoxedStoreFuture<'a, T>),
}

impl<'a, T> StoreFuture<'a, T> {
    /// A future that is already complete with `result`: no allocation, for a store that
    /// answers without awaiting anything.
    ///
    /// ```
    /// use tower_idempotency::ledger::{StoreError, StoreFuture};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let refused: StoreFuture<'_, ()> = StoreFuture::ready(Err(StoreError::unavailable("down")));
    /// assert!(refused.await.unwrap_err().is_unavailable());
    /// # }
    /// ```
    pub fn ready(result: Result<T, StoreError>) -> Self {
        StoreFuture {
            inner: StoreFutureInner::Ready(Some(result)),
        }
    }

    /// Box `future`: for a store that has to await (a network round trip, a lock held
    /// across an `.await`).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::ledger::{StoreError, StoreFuture};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), StoreError> {
    /// let delay = Duration::from_millis(1);
    /// let answer: StoreFuture<'_, &str> = StoreFuture::new(async move {
    ///     tokio::time::sleep(delay).await;
    ///     Ok("stored")
    /// });
    /// assert_eq!(answer.await?, "stored");
    /// # Ok(())
    /// # }
    /// ```
    pub fn new(future: impl Future<Output = Result<T, StoreError>> + Send + 'a) -> Self {
        StoreFuture {
            inner: StoreFutureInner::Boxed(Box::pin(future)),
        }
    }

    /// The answer of a [`ready`](Self::ready) future, taken without polling; `None` for a
    /// boxed one (left as it is) or one already taken.
    pub(crate) fn take_ready(&mut self) -> Option<Result<T, StoreError>> {
        match &mut self.inner {
            StoreFutureInner::Ready(result) => result.take(),
            StoreFutureInner::Boxed(_) => None,
        }
    }
}

/// An already boxed future is a [`StoreFuture`] as it is (no second box).
///
/// ```
/// use std::future::Future;
/// use std::pin::Pin;
/// use tower_idempotency::ledger::{StoreError, StoreFuture};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), StoreError> {
/// let boxed: Pin<Box<dyn Future<Output = Result<u8, StoreError>> + Send>> =
///     Box::pin(async { Ok(1) });
/// let future: StoreFuture<'_, u8> = boxed.into();
/// assert_eq!(future.await?, 1);
/// # Ok(())
/// # }
/// ```
impl<'a, T> From<Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>>
    for StoreFuture<'a, T>
{
    fn from(future: Pin<Box<dyn Future<Output = Result<T, StoreError>> + Send + 'a>>) -> Self {
        StoreFuture {
            inner: StoreFutureInner::Boxed(future),
        }
    }
}

/// Answers the ready result on the first poll, or polls the boxed future.
///
/// ```
/// use std::future::Future;
/// use std::pin::pin;
/// use std::task::{Context, Poll, Waker};
/// use tower_idempotency::ledger::StoreFuture;
///
/// let mut future = pin!(StoreFuture::<'_, u8>::ready(Ok(3)));
/// let mut cx = Context::from_waker(Waker::noop());
/// assert!(matches!(future.as_mut().poll(&mut cx), Poll::Ready(Ok(3))));
/// ```
impl<T> Future for StoreFuture<'_, T> {
    type Output = Result<T, StoreError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match &mut self.get_mut().inner {
            StoreFutureInner::Ready(result) => {
                Poll::Ready(result.take().expect("StoreFuture polled after completion"))
            }
            StoreFutureInner::Boxed(future) => future.as_mut().poll(cx),
        }
    }
}

// The ready answer is moved out, never pinned, and the boxed future is `Unpin` whatever it
// holds: moving a `StoreFuture` never moves pinned data, whatever `T` is.
impl<T> Unpin for StoreFuture<'_, T> {}

/// Says which kind it is (ready, or boxed), never the value.
///
/// ```
/// use tower_idempotency::ledger::StoreFuture;
///
/// let future = StoreFuture::<'_, u8>::ready(Ok(3));
/// assert_eq!(format!("{future:?}"), "StoreFuture::Ready");
/// let future = StoreFuture::<'_, u8>::new(async { Ok(3) });
/// assert_eq!(format!("{future:?}"), "StoreFuture::Boxed");
/// ```
impl<T> fmt::Debug for StoreFuture<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match &self.inner {
            StoreFutureInner::Ready(Some(_)) => "StoreFuture::Ready",
            StoreFutureInner::Ready(None) => "StoreFuture::Done",
            StoreFutureInner::Boxed(_) => "StoreFuture::Boxed",
        })
    }
}

// A store future is `Send` whenever its answer is: layers hold them across `.await`s.
const _: fn() = || {
    fn assert_send<F: Send>() {}
    assert_send::<StoreFuture<'static, Begin>>();
    assert_send::<StoreFuture<'static, ()>>();
    assert_send::<StoreFuture<'static, Option<RecordView>>>();
};
