//! The request body the server face hands its inner service.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// The request body the server [`IdempotencyLayer`](crate::IdempotencyLayer) passes
    /// to the service it wraps.
    ///
    /// A request that goes through the ledger was read whole (under the body limit) to
    /// fingerprint it, so its handler receives those buffered bytes: one frame, no copy.
    /// Every other request (reads, keyless requests when the key is optional) keeps its
    /// original body and streams untouched, so an upload route behind the same layer is
    /// neither buffered nor limited.
    ///
    /// axum handlers never see this type: axum wraps any body in its own
    /// `axum::body::Body`. A plain hyper service names it in its request type:
    ///
    /// ```
    /// use bytes::Bytes;
    /// use http::{Request, Response};
    /// use http_body_util::{BodyExt, Full};
    /// use tower::{service_fn, Layer};
    /// use tower_idempotency::{server::RequestBody, ledger::MemoryStore, IdempotencyLayer};
    ///
    /// let charge = service_fn(|req: Request<RequestBody<Full<Bytes>>>| async move {
    ///     let payload = req.into_body().collect().await?.to_bytes();
    ///     Ok::<_, std::convert::Infallible>(Response::new(Full::new(payload)))
    /// });
    /// let service = IdempotencyLayer::server(MemoryStore::new()).layer(charge);
    /// # let _ = service;
    /// ```
    pub struct RequestBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Buffered { bytes: Option<Bytes> },
        Streaming { #[pin] body: B },
    }
}

impl<B> RequestBody<B> {
    pub(crate) fn buffered(bytes: Bytes) -> Self {
        // An empty body is held as already ended: `is_end_stream` is then true from the
        // start, and the handler sees no body rather than one empty data frame.
        Self {
            kind: Kind::Buffered {
                bytes: (!bytes.is_empty()).then_some(bytes),
            },
        }
    }

    pub(crate) fn streaming(body: B) -> Self {
        Self {
            kind: Kind::Streaming { body },
        }
    }

    /// Whether this body was buffered by the layer (the request went through the ledger).
    ///
    /// ```
    /// # use bytes::Bytes;
    /// # use http::{Request, Response};
    /// # use http_body_util::Full;
    /// # use tower::{service_fn, ServiceExt};
    /// # use tower_idempotency::{server::RequestBody, ledger::MemoryStore, IdempotencyLayer};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let handler = service_fn(|req: Request<RequestBody<Full<Bytes>>>| async move {
    ///     let buffered = req.body().is_buffered();
    ///     Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(buffered.to_string()))))
    /// });
    /// let service = tower::Layer::layer(&IdempotencyLayer::server(MemoryStore::new()), handler);
    /// let read = Request::get("/charges").body(Full::new(Bytes::new())).unwrap();
    /// let response = service.oneshot(read).await.unwrap();
    /// # use http_body_util::BodyExt;
    /// assert_eq!(response.into_body().collect().await.unwrap().to_bytes(), "false");
    /// # }
    /// ```
    pub fn is_buffered(&self) -> bool {
        matches!(self.kind, Kind::Buffered { .. })
    }
}

impl<B> std::fmt::Debug for RequestBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.kind {
            Kind::Buffered { bytes } => f
                .debug_struct("RequestBody")
                .field("buffered", &bytes.as_ref().map_or(0, Bytes::len))
                .finish(),
            Kind::Streaming { .. } => f
                .debug_struct("RequestBody")
                .field("streaming", &true)
                .finish(),
        }
    }
}

impl<B> Body for RequestBody<B>
where
    B: Body<Data = Bytes>,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        match self.project().kind.project() {
            KindProj::Buffered { bytes } => Poll::Ready(bytes.take().map(|b| Ok(Frame::data(b)))),
            KindProj::Streaming { body } => body.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Buffered { bytes } => bytes.is_none(),
            Kind::Streaming { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            // Exact, as the bytes are all here: a consumer that sizes a buffer or a
            // `Content-Length` from the hint (a handler forwarding the body) gets the truth.
            Kind::Buffered { bytes } => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
            Kind::Streaming { body } => body.size_hint(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};

    #[tokio::test]
    async fn buffered_body_is_one_frame_with_an_exact_size() {
        let body = RequestBody::<Full<Bytes>>::buffered(Bytes::from_static(b"abc"));
        assert_eq!(body.size_hint().exact(), Some(3));
        assert!(!body.is_end_stream());
        assert_eq!(body.collect().await.unwrap().to_bytes(), "abc");
        let empty = RequestBody::<Full<Bytes>>::buffered(Bytes::new());
        assert!(empty.is_end_stream());
    }

    #[tokio::test]
    async fn streaming_body_passes_through() {
        let body = RequestBody::streaming(Full::new(Bytes::from_static(b"xyz")));
        assert!(!body.is_buffered());
        assert_eq!(body.collect().await.unwrap().to_bytes(), "xyz");
    }
}
