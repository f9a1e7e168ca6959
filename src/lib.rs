//! Exactly-once side effects for retried HTTP calls, as tower middleware.
#![forbid(unsafe_code)]
#![warn(
    missing_docs,
    missing_debug_implementations,
    rust_2018_idioms,
    unreachable_pub
)]
#![cfg_attr(docsrs, feature(doc_cfg))]

mod effect;
mod error;
pub mod fingerprint;
pub mod frozen;
pub mod key;
pub mod idempotency;
pub mod ledger;
pub mod phase;
pub mod retry;

pub use effect::EffectClass;
pub use error::{ConfigError, Drift, Error};
pub use idempotency::{BusyPolicy, DriftPolicy, IdempotencyLayer, ResponseSource};
pub use retry::FrozenRetryLayer;
pub use fingerprint::Fingerprint;
pub use frozen::FrozenRequest;
pub use key::{HeaderKey, IdempotencyKey, InvalidKey, OperationId};

/// A type-erased error, as tower uses.
pub type BoxError = tower::BoxError;

#[cfg(feature = "test-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub mod testing;
