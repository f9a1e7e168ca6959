//! The provider double: a tower service that counts effects per key.

use std::convert::Infallible;
use std::fmt;
use std::io;
use std::sync::{Arc, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use sha2::{Digest, Sha256};
use tower_service::Service;

use super::captured::CapturedRequest;
use super::fault::Fault;
use super::future::ResponseFuture;
use super::responses::lookup_key;
use super::state::{Action, Ending, Shared, State, Work};
use crate::BoxError;

/// A side-effect provider double that counts effects per key and injects faults.
///
/// A tower [`Service`] over `http::Request<B>` answering
/// `http::Response<Full<Bytes>>`, with `Error = std::io::Error` (so a refused call looks
/// like a transport error). Cloning is cheap and every clone shares the same counts, log
/// and fault queue. How calls are answered is told below.
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
///
/// A fault-injecting side-effect service: a payment, email or order provider double.
///
/// Use [`SideEffectService`] to assert "one effect per operation" in your own tests. It
/// stands in for the downstream service whose effect must happen exactly once (a card
/// charge, a sent email, a placed order): every call that *commits* counts one effect for
/// the request's `Idempotency-Key`, and faults can be queued to fail calls at the points
/// that matter, so a test can replay both incidents this crate exists to stop:
///
/// - [`Fault::CommitThenTimeout`]: the effect happens, the answer never arrives, the caller
///   times out and retries (the first incident).
/// - [`Fault::ServerError`] with `commit: true`: a `500` although the write happened.
/// - [`Fault::RefuseBeforeSend`]: a refused connection, proven to fail before the write.
/// - [`Fault::KeyInUse`]: a `409` that says another request holds the key (Stripe's
///   shape), which is no outcome.
/// - [`Fault::Panic`] and [`Fault::Latency`]: a provider that dies mid-way, or is slow.
///
/// Faults are queued and consumed one per call, in order; a call with no fault queued
/// behaves normally. All clones of a service share one state, so keep a clone to read the
/// counts ([`effects_for_key`](SideEffectService::effects_for_key),
/// [`attempts`](SideEffectService::attempts), …) after handing another to the stack under
/// test. Use it in-process as the inner service of a tower stack, or over real HTTP with
/// [`SideEffectService::serve`].
///
/// # How a call is answered
///
/// 1. The call takes the next queued fault. [`Fault::RefuseBeforeSend`] fails it at once.
/// 2. The whole body is read and the request recorded in the
///    [`attempts`](SideEffectService::attempts) log.
/// 3. With key honouring on (the default, like a payment provider), a request with a key
///    (under its [key header](super::SideEffectServiceBuilder::key_header), `Idempotency-Key` by
///    default; an sf-string and a bare token are the same key) is checked against earlier
///    ones with the same key:
///
///    | earlier request with this key | answer | effect |
///    |---|---|---|
///    | none | commit (below) | yes |
///    | committed, same body | the first commit's response, with `idempotent-replayed: true` | no |
///    | committed, different body | `422` JSON error | no |
///    | still being processed | `409` JSON error with `retry-after: 1` | no |
///    | (the key header is malformed or repeated) | `400` JSON error | no |
///
///    With key honouring off (a naive provider) or without a key, every call commits.
/// 4. The provider "works" for the base latency plus any [`Fault::Latency`].
/// 5. A commit is the side effect: it counts one effect for the key, assigns an effect id
///    (`eff_1`, `eff_2`, … in commit order) and answers `201 Created` with
///    `content-type: application/json` and the body
///    `{"effect_id":"eff_N","key":"<key>" or null,"body_sha256":"<hex>"}`.
///
/// # Looking an effect up
///
/// `GET /effects?idempotency_key=<key>` ([`LOOKUP_PATH`](super::LOOKUP_PATH)) asks the provider whether it
/// committed an effect under `<key>`, the key header's value **as it was sent** (quotes
/// included for an sf-string) — whether or not it honours keys, as a provider that
/// ignores the key for deduplication may still store it with the charge. Found:
/// `200` with the first such commit's body; not found: `404`. This is what a
/// [reconciler](crate::idempotency::LookupReconciler) asks about an in-doubt operation. A
/// lookup is a call (it counts in [`calls`](SideEffectService::calls) and in
/// [`lookups`](SideEffectService::lookups), and takes the next queued fault, so a test can
/// make the lookup itself fail), but never an effect nor an attempt.
///
/// A fault acts on the call that takes it, whatever step 3 decided; its commit part only
/// happens when the call would commit (a replay, a `409` or a `422` never commits). Once a
/// call has claimed a key, the provider finishes its work even if the caller gives up
/// (drops the future) during the latency, as a real server does when a client disconnects.
///
/// # Example
///
/// The first incident, and a provider that honours keys saving the day:
///
/// ```
/// use std::time::Duration;
///
/// use bytes::Bytes;
/// use http_body_util::Full;
/// use tower::ServiceExt;
/// use tower_idempotency::testing::{Fault, SideEffectService};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let provider = SideEffectService::new().with_faults([Fault::CommitThenTimeout]);
///
/// let charge = || {
///     http::Request::post("http://payments.local/charges")
///         .header("idempotency-key", "\"order-42\"")
///         .body(Full::new(Bytes::from_static(b"{\"amount\":4200}")))
///         .unwrap()
/// };
///
/// // The provider charges the card, but its answer never arrives: the caller times out.
/// let first = tokio::time::timeout(Duration::from_secs(5), provider.clone().oneshot(charge())).await;
/// assert!(first.is_err());
/// assert_eq!(provider.effects_for_key("order-42"), 1);
///
/// // The retry sends the same key and the same bytes: the provider replays its first answer.
/// let retry = provider.clone().oneshot(charge()).await.unwrap();
/// assert_eq!(retry.status(), http::StatusCode::CREATED);
/// assert_eq!(retry.headers()["idempotent-replayed"], "true");
///
/// // One operation, one charge.
/// assert_eq!(provider.effects_for_key("order-42"), 1);
/// assert_eq!(provider.calls(), 2);
/// # }
/// ```
#[derive(Clone)]
pub struct SideEffectService {
    pub(super) shared: Arc<Shared>,
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

    /// Effects committed for `key` (the key's characters, without quotes), or for requests
    /// without a key when `None`.
    pub fn effects_for(&self, key: Option<&str>) -> usize {
        match key {
            Some(key) => self.effects_for_key(key),
            None => self.effects_without_key(),
        }
    }

    /// Effects committed for `key`: the key's characters, whichever form the header was
    /// written in (for a key this crate derived,
    /// [`IdempotencyKey::to_hex`](crate::IdempotencyKey::to_hex)).
    pub fn effects_for_key(&self, key: &str) -> usize {
        self.lock().effects_by_key.get(key).copied().unwrap_or(0)
    }

    /// Effects committed for the operation `op` of a client layer built with `scope` (`""`
    /// unless [`client::Builder::scope`](crate::client::Builder::scope) set one):
    /// the key the layer derives and sends for it.
    ///
    /// ```
    /// # use bytes::Bytes;
    /// # use http_body_util::Full;
    /// # use tower::{ServiceBuilder, ServiceExt};
    /// use tower_idempotency::KeyHeader;
    /// # use tower_idempotency::{ledger::MemoryStore, testing::SideEffectService, IdempotencyLayer, OperationId};
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let provider = SideEffectService::new();
    /// let client = ServiceBuilder::new()
    ///     .layer(IdempotencyLayer::client_builder(MemoryStore::new()).provider_deduplicates(true).key_header(KeyHeader::ietf()).scope("billing").build().unwrap())
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

    /// Lookups made ([`LOOKUP_PATH`](super::LOOKUP_PATH)), refused ones included.
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
            Some(Fault::KeyInUse) => (Duration::ZERO, Action::KeyInUse),
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
