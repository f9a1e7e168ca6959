//! How many attempts a response took, as a response extension.

use http::Response;

/// How many attempts produced a response: a response extension set by
/// [`FrozenRetry`](super::FrozenRetry) on the answers that took **more than one** attempt.
///
/// A response answered by its first attempt carries no `Attempts` (an extension costs every
/// response three allocations, more than the rest of the layer's work on the common path);
/// [`Attempts::of`] reads either kind.
///
/// ```
/// # use tower_idempotency::retry::Attempts;
/// let attempts = Attempts::new(2);
/// assert_eq!(attempts.get(), 2);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attempts(pub(super) u32);

impl Attempts {
    /// `n` attempts.
    pub const fn new(n: u32) -> Self {
        Self(n)
    }

    /// The number of attempts made, the first included.
    pub const fn get(self) -> u32 {
        self.0
    }

    /// How many attempts produced `response`: its `Attempts` extension, or one attempt when
    /// it carries none (a first-attempt answer, or one that did not pass a
    /// [`FrozenRetry`](super::FrozenRetry)).
    ///
    /// ```
    /// use tower_idempotency::retry::Attempts;
    ///
    /// let mut response = http::Response::new(());
    /// assert_eq!(Attempts::of(&response), Attempts::new(1));
    /// response.extensions_mut().insert(Attempts::new(3));
    /// assert_eq!(Attempts::of(&response).get(), 3);
    /// ```
    pub fn of<B>(response: &Response<B>) -> Self {
        response
            .extensions()
            .get::<Self>()
            .copied()
            .unwrap_or(Self(1))
    }
}
