//! [`Generation`]: which life of its key a record is.

use std::fmt;

/// Which life of its key a record is, so that a look at one record is never mistaken for a
/// look at a later one.
///
/// A key's record has lives: it is created by a claim, goes through its transitions (in
/// flight, in doubt, resumed, completed), and leaves (forgotten, released, evicted, past its
/// retention); the next claim creates it again. Two lives can look alike in every other
/// respect (the same request, so the same fingerprint; one attempt each; both completed),
/// so an operator's [`Expected`](super::Expected), taken from one life, would match the
/// next and [`forget`](super::IdempotencyStore::forget) a newer outcome, letting the
/// operation run a second time. The generation tells them apart: a store gives each life
/// its own when the claim creates the record, keeps it unchanged through every transition
/// of that life, and shows it in [`RecordView`](super::RecordView).
///
/// How a store makes them is its own choice, as long as no two lives of one key that an
/// operator could confuse share one, across restarts and across the processes that share
/// the store: [`MemoryStore`](super::MemoryStore) counts its claims (its records live and
/// die with it), the Redis store draws a [random](Self::random) one per claim (its
/// processes share no counter), the PostgreSQL store takes the next value of a sequence in
/// the database.
///
/// ```
/// use tower_idempotency::ledger::Generation;
///
/// let generation = Generation::from_u64(0x2a);
/// assert_eq!(generation.as_u64(), 42);
/// assert_eq!(generation.to_string(), "000000000000002a");
/// assert_ne!(Generation::random(), Generation::random()); // 1 in 2^64 to fail
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Generation(u64);

impl Generation {
    /// A generation drawn at random, for a store whose processes share no counter: two
    /// lives of one key share one with a chance of one in 2^64.
    pub fn random() -> Self {
        Self(fastrand::u64(..))
    }

    /// The generation `value` (as a store keeps it).
    pub const fn from_u64(value: u64) -> Self {
        Self(value)
    }

    /// The generation as a number (to keep it in a store).
    pub const fn as_u64(self) -> u64 {
        self.0
    }

    /// The generation that sixteen hex digits spell, as it is displayed; `None` for any
    /// other text.
    ///
    /// ```
    /// use tower_idempotency::ledger::Generation;
    ///
    /// assert_eq!(Generation::from_hex("000000000000002a"), Some(Generation::from_u64(42)));
    /// assert_eq!(Generation::from_hex("2a"), None);
    /// ```
    pub fn from_hex(text: &str) -> Option<Self> {
        crate::key::derived::from_hex16(text).map(Self)
    }
}

/// Sixteen lowercase hex digits, as the stores' logs show it.
impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}
