use std::sync::Arc;

use tower_layer::Layer;

use super::policy::RetryPolicy;
use super::service::FrozenRetry;

/// Wraps a service in [`FrozenRetry`]: freeze once, resend the frozen bytes on every retry.
///
/// The inner service takes `Request<Full<Bytes>>` (whatever body you send in) and must be
/// `Clone + Send + 'static`: each attempt is sent through a clone.
///
/// See the [module docs](crate::retry) for an example.
#[derive(Clone, Debug, Default)]
#[must_use = "a layer does nothing until it wraps a service"]
pub struct FrozenRetryLayer {
    policy: Arc<RetryPolicy>,
}

impl FrozenRetryLayer {
    /// A layer retrying per `policy`.
    pub fn new(policy: RetryPolicy) -> Self {
        Self {
            policy: Arc::new(policy),
        }
    }

    /// The policy this layer applies.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }
}

impl<S> Layer<S> for FrozenRetryLayer {
    type Service = FrozenRetry<S>;

    fn layer(&self, inner: S) -> Self::Service {
        FrozenRetry::from_shared(inner, self.policy.clone())
    }
}
