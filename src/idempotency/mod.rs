//! Exactly-once side effects: a ledger consulted before the effect fires.
//!
//! [`IdempotencyLayer`] has two faces over one ledger engine.
//!
//! # The client face
//!
//! For an orchestrator calling tools over HTTP: see [`client`](crate::client).
//!
//! # The server face
//!
//! In front of the handlers that perform the effects: see [`server`](crate::server).
//!
//! ## Decision events (both faces)
//!
//! Every ledger decision is one event `idempotency decision`, inside the request's span,
//! with the fields `idempotency.face` (`client`, `server`), `idempotency.decision`
//! (`acquired`, `replayed`, `resumed`, `busy`, `drift`, `in_doubt`, `released`, `full`,
//! `unavailable`, `reconciled`) and `idempotency.key.digest`: the first 16 hex digits of
//! `SHA-256("tower-idempotency/log/v1" || key)` over the `Idempotency-Key` as it travels
//! (unquoted). A client and the server it calls log the same digest for one operation, so
//! their logs join; neither logs the key itself, the scope or a credential. Levels: `WARN`
//! for `drift`, `full` and `unavailable`, `INFO` for `in_doubt`, `resumed` and `reconciled`, `DEBUG` for
//! the rest. The client span `idempotency` (`face = "client"`) carries the same digest as
//! `key`.
//!
//! For observability of your own, `on_outcome` on either builder
//! ([`ClientBuilder::on_outcome`](crate::client::ClientBuilder::on_outcome),
//! [`ServerBuilder::on_outcome`](crate::ServerBuilder::on_outcome)) calls a hook once per request that reached the
//! ledger, with an [`OutcomeEvent`]: the face, the last decision, the key's digest, the
//! status when there was a response, and the time taken. Unset, it costs nothing.

pub(crate) mod body;
pub(crate) mod decision;
pub(crate) mod engine;
mod layer;
pub(crate) mod reconcile;
pub(crate) mod release;
pub(crate) mod scope;

pub use body::ResponseBody;
#[cfg(feature = "reqwest-middleware")]
pub(crate) use decision::request_span;
pub use decision::{Decision, Face, OutcomeEvent};
pub use engine::BusyPolicy;
pub(crate) use engine::{LeaseGuard, Ledger};
pub(crate) use engine::{DEFAULT_LEASE, DEFAULT_RETENTION};
pub use layer::{Idempotency, IdempotencyLayer};
pub(crate) use reconcile::ask as ask_reconciler;
pub(crate) use reconcile::DEFAULT_RECONCILE_TIMEOUT;
pub use reconcile::{InDoubtOperation, LookupReconciler, Reconcile, ReconcileFuture, Reconciled};
pub use release::ReleaseOn;

/// Where a response came from: a response extension set by the client
/// [`IdempotencyLayer`] on every response of a side-effecting request. (The server face
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
    /// [`ClientBuilder::require_key`](crate::client::ClientBuilder::require_key).
    Unprotected,
}
