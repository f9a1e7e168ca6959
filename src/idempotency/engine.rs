//! The ledger engine both faces of the layer share: claiming, waiting, holding and settling
//! a lease.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use pin_project_lite::pin_project;

use tokio::time::Instant;

use crate::ledger::{
    Begin, BeginRequest, IdempotencyStore, LeaseToken, LedgerKey, Outcome, Settled, StoreError,
    StoreFuture,
};

/// The default lease: how long an owner may hold an operation in flight without renewing
/// it. Live owners renew (every third of the lease), so the lease only bounds how long a
/// **dead** owner's operation stays busy before the next caller may resume it.
pub(crate) const DEFAULT_LEASE: Duration = Duration::from_secs(10);
/// The default retention of ledger records.
pub(crate) const DEFAULT_RETENTION: Duration = Duration::from_secs(24 * 60 * 60);

/// The longest lease, retention, protected window or busy wait the layers work with: about
/// 139 years (2^42 ms). A longer setting ("keep forever": `Duration::MAX`) saturates to it
/// rather than being refused. It is far beyond any real use, yet every clock can add it to
/// the present (`Instant + Duration::MAX` panics, on every request) and every store can
/// hold it: Redis `PX` and PostgreSQL intervals are clamped to the same bound.
pub(crate) const LONGEST: Duration = Duration::from_millis(1 << 42);

/// The first pause between two `begin`s while waiting for a busy operation on a store that
/// cannot notify ([`IdempotencyStore::notify_settled`] answers `None`); it doubles up to
/// [`MAX_BUSY_POLL`]. A store that notifies wakes its waiters when the owner settles.
const FIRST_BUSY_POLL: Duration = Duration::from_millis(5);
const MAX_BUSY_POLL: Duration = Duration::from_millis(250);

/// How often a store call whose answer was lost (a timeout, a dropped connection) is asked
/// again, and the first pause between two tries (doubling, capped at [`MAX_STORE_RETRY`]).
const BEGIN_TRIES: u32 = 3;
const FIRST_STORE_RETRY: Duration = Duration::from_millis(25);
const MAX_STORE_RETRY: Duration = Duration::from_secs(1);
/// Settles and renewals are retried at least this many times per lease once their pause
/// stops doubling: a store that comes back before the lease ends is then written to within
/// a tenth of a lease, while the lease still holds, rather than up to a whole
/// [`MAX_STORE_RETRY`] later, when a short lease may have run out into doubt.
const RETRIES_PER_LEASE: u32 = 10;
/// How long a claim nobody will use (its `begin` reply was lost) is retried in the background
/// before it is left to read as in doubt.
const RELEASE_PATIENCE: Duration = Duration::from_secs(10 * 60);
/// At most this many such releases run at once per layer: during a long ledger outage every
/// refused request would otherwise leave a task behind. Past it, the claim (if it exists)
/// reads as in doubt once its lease runs out, which is never a second run.
const MAX_PENDING_RELEASES: usize = 256;

/// What to do when another caller holds the operation in flight.
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::BusyPolicy;
///
/// let patient = BusyPolicy::Wait(Duration::from_secs(30));
/// # let _ = (patient, BusyPolicy::Fail);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BusyPolicy {
    /// Wait up to this long for the owner to finish, then replay its outcome (or resume, if
    /// it failed); still busy after that, fail with a busy error.
    Wait(Duration),
    /// Fail at once with a busy error carrying the owner's remaining lease.
    Fail,
}

/// The store and its timings, shared by every request of a layer: a handle, so that each
/// lease guard holds one pointer (one reference count) rather than a copy of the settings.
#[derive(Clone)]
pub(crate) struct Ledger(Arc<LedgerState>);

/// What a [`Ledger`] handle points to.
pub(crate) struct LedgerState {
    pub(crate) store: Arc<dyn IdempotencyStore>,
    pub(crate) lease: Duration,
    pub(crate) retention: Duration,
    /// How long after its last transition a record must never be evicted.
    pub(crate) protected: Duration,
    /// What the layer's requests learn of the store as they go.
    shared: Shared,
    /// How many requests may wait for busy operations at once, if bounded.
    pub(crate) waiters: Option<WaiterLimit>,
}

impl std::ops::Deref for Ledger {
    type Target = LedgerState;

    fn deref(&self) -> &LedgerState {
        &self.0
    }
}

/// What every request of a layer shares about its store.
#[derive(Debug, Default)]
struct Shared {
    /// Background releases of unused claims under way (see [`MAX_PENDING_RELEASES`]).
    pending_releases: std::sync::atomic::AtomicUsize,
    /// Set once the store answered with a future to await: its calls then go straight to
    /// the waiting and retrying path, rather than each making a future that is dropped
    /// unpolled (see [`Ledger::begin_in_place`]).
    awaits: std::sync::atomic::AtomicBool,
}

/// A bound on the requests waiting for busy operations: under a storm of duplicates each
/// waiter holds its request (its body included), so past the bound a request is answered
/// busy at once instead of joining the queue.
#[derive(Clone, Debug)]
pub(crate) struct WaiterLimit {
    max: usize,
    waiting: Arc<std::sync::atomic::AtomicUsize>,
}

impl WaiterLimit {
    pub(crate) fn new(max: usize) -> Self {
        Self {
            max,
            waiting: Arc::default(),
        }
    }

    /// A place among the waiters, or `None` when they are all taken.
    pub(crate) fn try_enter(&self) -> Option<WaiterPermit> {
        // A counter, not a synchronisation point: relaxed is enough.
        use std::sync::atomic::Ordering::Relaxed;
        self.waiting
            .fetch_update(Relaxed, Relaxed, |n| (n < self.max).then_some(n + 1))
            .ok()?;
        Some(WaiterPermit(self.waiting.clone()))
    }
}

/// One place among the waiters, given back when the wait ends (however it ends).
pub(crate) struct WaiterPermit(Arc<std::sync::atomic::AtomicUsize>);

impl Drop for WaiterPermit {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

impl fmt::Debug for Ledger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Ledger")
            .field("store", &self.store)
            .field("lease", &self.lease)
            .field("retention", &self.retention)
            .field("protected", &self.protected)
            .finish()
    }
}

/// A store error after which the store may or may not have applied the call.
fn is_ambiguous(err: &StoreError) -> bool {
    err.is_timeout() || err.is_unavailable()
}

impl Ledger {
    pub(crate) fn new(
        store: Arc<dyn IdempotencyStore>,
        lease: Duration,
        retention: Duration,
        protected: Duration,
    ) -> Self {
        Self::with_waiters(store, lease, retention, protected, None)
    }

    /// [`new`](Self::new), with at most `max` requests waiting for busy operations at once.
    pub(crate) fn with_max_waiters(
        store: Arc<dyn IdempotencyStore>,
        lease: Duration,
        retention: Duration,
        protected: Duration,
        max: usize,
    ) -> Self {
        Self::with_waiters(
            store,
            lease,
            retention,
            protected,
            Some(WaiterLimit::new(max)),
        )
    }

    fn with_waiters(
        store: Arc<dyn IdempotencyStore>,
        lease: Duration,
        retention: Duration,
        protected: Duration,
        waiters: Option<WaiterLimit>,
    ) -> Self {
        // Saturated here, where every duration a store or a clock is handed comes from, so
        // that no setting a builder accepted can overflow an `Instant` or a store's TTL.
        let (lease, retention) = (lease.min(LONGEST), retention.min(LONGEST));
        Self(Arc::new(LedgerState {
            store,
            lease,
            retention,
            protected: protected.min(retention),
            shared: Shared::default(),
            waiters,
        }))
    }

    /// The longest pause between two tries of a settle or a renewal: a tenth of the lease,
    /// within [`FIRST_STORE_RETRY`] and [`MAX_STORE_RETRY`].
    fn max_retry_pause(&self) -> Duration {
        (self.lease / RETRIES_PER_LEASE).clamp(FIRST_STORE_RETRY, MAX_STORE_RETRY)
    }

    pub(crate) fn request(&self, key: LedgerKey, fingerprint: crate::Fingerprint) -> BeginRequest {
        BeginRequest::new(key, fingerprint, self.lease, self.retention)
            .with_protected_window(self.protected)
    }

    /// `begin`, waiting per `busy` while another owner holds the operation: woken by the
    /// store when the owner settles, if it can notify, else polling with a backoff; never
    /// sleeping past the owner's lease (it turns in doubt then) nor past the bound. Past the
    /// [waiter limit](Self::with_max_waiters), a busy answer is returned at once.
    pub(crate) async fn begin(
        &self,
        request: BeginRequest,
        busy: BusyPolicy,
    ) -> Result<Begin, StoreError> {
        self.begin_after(request, busy, None).await
    }

    /// [`begin`](Self::begin) after an in-place try: `lost` is its answer, when that answer
    /// was lost (see [`begin_in_place`](Self::begin_in_place)).
    pub(crate) async fn begin_after(
        &self,
        request: BeginRequest,
        busy: BusyPolicy,
        lost: Option<StoreError>,
    ) -> Result<Begin, StoreError> {
        let mut lost = lost;
        let give_up_at = match busy {
            BusyPolicy::Wait(limit) => Instant::now() + limit.min(LONGEST),
            BusyPolicy::Fail => Instant::now(),
        };
        let mut pause = FIRST_BUSY_POLL;
        let mut permit = None;
        // Subscribed before the `begin` it follows, so a settle in between is not missed.
        let mut settled: Option<Settled> = None;
        let mut notifies = true;
        loop {
            let answer = self.begin_once(&request, lost.take()).await?;
            let Begin::Busy { retry_after } = answer else {
                return Ok(answer);
            };
            let now = Instant::now();
            if now >= give_up_at {
                return Ok(answer);
            }
            if let (None, Some(limit)) = (&permit, &self.waiters) {
                match limit.try_enter() {
                    Some(entered) => permit = Some(entered),
                    // A storm of duplicates: answer busy now rather than queue one more.
                    None => return Ok(answer),
                }
            }
            let nap = retry_after
                .max(Duration::from_millis(1))
                .min(give_up_at - now);
            match settled.take() {
                Some(settled) => {
                    let _ = tokio::time::timeout(nap, settled).await;
                }
                None if notifies => match self.store.notify_settled(request.key) {
                    // Listening now: ask again at once, then wait for the settle.
                    Some(listening) => {
                        settled = Some(listening);
                        continue;
                    }
                    None => notifies = false,
                },
                None => {}
            }
            if notifies {
                settled = self.store.notify_settled(request.key);
            } else {
                tokio::time::sleep(pause.min(nap)).await;
                pause = (pause * 2).min(MAX_BUSY_POLL);
            }
        }
    }

    /// [`begin`](Self::begin) answered in place, when the store answers at once and its
    /// answer needs no waiting (a busy operation under [`BusyPolicy::Wait`]) and no asking
    /// again (a lost answer). Otherwise `Err`, with the lost answer if there was one, for
    /// [`begin_after`](Self::begin_after), which goes on as `begin` would have. For a store
    /// that answers in place (`MemoryStore`) this skips the waiting and retrying machinery,
    /// and its state, on every request.
    pub(crate) fn begin_in_place(
        &self,
        request: &BeginRequest,
        busy: BusyPolicy,
    ) -> Result<Result<Begin, StoreError>, Option<StoreError>> {
        if !self.may_answer_in_place() {
            return Err(None);
        }
        let started = start();
        let Some(answer) = self.take_in_place(self.store.begin(request.clone())) else {
            return Err(None);
        };
        observe("begin", started, &answer);
        match answer {
            Ok(Begin::Busy { .. }) if matches!(busy, BusyPolicy::Wait(_)) => Err(None),
            Err(err) if is_ambiguous(&err) => Err(Some(err)),
            answer => Ok(answer),
        }
    }

    /// The answer of a store call made in place, unless the store awaits (learnt once,
    /// then no call is made here at all).
    fn take_in_place<T>(&self, mut call: StoreFuture<'_, T>) -> Option<Result<T, StoreError>> {
        let answer = call.take_ready();
        if answer.is_none() {
            self.shared
                .awaits
                .store(true, std::sync::atomic::Ordering::Relaxed);
        }
        answer
    }

    /// Whether calls are worth making in place: the store has not yet answered with a
    /// future to await.
    fn may_answer_in_place(&self) -> bool {
        !self
            .shared
            .awaits
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// One `begin`, asked again (same token) when its answer was lost: the store recognises
    /// a claim it already made for this token and answers it again. If no answer comes, the
    /// claim it may have made is released in the background, so the key does not stay
    /// claimed by nobody once the store is back.
    ///
    /// `lost`: the lost answer of a first try already made (in place).
    async fn begin_once(
        &self,
        request: &BeginRequest,
        lost: Option<StoreError>,
    ) -> Result<Begin, StoreError> {
        let mut pause = FIRST_STORE_RETRY;
        let mut tries = 0;
        // The lost answer stands for the first try's.
        let mut lost = lost.map(Err);
        // From the first call on, the store may hold a claim under this token that no one
        // will use if this future is dropped before an answer arrives (the caller's timeout
        // fired mid round trip): nothing was sent under it, so it must not expire into
        // doubt. Disarmed once the answer is in the caller's hands.
        let mut unanswered = UnansweredClaim {
            ledger: self,
            key: request.key,
            token: request.token,
            armed: true,
        };
        loop {
            tries += 1;
            let answer = match lost.take() {
                Some(lost) => lost,
                None => {
                    let started = start();
                    let answer = self.store.begin(request.clone()).await;
                    observe("begin", started, &answer);
                    answer
                }
            };
            match answer {
                Ok(answer) => {
                    unanswered.armed = false;
                    return Ok(answer);
                }
                Err(err) if is_ambiguous(&err) && tries < BEGIN_TRIES => {
                    tracing::debug!(%err, tries, "begin failed; asking again with the same token");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(MAX_STORE_RETRY);
                }
                Err(err) => {
                    // An ambiguous failure may have left a claim: released by the guard.
                    unanswered.armed = is_ambiguous(&err);
                    return Err(err);
                }
            }
        }
    }

    /// Release, in the background, a claim that may have been made under `token` but will
    /// not be used: nothing was sent under it. A claim that resumed an in-doubt operation
    /// goes back to doubt (the store's `abandon` never releases one that may have been sent).
    fn release_unused(&self, key: LedgerKey, token: LeaseToken) {
        use std::sync::atomic::Ordering::Relaxed;
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let pending = &self.shared.pending_releases;
        if pending
            .fetch_update(Relaxed, Relaxed, |n| {
                (n < MAX_PENDING_RELEASES).then_some(n + 1)
            })
            .is_err()
        {
            tracing::debug!(
                "too many claims to release in the background; this one will read as in doubt"
            );
            return;
        }
        let ledger = self.clone();
        runtime.spawn(async move {
            let deadline = Instant::now() + RELEASE_PATIENCE;
            if let Err(err) = ledger
                .apply(key, token, &Settle::Abandon, deadline, None)
                .await
            {
                if !err.is_fenced() {
                    tracing::warn!(%err, "could not release an unused claim; it will read as in doubt");
                }
            }
            ledger.shared.pending_releases.fetch_sub(1, Relaxed);
        });
    }

    /// Hold the lease of `key` under `token`; settle it with the guard's methods. Dropped
    /// unsettled, the guard leaves the operation in doubt (see [`LeaseGuard`]).
    pub(crate) fn hold(&self, key: LedgerKey, token: LeaseToken) -> LeaseGuard {
        let mut lease = self.hold_unsent(key, token);
        lease.sending();
        lease
    }

    /// [`hold`](Self::hold) a lease under which nothing has been sent yet: until
    /// [`LeaseGuard::sending`], a drop releases the operation instead of leaving it in
    /// doubt (the owner went away before a byte could leave).
    pub(crate) fn hold_unsent(&self, key: LedgerKey, token: LeaseToken) -> LeaseGuard {
        LeaseGuard {
            ledger: self.clone(),
            key,
            token,
            pending: None,
            done: false,
            sent: false,
        }
    }

    /// One store call for `settle`, observed.
    async fn settle_once(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        settle: &Settle,
    ) -> Result<(), StoreError> {
        let started = start();
        let result = match settle {
            Settle::Complete(outcome) => {
                self.store
                    .complete(key, token, outcome.clone(), self.retention)
                    .await
            }
            Settle::Abandon => self.store.abandon(key, token).await,
            Settle::MarkInDoubt => self.store.mark_in_doubt(key, token, self.retention).await,
        };
        observe(settle.call(), started, &result);
        result
    }

    /// Apply `settle` under `token`, asking again while the store's answer is lost or the
    /// store is away, until `deadline` (the last try is made at the deadline, not a pause
    /// before it). A `fenced` answer after a lost one most likely means the lost one applied
    /// (the record left our hands through our own write).
    ///
    /// The pause between tries doubles up to a tenth of the lease: an owner whose handler
    /// finished records its outcome as soon as the store is back, while its lease still
    /// holds, instead of sleeping past the lease's end and letting the key read as in doubt.
    ///
    /// `lost`: the lost answer of a first try already made (in place).
    async fn apply(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        settle: &Settle,
        deadline: Instant,
        lost: Option<StoreError>,
    ) -> Result<(), StoreError> {
        let mut pause = FIRST_STORE_RETRY;
        let max_pause = self.max_retry_pause();
        let mut lost_one = false;
        // The lost answer stands for the first try's.
        let mut lost = lost.map(Err);
        loop {
            let result = match lost.take() {
                Some(lost) => lost,
                None => self.settle_once(key, token, settle).await,
            };
            let now = Instant::now();
            match result {
                Ok(()) => return Ok(()),
                Err(err) if err.is_fenced() && lost_one => {
                    tracing::debug!(
                        ?settle,
                        "fenced after a lost answer: the earlier call applied"
                    );
                    return Ok(());
                }
                Err(err) if is_ambiguous(&err) && now < deadline => {
                    lost_one = true;
                    tracing::debug!(%err, ?settle, "settling failed; trying again");
                    tokio::time::sleep(pause.min(deadline - now)).await;
                    pause = (pause * 2).min(max_pause);
                }
                Err(err) => return Err(err),
            }
        }
    }
}

/// How a lease is settled.
#[derive(Clone, Debug)]
enum Settle {
    Complete(Outcome),
    Abandon,
    MarkInDoubt,
}

impl Settle {
    /// The store call, as metrics name it.
    fn call(&self) -> &'static str {
        match self {
            Self::Complete(_) => "complete",
            Self::Abandon => "abandon",
            Self::MarkInDoubt => "mark_in_doubt",
        }
    }
}

/// With feature `metrics`, how long a store call took, in `idempotency_ledger_call_seconds`
/// (labels `call`, and `result`: `ok`, `fenced`, `full`, `timeout`, `unavailable`, `corrupt`).
#[cfg(feature = "metrics")]
fn observe<T>(call: &'static str, started: Started, result: &Result<T, StoreError>) {
    let result = match result {
        Ok(_) => "ok",
        Err(err) if err.is_fenced() => "fenced",
        Err(err) if err.is_full() => "full",
        Err(err) if err.is_timeout() => "timeout",
        Err(err) if err.is_unavailable() => "unavailable",
        Err(_) => "corrupt",
    };
    metrics::histogram!("idempotency_ledger_call_seconds", "call" => call, "result" => result)
        .record(started.elapsed().as_secs_f64());
}

#[cfg(not(feature = "metrics"))]
fn observe<T>(_: &'static str, _: Started, _: &Result<T, StoreError>) {}

/// When a store call started: read only when metrics will be recorded.
#[cfg(feature = "metrics")]
type Started = std::time::Instant;
#[cfg(not(feature = "metrics"))]
#[derive(Clone, Copy)]
struct Started;

fn start() -> Started {
    #[cfg(feature = "metrics")]
    return std::time::Instant::now();
    #[cfg(not(feature = "metrics"))]
    Started
}

/// A lease being settled by the engine's waiting and retrying path ([`LeaseGuard::complete`],
/// [`abandon`](LeaseGuard::abandon), [`mark_in_doubt`](LeaseGuard::mark_in_doubt)).
pub(crate) type Settling = Pin<Box<dyn Future<Output = Result<(), StoreError>> + Send>>;

/// An owned lease. Settle it with exactly one of `complete`, `abandon`, `mark_in_doubt`.
///
/// A settle is finished even if its caller is dropped halfway through the store call: the
/// guard keeps what it was asked to do and completes it in a background task. Dropped
/// before any settle (the caller went away, or a panic unwound through it), it marks the
/// operation in doubt the same way once anything may have been sent (the request may be on
/// the wire, or the handler may have done part of its work), and releases it when nothing
/// was (a guard from [`Ledger::hold_unsent`] not yet [sending](LeaseGuard::sending)). So a cancelled or panicking request never leaves its key in
/// flight until the lease runs out.
pub(crate) struct LeaseGuard {
    ledger: Ledger,
    key: LedgerKey,
    token: LeaseToken,
    /// The settle under way, if any: what a drop must finish.
    pending: Option<Settle>,
    done: bool,
    /// Whether anything may have been sent under the lease: what a drop without a settle
    /// under way does (leave the operation in doubt, or release it).
    sent: bool,
}

/// A claim `begin` may have made whose answer its caller has not seen: released in the
/// background if dropped armed (see [`Ledger::begin_once`]).
struct UnansweredClaim<'a> {
    ledger: &'a Ledger,
    key: LedgerKey,
    token: LeaseToken,
    armed: bool,
}

impl Drop for UnansweredClaim<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.ledger.release_unused(self.key, self.token);
        }
    }
}

impl LeaseGuard {
    /// Record `outcome`, retrying a lost write inside the lease.
    pub(crate) fn complete(self, outcome: Outcome) -> Settling {
        self.settle(Settle::Complete(outcome))
    }

    /// [`complete`](Self::complete) in place, when the store answers at once and its answer
    /// was not lost; else what is left to do, by the waiting and retrying path.
    pub(crate) fn complete_in_place(mut self, outcome: Outcome) -> InPlace {
        let unsettled = |lease, outcome, lost| Unsettled {
            lease,
            outcome,
            lost,
        };
        if !self.ledger.may_answer_in_place() {
            return InPlace::Later(unsettled(self, outcome, None));
        }
        let started = start();
        let call = (self.ledger.store).complete(
            self.key,
            self.token,
            outcome.clone(),
            self.ledger.retention,
        );
        let Some(result) = self.ledger.take_in_place(call) else {
            return InPlace::Later(unsettled(self, outcome, None));
        };
        observe("complete", started, &result);
        match result {
            Err(err) if is_ambiguous(&err) => InPlace::Later(unsettled(self, outcome, Some(err))),
            result => {
                self.done = true;
                InPlace::Done(result)
            }
        }
    }

    /// Release the operation: nothing of it was sent.
    pub(crate) fn abandon(self) -> Settling {
        self.settle(Settle::Abandon)
    }

    /// Leave the operation in doubt: its bytes may have left.
    pub(crate) fn mark_in_doubt(self) -> Settling {
        self.settle(Settle::MarkInDoubt)
    }

    /// From here on, the request may leave: a drop leaves the operation in doubt rather
    /// than releasing it. Called before the inner service is called, never after.
    pub(crate) fn sending(&mut self) {
        self.sent = true;
    }

    /// Hand the lease on unsettled, to whoever goes on with the operation under the same
    /// token (a reconciled operation found not applied is sent by the usual path, which
    /// holds its own guard).
    pub(crate) fn hand_on(mut self) -> LeaseToken {
        self.done = true;
        self.token
    }

    /// Boxed: settling by this path is rare on the request path (a failure, a `5xx` to
    /// release, a store that awaits), and held in place its retrying state would weigh on
    /// every request's future, which is moved whole as it is built.
    fn settle(self, settle: Settle) -> Settling {
        Box::pin(self.settle_after(settle, None))
    }

    /// `settle`; `lost`: the lost answer of a first try already made (see
    /// [`Ledger::apply`]).
    async fn settle_after(
        mut self,
        settle: Settle,
        lost: Option<StoreError>,
    ) -> Result<(), StoreError> {
        self.pending = Some(settle.clone());
        // An owner holding the outcome keeps trying to record it for as long as its lease
        // would last: a write lost to a store restart is retried, not given up at once.
        let deadline = Instant::now() + self.ledger.lease;
        let result = self
            .ledger
            .apply(self.key, self.token, &settle, deadline, lost)
            .await;
        self.done = true;
        result
    }

    /// Run `work` while keeping the lease alive: renewed every third of the lease, so a
    /// slow but live owner is never taken for dead and overtaken.
    pub(crate) fn renewing<F: Future>(&self, work: F) -> Renewing<'_, F> {
        Renewing {
            lease: self,
            work,
            renewal: Renewal::new(),
        }
    }
}

pin_project! {
    /// [`LeaseGuard::renewing`]'s future: `work`, and the lease's [`Renewal`] while it is
    /// pending.
    pub(crate) struct Renewing<'a, F> {
        lease: &'a LeaseGuard,
        #[pin]
        work: F,
        #[pin]
        renewal: Renewal,
    }
}

impl<F: Future> Future for Renewing<'_, F> {
    type Output = F::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        if let Poll::Ready(output) = this.work.poll(cx) {
            return Poll::Ready(output);
        }
        match this.renewal.poll_renew(this.lease, cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(never) => match never {},
        }
    }
}

/// A store call renewing a lease: boxed, since it borrows the store and is made once per
/// third of a lease at most, never for work done within it.
type RenewCall = Pin<Box<dyn Future<Output = Result<(), StoreError>> + Send>>;

pin_project! {
    /// Renews a lease every third of it, for as long as it is polled (it never completes):
    /// poll it with its lease's guard whenever the work holding that lease is pending.
    ///
    /// Nothing happens before its first poll, so work that is ready at once never starts a
    /// timer. A renewal refused as fenced (the operation was taken over) stops it: later
    /// writes under the lost lease will be refused, never applied. A renewal that fails
    /// otherwise (the store is away, or its answer was lost) is tried again soon, the pause
    /// doubling up to a tenth of the lease, not a third of a lease later: two such misses
    /// in a row would let the lease run out under its live owner while the store was back.
    pub(crate) struct Renewal {
        #[pin]
        sleep: Option<tokio::time::Sleep>,
        call: Option<(RenewCall, Started)>,
        // The pause before the next try while renewals fail; `None` after a success.
        retry: Option<Duration>,
        stopped: bool,
    }
}

impl Renewal {
    pub(crate) fn new() -> Self {
        Self {
            sleep: None,
            call: None,
            retry: None,
            stopped: false,
        }
    }

    /// Drive the renewals of `lease`. Never ready.
    pub(crate) fn poll_renew(
        self: Pin<&mut Self>,
        lease: &LeaseGuard,
        cx: &mut Context<'_>,
    ) -> Poll<std::convert::Infallible> {
        let mut this = self.project();
        let every = (lease.ledger.lease / 3).max(Duration::from_millis(1));
        loop {
            if *this.stopped {
                return Poll::Pending;
            }
            if let Some((call, started)) = this.call.as_mut() {
                let renewed = std::task::ready!(call.as_mut().poll(cx));
                observe("renew", *started, &renewed);
                *this.call = None;
                // The next renewal is a third of a lease after a success, and soon after a
                // failure.
                let next = match renewed {
                    Ok(()) => {
                        *this.retry = None;
                        every
                    }
                    Err(err) if err.is_fenced() => {
                        tracing::warn!("the lease was taken over while its owner was working");
                        *this.stopped = true;
                        continue;
                    }
                    Err(err) => {
                        let pause = match *this.retry {
                            None => {
                                tracing::warn!(%err, "could not renew the lease; trying again");
                                FIRST_STORE_RETRY
                            }
                            Some(pause) => {
                                tracing::debug!(%err, "could not renew the lease; trying again");
                                (pause * 2).min(lease.ledger.max_retry_pause())
                            }
                        };
                        *this.retry = Some(pause);
                        pause.min(every)
                    }
                };
                if let Some(sleep) = this.sleep.as_mut().as_pin_mut() {
                    sleep.reset(Instant::now() + next);
                }
            }
            match this.sleep.as_mut().as_pin_mut() {
                None => this.sleep.set(Some(tokio::time::sleep(every))),
                Some(sleep) => {
                    std::task::ready!(sleep.poll(cx));
                    *this.call = Some((lease.renew_call(), start()));
                }
            }
        }
    }
}

impl Renewal {
    /// Renew `lease` while one is held: pending either way, for the work holding it.
    pub(crate) fn poll_renew_while<T>(
        self: Pin<&mut Self>,
        lease: &Option<LeaseGuard>,
        cx: &mut Context<'_>,
    ) -> Poll<T> {
        if let Some(lease) = lease {
            if let Poll::Ready(never) = self.poll_renew(lease, cx) {
                match never {}
            }
        }
        Poll::Pending
    }
}

impl LeaseGuard {
    fn renew_call(&self) -> RenewCall {
        let (store, key, token, lease) = (
            self.ledger.store.clone(),
            self.key,
            self.token,
            self.ledger.lease,
        );
        Box::pin(async move { store.renew(key, token, lease).await })
    }
}

/// What [`LeaseGuard::complete_in_place`] did.
pub(crate) enum InPlace {
    /// The store answered at once: the lease is settled, with this result.
    Done(Result<(), StoreError>),
    /// Still to do, by the waiting and retrying path.
    Later(Unsettled),
}

/// A completion [`LeaseGuard::complete_in_place`] could not make: the store awaits, or its
/// answer was lost.
pub(crate) struct Unsettled {
    lease: LeaseGuard,
    outcome: Outcome,
    /// The in-place call's answer, when it was lost.
    lost: Option<StoreError>,
}

impl Unsettled {
    /// Record the outcome as [`LeaseGuard::complete`] does, knowing what the in-place call
    /// left.
    pub(crate) async fn complete(self) -> Result<(), StoreError> {
        let Self {
            lease,
            outcome,
            lost,
        } = self;
        lease.settle_after(Settle::Complete(outcome), lost).await
    }
}

impl Drop for LeaseGuard {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        // Without a runtime (a runtime shutting down), the lease expiring is the fallback:
        // the record then reads as in doubt all the same.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        // Nothing sent yet (the owner went away between its claim and its call): release,
        // so the next run sends it rather than finding it in doubt. The store never
        // releases an operation an earlier attempt may have sent (a resumed claim goes
        // back to doubt), so this is safe whatever came before.
        let unsettled = if self.sent {
            Settle::MarkInDoubt
        } else {
            Settle::Abandon
        };
        let settle = self.pending.take().unwrap_or(unsettled);
        let (ledger, key, token) = (self.ledger.clone(), self.key, self.token);
        let mut settling = Box::pin(async move {
            let deadline = Instant::now() + ledger.lease;
            if let Err(err) = ledger.apply(key, token, &settle, deadline, None).await {
                tracing::warn!(%err, ?settle, "could not settle a dropped lease; it will expire into doubt");
            }
        });
        // A store that answers at once (`MemoryStore`) settles here and now, so the very next
        // request already sees the key settled; one that must wait finishes in a task. Not
        // while a panic unwinds: nothing that could panic again runs then.
        if !std::thread::panicking() {
            let mut cx = Context::from_waker(std::task::Waker::noop());
            if settling.as_mut().poll(&mut cx).is_ready() {
                return;
            }
        }
        runtime.spawn(settling);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};

    use super::*;
    use crate::ledger::{Outcome, RecordView};

    /// Counts renewals; answers them `fenced` once told to.
    #[derive(Debug, Default)]
    struct Renewals {
        calls: AtomicUsize,
        fenced: AtomicBool,
    }

    impl IdempotencyStore for Renewals {
        fn begin(&self, _: BeginRequest) -> StoreFuture<'_, Begin> {
            unreachable!("only renewals are asked for")
        }
        fn complete(
            &self,
            _: LedgerKey,
            _: LeaseToken,
            _: Outcome,
            _: Duration,
        ) -> StoreFuture<'_, ()> {
            StoreFuture::ready(Ok(()))
        }
        fn abandon(&self, _: LedgerKey, _: LeaseToken) -> StoreFuture<'_, ()> {
            StoreFuture::ready(Ok(()))
        }
        fn mark_in_doubt(&self, _: LedgerKey, _: LeaseToken, _: Duration) -> StoreFuture<'_, ()> {
            StoreFuture::ready(Ok(()))
        }
        fn renew(&self, _: LedgerKey, _: LeaseToken, _: Duration) -> StoreFuture<'_, ()> {
            self.calls.fetch_add(1, SeqCst);
            if self.fenced.load(SeqCst) {
                return StoreFuture::ready(Err(StoreError::fenced()));
            }
            StoreFuture::ready(Ok(()))
        }
        fn inspect(&self, _: LedgerKey) -> StoreFuture<'_, Option<RecordView>> {
            StoreFuture::ready(Ok(None))
        }
    }

    fn lease_of(store: &Arc<Renewals>, lease: Duration) -> LeaseGuard {
        let store: Arc<dyn IdempotencyStore> = store.clone();
        let ledger = Ledger::new(store, lease, lease * 10, lease);
        ledger.hold(LedgerKey::server("", "k"), LeaseToken::generate())
    }

    /// Let the renewing future run on the paused clock for `time`, a millisecond at a time.
    async fn run_for<F: Future + Unpin>(work: &mut F, time: Duration) {
        let end = Instant::now() + time;
        while Instant::now() < end {
            let polled = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *work).poll(cx)));
            assert!(polled.await.is_pending(), "the work never completes");
            tokio::time::advance(Duration::from_millis(1)).await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn pending_work_renews_every_third_of_the_lease_until_fenced() {
        let store = Arc::new(Renewals::default());
        let lease = lease_of(&store, Duration::from_millis(300));
        let mut work = Box::pin(lease.renewing(std::future::pending::<()>()));
        run_for(&mut work, Duration::from_millis(1050)).await;
        assert_eq!(store.calls.load(SeqCst), 10, "one renewal per 100 ms");

        store.fenced.store(true, SeqCst);
        run_for(&mut work, Duration::from_millis(1000)).await;
        assert_eq!(
            store.calls.load(SeqCst),
            11,
            "a renewal refused as fenced is the last: the lease is someone else's"
        );
        drop(work);
        let _ = lease.hand_on();
    }

    #[tokio::test(start_paused = true)]
    async fn work_ready_at_once_never_starts_a_timer() {
        let store = Arc::new(Renewals::default());
        let lease = lease_of(&store, Duration::from_millis(300));
        assert_eq!(lease.renewing(async { 7 }).await, 7);
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(store.calls.load(SeqCst), 0);
        let _ = lease.hand_on();
    }
}
