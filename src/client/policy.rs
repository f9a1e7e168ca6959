//! What the client face does with a regenerated payload, and how it tells the caller.

use crate::error::Drift;

/// What to do when an operation comes back with a different payload (*drift*).
///
/// The default depends on who named the operation (see
/// [`Builder::drift_policy`](super::Builder::drift_policy)): [`ResendFrozen`](Self::ResendFrozen) for an
/// [`OperationId`](crate::OperationId), [`Reject`](Self::Reject) for a caller's own
/// `Idempotency-Key`.
///
/// ```
/// use tower_idempotency::KeyHeader;
/// use tower_idempotency::{ledger::MemoryStore, DriftPolicy, IdempotencyLayer};
///
/// // Refuse regenerated payloads even under an `OperationId`.
/// let layer = IdempotencyLayer::client_builder(MemoryStore::new()).provider_deduplicates(true).key_header(KeyHeader::ietf())
///     .drift_policy(DriftPolicy::Reject)
///     .build()
///     .unwrap();
/// # let _ = layer;
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum DriftPolicy {
    /// Refuse with a [drift error](crate::Error::is_drift) naming the changed JSON fields;
    /// nothing is sent. The operation stays as it was: only a run with the first payload
    /// finishes it. Where [defining fields](super::Builder::defining_fields) are declared,
    /// only a change to them is refused: other fields are discarded and named, as under
    /// [`ResendFrozen`](Self::ResendFrozen).
    Reject,
    /// Continue the operation with the bytes first frozen, never the new ones: resend them
    /// if in doubt, replay the outcome if completed. The response carries a
    /// [`PayloadDiscarded`] naming what the discarded payload changed.
    ///
    /// Only a regenerated **body** is discarded: a request whose method or target changed
    /// (an operation first sent to `/charges` coming back for `/refunds`) is refused with a
    /// drift error naming the changed part, nothing sent, under this policy as under
    /// [`Reject`](Self::Reject); so is a changed
    /// [defining field](super::Builder::defining_fields).
    ResendFrozen,
}

/// A response extension: the request handed in was **not** sent, because its operation
/// was first sent with another payload, and this response is that operation's (resent from
/// the bytes first frozen, or replayed). Set whenever a drift was resolved without a
/// refusal: under [`DriftPolicy::ResendFrozen`] (the default for an
/// [`OperationId`](crate::OperationId)), or when only fields outside the
/// [defining fields](super::Builder::defining_fields) changed.
///
/// ```
/// use bytes::Bytes;
/// use http::Request;
/// use http_body_util::Full;
/// use tower::{ServiceBuilder, ServiceExt};
/// use tower_idempotency::KeyHeader;
/// use tower_idempotency::testing::SideEffectService;
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer, OperationId, PayloadDiscarded, ProviderKeys};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_idempotency::Error> {
/// let provider = SideEffectService::new();
/// let client = ServiceBuilder::new()
///     .layer(IdempotencyLayer::client(MemoryStore::new(), ProviderKeys::Deduplicates, KeyHeader::ietf()))
///     .service(provider.clone());
/// let charge = |summary: &str| {
///     let body = format!(r#"{{"order_id":"order_42","amount_cents":1999,"summary":"{summary}"}}"#);
///     let mut req = Request::post("http://payments.local/charges").body(Full::new(Bytes::from(body))).unwrap();
///     req.extensions_mut().insert(OperationId::new("task-7", "charge_customer"));
///     req
/// };
///
/// client.clone().oneshot(charge("Order 42")).await?;
/// // The orchestrator re-ran the step and the model reworded the call.
/// let again = client.clone().oneshot(charge("Charge for order 42")).await?;
/// let discarded = again.extensions().get::<PayloadDiscarded>().expect("told");
/// assert_eq!(discarded.changed_fields(), Some(&["summary".to_owned()][..]));
/// assert_eq!(provider.effects(), 1);
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PayloadDiscarded {
    drift: Drift,
}

impl PayloadDiscarded {
    pub(super) fn new(drift: Drift) -> Self {
        Self { drift }
    }

    /// How the discarded request differed from the one first sent.
    pub fn drift(&self) -> &Drift {
        &self.drift
    }

    /// The top-level JSON fields the discarded payload changed, sorted; `None` when
    /// either payload is not a JSON object (see [`Drift::changed_fields`]).
    pub fn changed_fields(&self) -> Option<&[String]> {
        self.drift.changed_fields()
    }
}
