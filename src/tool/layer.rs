//! [`ToolLayer`]: the tool face as a tower layer.

use std::fmt;
use std::sync::Arc;

use tower_layer::Layer;

use super::face::ToolFace;
use super::service::ToolService;
use super::types::MayHaveHappened;

/// Protects a tool: a [`Layer`] for any `tower::Service<ToolCall<A>>`. See the
/// [module docs](super) for what it does and an example.
///
/// Clones share one face (one ledger handle, one configuration).
///
/// ```
/// use tower::{service_fn, ServiceBuilder, ServiceExt};
/// use tower_idempotency::ledger::MemoryStore;
/// use tower_idempotency::tool::{ProviderKeys, ToolCall, ToolLayer};
/// use tower_idempotency::OperationId;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let layer = ToolLayer::builder(MemoryStore::new(), "page_oncall", ProviderKeys::Ignored).build().unwrap();
/// let page = ServiceBuilder::new().layer(layer).service(service_fn(|call: ToolCall<String>| async move {
///     Ok::<_, std::io::Error>(format!("paged: {}", call.arguments()))
/// }));
/// let out = page.oneshot(ToolCall::new(OperationId::new("incident-9", "page"), "db down".into())).await.unwrap();
/// assert_eq!(out.value(), "paged: db down");
/// # }
/// ```
pub struct ToolLayer<C = MayHaveHappened> {
    pub(crate) face: Arc<ToolFace<C>>,
}

impl<C> Clone for ToolLayer<C> {
    fn clone(&self) -> Self {
        Self {
            face: self.face.clone(),
        }
    }
}

impl<C> fmt::Debug for ToolLayer<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolLayer")
            .field("face", &self.face)
            .finish()
    }
}

impl<S, C> Layer<S> for ToolLayer<C> {
    type Service = ToolService<S, C>;

    fn layer(&self, inner: S) -> Self::Service {
        ToolService {
            wiring: crate::idempotency::wiring::Wiring::of::<S>(),
            inner,
            face: self.face.clone(),
        }
    }
}
