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

/// A handler's word that its answer comes **before** any effect: the layer releases the
/// key instead of recording the answer, so the next request with the key runs the handler.
///
/// Insert it into a response's extensions (with axum, return `Extension(NotProcessed)` as
/// one of the response's parts) when the handler turned the request away before doing
/// anything: a dependency it checks first was down, a quota was spent, the request was
/// shed under load. Any status may carry it, a `2xx` too. Without it, only the
/// [`release_statuses`](crate::server::Builder::release_statuses), a `503` with
/// `Retry-After` and (under [`ServerErrorPolicy::Release`]) a `5xx` are released; every
/// other answer is the key's outcome, replayed for the whole retention.
///
/// Mark only an answer given before the effect: a marked answer given after it lets a
/// retry run the effect a second time. In the transactional mode a marked answer rolls the
/// handler's transaction back.
///
/// ```
/// use axum::http::{Request, StatusCode};
/// use axum::response::{IntoResponse, Response};
/// use axum::{body::Body, routing::post, Extension, Router};
/// use tower::ServiceExt;
/// use tower_idempotency::server::NotProcessed;
/// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
///
/// async fn charge() -> Response {
///     let fraud_check_reachable = false;
///     if !fraud_check_reachable {
///         // Checked before charging: nothing happened, so the retry must run again.
///         return (StatusCode::BAD_GATEWAY, Extension(NotProcessed), "try again").into_response();
///     }
///     (StatusCode::CREATED, "ch_1").into_response()
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let layer = IdempotencyLayer::server(MemoryStore::new());
/// let app = Router::new().route("/charges", post(charge).route_layer(layer));
/// let request = || {
///     Request::post("/charges")
///         .header("authorization", "Bearer sk_alice")
///         .header("idempotency-key", "\"order-42\"")
///         .body(Body::from("{}"))
///         .unwrap()
/// };
/// let first = app.clone().oneshot(request()).await.unwrap();
/// let retry = app.oneshot(request()).await.unwrap();
/// assert_eq!(first.status(), StatusCode::BAD_GATEWAY);
/// assert!(!retry.headers().contains_key("idempotent-replayed")); // the handler ran again
/// # }
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NotProcessed;
