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
pub(crate) fn buffer_up_to<B>(body: B, cap: usize) -> BufferUpTo<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    BufferUpTo {
        body: Some(body),
        first: None,
        joined: None,
        total: 0,
        cap,
    }
}

/// [`buffer_up_to`]'s future. A body of one frame (the common case) is kept as it came,
/// never copied.
pub(crate) struct BufferUpTo<B> {
    /// Taken when done: the unread rest of an overflowing body goes with what was read.
    body: Option<B>,
    first: Option<Bytes>,
    /// The frames so far, joined, from the second frame on.
    joined: Option<bytes::BytesMut>,
    total: usize,
    cap: usize,
}

impl<B> BufferUpTo<B> {
    fn take_read(&mut self) -> Bytes {
        match self.joined.take() {
            Some(joined) => joined.freeze(),
            None => self.first.take().unwrap_or_default(),
        }
    }

    fn push(&mut self, chunk: Bytes) {
        self.total += chunk.len();
        match (&self.first, &mut self.joined) {
            (None, _) => self.first = Some(chunk),
            (Some(head), None) => {
                let mut buf = bytes::BytesMut::with_capacity(head.len() + chunk.len());
                buf.extend_from_slice(head);
                buf.extend_from_slice(&chunk);
                self.joined = Some(buf);
            }
            (Some(_), Some(buf)) => buf.extend_from_slice(&chunk),
        }
    }
}

impl<B> std::future::Future for BufferUpTo<B>
where
    B: Body<Data = Bytes> + Unpin,
{
    type Output = Result<Buffered<B>, B::Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        loop {
            let body = this
                .body
                .as_mut()
                .expect("BufferUpTo polled after completion");
            let Some(frame) = std::task::ready!(Pin::new(body).poll_frame(cx)) else {
                this.body = None;
                return Poll::Ready(Ok(Buffered::Whole(this.take_read())));
            };
            let frame = match frame {
                Ok(frame) => frame,
                Err(err) => {
                    this.body = None;
                    return Poll::Ready(Err(err));
                }
            };
            let Ok(chunk) = frame.into_data() else {
                continue; // trailers are not recorded
            };
            this.push(chunk);
            if this.total > this.cap {
                let read = this.take_read();
                let rest = this.body.take().expect("still reading");
                return Poll::Ready(Ok(Buffered::Overflow(read, rest)));
            }
        }
    }
}
