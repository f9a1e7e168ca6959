//! [`ToolService`]: a tool behind the ledger, and its future.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use serde::de::DeserializeOwned;
use serde::Serialize;
use tower_service::Service;

use super::face::ToolFace;
use super::operation::{run, Tower};
use super::types::{
    ClassifyToolError, MayHaveHappened, ToolCall, ToolClass, ToolError, ToolOutput,
};
use crate::idempotency::wiring::Wiring;

/// The service of a [`ToolLayer`](super::ToolLayer): answers a [`ToolCall`] with a [`ToolOutput`].
///
/// See [`ToolLayer`](super::ToolLayer) for an example.
pub struct ToolService<S, C = MayHaveHappened> {
    pub(super) inner: S,
    pub(super) face: Arc<ToolFace<C>>,
    /// What the type of `inner` shows (a retrying layer inside, refused for side effects).
    pub(super) wiring: Wiring,
}

impl<S: Clone, C> Clone for ToolService<S, C> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            face: self.face.clone(),
            wiring: self.wiring,
        }
    }
}

impl<S: fmt::Debug, C> fmt::Debug for ToolService<S, C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolService")
            .field("inner", &self.inner)
            .field("face", &self.face)
            .finish()
    }
}

/// The future of a [`ToolService`]: boxed, as it holds the operation's whole ledger
/// conversation and the tool's own future.
pub type ToolFuture<R, E> =
    Pin<Box<dyn Future<Output = Result<ToolOutput<R>, ToolError<E>>> + Send + 'static>>;

impl<S, C, A, R, E> Service<ToolCall<A>> for ToolService<S, C>
where
    S: Service<ToolCall<A>, Response = R, Error = E> + Clone + Send + 'static,
    S::Future: Send,
    C: ClassifyToolError<E>,
    A: Serialize + DeserializeOwned + Send + 'static,
    R: Serialize + DeserializeOwned + Send + 'static,
    E: Send + 'static,
{
    type Response = ToolOutput<R>;
    type Error = ToolError<E>;
    type Future = ToolFuture<R, E>;

    /// Always ready: the tool's own readiness is awaited inside the call, before each
    /// attempt (an operation may call it more than once), and before the attempt counts
    /// as sent: a caller that gives up while the tool is not ready, or a readiness error
    /// (a shed load), leaves nothing in doubt. For a side effect the attempt timeout bounds
    /// the call, not the wait: give the caller a deadline, or the tool a timeout of its own,
    /// to bound it. (A read or an idempotent write, outside the ledger, has both bounded.)
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, call: ToolCall<A>) -> Self::Future {
        // A retrying layer of tower's inside would call a side effect again, blind to the
        // ledger: refused before anything is claimed or called. Reads and idempotent
        // writes pass straight through anyway.
        if self.face.class == ToolClass::SideEffect {
            if let Err(refused) = self.wiring.check() {
                return Box::pin(std::future::ready(Err(ToolError::Idempotency(refused))));
            }
        }
        let inner = self.inner.clone();
        let face = self.face.clone();
        Box::pin(async move { run(&face, call, &mut Tower(inner)).await })
    }
}
