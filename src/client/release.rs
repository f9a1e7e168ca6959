//! Answers that say an operation never started: released, not recorded.
//!
//! A client records the answer an operation got and replays it to every later run. That is
//! right for an outcome (`201`, a declined card, a business `409`), and wrong for an answer
//! that says the request was refused before anything ran: a `401` from a stale token, a
//! `429`, or an idempotency refusal such as the server face's `400 scope-missing`. Recorded,
//! such an answer would be replayed for the whole retention after the caller fixed its
//! credentials or waited out the limit, and the step could never succeed. Released, the
//! next run sends the operation again, which is safe: nothing of it ran.
//!
//! "Released" follows the ledger's sticky rule: an operation an earlier attempt may have
//! sent is never released, whatever a later attempt was told; it stays in doubt instead.

use http::header::CONTENT_TYPE;
use http::{HeaderMap, StatusCode};

use crate::server::problem;

/// Which answers say the operation never started (see
/// [`client::Builder::release_on`](crate::client::Builder::release_on)).
///
/// The default releases on `401`, `407` (authentication failed), `429` (the request was not
/// taken), and on problem responses (`application/problem+json`, RFC 9457) whose
/// `type` is one of this crate's server face's refusals that say nothing ran:
/// [`KEY_MISSING`](problem::KEY_MISSING), [`KEY_INVALID`](problem::KEY_INVALID),
/// [`SCOPE_MISSING`](problem::SCOPE_MISSING), [`PAYLOAD_MISMATCH`](problem::PAYLOAD_MISMATCH),
/// [`BODY_TOO_LARGE`](problem::BODY_TOO_LARGE), [`BODY_UNREADABLE`](problem::BODY_UNREADABLE),
/// [`CONTENT_DIGEST_MISMATCH`](problem::CONTENT_DIGEST_MISMATCH),
/// [`CONTENT_DIGEST_INVALID`](problem::CONTENT_DIGEST_INVALID),
/// [`LEDGER_UNAVAILABLE`](problem::LEDGER_UNAVAILABLE) and
/// [`LEDGER_FULL`](problem::LEDGER_FULL). Add your provider's own refusals by status or by
/// problem type.
///
/// Not `408`, though RFC 9110 defines it as a request the server did not wait to receive:
/// servers send it once the handler has started, too (tower-http's `TimeoutLayer`, axum's
/// `HandleErrorLayer` around a timeout), and the handler may then have acted. A `408` is
/// "try again", so it leaves the operation in doubt: resent with its key, reconciled, or
/// refused as in doubt when the provider ignores keys. Add it with
/// [`status`](Self::status) for a provider whose `408` always means nothing ran.
///
/// ```
/// use http::StatusCode;
/// use tower_idempotency::client::ReleaseOn;
///
/// // The defaults, plus a provider's own "idempotency key reused" problem type.
/// let rule = ReleaseOn::default().problem_type("https://api.example.com/problems/key-reused");
/// assert!(rule.releases_status(StatusCode::UNAUTHORIZED));
/// // Record every answer, as a final outcome or in doubt, and release none.
/// let never = ReleaseOn::nothing();
/// assert!(!never.releases_status(StatusCode::UNAUTHORIZED));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReleaseOn {
    statuses: Vec<StatusCode>,
    problem_types: Vec<String>,
}

/// Put on a response a transport got by following a redirect (reqwest does by default): its
/// status and body are the redirect's request's, and the operation's own request was
/// answered before it, so nothing in them says the operation never started.
#[derive(Clone, Copy, Debug)]
#[cfg_attr(not(feature = "reqwest"), allow(dead_code))]
pub(crate) struct AnsweredAfterRedirect;

/// This crate's server-face problem types that say the handler never ran.
const NOTHING_RAN: [&str; 10] = [
    problem::KEY_MISSING,
    problem::KEY_INVALID,
    problem::SCOPE_MISSING,
    problem::PAYLOAD_MISMATCH,
    problem::BODY_TOO_LARGE,
    problem::BODY_UNREADABLE,
    problem::CONTENT_DIGEST_MISMATCH,
    problem::CONTENT_DIGEST_INVALID,
    problem::LEDGER_UNAVAILABLE,
    problem::LEDGER_FULL,
];

impl Default for ReleaseOn {
    fn default() -> Self {
        Self {
            statuses: vec![
                StatusCode::UNAUTHORIZED,
                StatusCode::PROXY_AUTHENTICATION_REQUIRED,
                StatusCode::TOO_MANY_REQUESTS,
            ],
            problem_types: NOTHING_RAN.iter().map(|t| (*t).to_owned()).collect(),
        }
    }
}

impl ReleaseOn {
    /// Release on no answer: every answer is recorded (or left in doubt when it says
    /// "try again").
    ///
    /// ```
    /// # use tower_idempotency::client::ReleaseOn;
    /// assert!(!ReleaseOn::nothing().releases_status(http::StatusCode::TOO_MANY_REQUESTS));
    /// ```
    pub fn nothing() -> Self {
        Self {
            statuses: Vec::new(),
            problem_types: Vec::new(),
        }
    }

    /// Also release on `status`, whatever the body says.
    ///
    /// ```
    /// # use tower_idempotency::client::ReleaseOn;
    /// let rule = ReleaseOn::nothing().status(http::StatusCode::FORBIDDEN);
    /// assert!(rule.releases_status(http::StatusCode::FORBIDDEN));
    /// ```
    pub fn status(mut self, status: StatusCode) -> Self {
        self.statuses.push(status);
        self
    }

    /// Also release on a problem response (`application/problem+json`) whose `type` is
    /// `type_uri`. Only an error answer (`4xx`, `5xx`) is read for its type: RFC 9457
    /// problems describe errors, and an answer whose status says it succeeded is recorded
    /// as it stands, never released on its body's word.
    ///
    /// ```
    /// # use tower_idempotency::client::ReleaseOn;
    /// let rule = ReleaseOn::nothing().problem_type("https://api.example.com/problems/not-started");
    /// # let _ = rule;
    /// ```
    pub fn problem_type(mut self, type_uri: impl Into<String>) -> Self {
        self.problem_types.push(type_uri.into());
        self
    }

    /// Whether an answer with `status` is released on its status alone.
    ///
    /// ```
    /// # use tower_idempotency::client::ReleaseOn;
    /// assert!(ReleaseOn::default().releases_status(http::StatusCode::PROXY_AUTHENTICATION_REQUIRED));
    /// assert!(!ReleaseOn::default().releases_status(http::StatusCode::CREATED));
    /// ```
    pub fn releases_status(&self, status: StatusCode) -> bool {
        self.statuses.contains(&status)
    }

    /// Whether an answer with this status and these headers must be read to be judged: an
    /// error answer that is a problem response, while problem types are listed. The status
    /// is looked at first, so a successful answer (most answers) costs no header lookup.
    pub(crate) fn reads_problem(&self, status: StatusCode, headers: &HeaderMap) -> bool {
        (status.is_client_error() || status.is_server_error())
            && !self.problem_types.is_empty()
            && is_problem(headers)
    }

    /// Whether a problem response's body names one of the listed types.
    pub(crate) fn releases_problem(&self, body: &[u8]) -> bool {
        let Ok(problem) = serde_json::from_slice::<serde_json::Value>(body) else {
            return false;
        };
        problem
            .get("type")
            .and_then(serde_json::Value::as_str)
            .is_some_and(|kind| self.problem_types.iter().any(|listed| listed == kind))
    }
}

fn is_problem(headers: &HeaderMap) -> bool {
    const PROBLEM: &str = "application/problem+json";
    headers
        .get(CONTENT_TYPE)
        // Too short to name it (`application/json`, the common answer): nothing to parse.
        .filter(|value| value.len() >= PROBLEM.len())
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .is_some_and(|media| media.trim().eq_ignore_ascii_case(PROBLEM))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_listed_problem_types_are_released() {
        let rule = ReleaseOn::default();
        let mut headers = HeaderMap::new();
        headers.insert(
            CONTENT_TYPE,
            "application/problem+json; charset=utf-8".parse().unwrap(),
        );
        let bad_request = StatusCode::BAD_REQUEST;
        assert!(rule.reads_problem(bad_request, &headers));
        assert!(rule.reads_problem(StatusCode::SERVICE_UNAVAILABLE, &headers));
        // A success is what it says, whatever its body claims.
        assert!(!rule.reads_problem(StatusCode::OK, &headers));
        assert!(!rule.reads_problem(StatusCode::CREATED, &headers));
        let ours = format!("{{\"type\":\"{}\",\"status\":400}}", problem::SCOPE_MISSING);
        assert!(rule.releases_problem(ours.as_bytes()));
        let ran = format!("{{\"type\":\"{}\"}}", problem::OUTCOME_UNKNOWN);
        assert!(!rule.releases_problem(ran.as_bytes()));
        assert!(!rule.releases_problem(b"not json"));
        assert!(!ReleaseOn::nothing().reads_problem(bad_request, &headers));
        headers.insert(CONTENT_TYPE, "application/json".parse().unwrap());
        assert!(!rule.reads_problem(bad_request, &headers));
    }
}
