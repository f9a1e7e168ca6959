//! The retry service: each call frozen once, then sent until the policy stops it.

use crate::key::KeyHeader;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Extensions, Request, Response};
use http_body::Body;
use http_body_util::Full;
use tower_service::Service;

use super::call::Call;
use super::future::{Attempting, FrozenAttempts, ResponseFuture, State};
use super::policy::RetryPolicy;
use super::FrozenRetryLayer;
use crate::frozen::{check_declared_length, CollectRequest, FrozenRequest};
use crate::phase::FailurePhase;
use crate::{BoxError, Error};

/// Resends the exact frozen bytes of a request on retry. See the [module docs](crate::retry).
#[derive(Clone, Debug)]
pub struct FrozenRetry<S> {
    inner: S,
    policy: Arc<RetryPolicy>,
}

impl<S> FrozenRetry<S> {
    /// Wrap `inner` with `policy`.
    pub fn new(inner: S, policy: RetryPolicy) -> Self {
        Self {
            inner,
            policy: Arc::new(policy),
        }
    }

    pub(crate) fn from_shared(inner: S, policy: Arc<RetryPolicy>) -> Self {
        Self { inner, policy }
    }

    /// A layer wrapping services with `policy`.
    pub fn layer(policy: RetryPolicy) -> FrozenRetryLayer {
        FrozenRetryLayer::new(policy)
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwrap the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S> FrozenRetry<S> {
    /// All attempts of `frozen`, handed over by the client layer of a stack built as one
    /// ([`ClientStack`](crate::client::ClientStack)): no request to read and freeze again,
    /// no hand-off through the extensions. `self` is the instance the caller drove to
    /// readiness; `key_ignored` says the server ignores its key, `key_header` is where the
    /// client layer puts it (`None`: the policy's).
    #[inline(always)]
    pub(crate) fn send_frozen(
        self,
        frozen: FrozenRequest,
        extensions: Extensions,
        (key_ignored, key_header): (bool, Option<KeyHeader>),
    ) -> FrozenAttempts<S>
    where
        S: Service<Request<Full<Bytes>>>,
    {
        let call = Call::handed(frozen, extensions, !key_ignored, key_header, &self.policy);
        Attempting {
            state: State::Readying { first: None },
            inner: self.inner,
            policy: self.policy,
            call: Some(call),
        }
    }
}

impl<S, B, ResBody> Service<Request<B>> for FrozenRetry<S>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>> + Clone,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
{
    type Response = Response<ResBody>;
    type Error = Error;
    type Future = ResponseFuture<S, B>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        // Nothing has been sent when readiness fails.
        self.inner
            .poll_ready(cx)
            .map_err(|err| Error::inner(err.into(), FailurePhase::PreWrite))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // Take the instance that was driven to readiness; leave a clone in its place.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        // The head and body are moved once, into the state: no `Result` of them between.
        let (parts, body) = req.into_parts();
        let limit = self.policy.body_limit;
        let state = match check_declared_length(&parts.headers, &body, limit) {
            Ok(()) => State::Freezing {
                collect: CollectRequest::checked(parts, body, limit),
            },
            Err(error) => State::Refused { error: Some(error) },
        };
        ResponseFuture::new(state, inner, self.policy.clone())
    }
}
