//! The locks and atomics of the memory store, in one place so that a model checker can stand
//! in for them.
//!
//! Built normally, these are `std`'s. The store's unit tests built with
//! `RUSTFLAGS="--cfg tower_idempotency_loom"` take loom's instead, so that its model checker
//! (`model_check.rs`) sees every lock taken and every atomic touched, and runs each scenario
//! under every interleaving of them. `Arc` and `PoisonError` stay `std`'s either way: the
//! store's `Arc` is only ever cloned and dropped whole, and loom's locks answer `std`'s
//! `LockResult`.

#[cfg(not(all(test, tower_idempotency_loom)))]
pub(super) use std::sync::{atomic::AtomicU64, Mutex, MutexGuard};

#[cfg(all(test, tower_idempotency_loom))]
pub(super) use loom::sync::{atomic::AtomicU64, Mutex, MutexGuard};

pub(super) use std::sync::atomic::Ordering;
pub(super) use std::sync::{Arc, PoisonError};
