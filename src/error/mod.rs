//! The client-side error type.

use std::fmt;
use std::time::Duration;

use crate::ledger::StoreError;
use crate::phase::FailurePhase;
use crate::BoxError;
use crate::InvalidKey;

mod drift;

pub use drift::Drift;

/// Errors from the client [`IdempotencyLayer`](crate::IdempotencyLayer) and the
/// [`FrozenRetryLayer`](crate::FrozenRetryLayer).
///
/// Opaque, in the manner of `hyper::Error`: ask what happened with the `is_*` predicates
/// and [`phase`](Error::phase); the message text is not part of the API. Converts into
/// [`tower::BoxError`].
///
/// ```
/// use tower_idempotency::Error;
///
/// fn explain(err: &Error) -> &'static str {
///     if err.is_drift() {
///         "the payload changed under the same operation id"
///     } else if err.is_body_too_large() {
///         "request too large to freeze; nothing was sent"
///     } else {
///         "other"
///     }
/// }
/// # let _ = explain;
/// ```
pub struct Error {
    inner: Box<ErrorImpl>,
}

struct ErrorImpl {
    kind: Kind,
    source: Option<BoxError>,
}

#[derive(Debug)]
enum Kind {
    MissingKey,
    MissingScope,
    InvalidKey(InvalidKey),
    BodyTooLarge {
        limit: usize,
        declared: Option<u64>,
    },
    Body,
    Drift(Drift),
    Busy {
        retry_after: Duration,
    },
    Store,
    Inner {
        phase: FailurePhase,
    },
    AttemptTimeout,
    ReplayUnavailable,
    /// What the reconciler said, if one was asked.
    InDoubt {
        reconciler: Asked,
    },
    KeyInUse {
        retry_after: Option<Duration>,
    },
    ResponseBody,
    RetryOutside,
    RetryNested,
    /// `first`: how far the first send of the attempt got, as the transport saw it.
    RetryInside {
        first: FailurePhase,
    },
    /// `layer`: the retrying layer found in the type of the service under the face.
    RetryLayerInside {
        layer: &'static str,
    },
    /// A gRPC call to a method the layer's table does not name.
    #[cfg_attr(not(feature = "tonic"), allow(dead_code))]
    MethodNotListed {
        path: Box<str>,
    },
}

/// Whether a reconciler was asked about an operation left in doubt, and what came of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Asked {
    /// None is configured, or the face does not ask one on this path.
    No,
    /// It answered [`Unknown`](crate::idempotency::Reconciled::Unknown).
    Unknown,
    /// It failed, panicked or ran past its bound: the error's source says which.
    Failed,
}

impl Error {
    fn new(kind: Kind, source: Option<BoxError>) -> Self {
        Self {
            inner: Box::new(ErrorImpl { kind, source }),
        }
    }

    pub(crate) fn missing_key() -> Self {
        Self::new(Kind::MissingKey, None)
    }

    pub(crate) fn missing_scope() -> Self {
        Self::new(Kind::MissingScope, None)
    }

    pub(crate) fn from_invalid_key(err: InvalidKey) -> Self {
        Self::new(Kind::InvalidKey(err), None)
    }

    pub(crate) fn body_too_large(limit: usize, declared: Option<u64>) -> Self {
        Self::new(Kind::BodyTooLarge { limit, declared }, None)
    }

    pub(crate) fn body(source: BoxError) -> Self {
        Self::new(Kind::Body, Some(source))
    }

    pub(crate) fn from_drift(drift: Drift) -> Self {
        Self::new(Kind::Drift(drift), None)
    }

    pub(crate) fn busy(retry_after: Duration) -> Self {
        Self::new(Kind::Busy { retry_after }, None)
    }

    pub(crate) fn store(source: StoreError) -> Self {
        Self::new(Kind::Store, Some(Box::new(source)))
    }

    pub(crate) fn inner(source: BoxError, phase: FailurePhase) -> Self {
        Self::new(Kind::Inner { phase }, Some(source))
    }

    /// This error, knowing that an earlier attempt of the same call may have been sent as
    /// far as `earlier`: "may have been sent" is sticky across attempts.
    /// The error this one wraps, taken out when it is a `T`: how an adapter hands a
    /// transport's own error back to the stack it came from. Any other, `self` as it was.
    #[cfg(feature = "reqwest-middleware")]
    pub(crate) fn take_source<T: std::error::Error + 'static>(mut self) -> Result<Box<T>, Self> {
        let Some(source) = self.inner.source.take() else {
            return Err(self);
        };
        match source.downcast::<T>() {
            Ok(found) => Ok(found),
            Err(other) => {
                self.inner.source = Some(other);
                Err(self)
            }
        }
    }

    pub(crate) fn after_earlier_attempts(mut self, earlier: FailurePhase) -> Self {
        if let Kind::Inner { phase } = &mut self.inner.kind {
            *phase = phase.strongest(earlier);
        }
        self
    }

    pub(crate) fn attempt_timeout() -> Self {
        Self::new(Kind::AttemptTimeout, None)
    }

    pub(crate) fn replay_unavailable() -> Self {
        Self::new(Kind::ReplayUnavailable, None)
    }

    pub(crate) fn key_in_use(retry_after: Option<Duration>) -> Self {
        Self::new(Kind::KeyInUse { retry_after }, None)
    }

    pub(crate) fn in_doubt() -> Self {
        Self::new(
            Kind::InDoubt {
                reconciler: Asked::No,
            },
            None,
        )
    }

    /// Left in doubt after asking the reconciler: it answered `Unknown` (`failure` is
    /// `None`) or failed with `failure`, kept as this error's source.
    pub(crate) fn unreconciled(failure: Option<BoxError>) -> Self {
        let reconciler = match failure {
            Some(_) => Asked::Failed,
            None => Asked::Unknown,
        };
        Self::new(Kind::InDoubt { reconciler }, failure)
    }

    pub(crate) fn response_body(source: BoxError) -> Self {
        Self::new(Kind::ResponseBody, Some(source))
    }

    pub(crate) fn retry_outside() -> Self {
        Self::new(Kind::RetryOutside, None)
    }

    pub(crate) fn retry_nested() -> Self {
        Self::new(Kind::RetryNested, None)
    }

    /// A second send of one attempt, refused; `first` is how far its first send got.
    pub(crate) fn retry_inside(first: FailurePhase) -> Self {
        Self::new(Kind::RetryInside { first }, None)
    }

    /// A retrying layer that is not ours found under the face by its type; nothing sent.
    pub(crate) fn retry_layer_inside(layer: &'static str) -> Self {
        Self::new(Kind::RetryLayerInside { layer }, None)
    }

    /// A gRPC call to a method its layer's table does not name; nothing sent.
    #[cfg(feature = "tonic")]
    pub(crate) fn method_not_listed(path: &str) -> Self {
        Self::new(Kind::MethodNotListed { path: path.into() }, None)
    }

    /// A side-effecting request carried no [`OperationId`](crate::OperationId) and no
    /// `Idempotency-Key`, and the layer requires one. Nothing was sent.
    pub fn is_missing_key(&self) -> bool {
        matches!(self.inner.kind, Kind::MissingKey)
    }

    /// The caller's own `Idempotency-Key` travelled without a credential to scope it by
    /// (no `Authorization` header, and no
    /// [scope function](crate::client::Builder::caller_key_scope)). Nothing was
    /// sent.
    pub fn is_missing_scope(&self) -> bool {
        matches!(self.inner.kind, Kind::MissingScope)
    }

    /// The caller's own `Idempotency-Key` header was malformed. Nothing was sent.
    pub fn is_invalid_key(&self) -> bool {
        matches!(self.inner.kind, Kind::InvalidKey(_))
    }

    /// The request body was over the freeze limit. Nothing was sent.
    pub fn is_body_too_large(&self) -> bool {
        matches!(self.inner.kind, Kind::BodyTooLarge { .. })
    }

    /// Reading the request body failed. Nothing was sent.
    pub fn is_body(&self) -> bool {
        matches!(self.inner.kind, Kind::Body)
    }

    /// The operation was seen before with a different payload; see [`Error::drift`].
    pub fn is_drift(&self) -> bool {
        matches!(self.inner.kind, Kind::Drift(_))
    }

    /// Another caller holds the operation's lease and waiting for it was not allowed or
    /// ran out; see [`Error::retry_after`].
    pub fn is_busy(&self) -> bool {
        matches!(self.inner.kind, Kind::Busy { .. })
    }

    /// The ledger failed (unavailable, timed out, fenced). When this happens before the
    /// request is sent, nothing was sent: the layer fails closed.
    pub fn is_store(&self) -> bool {
        matches!(self.inner.kind, Kind::Store)
    }

    /// The ledger refused the operation because its memory budget is full of records it
    /// must keep (see [`StoreError::is_full`]). Nothing was sent; retry later, or give the
    /// store a larger budget.
    ///
    /// ```
    /// # use tower_idempotency::Error;
    /// fn should_shed_load(err: &Error) -> bool {
    ///     err.is_ledger_full()
    /// }
    /// # let _ = should_shed_load;
    /// ```
    pub fn is_ledger_full(&self) -> bool {
        self.store_error().is_some_and(StoreError::is_full)
    }

    /// The inner service failed; see [`Error::phase`] for whether the request may have left.
    pub fn is_inner(&self) -> bool {
        matches!(self.inner.kind, Kind::Inner { .. })
    }

    /// A per-attempt timeout of the [`FrozenRetryLayer`](crate::FrozenRetryLayer) elapsed.
    pub fn is_timeout(&self) -> bool {
        matches!(self.inner.kind, Kind::AttemptTimeout)
    }

    /// The operation completed before, but only a tombstone of it was kept (its response was
    /// over the recording cap, or the ledger had no room for it when it completed): it cannot
    /// be replayed, and it is not run again either.
    pub fn is_replay_unavailable(&self) -> bool {
        matches!(self.inner.kind, Kind::ReplayUnavailable)
    }

    /// The operation may have taken effect and its outcome is not known: the failure
    /// happened after its bytes may have left (a [timeout](Error::is_timeout), a transport
    /// error whose [phase](Error::phase) is not `PreWrite`, a lost
    /// [response body](Error::is_response_body)), or the operation was found so and not
    /// sent again ([`is_unreconciled`](Error::is_unreconciled)).
    ///
    /// The ledger keeps such an operation in doubt: running the step again resumes it with
    /// the bytes first frozen (or asks the reconciler), so retrying is safe; what is not
    /// safe is treating the call as not having happened.
    ///
    /// ```
    /// # use tower_idempotency::Error;
    /// fn the_step_may_have_charged(err: &Error) -> bool {
    ///     err.is_in_doubt()
    /// }
    /// # let _ = the_step_may_have_charged;
    /// ```
    pub fn is_in_doubt(&self) -> bool {
        match self.inner.kind {
            Kind::InDoubt { .. }
            | Kind::AttemptTimeout
            | Kind::ResponseBody
            | Kind::KeyInUse { .. } => true,
            Kind::Inner { phase } | Kind::RetryInside { first: phase } => {
                phase.may_have_been_sent()
            }
            _ => false,
        }
    }

    /// The operation was in doubt and was **not** sent again: an earlier attempt may have
    /// reached a server that does not deduplicate on `Idempotency-Key`, and no reconciler
    /// could tell whether it happened (none is configured, or it answered
    /// [`Unknown`](crate::idempotency::Reconciled::Unknown), failed or timed out).
    /// Reconcile it out of band, or let a later run ask again. Implies
    /// [`is_in_doubt`](Error::is_in_doubt).
    /// See [`client::Builder::provider_deduplicates`](crate::client::Builder::provider_deduplicates).
    ///
    /// ```
    /// # use tower_idempotency::Error;
    /// fn needs_reconciling(err: &Error) -> bool {
    ///     err.is_unreconciled()
    /// }
    /// # let _ = needs_reconciling;
    /// ```
    pub fn is_unreconciled(&self) -> bool {
        matches!(self.inner.kind, Kind::InDoubt { .. })
    }

    /// The provider refused the request because a request with its key is still being
    /// processed (a `409` that says the key is in use: see the
    /// [client docs](crate::client#a-providers-409)), and the retries inside did not see it
    /// through. **Not a final answer**: the operation is kept in doubt, never recorded
    /// with this refusal, and running the step again resends the frozen bytes, which the
    /// provider then answers with the first request's outcome. Implies
    /// [`is_in_doubt`](Error::is_in_doubt); [`retry_after`](Error::retry_after) is the
    /// provider's `Retry-After`, when it sent one.
    ///
    /// ```
    /// # use tower_idempotency::Error;
    /// fn come_back_later(err: &Error) -> Option<std::time::Duration> {
    ///     err.is_key_in_use().then(|| err.retry_after().unwrap_or_default())
    /// }
    /// # let _ = come_back_later;
    /// ```
    pub fn is_key_in_use(&self) -> bool {
        matches!(self.inner.kind, Kind::KeyInUse { .. })
    }

    /// Reading the response body failed after the request was sent.
    pub fn is_response_body(&self) -> bool {
        matches!(self.inner.kind, Kind::ResponseBody)
    }

    /// A [`FrozenRetryLayer`](crate::FrozenRetryLayer) sits **outside** the client
    /// [`IdempotencyLayer`](crate::IdempotencyLayer) (the two stacked the wrong way
    /// round), so each of its retries would consult the ledger as a new visit and a retry
    /// would be judged outside the operation's record. Refused before anything is sent, on
    /// every request, until the stack is fixed: the idempotency layer outside (first in
    /// `ServiceBuilder`), or both built as one with
    /// [`build_stack`](crate::client::Builder::build_stack).
    ///
    /// ```
    /// # use tower_idempotency::Error;
    /// fn the_stack_is_upside_down(err: &Error) -> bool {
    ///     err.is_retry_outside()
    /// }
    /// # let _ = the_stack_is_upside_down;
    /// ```
    pub fn is_retry_outside(&self) -> bool {
        matches!(self.inner.kind, Kind::RetryOutside)
    }

    /// A second [`FrozenRetryLayer`](crate::FrozenRetryLayer) sits under the one the
    /// client [`IdempotencyLayer`](crate::IdempotencyLayer) hands its operations to: its
    /// retries would resend attempts that may have arrived, judged without the provider's
    /// keys or the operation's doubt, and the response would still read
    /// [`Sent`](crate::ResponseSource::Sent). Refused by the inner one before its first
    /// send, on every operation, until the stack is fixed: one `FrozenRetryLayer`, directly
    /// inside the idempotency layer. Nothing was sent, so the operation is released, and
    /// the retry layer outside does not retry the refusal.
    ///
    /// ```
    /// # use tower_idempotency::Error;
    /// fn two_retry_layers_stacked(err: &Error) -> bool {
    ///     err.is_retry_nested()
    /// }
    /// # let _ = two_retry_layers_stacked;
    /// ```
    pub fn is_retry_nested(&self) -> bool {
        matches!(self.inner.kind, Kind::RetryNested)
    }

    /// A retrying layer that is not this crate's (`tower::retry`, a hedge, a layer of
    /// your own) sits between the client [`IdempotencyLayer`](crate::IdempotencyLayer)
    /// (or the tool face) and the transport. Such a layer resends blind to the provider's
    /// keys and to the operation's doubt, and a provider that ignores keys would run the
    /// effect again. Seen one of two ways:
    ///
    /// - **by its type** (`tower::retry`, `tower::hedge`), when the layer wrapped the
    ///   service: every side effect is refused before it is claimed, and nothing was sent
    ///   ([`phase`](Error::phase) is `None`, the operation untouched);
    /// - **by its second send** of one attempt, when the type hides it: the transport of
    ///   this crate ([`ReqwestService`](crate::reqwest::ReqwestService), any transport
    ///   wrapped in [`SendOnce`](crate::client::SendOnce)) or a
    ///   [`FrozenRetryLayer`](crate::FrozenRetryLayer) under it refused the second send
    ///   before any byte of it left. The first send may have run: the operation is settled
    ///   as that send's outcome dictates, never released as unsent unless the first send
    ///   failed before writing ([`phase`](Error::phase) is the first send's).
    ///
    /// Refused on every operation until the stack is fixed: retry with a
    /// [`FrozenRetryLayer`](crate::FrozenRetryLayer) directly inside the idempotency layer
    /// (or [`build_stack`](crate::client::Builder::build_stack)), and drop the other one.
    ///
    /// ```
    /// # use tower_idempotency::Error;
    /// fn a_foreign_retry_layer_inside(err: &Error) -> bool {
    ///     err.is_retry_inside()
    /// }
    /// # let _ = a_foreign_retry_layer_inside;
    /// ```
    pub fn is_retry_inside(&self) -> bool {
        matches!(
            self.inner.kind,
            Kind::RetryInside { .. } | Kind::RetryLayerInside { .. }
        )
    }

    /// A gRPC call to a method the layer's [`Methods`](crate::grpc::Methods) table does not
    /// name was refused before anything was sent (feature `tonic`): on the wire a unary
    /// call looks like a streaming one, and a side effect the table forgot would go out
    /// unprotected. Name the method (`unary`, `reads`, `server_streaming`…).
    ///
    /// ```
    /// # use tower_idempotency::Error;
    /// fn a_method_the_table_forgot(err: &Error) -> bool {
    ///     err.is_method_not_listed()
    /// }
    /// # let _ = a_method_the_table_forgot;
    /// ```
    pub fn is_method_not_listed(&self) -> bool {
        matches!(self.inner.kind, Kind::MethodNotListed { .. })
    }

    /// Our error inside `err`, however deep: `err` itself, one of its
    /// [`source`](std::error::Error::source)s, or (feature `reqwest-middleware`) the error
    /// a `reqwest_middleware::Error::Middleware` wraps.
    ///
    /// Stacks put their own wrappers around it. With `reqwest-retry` in front of the
    /// [`IdempotencyMiddleware`](crate::reqwest_middleware::IdempotencyMiddleware), a
    /// refusal of ours is two wrappers deep: a `reqwest_middleware::Error::Middleware`
    /// holding `reqwest-retry`'s `RetryError`, holding the `reqwest_middleware::Error` this
    /// crate returned, holding this error. A `tower::BoxError` from a stack with layers of
    /// its own may hold it as a source. Ask this rather than downcasting by hand.
    ///
    /// ```
    /// use tower_idempotency::Error;
    ///
    /// fn is_drift(err: &(dyn std::error::Error + 'static)) -> bool {
    ///     Error::find(err).is_some_and(Error::is_drift)
    /// }
    /// let io = std::io::Error::other("connection reset");
    /// assert!(!is_drift(&io));
    /// ```
    pub fn find<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<&'a Error> {
        let mut next = Some(err);
        while let Some(err) = next {
            if let Some(ours) = err.downcast_ref::<Error>() {
                return Some(ours);
            }
            #[cfg(feature = "reqwest-middleware")]
            if let Some(::reqwest_middleware::Error::Middleware(wrapped)) =
                err.downcast_ref::<::reqwest_middleware::Error>()
            {
                // `Middleware` forwards `source` past the error it wraps: look at that one.
                let wrapped: &(dyn std::error::Error + 'static) = wrapped.as_ref();
                next = Some(wrapped);
                continue;
            }
            next = err.source();
        }
        None
    }

    /// The drift report, when [`is_drift`](Error::is_drift).
    pub fn drift(&self) -> Option<&Drift> {
        match &self.inner.kind {
            Kind::Drift(drift) => Some(drift),
            _ => None,
        }
    }

    /// The key error, when [`is_invalid_key`](Error::is_invalid_key).
    pub fn invalid_key(&self) -> Option<&InvalidKey> {
        match &self.inner.kind {
            Kind::InvalidKey(err) => Some(err),
            _ => None,
        }
    }

    /// How long to wait before trying again, when the answer is known: the current owner's
    /// lease left, when [`is_busy`](Error::is_busy); when room frees up, when
    /// [`is_ledger_full`](Error::is_ledger_full) and the store knows
    /// ([`StoreError::retry_after`]).
    ///
    /// ```
    /// # use tower_idempotency::Error;
    /// async fn back_off(err: &Error) {
    ///     if let Some(wait) = err.retry_after() {
    ///         tokio::time::sleep(wait).await;
    ///     }
    /// }
    /// # let _ = back_off;
    /// ```
    pub fn retry_after(&self) -> Option<Duration> {
        match self.inner.kind {
            Kind::Busy { retry_after } => Some(retry_after),
            Kind::KeyInUse { retry_after } => retry_after,
            _ => self.store_error().and_then(StoreError::retry_after),
        }
    }

    /// Whether this refuses the request for what it is (its key, its body) before any of it
    /// was sent. A layer outside that gets it from a layer of ours inside (a
    /// [`FrozenRetryLayer`](crate::FrozenRetryLayer) with a smaller body limit, say) knows
    /// that nothing left.
    pub(crate) fn refused_before_sending(&self) -> bool {
        matches!(
            self.inner.kind,
            Kind::MissingKey
                | Kind::MissingScope
                | Kind::InvalidKey(_)
                | Kind::BodyTooLarge { .. }
                | Kind::Body
                | Kind::RetryNested
                | Kind::MethodNotListed { .. }
        )
    }

    /// Whether the failed request may have left the process.
    ///
    /// `Some(PreWrite)`: proven never sent. `Some(_)` otherwise for failures of the inner
    /// service, timeouts and response bodies. `None` for failures before anything was sent
    /// that are not about the transport (a missing key, a drift, a busy operation…).
    pub fn phase(&self) -> Option<FailurePhase> {
        match self.inner.kind {
            Kind::Inner { phase } => Some(phase),
            // The second send never left: the operation is where its first send left it.
            Kind::RetryInside { first } => Some(first),
            Kind::AttemptTimeout => Some(FailurePhase::Unknown),
            Kind::ResponseBody => Some(FailurePhase::AfterWrite),
            _ => None,
        }
    }

    /// The inner service's error, when [`is_inner`](Error::is_inner).
    pub fn into_inner(self) -> Option<BoxError> {
        match self.inner.kind {
            Kind::Inner { .. } => self.inner.source,
            _ => None,
        }
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("tower_idempotency::Error");
        d.field("kind", &self.inner.kind);
        // `fn main() -> Result<(), BoxError>` prints an error's Debug form: carry the
        // message, which says what to do, not only the kind's name.
        d.field("message", &format_args!("{self}"));
        if let Some(source) = &self.inner.source {
            d.field("source", source);
        }
        d.finish()
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner.kind {
            Kind::MissingKey => f.write_str(
                "side-effecting request has no OperationId (and no Idempotency-Key header); \
                 nothing was sent: insert an OperationId into the request's extensions, or \
                 build the layer with require_key(false) to pass such requests through \
                 unprotected",
            ),
            Kind::MissingScope => f.write_str(
                "the request's own Idempotency-Key travels without an Authorization header, so \
                 it cannot be kept apart from another principal's key; nothing was sent: use an \
                 OperationId, or build the layer with caller_key_scope(..) naming the \
                 principal (or caller_keys_unscoped())",
            ),
            Kind::InvalidKey(err) => write!(f, "{err}; nothing was sent"),
            Kind::BodyTooLarge { limit, declared } => match declared {
                Some(len) => write!(
                    f,
                    "request body of {len} bytes is over the {limit}-byte limit; nothing was sent"
                ),
                None => write!(
                    f,
                    "request body is over the {limit}-byte limit; nothing was sent"
                ),
            },
            Kind::Body => f.write_str("reading the request body failed; nothing was sent"),
            Kind::Drift(drift) => fmt::Display::fmt(drift, f),
            Kind::Busy { retry_after } => write!(
                f,
                "the operation is in flight elsewhere; retry after {retry_after:?}"
            ),
            Kind::Store => self.fmt_store(f),
            Kind::Inner { phase } => write!(f, "the inner service failed ({phase})"),
            Kind::AttemptTimeout => {
                f.write_str("the attempt timed out; the request may have been sent")
            }
            Kind::ReplayUnavailable => f.write_str(
                "the operation completed before, but its response was not kept (over the \
                 recording cap, or no room in the ledger when it completed); it is not run again",
            ),
            Kind::InDoubt {
                reconciler: Asked::No,
            } => f.write_str(
                "an earlier attempt may have reached the provider, and sending it again could \
                 run it twice: not sending it again; reconcile it (a reconciler on the layer), \
                 or resolve it as an operator (`Records::list`, the console)",
            ),
            Kind::InDoubt {
                reconciler: Asked::Unknown,
            } => f.write_str(
                "an earlier attempt may have reached the provider, and the reconciler answered \
                 that it cannot tell whether it happened: not sending it again; a later run \
                 asks again, or resolve it as an operator (`Records::list`, the console)",
            ),
            Kind::InDoubt {
                reconciler: Asked::Failed,
            } => f.write_str(
                "an earlier attempt may have reached the provider, and the reconciler failed \
                 to tell whether it happened (its failure is this error's source): not sending \
                 it again; a later run asks again, or resolve it as an operator \
                 (`Records::list`, the console)",
            ),
            Kind::KeyInUse { .. } => f.write_str(
                "the provider is still processing a request with this key (409, key in use): \
                 not a final answer; the operation stays in doubt and running it again resends \
                 the frozen request",
            ),
            Kind::ResponseBody => f.write_str("reading the response body failed"),
            Kind::RetryOutside => f.write_str(
                "FrozenRetryLayer is outside IdempotencyLayer, so its retries would bypass the \
                 operation's record; nothing was sent: put the idempotency layer outside \
                 (first in ServiceBuilder), or build both with \
                 IdempotencyLayer::client_builder(..).build_stack()",
            ),
            Kind::RetryNested => f.write_str(
                "a second FrozenRetryLayer is stacked under the one inside IdempotencyLayer, \
                 so its retries would resend attempts that may have arrived; nothing was sent: \
                 keep one FrozenRetryLayer, directly inside the idempotency layer",
            ),
            Kind::RetryInside { first } => write!(
                f,
                "a retrying layer between IdempotencyLayer and the transport (tower::retry, \
                 a hedge, a layer of your own) sent one attempt twice, blind to the \
                 provider's keys; the second send was refused before any of it left, and the \
                 first one {}: retry with a FrozenRetryLayer directly inside the \
                 idempotency layer (or build_stack()) and remove the other retrying layer",
                match first {
                    FailurePhase::PreWrite => "failed before it was written",
                    FailurePhase::AfterWrite => "reached the provider",
                    FailurePhase::Unknown => "may have reached the provider",
                }
            ),
            Kind::RetryLayerInside { layer } => write!(
                f,
                "a retrying layer ({layer}) is inside the idempotency layer, between it and \
                 the transport: its retries would resend an attempt that may have taken \
                 effect, blind to the provider's keys, so nothing was sent; retry with a \
                 FrozenRetryLayer directly inside the idempotency layer (or build_stack()), \
                 and put any other retrying layer outside it"
            ),
            Kind::MethodNotListed { path } => write!(
                f,
                "the gRPC method {path} is not in the layer's method table, so it cannot \
                 tell a side effect from a read or a stream; nothing was sent: name it in \
                 the table (unary, reads or server_streaming)"
            ),
        }
    }
}

impl Error {
    /// A ledger failure, in words a caller can act on. Every path that makes one fails
    /// before the operation starts; the [`StoreError`] stays the source.
    fn fmt_store(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(store) = self.store_error() else {
            return f.write_str("the idempotency ledger failed; the operation was not started");
        };
        if store.is_never_fits() {
            return f.write_str(
                "the operation is heavier than the idempotency ledger's whole budget: it can \
                 never fit, and retrying will not help; the operation was not started (give \
                 the store a budget above the body limit: MemoryStore::builder().max_bytes(..))",
            );
        }
        if store.is_full() {
            f.write_str("the idempotency ledger is full of records it must keep")?;
            if let Some(room_in) = store.retry_after() {
                write!(
                    f,
                    " (room frees up in {})",
                    crate::ledger::error::Seconds(room_in)
                )?;
            }
            return f.write_str(
                "; the operation was not started: retry later, or give the store more room \
                 (MemoryStore::builder().max_bytes(..))",
            );
        }
        let what = if store.is_unavailable() {
            "the idempotency ledger is unavailable"
        } else if store.is_timeout() {
            "the idempotency ledger did not answer in time"
        } else if store.is_corrupt() {
            "an idempotency ledger record could not be read"
        } else {
            "the idempotency ledger refused the operation"
        };
        write!(f, "{what}; the operation was not started (failing closed)")
    }

    /// The ledger's own error, when this is a [`Kind::Store`] failure.
    fn store_error(&self) -> Option<&StoreError> {
        match self.inner.kind {
            Kind::Store => self.inner.source.as_ref()?.downcast_ref::<StoreError>(),
            _ => None,
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.inner
            .source
            .as_ref()
            .map(|source| &**source as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every line of `err`'s chain, as a `main` returning it or a reporter prints them.
    fn chain(err: &(dyn std::error::Error + 'static)) -> Vec<String> {
        std::iter::successors(Some(err), |err| err.source())
            .map(ToString::to_string)
            .collect()
    }

    #[test]
    fn a_full_ledger_says_so_when_room_frees_up_and_what_to_do() {
        let err = Error::store(StoreError::full_until(Duration::from_millis(32_400)));
        let message = err.to_string();
        assert_eq!(
            message,
            "the idempotency ledger is full of records it must keep (room frees up in 33 s); \
             the operation was not started: retry later, or give the store more room \
             (MemoryStore::builder().max_bytes(..))"
        );
        assert!(err.is_ledger_full());
        assert_eq!(err.retry_after(), Some(Duration::from_millis(32_400)));
        // The store's own error follows once, and nothing below it repeats it.
        let lines = chain(&err);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines[1].starts_with("the ledger is full"), "{lines:?}");
    }

    #[test]
    fn a_ledger_failure_says_what_failed_and_that_nothing_started() {
        let unavailable = Error::store(StoreError::unavailable("connection refused"));
        assert_eq!(
            unavailable.to_string(),
            "the idempotency ledger is unavailable; the operation was not started (failing closed)"
        );
        assert_eq!(unavailable.retry_after(), None);
        assert_eq!(
            chain(&unavailable)[1],
            "the ledger is unavailable: connection refused"
        );
        let timeout = Error::store(StoreError::timeout());
        assert!(timeout
            .to_string()
            .starts_with("the idempotency ledger did not answer in time;"));
        assert!(!timeout.is_ledger_full());
        let soon = Error::store(StoreError::full_until(Duration::from_millis(250)));
        assert!(
            soon.to_string().contains("(room frees up in 250 ms)"),
            "{soon}"
        );
    }

    #[test]
    fn the_debug_form_carries_the_message_a_main_would_print() {
        let debug = format!("{:?}", Error::missing_key());
        assert!(debug.contains("MissingKey"), "{debug}");
        assert!(debug.contains("insert an OperationId"), "{debug}");
    }

    #[test]
    fn find_reaches_our_error_through_sources_and_boxes() {
        #[derive(Debug)]
        struct Wrapper(Error);
        impl fmt::Display for Wrapper {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a layer of its own failed")
            }
        }
        impl std::error::Error for Wrapper {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        let boxed: BoxError = Box::new(Wrapper(Error::busy(Duration::from_secs(1))));
        let found = Error::find(&*boxed).expect("found as a source");
        assert_eq!(found.retry_after(), Some(Duration::from_secs(1)));
        let plain: BoxError = Box::new(std::io::Error::other("reset"));
        assert!(Error::find(&*plain).is_none());
    }

    #[test]
    fn errors_are_small_and_send_sync() {
        fn assert_send_sync<T: Send + Sync + 'static>() {}
        assert_send_sync::<Error>();
        assert_eq!(std::mem::size_of::<Error>(), std::mem::size_of::<usize>());
    }
}
