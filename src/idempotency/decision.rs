//! One `tracing` event per ledger decision, the same on both faces.
//!
//! Field names are dotted, as OpenTelemetry attributes are: `idempotency.face` (`client`,
//! `server`), `idempotency.decision` and `idempotency.key.digest`. The digest is the first
//! 16 hex digits of `SHA-256("tower-idempotency/log/v1" || key)` over the `Idempotency-Key`
//! as it travels (unquoted), so a client's and a server's logs of one operation can be
//! joined, while neither ever logs the key itself (a caller's own key may be a secret) or a
//! credential. It is computed only when an event is recorded.
//!
//! With feature `metrics`, each decision also counts in `idempotency_decisions_total`
//! (labels `face`, `decision`).
//!
//! A hook set with `on_outcome` on a face's builder (client, server, tool) gets one
//! [`OutcomeEvent`] per request that reached the ledger, once its answer is known.
//!
//! A warning that an effect may repeat or that a payload was discarded is a [`Signal`]:
//! besides its `WARN` event, it counts in `idempotency_safety_signals_total` (labels
//! `face`, `signal`) and the hook sees it in [`OutcomeEvent::signals`], so an application
//! without a `tracing` subscriber still hears of it.

use std::fmt;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use http::StatusCode;
use sha2::{Digest, Sha256};
use tokio::time::Instant;

use crate::key::{hex, HeaderKey, IdempotencyKey};

/// Which face of the layer decided: in an [`OutcomeEvent`].
///
/// ```
/// use tower_idempotency::idempotency::Face;
///
/// assert_eq!(Face::Client.as_str(), "client");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Face {
    /// The client face, in front of a transport.
    Client,
    /// The server face, in front of handlers.
    Server,
    /// The tool face, in front of any tool call ([`tool`](crate::tool)).
    Tool,
}

impl Face {
    /// The name logs and metrics use: `client`, `server`, `tool`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Client => "client",
            Self::Server => "server",
            Self::Tool => "tool",
        }
    }
}

/// What the ledger decided for one request: in an [`OutcomeEvent`], the last decision
/// taken for it (an operation acquired and then left in doubt reports
/// [`InDoubt`](Decision::InDoubt)).
///
/// ```
/// use tower_idempotency::idempotency::Decision;
///
/// assert_eq!(Decision::InDoubt.as_str(), "in_doubt");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Decision {
    /// A new operation: sent (client) or run (server).
    Acquired,
    /// The recorded outcome was returned; nothing was sent or run.
    Replayed,
    /// An in-doubt operation was taken over: resent (client) or run again (server).
    Resumed,
    /// Another owner holds it.
    Busy,
    /// The same key with another request.
    Drift,
    /// Left or found in doubt.
    InDoubt,
    /// Released after a failure proven to happen before anything was sent.
    Released,
    /// Refused: the ledger is full of records it must keep.
    Full,
    /// Refused: the ledger is unavailable (fail closed).
    Unavailable,
    /// An in-doubt operation's [reconciler](crate::idempotency::Reconcile) found it had
    /// happened; its answer was recorded and returned, nothing was sent again (client).
    Reconciled,
}

/// How a `begin` answer is logged (the server face's; the client face logs the same).
impl Decision {
    pub(crate) fn of_begin(answer: &crate::ledger::Begin) -> Self {
        use crate::ledger::Begin;
        match answer {
            Begin::Acquired { .. } => Self::Acquired,
            Begin::Resume { .. } => Self::Resumed,
            Begin::Replay(_) => Self::Replayed,
            Begin::Busy { .. } => Self::Busy,
            Begin::InDoubt => Self::InDoubt,
            Begin::Drift { .. } | Begin::DriftFields { .. } => Self::Drift,
            // Answers added later are refused like an in-doubt operation.
            #[allow(unreachable_patterns)]
            _ => Self::InDoubt,
        }
    }
}

impl Decision {
    const ALL: [Self; 10] = [
        Self::Acquired,
        Self::Replayed,
        Self::Resumed,
        Self::Busy,
        Self::Drift,
        Self::InDoubt,
        Self::Released,
        Self::Full,
        Self::Unavailable,
        Self::Reconciled,
    ];

    /// The name logs and metrics use: `acquired`, `replayed`, `resumed`, `busy`, `drift`,
    /// `in_doubt`, `released`, `full`, `unavailable`, `reconciled`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Acquired => "acquired",
            Self::Replayed => "replayed",
            Self::Resumed => "resumed",
            Self::Busy => "busy",
            Self::Drift => "drift",
            Self::InDoubt => "in_doubt",
            Self::Released => "released",
            Self::Full => "full",
            Self::Unavailable => "unavailable",
            Self::Reconciled => "reconciled",
        }
    }
}

/// A safety signal: something happened to a request that means its effect **may repeat**,
/// or that what its caller (or the ledger) had **was discarded**. Each is a `WARN` event in
/// `tracing` (a followed redirect, an unkeyed request and a retry window longer than told
/// the first time only; a tombstone kept past a scope's share at most every 30 s), and
/// never only that: with feature `metrics` it counts in `idempotency_safety_signals_total`
/// (labels `face`, `signal`), and the face's `on_outcome` hook sees it in
/// [`OutcomeEvent::signals`] ([`Unkeyed`](Signal::Unkeyed) excepted: such a request never
/// reaches the ledger).
///
/// ```
/// use tower_idempotency::idempotency::Signal;
///
/// assert_eq!(Signal::FailOpen.as_str(), "fail_open");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Signal {
    /// The ledger was unavailable and the layer was built to
    /// [fail open](crate::server::Builder::fail_open): the request was sent (client) or run
    /// (server) unprotected, and a retry of it may run its effect again.
    FailOpen,
    /// A regenerated request joined its operation: it was answered for the payload first
    /// frozen, and its own payload was discarded (a client's
    /// [`PayloadDiscarded`](crate::PayloadDiscarded), a tool's
    /// [`Discarded`](crate::tool::Discarded)).
    PayloadDiscarded,
    /// The owner's lease was taken over while it still worked (a renewal was refused as
    /// fenced): another run may have resumed the operation and sent it again, so its effect
    /// may repeat. The owner's own writes are refused from then on, never applied.
    LeaseLost,
    /// The transport followed a redirect of an operation's request (reqwest does by
    /// default): its answer is taken as the redirect's, never as a sign that nothing ran,
    /// but with such a client a failure on a redirect's hop reads as a failure before
    /// sending, and releases an operation that ran, so its effect may repeat. Build the
    /// client without redirects (see the `reqwest` module, feature `reqwest`).
    RedirectFollowed,
    /// The operation completed, but the ledger kept only a tombstone of it, not its
    /// response: it had no room for the outcome, or the outcome would have taken its scope
    /// past its share of a ledger under pressure (a
    /// [`MemoryStore`](crate::ledger::MemoryStore)'s budget). The effect is not run again,
    /// but a later run of the operation cannot be answered with its response
    /// ([`Error::is_replay_unavailable`](crate::Error::is_replay_unavailable), a server's
    /// `410`): its outcome was discarded. Raised on the request that completed, when its
    /// store answers in place (a `MemoryStore` does).
    OutcomeDiscarded,
    /// A side-effecting request passed through the client face unprotected, with no
    /// [`OperationId`](crate::OperationId) and no key, because the layer was built with
    /// [`require_key(false)`](crate::client::Builder::require_key): a retry of it runs its
    /// effect again. Counted for every such request; never seen by `on_outcome`, which hears
    /// of requests that reached the ledger (the response carries
    /// [`ResponseSource::Unprotected`](crate::ResponseSource::Unprotected)).
    Unkeyed,
    /// The [`FrozenRetryLayer`](crate::FrozenRetryLayer) inside the client face may keep
    /// retrying longer than the face was told
    /// ([`retry_policy`](crate::client::Builder::retry_policy)), which it checked its
    /// protected window and retention against: the operation's record could expire or be
    /// evicted while it is still retried, and the effect then run again. Build the face with
    /// the retry layer's policy.
    RetryWindowExceeded,
    /// An attempt that may have reached the provider was sent again under its key: a retry
    /// inside the client face after a failure that may have arrived, or the resume of an
    /// operation in doubt. One effect only if the provider deduplicates on the key as it
    /// was sent, as the face was told ([`ProviderKeys::Deduplicates`](crate::ProviderKeys)
    /// and its [`key_header`](crate::client::Builder::key_header)); counted so that a
    /// provider that does not (told wrongly, or reading another header) shows as resends
    /// rather than as silent second effects. The response is marked
    /// [`ResponseSource::Resent`](crate::ResponseSource::Resent).
    ResentInDoubt,
}

impl Signal {
    const ALL: [Self; 8] = [
        Self::FailOpen,
        Self::PayloadDiscarded,
        Self::LeaseLost,
        Self::RedirectFollowed,
        Self::OutcomeDiscarded,
        Self::Unkeyed,
        Self::RetryWindowExceeded,
        Self::ResentInDoubt,
    ];

    /// The name metrics use: `fail_open`, `payload_discarded`, `lease_lost`,
    /// `redirect_followed`, `outcome_discarded`, `unkeyed`, `retry_window_exceeded`,
    /// `resent_in_doubt`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::FailOpen => "fail_open",
            Self::PayloadDiscarded => "payload_discarded",
            Self::LeaseLost => "lease_lost",
            Self::RedirectFollowed => "redirect_followed",
            Self::OutcomeDiscarded => "outcome_discarded",
            Self::Unkeyed => "unkeyed",
            Self::RetryWindowExceeded => "retry_window_exceeded",
            Self::ResentInDoubt => "resent_in_doubt",
        }
    }

    /// This signal's bit in a [`Track`]'s set.
    fn bit(self) -> u8 {
        let index = Self::ALL
            .iter()
            .position(|s| *s == self)
            .expect("every signal is in ALL");
        1 << index
    }
}

/// The key as it travels in `Idempotency-Key`, for its digest.
#[derive(Clone, Debug)]
pub(crate) enum WireKey {
    /// Derived from an `OperationId`: travels as its 64 hex digits.
    Derived(IdempotencyKey),
    /// The caller's own, or the one a server received.
    Header(HeaderKey),
}

/// Formats the digest of a [`WireKey`] (only when an event or a span records it).
pub(crate) struct KeyDigest<'a>(pub(crate) &'a WireKey);

impl fmt::Display for KeyDigest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut hasher = Sha256::new();
        hasher.update(b"tower-idempotency/log/v1");
        match self.0 {
            WireKey::Derived(key) => hasher.update(key.to_hex().as_bytes()),
            WireKey::Header(key) => hasher.update(key.as_bytes()),
        }
        f.write_str(&hex(&hasher.finalize()[..8]))
    }
}

/// A request's `idempotency` span (`tracing::debug_span!` with these fields), or no span at
/// all ([`RequestSpan`]) when no subscriber takes `debug`.
///
/// Such a span would be disabled anyway; a disabled span, even
/// [`Span::none`](tracing::Span::none), is still checked, and with `tracing`'s `log`
/// feature (which axum's default `tower-log` turns on) handed to `log`, at every poll,
/// enter, exit and drop.
macro_rules! request_span {
    ($($fields:tt)*) => {
        $crate::idempotency::decision::RequestSpan(
            tracing::level_enabled!(tracing::Level::DEBUG)
                .then(|| tracing::debug_span!("idempotency", $($fields)*)),
        )
    };
}
pub(crate) use request_span;

/// The span the layer's fields (`key`, `outcome`, `settled`) are recorded in: the current
/// one when it is the layer's own ([`request_span!`], enabled, as a current span is), else
/// none, where recording does nothing.
///
/// The current span is the caller's whenever the layer's is disabled (a filter that takes
/// `debug` for other targets only, a subscriber reloaded during the request): its fields
/// are not the layer's to write. With no subscriber that takes `debug` at all, the
/// layer's span is disabled, and the lookup (a thread-local access, several per request)
/// is skipped.
pub(crate) fn layer_span() -> tracing::Span {
    if !tracing::level_enabled!(tracing::Level::DEBUG) {
        return tracing::Span::none();
    }
    let current = tracing::Span::current();
    let ours = current.metadata().is_some_and(|meta| {
        meta.name() == "idempotency" && meta.target().starts_with(env!("CARGO_CRATE_NAME"))
    });
    if ours {
        current
    } else {
        tracing::Span::none()
    }
}

/// Record `field` in the layer's span ([`layer_span`]); nothing at all, not even a span
/// handle to drop, when no subscriber may take `debug`.
pub(crate) fn record_in_layer_span(field: &str, value: impl tracing::Value) {
    if tracing::level_enabled!(tracing::Level::DEBUG) {
        layer_span().record(field, value);
    }
}

/// A request's span, when a subscriber may take it (see [`request_span!`]).
#[derive(Clone, Debug, Default)]
pub(crate) struct RequestSpan(pub(crate) Option<tracing::Span>);

impl RequestSpan {
    /// Enter the span, if there is one.
    pub(crate) fn enter(&self) -> Option<tracing::span::Entered<'_>> {
        self.0.as_ref().map(tracing::Span::enter)
    }

    /// The span, or [`Span::none`](tracing::Span::none), for what needs one.
    pub(crate) fn into_span(self) -> tracing::Span {
        self.0.unwrap_or_else(tracing::Span::none)
    }
}

/// What one request that reached the ledger came to, for a hook set with
/// [`client::Builder::on_outcome`](crate::client::Builder::on_outcome) or
/// [`server::Builder::on_outcome`](crate::server::Builder::on_outcome).
///
/// It says nothing secret: the key only as its digest (the one the decision events log,
/// the same on a client and on the server it calls), never the key itself, the scope or a
/// credential.
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use tower::{ServiceBuilder, ServiceExt};
/// use tower_idempotency::KeyHeader;
/// use tower_idempotency::idempotency::{Decision, OutcomeEvent};
/// use tower_idempotency::testing::SideEffectService;
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer, OperationId};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let seen = Arc::new(Mutex::new(Vec::new()));
/// let layer = IdempotencyLayer::client_builder(MemoryStore::new()).provider_deduplicates(true).key_header(KeyHeader::ietf())
///     .on_outcome({
///         let seen = seen.clone();
///         move |event: &OutcomeEvent<'_>| {
///             seen.lock().unwrap().push((event.decision(), event.status(), event.key_digest()))
///         }
///     })
///     .build()
///     .unwrap();
/// let client = ServiceBuilder::new().layer(layer).service(SideEffectService::new());
/// let mut req = http::Request::post("http://payments.local/charges").body(String::from("{}")).unwrap();
/// req.extensions_mut().insert(OperationId::new("task-7", "charge"));
/// client.oneshot(req).await.unwrap();
///
/// let seen = seen.lock().unwrap();
/// assert_eq!(seen[0].0, Decision::Acquired);
/// assert_eq!(seen[0].1, Some(http::StatusCode::CREATED));
/// assert_eq!(seen[0].2.len(), 16);
/// # }
/// ```
#[derive(Debug)]
pub struct OutcomeEvent<'a> {
    face: Face,
    decision: Decision,
    key: &'a WireKey,
    status: Option<StatusCode>,
    elapsed: Duration,
    signals: u8,
}

impl OutcomeEvent<'_> {
    /// Which face decided.
    pub fn face(&self) -> Face {
        self.face
    }

    /// The last decision taken for the request.
    pub fn decision(&self) -> Decision {
        self.decision
    }

    /// The key's digest, 16 hex digits, as the decision events log it (computed on call).
    pub fn key_digest(&self) -> String {
        KeyDigest(self.key).to_string()
    }

    /// The status answered, when there was a response (replayed, recorded or not); `None`
    /// when the request ended in an error.
    pub fn status(&self) -> Option<StatusCode> {
        self.status
    }

    /// From the layer receiving the request to its answer being known (the response's
    /// head; its body may still be streaming).
    pub fn elapsed(&self) -> Duration {
        self.elapsed
    }

    /// The [safety signals](Signal) raised for the request, each once, in the order of
    /// [`Signal`]'s variants; none for nearly every request. A hook that alerts on them
    /// sees what the `WARN` events say, without reading logs.
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use tower::{ServiceBuilder, ServiceExt};
    /// use tower_idempotency::KeyHeader;
    /// use tower_idempotency::idempotency::{OutcomeEvent, Signal};
    /// use tower_idempotency::testing::SideEffectService;
    /// use tower_idempotency::{ledger::MemoryStore, DriftPolicy, IdempotencyLayer, OperationId};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() {
    /// let discarded = Arc::new(Mutex::new(0));
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .provider_deduplicates(true)
    ///     .key_header(KeyHeader::ietf())
    ///     .drift_policy(DriftPolicy::ResendFrozen)
    ///     .on_outcome({
    ///         let discarded = discarded.clone();
    ///         move |event: &OutcomeEvent<'_>| {
    ///             if event.signals().any(|signal| signal == Signal::PayloadDiscarded) {
    ///                 *discarded.lock().unwrap() += 1; // page someone: a payload took no effect
    ///             }
    ///         }
    ///     })
    ///     .build()
    ///     .unwrap();
    /// let client = ServiceBuilder::new().layer(layer).service(SideEffectService::new());
    /// let charge = |body: &str| {
    ///     let mut req = http::Request::post("http://payments.local/charges").body(body.to_owned()).unwrap();
    ///     req.extensions_mut().insert(OperationId::new("task-7", "charge"));
    ///     req
    /// };
    /// client.clone().oneshot(charge(r#"{"amount":10}"#)).await.unwrap();
    /// client.oneshot(charge(r#"{"amount":12}"#)).await.unwrap(); // regenerated
    /// assert_eq!(*discarded.lock().unwrap(), 1);
    /// # }
    /// ```
    pub fn signals(&self) -> impl Iterator<Item = Signal> + '_ {
        Signal::ALL
            .into_iter()
            .filter(|signal| self.signals & signal.bit() != 0)
    }
}

/// A user's `on_outcome` hook.
#[derive(Clone)]
pub(crate) struct OutcomeHook(Arc<dyn Fn(&OutcomeEvent<'_>) + Send + Sync>);

impl OutcomeHook {
    pub(crate) fn new(hook: impl Fn(&OutcomeEvent<'_>) + Send + Sync + 'static) -> Self {
        Self(Arc::new(hook))
    }
}

impl fmt::Debug for OutcomeHook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("OutcomeHook")
    }
}

/// The decisions taken for one request: each is logged (and counted) as it is taken, and
/// the last one is reported to the hook when the answer is known.
pub(crate) struct Track {
    face: Face,
    /// The key, when an event or the hook may need its digest (the server keeps a copy of
    /// the key only then).
    wire: Option<WireKey>,
    /// The last decision, as its index in [`Decision::ALL`] plus one; zero for none yet.
    last: AtomicU8,
    /// The [`Signal`]s raised, one bit each.
    signals: AtomicU8,
}

impl Track {
    pub(crate) fn new(face: Face, wire: Option<WireKey>) -> Self {
        Self {
            face,
            wire,
            last: AtomicU8::new(0),
            signals: AtomicU8::new(0),
        }
    }

    pub(crate) fn wire(&self) -> Option<&WireKey> {
        self.wire.as_ref()
    }

    /// A track of its own for a part of the request that decides on its own (a nested
    /// exchange); [`follow`](Self::follow) takes its decisions back.
    pub(crate) fn fork(&self) -> Self {
        Self {
            face: self.face,
            wire: self.wire.clone(),
            last: AtomicU8::new(self.last.load(Ordering::Relaxed)),
            signals: AtomicU8::new(self.signals.load(Ordering::Relaxed)),
        }
    }

    /// Take the latest decision of `fork`, made after it was forked from this track, and
    /// the signals it raised.
    pub(crate) fn follow(&self, fork: &Track) {
        self.last
            .store(fork.last.load(Ordering::Relaxed), Ordering::Relaxed);
        self.signals
            .fetch_or(fork.signals.load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// Count `signal` and keep it for the hook. The `WARN` event is the caller's to write,
    /// where it knows what to say.
    pub(crate) fn signal(&self, signal: Signal) {
        count_signal(self.face, signal);
        self.signals.fetch_or(signal.bit(), Ordering::Relaxed);
    }

    /// [`signal`](Self::signal) each of the signals a store raised during a call of this
    /// request's ([`StoreSignals`]).
    pub(crate) fn signal_all(&self, raised: StoreSignals) {
        for signal in Signal::ALL {
            if raised.0 & signal.bit() != 0 {
                self.signal(signal);
            }
        }
    }

    /// Log and count `decision`, and remember it as the request's latest.
    pub(crate) fn decided(&self, decision: Decision) {
        #[cfg(feature = "metrics")]
        metrics::counter!(
            "idempotency_decisions_total",
            "face" => self.face.as_str(),
            "decision" => decision.as_str()
        )
        .increment(1);
        if let Some(wire) = &self.wire {
            log(self.face, decision, wire);
        }
        let index = Decision::ALL
            .iter()
            .position(|d| *d == decision)
            .expect("every decision is in ALL");
        self.last.store(index as u8 + 1, Ordering::Relaxed);
    }

    /// Tell `hook` what the request came to; nothing when no decision was taken.
    pub(crate) fn report(
        &self,
        hook: Option<&OutcomeHook>,
        started: Option<Instant>,
        status: Option<StatusCode>,
    ) {
        let (Some(hook), Some(started), Some(key)) = (hook, started, &self.wire) else {
            return;
        };
        let Some(index) = self.last.load(Ordering::Relaxed).checked_sub(1) else {
            return;
        };
        (hook.0)(&OutcomeEvent {
            face: self.face,
            decision: Decision::ALL[usize::from(index)],
            key,
            status,
            elapsed: started.elapsed(),
            signals: self.signals.load(Ordering::Relaxed),
        });
    }
}

/// The signals a store raised ([`raise_in_store`]) during one call of a face's into it.
#[derive(Clone, Copy, Debug, Default)]
#[must_use = "signals a store raised are meant for the request's track"]
pub(crate) struct StoreSignals(u8);

thread_local! {
    /// The signals raised by the store a face is calling on this thread, while it calls it
    /// ([`with_store_signals`]); `None` when no face is listening.
    static STORE_SIGNALS: std::cell::Cell<Option<u8>> = const { std::cell::Cell::new(None) };
}

/// Run `call`, a face's call into its store for one request, and give back what it returned
/// with the signals the store raised while it ran ([`raise_in_store`]). A store has no
/// request's [`Track`] to raise them on (its trait is the user's to implement, and says
/// nothing of signals), but a store that answers in place does its work inside the call,
/// on this thread.
pub(crate) fn with_store_signals<T>(call: impl FnOnce() -> T) -> (T, StoreSignals) {
    let outer = STORE_SIGNALS.with(|cell| cell.replace(Some(0)));
    let answer = call();
    let raised = STORE_SIGNALS.with(|cell| cell.replace(outer)).unwrap_or(0);
    (answer, StoreSignals(raised))
}

pin_project_lite::pin_project! {
    /// A store call's future, each poll made under [`with_store_signals`]: for a store
    /// that does its work when polled. Its output comes with the signals raised.
    pub(crate) struct WithStoreSignals<F> {
        #[pin]
        call: F,
        raised: u8,
    }
}

/// Watch the store call `call` for the signals the store raises while it is polled.
pub(crate) fn watch_store_signals<F: std::future::Future>(call: F) -> WithStoreSignals<F> {
    WithStoreSignals { call, raised: 0 }
}

impl<F: std::future::Future> std::future::Future for WithStoreSignals<F> {
    type Output = (F::Output, StoreSignals);

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let this = self.project();
        let (poll, StoreSignals(raised)) = with_store_signals(|| this.call.poll(cx));
        *this.raised |= raised;
        poll.map(|answer| (answer, StoreSignals(*this.raised)))
    }
}

/// A store raises `signal` for the request whose call it is answering: the face that
/// called it ([`with_store_signals`]) puts it on the request's track. Nothing when no face
/// is listening (the store used on its own, or answering on another thread).
pub(crate) fn raise_in_store(signal: Signal) {
    STORE_SIGNALS.with(|cell| {
        if let Some(raised) = cell.get() {
            cell.set(Some(raised | signal.bit()));
        }
    });
}

/// Count `signal` in `idempotency_safety_signals_total` (feature `metrics`): for a
/// signal raised where no request's [`Track`] is at hand.
pub(crate) fn count_signal(face: Face, signal: Signal) {
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "idempotency_safety_signals_total",
        "face" => face.as_str(),
        "signal" => signal.as_str()
    )
    .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = (face, signal);
}

/// What one request that reached the ledger came to, built by a face whose [`Track`]
/// keeps only its signals (the tool face, which reads its decision from the answer): its
/// hook is called with it.
pub(crate) fn report_once(
    hook: &OutcomeHook,
    (face, decision, key): (Face, Decision, &WireKey),
    started: Instant,
    signals: &Track,
) {
    (hook.0)(&OutcomeEvent {
        face,
        decision,
        key,
        status: None,
        elapsed: started.elapsed(),
        signals: signals.signals.load(Ordering::Relaxed),
    });
}

/// Record `decision` as one event, at a level that says how much it deserves attention.
fn log(face: Face, decision: Decision, key: &WireKey) {
    let (face, what, digest) = (face.as_str(), decision.as_str(), KeyDigest(key));
    match decision {
        Decision::Drift | Decision::Full | Decision::Unavailable => tracing::warn!(
            idempotency.face = face,
            idempotency.decision = what,
            idempotency.key.digest = %digest,
            "idempotency decision"
        ),
        Decision::InDoubt | Decision::Resumed | Decision::Reconciled => tracing::info!(
            idempotency.face = face,
            idempotency.decision = what,
            idempotency.key.digest = %digest,
            "idempotency decision"
        ),
        _ => tracing::debug!(
            idempotency.face = face,
            idempotency.decision = what,
            idempotency.key.digest = %digest,
            "idempotency decision"
        ),
    }
}

/// How a `begin` answer is logged.
pub(crate) fn decision_of(answer: &crate::ledger::Begin) -> Decision {
    match answer {
        crate::ledger::Begin::Acquired { .. } => Decision::Acquired,
        crate::ledger::Begin::Resume { .. } => Decision::Resumed,
        crate::ledger::Begin::Replay(_) => Decision::Replayed,
        crate::ledger::Begin::Busy { .. } => Decision::Busy,
        crate::ledger::Begin::InDoubt => Decision::InDoubt,
        crate::ledger::Begin::Drift { .. } | crate::ledger::Begin::DriftFields { .. } => {
            Decision::Drift
        }
        // Answers added later are refused like an in-doubt operation.
        #[allow(unreachable_patterns)]
        _ => Decision::InDoubt,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_derived_key_and_the_header_it_travels_in_have_one_digest() {
        let derived = IdempotencyKey::derive("", "task", "step");
        let value = derived.header_value();
        let received = HeaderKey::parse(&value).unwrap();
        let a = KeyDigest(&WireKey::Derived(derived)).to_string();
        let b = KeyDigest(&WireKey::Header(received)).to_string();
        assert_eq!(a, b);
        assert_eq!(a.len(), 16);
        assert!(!a.contains(&derived.to_hex()[..16]));
    }
}
