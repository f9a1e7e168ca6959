//! Reconciliation: ask the provider whether an in-doubt operation happened, instead of
//! resending it blindly or stopping for a human.
//!
//! The public items are re-exported from [`idempotency`](crate::idempotency); see
//! [`Reconcile`] for how the client layer uses a reconciler.

use std::borrow::Cow;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use tower::ServiceExt;
use tower_service::Service;

use crate::key::KeyHeader;
use crate::BoxError;
use crate::FrozenRequest;

/// How long a reconciler may take before its answer counts as
/// [`Unknown`](Reconciled::Unknown): 10 s.
pub(crate) const DEFAULT_RECONCILE_TIMEOUT: std::time::Duration =
    std::time::Duration::from_secs(10);

/// An in-doubt operation, as a [`Reconcile`] is asked about it.
///
/// ```
/// use tower_idempotency::idempotency::InDoubtOperation;
/// use tower_idempotency::FrozenRequest;
///
/// let frozen = FrozenRequest::from_parts(
///     http::Method::POST,
///     "http://payments.local/charges".parse().unwrap(),
///     http::Version::HTTP_11,
///     http::HeaderMap::new(),
///     bytes::Bytes::from_static(b"{\"order_id\":\"order-42\"}"),
/// );
/// let op = InDoubtOperation::new(frozen, "order-42-charge", Some(1));
/// assert_eq!(op.key(), "order-42-charge");
/// // What a provider reading the IETF draft's header received, quotes and all.
/// assert_eq!(op.sent_key(), "\"order-42-charge\"");
/// assert_eq!(op.payload_field("order_id").as_deref(), Some("order-42"));
/// ```
#[derive(Clone, Debug)]
pub struct InDoubtOperation {
    frozen: FrozenRequest,
    key: Arc<str>,
    key_header: KeyHeader,
    attempts: Option<u32>,
}

impl InDoubtOperation {
    /// An operation whose request was frozen as `frozen` and travels under `key` (its
    /// characters, unquoted), in the IETF draft's header and form unless
    /// [`with_key_header`](Self::with_key_header) says otherwise.
    pub fn new(frozen: FrozenRequest, key: impl Into<Arc<str>>, attempts: Option<u32>) -> Self {
        Self {
            frozen,
            key: key.into(),
            key_header: KeyHeader::ietf(),
            attempts,
        }
    }

    /// The header the key travelled under, and its form (the client layer's
    /// [`key_header`](crate::client::Builder::key_header)).
    ///
    /// ```
    /// # use tower_idempotency::idempotency::InDoubtOperation;
    /// # use tower_idempotency::{key::KeyHeader, FrozenRequest};
    /// # let frozen = FrozenRequest::from_parts(http::Method::POST, "/charges".parse().unwrap(),
    /// #     http::Version::HTTP_11, http::HeaderMap::new(), bytes::Bytes::new());
    /// let op = InDoubtOperation::new(frozen, "order-42", None).with_key_header(KeyHeader::stripe());
    /// assert_eq!(op.sent_key(), "order-42");
    /// ```
    pub fn with_key_header(mut self, header: KeyHeader) -> Self {
        self.key_header = header;
        self
    }

    /// The header the key travelled under, and its form.
    pub fn key_header(&self) -> &KeyHeader {
        &self.key_header
    }

    /// The key's header value exactly as it was sent: the frozen request's value under
    /// [`key_header`](Self::key_header) (`"<key>"` in the IETF draft's sf-string form,
    /// `<key>` bare), or, when the frozen request does not carry it, the key spelled in
    /// that form. Look the operation up by this: a provider that keeps the header as it
    /// arrives has stored exactly these characters, quotes included.
    pub fn sent_key(&self) -> Cow<'_, str> {
        let sent = self
            .key_header
            .sent_value(self.frozen.headers())
            .and_then(|value| value.to_str().ok());
        if let Some(sent) = sent {
            return Cow::Borrowed(sent);
        }
        match self.key_header.spell(&self.key) {
            Ok(spelled) => Cow::Owned(
                spelled
                    .to_str()
                    .expect("a spelled key is visible ASCII")
                    .to_owned(),
            ),
            // A key no header can carry was never sent in one: its characters are all
            // there is.
            Err(_) => Cow::Borrowed(&self.key),
        }
    }

    /// The request as first frozen: the bytes that may have reached the provider.
    pub fn frozen(&self) -> &FrozenRequest {
        &self.frozen
    }

    /// The key's characters, unquoted (for a key derived from an
    /// [`OperationId`](crate::OperationId), its 64 hex digits). This is not always what the
    /// provider received: in the IETF draft's form the header carried it quoted. To look
    /// the operation up at a provider, use [`sent_key`](Self::sent_key).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// How many times the ledger handed the operation out (its first claim and each
    /// resume), when the store can be [inspected](crate::ledger::IdempotencyStore::inspect).
    pub fn attempts(&self) -> Option<u32> {
        self.attempts
    }

    /// A top-level field of the frozen JSON body, as text (a string as is, another value
    /// as JSON): the provider-side reference an operation carries (`order_id`,
    /// `fulfillment_intent_id`). `None` if the body is not a JSON object or lacks it.
    pub fn payload_field(&self, field: &str) -> Option<String> {
        let value: serde_json::Value = serde_json::from_slice(self.frozen.body()).ok()?;
        match value.get(field)? {
            serde_json::Value::String(text) => Some(text.clone()),
            other => Some(other.to_string()),
        }
    }
}

/// What a [`Reconcile`] found out.
///
/// ```
/// use tower_idempotency::idempotency::Reconciled;
///
/// let found = Reconciled::Applied(http::Response::new(bytes::Bytes::from_static(b"{\"id\":\"ch_1\"}")));
/// assert!(matches!(found, Reconciled::Applied(_)));
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum Reconciled {
    /// The operation happened. The response (the provider's real one, or a stand-in built
    /// from what the lookup returned) is recorded as its outcome and returned to the caller.
    Applied(Response<Bytes>),
    /// The operation did not happen: sending the frozen bytes again is safe.
    NotApplied,
    /// It cannot be told: the operation stays in doubt and the caller gets an in-doubt
    /// error.
    Unknown,
}

/// The future a [`Reconcile`] returns. Its failure counts as [`Reconciled::Unknown`].
pub type ReconcileFuture = Pin<Box<dyn Future<Output = Result<Reconciled, BoxError>> + Send>>;

/// Finds out whether an in-doubt operation happened at the provider, so the client layer
/// need neither resend it blindly nor stop for a human.
///
/// An operation is *in doubt* when an attempt may have reached the provider and no answer
/// came back (a timeout, a reset, a crash after sending). Against a provider that
/// deduplicates on `Idempotency-Key`, the client layer resends the frozen bytes and the
/// provider answers the first outcome. Against one that does not
/// ([`provider_deduplicates(false)`](crate::client::Builder::provider_deduplicates)),
/// resending could charge twice, so the layer asks a [`Reconcile`] first — given the frozen
/// request, the key and the attempts made — and acts on its answer:
///
/// | [`Reconciled`] | what the layer does |
/// |---|---|
/// | [`Applied`](Reconciled::Applied) | records the provider's response (or a stand-in) as the outcome and returns it ([`ResponseSource::Reconciled`](crate::ResponseSource::Reconciled)) |
/// | [`NotApplied`](Reconciled::NotApplied) | sends the frozen bytes again, as the operation's owner |
/// | [`Unknown`](Reconciled::Unknown) | leaves the operation in doubt; the caller gets an [in-doubt error](crate::Error::is_in_doubt) |
///
/// The reconciler runs as the operation's owner: the layer takes the in-doubt record over
/// (a new fencing token, the lease renewed while it runs), so two processes resuming one
/// operation never reconcile it at once, and a recorded outcome is fenced like every other
/// ledger write. It is bounded in time
/// ([`reconcile_timeout`](crate::client::Builder::reconcile_timeout), 10 s by
/// default); running past it, failing or panicking counts as [`Unknown`](Reconciled::Unknown).
///
/// [`LookupReconciler`] covers the common shape, "look the operation up at the provider by
/// its key or by a reference in the payload" (`GET /charges?idempotency_key=…`), in a few
/// lines; its docs show a whole run.
///
/// Any `Fn(InDoubtOperation) -> impl Future<Output = Result<Reconciled, BoxError>>` is one:
///
/// ```
/// use tower_idempotency::idempotency::{InDoubtOperation, Reconciled};
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
///
/// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
///     .provider_deduplicates(false)
///     .reconcile(|op: InDoubtOperation| async move {
///         // Ask your provider about `op.key()` or `op.payload_field("order_id")` here.
///         let _ = op;
///         Ok::<_, tower_idempotency::BoxError>(Reconciled::Unknown)
///     })
///     .build()
///     .unwrap();
/// # let _ = layer;
/// ```
pub trait Reconcile: Send + Sync + 'static {
    /// Find out whether `operation` happened.
    fn reconcile(&self, operation: InDoubtOperation) -> ReconcileFuture;
}

impl<F, Fut> Reconcile for F
where
    F: Fn(InDoubtOperation) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Reconciled, BoxError>> + Send + 'static,
{
    fn reconcile(&self, operation: InDoubtOperation) -> ReconcileFuture {
        Box::pin(self(operation))
    }
}

impl fmt::Debug for dyn Reconcile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Reconcile")
    }
}

type BuildLookup =
    dyn Fn(&InDoubtOperation) -> Result<Request<Full<Bytes>>, BoxError> + Send + Sync;
type Classify = dyn Fn(Response<Bytes>) -> Reconciled + Send + Sync;

/// A [`Reconcile`] that looks the operation up at the provider with one request.
///
/// What the lookup's answer means is yours to say, and every constructor asks for it: a
/// classifier of the whole response that reads it as [`Applied`](Reconciled::Applied)
/// (with the response to record as the operation's outcome),
/// [`NotApplied`](Reconciled::NotApplied) or [`Unknown`](Reconciled::Unknown). There is
/// no default, because no status alone tells "found it" from "found nothing": a search
/// endpoint answers `200 {"data":[]}` when nothing matched, and reading that `200` as
/// "applied" records a charge that never happened as done and replays the empty list as
/// its answer. [`record_or_not_found`] is the classifier for a lookup that answers the
/// operation's own record (`2xx` when it exists, `404` or `410` when it does not); for a
/// search or list endpoint, read the body.
///
/// [`applied_status`](Self::applied_status) replaces the status of what is recorded.
///
/// `service` sends the lookup: a plain HTTP client (not a stack with the idempotency layer:
/// a lookup is a read).
///
/// # Example
///
/// A provider that ignores keys, a call whose answer was lost, and the next run of the
/// operation resolving it by looking the key up (the testing kit's provider answers
/// `GET /effects?idempotency_key=…`):
///
/// ```
/// use std::time::Duration;
/// use bytes::Bytes;
/// use http_body_util::{BodyExt, Full};
/// use tower::{ServiceBuilder, ServiceExt};
/// use tower_idempotency::idempotency::{record_or_not_found, LookupReconciler};
/// use tower_idempotency::ledger::MemoryStore;
/// use tower_idempotency::testing::{Fault, SideEffectService};
/// use tower_idempotency::{IdempotencyLayer, OperationId, ResponseSource};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let provider = SideEffectService::builder().honour_keys(false).build();
/// let ledger = MemoryStore::new();
/// let charge = || {
///     let mut req = http::Request::post("http://payments.local/charges")
///         .body(Full::new(Bytes::from_static(b"{\"amount\":4200}")))
///         .unwrap();
///     req.extensions_mut().insert(OperationId::new("task-7", "charge"));
///     req
/// };
///
/// // The charge goes through, its answer never arrives, and the orchestrator gives up.
/// provider.push_fault(Fault::CommitThenTimeout);
/// let naive = ServiceBuilder::new()
///     .layer(IdempotencyLayer::client_builder(ledger.clone()).provider_deduplicates(false).build().unwrap())
///     .service(provider.clone());
/// assert!(tokio::time::timeout(Duration::from_secs(5), naive.oneshot(charge())).await.is_err());
///
/// // The next run asks the provider before anything is sent again.
/// let resumed = ServiceBuilder::new()
///     .layer(
///         IdempotencyLayer::client_builder(ledger.clone())
///             .provider_deduplicates(false)
///             .reconcile(
///                 // The kit's lookup answers the effect itself, or 404.
///                 LookupReconciler::by_key(provider.clone(), "/effects", "idempotency_key", record_or_not_found)
///                     .applied_status(http::StatusCode::CREATED),
///             )
///             .build()
///             .unwrap(),
///     )
///     .service(provider.clone());
/// let response = resumed.oneshot(charge()).await.unwrap();
/// assert_eq!(response.status(), http::StatusCode::CREATED);
/// assert_eq!(ResponseSource::of(&response), ResponseSource::Reconciled);
/// let body = response.into_body().collect().await.unwrap().to_bytes();
/// assert!(body.starts_with(b"{\"effect_id\":\"eff_1\""));
/// assert_eq!(provider.effects(), 1);
/// # }
/// ```
pub struct LookupReconciler<S> {
    service: S,
    build: Arc<BuildLookup>,
    classify: Arc<Classify>,
}

impl<S: Clone> Clone for LookupReconciler<S> {
    fn clone(&self) -> Self {
        Self {
            service: self.service.clone(),
            build: self.build.clone(),
            classify: self.classify.clone(),
        }
    }
}

impl<S> fmt::Debug for LookupReconciler<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LookupReconciler").finish_non_exhaustive()
    }
}

impl<S> LookupReconciler<S> {
    /// Look up with the request `build` makes of the operation, and read its answer with
    /// `classify` (see [`LookupReconciler`]: there is no default reading).
    ///
    /// ```
    /// use tower_idempotency::idempotency::{record_or_not_found, LookupReconciler};
    /// use tower_idempotency::testing::SideEffectService;
    ///
    /// let lookup = LookupReconciler::new(
    ///     SideEffectService::new(),
    ///     |op| {
    ///         let uri = format!("http://payments.local/effects?idempotency_key={}", op.sent_key());
    ///         Ok(http::Request::get(uri).body(Default::default())?)
    ///     },
    ///     record_or_not_found,
    /// );
    /// # let _ = lookup;
    /// ```
    pub fn new<F, C>(service: S, build: F, classify: C) -> Self
    where
        F: Fn(&InDoubtOperation) -> Result<Request<Full<Bytes>>, BoxError> + Send + Sync + 'static,
        C: Fn(Response<Bytes>) -> Reconciled + Send + Sync + 'static,
    {
        Self {
            service,
            build: Arc::new(build),
            classify: Arc::new(classify),
        }
    }

    /// `GET <path>?<param>=<key>` at the frozen request's scheme and authority: the
    /// operation looked up by its key **as it was sent**
    /// ([`InDoubtOperation::sent_key`]): quoted when the key travelled as an sf-string
    /// (the IETF draft's form, the default), bare when it travelled as a token
    /// ([`KeyHeader::stripe`] and the other token presets), as a provider that keeps the
    /// header as it arrives has stored it.
    ///
    /// `classify` reads the answer. A provider's search answers `200` with an empty list
    /// when it found nothing; read the list:
    ///
    /// ```
    /// use bytes::Bytes;
    /// use tower_idempotency::idempotency::{LookupReconciler, Reconciled};
    /// use tower_idempotency::testing::SideEffectService;
    ///
    /// let search = LookupReconciler::by_key(
    ///     SideEffectService::new(),
    ///     "/charges/search",
    ///     "idempotency_key",
    ///     |response: http::Response<Bytes>| {
    ///         let found: Option<serde_json::Value> = serde_json::from_slice(response.body()).ok();
    ///         match found.as_ref().and_then(|found| found["data"].as_array()).map(Vec::as_slice) {
    ///             _ if !response.status().is_success() => Reconciled::Unknown,
    ///             Some([]) => Reconciled::NotApplied,
    ///             Some([charge]) => Reconciled::Applied(http::Response::new(charge.to_string().into())),
    ///             _ => Reconciled::Unknown,
    ///         }
    ///     },
    /// );
    /// # let _ = search;
    /// ```
    pub fn by_key<C>(service: S, path: &str, param: &str, classify: C) -> Self
    where
        C: Fn(Response<Bytes>) -> Reconciled + Send + Sync + 'static,
    {
        let (path, param) = (path.to_owned(), param.to_owned());
        Self::new(
            service,
            move |op| lookup_at(op.frozen(), &path, &param, &op.sent_key()),
            classify,
        )
    }

    /// `GET <path>?<param>=<value>` at the frozen request's scheme and authority, `value`
    /// being the top-level JSON `field` of the frozen body (`order_id`, say): the operation
    /// looked up by a reference it carries, its answer read by `classify`. A body without
    /// the field is [`Unknown`](Reconciled::Unknown).
    ///
    /// ```
    /// use tower_idempotency::idempotency::{record_or_not_found, LookupReconciler};
    /// use tower_idempotency::testing::SideEffectService;
    ///
    /// // `GET /orders/charge?order_id=…` answers the order's charge, or 404.
    /// let lookup = LookupReconciler::by_payload_field(
    ///     SideEffectService::new(), "/orders/charge", "order_id", "order_id", record_or_not_found,
    /// );
    /// # let _ = lookup;
    /// ```
    pub fn by_payload_field<C>(
        service: S,
        path: &str,
        param: &str,
        field: &str,
        classify: C,
    ) -> Self
    where
        C: Fn(Response<Bytes>) -> Reconciled + Send + Sync + 'static,
    {
        let (path, param, field) = (path.to_owned(), param.to_owned(), field.to_owned());
        let build = move |op: &InDoubtOperation| {
            let value = op
                .payload_field(&field)
                .ok_or_else(|| format!("the frozen body has no `{field}` field"))?;
            lookup_at(op.frozen(), &path, &param, &value)
        };
        Self::new(service, build, classify)
    }

    /// Answer a found operation with this status instead of the lookup's (`201 Created`
    /// for a lookup that finds a created charge with `200`), so the caller sees what the
    /// original call would have answered.
    pub fn applied_status(mut self, status: StatusCode) -> Self {
        let classify = self.classify.clone();
        self.classify = Arc::new(move |response| match classify(response) {
            Reconciled::Applied(mut found) => {
                *found.status_mut() = status;
                Reconciled::Applied(found)
            }
            other => other,
        });
        self
    }
}

/// The reading of a lookup that answers **the operation's own record**: a `2xx` is
/// [`Applied`](Reconciled::Applied), the lookup's response recorded as the stand-in for
/// the operation's answer; `404` or `410` is [`NotApplied`](Reconciled::NotApplied);
/// anything else is [`Unknown`](Reconciled::Unknown).
///
/// Only for an endpoint whose `2xx` means "this operation exists" (`GET /charges/{key}`,
/// the testing kit's lookup), and whose `404` means it does not (not a mistyped path).
/// Never for a search or list endpoint: it answers `2xx` with an empty list when nothing
/// matched. As a guard against that mistake, a `2xx` whose JSON body says "nothing found"
/// (`null`, `[]`, `{}`, or an object holding an empty list, as a search's `{"data":[]}`)
/// is [`Unknown`](Reconciled::Unknown): the operation stays in doubt and is reported,
/// never recorded as done. A record that holds an empty list of its own (`"refunds":[]`)
/// is read the same way; give such an endpoint a reading of your own.
///
/// ```
/// use bytes::Bytes;
/// use tower_idempotency::idempotency::{record_or_not_found, Reconciled};
///
/// let answer = |status: u16, body: &'static str| {
///     let mut response = http::Response::new(Bytes::from_static(body.as_bytes()));
///     *response.status_mut() = http::StatusCode::from_u16(status).unwrap();
///     record_or_not_found(response)
/// };
/// assert!(matches!(answer(200, r#"{"id":"ch_1"}"#), Reconciled::Applied(_)));
/// assert!(matches!(answer(404, ""), Reconciled::NotApplied));
/// assert!(matches!(answer(503, ""), Reconciled::Unknown));
/// // A search that found nothing is no record.
/// assert!(matches!(answer(200, r#"{"data":[]}"#), Reconciled::Unknown));
/// ```
pub fn record_or_not_found(response: Response<Bytes>) -> Reconciled {
    let status = response.status();
    if status.is_success() {
        if says_nothing_found(response.body()) {
            Reconciled::Unknown
        } else {
            Reconciled::Applied(response)
        }
    } else if status == StatusCode::NOT_FOUND || status == StatusCode::GONE {
        Reconciled::NotApplied
    } else {
        Reconciled::Unknown
    }
}

/// Whether a `2xx` lookup's body is a search's "nothing found" rather than a record: JSON
/// `null`, `[]`, `{}`, or an object with an empty list among its members. A body that is
/// not JSON (or empty: an existence check) says nothing of the kind.
fn says_nothing_found(body: &[u8]) -> bool {
    use serde_json::Value;
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Null) => true,
        Ok(Value::Array(items)) => items.is_empty(),
        Ok(Value::Object(members)) => {
            members.is_empty()
                || members
                    .values()
                    .any(|member| matches!(member, Value::Array(items) if items.is_empty()))
        }
        _ => false,
    }
}

/// `GET scheme://authority<path>?<param>=<value>`, the value percent-encoded.
fn lookup_at(
    frozen: &FrozenRequest,
    path: &str,
    param: &str,
    value: &str,
) -> Result<Request<Full<Bytes>>, BoxError> {
    let uri = frozen.uri();
    let origin = match (uri.scheme_str(), uri.authority()) {
        (Some(scheme), Some(authority)) => format!("{scheme}://{authority}"),
        _ => String::new(),
    };
    let target = format!(
        "{origin}{path}?{}={}",
        percent_encode(param),
        percent_encode(value)
    );
    Ok(Request::get(target).body(Full::default())?)
}

/// Percent-encode everything but RFC 3986's unreserved characters.
fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

impl<S, B> Reconcile for LookupReconciler<S>
where
    S: Service<Request<Full<Bytes>>, Response = Response<B>> + Clone + Send + Sync + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    fn reconcile(&self, operation: InDoubtOperation) -> ReconcileFuture {
        let lookup = (self.build)(&operation);
        let (service, classify) = (self.service.clone(), self.classify.clone());
        Box::pin(async move {
            let response = service.oneshot(lookup?).await.map_err(Into::into)?;
            let (parts, body) = response.into_parts();
            let body = body.collect().await.map_err(Into::into)?.to_bytes();
            Ok(classify(Response::from_parts(parts, body)))
        })
    }
}

/// Ask `reconciler` about `operation` within `bound`. Its error, its panic and its running
/// past the bound are all a failure (`Err`, kept as the source of the in-doubt error the
/// caller gets), which counts as [`Reconciled::Unknown`]: a reconciler that cannot tell must
/// never be read as "not applied". It runs on a task of its own, so its panic is caught
/// there, and is aborted if this future is dropped or the bound passes.
pub(crate) async fn ask(
    reconciler: &dyn Reconcile,
    operation: InDoubtOperation,
    bound: std::time::Duration,
) -> Result<Reconciled, BoxError> {
    asked(reconciler, operation, bound)
        .await
        .map_err(|(_, failure)| failure)
}

/// Why a reconciler gave no answer: each counts as [`Reconciled::Unknown`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(not(feature = "console"), allow(dead_code))]
pub(crate) enum Unanswered {
    /// It failed, or panicked.
    Failed,
    /// It ran past its bound.
    TimedOut,
}

/// [`ask`], telling a reconciler's failure and its running late apart from its answer (the
/// console says which to the operator who asked).
#[cfg(feature = "console")]
pub(crate) async fn ask_telling_why(
    reconciler: &dyn Reconcile,
    operation: InDoubtOperation,
    bound: std::time::Duration,
) -> Result<Reconciled, Unanswered> {
    asked(reconciler, operation, bound)
        .await
        .map_err(|(why, _)| why)
}

/// The reconciler's answer, or why it gave none and the failure that says so.
async fn asked(
    reconciler: &dyn Reconcile,
    operation: InDoubtOperation,
    bound: std::time::Duration,
) -> Result<Reconciled, (Unanswered, BoxError)> {
    let started = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        reconciler.reconcile(operation)
    }));
    let Ok(future) = started else {
        tracing::warn!("the reconciler panicked; the operation stays in doubt");
        return Err((Unanswered::Failed, "the reconciler panicked".into()));
    };
    let mut task = AbortOnDrop(tokio::spawn(future));
    match tokio::time::timeout(bound, &mut task.0).await {
        Ok(Ok(Ok(verdict))) => Ok(verdict),
        Ok(Ok(Err(err))) => {
            tracing::warn!(%err, "the reconciler failed; the operation stays in doubt");
            Err((Unanswered::Failed, err))
        }
        Ok(Err(join)) => {
            tracing::warn!(%join, "the reconciler panicked; the operation stays in doubt");
            let failure = format!("the reconciler panicked: {join}");
            Err((Unanswered::Failed, failure.into()))
        }
        Err(_) => {
            tracing::warn!(
                ?bound,
                "the reconciler did not answer in time; the operation stays in doubt"
            );
            let failure = format!("the reconciler did not answer within {bound:?}");
            Err((Unanswered::TimedOut, failure.into()))
        }
    }
}

/// A client layer's reconciler and what asking it needs, carried by its
/// [`Records`](crate::ledger::Records) so an operator can ask it now (the console's
/// "reconcile now").
#[derive(Clone)]
#[cfg_attr(not(feature = "console"), allow(dead_code))]
pub(crate) struct Reconciling {
    pub(crate) reconciler: Arc<dyn Reconcile>,
    /// How long it may take (the layer's `reconcile_timeout`).
    pub(crate) timeout: std::time::Duration,
    /// The header the key travels under, and its form.
    pub(crate) key_header: KeyHeader,
    /// The largest response recorded whole; a larger one is recorded as a tombstone.
    pub(crate) response_limit: usize,
}

impl fmt::Debug for Reconciling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reconciling")
            .field("timeout", &self.timeout)
            .field("key_header", &self.key_header)
            .finish_non_exhaustive()
    }
}

#[cfg_attr(not(feature = "console"), allow(dead_code))]
impl Reconciling {
    /// The operation a record in doubt under `ledger_key` keeps as `frozen`, as the layer
    /// would ask about it: its key as sent (read from the frozen request's key header; a
    /// request without one was keyed by an [`OperationId`](crate::OperationId), whose
    /// derived key is the record key), and the attempts the record counts.
    pub(crate) fn operation(
        &self,
        ledger_key: &crate::ledger::LedgerKey,
        frozen: FrozenRequest,
        attempts: u32,
    ) -> InDoubtOperation {
        let key = match self.key_header.read(frozen.headers()) {
            Ok(Some(sent)) => sent.as_str().to_owned(),
            _ => ledger_key.to_hex(),
        };
        InDoubtOperation::new(frozen, key, Some(attempts)).with_key_header(self.key_header.clone())
    }

    /// What an [`Applied`](Reconciled::Applied) answer records: the response found (a
    /// tombstone of its status past the recording cap), as the layer records it.
    pub(crate) fn outcome_of(&self, found: &Response<Bytes>) -> crate::ledger::Outcome {
        recorded_outcome(
            found.status(),
            found.version(),
            found.headers(),
            found.body(),
            self.response_limit,
        )
    }
}

/// The outcome a reconciler's found response is recorded as: whole, with its headers and
/// body in one buffer, or as a tombstone of its status when its body is over `limit`.
pub(crate) fn recorded_outcome(
    status: StatusCode,
    version: http::Version,
    headers: &http::HeaderMap,
    body: &Bytes,
    limit: usize,
) -> crate::ledger::Outcome {
    use crate::ledger::{HeaderBlock, Outcome, StoredResponse};
    if body.len() > limit {
        Outcome::Tombstone { status }
    } else {
        let recorded = HeaderBlock::with_body(headers, body);
        Outcome::Response(StoredResponse::of_block_with_body(
            status, version, recorded,
        ))
    }
}

/// A spawned task aborted when its handle goes away.
struct AbortOnDrop<T>(tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookups_keep_the_origin_and_encode_the_value() {
        let frozen = FrozenRequest::from_parts(
            http::Method::POST,
            "https://pay.local:8443/charges?x=1".parse().unwrap(),
            http::Version::HTTP_11,
            http::HeaderMap::new(),
            Bytes::new(),
        );
        let req = lookup_at(&frozen, "/charges", "idempotency_key", "a b&c").unwrap();
        assert_eq!(req.method(), http::Method::GET);
        assert_eq!(
            req.uri(),
            "https://pay.local:8443/charges?idempotency_key=a%20b%26c"
        );
    }

    #[test]
    fn a_records_lookup() {
        let with = |status: u16| {
            let mut response = Response::new(Bytes::new());
            *response.status_mut() = StatusCode::from_u16(status).unwrap();
            record_or_not_found(response)
        };
        assert!(matches!(with(200), Reconciled::Applied(_)));
        assert!(matches!(with(404), Reconciled::NotApplied));
        assert!(matches!(with(410), Reconciled::NotApplied));
        assert!(matches!(with(500), Reconciled::Unknown));
        assert!(matches!(with(429), Reconciled::Unknown));
    }
}
