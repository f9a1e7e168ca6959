//! A gRPC answer as the server face records it, and back.
//!
//! The server face records a response's status, allow-listed headers and body; a gRPC
//! answer also has trailers, where its status, message and details travel. The handler's
//! answer is therefore handed to the face as one body: its trailers first, as a block,
//! then its data frames exactly as the handler wrote them. Every store keeps that body as
//! it keeps any other, so the trailers are recorded on each of them with no change to
//! records or schemas, and a replay unpacks them again.
//!
//! The block: one byte `0x80` (gRPC-Web's flag for a trailers frame), a `u32` count, then
//! for each trailer a `u16` name length, the name, a `u32` value length and the value (all
//! big-endian), the value's bytes as sent (`grpc-message` percent-encoded,
//! `grpc-status-details-bin` base64).
//!
//! When the request's fields were digested (its method's input message is named in the
//! descriptor set, see [`fields`](super::fields)), the block opens with `0x81` instead, and
//! the trailers are followed by the digests: a `u32` count, then each field's number
//! (`u32`) and its 8-byte digest. A body opening with `0x80` is read as before.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header::{HeaderName, HeaderValue, CONTENT_TYPE};
use http::{HeaderMap, Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tonic::Code;
use tower_service::Service;

use super::fields::{MessageDigests, RequestDigests};
use super::wire::{self, Pushback};
use crate::server::replay::NEVER_REPLAYED;
use crate::server::{NotProcessed, RequestBody};
use crate::BoxError;

/// The flag that opens a trailer block (gRPC-Web's trailers frame).
const TRAILERS_FLAG: u8 = 0x80;

/// The flag that opens a trailer block followed by the request's field digests.
const TRAILERS_AND_FIELDS_FLAG: u8 = 0x81;

/// The request metadata by which a client says which compressions it accepts. Taken off
/// a protected call before its handler sees it, so that no recorded answer is compressed:
/// a replay may go to a client that accepts no compression at all.
const ACCEPT_ENCODING: &str = "grpc-accept-encoding";

/// Pack `trailers`, the request's field digests if any, and `data` as one recorded body.
pub(super) fn pack(trailers: &HeaderMap, fields: Option<&MessageDigests>, data: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(5 + data.len() + 64);
    out.put_u8(if fields.is_some() {
        TRAILERS_AND_FIELDS_FLAG
    } else {
        TRAILERS_FLAG
    });
    out.put_u32(u32::try_from(trailers.len()).unwrap_or(u32::MAX));
    for (name, value) in trailers {
        out.put_u16(name.as_str().len() as u16);
        out.put_slice(name.as_str().as_bytes());
        out.put_u32(value.len() as u32);
        out.put_slice(value.as_bytes());
    }
    if let Some(fields) = fields {
        fields.write(&mut out);
    }
    out.put_slice(data);
    out.freeze()
}

/// A recorded body, unpacked.
#[derive(Debug)]
pub(super) struct Unpacked {
    pub(super) trailers: HeaderMap,
    /// The digests of the request's fields, when they were recorded.
    pub(super) fields: Option<MessageDigests>,
    pub(super) data: Bytes,
}

/// The trailers, field digests and data of a body [`pack`] made; `None` for anything else.
pub(super) fn unpack(mut body: Bytes) -> Option<Unpacked> {
    if body.len() < 5 {
        return None;
    }
    let with_fields = match body.get_u8() {
        TRAILERS_FLAG => false,
        TRAILERS_AND_FIELDS_FLAG => true,
        _ => return None,
    };
    let count = body.get_u32();
    let mut trailers = HeaderMap::new();
    for _ in 0..count {
        let name = take(&mut body, 2)?;
        let value = take(&mut body, 4)?;
        let name = HeaderName::from_bytes(&name).ok()?;
        let value = HeaderValue::from_maybe_shared(value).ok()?;
        trailers.append(name, value);
    }
    let fields = if with_fields {
        Some(MessageDigests::read(&mut body)?)
    } else {
        None
    };
    Some(Unpacked {
        trailers,
        fields,
        data: body,
    })
}

/// One length-prefixed field (a `u16` or `u32` length, by `width`).
fn take(body: &mut Bytes, width: usize) -> Option<Bytes> {
    if body.len() < width {
        return None;
    }
    let len = if width == 2 {
        usize::from(body.get_u16())
    } else {
        body.get_u32() as usize
    };
    (body.len() >= len).then(|| body.split_to(len))
}

/// The tonic service behind the server face: each call's answer gathered whole (headers,
/// data, trailers) and handed to the face as one packed body, with the digests of the
/// request's fields when the layer made them.
#[derive(Clone, Debug)]
pub(super) struct Recorded<S> {
    pub(super) inner: S,
    /// The face's [`ServerErrorPolicy`](crate::ServerErrorPolicy) is `Release`: a server
    /// error's status releases the key (see [`is_released`]).
    pub(super) release_server_errors: bool,
}

impl<S, B, ResBody> Service<Request<RequestBody<B>>> for Recorded<S>
where
    S: Service<Request<tonic::body::Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<PackedBody>;
    type Error = S::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Self::Response, S::Error>> + Send>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<RequestBody<B>>) -> Self::Future {
        let (mut parts, body) = req.into_parts();
        parts.headers.remove(ACCEPT_ENCODING);
        let fields = parts
            .extensions
            .remove::<RequestDigests>()
            .map(|RequestDigests(digests)| digests);
        let answer = self
            .inner
            .call(Request::from_parts(parts, tonic::body::Body::new(body)));
        let release_server_errors = self.release_server_errors;
        Box::pin(async move {
            let answer = answer.await?;
            Ok(gather(answer, fields, release_server_errors).await)
        })
    }
}

/// The answer read whole, its trailers (or a trailers-only answer's status) and the
/// request's field digests packed before its data. An answer whose body fails is handed on
/// failing, so the face holds the call in doubt rather than recording half of it.
async fn gather<ResBody>(
    answer: Response<ResBody>,
    fields: Option<MessageDigests>,
    release_server_errors: bool,
) -> Response<PackedBody>
where
    ResBody: Body<Data = Bytes>,
    ResBody::Error: Into<BoxError>,
{
    let (mut parts, body) = answer.into_parts();
    let collected = match body.collect().await {
        Ok(collected) => collected,
        Err(err) => return Response::from_parts(parts, PackedBody::failed(err.into())),
    };
    let mut trailers = collected.trailers().cloned().unwrap_or_default();
    if parts.headers.contains_key(wire::GRPC_STATUS) {
        trailers.extend(trailers_of_trailers_only(&mut parts.headers));
    }
    if is_released(&trailers, release_server_errors) {
        parts.extensions.insert(NotProcessed);
    }
    let data = collected.to_bytes();
    Response::from_parts(
        parts,
        PackedBody::whole(pack(&trailers, fields.as_ref(), &data)),
    )
}

/// The trailers of a trailers-only answer, taken out of its `headers`: every entry but its
/// `content-type` (a status's message, details and metadata all travel there), less what
/// must never outlive an answer (cookies, credentials, dates, hop-by-hop headers). Packed
/// as trailers, they are recorded as a normal answer's trailers are, whatever the face's
/// allow-list for headers says.
fn trailers_of_trailers_only(headers: &mut HeaderMap) -> HeaderMap {
    let mut trailers = HeaderMap::new();
    let mut kept = HeaderMap::new();
    let mut last = None;
    for (name, value) in std::mem::take(headers) {
        let name = name.or(last.clone()).expect("the first entry has a name");
        last = Some(name.clone());
        if name == CONTENT_TYPE {
            kept.append(name, value);
        } else if !NEVER_REPLAYED.contains(&name.as_str()) {
            trailers.append(name, value);
        }
    }
    *headers = kept;
    trailers
}

/// Whether the handler's status releases the key rather than being recorded:
///
/// - `UNAVAILABLE` or `RESOURCE_EXHAUSTED` with a `grpc-retry-pushback-ms`: the handler
///   turned the call away before doing anything and asks for it again, as an HTTP
///   handler's `503` with `Retry-After` does. Released whatever the policy, so the retry
///   runs.
/// - a server error (`INTERNAL`, `UNKNOWN`, `DATA_LOSS`, `UNAVAILABLE`: what gRPC makes of
///   HTTP's `5xx`), when the face's [`ServerErrorPolicy`](crate::ServerErrorPolicy) is
///   `Release`, as an HTTP handler's `5xx` is.
fn is_released(trailers: &HeaderMap, release_server_errors: bool) -> bool {
    let Some(code) = trailers
        .get(wire::GRPC_STATUS)
        .map(|code| Code::from_bytes(code.as_bytes()))
    else {
        return false;
    };
    let shed = matches!(code, Code::Unavailable | Code::ResourceExhausted)
        && matches!(wire::pushback(trailers), Pushback::After(_));
    shed || (release_server_errors && is_server_error(code))
}

/// The codes the [`ServerErrorPolicy`](crate::ServerErrorPolicy) applies to.
fn is_server_error(code: Code) -> bool {
    matches!(
        code,
        Code::Internal | Code::Unknown | Code::DataLoss | Code::Unavailable
    )
}

/// A packed answer, or the failure of the answer's body.
#[derive(Debug)]
pub(super) struct PackedBody {
    data: Option<Bytes>,
    failure: Option<BoxError>,
}

impl PackedBody {
    pub(super) fn whole(data: Bytes) -> Self {
        Self {
            data: Some(data),
            failure: None,
        }
    }

    pub(super) fn failed(err: BoxError) -> Self {
        Self {
            data: None,
            failure: Some(err),
        }
    }
}

impl Body for PackedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        if let Some(err) = self.failure.take() {
            return Poll::Ready(Some(Err(err)));
        }
        Poll::Ready(self.data.take().map(|data| Ok(Frame::data(data))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.failure.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match &self.data {
            Some(data) => SizeHint::with_exact(data.len() as u64),
            None => SizeHint::with_exact(0),
        }
    }
}

/// A recorded answer's data, then its trailers.
pub(super) struct Answer {
    data: Option<Bytes>,
    trailers: Option<HeaderMap>,
}

impl Answer {
    pub(super) fn new(data: Bytes, trailers: HeaderMap) -> Self {
        Self {
            data: Some(data),
            trailers: Some(trailers),
        }
    }
}

impl Body for Answer {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(data) = self.data.take() {
            return Poll::Ready(Some(Ok(Frame::data(data))));
        }
        Poll::Ready(
            self.trailers
                .take()
                .map(|trailers| Ok(Frame::trailers(trailers))),
        )
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none() && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.data.as_ref().map_or(0, |data| data.len() as u64))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_packed_body_unpacks_to_its_trailers_and_data_byte_for_byte() {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("9"));
        trailers.insert("grpc-message", HeaderValue::from_static("card%20declined"));
        trailers.append("x-note", HeaderValue::from_static("a"));
        trailers.append("x-note", HeaderValue::from_static("b"));
        let data = b"\0\0\0\0\x03abc";

        let back = unpack(pack(&trailers, None, data)).unwrap();

        assert_eq!(back.trailers, trailers);
        assert_eq!(back.fields, None);
        assert_eq!(back.data.as_ref(), data);
    }

    fn charge_fields() -> crate::grpc::fields::MessageFields {
        crate::grpc::fields::MessageFields::new([
            (2, "order_id".to_owned(), false),
            (3, "amount_cents".to_owned(), false),
        ])
    }

    #[test]
    fn a_body_packed_with_field_digests_unpacks_to_them_and_the_same_trailers_and_data() {
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        let message = Bytes::from_static(b"\x12\x03o_1\x18\x64");
        let digests = MessageDigests::of_message(message, &charge_fields()).unwrap();
        let data = b"\0\0\0\0\x03abc";

        let packed = pack(&trailers, Some(&digests), data);
        let back = unpack(packed.clone()).unwrap();

        assert_eq!(packed[0], TRAILERS_AND_FIELDS_FLAG);
        assert_eq!(back.trailers, trailers);
        assert_eq!(back.fields, Some(digests));
        assert_eq!(back.data.as_ref(), data);
    }

    #[test]
    fn a_body_recorded_before_field_digests_still_unpacks_byte_for_byte() {
        // `grpc-status: 0` and one data frame, as the first format wrote them.
        let recorded: &[u8] = b"\x80\0\0\0\x01\0\x0bgrpc-status\0\0\0\x010\0\0\0\0\x03abc";

        let back = unpack(Bytes::from_static(recorded)).unwrap();

        assert_eq!(back.trailers.len(), 1);
        assert_eq!(back.trailers["grpc-status"], "0");
        assert_eq!(back.fields, None);
        assert_eq!(back.data.as_ref(), b"\0\0\0\0\x03abc");
    }

    #[test]
    fn server_errors_are_released_only_under_the_release_policy_pushback_always() {
        let status = |code: &'static str| {
            let mut trailers = HeaderMap::new();
            trailers.insert("grpc-status", HeaderValue::from_static(code));
            trailers
        };
        for code in ["13", "2", "15", "14"] {
            assert!(is_released(&status(code), true), "{code}");
            assert!(!is_released(&status(code), false), "{code}");
        }
        for code in ["0", "3", "4", "9", "8"] {
            assert!(!is_released(&status(code), true), "{code}");
        }
        let mut pushback = status("14");
        pushback.insert("grpc-retry-pushback-ms", HeaderValue::from_static("10"));
        assert!(is_released(&pushback, false));
        assert!(!is_released(&HeaderMap::new(), true));
    }

    #[test]
    fn bodies_not_packed_are_refused() {
        assert!(unpack(Bytes::from_static(b"\0\0\0\0\x01a")).is_none());
        assert!(unpack(Bytes::from_static(b"\x80\0\0\0\x01\0\x09grpc")).is_none());
        assert!(unpack(Bytes::new()).is_none());
    }
}
