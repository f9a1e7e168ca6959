//! The server face in front of a tonic service: unary calls keyed, recorded and replayed,
//! every refusal a gRPC status.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE};
use http::{HeaderMap, HeaderValue, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Full, Limited};
use tonic::metadata::MetadataMap;
use tonic::{Code, Status};
use tower_layer::Layer;
use tower_service::Service;

use super::key::{field_key, FieldKeyError, KeySource};
use super::methods::{MethodEffect, MethodKind, Methods};
use super::recorded::{unpack, Answer, PackedBody, Recorded};
use super::wire;
use crate::idempotency::{Idempotency, ResponseBody};
use crate::server::{problem, ServerFace};
use crate::BoxError;

type GrpcBody = tonic::body::Body;

/// The header the server face reads a key from.
const FACE_KEY: &str = "idempotency-key";

/// Puts the server face in front of a tonic service (or a tonic `Routes`): see the
/// [module docs](crate::grpc#the-server-layer).
#[derive(Clone, Debug)]
#[must_use = "a layer does nothing until it wraps a service"]
pub struct ServerLayer {
    http: crate::server::ServerLayer,
    shared: Arc<Shared>,
}

#[derive(Clone, Debug)]
struct Shared {
    methods: Methods,
    key: KeySource,
    body_limit: usize,
}

impl ServerLayer {
    /// The server face built as `http` (its store, scope, lease, retention, in-doubt
    /// policy, response allow-list…) in front of the unary methods of `methods`; the key
    /// from metadata `idempotency-key`.
    pub fn new(http: crate::server::ServerLayer, methods: Methods) -> Self {
        let body_limit = http.face().body_limit;
        Self {
            http,
            shared: Arc::new(Shared {
                methods,
                key: KeySource::default(),
                body_limit,
            }),
        }
    }

    /// Where calls carry their key (default: metadata `idempotency-key`).
    pub fn key_source(mut self, key: KeySource) -> Self {
        Arc::make_mut(&mut self.shared).key = key;
        self
    }
}

impl<S: Clone> Layer<S> for ServerLayer {
    type Service = IdempotentService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotentService {
            guarded: self.http.layer(Recorded {
                inner: inner.clone(),
            }),
            passed: inner,
            shared: self.shared.clone(),
        }
    }
}

/// A tonic service behind the server face. See the [module docs](crate::grpc).
#[derive(Clone, Debug)]
pub struct IdempotentService<S> {
    /// For the calls the face does not guard: streaming methods, reads, unknown methods.
    passed: S,
    guarded: Idempotency<Recorded<S>, ServerFace>,
    shared: Arc<Shared>,
}

type Guarded<S> = Idempotency<Recorded<S>, ServerFace>;

impl<S, ResBody> Service<Request<GrpcBody>> for IdempotentService<S>
where
    S: Service<Request<GrpcBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<GrpcBody>;
    type Error = S::Error;
    type Future = ServerFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        ready!(self.passed.poll_ready(cx))?;
        Service::<Request<GrpcBody>>::poll_ready(&mut self.guarded, cx)
    }

    fn call(&mut self, req: Request<GrpcBody>) -> Self::Future {
        let Some(method) = self.shared.methods.get(req.uri().path()) else {
            // A unary method missing from the table would run unguarded, in silence: a
            // retry of it could charge twice. Refused until the table names it.
            let status = Status::internal(format!(
                "the idempotency layer's method table does not name {}",
                req.uri().path()
            ));
            return ServerFuture::new(async move { Ok(status.into_http()) });
        };
        let guarded = method.kind == MethodKind::Unary
            && (method.effect != MethodEffect::NoSideEffects
                || carries_metadata_key(&req, &self.shared.key));
        if !guarded {
            let answer = self.passed.call(req);
            return ServerFuture::new(async move { Ok(answer.await?.map(GrpcBody::new)) });
        }
        let clone = self.guarded.clone();
        let ready = std::mem::replace(&mut self.guarded, clone);
        ServerFuture::new(guard(ready, self.shared.clone(), req))
    }
}

/// Whether `req` carries a key in the metadata the layer reads keys from. A read that
/// arrives keyed is guarded all the same: its caller takes it for a side effect, and will
/// resend it under the key after a timeout, so a table that calls a side effect a read
/// would otherwise run it once per resend, in silence. A read run once per key costs a
/// ledger entry and nothing else. (A key in a message field is not looked for here: that
/// would buffer every read's message.)
fn carries_metadata_key(req: &Request<GrpcBody>, key: &KeySource) -> bool {
    match key {
        KeySource::Metadata(name) => req.headers().contains_key(name),
        KeySource::Field(_) => false,
    }
}

/// One guarded call: its key put where the face reads it, the face's answer unpacked or
/// its refusal told as a status.
async fn guard<S, ResBody>(
    mut face: Guarded<S>,
    shared: Arc<Shared>,
    req: Request<GrpcBody>,
) -> Result<Response<GrpcBody>, S::Error>
where
    S: Service<Request<GrpcBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let req = match keyed(req, &shared).await {
        Ok(req) => req,
        Err(status) => return Ok(status.into_http()),
    };
    let answer = face.call(req).await?;
    Ok(unpacked(answer).await)
}

/// `req` with its key under the header the face reads (and nowhere else the face would
/// see a second one), or the status that refuses it.
async fn keyed(mut req: Request<GrpcBody>, shared: &Shared) -> Result<Request<GrpcBody>, Status> {
    match &shared.key {
        KeySource::Metadata(name) if name == FACE_KEY => Ok(req),
        KeySource::Metadata(name) => {
            let key = req.headers_mut().remove(name);
            let headers = req.headers_mut();
            headers.remove(FACE_KEY);
            if let Some(key) = key {
                headers.insert(FACE_KEY, key);
            }
            Ok(req)
        }
        KeySource::Field(number) => {
            let (mut parts, body) = req.into_parts();
            let body = match Limited::new(body, shared.body_limit).collect().await {
                Ok(collected) => collected.to_bytes(),
                Err(_) => return Err(Status::resource_exhausted("the message is over the limit")),
            };
            let key = field_key(&body, *number).map_err(|err| match err {
                FieldKeyError::Missing => {
                    Status::invalid_argument(format!("the key field {number} is missing or empty"))
                }
                FieldKeyError::Unreadable(why) => Status::invalid_argument(why),
            })?;
            parts.headers.insert(FACE_KEY, key);
            Ok(Request::from_parts(parts, GrpcBody::new(Full::new(body))))
        }
    }
}

/// The face's answer as the client is owed it: a recorded (or fresh) gRPC answer with its
/// trailers back where they travel, or the face's refusal as a status.
async fn unpacked(answer: Response<ResponseBody<PackedBody>>) -> Response<GrpcBody> {
    let (mut parts, body) = answer.into_parts();
    let refused = parts
        .headers
        .get(CONTENT_TYPE)
        .is_some_and(|kind| kind.as_bytes() == b"application/problem+json");
    let bytes = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        // The handler's answer failed: the face holds the call in doubt.
        Err(_) => {
            return Status::unknown("the call failed before its answer was complete").into_http()
        }
    };
    if refused {
        return refusal(&parts.headers, &bytes).into_http();
    }
    let Some((trailers, data)) = unpack(bytes) else {
        return Status::internal("the recorded answer is unreadable").into_http();
    };
    // The face sized the packed body; ours is another.
    parts.headers.remove(CONTENT_LENGTH);
    if data.is_empty() && trailers.contains_key(wire::GRPC_STATUS) {
        // Trailers-only, as it was first sent.
        parts.headers.extend(trailers);
        return Response::from_parts(parts, GrpcBody::default());
    }
    Response::from_parts(parts, GrpcBody::new(Answer::new(data, trailers)))
}

/// A refusal of the server face (an RFC 9457 problem) as a gRPC status:
///
/// | face's problem | status |
/// |---|---|
/// | key missing or malformed, body unreadable | `INVALID_ARGUMENT` |
/// | no principal to scope the key by | `UNAUTHENTICATED` |
/// | message over the limit | `RESOURCE_EXHAUSTED` |
/// | key in flight | `ABORTED`, with `grpc-retry-pushback-ms` |
/// | another message under the key | `FAILED_PRECONDITION` |
/// | answered, but too large to record | `ALREADY_EXISTS` |
/// | an earlier call under the key never finished | `UNKNOWN` |
/// | ledger unavailable or full | `UNAVAILABLE`, with `grpc-retry-pushback-ms` |
fn refusal(headers: &HeaderMap, body: &[u8]) -> Status {
    let problem: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let kind = problem["type"].as_str().unwrap_or_default();
    let detail = problem["detail"]
        .as_str()
        .or_else(|| problem["title"].as_str())
        .unwrap_or("refused by the idempotency layer")
        .to_owned();
    let code = match kind {
        problem::KEY_MISSING
        | problem::KEY_INVALID
        | problem::BODY_UNREADABLE
        | problem::CONTENT_DIGEST_INVALID
        | problem::CONTENT_DIGEST_MISMATCH => Code::InvalidArgument,
        problem::SCOPE_MISSING => Code::Unauthenticated,
        problem::BODY_TOO_LARGE => Code::ResourceExhausted,
        problem::IN_FLIGHT => Code::Aborted,
        problem::PAYLOAD_MISMATCH => Code::FailedPrecondition,
        problem::RESPONSE_NOT_RECORDED => Code::AlreadyExists,
        problem::OUTCOME_UNKNOWN => Code::Unknown,
        problem::LEDGER_UNAVAILABLE | problem::LEDGER_FULL | problem::COMMIT_UNKNOWN => {
            Code::Unavailable
        }
        _ => Code::Internal,
    };
    let mut metadata = HeaderMap::new();
    if let Some(wait) = crate::retry::retry_after(headers) {
        let ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        metadata.insert(wire::RETRY_PUSHBACK, HeaderValue::from(ms));
    }
    Status::with_metadata(code, detail, MetadataMap::from_headers(metadata))
}

/// The future of [`IdempotentService`].
pub struct ServerFuture<E> {
    future: Pin<Box<dyn Future<Output = Result<Response<GrpcBody>, E>> + Send>>,
}

impl<E> ServerFuture<E> {
    fn new(future: impl Future<Output = Result<Response<GrpcBody>, E>> + Send + 'static) -> Self {
        Self {
            future: Box::pin(future),
        }
    }
}

impl<E> Future for ServerFuture<E> {
    type Output = Result<Response<GrpcBody>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.future.as_mut().poll(cx)
    }
}

impl<E> fmt::Debug for ServerFuture<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerFuture").finish_non_exhaustive()
    }
}
