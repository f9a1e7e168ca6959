//! The server face in front of a tonic service: unary calls keyed, recorded and replayed,
//! every refusal a gRPC status.
//!
//! A gRPC answer is HTTP `200` whatever its status, so the face's
//! [`ServerErrorPolicy`](crate::ServerErrorPolicy) is applied to the handler's status code
//! (by [`Recorded`], which marks a released answer [`NotProcessed`](crate::server::NotProcessed)):
//!
//! | the handler's status | `Record` (default) | `Release` |
//! |---|---|---|
//! | `UNAVAILABLE` or `RESOURCE_EXHAUSTED` with `grpc-retry-pushback-ms` (as a `503` with `Retry-After`) | released | released |
//! | `INTERNAL`, `UNKNOWN`, `DATA_LOSS`, `UNAVAILABLE` (gRPC's server errors, as HTTP's `5xx`) | recorded, replayed | released: the retry runs the handler again |
//! | any other, `OK` included | recorded, replayed | recorded, replayed |
//!
//! `DEADLINE_EXCEEDED` is no server error here: a handler that answers it gave up waiting on
//! something it called, which may have acted.

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

use super::fields::{MessageDigests, MessageFields, RequestDigests};
use super::key::{field_key, FieldKeyError, KeySource};
use super::methods::{MethodEffect, MethodKind, Methods};
use super::recorded::{unpack, Answer, PackedBody, Recorded};
use super::wire;
use crate::idempotency::{Idempotency, ResponseBody};
use crate::ledger::{Begin, BeginRequest, Outcome, RecordState};
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
    /// The face's configuration: its ledger, read to name the fields a call changed.
    face: Arc<ServerFace>,
}

impl ServerLayer {
    /// The server face built as `http` (its store, scope, lease, retention, in-doubt
    /// policy, response allow-list…) in front of the unary methods of `methods`; the key
    /// from metadata `idempotency-key`.
    pub fn new(http: crate::server::ServerLayer, methods: Methods) -> Self {
        let face = http.face().clone();
        Self {
            http,
            shared: Arc::new(Shared {
                methods,
                key: KeySource::default(),
                body_limit: face.body_limit,
                face,
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
                release_server_errors: self.shared.face.releases_server_errors(),
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
    let names = shared.methods.input_fields(req.uri().path()).cloned();
    let req = match keyed(req, &shared).await {
        Ok(req) => req,
        Err(status) => return Ok(status.into_http()),
    };
    let (req, digested) = match names {
        Some(names) => match digested(req, names, &shared).await {
            Ok(digested) => digested,
            Err(status) => return Ok(status.into_http()),
        },
        None => (req, None),
    };
    let answer = face.call(req).await?;
    match unpacked(answer).await {
        Ok(answer) => Ok(answer),
        Err(mut refusal) => {
            if let Some(digested) = digested.filter(|_| refusal.is_message_mismatch()) {
                if let Some(changed) = changed_fields(&shared.face, &digested).await {
                    refusal.detail = describe_changed(&changed);
                }
            }
            Ok(refusal.into_status().into_http())
        }
    }
}

/// What the layer keeps of a guarded call whose method's fields are named: enough to name
/// the fields it changed if the face refuses it for another message under its key.
struct Digested {
    /// The head the face saw (the key where it reads it, the caller's credentials).
    head: http::request::Parts,
    digests: MessageDigests,
    names: Arc<MessageFields>,
}

/// `req` read whole, and its message's field digests put in its extensions for the answer's
/// record; what the layer keeps of it to name changed fields. A message whose fields cannot
/// be read (compressed, or not protobuf) goes on without digests, for the face to judge.
async fn digested(
    req: Request<GrpcBody>,
    names: Arc<MessageFields>,
    shared: &Shared,
) -> Result<(Request<GrpcBody>, Option<Digested>), Status> {
    let (mut parts, body) = req.into_parts();
    let body = match Limited::new(body, shared.body_limit).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(err) if err.is::<http_body_util::LengthLimitError>() => {
            return Err(Status::resource_exhausted("the message is over the limit"))
        }
        Err(_) => return Err(Status::invalid_argument("the message could not be read")),
    };
    let digested = MessageDigests::of_request(&body, &names).map(|digests| {
        let head = parts.clone();
        parts.extensions.insert(RequestDigests(digests.clone()));
        Digested {
            head,
            digests,
            names,
        }
    });
    Ok((
        Request::from_parts(parts, GrpcBody::new(Full::new(body))),
        digested,
    ))
}

/// The fields of the call's message that differ from the message whose answer is recorded
/// under its key, by name; `None` when the record is not completed (a call in flight or in
/// doubt has no answer to read them from) or its answer carries no digests (recorded
/// without a descriptor set, or by an earlier release).
///
/// The record is read with a probe `begin` under its own fingerprint, which answers a
/// completed record's outcome and changes nothing; only on this refusal's path.
async fn changed_fields(face: &ServerFace, digested: &Digested) -> Option<Vec<String>> {
    let key = face.ledger_key(&digested.head)?;
    let store = face.store();
    let view = store.inspect(key).await.ok()??;
    if !matches!(view.state, RecordState::Completed { .. }) {
        return None;
    }
    let probe = BeginRequest::new(key, view.fingerprint, PROBE_LEASE, PROBE_LEASE).probe();
    match store.begin(probe).await.ok()? {
        Begin::Replay(Outcome::Response(stored)) => {
            let first = unpack(stored.body())?.fields?;
            Some(first.changed(&digested.digests, &digested.names))
        }
        // The record went away between the two looks and the probe claimed the key: give
        // it back at once, unused.
        Begin::Acquired { token } => {
            let _ = store.abandon(key, token).await;
            None
        }
        _ => None,
    }
}

/// The lease of a probe that finds no record (see [`changed_fields`]): given back at once.
const PROBE_LEASE: std::time::Duration = std::time::Duration::from_secs(1);

/// The `FAILED_PRECONDITION` message of a call that changed `changed` (names, never values).
fn describe_changed(changed: &[String]) -> String {
    if changed.is_empty() {
        // The fingerprint is of the bytes: the same fields, encoded otherwise.
        return "idempotency key reused with another encoding of the same message: no field \
            changed, but its bytes did (a map encoded in another order?); use a new key for a \
            new call"
            .to_owned();
    }
    format!(
        "idempotency key reused with another message: fields changed: {}; use a new key for \
         a new call",
        changed.join(", ")
    )
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
/// trailers back where they travel, or the face's refusal, to be told as a status.
async fn unpacked(
    answer: Response<ResponseBody<PackedBody>>,
) -> Result<Response<GrpcBody>, Refusal> {
    let (mut parts, body) = answer.into_parts();
    let refused = parts
        .headers
        .get(CONTENT_TYPE)
        .is_some_and(|kind| kind.as_bytes() == b"application/problem+json");
    let bytes = match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        // The handler's answer failed: the face holds the call in doubt.
        Err(_) => {
            return Ok(
                Status::unknown("the call failed before its answer was complete").into_http(),
            )
        }
    };
    if refused {
        return Err(refusal(&parts.headers, &bytes));
    }
    let Some(unpacked) = unpack(bytes) else {
        return Ok(Status::internal("the recorded answer is unreadable").into_http());
    };
    let (trailers, data) = (unpacked.trailers, unpacked.data);
    // The face sized the packed body; ours is another.
    parts.headers.remove(CONTENT_LENGTH);
    if data.is_empty() && trailers.contains_key(wire::GRPC_STATUS) {
        // Trailers-only, as it was first sent.
        parts.headers.extend(trailers);
        return Ok(Response::from_parts(parts, GrpcBody::default()));
    }
    Ok(Response::from_parts(
        parts,
        GrpcBody::new(Answer::new(data, trailers)),
    ))
}

/// A refusal of the server face, read from its problem, before it is told as a status.
struct Refusal {
    kind: String,
    /// What the face's problem says differs (`target`, `body`) for a payload mismatch.
    differs: Vec<String>,
    code: Code,
    detail: String,
    metadata: MetadataMap,
}

impl Refusal {
    /// Another message under the key, for the same method: its fields can be compared.
    fn is_message_mismatch(&self) -> bool {
        self.kind == problem::PAYLOAD_MISMATCH && self.differs.iter().all(|part| part == "body")
    }

    fn into_status(self) -> Status {
        Status::with_metadata(self.code, self.detail, self.metadata)
    }
}

/// A refusal of the server face (an RFC 9457 problem) as a gRPC status:
///
/// | face's problem | status |
/// |---|---|
/// | key missing or malformed, body unreadable | `INVALID_ARGUMENT` |
/// | no principal to scope the key by | `UNAUTHENTICATED` |
/// | message over the limit | `RESOURCE_EXHAUSTED` |
/// | key in flight | `ABORTED`, with `grpc-retry-pushback-ms` |
/// | another message under the key | `FAILED_PRECONDITION` (naming the changed fields when the method's are named) |
/// | answered, but too large to record | `ALREADY_EXISTS` |
/// | an earlier call under the key never finished | `UNKNOWN` |
/// | ledger unavailable or full | `UNAVAILABLE`, with `grpc-retry-pushback-ms` |
fn refusal(headers: &HeaderMap, body: &[u8]) -> Refusal {
    let problem: serde_json::Value = serde_json::from_slice(body).unwrap_or_default();
    let kind = problem["type"].as_str().unwrap_or_default().to_owned();
    let detail = problem["detail"]
        .as_str()
        .or_else(|| problem["title"].as_str())
        .unwrap_or("refused by the idempotency layer")
        .to_owned();
    let differs = problem["differs"]
        .as_array()
        .map(|parts| {
            parts
                .iter()
                .filter_map(|part| part.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    let code = match kind.as_str() {
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
    Refusal {
        kind,
        differs,
        code,
        detail,
        metadata: MetadataMap::from_headers(metadata),
    }
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
