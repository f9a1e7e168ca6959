//! [`StoreError`]: a ledger failure, by kind.

use std::fmt;
use std::time::Duration;

#[cfg(doc)]
use super::IdempotencyStore;
use crate::BoxError;

/// A ledger failure.
///
/// ```
/// use tower_idempotency::ledger::StoreError;
///
/// let err = StoreError::unavailable("connection refused");
/// assert!(err.is_unavailable() && !err.is_fenced());
/// ```
pub struct StoreError {
    kind: StoreErrorKind,
    source: Option<BoxError>,
    /// When a full store expects room again, if it knows.
    room_in: Option<Duration>,
    /// A full store's refusal of a record heavier than its whole budget: no wait helps.
    never_fits: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StoreErrorKind {
    Unavailable,
    Timeout,
    Fenced,
    Corrupt,
    Full,
}

impl StoreError {
    /// The store cannot be reached or refused the operation.
    pub fn unavailable(source: impl Into<BoxError>) -> Self {
        Self {
            kind: StoreErrorKind::Unavailable,
            source: Some(source.into()),
            room_in: None,
            never_fits: false,
        }
    }

    /// The store did not answer within its operation timeout.
    pub fn timeout() -> Self {
        Self {
            kind: StoreErrorKind::Timeout,
            source: None,
            room_in: None,
            never_fits: false,
        }
    }

    /// A write carried a token that is not the record's current owner's, or a `begin` a
    /// token its caller already released (see [`IdempotencyStore::abandon`]).
    pub fn fenced() -> Self {
        Self {
            kind: StoreErrorKind::Fenced,
            source: None,
            room_in: None,
            never_fits: false,
        }
    }

    /// A stored record could not be decoded.
    pub fn corrupt(source: impl Into<BoxError>) -> Self {
        Self {
            kind: StoreErrorKind::Corrupt,
            source: Some(source.into()),
            room_in: None,
            never_fits: false,
        }
    }

    /// The store's memory budget is full of records it must not forget (inside their
    /// protected window, or still open): it refuses new claims rather than evict one.
    ///
    /// ```
    /// # use tower_idempotency::ledger::StoreError;
    /// assert!(StoreError::full().is_full());
    /// ```
    pub fn full() -> Self {
        Self {
            kind: StoreErrorKind::Full,
            source: None,
            room_in: None,
            never_fits: false,
        }
    }

    /// [`StoreError::full`], knowing when room frees up: in `retry_after`, the first record
    /// the store keeps leaves its protected window and may make way for a new one.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use tower_idempotency::ledger::StoreError;
    /// let err = StoreError::full_until(Duration::from_secs(12));
    /// assert!(err.is_full());
    /// assert_eq!(err.retry_after(), Some(Duration::from_secs(12)));
    /// assert_eq!(StoreError::full().retry_after(), None);
    /// ```
    pub fn full_until(retry_after: Duration) -> Self {
        Self {
            kind: StoreErrorKind::Full,
            source: None,
            room_in: Some(retry_after),
            never_fits: false,
        }
    }

    /// [`StoreError::full`] for a record heavier than the store's whole budget: it can
    /// never be kept, however long the caller waits, so there is no
    /// [`retry_after`](Self::retry_after). It is still [full](Self::is_full): the layers
    /// fail closed on it alike (nothing runs), and only what they tell the caller differs.
    /// A store answers it when the operation's request (which the client face keeps, to
    /// resend) or claim weighs more than it may ever hold: a body limit larger than the
    /// store's budget.
    ///
    /// ```
    /// # use tower_idempotency::ledger::StoreError;
    /// let err = StoreError::never_fits();
    /// assert!(err.is_full() && err.is_never_fits());
    /// assert_eq!(err.retry_after(), None);
    /// assert!(!StoreError::full().is_never_fits());
    /// ```
    pub fn never_fits() -> Self {
        Self {
            never_fits: true,
            ..Self::full()
        }
    }

    /// See [`StoreError::never_fits`].
    pub fn is_never_fits(&self) -> bool {
        self.never_fits
    }

    /// See [`StoreError::full`].
    pub fn is_full(&self) -> bool {
        self.kind == StoreErrorKind::Full
    }

    /// When a [full](Self::is_full) store expects room for a new claim, if it knows
    /// ([`full_until`](Self::full_until)).
    pub fn retry_after(&self) -> Option<Duration> {
        self.room_in
    }

    /// See [`StoreError::unavailable`].
    pub fn is_unavailable(&self) -> bool {
        self.kind == StoreErrorKind::Unavailable
    }

    /// See [`StoreError::timeout`].
    pub fn is_timeout(&self) -> bool {
        self.kind == StoreErrorKind::Timeout
    }

    /// See [`StoreError::fenced`].
    pub fn is_fenced(&self) -> bool {
        self.kind == StoreErrorKind::Fenced
    }

    /// See [`StoreError::corrupt`].
    pub fn is_corrupt(&self) -> bool {
        self.kind == StoreErrorKind::Corrupt
    }
}

impl fmt::Debug for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreError")
            .field("kind", &self.kind)
            .field("source", &self.source)
            .field("room_in", &self.room_in)
            .field("never_fits", &self.never_fits)
            .finish()
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            StoreErrorKind::Unavailable => "the ledger is unavailable",
            StoreErrorKind::Timeout => "the ledger did not answer in time",
            StoreErrorKind::Fenced => {
                "the ledger refused a write from a stale owner (its lease was taken over)"
            }
            StoreErrorKind::Corrupt => "a ledger record could not be decoded",
            StoreErrorKind::Full if self.never_fits => {
                "the operation is heavier than the ledger's whole budget: it can never fit \
                 (waiting will not help; raise the budget or lower the body limit)"
            }
            StoreErrorKind::Full => {
                "the ledger is full of records it must keep; refusing new operations"
            }
        };
        f.write_str(what)?;
        if let Some(room_in) = self.room_in {
            write!(f, " (room frees up in {})", Seconds(room_in))?;
        }
        match &self.source {
            Some(source) => write!(f, ": {source}"),
            None => Ok(()),
        }
    }
}

/// A duration as a person reads it in a message: whole seconds, or milliseconds under one.
pub(crate) struct Seconds(pub(crate) Duration);

impl fmt::Display for Seconds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.as_secs() {
            0 => write!(f, "{} ms", self.0.as_millis()),
            secs => write!(f, "{} s", secs + u64::from(self.0.subsec_nanos() > 0)),
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_ref()
            .map(|source| &**source as &(dyn std::error::Error + 'static))
    }
}
