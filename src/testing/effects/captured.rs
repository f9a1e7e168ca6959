//! A request as the double received it.

use bytes::Bytes;
use http::{HeaderMap, Method, Uri, Version};

/// A request as the provider received it: method, URI, version, headers and whole body.
///
/// Read them from [`SideEffectService::attempts`](super::SideEffectService::attempts), for
/// instance to check that every retry sent byte-identical bodies under the same key.
///
/// ```
/// # use bytes::Bytes;
/// # use http_body_util::Full;
/// # use tower::ServiceExt;
/// # use tower_idempotency::testing::SideEffectService;
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let provider = SideEffectService::new();
/// let req = http::Request::post("http://mail.local/send")
///     .header("idempotency-key", "welcome-7")
///     .body(Full::new(Bytes::from_static(b"hello")))
///     .unwrap();
/// provider.clone().oneshot(req).await.unwrap();
///
/// let attempts = provider.attempts();
/// assert_eq!(attempts[0].method(), http::Method::POST);
/// assert_eq!(attempts[0].uri().path(), "/send");
/// assert_eq!(attempts[0].key(), Some("welcome-7"));
/// assert_eq!(&attempts[0].body()[..], b"hello");
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct CapturedRequest {
    pub(super) method: Method,
    pub(super) uri: Uri,
    pub(super) version: Version,
    pub(super) headers: HeaderMap,
    pub(super) body: Bytes,
    pub(super) key: Option<String>,
}

impl CapturedRequest {
    /// The request method.
    pub fn method(&self) -> &Method {
        &self.method
    }

    /// The request URI (in-process the full URI; over HTTP usually the path and query).
    pub fn uri(&self) -> &Uri {
        &self.uri
    }

    /// The HTTP version.
    pub fn version(&self) -> Version {
        self.version
    }

    /// The request headers.
    pub fn headers(&self) -> &HeaderMap {
        &self.headers
    }

    /// The whole request body.
    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// The request's `Idempotency-Key` as parsed (without quotes), or `None` when it is
    /// absent, malformed or repeated.
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }
}
