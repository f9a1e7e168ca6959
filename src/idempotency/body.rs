use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

pin_project! {
    /// The response body of the [`IdempotencyLayer`](crate::IdempotencyLayer), both faces.
    ///
    /// A recorded or replayed response is one buffer; a response over the recording cap is
    /// the part read so far followed by the rest of the inner body, so the caller receives
    /// it whole; a call outside the ledger is the inner body untouched.
    pub struct ResponseBody<B> {
        #[pin]
        kind: Kind<B>,
    }
}

pin_project! {
    #[project = KindProj]
    enum Kind<B> {
        Buffered { bytes: Option<Bytes> },
        Overflow { prefix: Option<Bytes>, #[pin] rest: B },
        Inner { #[pin] body: B },
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn buffered(bytes: Bytes) -> Self {
        Self {
            kind: Kind::Buffered {
                bytes: (!bytes.is_empty()).then_some(bytes),
            },
        }
    }

    pub(crate) fn overflow(prefix: Bytes, rest: B) -> Self {
        Self {
            kind: Kind::Overflow {
                prefix: Some(prefix),
                rest,
            },
        }
    }

    pub(crate) fn inner(body: B) -> Self {
        Self {
            kind: Kind::Inner { body },
        }
    }
}

impl<B> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &self.kind {
            Kind::Buffered { .. } => "Buffered",
            Kind::Overflow { .. } => "Overflow",
            Kind::Inner { .. } => "Inner",
        };
        f.debug_struct("ResponseBody").field("kind", &kind).finish()
    }
}

impl<B> Body for ResponseBody<B>
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
            KindProj::Overflow { prefix, rest } => match prefix.take() {
                Some(prefix) => Poll::Ready(Some(Ok(Frame::data(prefix)))),
                None => rest.poll_frame(cx),
            },
            KindProj::Inner { body } => body.poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match &self.kind {
            Kind::Buffered { bytes } => bytes.is_none(),
            Kind::Overflow { prefix, rest } => prefix.is_none() && rest.is_end_stream(),
            Kind::Inner { body } => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match &self.kind {
            Kind::Buffered { bytes } => {
                SizeHint::with_exact(bytes.as_ref().map_or(0, |b| b.len() as u64))
            }
            Kind::Overflow { prefix, rest } => {
                let extra = prefix.as_ref().map_or(0, |b| b.len() as u64);
                let inner = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(inner.lower() + extra);
                if let Some(upper) = inner.upper() {
                    hint.set_upper(upper + extra);
                }
                hint
            }
            Kind::Inner { body } => body.size_hint(),
        }
    }
}

/// A response body read up to a cap.
pub(crate) enum Buffered<B> {
    /// The whole body fit.
    Whole(Bytes),
    /// The body passed the cap: what was read, and the unread rest.
    Overflow(Bytes, B),
}

/// Read `body` until its end or until more than `cap` bytes arrived.
pub(crate) async fn buffer_up_to<B>(body: B, cap: usize) -> Result<Buffered<B>, B::Error>
where
    B: Body<Data = Bytes> + Unpin,
{
    use http_body_util::BodyExt;
    let mut body = body;
    let mut first: Option<Bytes> = None;
    let mut joined: Option<bytes::BytesMut> = None;
    let mut total = 0usize;
    while let Some(frame) = body.frame().await {
        let Ok(chunk) = frame?.into_data() else {
            continue; // trailers are not recorded
        };
        total += chunk.len();
        match (&first, &mut joined) {
            (None, _) => first = Some(chunk),
            (Some(head), None) => {
                let mut buf = bytes::BytesMut::with_capacity(head.len() + chunk.len());
                buf.extend_from_slice(head);
                buf.extend_from_slice(&chunk);
                joined = Some(buf);
            }
            (Some(_), Some(buf)) => buf.extend_from_slice(&chunk),
        }
        if total > cap {
            let read = joined.map(|b| b.freeze()).or(first).unwrap_or_default();
            return Ok(Buffered::Overflow(read, body));
        }
    }
    Ok(Buffered::Whole(
        joined.map(|b| b.freeze()).or(first).unwrap_or_default(),
    ))
}
