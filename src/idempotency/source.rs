//! [`ResponseSource`]: where a client response came from.

/// Where a response came from: a response extension set by the client
/// [`IdempotencyLayer`](crate::IdempotencyLayer) on every response of a side-effecting request. (The server face
/// marks replays with the `Idempotent-Replayed: true` header instead.)
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ResponseSource {
    /// The operation was sent for the first time.
    Sent,
    /// The operation was in doubt; its stored frozen bytes were sent again.
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
