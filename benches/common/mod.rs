//! What the benches (and the measuring examples) share: a no-op service and handler, the
//! hand-written `tower::retry` alternative to `FrozenRetryLayer`, the runtime, and the layers
//! as measured.
#![allow(dead_code)] // each bench uses its own part of it

pub mod floor;
pub mod ledger;
pub mod moka_ledger;

use std::convert::Infallible;
use std::future::{ready, Future, Ready};
use std::hint::black_box;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use tower_idempotency::KeyHeader;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, USER_AGENT};
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Uri};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use tokio::runtime::Runtime;
use tower::retry::Policy;
use tower::{BoxError, Service};
use tower_idempotency::OperationId;

static NEXT_ID: AtomicU64 = AtomicU64::new(0);

pub fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

pub fn runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime")
}

pub fn created() -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(
        br#"{"id":"ch_1","status":"succeeded"}"#,
    )));
    *response.status_mut() = StatusCode::CREATED;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// The no-op client-side service: drops the request, answers `201` at once.
#[derive(Clone, Copy, Debug)]
pub struct Noop;

impl<B> Service<Request<B>> for Noop {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        drop(black_box(req));
        ready(Ok(created()))
    }
}

/// [`Noop`] as a transport over a network looks to the layers around it: each call's
/// future is pending once (it wakes its task at once) before it answers. Around it, the
/// layers are polled a second time and arm what they arm while a call is on the wire (a
/// lease's renewal timer), which an answer that is ready at once never shows.
#[derive(Clone, Copy, Debug)]
pub struct Waiting;

impl<B> Service<Request<B>> for Waiting {
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = PendingOnce;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        drop(black_box(req));
        PendingOnce { waited: false }
    }
}

/// [`Waiting`]'s future: pending on its first poll, `201` on the next.
#[derive(Debug)]
pub struct PendingOnce {
    waited: bool,
}

impl Future for PendingOnce {
    type Output = Result<Response<Full<Bytes>>, Infallible>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        if self.waited {
            return Poll::Ready(Ok(created()));
        }
        self.waited = true;
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}

/// The no-op handler: reads the request body, answers `201`.
pub fn handler<B>() -> impl Service<
    Request<B>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future = impl Future<Output = Result<Response<Full<Bytes>>, Infallible>> + Send,
> + Clone
       + Send
       + 'static
where
    B: Body + Send + 'static,
    B::Data: Send,
{
    tower::service_fn(|req: Request<B>| async move {
        let body = req.into_body().collect().await.ok().map(|c| c.to_bytes());
        black_box(body);
        Ok::<_, Infallible>(created())
    })
}

// --- The hand-written alternative to `FrozenRetryLayer` -------------------------------

pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// Buffer the body into `Bytes` so that `tower::retry` can clone the request.
#[derive(Clone, Debug)]
pub struct BufferBody<S> {
    pub inner: S,
}

impl<S, B> Service<Request<B>> for BufferBody<S>
where
    S: Service<Request<Full<Bytes>>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = BoxFuture<Result<S::Response, BoxError>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let bytes = body.collect().await.map_err(Into::into)?.to_bytes();
            inner
                .call(Request::from_parts(parts, Full::new(bytes)))
                .await
                .map_err(Into::into)
        })
    }
}

/// Retry up to `n` attempts on 408/429/5xx or an error; clone the request per attempt.
#[derive(Clone, Copy, Debug)]
pub struct CloneAttempts(pub u32);

impl<ResBody, E> Policy<Request<Full<Bytes>>, Response<ResBody>, E> for CloneAttempts {
    type Future = Ready<()>;

    fn retry(
        &mut self,
        _req: &mut Request<Full<Bytes>>,
        result: &mut Result<Response<ResBody>, E>,
    ) -> Option<Self::Future> {
        let retryable = match result {
            Ok(response) => matches!(response.status().as_u16(), 408 | 429 | 500 | 502..=504),
            Err(_) => true,
        };
        if retryable && self.0 > 1 {
            self.0 -= 1;
            Some(ready(()))
        } else {
            None
        }
    }

    fn clone_request(&mut self, req: &Request<Full<Bytes>>) -> Option<Request<Full<Bytes>>> {
        let mut clone = Request::new(req.body().clone());
        *clone.method_mut() = req.method().clone();
        *clone.uri_mut() = req.uri().clone();
        *clone.version_mut() = req.version();
        *clone.headers_mut() = req.headers().clone();
        Some(clone)
    }
}

/// How long a completed record stays protected from eviction in the benches: short, so a
/// store at its cap keeps evicting the oldest records (the steady state measured here) instead
/// of filling with protected ones and refusing new operations, as the defaults would at these
/// rates (that refusal is tested in tests/whole_stack/seams.rs, not timed).
pub const BENCH_PROTECTION: std::time::Duration = std::time::Duration::from_millis(50);

/// The client layer's builder as the benches run it: the default settings, with
/// [`BENCH_PROTECTION`] and a retry policy without a retry window (so that the protected
/// window is the bench's).
fn bench_client_builder(
    store: impl tower_idempotency::ledger::IdempotencyStore,
) -> tower_idempotency::client::Builder {
    tower_idempotency::IdempotencyLayer::client_builder(store)
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .lease(BENCH_PROTECTION)
        .retry_policy(
            tower_idempotency::retry::RetryPolicy::builder()
                .max_elapsed(std::time::Duration::ZERO)
                .build()
                .unwrap(),
        )
        .protected_window(BENCH_PROTECTION)
}

/// The client layer as the benches run it (see [`bench_client_builder`]).
pub fn client_layer(
    store: impl tower_idempotency::ledger::IdempotencyStore,
) -> tower_idempotency::IdempotencyLayer<tower_idempotency::client::ClientFace> {
    bench_client_builder(store)
        .build()
        .expect("valid bench settings")
}

/// The client stack as the benches run it (`build_stack()`, as the README builds it), with
/// the settings of [`client_layer`].
#[allow(dead_code)]
pub fn client_stack(
    store: impl tower_idempotency::ledger::IdempotencyStore,
) -> tower_idempotency::client::ClientStack {
    bench_client_builder(store)
        .build_stack()
        .expect("valid bench settings")
}

/// The server layer as the benches run it: the default settings, one scope, with
/// [`BENCH_PROTECTION`].
pub fn server_layer(
    store: impl tower_idempotency::ledger::IdempotencyStore,
) -> tower_idempotency::IdempotencyLayer<tower_idempotency::server::ServerFace> {
    tower_idempotency::IdempotencyLayer::server_builder(store)
        .unscoped()
        .protected_window(BENCH_PROTECTION)
        .build()
        .expect("valid bench settings")
}

/// A `POST` to a payments API with a JSON body of a chosen size, and the ways the benches
/// mark it (a fresh or fixed operation or key).
#[derive(Clone)]
pub struct Template {
    uri: Uri,
    headers: HeaderMap,
    /// The shared body every request of the template carries.
    pub body: Bytes,
}

impl Template {
    pub fn new(body_len: usize) -> Self {
        let mut headers = HeaderMap::new();
        headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert(USER_AGENT, HeaderValue::from_static("bench/1"));
        Self {
            uri: Uri::from_static("http://payments.local/charges"),
            headers,
            body: json_body(body_len),
        }
    }

    pub fn request(&self) -> Request<Full<Bytes>> {
        let mut req = Request::new(Full::new(self.body.clone()));
        *req.method_mut() = Method::POST;
        *req.uri_mut() = self.uri.clone();
        *req.headers_mut() = self.headers.clone();
        req
    }

    /// With a fresh `OperationId`: the client layer derives a new key from it.
    pub fn fresh_operation(&self) -> Request<Full<Bytes>> {
        let mut req = self.request();
        req.extensions_mut()
            .insert(OperationId::new("bench-task", next_id().to_string()));
        req
    }

    pub fn fixed_operation(&self) -> Request<Full<Bytes>> {
        let mut req = self.request();
        req.extensions_mut()
            .insert(OperationId::new("bench-task", "replayed-step"));
        req
    }

    /// With a fresh `Idempotency-Key` (a UUID-sized sf-string), as a server receives it.
    pub fn fresh_key(&self) -> Request<Full<Bytes>> {
        let mut req = self.request();
        req.headers_mut()
            .insert("idempotency-key", key_header(next_id()));
        req
    }

    /// [`fresh_key`](Self::fresh_key) carrying the body's `Content-Digest`, as the client
    /// stack sends every keyed request.
    pub fn fresh_key_with_digest(&self) -> Request<Full<Bytes>> {
        self.with_digest(self.fresh_key())
    }

    /// [`fixed_key`](Self::fixed_key) carrying the body's `Content-Digest`.
    pub fn fixed_key_with_digest(&self) -> Request<Full<Bytes>> {
        self.with_digest(self.fixed_key())
    }

    fn with_digest(&self, mut req: Request<Full<Bytes>>) -> Request<Full<Bytes>> {
        req.headers_mut().insert(
            "content-digest",
            tower_idempotency::digest::BodyDigest::of(&self.body).header_value(),
        );
        req
    }

    pub fn fixed_key(&self) -> Request<Full<Bytes>> {
        let mut req = self.request();
        req.headers_mut()
            .insert("idempotency-key", key_header(u64::MAX));
        req
    }
}

/// `"0000…<n as hex>"`: 36 characters inside quotes, like a UUID.
pub fn key_header(n: u64) -> HeaderValue {
    let text = format!("\"00000000-0000-4000-8000-{:012x}\"", n & 0xffff_ffff_ffff);
    HeaderValue::from_str(&text).expect("visible ASCII")
}

/// A JSON object of exactly `len` bytes (`len` 0 gives an empty body).
pub fn json_body(len: usize) -> Bytes {
    if len == 0 {
        return Bytes::new();
    }
    let head = br#"{"order_id":"order_42","amount_cents":1999,"summary":""#;
    let tail = br#""}"#;
    let mut out = Vec::with_capacity(len);
    if len < head.len() + tail.len() {
        out.resize(len, b' ');
    } else {
        out.extend_from_slice(head);
        out.resize(len - tail.len(), b'x');
        out.extend_from_slice(tail);
    }
    Bytes::from(out)
}

/// One call of `svc` on `req`, its response body read to the end: what every measured
/// operation costs a caller. Returns the status.
pub async fn call_once<S, B, ResBody>(svc: &mut S, req: Request<B>) -> StatusCode
where
    S: Service<Request<B>, Response = Response<ResBody>>,
    S::Error: std::fmt::Debug,
    ResBody: Body,
{
    use tower::ServiceExt;
    let response = svc
        .ready()
        .await
        .expect("ready")
        .call(req)
        .await
        .expect("call");
    let status = response.status();
    black_box(response.into_body().collect().await.is_ok());
    status
}
