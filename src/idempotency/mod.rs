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
//! ([`client::Builder::on_outcome`](crate::client::Builder::on_outcome),
//! [`server::Builder::on_outcome`](crate::server::Builder::on_outcome)) calls a hook once per request that reached the
//! ledger, with an [`OutcomeEvent`]: the face, the last decision, the key's digest, the
//! status when there was a response, and the time taken. Unset, it costs nothing.

pub(crate) mod body;
pub(crate) mod decision;
pub(crate) mod engine;
pub(crate) mod hold;
pub(crate) mod layer;
pub(crate) mod reconcile;
pub(crate) mod scope;
pub(crate) mod source;
pub(crate) mod wiring;

pub use body::ResponseBody;
#[cfg(feature = "reqwest-middleware")]
pub(crate) use decision::request_span;
pub use decision::{Decision, Face, OutcomeEvent, Signal};
pub(crate) use engine::BusyPolicy;
pub(crate) use engine::{LeaseGuard, Ledger};
pub use layer::Idempotency;
pub(crate) use layer::IdempotencyLayer;
pub(crate) use reconcile::ask as ask_reconciler;
pub use reconcile::{
    record_or_not_found, InDoubtOperation, LookupReconciler, Reconcile, ReconcileFuture, Reconciled,
};
