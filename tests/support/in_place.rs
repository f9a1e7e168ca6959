//! Test support: the answer of a store that answers in place (`StoreFuture::ready`, as
//! `MemoryStore` does), taken without a runtime, for wrapper stores that must answer in
//! place too.
//!
//! ```ignore
//! use crate::support::in_place;
//!
//! let answer = in_place::at_once(memory_store.begin(request));
//! ```
#![allow(dead_code)]

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use tower_idempotency::ledger::{StoreError, StoreFuture};

/// `call`'s answer; panics if the store had to await.
pub fn at_once<T>(mut call: StoreFuture<'_, T>) -> Result<T, StoreError> {
    let mut cx = Context::from_waker(Waker::noop());
    match Pin::new(&mut call).poll(&mut cx) {
        Poll::Ready(answer) => answer,
        Poll::Pending => panic!("the store does not answer in place"),
    }
}
