//! Frozen requests: capture a request's bytes once, resend exactly those bytes every time.
//!
//! A retry that rebuilds its request — re-running the step that produced it — sends new
//! bytes under the old key (the second incident this crate exists to stop). A
//! [`FrozenRequest`] is captured once, before the first network call: method, URI, version,
//! headers and the whole body as [`Bytes`]. Each attempt is rebuilt from it by cloning
//! `Bytes` (a reference-count increment) and the head; the body is never copied again.
//!
//! The body is collected under a limit (1 MiB unless the layer's `body_limit` says
//! otherwise) enforced twice: up front from `Content-Length` and the body's size hint, and
//! again while the body streams in. Over the limit, freezing fails with a `BodyTooLarge`
//! [`Error`] and nothing is sent. Trailers are not part of a frozen request.
//!
//! # Example
//!
//! ```
//! use bytes::Bytes;
//! use http_body_util::{BodyExt, Full};
//! use tower_idempotency::FrozenRequest;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tower_idempotency::Error> {
//! let req = http::Request::post("http://orders.local/orders")
//!     .header("content-type", "application/json")
//!     .body(Full::new(Bytes::from_static(b"{\"sku\":\"SKU-4471\"}")))
//!     .unwrap();
//! let (frozen, _extensions) = FrozenRequest::freeze(req, 1024).await?;
//!
//! let first = frozen.to_request();
//! let second = frozen.to_request();
//! assert_eq!(first.uri(), second.uri());
//! assert_eq!(
//!     first.into_body().collect().await.unwrap().to_bytes(),
//!     second.into_body().collect().await.unwrap().to_bytes(),
//! );
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::header::{Entry, HeaderValue, CONTENT_LENGTH};
use http::{Extensions, HeaderMap, Method, Request, Uri, Version};
use http_body::Body;
use http_body_util::{BodyExt, Full};

use crate::digest::{BodyDigest, CONTENT_DIGEST};
use crate::fingerprint::Fingerprint;
use crate::Error;

/// The default limit on a request body that may be frozen: 1 MiB.
pub(crate) const DEFAULT_BODY_LIMIT: usize = 1024 * 1024;

/// A request captured once, rebuilt cheaply for every attempt.
///
/// Cloning a `FrozenRequest` is a reference-count increment. See the
/// [module docs](crate::frozen).
#[derive(Clone)]
pub struct FrozenRequest(Arc<Frozen>);

struct Frozen {
    method: Method,
    uri: Uri,
    version: Version,
    headers: HeaderMap,
    body: Bytes,
    hashes: Hashes,
}

/// The body's SHA-256, in one pass over the contiguous body, and the fingerprint made of it
/// (as `Content-Digest` is).
enum Hashes {
    /// Made at freezing: a keyed request needs both at once (it is claimed by its
    /// fingerprint and carries its digest), so it skips the locks' first-use path.
    Made {
        digest: BodyDigest,
        fingerprint: Fingerprint,
    },
    /// Made on first use: a request that only passes through the retry layer is never
    /// hashed at all.
    OnFirstUse {
        digest: OnceLock<BodyDigest>,
        fingerprint: OnceLock<Fingerprint>,
    },
}

impl Hashes {
    fn on_first_use() -> Self {
        Self::OnFirstUse {
            digest: OnceLock::new(),
            fingerprint: OnceLock::new(),
        }
    }

    /// The digest, if it is made already.
    fn digest(&self) -> Option<BodyDigest> {
        match self {
            Self::Made { digest, .. } => Some(*digest),
            Self::OnFirstUse { digest, .. } => digest.get().copied(),
        }
    }

    /// The fingerprint, if it is made already.
    fn fingerprint(&self) -> Option<Fingerprint> {
        match self {
            Self::Made { fingerprint, .. } => Some(*fingerprint),
            Self::OnFirstUse { fingerprint, .. } => fingerprint.get().copied(),
        }
    }
}

impl FrozenRequest {
    /// Collect `req`'s body (at most `limit` bytes) and freeze the request.
    ///
    /// Returns the frozen request and the original request's extensions, which are not part
    /// of what is frozen (they are in-process values, not bytes on the wire).
    pub async fn freeze<B>(req: Request<B>, limit: usize) -> Result<(Self, Extensions), Error>
    where
        B: Body,
        B::Error: Into<crate::BoxError>,
    {
        let (parts, body) = collect_request(req, limit).await?;
        Ok(Self::of_collected(parts, body, false))
    }

    /// Freeze `req` as [`freeze`](Self::freeze) does, and add
    /// `Content-Digest: sha-256=:…:` of its body (RFC 9530) to the frozen head unless the
    /// request already carries a `Content-Digest` of its own. The digest is the one the
    /// fingerprint is made of: the body is hashed once, for both.
    ///
    /// ```
    /// # use bytes::Bytes;
    /// # use http_body_util::Full;
    /// use tower_idempotency::{digest::BodyDigest, FrozenRequest};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::Error> {
    /// let req = http::Request::post("http://pay.local/charges")
    ///     .body(Full::new(Bytes::from_static(b"{}")))
    ///     .unwrap();
    /// let (frozen, _) = FrozenRequest::freeze_with_content_digest(req, 1024).await?;
    /// assert_eq!(frozen.headers()["content-digest"], BodyDigest::of(b"{}").header_value());
    /// assert_eq!(frozen.body_digest(), BodyDigest::of(b"{}"));
    /// # Ok(())
    /// # }
    /// ```
    pub async fn freeze_with_content_digest<B>(
        req: Request<B>,
        limit: usize,
    ) -> Result<(Self, Extensions), Error>
    where
        B: Body,
        B::Error: Into<crate::BoxError>,
    {
        let (parts, body) = collect_request(req, limit).await?;
        Ok(Self::of_collected(parts, body, true))
    }

    /// Freeze a request whose body is collected, with `Content-Digest` added as
    /// [`freeze_with_content_digest`](Self::freeze_with_content_digest) does when
    /// `content_digest` is set (the body digest and the fingerprint are then made at once).
    pub(crate) fn of_collected(
        mut parts: http::request::Parts,
        body: Bytes,
        content_digest: bool,
    ) -> (Self, Extensions) {
        let mut hashes = Hashes::on_first_use();
        if content_digest {
            let sha256 = BodyDigest::of(&body);
            // One lookup: a digest the caller sent is kept as it is.
            if let Entry::Vacant(place) = parts.headers.entry(&CONTENT_DIGEST) {
                place.insert(sha256.header_value());
            }
            hashes = Hashes::Made {
                digest: sha256,
                fingerprint: Fingerprint::of_request(&parts.method, &parts.uri, &sha256),
            };
        }
        let frozen = Frozen {
            method: parts.method,
            uri: parts.uri,
            version: parts.version,
            headers: parts.headers,
            body,
            hashes,
        };
        (Self(Arc::new(frozen)), parts.extensions)
    }

    /// Assemble a frozen request from its parts (for stores decoding their records, and for
    /// callers that already hold the bytes).
    ///
    /// ```
    /// # use tower_idempotency::{Fingerprint, FrozenRequest};
    /// let frozen = FrozenRequest::from_parts(
    ///     http::Method::POST,
    ///     "/charges?x=1".parse().unwrap(),
    ///     http::Version::HTTP_11,
    ///     http::HeaderMap::new(),
    ///     bytes::Bytes::from_static(b"{}"),
    /// );
    /// assert_eq!(frozen.fingerprint(), Fingerprint::of(&http::Method::POST, "/charges?x=1", b"{}"));
    /// ```
    pub fn from_parts(
        method: Method,
        uri: Uri,
        version: Version,
        headers: HeaderMap,
        body: Bytes,
    ) -> Self {
        Self(Arc::new(Frozen {
            method,
            uri,
            version,
            headers,
            body,
            hashes: Hashes::on_first_use(),
        }))
    }

    /// Build one attempt: the frozen head and body, with no extensions.
    pub fn to_request(&self) -> Request<Full<Bytes>> {
        self.to_request_with(Extensions::new())
    }

    /// Build one attempt carrying `extensions` (e.g. the caller's, cloned per attempt).
    pub fn to_request_with(&self, extensions: Extensions) -> Request<Full<Bytes>> {
        let frozen = &*self.0;
        let mut req = Request::new(Full::new(frozen.body.clone()));
        *req.method_mut() = frozen.method.clone();
        *req.uri_mut() = frozen.uri.clone();
        *req.version_mut() = frozen.version;
        *req.headers_mut() = frozen.headers.clone();
        *req.extensions_mut() = extensions;
        req
    }

    /// The request method.
    pub fn method(&self) -> &Method {
        &self.0.method
    }

    /// The request URI.
    pub fn uri(&self) -> &Uri {
        &self.0.uri
    }

    /// The HTTP version.
    pub fn version(&self) -> Version {
        self.0.version
    }

    /// The request headers, as frozen.
    pub fn headers(&self) -> &HeaderMap {
        &self.0.headers
    }

    /// The whole request body.
    pub fn body(&self) -> &Bytes {
        &self.0.body
    }

    /// The SHA-256 of the body (what `Content-Digest: sha-256` carries), computed once, on
    /// first use.
    pub fn body_digest(&self) -> BodyDigest {
        match &self.0.hashes {
            Hashes::Made { digest, .. } => *digest,
            Hashes::OnFirstUse { digest, .. } => {
                *digest.get_or_init(|| BodyDigest::of(&self.0.body))
            }
        }
    }

    /// The request's [`Fingerprint`], computed once, on first use, from the
    /// [body digest](Self::body_digest).
    pub fn fingerprint(&self) -> Fingerprint {
        match &self.0.hashes {
            Hashes::Made { fingerprint, .. } => *fingerprint,
            Hashes::OnFirstUse { fingerprint, .. } => *fingerprint.get_or_init(|| {
                let frozen = &*self.0;
                Fingerprint::of_request(&frozen.method, &frozen.uri, &self.body_digest())
            }),
        }
    }

    /// Bytes this request holds in memory (head estimate plus body), for weighing caches.
    pub fn weight(&self) -> usize {
        let uri = &self.0.uri;
        // The URI's parts, measured without formatting it.
        let uri_len = uri.scheme_str().map_or(0, str::len)
            + uri.authority().map_or(0, |a| a.as_str().len())
            + path_and_query(uri).len();
        std::mem::size_of::<Frozen>()
            + uri_len
            + headers_weight(&self.0.headers)
            + self.0.body.len()
    }
}

impl fmt::Debug for FrozenRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FrozenRequest")
            .field("method", &self.0.method)
            .field("uri", &self.0.uri)
            .field("version", &self.0.version)
            .field("headers", &self.0.headers)
            .field("body_len", &self.0.body.len())
            .field("fingerprint", &self.fingerprint())
            .finish()
    }
}

/// Bytes a header map holds in memory: its table (a `HeaderMap` with one entry already
/// allocates about 600 bytes) and each name and value.
pub(crate) fn headers_weight(headers: &HeaderMap) -> usize {
    const TABLE: usize = 512;
    const PER_ENTRY: usize = 48;
    TABLE
        + headers
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len() + PER_ENTRY)
            .sum::<usize>()
}

/// What the client [`IdempotencyLayer`](crate::IdempotencyLayer) leaves in a request's
/// extensions for the [`FrozenRetryLayer`](crate::FrozenRetryLayer) inside it, and what the
/// retry layer tells it back.
///
/// The retry layer sends what it is handed (a layer in between may have added a header);
/// when it is handed the very bytes the idempotency layer froze, it reuses their fingerprint
/// instead of hashing them again. Every attempt that may have left is reported here, so
/// "may have been sent" survives later attempts that were refused before writing.
#[derive(Clone, Debug)]
pub(crate) struct Handoff(Arc<HandoffState>);

#[derive(Debug)]
struct HandoffState {
    frozen: FrozenRequest,
    /// The server ignores `Idempotency-Key`: a keyed side effect is then no safer to resend
    /// than an unkeyed one.
    key_ignored: bool,
    sent: std::sync::atomic::AtomicBool,
    /// The retry window of the retry layer inside, in ms, once it reported it (0: none).
    retry_window_ms: std::sync::atomic::AtomicU64,
}

impl Handoff {
    pub(crate) fn new(frozen: FrozenRequest, key_ignored: bool) -> Self {
        Self(Arc::new(HandoffState {
            frozen,
            key_ignored,
            sent: std::sync::atomic::AtomicBool::new(false),
            retry_window_ms: std::sync::atomic::AtomicU64::new(0),
        }))
    }

    pub(crate) fn key_ignored(&self) -> bool {
        self.0.key_ignored
    }

    /// An attempt of this operation may have reached the server.
    pub(crate) fn attempt_may_have_left(&self) {
        self.0
            .sent
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The retry layer inside reports the longest it may keep retrying.
    pub(crate) fn report_retry_window(&self, window: std::time::Duration) {
        let ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX).max(1);
        self.0
            .retry_window_ms
            .store(ms, std::sync::atomic::Ordering::Relaxed);
    }

    /// The retry window the retry layer inside reported, if it did.
    pub(crate) fn retry_window(&self) -> Option<std::time::Duration> {
        match self
            .0
            .retry_window_ms
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            0 => None,
            ms => Some(std::time::Duration::from_millis(ms)),
        }
    }

    /// Whether any attempt so far may have reached the server.
    pub(crate) fn may_have_been_sent(&self) -> bool {
        self.0.sent.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// Left by a [`FrozenRetryLayer`](crate::FrozenRetryLayer) on the attempts of a request no
/// idempotency layer handed it, so an [`IdempotencyLayer`](crate::IdempotencyLayer) inside
/// it can tell that the layers are stacked the wrong way round. Zero-sized: inserting it
/// allocates nothing but, at most, the extensions' map.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RetriedOutside;

/// What the retry layer was handed, frozen.
pub(crate) struct Handed {
    /// What every attempt is rebuilt from.
    pub(crate) frozen: FrozenRequest,
    /// The request's extensions, given to every attempt.
    pub(crate) extensions: Extensions,
    /// The head and body exactly as handed in, when they are the bytes the outer
    /// idempotency layer froze: the first attempt sends them as they are, and `frozen` is
    /// that layer's own, so no second copy of the head is made for an operation that is
    /// answered at once.
    pub(crate) first: Option<(http::request::Parts, Bytes)>,
}

/// Freeze the request the retry layer was handed, once its body is read. When an outer
/// idempotency layer handed on exactly the request it froze (same method, URI, version,
/// headers in the same order and the same body bytes), its [`FrozenRequest`] is taken as
/// it is, digest and fingerprint included; otherwise the request is frozen anew, reusing
/// the fingerprint when the bytes are the ones it froze.
pub(crate) fn hand_over(mut parts: http::request::Parts, body: Bytes) -> Handed {
    let extensions = std::mem::take(&mut parts.extensions);
    let same = extensions
        .get::<Handoff>()
        .map(|handoff| &handoff.0.frozen)
        .filter(|frozen| frozen.is_exactly(&parts, &body))
        .cloned();
    if let Some(frozen) = same {
        return Handed {
            frozen,
            extensions,
            first: Some((parts, body)),
        };
    }
    let frozen =
        FrozenRequest::from_parts(parts.method, parts.uri, parts.version, parts.headers, body);
    if let Some(handoff) = extensions.get::<Handoff>() {
        frozen.reuse_fingerprint_of(&handoff.0.frozen);
    }
    Handed {
        frozen,
        extensions,
        first: None,
    }
}

/// Whether two URIs are the same bytes: scheme, authority, path and query.
fn same_uri_bytes(a: &Uri, b: &Uri) -> bool {
    a.scheme() == b.scheme()
        && a.authority().map(|a| a.as_str()) == b.authority().map(|b| b.as_str())
        && a.path_and_query().map(|pq| pq.as_str()) == b.path_and_query().map(|pq| pq.as_str())
}

/// Whether two maps hold the same headers in the same order. A value cloned from the
/// other shares its bytes, so most compare by address before they compare by content.
fn same_headers(a: &HeaderMap, b: &HeaderMap) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b.iter())
            .all(|((a_name, a_value), (b_name, b_value))| {
                let (a_value, b_value) = (a_value.as_bytes(), b_value.as_bytes());
                a_name == b_name
                    && a_value.len() == b_value.len()
                    && (a_value.as_ptr() == b_value.as_ptr() || a_value == b_value)
            })
}

impl FrozenRequest {
    /// Whether `parts` and `body` are this request's head and bytes as they are: the
    /// headers compared in order (a rebuilt request keeps the frozen order), the body by
    /// identity (a rebuilt request shares the frozen `Bytes`).
    ///
    /// Byte for byte, which is stricter than `==` on a `Uri` (its host compares without
    /// case): a rebuilt request holds clones of the frozen parts, so it always passes, and
    /// anything else that fails is frozen anew, which is only slower.
    fn is_exactly(&self, parts: &http::request::Parts, body: &Bytes) -> bool {
        let frozen = &*self.0;
        frozen.body.as_ptr() == body.as_ptr()
            && frozen.body.len() == body.len()
            && frozen.method == parts.method
            && frozen.version == parts.version
            && same_uri_bytes(&frozen.uri, &parts.uri)
            && same_headers(&frozen.headers, &parts.headers)
    }

    /// Take `earlier`'s digest and fingerprint when it covers exactly what this request says: the same
    /// method and target, and the same body buffer (a single-chunk body is frozen without a
    /// copy, so "the same buffer" is a pointer comparison, not a second pass over the bytes).
    fn reuse_fingerprint_of(&self, earlier: &FrozenRequest) {
        let (now, then) = (&*self.0, &*earlier.0);
        let Hashes::OnFirstUse {
            digest,
            fingerprint,
        } = &now.hashes
        else {
            return;
        };
        let same = now.method == then.method
            && now.uri == then.uri
            && now.body.as_ptr() == then.body.as_ptr()
            && now.body.len() == then.body.len();
        if !same {
            return;
        }
        if let Some(made) = then.hashes.digest() {
            let _ = digest.set(made);
        }
        if let Some(made) = then.hashes.fingerprint() {
            let _ = fingerprint.set(made);
        }
    }
}

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
async fn collect_limited<B>(body: B, limit: usize) -> Result<Bytes, Error>
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
    /// Start reading `req`'s body; refused at once when it says it is over `limit`.
    pub(crate) fn new(req: Request<B>, limit: usize) -> Result<Self, Error> {
        let (parts, body) = req.into_parts();
        check_declared_length(&parts.headers, &body, limit)?;
        Ok(Self::checked(parts, body, limit))
    }

    /// Start reading the body of a request already taken apart, once
    /// [`check_declared_length`] let it through. Infallible, so that a caller can build it
    /// straight into the future that holds it.
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

/// The path and query a fingerprint covers (`/` when the URI has none).
pub(crate) fn path_and_query(uri: &Uri) -> &str {
    uri.path_and_query().map_or("/", |pq| pq.as_str())
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
struct Collected {
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
trait CopyToBytesAll {
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
