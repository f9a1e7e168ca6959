//! Collecting a body under a limit, from the declared length and frame by frame.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::header::{HeaderValue, CONTENT_LENGTH};
use http::{HeaderMap, Request};
use http_body::Body;
use http_body_util::BodyExt;

use crate::Error;

/// Read a request's whole body under `limit` (checked from `Content-Length` and the size
/// hint before reading, and while reading), keeping its head as it is. For callers that
/// need the bytes but not a [`FrozenRequest`] (the server face never stores one).
pub(crate) async fn collect_request<B>(
    req: Request<B>,
    limit: usize,
) -> Result<(http::request::Parts, Bytes), Error>
where
    B: Body,
    B::Error: Into<crate::BoxError>,
{
    let (parts, body) = req.into_parts();
    check_declared_length(&parts.headers, &body, limit)?;
    let body = collect_limited(body, limit).await?;
    Ok((parts, body))
}

/// Read the body frame by frame, stopping the moment it passes `limit`.
pub(super) async fn collect_limited<B>(body: B, limit: usize) -> Result<Bytes, Error>
where
    B: Body,
    B::Error: Into<crate::BoxError>,
{
    let mut collected = Collected::new(&body, limit);
    let mut body = std::pin::pin!(body);
    while let Some(frame) = body.frame().await {
        collected.push_frame(frame)?;
    }
    Ok(collected.take())
}

pin_project_lite::pin_project! {
    /// [`collect_request`] as a named future, for hand-written futures that hold one
    /// (the `async fn` stays for `async` callers: nested in theirs, it compiles smaller).
    pub(crate) struct CollectRequest<B> {
        #[pin]
        body: B,
        parts: Option<http::request::Parts>,
        collected: Collected,
    }
}

impl<B: Body> CollectRequest<B> {
    /// Start reading the body of a request already taken apart, once
    /// [`check_declared_length`] let it through. Infallible, so that a caller can build it
    /// straight into the future that holds it.
    #[inline(always)]
    pub(crate) fn checked(parts: http::request::Parts, body: B, limit: usize) -> Self {
        Self {
            collected: Collected::new(&body, limit),
            body,
            parts: Some(parts),
        }
    }
}

impl<B> Future for CollectRequest<B>
where
    B: Body,
    B::Error: Into<crate::BoxError>,
{
    type Output = Result<(http::request::Parts, Bytes), Error>;

    // Inlined, so that the head it hands back is read where it lands, not moved there.
    #[inline(always)]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        while let Some(frame) = std::task::ready!(this.body.as_mut().poll_frame(cx)) {
            this.collected.push_frame(frame)?;
        }
        let parts = this
            .parts
            .take()
            .expect("CollectRequest polled after completion");
        Poll::Ready(Ok((parts, this.collected.take())))
    }
}

/// Refuse before reading a byte when the sender already says the body is too large.
pub(crate) fn check_declared_length<B: Body>(
    headers: &HeaderMap,
    body: &B,
    limit: usize,
) -> Result<(), Error> {
    check_length(declared_length(headers.get(CONTENT_LENGTH)), body, limit)
}

/// The length a `Content-Length` value declares, when it is a number.
pub(crate) fn declared_length(content_length: Option<&HeaderValue>) -> Option<u64> {
    content_length
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.trim().parse::<u64>().ok())
}

/// [`check_declared_length`] of a request whose `Content-Length` declares `declared`.
pub(crate) fn check_length<B: Body>(
    declared: Option<u64>,
    body: &B,
    limit: usize,
) -> Result<(), Error> {
    let hinted = body.size_hint().exact().or(Some(body.size_hint().lower()));
    let known = declared.into_iter().chain(hinted).max();
    match known {
        Some(len) if len > limit as u64 => Err(Error::body_too_large(limit, Some(len))),
        _ => Ok(()),
    }
}

/// A body read frame by frame, stopping the moment it passes `limit`. A single-chunk body
/// (the common `Full<Bytes>` case) is kept without a copy.
pub(super) struct Collected {
    limit: usize,
    /// What the body says it will hold (hyper knows it from Content-Length), so a body
    /// that arrives in chunks is joined into one allocation of the right size, not doubled
    /// into.
    expected: usize,
    first: Option<Bytes>,
    rest: Option<BytesMut>,
    total: usize,
}

impl Collected {
    fn new<B: Body>(body: &B, limit: usize) -> Self {
        Self {
            limit,
            expected: usize::try_from(body.size_hint().lower()).map_or(limit, |n| n.min(limit)),
            first: None,
            rest: None,
            total: 0,
        }
    }

    /// Take a frame the body yielded: its data, if it is data (trailers are not frozen).
    fn push_frame<D: bytes::Buf, E: Into<crate::BoxError>>(
        &mut self,
        frame: Result<http_body::Frame<D>, E>,
    ) -> Result<(), Error> {
        let frame = frame.map_err(|err| Error::body(err.into()))?;
        match frame.into_data() {
            Ok(mut chunk) => self.push(chunk.copy_to_bytes_all()),
            Err(_trailers) => Ok(()),
        }
    }

    fn push(&mut self, chunk: Bytes) -> Result<(), Error> {
        self.total = self.total.saturating_add(chunk.len());
        if self.total > self.limit {
            return Err(Error::body_too_large(self.limit, None));
        }
        match (&mut self.first, &mut self.rest) {
            (None, _) => self.first = Some(chunk),
            (Some(head), None) => {
                let mut buf = BytesMut::with_capacity(self.expected.max(head.len() + chunk.len()));
                buf.extend_from_slice(head);
                buf.extend_from_slice(&chunk);
                self.rest = Some(buf);
            }
            (Some(_), Some(buf)) => buf.extend_from_slice(&chunk),
        }
        Ok(())
    }

    fn take(&mut self) -> Bytes {
        match (self.first.take(), self.rest.take()) {
            (_, Some(buf)) => buf.freeze(),
            (Some(only), None) => only,
            (None, None) => Bytes::new(),
        }
    }
}

/// Turn any [`bytes::Buf`] into [`Bytes`], without a copy when it already is one.
pub(super) trait CopyToBytesAll {
    fn copy_to_bytes_all(&mut self) -> Bytes;
}

impl<T: bytes::Buf> CopyToBytesAll for T {
    fn copy_to_bytes_all(&mut self) -> Bytes {
        let len = self.remaining();
        self.copy_to_bytes(len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    use http::Method;
    use http_body_util::Full;

    use crate::fingerprint::Fingerprint;
    use crate::FrozenRequest;

    /// A body that arrives in several frames and does not announce its length.
    struct Chunked(VecDeque<&'static [u8]>);

    impl Body for Chunked {
        type Data = Bytes;
        type Error = std::io::Error;
        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
            Poll::Ready(
                self.0
                    .pop_front()
                    .map(|chunk| Ok(http_body::Frame::data(Bytes::from_static(chunk)))),
            )
        }
    }

    fn chunked(chunks: &[&'static [u8]]) -> Request<Chunked> {
        Request::post("/x")
            .body(Chunked(chunks.iter().copied().collect()))
            .unwrap()
    }

    #[tokio::test]
    async fn chunked_body_is_joined_and_fingerprinted_once() {
        let (frozen, _) = FrozenRequest::freeze(chunked(&[b"ab", b"cd", b"ef"]), 6)
            .await
            .unwrap();
        assert_eq!(frozen.body().as_ref(), b"abcdef");
        assert_eq!(
            frozen.fingerprint(),
            Fingerprint::of(&Method::POST, "/x", b"abcdef")
        );
    }

    #[tokio::test]
    async fn limit_is_enforced_while_streaming() {
        let err = FrozenRequest::freeze(chunked(&[b"ab", b"cd", b"ef"]), 5)
            .await
            .unwrap_err();
        assert!(err.is_body_too_large());
    }

    #[tokio::test]
    async fn limit_is_enforced_from_content_length_before_reading() {
        let mut req = chunked(&[b"ab"]);
        req.headers_mut()
            .insert(CONTENT_LENGTH, http::HeaderValue::from_static("10"));
        let err = FrozenRequest::freeze(req, 5).await.unwrap_err();
        assert!(err.is_body_too_large());
    }

    #[tokio::test]
    async fn single_chunk_is_not_copied() {
        let body = Bytes::from(vec![7u8; 64]);
        let ptr = body.as_ptr();
        let req = Request::post("/x").body(Full::new(body)).unwrap();
        let (frozen, _) = FrozenRequest::freeze(req, 1024).await.unwrap();
        assert_eq!(frozen.body().as_ptr(), ptr);
        let rebuilt = frozen
            .to_request()
            .into_body()
            .collect()
            .await
            .unwrap()
            .to_bytes();
        assert_eq!(rebuilt.as_ptr(), ptr);
    }
}
