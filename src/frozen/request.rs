//! The frozen request: a request's head and bytes, captured once, and knowing them again.

use std::fmt;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use bytes::Bytes;
use http::header::Entry;
use http::{Extensions, HeaderMap, Method, Request, Uri, Version};
use http_body::Body;
use http_body_util::Full;

use super::collect::collect_request;
use crate::digest::{BodyDigest, CONTENT_DIGEST};
use crate::fingerprint::Fingerprint;
use crate::key::{KeyForm, KeyHeader};
use crate::Error;
use crate::IdempotencyKey;
use crate::OperationId;

/// A request captured once, rebuilt cheaply for every attempt.
///
/// Cloning a `FrozenRequest` is a reference-count increment. See the
/// [module docs](crate::frozen).
#[derive(Clone)]
pub struct FrozenRequest(pub(super) Arc<Frozen>);

pub(super) struct Frozen {
    method: Method,
    uri: Uri,
    version: Version,
    headers: Headers,
    body: Bytes,
    hashes: Hashes,
    /// The operation a key derived from names, shared with its [`OperationId`]: what a
    /// record of it shows an operator ([`Origin`](crate::ledger::Origin)).
    operation: Option<OperationId>,
}

/// The frozen headers.
enum Headers {
    /// As they were frozen.
    Frozen(HeaderMap),
    /// A keyed request's, its `Content-Digest` and its derived `Idempotency-Key` still to
    /// add: they are added on the first read of its headers. An operation that the ledger
    /// answers from its record never sends its request, so it never makes the two values
    /// (their encoding, an allocation and two insertions are a fifth of a replay). Anything
    /// that reads the headers (a send, a store that weighs, keeps or encodes the request, a
    /// comparison) sees them added, so the frozen head is the same bytes either way.
    Pending {
        added: OnceLock<HeaderMap>,
        /// The caller's headers, taken out on the first read.
        caller: Mutex<Option<HeaderMap>>,
        /// The key derived from an `OperationId`, and the header it travels under.
        derived_key: Option<(IdempotencyKey, KeyHeader)>,
    },
}

impl Frozen {
    /// The headers, a keyed request's pending values added on the first read.
    #[inline]
    fn headers(&self) -> &HeaderMap {
        match &self.headers {
            Headers::Frozen(headers) => headers,
            Headers::Pending {
                added,
                caller,
                derived_key,
            } => added.get_or_init(|| {
                let mut headers = lock(caller)
                    .take()
                    .expect("the caller's headers are taken once");
                let digest = self
                    .hashes
                    .digest()
                    .expect("a request with pending headers had its digest made at freezing");
                let derived_key = derived_key.as_ref().map(|(key, header)| (key, header));
                add_key_and_digest(&mut headers, derived_key, &digest);
                headers
            }),
        }
    }
}

/// The mutex's guard, even if a thread panicked holding it (nothing it guards is left
/// half-made: the headers are taken out whole).
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The body's SHA-256, in one pass over the contiguous body, and the fingerprint made of it
/// (as `Content-Digest` is).
pub(super) enum Hashes {
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

/// What freezing a collected request adds to its head ([`FrozenRequest::of_collected`]).
#[derive(Clone, Copy)]
pub(crate) enum Adding<'a> {
    /// Nothing: the request is frozen as it came.
    Nothing,
    /// `Content-Digest` of the body (unless the caller sent one, which is kept as sent),
    /// and a key derived from an `OperationId`, if any, under its header in its form (its
    /// place was found empty): for the IETF form, the two values then share one
    /// allocation.
    Digest {
        derived_key: Option<(&'a IdempotencyKey, &'a KeyHeader)>,
    },
}

/// Add the derived key's header (if any) and `Content-Digest: sha256` unless the caller
/// sent a digest (one lookup finds it or makes its place).
#[inline(always)]
fn add_key_and_digest(
    headers: &mut HeaderMap,
    derived_key: Option<(&IdempotencyKey, &KeyHeader)>,
    sha256: &BodyDigest,
) {
    match derived_key {
        Some((key, header)) => {
            let (key, digest) = match header.form() {
                KeyForm::SfString => key.header_values_with(sha256),
                _ => (header.derived_value(key), sha256.header_value()),
            };
            headers.insert(header.name(), key);
            if let Entry::Vacant(place) = headers.entry(&CONTENT_DIGEST) {
                place.insert(digest);
            }
        }
        None => {
            if let Entry::Vacant(place) = headers.entry(&CONTENT_DIGEST) {
                place.insert(sha256.header_value());
            }
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
        Ok(Self::of_collected(parts, body, Adding::Nothing))
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
        Ok(Self::of_collected(
            parts,
            body,
            Adding::Digest { derived_key: None },
        ))
    }

    /// Freeze a request whose body is collected, with what `adding` says added: for
    /// [`Adding::Digest`], `Content-Digest` as
    /// [`freeze_with_content_digest`](Self::freeze_with_content_digest) adds it (the body
    /// digest and the fingerprint are then made at once) and a derived key's header.
    #[inline(always)]
    pub(crate) fn of_collected(
        parts: http::request::Parts,
        body: Bytes,
        adding: Adding<'_>,
    ) -> (Self, Extensions) {
        let mut operation = None;
        let (headers, hashes) = match adding {
            Adding::Nothing => (Headers::Frozen(parts.headers), Hashes::on_first_use()),
            Adding::Digest { derived_key } => {
                let sha256 = BodyDigest::of(&body);
                let hashes = Hashes::Made {
                    digest: sha256,
                    fingerprint: Fingerprint::of_sent(&parts.method, &parts.uri, &sha256),
                };
                if derived_key.is_some() {
                    // The key was derived from the request's `OperationId`: it is there.
                    operation = parts.extensions.get::<OperationId>().cloned();
                }
                let headers = Headers::Pending {
                    added: OnceLock::new(),
                    caller: Mutex::new(Some(parts.headers)),
                    derived_key: derived_key.map(|(key, header)| (*key, header.clone())),
                };
                (headers, hashes)
            }
        };
        let frozen = Frozen {
            method: parts.method,
            uri: parts.uri,
            version: parts.version,
            headers,
            body,
            hashes,
            operation,
        };
        (Self(Arc::new(frozen)), parts.extensions)
    }

    /// Assemble a frozen request from its parts (for stores decoding their records, and for
    /// callers that already hold the bytes).
    ///
    /// ```
    /// # use tower_idempotency::{fingerprint::Fingerprint, FrozenRequest};
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
            headers: Headers::Frozen(headers),
            body,
            hashes: Hashes::on_first_use(),
            operation: None,
        }))
    }

    /// Build one attempt: the frozen head and body, with no extensions.
    pub fn to_request(&self) -> Request<Full<Bytes>> {
        self.to_request_with(Extensions::new())
    }

    /// Build one attempt carrying `extensions` (e.g. the caller's, cloned per attempt).
    #[inline]
    pub fn to_request_with(&self, extensions: Extensions) -> Request<Full<Bytes>> {
        let frozen = &*self.0;
        let mut req = Request::new(Full::new(frozen.body.clone()));
        *req.method_mut() = frozen.method.clone();
        *req.uri_mut() = frozen.uri.clone();
        *req.version_mut() = frozen.version;
        *req.headers_mut() = frozen.headers().clone();
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
        self.0.headers()
    }

    /// The whole request body.
    pub fn body(&self) -> &Bytes {
        &self.0.body
    }

    /// The operation whose `OperationId` the request's key was derived from, if it was
    /// ([`with_operation`](Self::with_operation)).
    pub(crate) fn operation(&self) -> Option<&OperationId> {
        self.0.operation.as_ref()
    }

    /// This request, frozen for the operation `operation` names: a claim made with it
    /// keeps the operation's `task_id` and `step_id` in its record's
    /// [`Origin`](crate::ledger::Origin) ([`BeginRequest::named_origin`]), sharing its ids.
    /// The client face does this for every request keyed by an `OperationId`; a layer of
    /// your own does it before it claims. Call it on a request just frozen: on one already
    /// shared, its head is copied.
    ///
    /// [`BeginRequest::named_origin`]: crate::ledger::BeginRequest::named_origin
    ///
    /// ```
    /// use tower_idempotency::{FrozenRequest, OperationId};
    /// use tower_idempotency::ledger::{BeginRequest, LedgerKey};
    /// # use std::time::Duration;
    ///
    /// let op = OperationId::new("task-42", "charge");
    /// let frozen = FrozenRequest::from_parts(
    ///     http::Method::POST,
    ///     "https://payments.example/v1/charges".parse().unwrap(),
    ///     http::Version::HTTP_11,
    ///     http::HeaderMap::new(),
    ///     bytes::Bytes::from_static(b"{}"),
    /// )
    /// .with_operation(&op);
    /// let claim = BeginRequest::new(LedgerKey::for_operation(op.key("")), frozen.fingerprint(),
    ///     Duration::from_secs(10), Duration::from_secs(60))
    ///     .with_frozen(frozen);
    /// assert_eq!(claim.named_origin().unwrap().task_id(), Some("task-42"));
    /// ```
    pub fn with_operation(mut self, operation: &OperationId) -> Self {
        match Arc::get_mut(&mut self.0) {
            Some(frozen) => frozen.operation = Some(operation.clone()),
            None => {
                let frozen = &self.0;
                self = Self(Arc::new(Frozen {
                    method: frozen.method.clone(),
                    uri: frozen.uri.clone(),
                    version: frozen.version,
                    headers: Headers::Frozen(frozen.headers().clone()),
                    body: frozen.body.clone(),
                    hashes: Hashes::on_first_use(),
                    operation: Some(operation.clone()),
                }));
            }
        }
        self
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
                Fingerprint::of_sent(&frozen.method, &frozen.uri, &self.body_digest())
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
        self.least_weight() + uri_len + headers_weight(self.headers())
    }

    /// At most its [`weight`](Self::weight), without weighing its head (which reads its
    /// headers): what the request weighs at least.
    pub(crate) fn least_weight(&self) -> usize {
        std::mem::size_of::<Frozen>() + self.0.body.len()
    }
}

impl fmt::Debug for FrozenRequest {
    /// The head with its credentials' values redacted (`Authorization`, `Cookie`,
    /// `Proxy-Authorization`), and the body's length: a record or an error logged with
    /// `{:?}` must not carry a caller's secrets into the logs.
    ///
    /// ```
    /// # use tower_idempotency::FrozenRequest;
    /// let mut headers = http::HeaderMap::new();
    /// headers.insert("authorization", "Bearer sk_live_secret".parse().unwrap());
    /// let frozen = FrozenRequest::from_parts(http::Method::POST, "/charges".parse().unwrap(),
    ///     http::Version::HTTP_11, headers, bytes::Bytes::from_static(b"{}"));
    /// let shown = format!("{frozen:?}");
    /// assert!(shown.contains("authorization") && !shown.contains("sk_live_secret"));
    /// ```
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FrozenRequest")
            .field("method", &self.0.method)
            .field("uri", &self.0.uri)
            .field("version", &self.0.version)
            .field("headers", &RedactedHeaders(self.headers()))
            .field("body_len", &self.0.body.len())
            .field("fingerprint", &self.fingerprint())
            .finish()
    }
}

/// The headers whose values are never shown, wherever a request is (`Debug`, the console):
/// credentials.
pub(crate) const CREDENTIAL_HEADERS: [&str; 3] = ["authorization", "cookie", "proxy-authorization"];

/// What a value that is not shown is shown as.
pub(crate) const REDACTED: &str = "[redacted]";

/// Headers as `Debug` shows them, the values of credentials replaced.
struct RedactedHeaders<'a>(&'a http::HeaderMap);

impl fmt::Debug for RedactedHeaders<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.0.iter().map(|(name, value)| {
                let shown: &dyn fmt::Debug = if CREDENTIAL_HEADERS.contains(&name.as_str()) {
                    &REDACTED
                } else {
                    value
                };
                (name, shown)
            }))
            .finish()
    }
}

/// Two frozen requests are equal when they are the same bytes: method, version, URI,
/// headers in order, and body (what a store that keeps one must give back).
///
/// ```
/// # use tower_idempotency::FrozenRequest;
/// let frozen = |body: &'static [u8]| FrozenRequest::from_parts(
///     http::Method::POST, "/charges".parse().unwrap(), http::Version::HTTP_11,
///     http::HeaderMap::new(), bytes::Bytes::from_static(body));
/// assert_eq!(frozen(b"{}"), FrozenRequest::decode(&frozen(b"{}").encode()).unwrap());
/// assert_ne!(frozen(b"{}"), frozen(b"[]"));
/// ```
impl PartialEq for FrozenRequest {
    fn eq(&self, other: &Self) -> bool {
        let (a, b) = (&*self.0, &*other.0);
        Arc::ptr_eq(&self.0, &other.0)
            || (a.method == b.method
                && a.version == b.version
                && same_uri_bytes(&a.uri, &b.uri)
                && a.body == b.body
                && same_headers(a.headers(), b.headers()))
    }
}

impl Eq for FrozenRequest {}

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

/// Whether two URIs are the same bytes: scheme, authority, path and query.
pub(super) fn same_uri_bytes(a: &Uri, b: &Uri) -> bool {
    a.scheme() == b.scheme()
        && a.authority().map(|a| a.as_str()) == b.authority().map(|b| b.as_str())
        && a.path_and_query().map(|pq| pq.as_str()) == b.path_and_query().map(|pq| pq.as_str())
}

/// Whether two maps hold the same headers in the same order. A value cloned from the
/// other shares its bytes, so most compare by address before they compare by content.
pub(super) fn same_headers(a: &HeaderMap, b: &HeaderMap) -> bool {
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
    pub(super) fn is_exactly(&self, parts: &http::request::Parts, body: &Bytes) -> bool {
        let frozen = &*self.0;
        frozen.body.as_ptr() == body.as_ptr()
            && frozen.body.len() == body.len()
            && frozen.method == parts.method
            && frozen.version == parts.version
            && same_uri_bytes(&frozen.uri, &parts.uri)
            && same_headers(frozen.headers(), &parts.headers)
    }

    /// Take `earlier`'s digest and fingerprint when it covers exactly what this request says: the same
    /// method and target, and the same body buffer (a single-chunk body is frozen without a
    /// copy, so "the same buffer" is a pointer comparison, not a second pass over the bytes).
    pub(super) fn reuse_fingerprint_of(&self, earlier: &FrozenRequest) {
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

/// The path and query a fingerprint covers (`/` when the URI has none).
pub(crate) fn path_and_query(uri: &Uri) -> &str {
    uri.path_and_query().map_or("/", |pq| pq.as_str())
}

/// A `POST` of `body` to an orders API with no headers, frozen: the request the unit tests
/// record outcomes for.
#[cfg(test)]
pub(crate) fn test_post(body: impl Into<Bytes>) -> FrozenRequest {
    FrozenRequest::from_parts(
        Method::POST,
        Uri::from_static("http://orders.local/orders"),
        Version::HTTP_11,
        HeaderMap::new(),
        body.into(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::key::IDEMPOTENCY_KEY;

    #[test]
    fn a_shared_request_named_for_an_operation_is_copied_whole() {
        let first = FrozenRequest::from_parts(
            Method::POST,
            "http://pay.local/charges".parse().unwrap(),
            Version::HTTP_11,
            HeaderMap::new(),
            Bytes::from_static(b"{}"),
        );
        let kept = first.clone();
        let op = OperationId::new("task-1", "charge");
        let named = first.with_operation(&op);
        assert_eq!(named.operation(), Some(&op));
        assert_eq!(
            kept.operation(),
            None,
            "the other holder's request is unchanged"
        );
        assert_eq!(named.fingerprint(), kept.fingerprint());
        assert_eq!(named.headers(), kept.headers());
    }

    fn keyed_parts(digest: Option<&'static str>) -> http::request::Parts {
        let mut builder =
            Request::post("http://pay.local/charges").header("content-type", "application/json");
        if let Some(digest) = digest {
            builder = builder.header(&CONTENT_DIGEST, digest);
        }
        builder.body(()).unwrap().into_parts().0
    }

    const BODY: &[u8] = br#"{"order_id":"o_1"}"#;

    /// A request frozen as the client face freezes one keyed by an `OperationId`.
    fn keyed_frozen() -> (IdempotencyKey, FrozenRequest) {
        let key = IdempotencyKey::derive("", "task-7", "charge");
        let header = KeyHeader::ietf();
        let adding = Adding::Digest {
            derived_key: Some((&key, &header)),
        };
        let (frozen, _) =
            FrozenRequest::of_collected(keyed_parts(None), Bytes::from_static(BODY), adding);
        (key, frozen)
    }

    #[test]
    fn a_keyed_requests_key_and_digest_are_added_on_the_first_read_of_its_headers() {
        let (key, frozen) = keyed_frozen();
        // Nothing made yet: an operation answered from its record stops here.
        let Headers::Pending { added, .. } = &frozen.0.headers else {
            panic!("a keyed request's headers are pending");
        };
        assert!(added.get().is_none());
        let uri: Uri = "http://pay.local/charges".parse().unwrap();
        let fingerprint = Fingerprint::of_sent(&Method::POST, &uri, &BodyDigest::of(BODY));
        assert_eq!(frozen.fingerprint(), fingerprint);

        // The first read (a claim weighing it, a send, an encoding) adds both.
        let weight = frozen.weight();
        let headers = frozen.headers();
        assert_eq!(headers[&IDEMPOTENCY_KEY], key.header_value());
        assert_eq!(
            headers[&CONTENT_DIGEST],
            BodyDigest::of(BODY).header_value()
        );
        assert_eq!(headers["content-type"], "application/json");
        assert_eq!(frozen.weight(), weight, "the same weight before and after");

        // Every view of the head is the same bytes: an attempt, and a store's encoding.
        let attempt = frozen.to_request();
        assert_eq!(attempt.headers(), headers);
        let decoded = FrozenRequest::decode(&frozen.encode()).unwrap();
        assert_eq!(decoded.headers(), headers);
    }

    #[test]
    fn a_callers_own_content_digest_is_kept_when_the_headers_are_added() {
        let sent = "sha-256=:callers-own:";
        let adding = Adding::Digest { derived_key: None };
        let (frozen, _) =
            FrozenRequest::of_collected(keyed_parts(Some(sent)), Bytes::from_static(BODY), adding);
        let headers = frozen.to_request().headers().clone();
        assert_eq!(
            headers.get_all(&CONTENT_DIGEST).iter().collect::<Vec<_>>(),
            [sent]
        );
        assert!(!headers.contains_key(&IDEMPOTENCY_KEY));
        assert_eq!(frozen.body_digest(), BodyDigest::of(BODY));
    }

    #[test]
    fn threads_reading_a_keyed_requests_headers_at_once_see_them_added_once() {
        let (_, frozen) = keyed_frozen();
        let seen: Vec<HeaderMap> = std::thread::scope(|scope| {
            let readers: Vec<_> = (0..4)
                .map(|_| scope.spawn(|| frozen.headers().clone()))
                .collect();
            readers.into_iter().map(|r| r.join().unwrap()).collect()
        });
        for headers in &seen {
            assert_eq!(headers, frozen.headers());
            assert_eq!(headers.get_all(&IDEMPOTENCY_KEY).iter().count(), 1);
            assert_eq!(headers.get_all(&CONTENT_DIGEST).iter().count(), 1);
        }
    }
}
