//! The double's response future.

use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::Response;
use http_body_util::Full;

/// What a call of a [`SideEffectService`](super::SideEffectService) resolves to.
pub(super) type CallResult = Result<Response<Full<Bytes>>, io::Error>;

/// The future a [`SideEffectService`](super::SideEffectService) call returns.
pub struct ResponseFuture {
    // Boxed: a call awaits the body, maybe a sleep or a spawned task, maybe forever.
    inner: Pin<Box<dyn Future<Output = CallResult> + Send>>,
}

impl ResponseFuture {
    pub(super) fn new(future: impl Future<Output = CallResult> + Send + 'static) -> Self {
        Self {
            inner: Box::pin(future),
        }
    }
}

impl Future for ResponseFuture {
    type Output = CallResult;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
