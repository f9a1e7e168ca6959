//! Test support: a ledger that is never there, every call answered `unavailable`.
//!
//! ```ignore
//! use crate::support::down;
//!
//! let layer = IdempotencyLayer::server_builder(down::DownStore).fail_open(true).build()?;
//! ```
#![allow(dead_code)]

use std::time::Duration;

use tower_idempotency::ledger::{
    Begin, BeginRequest, IdempotencyStore, LeaseToken, LedgerKey, Outcome, StoreError, StoreFuture,
};

/// A store that is down.
#[derive(Debug)]
pub struct DownStore;

fn refused<T>() -> StoreFuture<'static, T> {
    StoreFuture::ready(Err(StoreError::unavailable("connection refused")))
}

impl IdempotencyStore for DownStore {
    fn begin(&self, _: BeginRequest) -> StoreFuture<'_, Begin> {
        refused()
    }
    fn complete(
        &self,
        _: LedgerKey,
        _: LeaseToken,
        _: Outcome,
        _: Duration,
    ) -> StoreFuture<'_, ()> {
        refused()
    }
    fn abandon(&self, _: LedgerKey, _: LeaseToken) -> StoreFuture<'_, ()> {
        refused()
    }
    fn mark_in_doubt(&self, _: LedgerKey, _: LeaseToken, _: Duration) -> StoreFuture<'_, ()> {
        refused()
    }
    fn renew(&self, _: LedgerKey, _: LeaseToken, _: Duration) -> StoreFuture<'_, ()> {
        refused()
    }
}

/// A store whose every claim is heavier than its whole budget: each `begin` is refused as
/// [never fitting](StoreError::never_fits); nothing else is ever reached.
#[derive(Debug)]
pub struct TooSmallStore;

impl IdempotencyStore for TooSmallStore {
    fn begin(&self, _: BeginRequest) -> StoreFuture<'_, Begin> {
        StoreFuture::ready(Err(StoreError::never_fits()))
    }
    fn complete(
        &self,
        _: LedgerKey,
        _: LeaseToken,
        _: Outcome,
        _: Duration,
    ) -> StoreFuture<'_, ()> {
        refused()
    }
    fn abandon(&self, _: LedgerKey, _: LeaseToken) -> StoreFuture<'_, ()> {
        refused()
    }
    fn mark_in_doubt(&self, _: LedgerKey, _: LeaseToken, _: Duration) -> StoreFuture<'_, ()> {
        refused()
    }
    fn renew(&self, _: LedgerKey, _: LeaseToken, _: Duration) -> StoreFuture<'_, ()> {
        refused()
    }
}
