//! [`ProviderKeys`]: whether the provider behind a face deduplicates on the key it is sent.

/// Whether the provider deduplicates on the key it is sent: a choice every face that
/// calls a provider states when it is built — an argument of
/// [`ToolLayer::builder`](crate::tool::ToolLayer::builder) and of
/// [`IdempotencyLayer::client`](crate::IdempotencyLayer::client), a required setting of
/// [`client::Builder`](crate::client::Builder::provider_keys) — since the safe answer
/// differs and no default is safe for both.
///
/// An operation is *in doubt* when an attempt failed after it may have reached the
/// provider (a timeout once the bytes left, a reset, a retryable answer after the last
/// retry). Sending it again is one effect only if the provider recognises the key.
///
/// ```
/// use tower_idempotency::KeyHeader;
/// use tower_idempotency::ledger::MemoryStore;
/// use tower_idempotency::tool::ToolLayer;
/// use tower_idempotency::{IdempotencyLayer, ProviderKeys};
///
/// // A payment API that honours `Idempotency-Key`: an in-doubt charge may be sent again.
/// let stripe = IdempotencyLayer::client(MemoryStore::new(), ProviderKeys::Deduplicates, KeyHeader::ietf());
/// // An SDK that ignores keys: an in-doubt call is never made again blindly.
/// let legacy = ToolLayer::builder(MemoryStore::new(), "charge_legacy", ProviderKeys::Ignored).build();
/// # let _ = (stripe, legacy.unwrap());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProviderKeys {
    /// The provider runs an operation at most once per key: an operation in doubt is sent
    /// again with the same key and the bytes (or arguments) first frozen, and an attempt
    /// that may have arrived may be retried.
    Deduplicates,
    /// The provider ignores keys (or reads another header): an operation in doubt is never
    /// sent again blindly. It is reconciled if a reconciler is set
    /// ([client](crate::client::Builder::reconcile), [tool](crate::tool::Builder::reconcile)),
    /// else reported as in doubt; an attempt that may have arrived is not retried. At most
    /// once, rather than exactly once, unless reconciled.
    Ignored,
}
