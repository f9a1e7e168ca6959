//! Test support: one orchestrator operation, the request that carries it, a fast retry
//! policy, and where a response came from.
#![allow(dead_code)]

use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::Full;
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::{OperationId, ResponseSource};

/// Where the test orders go.
pub const ORDERS: &str = "http://orders.local/orders";

/// The operation every test request belongs to.
pub fn op() -> OperationId {
    OperationId::new("task-9", "create-order")
}

/// `POST` `body` to [`ORDERS`] as operation [`op`].
pub fn post(body: &'static str) -> Request<Full<Bytes>> {
    let mut req = Request::post(ORDERS)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap();
    req.extensions_mut().insert(op());
    req
}

/// Three attempts, millisecond backoff, no budget, `attempt_timeout` per attempt.
pub fn fast_policy(attempt_timeout: Duration) -> RetryPolicy {
    RetryPolicy::builder()
        .max_attempts(3)
        .backoff(Duration::from_millis(1), Duration::from_millis(5))
        .attempt_timeout(attempt_timeout)
        .no_budget()
        .build()
        .unwrap()
}

/// The client layer's marker on a response.
pub fn source<B>(response: &Response<B>) -> ResponseSource {
    ResponseSource::of(response)
}
