//! [`ResponseSource`]: where a client response came from.

use http::{Extensions, Response};

/// Where a response came from, as the client [`IdempotencyLayer`](crate::IdempotencyLayer)
/// tells it. (The server face marks replays with the `Idempotent-Replayed: true` header
/// instead.)
///
/// The layer marks a response (a response extension) only when it did not simply come back
/// from the one send of a new operation: a replay, a resend, a reconciled outcome or an
/// unprotected side effect. The common answer, [`Sent`](Self::Sent), carries no mark, so
/// that it costs the response nothing (an extension would cost three allocations: the
/// extensions' map, its table and the boxed value). Read it with [`of`](Self::of), which
/// answers `Sent` for an unmarked response, or
/// [`in_extensions`](Self::in_extensions) where only the extensions are at hand (a
/// `reqwest::Response`).
///
/// ```
/// use http::Response;
/// use tower_idempotency::ResponseSource;
///
/// let mut replayed = Response::new(());
/// replayed.extensions_mut().insert(ResponseSource::Replayed);
/// assert_eq!(ResponseSource::of(&replayed), ResponseSource::Replayed);
/// assert_eq!(ResponseSource::of(&Response::new(())), ResponseSource::Sent);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ResponseSource {
    /// Sent by this call and answered: a new operation, or a request that is no side
    /// effect. Such a response carries no mark. "Sent" counts the operation, not its
    /// attempts: a retry layer inside may have sent it more than once (then the response
    /// carries [`Attempts`](crate::retry::Attempts)), which is one effect where the
    /// provider deduplicates on the key (see
    /// [`provider_deduplicates`](crate::client::Builder::provider_deduplicates)).
    Sent,
    /// An attempt of the operation may have reached the provider, and its frozen bytes
    /// were sent again under its key: the operation was in doubt and was resumed, or a retry
    /// inside the face followed a failure that may have arrived (see
    /// [`Signal::ResentInDoubt`](crate::idempotency::Signal::ResentInDoubt)).
    Resent,
    /// The recorded response of a completed operation; the inner service was not called.
    Replayed,
    /// The operation was in doubt and its [reconciler](crate::idempotency::Reconcile) found
    /// it had happened: this is the provider's response (or the reconciler's stand-in), now
    /// recorded; nothing was sent again.
    Reconciled,
    /// A side effect without an [`OperationId`](crate::OperationId) or an `Idempotency-Key`:
    /// sent once, outside the ledger, unprotected against a caller's own retry. See
    /// [`client::Builder::require_key`](crate::client::Builder::require_key).
    Unprotected,
}

impl ResponseSource {
    /// Where `response` came from: its mark, or [`Sent`](Self::Sent) when it has none.
    ///
    /// ```
    /// use http::Response;
    /// use tower_idempotency::ResponseSource;
    ///
    /// let mut resent = Response::new(());
    /// resent.extensions_mut().insert(ResponseSource::Resent);
    /// assert_eq!(ResponseSource::of(&resent), ResponseSource::Resent);
    /// ```
    pub fn of<B>(response: &Response<B>) -> Self {
        Self::in_extensions(response.extensions())
    }

    /// Where the response with these extensions came from: its mark, or
    /// [`Sent`](Self::Sent) when it has none (for a `reqwest::Response`, whose extensions
    /// are all that is left of the `http::Response`).
    ///
    /// ```
    /// use http::Extensions;
    /// use tower_idempotency::ResponseSource;
    ///
    /// let mut extensions = Extensions::new();
    /// assert_eq!(ResponseSource::in_extensions(&extensions), ResponseSource::Sent);
    /// extensions.insert(ResponseSource::Replayed);
    /// assert_eq!(ResponseSource::in_extensions(&extensions), ResponseSource::Replayed);
    /// ```
    pub fn in_extensions(extensions: &Extensions) -> Self {
        extensions.get::<Self>().copied().unwrap_or(Self::Sent)
    }

    /// Mark a response's `extensions` with this source; `Sent` leaves them as they are.
    pub(crate) fn mark(self, extensions: &mut Extensions) {
        if self != Self::Sent {
            extensions.insert(self);
        }
    }
}
