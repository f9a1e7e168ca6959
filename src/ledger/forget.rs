//! [`Records`]: forgetting one record on purpose, fenced by what the operator saw.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::request::Parts;

use super::{
    Generation, IdempotencyStore, LedgerKey, ListPage, ListQuery, Outcome, RecordState, RecordView,
    Resolve, StoreError,
};
use crate::fingerprint::Fingerprint;
use crate::idempotency::reconcile::Reconciling;
use crate::OperationId;

/// Which state a record is in, as [`Expected`] names it: [`RecordState`] without its
/// details.
///
/// ```
/// use tower_idempotency::ledger::{RecordKind, RecordState};
///
/// let state = RecordState::Completed { status: http::StatusCode::UNAUTHORIZED };
/// assert_eq!(RecordKind::of(&state), RecordKind::Completed);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RecordKind {
    /// An owner holds (or held, if its lease ran out) the operation.
    InFlight,
    /// An attempt may have been sent; the next claim resumes.
    InDoubt,
    /// Done, with a recorded outcome.
    Completed,
}

impl RecordKind {
    /// The kind of `state`.
    pub fn of(state: &RecordState) -> Self {
        match state {
            RecordState::InFlight { .. } => Self::InFlight,
            RecordState::InDoubt => Self::InDoubt,
            RecordState::Completed { .. } => Self::Completed,
        }
    }

    /// `in_flight`, `in_doubt` or `completed`: the name the stores and the logs use.
    ///
    /// ```
    /// # use tower_idempotency::ledger::RecordKind;
    /// assert_eq!(RecordKind::InDoubt.as_str(), "in_doubt");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            Self::InFlight => "in_flight",
            Self::InDoubt => "in_doubt",
            Self::Completed => "completed",
        }
    }
}

/// What an operator saw of a record: [`IdempotencyStore::forget`] removes it only if it is
/// still so.
///
/// A record is still as seen when it is the same life of its key (its [`Generation`]) and
/// its state kind, its fingerprint and its attempts (each claim and resume counts one) are
/// unchanged: every transition of a record changes its kind or its attempts, except a
/// renewal of its lease, and a record created again after the one seen left (forgotten,
/// released, evicted, past its retention) is another life, however alike it looks. So a
/// look taken before the operation was resumed, completed or marked in doubt, or at an
/// earlier life of the key, never removes it. An operation in
/// flight under a lease that still runs is never forgotten either, however it was seen,
/// unless [forced](Self::force): its owner is alive and working.
///
/// ```
/// use tower_idempotency::ledger::{Expected, Generation, RecordKind};
/// # use tower_idempotency::fingerprint::Fingerprint;
/// # let fp = Fingerprint::of(&http::Method::POST, "/charges", b"{}");
/// # let generation = Generation::from_u64(7);
/// // Usually taken from a look: `Expected::of(&view)`. Or spelled out, with the
/// // generation the look showed:
/// let expected = Expected::new(RecordKind::InFlight, fp, 1, generation).force();
/// assert!(expected.force);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Expected {
    /// The state the record was seen in.
    pub kind: RecordKind,
    /// The fingerprint it was seen with.
    pub fingerprint: Fingerprint,
    /// Its attempts when seen.
    pub attempts: u32,
    /// The life of the key it was seen in.
    pub generation: Generation,
    /// Remove an operation in flight even while its owner's lease runs: the owner's later
    /// writes are then refused as fenced, and the next request runs the operation again,
    /// perhaps while the owner still does.
    pub force: bool,
}

impl Expected {
    /// A record of life `generation`, in state `kind`, with `fingerprint` and `attempts`;
    /// not forced.
    pub fn new(
        kind: RecordKind,
        fingerprint: Fingerprint,
        attempts: u32,
        generation: Generation,
    ) -> Self {
        Self {
            kind,
            fingerprint,
            attempts,
            generation,
            force: false,
        }
    }

    /// The record as `view` shows it; not forced.
    pub fn of(view: &RecordView) -> Self {
        Self::new(
            RecordKind::of(&view.state),
            view.fingerprint,
            view.attempts,
            view.generation,
        )
    }

    /// Forget it even while an owner's lease runs (see [`force`](Self#structfield.force)).
    pub fn force(mut self) -> Self {
        self.force = true;
        self
    }

    /// Whether `current` is still the record this look saw: the same life of its key, in
    /// the same state, with the same fingerprint and attempts. The generation first: another
    /// life of the key can match in everything else (the same request, completed on its
    /// first attempt), and acting on it would act on a record nobody looked at.
    pub(crate) fn describes(&self, current: &RecordView) -> bool {
        current.generation == self.generation
            && RecordKind::of(&current.state) == self.kind
            && current.fingerprint == self.fingerprint
            && current.attempts == self.attempts
    }

    /// What [`forget`](IdempotencyStore::forget) must do to the record `current` (`None`:
    /// absent), seen atomically with the removal: for stores that read the record and
    /// remove it under one lock or in one transaction.
    ///
    /// ```
    /// use tower_idempotency::ledger::{Expected, Forget, Generation, RecordKind};
    /// # use tower_idempotency::fingerprint::Fingerprint;
    /// # let fp = Fingerprint::of(&http::Method::POST, "/charges", b"{}");
    /// let expected = Expected::new(RecordKind::InDoubt, fp, 2, Generation::from_u64(7));
    /// assert_eq!(expected.judge(None), Forget::Absent);
    /// ```
    pub fn judge(&self, current: Option<&RecordView>) -> Forget {
        let Some(current) = current else {
            return Forget::Absent;
        };
        // Identity before liveness: a record that moved on is `Changed` even when its lease
        // runs, because the operator's look no longer describes it, forced or not. `force`
        // only ever overrides a live lease on the very record that was seen.
        if !self.describes(current) {
            return Forget::Changed;
        }
        // A lapsed lease protects nobody: no owner is working, and the next `begin` would read
        // the record as in doubt anyway.
        match current.state {
            RecordState::InFlight { lease_left, .. } if !lease_left.is_zero() && !self.force => {
                Forget::Live { lease_left }
            }
            _ => Forget::Forgotten,
        }
    }
}

/// What [`IdempotencyStore::forget`] did.
///
/// ```
/// # use tower_idempotency::ledger::Forget;
/// assert!(Forget::Forgotten.is_forgotten());
/// assert!(!Forget::Changed.is_forgotten());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Forget {
    /// The record was as expected, and is gone: the next request with its key runs the
    /// operation again.
    Forgotten,
    /// There is no record (never made, already forgotten or released, or past its
    /// retention). Nothing changed.
    Absent,
    /// The record is not as expected any more (it moved on since it was looked at).
    /// Nothing changed: look again.
    Changed,
    /// The record is in flight and its owner's lease still runs for `lease_left` (a whole
    /// lease at every look while the owner [holds](crate::ledger::IdempotencyStore::hold_lease)
    /// it: waiting does not end it, the owner does). Nothing changed: wait for the owner, or
    /// [force](Expected::force) it.
    Live {
        /// How long the owner's lease still runs (a whole lease while it is held).
        lease_left: Duration,
    },
}

impl Forget {
    /// Whether the record was removed.
    pub fn is_forgotten(&self) -> bool {
        matches!(self, Self::Forgotten)
    }

    fn as_str(&self) -> &'static str {
        match self {
            Self::Forgotten => "forgotten",
            Self::Absent => "absent",
            Self::Changed => "changed",
            Self::Live { .. } => "live",
        }
    }
}

/// Log, and with feature `metrics` count, one forget by `store` (`memory`, `redis`,
/// `postgres`): the operator's act must leave a trace.
pub(crate) fn report(
    store: &'static str,
    key: &LedgerKey,
    expected: &Expected,
    answer: &Result<Forget, StoreError>,
) {
    let state = expected.kind.as_str();
    // A removal is a `WARN`: it is the one ledger event that lets an operation run again,
    // and the first place to look when one did. A refusal changed nothing: `INFO`.
    let result = match answer {
        Ok(Forget::Forgotten) => {
            tracing::warn!(
                store,
                key = %key.to_hex(),
                state,
                attempts = expected.attempts,
                generation = %expected.generation,
                forced = expected.force,
                "a ledger record was forgotten on purpose: the next request with its key runs \
                 the operation again"
            );
            "forgotten"
        }
        Ok(refused) => {
            tracing::info!(
                store,
                key = %key.to_hex(),
                state,
                attempts = expected.attempts,
                generation = %expected.generation,
                result = refused.as_str(),
                "a ledger record was not forgotten: it is not as expected"
            );
            refused.as_str()
        }
        Err(err) => {
            tracing::info!(store, key = %key.to_hex(), state, %err, "could not forget a ledger record");
            "error"
        }
    };
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "idempotency_ledger_forget_total",
        "store" => store,
        "state" => state,
        "result" => result
    )
    .increment(1);
    #[cfg(not(feature = "metrics"))]
    let _ = result;
}

/// A server face's key derivation from a request head.
type DeriveKey = dyn Fn(&Parts) -> Option<LedgerKey> + Send + Sync;

/// How a [`Records`] handle derives record keys: as its layer does.
#[derive(Clone)]
enum Keys {
    /// The client face's `scope` (`""` for a bare store).
    Client(String),
    /// The server face's derivation from a request head.
    Server(Arc<DeriveKey>),
}

/// An operator's handle on a ledger: look at one record, and forget it (fenced), by the keys
/// a layer derives.
///
/// From a built layer, [`ClientLayer::records`](crate::client::ClientLayer) or
/// [`ServerLayer::records`](crate::server::ServerLayer), or over a bare store with
/// [`Records::new`] (whose [`operation_key`](Self::operation_key) is the client face's
/// with the default scope `""`). Cloning is cheap.
///
/// ```
/// use tower_idempotency::ledger::{MemoryStore, Records};
/// use tower_idempotency::OperationId;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
/// let records = Records::new(MemoryStore::new());
/// let key = records.operation_key(&OperationId::new("task-7", "charge"));
/// assert!(records.inspect(key).await?.is_none());
/// # Ok(())
/// # }
/// ```
///
/// Forgetting one record on purpose: the operator's way out of a record that should not be
/// there, fenced so that a stale look never removes a record that moved on.
///
/// A record sometimes outlives its use: a recorded `401` the caller can never get past, an
/// operation left in doubt that an operator has since checked by hand. Waiting out its
/// retention (24 h by default) is the only other way out. [`IdempotencyStore::forget`]
/// removes it at once, **only if it is still as the operator saw it** ([`Expected`], taken
/// from [`inspect`](IdempotencyStore::inspect)'s [`RecordView`]): the same life of its key
/// (its [`Generation`]: never a record created again since), same state, same
/// fingerprint, same number of attempts, and, for an operation in flight, a lease that ran
/// out (a live owner's lease is never taken from it unless the operator
/// [forces](Expected::force) it). Anything else is answered with what stood in the way, and
/// nothing changes.
///
/// A forgotten record is gone: the next request with its key runs the operation again. Only
/// forget an in-doubt operation once you know its effect did not happen (or will not mind
/// it happening again).
///
/// A handle from a built layer derives record keys as the layer does, from an
/// [`OperationId`] or a request head, so nobody computes a [`LedgerKey`] by hand. A client
/// layer's handle also carries the layer's [reconciler](crate::client::Builder::reconcile),
/// its timeout and its key header, so the operator's console can ask it about a record in
/// doubt ("reconcile now", with feature `console`); a server layer's and
/// [`Records::new`]'s carry none.
///
/// Every built-in store logs each forget (`WARN` when a record was removed, `INFO` when it
/// was refused) with the key's digest and the state forgotten, and with feature `metrics`
/// counts it in `idempotency_ledger_forget_total` (labels `store`, `state`: the expected
/// one, `result`: `forgotten`, `absent`, `changed`, `live` or `error`).
///
/// # Example
///
/// ```
/// use tower_idempotency::KeyHeader;
/// use tower_idempotency::ledger::{Expected, Forget, MemoryStore, RecordState};
/// use tower_idempotency::{IdempotencyLayer, OperationId};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
/// let layer = IdempotencyLayer::client_builder(MemoryStore::new()).provider_deduplicates(true).key_header(KeyHeader::ietf())
///     .scope("billing-agent")
///     .build()
///     .unwrap();
/// let records = layer.records();
/// let key = records.operation_key(&OperationId::new("task-7", "charge"));
/// # records.store().begin(tower_idempotency::ledger::BeginRequest::new(
/// #     key, tower_idempotency::fingerprint::Fingerprint::of(&http::Method::POST, "/charges", b"{}"),
/// #     std::time::Duration::ZERO, std::time::Duration::from_secs(60))).await?;
///
/// // Look first, then forget what you looked at, and only that.
/// let view = records.inspect(key).await?.expect("a record");
/// assert!(matches!(view.state, RecordState::InFlight { .. }));
/// assert_eq!(records.forget(key, Expected::of(&view)).await?, Forget::Forgotten);
/// assert!(records.inspect(key).await?.is_none());
/// // The same look again finds nothing to forget.
/// assert_eq!(records.forget(key, Expected::of(&view)).await?, Forget::Absent);
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct Records {
    store: Arc<dyn IdempotencyStore>,
    keys: Keys,
    /// How long a record an operator resolves is kept: its layer's retention.
    retention: Duration,
    /// A client layer's reconciler, which an operator may ask about a record in doubt
    /// (the console's "reconcile now"); `None` for a server layer, a client layer built
    /// without one, and [`Records::new`].
    pub(crate) reconciling: Option<Reconciling>,
}

impl Records {
    /// A handle on `store`, deriving keys as a client layer with the default scope does.
    pub fn new(store: impl IdempotencyStore) -> Self {
        Self::client(
            Arc::new(store),
            String::new(),
            crate::idempotency::engine::DEFAULT_RETENTION,
        )
    }

    /// A client layer's handle; its records are kept for `retention`.
    pub(crate) fn client(
        store: Arc<dyn IdempotencyStore>,
        scope: String,
        retention: Duration,
    ) -> Self {
        Self {
            store,
            keys: Keys::Client(scope),
            retention,
            reconciling: None,
        }
    }

    /// A server layer's handle: `derive` is its key derivation from a request head, and
    /// its records are kept for `retention`.
    pub(crate) fn server(
        store: Arc<dyn IdempotencyStore>,
        derive: impl Fn(&Parts) -> Option<LedgerKey> + Send + Sync + 'static,
        retention: Duration,
    ) -> Self {
        Self {
            store,
            keys: Keys::Server(Arc::new(derive)),
            retention,
            reconciling: None,
        }
    }

    /// The handle, able to ask its client layer's reconciler (`None`: it has none).
    pub(crate) fn with_reconciling(mut self, reconciling: Option<Reconciling>) -> Self {
        self.reconciling = reconciling;
        self
    }

    /// The handle, keeping the records it [resolves](Self::resolve) for `retention` (by
    /// default its layer's retention; 24 h for [`Records::new`]).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::ledger::{MemoryStore, Records};
    ///
    /// let records = Records::new(MemoryStore::new()).with_retention(Duration::from_secs(3600));
    /// assert_eq!(records.retention(), Duration::from_secs(3600));
    /// ```
    pub fn with_retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// How long a record this handle [resolves](Self::resolve) is kept from then on.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::KeyHeader;
    /// use tower_idempotency::ledger::MemoryStore;
    /// use tower_idempotency::IdempotencyLayer;
    ///
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new())
    ///     .provider_deduplicates(true)
    ///     .key_header(KeyHeader::ietf())
    ///     .retention(Duration::from_secs(7200))
    ///     .build()
    ///     .unwrap();
    /// assert_eq!(layer.records().retention(), Duration::from_secs(7200));
    /// ```
    pub fn retention(&self) -> Duration {
        self.retention
    }

    /// The store behind the handle.
    ///
    /// ```
    /// # use tower_idempotency::ledger::{MemoryStore, Records};
    /// let records = Records::new(MemoryStore::new());
    /// assert!(format!("{:?}", records.store()).contains("MemoryStore"));
    /// ```
    pub fn store(&self) -> &Arc<dyn IdempotencyStore> {
        &self.store
    }

    /// The record key a client layer gives the operation `operation` (set on a request as
    /// an extension): [`LedgerKey::for_operation`] of the key derived in the layer's
    /// scope. On a server layer's handle, the key of a client layer with the default scope.
    ///
    /// ```
    /// use tower_idempotency::KeyHeader;
    /// use tower_idempotency::ledger::{LedgerKey, MemoryStore};
    /// use tower_idempotency::{IdempotencyLayer, OperationId};
    ///
    /// let layer = IdempotencyLayer::client_builder(MemoryStore::new()).provider_deduplicates(true).key_header(KeyHeader::ietf()).scope("agent").build().unwrap();
    /// let op = OperationId::new("task-7", "charge");
    /// assert_eq!(layer.records().operation_key(&op), LedgerKey::for_operation(op.key("agent")));
    /// ```
    pub fn operation_key(&self, operation: &OperationId) -> LedgerKey {
        let scope = match &self.keys {
            Keys::Client(scope) => scope.as_str(),
            Keys::Server(_) => "",
        };
        LedgerKey::for_operation(operation.key(scope))
    }

    /// The record key a server layer gives a request with this head: its `Idempotency-Key`
    /// header in the scope the layer's scope function (by default, a hash of the
    /// `Authorization` header) gives it. `None` when the head has no valid key, or no scope.
    /// So an operator rebuilds the head of the caller's request (its key and credentials)
    /// rather than the scope. On a client layer's handle, the key in the empty scope
    /// ([`LedgerKey::server`]`("", key)`).
    ///
    /// ```
    /// use axum::http::Request;
    /// use tower_idempotency::ledger::MemoryStore;
    /// use tower_idempotency::IdempotencyLayer;
    ///
    /// let layer = IdempotencyLayer::server(MemoryStore::new());
    /// let (head, ()) = Request::post("/charges")
    ///     .header("authorization", "Bearer tenant-1")
    ///     .header("idempotency-key", "\"order-17\"")
    ///     .body(())
    ///     .unwrap()
    ///     .into_parts();
    /// assert!(layer.records().request_key(&head).is_some());
    /// ```
    pub fn request_key(&self, head: &Parts) -> Option<LedgerKey> {
        match &self.keys {
            Keys::Server(derive) => derive(head),
            Keys::Client(_) => {
                let key = crate::HeaderKey::from_headers(&head.headers).ok()??;
                Some(LedgerKey::server("", key.as_str()))
            }
        }
    }

    /// [`IdempotencyStore::inspect`]: the record of `key`, or `None`.
    pub async fn inspect(&self, key: LedgerKey) -> Result<Option<RecordView>, StoreError> {
        self.store.inspect(key).await
    }

    /// [`IdempotencyStore::list`]: a page of the records that pass `query`.
    ///
    /// ```
    /// use tower_idempotency::ledger::{ListQuery, MemoryStore, RecordKind, Records};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
    /// let records = Records::new(MemoryStore::new());
    /// let page = records.list(ListQuery::new().kind(RecordKind::InDoubt)).await?;
    /// assert!(page.records.is_empty() && page.next.is_none());
    /// # Ok(())
    /// # }
    /// ```
    pub async fn list(&self, query: ListQuery) -> Result<ListPage, StoreError> {
        self.store.list(query).await
    }

    /// [`IdempotencyStore::forget`]: remove the record of `key` if it is still as
    /// `expected`.
    pub async fn forget(&self, key: LedgerKey, expected: Expected) -> Result<Forget, StoreError> {
        self.store.forget(key, expected).await
    }

    /// [`IdempotencyStore::resolve`]: complete the record of `key` with `outcome` (the
    /// receipt of an effect the operator saw happen) if it is still as `expected` and
    /// open, kept for the handle's [retention](Self::retention). The caller's next run
    /// with the same payload replays `outcome` instead of sending again.
    ///
    /// Only resolve an operation as applied once you know its effect happened: the
    /// operation is never sent again under its key. The store logs the resolve (`WARN`)
    /// and with feature `metrics` counts it in `idempotency_ledger_resolve_total` (labels
    /// `store`, `state`: the expected one, `result`: `resolved`, `absent`, `changed`,
    /// `live`, `not_in_doubt` or `error`).
    ///
    /// For a record of the tool face, the outcome is a `200` whose body is the tool's
    /// result as JSON (what the tool would have answered); for an HTTP face, the
    /// provider's response.
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_idempotency::ledger::{
    ///     Begin, BeginRequest, Expected, MemoryStore, Outcome, Records, Resolve, StoredResponse,
    /// };
    /// use tower_idempotency::OperationId;
    /// # use tower_idempotency::fingerprint::Fingerprint;
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
    /// let records = Records::new(MemoryStore::new());
    /// let key = records.operation_key(&OperationId::new("task-7", "charge"));
    /// # let fp = Fingerprint::of(&http::Method::POST, "/charges", b"{}");
    /// # let request = BeginRequest::new(key, fp, Duration::from_secs(10), Duration::from_secs(60));
    /// # let Begin::Acquired { token } = records.store().begin(request.clone()).await? else { unreachable!() };
    /// # records.store().mark_in_doubt(key, token, Duration::from_secs(60)).await?;
    /// // The charge is in doubt; the provider's dashboard shows it went through.
    /// let view = records.inspect(key).await?.expect("a record");
    /// let receipt = Outcome::Response(StoredResponse::new(
    ///     http::StatusCode::CREATED,
    ///     http::Version::HTTP_11,
    ///     http::HeaderMap::new(),
    ///     r#"{"id":"ch_1","status":"succeeded"}"#.into(),
    /// ));
    /// assert_eq!(records.resolve(key, Expected::of(&view), receipt).await?, Resolve::Resolved);
    /// // The next run replays the receipt; the same look finds nothing open to resolve.
    /// assert!(matches!(records.store().begin(request).await?, Begin::Replay(_)));
    /// let again = Outcome::Tombstone { status: http::StatusCode::OK };
    /// assert_eq!(records.resolve(key, Expected::of(&view), again).await?, Resolve::Changed);
    /// # Ok(())
    /// # }
    /// ```
    pub async fn resolve(
        &self,
        key: LedgerKey,
        expected: Expected,
        outcome: Outcome,
    ) -> Result<Resolve, StoreError> {
        self.store
            .resolve(key, expected, outcome, self.retention)
            .await
    }
}

impl fmt::Debug for Records {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let keys = match &self.keys {
            Keys::Client(_) => "client",
            Keys::Server(_) => "server",
        };
        f.debug_struct("Records")
            .field("store", &self.store)
            .field("keys", &keys)
            .field("retention", &self.retention)
            .field("reconciles", &self.reconciling.is_some())
            .finish()
    }
}
