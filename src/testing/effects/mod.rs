//! A fault-injecting side-effect service: a payment, email or order provider double.
//!
//! Use [`SideEffectService`] to assert "one effect per operation" in your own tests. It
//! stands in for the downstream service whose effect must happen exactly once (a card
//! charge, a sent email, a placed order): every call that *commits* counts one effect for
//! the request's `Idempotency-Key`, and faults can be queued to fail calls at the points
//! that matter, so a test can replay both incidents this crate exists to stop:
//!
//! - [`Fault::CommitThenTimeout`]: the effect happens, the answer never arrives, the caller
//!   times out and retries (the first incident).
//! - [`Fault::ServerError`] with `commit: true`: a `500` although the write happened.
//! - [`Fault::RefuseBeforeSend`]: a refused connection, proven to fail before the write.
//! - [`Fault::Panic`] and [`Fault::Latency`]: a provider that dies mid-way, or is slow.
//!
//! Faults are queued and consumed one per call, in order; a call with no fault queued
//! behaves normally. All clones of a service share one state, so keep a clone to read the
//! counts ([`effects_for_key`](SideEffectService::effects_for_key),
//! [`attempts`](SideEffectService::attempts), …) after handing another to the stack under
//! test. Use it in-process as the inner service of a tower stack, or over real HTTP with
//! [`SideEffectService::serve`].
//!
//! # How a call is answered
//!
//! 1. The call takes the next queued fault. [`Fault::RefuseBeforeSend`] fails it at once.
//! 2. The whole body is read and the request recorded in the
//!    [`attempts`](SideEffectService::attempts) log.
//! 3. With key honouring on (the default, like a payment provider), a request with a key is
//!    checked against earlier ones with the same key:
//!
//!    | earlier request with this key | answer | effect |
//!    |---|---|---|
//!    | none | commit (below) | yes |
//!    | committed, same body | the first commit's response, with `idempotent-replayed: true` | no |
//!    | committed, different body | `422` JSON error | no |
//!    | still being processed | `409` JSON error with `retry-after: 1` | no |
//!    | (the key header is malformed or repeated) | `400` JSON error | no |
//!
//!    With key honouring off (a naive provider) or without a key, every call commits.
//! 4. The provider "works" for the base latency plus any [`Fault::Latency`].
//! 5. A commit is the side effect: it counts one effect for the key, assigns an effect id
//!    (`eff_1`, `eff_2`, … in commit order) and answers `201 Created` with
//!    `content-type: application/json` and the body
//!    `{"effect_id":"eff_N","key":"<key>" or null,"body_sha256":"<hex>"}`.
//!
//! # Looking an effect up
//!
//! `GET /effects?idempotency_key=<key>` ([`LOOKUP_PATH`]) asks the provider whether it
//! committed an effect under `<key>` — whether or not it honours keys, as a provider that
//! ignores `Idempotency-Key` for deduplication may still store it with the charge. Found:
//! `200` with the first such commit's body; not found: `404`. This is what a
//! [reconciler](crate::idempotency::LookupReconciler) asks about an in-doubt operation. A
//! lookup is a call (it counts in [`calls`](SideEffectService::calls) and in
//! [`lookups`](SideEffectService::lookups), and takes the next queued fault, so a test can
//! make the lookup itself fail), but never an effect nor an attempt.
//!
//! A fault acts on the call that takes it, whatever step 3 decided; its commit part only
//! happens when the call would commit (a replay, a `409` or a `422` never commits). Once a
//! call has claimed a key, the provider finishes its work even if the caller gives up
//! (drops the future) during the latency, as a real server does when a client disconnects.
//!
//! # Example
//!
//! The first incident, and a provider that honours keys saving the day:
//!
//! ```
//! use std::time::Duration;
//!
//! use bytes::Bytes;
//! use http_body_util::Full;
//! use tower::ServiceExt;
//! use tower_idempotency::testing::{Fault, SideEffectService};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() {
//! let provider = SideEffectService::new().with_faults([Fault::CommitThenTimeout]);
//!
//! let charge = || {
//!     http::Request::post("http://payments.local/charges")
//!         .header("idempotency-key", "\"order-42\"")
//!         .body(Full::new(Bytes::from_static(b"{\"amount\":4200}")))
//!         .unwrap()
//! };
//!
//! // The provider charges the card, but its answer never arrives: the caller times out.
//! let first = tokio::time::timeout(Duration::from_secs(5), provider.clone().oneshot(charge())).await;
//! assert!(first.is_err());
//! assert_eq!(provider.effects_for_key("order-42"), 1);
//!
//! // The retry sends the same key and the same bytes: the provider replays its first answer.
//! let retry = provider.clone().oneshot(charge()).await.unwrap();
//! assert_eq!(retry.status(), http::StatusCode::CREATED);
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//!
//! // One operation, one charge.
//! assert_eq!(provider.effects_for_key("order-42"), 1);
//! assert_eq!(provider.calls(), 2);
//! # }
//! ```

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::convert::Infallible;
use std::fmt;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::request::Parts;
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri, Version};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use sha2::{Digest, Sha256};
use tower_service::Service;

use crate::key::{hex, HeaderKey};
// The mark payment providers (and the IETF draft's examples) put on a replayed answer:
// the one the server face writes.
use crate::server::IDEMPOTENT_REPLAYED;
use crate::BoxError;

mod serve;

pub use serve::ServeHandle;

/// Where [`SideEffectService`] answers lookups: `GET /effects?idempotency_key=<key>` (see
/// the [module docs](self#looking-an-effect-up)).
///
/// ```
/// # use bytes::Bytes;
/// # use http_body_util::Full;
/// # use tower::ServiceExt;
/// use tower_idempotency::testing::{SideEffectService, LOOKUP_PATH};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let provider = SideEffectService::builder().honour_keys(false).build();
/// let lookup = || {
///     http::Request::get(format!("http://pay.local{LOOKUP_PATH}?idempotency_key=k-1"))
///         .body(Full::new(Bytes::new()))
///         .unwrap()
/// };
/// assert_eq!(provider.clone().oneshot(lookup()).await.unwrap().status(), 404);
///
/// let charge = http::Request::post("http://pay.local/charges")
///     .header("idempotency-key", "k-1")
///     .body(Full::new(Bytes::from_static(b"{}")))
///     .unwrap();
/// provider.clone().oneshot(charge).await.unwrap();
/// assert_eq!(provider.clone().oneshot(lookup()).await.unwrap().status(), 200);
/// assert_eq!((provider.effects(), provider.lookups()), (1, 2));
/// # }
/// ```
pub const LOOKUP_PATH: &str = "/effects";

/// A fault to inject into one call of a [`SideEffectService`].
///
/// Queue faults with [`SideEffectService::push_fault`] or
/// [`with_faults`](SideEffectService::with_faults); each call takes the next one. "Commit"
/// below means the call's side effect happens (it counts) — and only when the call would
/// have committed anyway: a replay, a `409` or a `422` never commits.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::testing::{Fault, SideEffectService};
///
/// let provider = SideEffectService::new().with_faults([
///     Fault::Latency(Duration::from_millis(250)),
///     Fault::ServerError { status: http::StatusCode::SERVICE_UNAVAILABLE, commit: false },
/// ]);
/// provider.push_fault(Fault::RefuseBeforeSend);
/// assert_eq!(provider.pending_faults().len(), 3);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fault {
    /// Commit the effect (and, with key honouring on, record the answer for the key), then
    /// never answer, so the caller's timeout fires. The first incident: charged, but the
    /// caller cannot know.
    ///
    /// Over HTTP the response is held open until the client gives up.
    CommitThenTimeout,
    /// Fail at once with an [`io::Error`] of kind
    /// [`ConnectionRefused`](io::ErrorKind::ConnectionRefused), without reading the request
    /// and without an effect, the way a refused connect looks to a client. This crate
    /// classifies that error as a pre-write failure
    /// ([`FailurePhase::PreWrite`](crate::phase::FailurePhase::PreWrite)).
    ///
    /// The request is not recorded in [`attempts`](SideEffectService::attempts) (the
    /// provider never saw it), but counts in [`calls`](SideEffectService::calls).
    ///
    /// Over HTTP the connection is closed without answering once the request head has
    /// arrived. A client cannot tell that from a failure after its bytes were written, and
    /// rightly treats it so; to test a true pre-write refusal over HTTP, point the client
    /// at a closed port.
    RefuseBeforeSend,
    /// Answer `status` (say `500` or `503`) with a JSON error body, after committing the
    /// effect when `commit` is `true` ("500, but the write happened": with key honouring on,
    /// a retry with the same key replays the commit's `201`) or without it (the key, if the
    /// call claimed one, is released so a retry runs normally).
    ServerError {
        /// The status to answer.
        status: StatusCode,
        /// Whether the effect happens before the error is answered.
        commit: bool,
    },
    /// Panic, after committing the effect when `after_commit` is `true` (without it, a
    /// claimed key is released first). In-process the caller's future panics; over HTTP
    /// the connection is dropped.
    Panic {
        /// Whether the effect happens before the panic.
        after_commit: bool,
    },
    /// Wait this long (with [`tokio::time::sleep`], so a paused test clock works), on top
    /// of the base latency, then answer normally.
    Latency(Duration),
}

/// A request as the provider received it: method, URI, version, headers and whole body.
///
/// Read them from [`SideEffectService::attempts`], for instance to check that every retry
/// sent byte-identical bodies under the same key.
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
    method: Method,
    uri: Uri,
    version: Version,
    headers: HeaderMap,
    body: Bytes,
    key: Option<String>,
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

/// Configures a [`SideEffectService`].
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::testing::{Fault, SideEffectService};
///
/// let naive = SideEffectService::builder()
///     .honour_keys(false)
///     .latency(Duration::from_millis(20))
///     .faults([Fault::CommitThenTimeout])
///     .build();
/// assert_eq!(naive.pending_faults(), [Fault::CommitThenTimeout]);
/// ```
#[derive(Clone, Debug)]
#[must_use = "a builder does nothing until `build` is called"]
pub struct SideEffectServiceBuilder {
    honour_keys: bool,
    latency: Duration,
    faults: Vec<Fault>,
}

impl Default for SideEffectServiceBuilder {
    fn default() -> Self {
        Self {
            honour_keys: true,
            latency: Duration::ZERO,
            faults: Vec::new(),
        }
    }
}

impl SideEffectServiceBuilder {
    /// Whether a repeated `Idempotency-Key` is deduplicated like a payment provider does
    /// (replay, `409`, `422`; the default, `true`) or ignored like a naive provider that
    /// commits every call (`false`). Turn it off to prove that *your* side, not the
    /// provider's, keeps effects to one.
    pub fn honour_keys(mut self, honour: bool) -> Self {
        self.honour_keys = honour;
        self
    }

    /// How long every call (except a refused one) takes before it is answered; default
    /// none. Slept with [`tokio::time::sleep`], so a paused test clock works.
    pub fn latency(mut self, latency: Duration) -> Self {
        self.latency = latency;
        self
    }

    /// Queue `faults`, after any queued before.
    pub fn faults(mut self, faults: impl IntoIterator<Item = Fault>) -> Self {
        self.faults.extend(faults);
        self
    }

    /// Build the service.
    #[must_use]
    pub fn build(self) -> SideEffectService {
        SideEffectService {
            shared: Arc::new(Shared {
                honour_keys: self.honour_keys,
                latency: self.latency,
                state: Mutex::new(State {
                    faults: self.faults.into(),
                    ..State::default()
                }),
            }),
        }
    }
}

/// A side-effect provider double that counts effects per key and injects faults.
///
/// A tower [`Service`] over `http::Request<B>` answering
/// `http::Response<Full<Bytes>>`, with `Error = std::io::Error` (so a refused call looks
/// like a transport error). Cloning is cheap and every clone shares the same counts, log
/// and fault queue. See the [module docs](crate::testing::effects) for how calls are
/// answered.
///
/// A call fails with an error only when [`Fault::RefuseBeforeSend`] refuses it
/// (`ConnectionRefused`) or its request body fails (`Other`, wrapping the body's error).
/// Calls run on tokio (latency uses its timer), so use the service inside a tokio runtime.
///
/// ```
/// # use bytes::Bytes;
/// # use http_body_util::Full;
/// # use tower::ServiceExt;
/// use tower_idempotency::testing::SideEffectService;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// // A naive provider charges twice for a retried request, key or not.
/// let naive = SideEffectService::builder().honour_keys(false).build();
/// for _ in 0..2 {
///     let req = http::Request::post("http://payments.local/charges")
///         .header("idempotency-key", "order-42")
///         .body(Full::new(Bytes::from_static(b"{\"amount\":4200}")))
///         .unwrap();
///     let res = naive.clone().oneshot(req).await.unwrap();
///     assert_eq!(res.status(), http::StatusCode::CREATED);
/// }
/// assert_eq!(naive.effects_for_key("order-42"), 2);
/// # }
/// ```
#[derive(Clone)]
pub struct SideEffectService {
    shared: Arc<Shared>,
}

struct Shared {
    honour_keys: bool,
    latency: Duration,
    // A std mutex: every critical section is short and synchronous, and it is never held
    // across an await (the futures below take it, act, and release it before any sleep).
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Bumped by `reset`, so work still in flight from before it cannot touch the new state.
    generation: u64,
    faults: VecDeque<Fault>,
    calls: usize,
    attempts: Vec<CapturedRequest>,
    effects: usize,
    effects_by_key: HashMap<String, usize>,
    effects_without_key: usize,
    /// The body of the first commit under each key, honoured or not: what a lookup finds.
    committed_by_key: HashMap<String, Bytes>,
    lookups: usize,
    /// What the provider remembers per key when it honours keys.
    keys: HashMap<String, KeyRecord>,
}

enum KeyRecord {
    /// Claimed by a call still being processed.
    InProgress,
    /// Committed: the body's digest (to tell a repeat from a different request) and the
    /// body of the `201` to replay.
    Committed {
        body_sha256: [u8; 32],
        response_body: Bytes,
    },
}

impl Default for SideEffectService {
    fn default() -> Self {
        Self::new()
    }
}

impl SideEffectService {
    /// A provider that honours keys, answers at once and has no faults queued.
    pub fn new() -> Self {
        Self::builder().build()
    }

    /// Configure a provider: key honouring, base latency, faults.
    pub fn builder() -> SideEffectServiceBuilder {
        SideEffectServiceBuilder::default()
    }

    /// Queue `faults` after those already queued, and return the service (for chaining
    /// after [`new`](Self::new)).
    #[must_use]
    pub fn with_faults(self, faults: impl IntoIterator<Item = Fault>) -> Self {
        self.lock().faults.extend(faults);
        self
    }

    /// Queue one fault after those already queued; the call that takes it fails with it.
    pub fn push_fault(&self, fault: Fault) {
        self.lock().faults.push_back(fault);
    }

    /// The faults still queued, next first.
    pub fn pending_faults(&self) -> Vec<Fault> {
        self.lock().faults.iter().cloned().collect()
    }

    /// Drop the faults still queued (the provider is healthy from now on), keeping every
    /// count and record.
    ///
    /// ```
    /// # use tower_idempotency::testing::{Fault, SideEffectService};
    /// let provider = SideEffectService::new().with_faults([Fault::RefuseBeforeSend]);
    /// provider.clear_faults();
    /// assert!(provider.pending_faults().is_empty());
    /// ```
    pub fn clear_faults(&self) {
        self.lock().faults.clear();
    }

    /// Effects committed in total.
    pub fn effects(&self) -> usize {
        self.lock().effects
    }

    /// Effects committed for `key` (the `Idempotency-Key` without quotes), or for requests
    /// without a key when `None`.
    pub fn effects_for(&self, key: Option<&str>) -> usize {
        match key {
            Some(key) => self.effects_for_key(key),
            None => self.effects_without_key(),
        }
    }

    /// Effects committed for `key`: the `Idempotency-Key` header's value without quotes
    /// (for a key this crate derived, [`IdempotencyKey::to_hex`](crate::IdempotencyKey::to_hex)).
    pub fn effects_for_key(&self, key: &str) -> usize {
        self.lock().effects_by_key.get(key).copied().unwrap_or(0)
    }

    /// Effects committed for the operation `op` of a client layer built with `scope` (`""`
    /// unless [`ClientBuilder::scope`](crate::client::ClientBuilder::scope) set one):
    /// the key the layer derives and sends for it.
    ///
    /// ```
    /// # use bytes::Bytes;
    /// # use http_body_util::Full;
    /// # use tower::{ServiceBuilder, ServiceExt};
    /// # use tower_idempotency::{ledger::MemoryStore, testing::SideEffectService, IdempotencyLayer, OperationId};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let provider = SideEffectService::new();
    /// let client = ServiceBuilder::new()
    ///     .layer(IdempotencyLayer::client_builder(MemoryStore::new()).scope("billing").build().unwrap())
    ///     .service(provider.clone());
    /// let op = OperationId::new("task-7", "charge");
    /// let mut req = http::Request::post("http://payments.local/charges")
    ///     .body(Full::new(Bytes::from_static(b"{}")))
    ///     .unwrap();
    /// req.extensions_mut().insert(op.clone());
    /// client.oneshot(req).await.unwrap();
    /// assert_eq!(provider.effects_for_operation(&op, "billing"), 1);
    /// assert_eq!(provider.effects_for_operation(&op, ""), 0);
    /// # }
    /// ```
    pub fn effects_for_operation(&self, op: &crate::OperationId, scope: &str) -> usize {
        self.effects_for_key(&op.key(scope).to_hex())
    }

    /// Effects committed for requests without a (valid) key.
    pub fn effects_without_key(&self) -> usize {
        self.lock().effects_without_key
    }

    /// Lookups made ([`LOOKUP_PATH`]), refused ones included.
    pub fn lookups(&self) -> usize {
        self.lock().lookups
    }

    /// Calls made to the service, refused ones included.
    pub fn calls(&self) -> usize {
        self.lock().calls
    }

    /// Every request the provider received, in arrival order. A call refused by
    /// [`Fault::RefuseBeforeSend`], or whose body failed to arrive, is not among them.
    pub fn attempts(&self) -> Vec<CapturedRequest> {
        self.lock().attempts.clone()
    }

    /// Forget everything: counts, attempts, remembered keys, effect ids and queued faults.
    /// Calls still in flight finish without touching the fresh state.
    pub fn reset(&self) {
        let mut state = self.lock();
        let generation = state.generation.wrapping_add(1);
        *state = State {
            generation,
            ..State::default()
        };
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.shared.lock()
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic never happens while the lock is held (faults panic after releasing it),
        // but a poisoned lock must not turn one failed test into a cascade.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Answer a lookup of `key` (never an effect, never an attempt).
    fn look_up(&self, key: &str) -> (u64, Decision) {
        let state = self.lock();
        let answer = match state.committed_by_key.get(key) {
            Some(body) => json_response(StatusCode::OK, body.clone()),
            None => json_error(
                StatusCode::NOT_FOUND,
                "no_such_effect",
                "no effect was committed under this Idempotency-Key",
            ),
        };
        (state.generation, Decision::Answer(answer))
    }

    /// Record the attempt and decide, in one critical section so concurrent calls with the
    /// same key see each other's claims.
    fn decide(&self, parts: Parts, body: Bytes, body_sha256: [u8; 32]) -> (u64, Decision) {
        let key = HeaderKey::from_headers(&parts.headers);
        let mut state = self.lock();
        state.attempts.push(CapturedRequest {
            method: parts.method,
            uri: parts.uri,
            version: parts.version,
            headers: parts.headers,
            body,
            key: key
                .as_ref()
                .ok()
                .and_then(Option::as_ref)
                .map(|key| key.as_str().to_owned()),
        });
        let generation = state.generation;
        let commit = |key: Option<HeaderKey>, claimed| Decision::Commit {
            key: key.map(|key| key.as_str().to_owned()),
            claimed,
            body_sha256,
        };
        if !self.honour_keys {
            // A naive provider never looks at the header; a malformed one counts as no key.
            return (generation, commit(key.ok().flatten(), false));
        }
        let decision = match key {
            Err(invalid) => Decision::Answer(json_error(
                StatusCode::BAD_REQUEST,
                "invalid_idempotency_key",
                &invalid.to_string(),
            )),
            Ok(None) => commit(None, false),
            Ok(Some(key)) => match state.keys.entry(key.as_str().to_owned()) {
                Entry::Vacant(vacant) => {
                    vacant.insert(KeyRecord::InProgress);
                    commit(Some(key), true)
                }
                Entry::Occupied(occupied) => match occupied.get() {
                    KeyRecord::InProgress => {
                        let mut res = json_error(
                            StatusCode::CONFLICT,
                            "idempotency_key_in_progress",
                            "a request with this Idempotency-Key is still being processed",
                        );
                        res.headers_mut()
                            .insert(RETRY_AFTER, HeaderValue::from_static("1"));
                        Decision::Answer(res)
                    }
                    KeyRecord::Committed {
                        body_sha256: stored,
                        response_body,
                    } if *stored == body_sha256 => {
                        let mut res = created(response_body.clone());
                        res.headers_mut().insert(
                            IDEMPOTENT_REPLAYED.clone(),
                            HeaderValue::from_static("true"),
                        );
                        Decision::Answer(res)
                    }
                    KeyRecord::Committed { .. } => Decision::Answer(json_error(
                        StatusCode::UNPROCESSABLE_ENTITY,
                        "idempotency_key_reused",
                        "this Idempotency-Key was used with a different request body",
                    )),
                },
            },
        };
        (generation, decision)
    }
}

impl fmt::Debug for SideEffectService {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.lock();
        f.debug_struct("SideEffectService")
            .field("honour_keys", &self.shared.honour_keys)
            .field("latency", &self.shared.latency)
            .field("calls", &state.calls)
            .field("effects", &state.effects)
            .field("pending_faults", &state.faults)
            .finish_non_exhaustive()
    }
}

/// What the provider decided for one call, before its latency and fault play out.
enum Decision {
    /// An answer without an effect: a replay, a `409`, a `422` or a `400`.
    Answer(Response<Full<Bytes>>),
    /// Perform the effect. `claimed` when this call holds the key's `InProgress` record and
    /// must complete or release it.
    Commit {
        key: Option<String>,
        claimed: bool,
        body_sha256: [u8; 32],
    },
}

/// What a fault does once the latency has passed (`Latency` and no fault both answer
/// normally; `RefuseBeforeSend` never gets this far).
#[derive(Clone, Copy)]
enum Action {
    Normal,
    Hang,
    ServerError { status: StatusCode, commit: bool },
    Panic { commit: bool },
}

/// How the caller's future ends.
enum Ending {
    Answer(Response<Full<Bytes>>),
    Hang,
    Panic,
}

/// The part of a call that runs after its latency; it owns everything it needs, so it can
/// run on its own task and finish even when the caller gives up.
struct Work {
    shared: Arc<Shared>,
    generation: u64,
    decision: Decision,
    action: Action,
}

impl Work {
    fn must_finish(&self) -> bool {
        matches!(self.decision, Decision::Commit { .. })
    }

    fn finish(self) -> Ending {
        let response = match self.decision {
            Decision::Answer(res) => Some(res),
            Decision::Commit {
                key,
                claimed,
                body_sha256,
            } => {
                let commit = match self.action {
                    Action::Normal | Action::Hang => true,
                    Action::ServerError { commit, .. } | Action::Panic { commit } => commit,
                };
                let mut state = self.shared.lock();
                // Work started before a `reset` answers, but leaves the fresh state alone.
                let current = state.generation == self.generation;
                if commit {
                    let body = commit_effect(&mut state, current, key, claimed, body_sha256);
                    Some(created(body))
                } else {
                    if current && claimed {
                        // Nothing happened, so the key is free again: a retry runs normally.
                        if let Some(key) = &key {
                            state.keys.remove(key);
                        }
                    }
                    None
                }
            }
        };
        match self.action {
            Action::Normal => Ending::Answer(response.expect("a normal call answers or commits")),
            Action::Hang => Ending::Hang,
            Action::ServerError { status, .. } => Ending::Answer(injected_error(status)),
            Action::Panic { .. } => Ending::Panic,
        }
    }
}

/// The side effect itself: count it, give it an id and, for a claimed key, remember the
/// answer to replay. Returns the body of the `201`.
fn commit_effect(
    state: &mut State,
    current: bool,
    key: Option<String>,
    claimed: bool,
    body_sha256: [u8; 32],
) -> Bytes {
    let effect_id = state.effects + 1;
    let body = effect_body(effect_id, key.as_deref(), &body_sha256);
    if !current {
        return body;
    }
    state.effects = effect_id;
    match key {
        Some(key) => {
            *state.effects_by_key.entry(key.clone()).or_default() += 1;
            state
                .committed_by_key
                .entry(key.clone())
                .or_insert_with(|| body.clone());
            if claimed {
                let record = KeyRecord::Committed {
                    body_sha256,
                    response_body: body.clone(),
                };
                state.keys.insert(key, record);
            }
        }
        None => state.effects_without_key += 1,
    }
    body
}

impl<B> Service<Request<B>> for SideEffectService
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
{
    type Response = Response<Full<Bytes>>;
    type Error = io::Error;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        // The fault is taken here, synchronously, so concurrent calls take faults in the
        // order they were made, not in the order their bodies happen to arrive.
        let lookup = lookup_key(&req);
        let fault = {
            let mut state = self.lock();
            state.calls += 1;
            state.lookups += usize::from(lookup.is_some());
            state.faults.pop_front()
        };
        let (extra_latency, action) = match fault {
            None => (Duration::ZERO, Action::Normal),
            Some(Fault::RefuseBeforeSend) => {
                return ResponseFuture::new(std::future::ready(Err(io::Error::from(
                    io::ErrorKind::ConnectionRefused,
                ))));
            }
            Some(Fault::Latency(latency)) => (latency, Action::Normal),
            Some(Fault::CommitThenTimeout) => (Duration::ZERO, Action::Hang),
            Some(Fault::ServerError { status, commit }) => {
                (Duration::ZERO, Action::ServerError { status, commit })
            }
            Some(Fault::Panic { after_commit }) => (
                Duration::ZERO,
                Action::Panic {
                    commit: after_commit,
                },
            ),
        };
        let shared = Arc::clone(&self.shared);
        ResponseFuture::new(async move {
            let (parts, body) = req.into_parts();
            let body = body
                .collect()
                .await
                .map_err(|err| io::Error::other(err.into()))?
                .to_bytes();
            let delay = shared.latency.saturating_add(extra_latency);
            let (generation, decision) = match lookup {
                Some(key) => shared.look_up(&key),
                None => {
                    let body_sha256: [u8; 32] = Sha256::digest(&body).into();
                    shared.decide(parts, body, body_sha256)
                }
            };
            let work = Work {
                shared,
                generation,
                decision,
                action,
            };
            let ending = if delay.is_zero() {
                work.finish()
            } else if work.must_finish() {
                // The key is claimed and the effect is due: a caller that gives up during
                // the latency must not cancel it, or the key would stay "in progress"
                // forever and the provider would never commit, unlike a real one.
                tokio::spawn(async move {
                    tokio::time::sleep(delay).await;
                    work.finish()
                })
                .await
                .map_err(io::Error::other)?
            } else {
                tokio::time::sleep(delay).await;
                work.finish()
            };
            match ending {
                Ending::Answer(res) => Ok(res),
                Ending::Hang => {
                    let never: Infallible = std::future::pending().await;
                    match never {}
                }
                Ending::Panic => panic!("SideEffectService: injected Fault::Panic"),
            }
        })
    }
}

/// What a call of a [`SideEffectService`] resolves to.
type CallResult = Result<Response<Full<Bytes>>, io::Error>;

/// The future a [`SideEffectService`] call returns.
pub struct ResponseFuture {
    // Boxed: a call awaits the body, maybe a sleep or a spawned task, maybe forever.
    inner: Pin<Box<dyn Future<Output = CallResult> + Send>>,
}

impl ResponseFuture {
    fn new(future: impl Future<Output = CallResult> + Send + 'static) -> Self {
        Self {
            inner: Box::pin(future),
        }
    }
}

impl Future for ResponseFuture {
    type Output = CallResult;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

/// The body of a commit's `201`, fields in a fixed order so tests can compare bytes.
fn effect_body(effect_id: usize, key: Option<&str>, body_sha256: &[u8; 32]) -> Bytes {
    // serde_json escapes the key: a key may hold `"` or `\`.
    let key = serde_json::to_string(&key).expect("a string or null serializes");
    Bytes::from(format!(
        r#"{{"effect_id":"eff_{effect_id}","key":{key},"body_sha256":"{}"}}"#,
        hex(body_sha256)
    ))
}

/// The key a lookup asks about, if `req` is one (`GET /effects?idempotency_key=…`).
fn lookup_key<B>(req: &Request<B>) -> Option<String> {
    if req.method() != Method::GET || req.uri().path() != LOOKUP_PATH {
        return None;
    }
    let query = req.uri().query().unwrap_or("");
    let encoded = query
        .split('&')
        .find_map(|pair| pair.strip_prefix("idempotency_key="))
        .unwrap_or("");
    Some(percent_decode(encoded))
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = (bytes[i] == b'%')
            .then(|| text.get(i + 1..i + 3))
            .flatten()
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escaped {
            Some(byte) => {
                out.push(byte);
                i += 3;
            }
            None => {
                out.push(if bytes[i] == b'+' { b' ' } else { bytes[i] });
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn created(body: Bytes) -> Response<Full<Bytes>> {
    json_response(StatusCode::CREATED, body)
}

fn injected_error(status: StatusCode) -> Response<Full<Bytes>> {
    json_error(
        status,
        "injected_fault",
        "SideEffectService: injected Fault::ServerError",
    )
}

fn json_error(status: StatusCode, error: &str, message: &str) -> Response<Full<Bytes>> {
    let body = serde_json::json!({ "error": error, "message": message }).to_string();
    json_response(status, Bytes::from(body))
}

fn json_response(status: StatusCode, body: Bytes) -> Response<Full<Bytes>> {
    let mut res = Response::new(Full::new(body));
    *res.status_mut() = status;
    res.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    res
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use http::StatusCode;
    use http_body_util::{BodyExt, Full};
    use sha2::{Digest, Sha256};
    use tokio::time::{timeout, Instant};
    use tower::ServiceExt;

    use super::*;
    use crate::phase::{classify, FailurePhase};

    fn post(key: Option<&str>, body: &'static str) -> Request<Full<Bytes>> {
        let mut builder = Request::post("http://payments.local/charges");
        if let Some(key) = key {
            builder = builder.header("idempotency-key", format!("\"{key}\""));
        }
        builder
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .unwrap()
    }

    async fn send(
        svc: &SideEffectService,
        req: Request<Full<Bytes>>,
    ) -> io::Result<(StatusCode, HeaderMap, Bytes)> {
        let res = svc.clone().oneshot(req).await?;
        let (parts, body) = res.into_parts();
        Ok((
            parts.status,
            parts.headers,
            body.collect().await.unwrap().to_bytes(),
        ))
    }

    fn json(body: &Bytes) -> serde_json::Value {
        serde_json::from_slice(body).unwrap()
    }

    #[tokio::test]
    async fn commit_answers_201_with_the_effect_body() {
        let svc = SideEffectService::new();
        let (status, headers, body) = send(&svc, post(Some("k1"), "{\"a\":1}")).await.unwrap();
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(headers[CONTENT_TYPE], "application/json");
        assert!(headers.get(&IDEMPOTENT_REPLAYED).is_none());
        let sha = hex(&Sha256::digest(b"{\"a\":1}"));
        assert_eq!(
            body,
            format!(r#"{{"effect_id":"eff_1","key":"k1","body_sha256":"{sha}"}}"#)
        );

        let (_, _, body) = send(&svc, post(None, "x")).await.unwrap();
        assert_eq!(json(&body)["effect_id"], "eff_2");
        assert_eq!(json(&body)["key"], serde_json::Value::Null);

        assert_eq!(svc.effects(), 2);
        assert_eq!(svc.effects_for_key("k1"), 1);
        assert_eq!(svc.effects_for(Some("k1")), 1);
        assert_eq!(svc.effects_for(None), 1);
        assert_eq!(svc.effects_without_key(), 1);
        assert_eq!(svc.effects_for_key("other"), 0);
        assert_eq!(svc.calls(), 2);
    }

    #[tokio::test]
    async fn without_a_key_every_call_commits() {
        let svc = SideEffectService::new();
        for _ in 0..3 {
            let (status, _, _) = send(&svc, post(None, "same")).await.unwrap();
            assert_eq!(status, StatusCode::CREATED);
        }
        assert_eq!(svc.effects_without_key(), 3);
        assert_eq!(svc.effects(), 3);
    }

    #[tokio::test]
    async fn same_key_same_body_replays_the_first_commit() {
        let svc = SideEffectService::new();
        let (_, _, first) = send(&svc, post(Some("k"), "body")).await.unwrap();
        let (status, headers, again) = send(&svc, post(Some("k"), "body")).await.unwrap();
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(headers[&IDEMPOTENT_REPLAYED], "true");
        assert_eq!(headers[CONTENT_TYPE], "application/json");
        assert_eq!(again, first);
        assert_eq!(svc.effects_for_key("k"), 1);
        assert_eq!(svc.calls(), 2);
        assert_eq!(svc.attempts().len(), 2);
    }

    #[tokio::test]
    async fn quoted_and_bare_keys_are_the_same_key() {
        let svc = SideEffectService::new();
        send(&svc, post(Some("k"), "body")).await.unwrap();
        let bare = Request::post("/charges")
            .header("idempotency-key", "k")
            .body(Full::new(Bytes::from_static(b"body")))
            .unwrap();
        let (_, headers, _) = send(&svc, bare).await.unwrap();
        assert_eq!(headers[&IDEMPOTENT_REPLAYED], "true");
        assert_eq!(svc.effects_for_key("k"), 1);
    }

    #[tokio::test]
    async fn same_key_different_body_is_422_without_an_effect() {
        let svc = SideEffectService::new();
        send(&svc, post(Some("k"), "original")).await.unwrap();
        let (status, headers, body) = send(&svc, post(Some("k"), "regenerated")).await.unwrap();
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(headers[CONTENT_TYPE], "application/json");
        assert_eq!(json(&body)["error"], "idempotency_key_reused");
        assert_eq!(svc.effects_for_key("k"), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn same_key_while_in_progress_is_409_without_an_effect() {
        let svc = SideEffectService::new().with_faults([Fault::Latency(Duration::from_secs(2))]);
        let start = Instant::now();
        let (slow, busy) = tokio::join!(send(&svc, post(Some("k"), "body")), async {
            let res = send(&svc, post(Some("k"), "body")).await;
            // The duplicate is refused at once, while the first is still working.
            assert_eq!(start.elapsed(), Duration::ZERO);
            res
        });
        let (status, headers, body) = busy.unwrap();
        assert_eq!(status, StatusCode::CONFLICT);
        assert_eq!(headers[RETRY_AFTER], "1");
        assert_eq!(json(&body)["error"], "idempotency_key_in_progress");
        assert_eq!(slow.unwrap().0, StatusCode::CREATED);
        assert_eq!(start.elapsed(), Duration::from_secs(2));
        assert_eq!(svc.effects_for_key("k"), 1);
    }

    #[tokio::test]
    async fn honouring_off_commits_every_call() {
        let svc = SideEffectService::builder().honour_keys(false).build();
        send(&svc, post(Some("k"), "one")).await.unwrap();
        let (status, headers, body) = send(&svc, post(Some("k"), "one")).await.unwrap();
        assert_eq!(status, StatusCode::CREATED);
        assert!(headers.get(&IDEMPOTENT_REPLAYED).is_none());
        assert_eq!(json(&body)["effect_id"], "eff_2");
        let (status, _, _) = send(&svc, post(Some("k"), "two")).await.unwrap();
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(svc.effects_for_key("k"), 3);
    }

    #[tokio::test]
    async fn malformed_key_is_400_when_honoured_and_no_key_when_not() {
        let bad = || {
            Request::post("/charges")
                .header("idempotency-key", "\"unterminated")
                .body(Full::new(Bytes::from_static(b"x")))
                .unwrap()
        };
        let svc = SideEffectService::new();
        let (status, _, body) = send(&svc, bad()).await.unwrap();
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(json(&body)["error"], "invalid_idempotency_key");
        assert_eq!(svc.effects(), 0);

        let naive = SideEffectService::builder().honour_keys(false).build();
        let (status, _, _) = send(&naive, bad()).await.unwrap();
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(naive.effects_without_key(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn commit_then_timeout_commits_and_never_answers() {
        let svc = SideEffectService::new().with_faults([Fault::CommitThenTimeout]);
        let lost = timeout(Duration::from_secs(30), send(&svc, post(Some("k"), "b"))).await;
        assert!(lost.is_err(), "the caller's timeout must fire");
        assert_eq!(svc.effects_for_key("k"), 1);

        // The answer was recorded for the key: the retry replays it.
        let (status, headers, body) = send(&svc, post(Some("k"), "b")).await.unwrap();
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(headers[&IDEMPOTENT_REPLAYED], "true");
        assert_eq!(json(&body)["effect_id"], "eff_1");
        assert_eq!(svc.effects(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn commit_then_timeout_against_a_naive_provider_charges_twice() {
        let svc = SideEffectService::builder()
            .honour_keys(false)
            .faults([Fault::CommitThenTimeout])
            .build();
        let lost = timeout(Duration::from_secs(30), send(&svc, post(Some("k"), "b"))).await;
        assert!(lost.is_err());
        send(&svc, post(Some("k"), "b")).await.unwrap();
        assert_eq!(svc.effects_for_key("k"), 2, "the first incident");
    }

    #[tokio::test]
    async fn refuse_before_send_fails_pre_write_without_an_effect() {
        let svc = SideEffectService::new().with_faults([Fault::RefuseBeforeSend]);
        let err = send(&svc, post(Some("k"), "b")).await.unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused);
        assert_eq!(classify(&err, None), FailurePhase::PreWrite);
        assert_eq!(svc.effects(), 0);
        assert_eq!(svc.calls(), 1);
        assert!(svc.attempts().is_empty(), "the provider never saw it");

        // Nothing was claimed: the retry commits.
        let (status, headers, _) = send(&svc, post(Some("k"), "b")).await.unwrap();
        assert_eq!(status, StatusCode::CREATED);
        assert!(headers.get(&IDEMPOTENT_REPLAYED).is_none());
        assert_eq!(svc.effects_for_key("k"), 1);
    }

    #[tokio::test]
    async fn server_error_after_commit_counts_and_replays_the_commit() {
        let svc = SideEffectService::new().with_faults([Fault::ServerError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            commit: true,
        }]);
        let (status, headers, body) = send(&svc, post(Some("k"), "b")).await.unwrap();
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(headers[CONTENT_TYPE], "application/json");
        assert_eq!(json(&body)["error"], "injected_fault");
        assert_eq!(svc.effects_for_key("k"), 1, "500, but the write happened");

        let (status, headers, _) = send(&svc, post(Some("k"), "b")).await.unwrap();
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(headers[&IDEMPOTENT_REPLAYED], "true");
        assert_eq!(svc.effects_for_key("k"), 1);
    }

    #[tokio::test]
    async fn server_error_without_commit_releases_the_key() {
        let svc = SideEffectService::new().with_faults([Fault::ServerError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            commit: false,
        }]);
        let (status, _, _) = send(&svc, post(Some("k"), "b")).await.unwrap();
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(svc.effects(), 0);

        let (status, headers, body) = send(&svc, post(Some("k"), "b")).await.unwrap();
        assert_eq!(status, StatusCode::CREATED);
        assert!(headers.get(&IDEMPOTENT_REPLAYED).is_none());
        assert_eq!(json(&body)["effect_id"], "eff_1");
        assert_eq!(svc.effects_for_key("k"), 1);
    }

    #[tokio::test]
    async fn panic_after_commit_counts_and_panic_before_releases() {
        let svc = SideEffectService::new().with_faults([
            Fault::Panic {
                after_commit: false,
            },
            Fault::Panic { after_commit: true },
        ]);
        let call = |svc: &SideEffectService| {
            let svc = svc.clone();
            tokio::spawn(async move { send(&svc, post(Some("k"), "b")).await })
        };

        let died = call(&svc).await.unwrap_err();
        assert!(died.is_panic());
        assert_eq!(svc.effects(), 0);

        let died = call(&svc).await.unwrap_err();
        assert!(died.is_panic());
        assert_eq!(svc.effects_for_key("k"), 1);

        // The lock survived both panics, and the committed key replays.
        let (_, headers, _) = send(&svc, post(Some("k"), "b")).await.unwrap();
        assert_eq!(headers[&IDEMPOTENT_REPLAYED], "true");
        assert_eq!(svc.effects(), 1);
    }

    #[tokio::test]
    async fn faults_are_consumed_one_per_call_in_order() {
        let error = |status| Fault::ServerError {
            status,
            commit: false,
        };
        let svc = SideEffectService::new()
            .with_faults([error(StatusCode::BAD_GATEWAY), Fault::RefuseBeforeSend]);
        svc.push_fault(error(StatusCode::SERVICE_UNAVAILABLE));
        assert_eq!(
            svc.pending_faults(),
            [
                error(StatusCode::BAD_GATEWAY),
                Fault::RefuseBeforeSend,
                error(StatusCode::SERVICE_UNAVAILABLE),
            ]
        );

        assert_eq!(
            send(&svc, post(None, "b")).await.unwrap().0,
            StatusCode::BAD_GATEWAY
        );
        assert!(send(&svc, post(None, "b")).await.is_err());
        assert_eq!(
            svc.pending_faults(),
            [error(StatusCode::SERVICE_UNAVAILABLE)]
        );
        assert_eq!(
            send(&svc, post(None, "b")).await.unwrap().0,
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert!(svc.pending_faults().is_empty());
        assert_eq!(
            send(&svc, post(None, "b")).await.unwrap().0,
            StatusCode::CREATED
        );
        assert_eq!(svc.effects(), 1);
        assert_eq!(svc.calls(), 4);
    }

    #[tokio::test]
    async fn a_fault_on_a_replay_answers_without_committing() {
        let svc = SideEffectService::new();
        send(&svc, post(Some("k"), "b")).await.unwrap();
        svc.push_fault(Fault::ServerError {
            status: StatusCode::BAD_GATEWAY,
            commit: true,
        });
        let (status, _, _) = send(&svc, post(Some("k"), "b")).await.unwrap();
        assert_eq!(status, StatusCode::BAD_GATEWAY);
        assert_eq!(svc.effects(), 1, "a replay never commits");
    }

    #[tokio::test(start_paused = true)]
    async fn latency_fault_and_base_latency_use_the_tokio_clock() {
        let svc = SideEffectService::builder()
            .latency(Duration::from_millis(100))
            .faults([Fault::Latency(Duration::from_secs(3))])
            .build();
        let start = Instant::now();
        let (status, _, _) = send(&svc, post(Some("k"), "b")).await.unwrap();
        assert_eq!(status, StatusCode::CREATED);
        assert_eq!(start.elapsed(), Duration::from_millis(3100));

        let start = Instant::now();
        let (_, headers, _) = send(&svc, post(Some("k"), "b")).await.unwrap();
        assert_eq!(headers[&IDEMPOTENT_REPLAYED], "true");
        assert_eq!(start.elapsed(), Duration::from_millis(100));
        assert_eq!(svc.effects(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_caller_that_gives_up_does_not_stop_the_provider() {
        let svc = SideEffectService::new().with_faults([Fault::Latency(Duration::from_secs(10))]);
        let gave_up = timeout(Duration::from_secs(1), send(&svc, post(Some("k"), "b"))).await;
        assert!(gave_up.is_err());
        assert_eq!(svc.effects(), 0, "still working");

        // The retry arrives while the first call is still being processed.
        assert_eq!(
            send(&svc, post(Some("k"), "b")).await.unwrap().0,
            StatusCode::CONFLICT
        );

        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(
            svc.effects_for_key("k"),
            1,
            "the provider finished its work"
        );
        let (_, headers, _) = send(&svc, post(Some("k"), "b")).await.unwrap();
        assert_eq!(headers[&IDEMPOTENT_REPLAYED], "true");
    }

    #[tokio::test]
    async fn attempts_record_what_arrived() {
        let svc = SideEffectService::new();
        let req = Request::put("http://orders.local/orders/7?dry=0")
            .version(Version::HTTP_2)
            .header("idempotency-key", "\"o-7\"")
            .header("x-trace", "abc")
            .body(Full::new(Bytes::from_static(b"{\"sku\":1}")))
            .unwrap();
        send(&svc, req).await.unwrap();
        send(&svc, post(None, "second")).await.unwrap();

        let attempts = svc.attempts();
        assert_eq!(attempts.len(), 2);
        let first = &attempts[0];
        assert_eq!(first.method(), Method::PUT);
        assert_eq!(first.uri(), "http://orders.local/orders/7?dry=0");
        assert_eq!(first.version(), Version::HTTP_2);
        assert_eq!(first.headers()["x-trace"], "abc");
        assert_eq!(first.body(), &Bytes::from_static(b"{\"sku\":1}"));
        assert_eq!(first.key(), Some("o-7"));
        assert_eq!(attempts[1].key(), None);
        assert_eq!(attempts[1].body(), &Bytes::from_static(b"second"));
    }

    #[tokio::test]
    async fn reset_forgets_everything() {
        let svc = SideEffectService::new();
        send(&svc, post(Some("k"), "b")).await.unwrap();
        svc.push_fault(Fault::RefuseBeforeSend);
        svc.reset();
        assert_eq!(
            (svc.effects(), svc.calls(), svc.attempts().len()),
            (0, 0, 0)
        );
        assert!(svc.pending_faults().is_empty());

        let (_, headers, body) = send(&svc, post(Some("k"), "b")).await.unwrap();
        assert!(
            headers.get(&IDEMPOTENT_REPLAYED).is_none(),
            "the key was forgotten"
        );
        assert_eq!(json(&body)["effect_id"], "eff_1");
    }

    #[tokio::test(start_paused = true)]
    async fn work_in_flight_at_reset_does_not_touch_the_fresh_state() {
        let svc = SideEffectService::new().with_faults([Fault::Latency(Duration::from_secs(1))]);
        let in_flight = tokio::spawn({
            let svc = svc.clone();
            async move { send(&svc, post(Some("k"), "b")).await }
        });
        tokio::task::yield_now().await;
        svc.reset();
        assert_eq!(in_flight.await.unwrap().unwrap().0, StatusCode::CREATED);
        assert_eq!(svc.effects(), 0);
    }

    #[test]
    fn debug_shows_the_state() {
        let svc = SideEffectService::new().with_faults([Fault::RefuseBeforeSend]);
        let debug = format!("{svc:?}");
        assert!(debug.contains("honour_keys: true"), "{debug}");
        assert!(debug.contains("RefuseBeforeSend"), "{debug}");
    }

    #[test]
    fn clones_share_state_and_the_service_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync + 'static>() {}
        assert_send_sync::<SideEffectService>();
        assert_send_sync::<CapturedRequest>();
        let svc = SideEffectService::new();
        svc.clone().push_fault(Fault::RefuseBeforeSend);
        assert_eq!(svc.pending_faults().len(), 1);
    }
}
