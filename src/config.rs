//! A setting a builder refused.

use std::fmt;

/// A layer or policy was configured with settings that cannot work; returned by builders,
/// so mistakes surface at start-up rather than at request time.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
///
/// let err = IdempotencyLayer::client_builder(MemoryStore::new())
///     .retention(Duration::from_secs(10))
///     .build()
///     .unwrap_err();
/// assert!(err.to_string().contains("retention"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError(String);

impl ConfigError {
    pub(crate) fn new(message: impl Into<String>) -> Self {
        Self(message.into())
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid configuration: {}", self.0)
    }
}

impl std::error::Error for ConfigError {}
