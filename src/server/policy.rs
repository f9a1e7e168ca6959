//! The two choices only the application can make: what a handler's `5xx` means, and what
//! to do with a key whose handler started and never finished.

/// What to do with a `5xx` response from the handler.
///
/// ```
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer, ServerErrorPolicy};
///
/// // My handler's 5xx always means "rolled back, nothing happened".
/// let layer = IdempotencyLayer::server_builder(MemoryStore::new())
///     .server_error_policy(ServerErrorPolicy::Release)
///     .build()
///     .unwrap();
/// # let _ = layer;
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ServerErrorPolicy {
    /// Record the `5xx` like any other response and replay it to retries (as Stripe does).
    /// The default: a handler can fail *after* its side effect, and only the handler knows
    /// whether it did; recording never runs an effect twice.
    #[default]
    Record,
    /// Release the key: the next request with it runs the handler again. Choose it when
    /// your handler's `5xx` reliably means nothing happened (its effect and its failure
    /// share one transaction), so clients' retries get a fresh attempt.
    Release,
}

/// What to do with a key whose earlier attempt started and never finished: its handler
/// panicked (with nothing catching it), its request future was cancelled, its response body
/// failed, or it ran past its lease. The ledger holds such a key *in doubt*.
///
/// A server cannot "resend" like a client can: the only choices are to run the handler
/// again or to refuse.
///
/// ```
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer, InDoubtPolicy};
///
/// // The handler passes the key to its payment provider, which deduplicates on it.
/// let layer = IdempotencyLayer::server_builder(MemoryStore::new())
///     .in_doubt_policy(InDoubtPolicy::RunAgain)
///     .build()
///     .unwrap();
/// # let _ = layer;
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum InDoubtPolicy {
    /// Answer every later request with the key `500`
    /// [`outcome-unknown`](super::problem::OUTCOME_UNKNOWN) until the record's retention ends:
    /// **at most once**. The default, because the layer cannot know whether the handler's
    /// effect happened, and running it again is exactly the double charge this crate exists
    /// to prevent.
    #[default]
    OutcomeUnknown,
    /// Run the handler again for a request with the same fingerprint: **at least once**.
    /// Safe only when the handler's own effects are idempotent, e.g. its downstream calls
    /// carry the key (it is in the request's extensions as a [`HeaderKey`](crate::HeaderKey)).
    RunAgain,
}
