//! The retry budget a [`RetryPolicy`](super::RetryPolicy) keeps: tower's `TpsBudget`, or by
//! default [`Windowed`], the same budget without a lock on every call.
//!
//! tower's `TpsBudget` takes a mutex and reads the clock on every deposit, that is on every
//! call through the layer, to see whether its window has moved on; all the clones of a
//! policy share one budget, so every call of every task meets at that mutex. [`Windowed`]
//! keeps its arithmetic (ten slots over the window, the reserve, the deposit and withdrawal
//! amounts), and the moment its current slot ends in an atomic: a call reads it, and takes
//! the lock only when the slot has ended, about once a second. The clock is read once per
//! call, by the call (its deadline starts then too), not once more by the budget.

use std::sync::atomic::{AtomicIsize, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;
use tower::retry::budget::{Budget, TpsBudget};

/// The budget a policy keeps.
#[derive(Clone, Debug)]
pub(crate) enum RetryBudget {
    /// The default (and [`Windowed`]'s parameters are the default's).
    Windowed(Arc<Windowed>),
    /// One the caller shares ([`RetryPolicyBuilder::budget`](super::RetryPolicyBuilder::budget)).
    Tower(Arc<TpsBudget>),
}

impl RetryBudget {
    /// A call started at `now`.
    pub(crate) fn deposit_at(&self, now: Instant) {
        match self {
            Self::Windowed(budget) => budget.deposit_at(now),
            Self::Tower(budget) => budget.deposit(),
        }
    }

    /// Whether a call may retry at `now` (taking what a retry costs if it may).
    pub(crate) fn withdraw_at(&self, now: Instant) -> bool {
        match self {
            Self::Windowed(budget) => budget.withdraw_at(now),
            Self::Tower(budget) => budget.withdraw(),
        }
    }
}

/// tower's `TpsBudget`, its window's end read without a lock (see the module docs).
pub(crate) struct Windowed {
    /// The current slot and when it began; changed under this lock only.
    generation: Mutex<Generation>,
    /// When the current slot ends, in nanoseconds after `base`: before it, nothing expires.
    slot_ends: AtomicU64,
    base: Instant,
    reserve: isize,
    slots: [AtomicIsize; SLOTS],
    /// How long a slot lasts: the window over [`SLOTS`].
    slot: Duration,
    /// The deposits and withdrawals of the current slot.
    writer: AtomicIsize,
    deposit_amount: isize,
    withdraw_amount: isize,
}

const SLOTS: usize = 10;

struct Generation {
    index: usize,
    time: Instant,
}

impl Windowed {
    /// As `TpsBudget::new(ttl, min_per_sec, retry_percent)`: a window of `ttl` (1 to 60 s),
    /// `min_per_sec` retries a second allowed whatever the calls, and `retry_percent` of the
    /// calls (0 to 1000) on top.
    pub(crate) fn new(ttl: Duration, min_per_sec: u32, retry_percent: f32) -> Self {
        assert!(ttl >= Duration::from_secs(1) && ttl <= Duration::from_secs(60));
        assert!((0.0..=1000.0).contains(&retry_percent));
        assert!(min_per_sec < i32::MAX as u32);
        // tower's amounts: a retry costs `1 / retry_percent` calls' deposits.
        let (deposit_amount, withdraw_amount) = if retry_percent == 0.0 {
            (0, 1)
        } else if retry_percent <= 1.0 {
            (1, (1.0 / retry_percent) as isize)
        } else {
            (1000, (1000.0 / retry_percent) as isize)
        };
        let reserve = (min_per_sec as isize)
            .saturating_mul(ttl.as_secs() as isize)
            .saturating_mul(withdraw_amount);
        let slot = ttl / SLOTS as u32;
        let base = Instant::now();
        Self {
            generation: Mutex::new(Generation {
                index: 0,
                time: base,
            }),
            slot_ends: AtomicU64::new(nanos(slot)),
            base,
            reserve,
            slots: std::array::from_fn(|_| AtomicIsize::new(0)),
            slot,
            writer: AtomicIsize::new(0),
            deposit_amount,
            withdraw_amount,
        }
    }

    fn deposit_at(&self, now: Instant) {
        self.expire(now);
        self.writer.fetch_add(self.deposit_amount, Ordering::SeqCst);
    }

    fn withdraw_at(&self, now: Instant) -> bool {
        self.expire(now);
        if self.sum() >= self.withdraw_amount {
            self.writer
                .fetch_add(-self.withdraw_amount, Ordering::SeqCst);
            true
        } else {
            false
        }
    }

    /// Move on to the next slot (or further) once the current one has ended, as tower's
    /// does; while it has not, one atomic load.
    fn expire(&self, now: Instant) {
        if nanos(now.saturating_duration_since(self.base)) < self.slot_ends.load(Ordering::Acquire)
        {
            return;
        }
        let mut generation = self
            .generation
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let mut elapsed = now.saturating_duration_since(generation.time);
        if elapsed < self.slot {
            // Another call moved it on meanwhile.
            return;
        }
        let committed = self.writer.swap(0, Ordering::SeqCst);
        self.slots[generation.index].store(committed, Ordering::SeqCst);
        let mut index = (generation.index + 1) % SLOTS;
        // One slot cleared per slot's time that passed, as tower's does, but never more than
        // them all: past a whole window every slot is cleared already, and a clock that
        // moved on by months (an idle process, a paused test clock) would otherwise spin
        // here once per slot's time, under the lock. Where the index lands then does not
        // matter: every slot is empty.
        let mut cleared = 0;
        while elapsed > self.slot && cleared < SLOTS {
            self.slots[index].store(0, Ordering::SeqCst);
            elapsed -= self.slot;
            index = (index + 1) % SLOTS;
            cleared += 1;
        }
        generation.index = index;
        generation.time = now;
        let ends = nanos((now + self.slot).saturating_duration_since(self.base));
        self.slot_ends.store(ends, Ordering::Release);
    }

    fn sum(&self) -> isize {
        let windowed = self
            .slots
            .iter()
            .map(|slot| slot.load(Ordering::SeqCst))
            .fold(0, isize::saturating_add);
        self.writer
            .load(Ordering::SeqCst)
            .saturating_add(windowed)
            .saturating_add(self.reserve)
    }
}

/// A duration in whole nanoseconds (saturating: about 584 years).
fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

impl std::fmt::Debug for Windowed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Windowed")
            .field("deposit", &self.deposit_amount)
            .field("withdraw", &self.withdraw_amount)
            .field("balance", &self.sum())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Clone, Debug)]
    enum Step {
        Call,
        Retry,
        Wait(Duration),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => Just(Step::Call),
            3 => Just(Step::Retry),
            1 => (0u64..3_000).prop_map(|ms| Step::Wait(Duration::from_millis(ms))),
            // Past a whole window or many: every slot cleared.
            1 => (10_000u64..600_000).prop_map(|ms| Step::Wait(Duration::from_millis(ms))),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// Any sequence of calls, retries and waits gets the same answers from `Windowed`
        /// as from tower's `TpsBudget` with the same parameters, on the same (paused) clock.
        #[test]
        fn windowed_answers_every_retry_as_tower_s_budget_does(
            steps in proptest::collection::vec(step(), 1..300),
            ttl_secs in 1u64..=60,
            min_per_sec in 0u32..5,
            percent in prop_oneof![Just(0.0f32), Just(0.2f32), Just(0.5f32), Just(1.0f32), Just(2.5f32)],
        ) {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_time()
                .start_paused(true)
                .build()
                .unwrap();
            runtime.block_on(async {
                let ttl = Duration::from_secs(ttl_secs);
                let ours = Windowed::new(ttl, min_per_sec, percent);
                let towers = TpsBudget::new(ttl, min_per_sec, percent);
                for (at, step) in steps.iter().enumerate() {
                    match step {
                        Step::Call => {
                            ours.deposit_at(Instant::now());
                            towers.deposit();
                        }
                        Step::Retry => {
                            let (a, b) = (ours.withdraw_at(Instant::now()), towers.withdraw());
                            prop_assert_eq!(a, b, "step {}: {:?}", at, steps);
                        }
                        Step::Wait(pause) => tokio::time::advance(*pause).await,
                    }
                }
                Ok(())
            })?;
        }
    }

    /// A clock that moved on by ages (an idle process, a paused test clock advanced to a
    /// far timer) costs one pass over the slots, not one step per slot's time: this test
    /// would spin for hours otherwise.
    #[tokio::test(start_paused = true)]
    async fn a_clock_ages_ahead_clears_the_window_at_once() {
        let budget = Windowed::new(Duration::from_secs(10), 10, 0.2);
        for _ in 0..500 {
            budget.deposit_at(Instant::now());
        }
        tokio::time::advance(Duration::from_secs(10_000 * 365 * 24 * 3600)).await;
        // The calls of ages ago are gone: the floor alone is left.
        assert_eq!(retries_allowed(&budget, 200), 100);
    }

    #[tokio::test(start_paused = true)]
    async fn the_default_allows_its_floor_and_a_fifth_of_the_calls_on_top() {
        let budget = Windowed::new(Duration::from_secs(10), 10, 0.2);
        // The floor: 10 retries a second over the 10 s window, with no call at all.
        assert_eq!(retries_allowed(&budget, 200), 100);
        // Then a fifth of the calls.
        for _ in 0..50 {
            budget.deposit_at(Instant::now());
        }
        assert_eq!(retries_allowed(&budget, 50), 10);
    }

    #[test]
    fn calls_on_many_threads_keep_count() {
        let budget = Arc::new(Windowed::new(Duration::from_secs(60), 0, 1.0));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let _entered = runtime.enter();
        std::thread::scope(|scope| {
            for _ in 0..4 {
                let budget = budget.clone();
                scope.spawn(move || {
                    for _ in 0..1_000 {
                        budget.deposit_at(Instant::now());
                    }
                });
            }
        });
        // Every deposit counted, in whichever slot it fell: as many retries as calls.
        assert_eq!(retries_allowed(&budget, 5_000), 4_000);
    }

    /// How many of `asked` retries in a row the budget allows now.
    fn retries_allowed(budget: &Windowed, asked: usize) -> usize {
        (0..asked)
            .take_while(|_| budget.withdraw_at(Instant::now()))
            .count()
    }
}
