//! Operation identities, idempotency keys and how one is derived from the other.
//!
//! An orchestrator owns two identifiers that never change across retries of one logical
//! step: the task it is running and the step within it. [`OperationId`] carries them in a
//! request's extensions; [`IdempotencyKey`] is the 32-byte key derived from them.
//!
//! # Derivation (stable across releases)
//!
//! ```text
//! key = SHA-256( "tower-idempotency/key/v1"
//!                || u64_be(len(scope))   || scope
//!                || u64_be(len(task_id)) || task_id
//!                || u64_be(len(step_id)) || step_id )
//! ```
//!
//! Every field is prefixed with its length in bytes as a big-endian `u64`, so no two
//! different triples encode to the same bytes: `("ab", "c")` and `("a", "bc")` differ.
//! The leading version tag lets a future derivation coexist with this one. The key is
//! shown as 64 lowercase hex digits and sent, by default, as an RFC 8941 sf-string:
//! `Idempotency-Key: "<hex>"`. A provider that names or spells the key otherwise
//! (`Idempotency-Key: <hex>` for Stripe, `PayPal-Request-Id: <hex>`) is described by a
//! [`KeyHeader`].
//!
//! # Example
//!
//! ```
//! use tower_idempotency::{IdempotencyKey, OperationId};
//!
//! let op = OperationId::new("task-7", "charge-customer");
//! let key = op.key("billing");
//! assert_eq!(key, IdempotencyKey::derive("billing", "task-7", "charge-customer"));
//! assert_eq!(key.to_hex().len(), 64);
//! assert_eq!(key.header_value().to_str().unwrap(), format!("\"{}\"", key.to_hex()));
//! ```

use http::header::HeaderName;

pub(crate) mod derived;
mod grammar;
pub(crate) mod header;
pub(crate) mod operation;
mod wire;

pub(crate) use derived::IdempotencyKey;
pub(crate) use derived::{
    hex, length_prefixed_sha256, shared_header_value, update_length_prefixed,
};
pub(crate) use header::{HeaderKey, InvalidKey};
pub(crate) use operation::OperationId;
pub use wire::{KeyForm, KeyHeader};

/// The `Idempotency-Key` header name (draft-ietf-httpapi-idempotency-key-header).
pub static IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// The longest key accepted from a header, per the IETF draft's guidance.
pub const MAX_KEY_LEN: usize = 255;
