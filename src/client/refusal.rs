//! A provider's refusal to run a request whose key is in use: never the operation's
//! outcome.
//!
//! A provider that deduplicates answers a request whose key it is still processing with a
//! `409` that means "not now", not "no": the first request's real answer is still to come.
//! Recorded as the outcome, that `409` would be replayed for the whole retention and the
//! real answer lost. The rule, for a keyed request's `409`:
//!
//! - with `Retry-After`, it is the IETF draft's "still in progress";
//! - without it, its body says so: an RFC 9457 problem whose `type` is the server face's
//!   [`IN_FLIGHT`](crate::server::problem::IN_FLIGHT) (the IETF draft itself names no
//!   registered type; its example's title reads "A request is outstanding for this
//!   Idempotency-Key"), or Stripe's error object, `{"error":{"type":"idempotency_error"}}`;
//! - any other `409` ("order already exists") is a business answer, and final.

use serde_json::Value;

use crate::server::problem::IN_FLIGHT;

/// Stripe's error type for a request whose key is in use by another one (`409`), or was
/// used with other parameters (`400`, never `409`).
const STRIPE_IDEMPOTENCY_ERROR: &str = "idempotency_error";

/// Whether the body of a `409` says the key is in use (see the module docs).
pub(super) fn says_key_in_use(body: &[u8]) -> bool {
    let Ok(answer) = serde_json::from_slice::<Value>(body) else {
        return false;
    };
    let problem_type = answer.get("type").and_then(Value::as_str);
    let stripe_type = answer.pointer("/error/type").and_then(Value::as_str);
    problem_type == Some(IN_FLIGHT) || stripe_type == Some(STRIPE_IDEMPOTENCY_ERROR)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_are_told_from_business_answers() {
        let ours = format!(r#"{{"type":"{IN_FLIGHT}","status":409}}"#);
        assert!(says_key_in_use(ours.as_bytes()));
        assert!(says_key_in_use(
            br#"{"error":{"type":"idempotency_error","message":"in use"}}"#
        ));
        assert!(!says_key_in_use(br#"{"error":"order_exists"}"#));
        assert!(!says_key_in_use(
            br#"{"error":{"type":"card_error","code":"duplicate"}}"#
        ));
        assert!(!says_key_in_use(b"not json"));
    }
}
