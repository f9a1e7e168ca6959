//! A setting a builder refused.

use std::fmt;

/// A layer or policy was configured with settings that cannot work; returned by builders,
/// so mistakes surface at start-up rather than at request time.
///
/// The message says what was wrong and how to fix it; its text is not API. The
/// `is_*()` predicates tell the cases a program may want to act on apart.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::KeyHeader;
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
///
/// let err = IdempotencyLayer::client_builder(MemoryStore::new())
///     .provider_deduplicates(true)
///     .key_header(KeyHeader::ietf())
///     .retention(Duration::from_secs(10))
///     .build()
///     .unwrap_err();
/// assert!(err.to_string().contains("retention"));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigError {
    kind: Kind,
    message: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// A setting out of range, or two settings that contradict each other.
    Invalid,
    /// A choice with no safe default was not made.
    ChoiceMissing,
}

impl ConfigError {
    pub(crate) fn new(message: impl Into<String>) -> Self {
        Self {
            kind: Kind::Invalid,
            message: message.into(),
        }
    }

    /// A choice the builder requires, because no default is safe, was left out.
    pub(crate) fn choice_missing(message: impl Into<String>) -> Self {
        Self {
            kind: Kind::ChoiceMissing,
            message: message.into(),
        }
    }

    /// Whether a choice with no safe default was left out (such as whether the provider
    /// deduplicates on `Idempotency-Key`), rather than a setting refused.
    ///
    /// ```
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// let err = IdempotencyLayer::client_builder(MemoryStore::new()).build().unwrap_err();
    /// assert!(err.is_choice_missing());
    /// ```
    pub fn is_choice_missing(&self) -> bool {
        self.kind == Kind::ChoiceMissing
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            Kind::Invalid => write!(f, "invalid configuration: {}", self.message),
            Kind::ChoiceMissing => write!(f, "incomplete configuration: {}", self.message),
        }
    }
}

impl std::error::Error for ConfigError {}
