//! The client face in front of a tonic channel: a unary call once per operation, its key in
//! metadata, its answer recorded with its headers and trailers.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use tonic::Code;
use tower_layer::Layer;
use tower_service::Service;

use super::methods::{MethodEffect, MethodKind, Methods};
use super::recorded::{pack, unpack, Answer, PackedBody};
use super::wire::{self, Pushback};
use crate::client::{ClientFace, ClientLayer as HttpClientLayer};
use crate::idempotency::{Idempotency, ResponseBody};
use crate::phase::{classify, FailurePhase};
use crate::{BoxError, Error, OperationId};

type GrpcBody = tonic::body::Body;

/// Puts the client face in front of a tonic channel (or a [`Retry`](super::Retry) around
/// one): see the [module docs](crate::grpc#the-client-layer).
#[derive(Clone, Debug)]
#[must_use = "a layer does nothing until it wraps a service"]
pub struct ClientLayer {
    face: HttpClientLayer,
    methods: Arc<Methods>,
}

impl ClientLayer {
    /// The client face built as `face` (its store, the required `provider_deduplicates`
    /// choice, its key header, lease, retry policy…) in front of the unary methods of
    /// `methods` that have side effects; reads and streaming methods pass through, and a
    /// method `methods` does not name is refused before it is sent.
    pub fn new(face: HttpClientLayer, methods: Methods) -> Self {
        Self {
            face,
            methods: Arc::new(methods),
        }
    }
}

impl<S: Clone> Layer<S> for ClientLayer {
    type Service = IdempotentClient<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotentClient {
            guarded: self.face.layer(Gathered {
                inner: inner.clone(),
            }),
            passed: inner,
            methods: self.methods.clone(),
        }
    }
}

/// A tonic channel behind the client face. See the [module docs](crate::grpc).
#[derive(Clone, Debug)]
pub struct IdempotentClient<S> {
    passed: S,
    guarded: Idempotency<Gathered<S>, ClientFace>,
    methods: Arc<Methods>,
}

impl<S, ResBody> Service<Request<GrpcBody>> for IdempotentClient<S>
where
    S: Service<Request<GrpcBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<GrpcBody>;
    type Error = Error;
    type Future = ClientFuture;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        ready!(self.passed.poll_ready(cx))
            .map_err(|err| Error::inner(err.into(), FailurePhase::PreWrite))?;
        Service::<Request<GrpcBody>>::poll_ready(&mut self.guarded, cx)
    }

    fn call(&mut self, req: Request<GrpcBody>) -> Self::Future {
        // A method the table forgot is refused, not passed through: a unary side effect
        // left out of it would go out with no key and no ledger, and a re-run step would
        // charge again in silence.
        let Some(method) = self.methods.get(req.uri().path()) else {
            let refused = Error::method_not_listed(req.uri().path());
            return ClientFuture::new(async move { Err(refused) });
        };
        let guarded = method.kind == MethodKind::Unary
            && match method.effect {
                MethodEffect::SideEffect => true,
                // The caller named an operation: keep it once, key and ledger, even for a
                // method the table calls idempotent. Passed through, a re-run step would
                // send it again with no key, and a method called idempotent that is not
                // (or a provider that relies on the key to be so) would act twice in
                // silence. Without an operation it passes through, retried freely, as before.
                MethodEffect::Idempotent => req.extensions().get::<OperationId>().is_some(),
                MethodEffect::NoSideEffects => false,
            };
        if !guarded {
            let answer = self.passed.call(req);
            return ClientFuture::new(async move {
                match answer.await {
                    Ok(response) => Ok(response.map(GrpcBody::new)),
                    Err(err) => {
                        let err = err.into();
                        let phase = classify(&*err, None);
                        Err(Error::inner(err, phase))
                    }
                }
            });
        }
        let clone = self.guarded.clone();
        let mut face = std::mem::replace(&mut self.guarded, clone);
        ClientFuture::new(async move { unpacked(face.call(req).await?).await })
    }
}

/// The face's answer (fresh or replayed) as it first came: its headers, data and trailers.
async fn unpacked(answer: Response<ResponseBody<PackedBody>>) -> Result<Response<GrpcBody>, Error> {
    let (mut parts, body) = answer.into_parts();
    let bytes = body
        .collect()
        .await
        .map_err(|err| Error::inner(err, FailurePhase::Unknown))?
        .to_bytes();
    let unreadable = || {
        Error::inner(
            "the recorded gRPC answer is unreadable".into(),
            FailurePhase::Unknown,
        )
    };
    let outer = unpack(bytes).ok_or_else(unreadable)?;
    let (headers, packed) = (outer.trailers, outer.data);
    let inner = unpack(packed).ok_or_else(unreadable)?;
    let (trailers, data) = (inner.trailers, inner.data);
    parts.status = StatusCode::OK;
    // The face's own marks (a replay's) stay beside the answer's headers.
    for (name, value) in headers {
        if let Some(name) = name {
            parts.headers.insert(name, value);
        }
    }
    if data.is_empty() && trailers.contains_key(wire::GRPC_STATUS) {
        parts.headers.extend(trailers);
        return Ok(Response::from_parts(parts, GrpcBody::default()));
    }
    Ok(Response::from_parts(
        parts,
        GrpcBody::new(Answer::new(data, trailers)),
    ))
}

/// The channel behind the client face: each attempt's answer gathered whole, its status
/// told to the face as the HTTP status that means the same to it (see the
/// [module docs](crate::grpc#the-client-layer)), its headers, trailers and data packed as
/// the body the face records.
#[derive(Clone, Debug)]
pub(super) struct Gathered<S> {
    inner: S,
}

impl<S, ResBody> Service<Request<Full<Bytes>>> for Gathered<S>
where
    S: Service<Request<GrpcBody>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<PackedBody>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<Full<Bytes>>) -> Self::Future {
        let answer = self.inner.call(req.map(GrpcBody::new));
        Box::pin(async move {
            let answer = answer.await.map_err(Into::into)?;
            let (mut parts, body) = answer.into_parts();
            let collected = match body.collect().await {
                Ok(collected) => collected,
                Err(err) => return Ok(Response::from_parts(parts, PackedBody::failed(err.into()))),
            };
            let mut headers = std::mem::take(&mut parts.headers);
            let mut trailers = collected.trailers().cloned().unwrap_or_default();
            if headers.contains_key(wire::GRPC_STATUS) {
                // Trailers-only: all of it is the status.
                trailers.extend(std::mem::take(&mut headers));
            }
            let code = trailers
                .get(wire::GRPC_STATUS)
                .map_or(Code::Unknown, |code| Code::from_bytes(code.as_bytes()));
            parts.status = face_status(code);
            if let Pushback::After(wait) = wire::pushback(&trailers) {
                let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
                parts
                    .headers
                    .insert(http::header::RETRY_AFTER, HeaderValue::from(seconds));
            }
            let body = pack(
                &headers,
                None,
                &pack(&trailers, None, &collected.to_bytes()),
            );
            Ok(Response::from_parts(parts, PackedBody::whole(body)))
        })
    }
}

/// The HTTP status that means to the client face what a gRPC `code` means to the caller
/// (the table of the [module docs](crate::grpc#the-client-layer)).
fn face_status(code: Code) -> StatusCode {
    match code {
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::Aborted => StatusCode::CONFLICT,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::Unknown
        | Code::Internal
        | Code::DeadlineExceeded
        | Code::Cancelled
        | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
        _ => StatusCode::OK,
    }
}

/// The future of [`IdempotentClient`].
pub struct ClientFuture {
    future: Pin<Box<dyn Future<Output = Result<Response<GrpcBody>, Error>> + Send>>,
}

impl ClientFuture {
    fn new(
        future: impl Future<Output = Result<Response<GrpcBody>, Error>> + Send + 'static,
    ) -> Self {
        Self {
            future: Box::pin(future),
        }
    }
}

impl Future for ClientFuture {
    type Output = Result<Response<GrpcBody>, Error>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.future.as_mut().poll(cx)
    }
}

impl fmt::Debug for ClientFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientFuture").finish_non_exhaustive()
    }
}
