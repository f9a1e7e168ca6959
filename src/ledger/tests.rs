use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use super::*;

fn poll_once<T>(future: &mut StoreFuture<'_, T>) -> Poll<Result<T, StoreError>> {
    Pin::new(future).poll(&mut Context::from_waker(Waker::noop()))
}

#[test]
fn a_ready_future_answers_on_its_first_poll() {
    let mut future = StoreFuture::ready(Ok(5_u8));
    assert!(matches!(poll_once(&mut future), Poll::Ready(Ok(5))));
    assert_eq!(format!("{future:?}"), "StoreFuture::Done");
}

#[test]
#[should_panic(expected = "StoreFuture polled after completion")]
fn polling_a_ready_future_again_panics() {
    let mut future = StoreFuture::ready(Ok(()));
    let _ = poll_once(&mut future);
    let _ = poll_once(&mut future);
}

#[test]
fn a_boxed_future_is_polled_through() {
    let mut yielded = false;
    let mut future = StoreFuture::new(std::future::poll_fn(move |cx| {
        if yielded {
            Poll::Ready(Ok(9_u8))
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }));
    assert!(poll_once(&mut future).is_pending());
    assert!(matches!(poll_once(&mut future), Poll::Ready(Ok(9))));
}

#[test]
fn debug_never_shows_the_value() {
    let future = StoreFuture::<'_, &str>::ready(Ok("secret"));
    assert!(!format!("{future:?}").contains("secret"));
}

#[test]
fn the_memory_store_answers_without_a_box() {
    let store = MemoryStore::new();
    let key = LedgerKey::from_bytes([1; 32]);
    let fingerprint = Fingerprint::of(&http::Method::POST, "/charges", b"{}");
    let request = BeginRequest::new(
        key,
        fingerprint,
        Duration::from_secs(10),
        Duration::from_secs(60),
    );
    let mut begin = store.begin(request);
    assert_eq!(format!("{begin:?}"), "StoreFuture::Ready");
    let Poll::Ready(Ok(Begin::Acquired { token })) = poll_once(&mut begin) else {
        panic!("a fresh key is acquired at once");
    };
    let inspect = store.inspect(key);
    assert_eq!(format!("{inspect:?}"), "StoreFuture::Ready");
    let renew = store.renew(key, token, Duration::from_secs(10));
    assert_eq!(format!("{renew:?}"), "StoreFuture::Ready");
    let outcome = Outcome::Tombstone {
        status: http::StatusCode::OK,
    };
    let complete = store.complete(key, token, outcome, Duration::from_secs(60));
    assert_eq!(format!("{complete:?}"), "StoreFuture::Ready");
}

#[test]
fn store_futures_are_send_whenever_their_answer_is() {
    fn assert_send<F: Future + Send>(_: &F) {}
    let store = MemoryStore::new();
    assert_send(&store.inspect(LedgerKey::from_bytes([2; 32])));
    assert_send(&StoreFuture::<'_, Vec<u8>>::new(async { Ok(Vec::new()) }));
}

/// A store of one's own that implements only the protocol's writes.
#[derive(Debug)]
struct WritesOnly;

impl IdempotencyStore for WritesOnly {
    fn begin(&self, _: BeginRequest) -> StoreFuture<'_, Begin> {
        StoreFuture::ready(Err(StoreError::unavailable("not in this test")))
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
        StoreFuture::ready(Ok(()))
    }
}

/// A store that does not implement `resolve` fails closed: an unavailable error, never an
/// answer about a record it never looked at (least of all `Resolved`), through an `Arc`
/// too.
#[tokio::test(flavor = "current_thread")]
async fn a_store_that_cannot_resolve_says_so() {
    let fp = Fingerprint::of(&http::Method::POST, "/charges", b"{}");
    let look = Expected::new(RecordKind::InDoubt, fp, 1, Generation::from_u64(1));
    let receipt = Outcome::Tombstone {
        status: http::StatusCode::OK,
    };
    let key = LedgerKey::from_bytes([1; 32]);
    let answer = WritesOnly
        .resolve(key, look, receipt.clone(), Duration::from_secs(60))
        .await;
    assert!(answer.unwrap_err().is_unavailable());
    let shared: std::sync::Arc<dyn IdempotencyStore> = std::sync::Arc::new(WritesOnly);
    let answer = shared
        .resolve(key, look, receipt, Duration::from_secs(60))
        .await;
    assert!(answer.unwrap_err().is_unavailable());
}
