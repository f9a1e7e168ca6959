//! Claiming an operation: `begin`, waiting while another owner holds it, asking again when
//! an answer was lost, and releasing a claim nobody will use.

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use tokio::time::Instant;

use crate::ledger::{Begin, BeginRequest, LeaseToken, LedgerKey, Settled, StoreError, StoreFuture};

use super::observe::{observe, start};
use super::settle::Settle;
use super::{
    is_ambiguous, BusyPolicy, LeaseGuard, Ledger, BEGIN_TRIES, FIRST_BUSY_POLL, FIRST_STORE_RETRY,
    LONGEST, MAX_BUSY_POLL, MAX_PENDING_RELEASES, MAX_STORE_RETRY, RELEASE_PATIENCE,
};

impl Ledger {
    /// `begin`, waiting per `busy` while another owner holds the operation: woken by the
    /// store when the owner settles, if it can notify, else polling with a backoff; never
    /// sleeping past the owner's lease (it turns in doubt then) nor past the bound, until
    /// the owner is seen to keep its lease (see [`Wakes`]). Past the
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
        // The bound is fixed once, here: every wait below is cut to what is left of it, so a
        // duplicate never waits longer than its policy says, however many times it is woken.
        let give_up_at = match busy {
            BusyPolicy::Wait(limit) => Instant::now() + limit.min(LONGEST),
            BusyPolicy::Fail => Instant::now(),
        };
        let mut pause = FIRST_BUSY_POLL;
        let mut permit = None;
        // Subscribed before the `begin` it follows, so a settle in between is not missed.
        let mut settled: Option<Settled> = None;
        let mut notifies = true;
        let mut wakes = Wakes::default();
        loop {
            let answer = self.begin_once(&request, lost.take()).await?;
            let Begin::Busy { retry_after } = answer else {
                return Ok(answer);
            };
            let now = Instant::now();
            if now >= give_up_at {
                return Ok(answer);
            }
            // A waiter's place is taken only once the store said busy, and kept until this
            // future ends: the common case (not busy) never touches the counter, and a
            // woken waiter that finds the key busy again does not queue twice.
            if let (None, Some(limit)) = (&permit, &self.waiters) {
                match limit.try_enter() {
                    Some(entered) => permit = Some(entered),
                    // A storm of duplicates: answer busy now rather than queue one more.
                    None => return Ok(answer),
                }
            }
            // The store's `retry_after` is what is left of the owner's lease: past it the
            // operation turns in doubt and this caller may take it over, so it never sleeps
            // longer than that (and never zero, which would spin), unless the owner was
            // seen to keep its lease.
            wakes.looked(now, retry_after);
            let nap = wakes.nap(retry_after).min(give_up_at - now);
            match settled.take() {
                // Woken over and over at this instant, the key busy each time: pause as the
                // polling path does (still listening), so the clock moves on before the next
                // look. Only a paused clock stands still for such a run of wakes.
                Some(listening) if wakes.too_many_at(now) => {
                    tokio::time::sleep(pause.min(nap)).await;
                    pause = (pause * 2).min(MAX_BUSY_POLL);
                    settled = Some(listening);
                    continue;
                }
                Some(listening) => {
                    let woken = tokio::time::timeout(nap, listening).await.is_ok();
                    wakes.woken(woken, nap, Instant::now());
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
    pub(super) fn take_in_place<T>(
        &self,
        mut call: StoreFuture<'_, T>,
    ) -> Option<Result<T, StoreError>> {
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
    pub(super) fn may_answer_in_place(&self) -> bool {
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
    /// A lost answer is a `begin` that may still be on its way (held up in the store's
    /// connection, or by a frozen server): it can land after an answer to a later try. If
    /// that answer is no claim of this token (the key was busy, replayed, drifted), the
    /// token is released too: the store remembers a released token, so the late `begin`
    /// claims nothing whenever it lands, even once the key is free again. A token released
    /// so is not asked with again: the store refuses it (fenced), and `begin` asks under a
    /// fresh one instead.
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
        // The request as asked: under a fresh token once the caller's was released.
        let mut request = std::borrow::Cow::Borrowed(request);
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
        // Whether a try's answer was lost: that try may still land.
        let mut may_land = false;
        // Whether the caller's token was found released, and a fresh one taken (once).
        let mut renewed = false;
        loop {
            tries += 1;
            let answer = match lost.take() {
                Some(lost) => lost,
                None => {
                    let started = start();
                    let answer = self.store.begin(request.clone().into_owned()).await;
                    observe("begin", started, &answer);
                    answer
                }
            };
            match answer {
                Ok(Begin::Busy { retry_after }) if may_land => {
                    // The caller may ask again with this token (it waits while busy): the
                    // release must be in the store first, so that asking again is refused
                    // and goes on under a fresh token, rather than claiming what the
                    // release would then take back. If the release fails too, so does this
                    // `begin`, and the guard releases the token in the background.
                    self.release_now(request.key, request.token).await?;
                    unanswered.armed = false;
                    return Ok(Begin::Busy { retry_after });
                }
                Ok(answer) => {
                    // A final answer that is no claim of this token, after a lost try: the
                    // caller asks no more under it, and the guard releases it.
                    unanswered.armed = may_land && !claims(&answer, request.token);
                    return Ok(answer);
                }
                Err(err) if err.is_fenced() && !renewed && !may_land && tries == 1 => {
                    // This token was released already (an earlier `begin` of this caller
                    // lost a try, then was answered busy): ask under a fresh one, which no
                    // try of this caller's ever carried.
                    tracing::debug!("begin under a released token; asking under a fresh one");
                    request.to_mut().token = LeaseToken::generate();
                    unanswered.token = request.token;
                    renewed = true;
                    tries = 0;
                }
                Err(err) if is_ambiguous(&err) && tries < BEGIN_TRIES => {
                    may_land = true;
                    tracing::debug!(%err, tries, "begin failed; asking again with the same token");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(MAX_STORE_RETRY);
                }
                Err(err) => {
                    // An ambiguous failure may have left a claim: released by the guard.
                    unanswered.armed = may_land || is_ambiguous(&err);
                    return Err(err);
                }
            }
        }
    }

    /// Release now a claim that may have been made under `token`, or that a `begin` of it
    /// still on its way may make: done once the store has the release (fenced: it had no
    /// claim of the token, and remembers the token all the same).
    async fn release_now(&self, key: LedgerKey, token: LeaseToken) -> Result<(), StoreError> {
        let started = start();
        let released = self.store.abandon(key, token).await;
        observe("abandon", started, &released);
        match released {
            Err(err) if !err.is_fenced() => Err(err),
            _ => Ok(()),
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
            held: AtomicBool::new(false),
        }
    }
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

/// Whether `answer` is a claim under `token` (a new one, or a resume): its caller holds it.
fn claims(answer: &Begin, token: LeaseToken) -> bool {
    matches!(
        answer,
        Begin::Acquired { token: claimed } | Begin::Resume { token: claimed, .. }
            if *claimed == token
    )
}

/// How many times in a row, at one instant, a settle may wake a waiter that then finds the
/// key still busy, before it pauses as a polling waiter does.
const WAKES_AT_ONCE: u32 = 8;

/// What a waiter on a store that notifies has learnt from its wakes, so that every wake that
/// finds the key still busy brings it nearer its bound:
///
/// - **A nap that ran out**, the key still busy and the owner's lease ending later than it
///   did (by half the nap at least), means the owner keeps its lease: a store holding it
///   for a live owner answers a whole lease left at every look, a renewing owner renews.
///   Waking at every lease end would then cost one `begin` a lease for the whole wait: on
///   a paused clock, a wait of years on a lease of seconds is millions of them. So each
///   such nap is twice as long as the last, from the lease up: a waiter that has waited
///   `t` on a live owner notices a lease that then runs out silently (an owner that died
///   without settling, on a store that does not announce it) at most about `t` late. The
///   in-process store announces every way a held lease ends (a settle, or the owner
///   letting go), so its waiters lose nothing: they are woken, and look again. A lease
///   whose end did not move (the clocks of waiter and store disagree by a little) is
///   waited for again as it is.
/// - **A settle** starts over from the owner's lease: the record changed hands.
/// - **A run of settles at one instant** (other keys of the store's shard settling, or
///   owners coming and going while the clock stands still) is cut short by
///   [`too_many_at`](Self::too_many_at).
#[derive(Debug, Default)]
struct Wakes {
    /// How long the next nap lasts at least: twice the last one, while the owner keeps
    /// its lease.
    kept_lease: Duration,
    /// When the owner's lease ended at the last look (`None` past what the clock holds).
    lease_end: Option<Instant>,
    /// The nap that ran out since the last look, if one did.
    slept: Option<Duration>,
    /// The instant of the last settle wake, and how many came in a row at it.
    at: Option<Instant>,
    at_once: u32,
}

impl Wakes {
    /// A look at `now` found the key busy, `retry_after` from its lease's end.
    fn looked(&mut self, now: Instant, retry_after: Duration) {
        let end = now.checked_add(retry_after);
        if let Some(slept) = self.slept.take() {
            let kept = match (self.lease_end, end) {
                (Some(before), Some(end)) => before
                    .checked_add(slept / 2)
                    .is_none_or(|moved_on| end >= moved_on),
                // Past what the clock holds, before or now: nothing to run out.
                _ => true,
            };
            self.kept_lease = if kept {
                slept.saturating_mul(2).min(LONGEST)
            } else {
                Duration::ZERO
            };
        }
        self.lease_end = end;
    }

    /// The nap before the next look at a key `retry_after` from its lease's end: at least a
    /// millisecond (zero would spin).
    fn nap(&self, retry_after: Duration) -> Duration {
        retry_after
            .max(Duration::from_millis(1))
            .max(self.kept_lease)
    }

    /// A nap of `nap` ended at `now`: by a settle (`settled`), or ran out.
    fn woken(&mut self, settled: bool, nap: Duration, now: Instant) {
        if settled {
            self.kept_lease = Duration::ZERO;
            if self.at == Some(now) {
                self.at_once += 1;
            } else {
                self.at = Some(now);
                self.at_once = 1;
            }
        } else {
            self.slept = Some(nap);
            self.at = None;
            self.at_once = 0;
        }
    }

    /// Whether settles woke the waiter [`WAKES_AT_ONCE`] times at `now` already, the key
    /// busy each time: it pauses then, and the count starts over.
    fn too_many_at(&mut self, now: Instant) -> bool {
        let too_many = self.at == Some(now) && self.at_once >= WAKES_AT_ONCE;
        if too_many {
            self.at = None;
            self.at_once = 0;
        }
        too_many
    }
}
