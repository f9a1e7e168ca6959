//! The problem types of the server [`IdempotencyLayer`](crate::IdempotencyLayer): every
//! answer it gives in place of the handler's is an RFC 9457 `application/problem+json` body.
//!
//! Each body carries `type`, `title`, `status` and `detail`; some add a member named
//! below. The `type` URIs are **API**: they never change between releases, so compare them
//! as strings (the constants in this module). Each one is this page with a fragment naming
//! the case, so dereferencing it leads to the documentation of that case. `title` and
//! `detail` are for people and may change.
//!
//! ```json
//! {
//!   "type": "https://docs.rs/tower-idempotency/latest/tower_idempotency/server/problem/index.html#in-flight",
//!   "title": "A request with this Idempotency-Key is in progress",
//!   "status": 409,
//!   "detail": "retry after the time in the Retry-After header"
//! }
//! ```
//!
//! | status | fragment | constant |
//! |---|---|---|
//! | 400 | `#key-missing` | [`KEY_MISSING`] |
//! | 400 | `#key-invalid` | [`KEY_INVALID`] |
//! | 400 | `#body-unreadable` | [`BODY_UNREADABLE`] |
//! | 413 | `#body-too-large` | [`BODY_TOO_LARGE`] |
//! | 409 | `#in-flight` | [`IN_FLIGHT`] |
//! | 422 | `#payload-mismatch` | [`PAYLOAD_MISMATCH`] |
//! | 410 | `#response-not-recorded` | [`RESPONSE_NOT_RECORDED`] |
//! | 500 | `#outcome-unknown` | [`OUTCOME_UNKNOWN`] |
//! | 503 | `#ledger-unavailable` | [`LEDGER_UNAVAILABLE`] |
//! | 503 | `#ledger-full` | [`LEDGER_FULL`] |
//! | 400 | `#scope-missing` | [`SCOPE_MISSING`] |
//! | 400 | `#content-digest-mismatch` | [`CONTENT_DIGEST_MISMATCH`] |
//! | 400 | `#content-digest-invalid` | [`CONTENT_DIGEST_INVALID`] |
//! | 503 | `#commit-unknown` | [`COMMIT_UNKNOWN`] |
//!
//! # key-missing
//!
//! **400.** A side-effecting request (by default `POST` or `PATCH`) carried no
//! `Idempotency-Key` header and the layer requires one. The handler was not called and the
//! ledger was not touched. Send the request again with a key.
//!
//! # key-invalid
//!
//! **400.** The `Idempotency-Key` header is malformed: empty, longer than 255 characters,
//! holding a byte that is not visible ASCII (a space, a control character, non-ASCII), an
//! invalid RFC 8941 string (an opening `"` without its closing one, an escape other than
//! `\"` and `\\`), a bare (unquoted) value holding a delimiter such as `,` (it is not one
//! key: `a,b` is what a proxy makes of two `Idempotency-Key` lines; quote a key holding
//! one), or the header appears more than once. The member `reason` names which: `empty`,
//! `too-long`, `invalid-character`, `bad-sf-string`, `not-a-token` or `repeated`. The
//! handler was not called and the ledger was not touched.
//!
//! # body-unreadable
//!
//! **400.** Reading the request body failed (the client broke off the upload). No lease
//! was taken.
//!
//! # body-too-large
//!
//! **413.** The request body is over the layer's body limit (1 MiB by default), as
//! declared by `Content-Length` or found while reading it. The member `limit` holds the
//! limit in bytes. Refused before any lease is taken: the key stays unused.
//!
//! # in-flight
//!
//! **409**, with `Retry-After`. An earlier request with this key is still being handled.
//! Retry after the delay; you then get its recorded response.
//!
//! # payload-mismatch
//!
//! **422.** This key was first used with a different request: another method, path and
//! query, or body. The member `differs` names which of them, from `"method"`, `"target"`
//! and `"body"` (a body reformatted, say, is `["body"]`; a record written by an older
//! fingerprint derivation names all three). A key names one request; use a new key for a
//! new request. The stored outcome is not disclosed, nor anything of the first request but
//! which parts differ (and only within the key's scope).
//!
//! # response-not-recorded
//!
//! **410.** The request with this key was handled, but only a tombstone of it was kept:
//! its response was larger than the layer's recording cap, or the ledger had no room for
//! it when it completed (a `MemoryStore` at its budget). The first caller received the
//! whole response; it cannot be replayed and the request is **not** run again. The member
//! `original_status` holds the status the first caller received. 410 rather than a 5xx
//! because the condition is permanent: retrying cannot help, and a 4xx stops clients'
//! automatic retries. Look the result up through the API instead.
//!
//! # outcome-unknown
//!
//! **500.** An earlier request with this key started but never finished: its handler
//! panicked, was cancelled, or ran past its lease, or its response body failed. The layer
//! cannot know whether the side effect happened, and under the default
//! [`InDoubtPolicy::OutcomeUnknown`](crate::InDoubtPolicy::OutcomeUnknown) it will not run
//! the handler again (at most once). Every later request with this key gets this answer
//! until the record's retention ends. Look the result up through the API before acting
//! again under a new key.
//!
//! # ledger-unavailable
//!
//! **503**, with `Retry-After`. The idempotency ledger could not be reached (or failed), so
//! the layer cannot tell whether this request already ran; it fails closed and the handler
//! is not called. Retry later with the same key. (When the layer is built with
//! [`fail_open`](crate::server::Builder::fail_open), the handler runs instead and
//! its response carries `Idempotency-Fail-Open: true`.)
//!
//! # ledger-full
//!
//! **503**, with `Retry-After`. The ledger's memory budget is full of records it must not
//! forget (operations still open, or completed inside their protected window), so it
//! refuses new keys rather than evict an outcome a retry may still need. The handler was
//! not called. Retry later with the same key; operators should give the store a larger
//! budget (see [`MemoryStore`](crate::ledger::MemoryStore)).
//!
//! **503 without `Retry-After`** when the request is heavier than the ledger's whole
//! budget: it can never fit, and the `detail` says so. Retrying will not help; operators
//! should make the budget larger than the layer's body limit.
//!
//! # scope-missing
//!
//! **400.** A keyed request carried no `Authorization` header, and the layer scopes keys by
//! it (its default): without a principal, the key would land in a scope shared by every
//! anonymous caller, where one caller could be served another's recorded response. The
//! handler was not called and the ledger was not touched. Send the request with your
//! credentials; operators whose callers authenticate otherwise (cookies, mTLS, API-key
//! headers) give the layer a [scope function](crate::server::Builder::scope).
//!
//! # content-digest-mismatch
//!
//! **400.** The request's `Content-Digest` (RFC 9530) has a `sha-256` or `sha-512` member
//! that does not match the body received: the bytes changed on the way, or the sender
//! computed the digest over other bytes. The member `algorithm` names the one that did not
//! match. The handler was not called and the ledger was not touched, so the key stays
//! unused: send the request again, with its own digest.
//!
//! # content-digest-invalid
//!
//! **400.** The request's `Content-Digest` is not a structured-field dictionary, or its
//! `sha-256` or `sha-512` member is not a byte sequence of that algorithm's length.
//! Members of other algorithms are ignored, never refused. The handler was not called and
//! the ledger was not touched.
//!
//! # commit-unknown
//!
//! **503**, with `Retry-After`. Only in the
//! [transactional mode](crate::IdempotencyLayer::transactional_server_builder): the handler
//! ran, and the transaction holding its writes and its recorded response was sent its
//! `COMMIT`, but the answer was lost (the connection to the database failed, or the
//! database did not answer in time). The request **may have been handled**. Retry with the
//! same key: if the commit landed you get the recorded response, and if it did not, the
//! request runs again (nothing of the first attempt was kept). Never retry under a new key.

use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE, RETRY_AFTER};
use http::{Method, Response, StatusCode};
use serde_json::Value;

use crate::digest::DigestError;
use crate::fingerprint::RequestPart;
use crate::idempotency::ResponseBody;
use crate::key::{InvalidKey, MAX_KEY_LEN};

macro_rules! problem_types {
    ($($(#[$doc:meta])* $name:ident = $fragment:literal;)*) => {
        $(
            $(#[$doc])*
            pub const $name: &str = concat!(
                "https://docs.rs/tower-idempotency/latest/tower_idempotency/server/problem/index.html#",
                $fragment
            );
        )*
    };
}

problem_types! {
    /// 400: a side-effecting request without an `Idempotency-Key` ([docs](self#key-missing)).
    ///
    /// ```
    /// assert!(tower_idempotency::server::problem::KEY_MISSING.ends_with("#key-missing"));
    /// ```
    KEY_MISSING = "key-missing";
    /// 400: a malformed or repeated `Idempotency-Key` ([docs](self#key-invalid)).
    KEY_INVALID = "key-invalid";
    /// 400: the request body could not be read ([docs](self#body-unreadable)).
    BODY_UNREADABLE = "body-unreadable";
    /// 413: the request body is over the limit ([docs](self#body-too-large)).
    BODY_TOO_LARGE = "body-too-large";
    /// 409: a request with this key is in progress ([docs](self#in-flight)).
    IN_FLIGHT = "in-flight";
    /// 422: the key was first used with a different request ([docs](self#payload-mismatch)).
    PAYLOAD_MISMATCH = "payload-mismatch";
    /// 410: handled, but the response was not recorded ([docs](self#response-not-recorded)).
    RESPONSE_NOT_RECORDED = "response-not-recorded";
    /// 500: an earlier attempt started and never finished ([docs](self#outcome-unknown)).
    OUTCOME_UNKNOWN = "outcome-unknown";
    /// 503: the ledger is unavailable; nothing ran ([docs](self#ledger-unavailable)).
    LEDGER_UNAVAILABLE = "ledger-unavailable";
    /// 503: the ledger is full of records it must keep; nothing ran ([docs](self#ledger-full)).
    LEDGER_FULL = "ledger-full";
    /// 400: a keyed request without a principal to scope its key ([docs](self#scope-missing)).
    SCOPE_MISSING = "scope-missing";
    /// 400: the `Content-Digest` does not match the body ([docs](self#content-digest-mismatch)).
    CONTENT_DIGEST_MISMATCH = "content-digest-mismatch";
    /// 400: the `Content-Digest` is malformed ([docs](self#content-digest-invalid)).
    CONTENT_DIGEST_INVALID = "content-digest-invalid";
    /// 503: the request's commit was sent and not answered; it may have been handled
    /// ([docs](self#commit-unknown)).
    COMMIT_UNKNOWN = "commit-unknown";
}

/// The media type of every problem body.
pub(crate) const PROBLEM_JSON: &str = "application/problem+json";

/// A problem response: the fixed members, in RFC 9457's order, then any extra one.
fn problem<T>(
    status: StatusCode,
    kind: &'static str,
    title: &str,
    detail: String,
    extra: Option<(&str, Value)>,
) -> Response<ResponseBody<T>> {
    problem_with_body(status, problem_body(status, kind, title, detail, extra))
}

/// The `application/problem+json` body of a [`problem`].
fn problem_body(
    status: StatusCode,
    kind: &'static str,
    title: &str,
    detail: String,
    extra: Option<(&str, Value)>,
) -> Bytes {
    let mut members = vec![
        ("type", Value::from(kind)),
        ("title", Value::from(title)),
        ("status", Value::from(status.as_u16())),
        ("detail", Value::from(detail)),
    ];
    members.extend(extra);
    // Written by hand rather than through a `serde_json::Map`, which would sort the members.
    let mut json = String::from("{");
    for (i, (name, value)) in members.iter().enumerate() {
        if i > 0 {
            json.push(',');
        }
        json.push_str(&Value::from(*name).to_string());
        json.push(':');
        json.push_str(&value.to_string());
    }
    json.push('}');
    Bytes::from(json)
}

/// A problem response of `status` with a body made by [`problem_body`].
fn problem_with_body<T>(status: StatusCode, body: Bytes) -> Response<ResponseBody<T>> {
    let mut response = Response::new(ResponseBody::buffered(body));
    *response.status_mut() = status;
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
    response
}

fn with_retry_after<T>(
    mut response: Response<ResponseBody<T>>,
    after: Duration,
) -> Response<ResponseBody<T>> {
    response
        .headers_mut()
        .insert(RETRY_AFTER, retry_after_value(after));
    response
}

/// Whole seconds, rounded up and at least 1: `Retry-After: 0` would invite a busy loop.
pub(crate) fn retry_after_value(after: Duration) -> HeaderValue {
    // Up, never down: `Retry-After` counts whole seconds, and a client sent back before the
    // owner's lease ends only meets the same `409` again. `0` would invite a tight loop.
    let mut secs = after.as_secs();
    if after.subsec_nanos() > 0 || secs == 0 {
        // Saturating: a `retry_after(Duration::MAX)` the builder accepted must not panic.
        secs = secs.saturating_add(1);
    }
    HeaderValue::from(secs)
}

fn member(name: &str, value: impl Into<Value>) -> Option<(&str, Value)> {
    Some((name, value.into()))
}

pub(crate) fn key_missing<T>(method: &Method) -> Response<ResponseBody<T>> {
    problem(
        StatusCode::BAD_REQUEST,
        KEY_MISSING,
        "Idempotency-Key required",
        format!("{method} requests to this endpoint need an Idempotency-Key header"),
        None,
    )
}

pub(crate) fn key_invalid<T>(err: &InvalidKey) -> Response<ResponseBody<T>> {
    let reason = match err {
        InvalidKey::Empty => "empty",
        InvalidKey::TooLong { .. } => "too-long",
        InvalidKey::InvalidCharacter { .. } => "invalid-character",
        InvalidKey::BadSfString => "bad-sf-string",
        InvalidKey::NotAToken { .. } => "not-a-token",
        InvalidKey::Repeated => "repeated",
        // A reason added to `InvalidKey` later is still a malformed key.
        #[allow(unreachable_patterns)]
        _ => "malformed",
    };
    problem(
        StatusCode::BAD_REQUEST,
        KEY_INVALID,
        "Invalid Idempotency-Key",
        format!("{err}; send one Idempotency-Key of 1 to {MAX_KEY_LEN} visible ASCII characters, as an RFC 8941 string or a bare token"),
        member("reason", reason),
    )
}

pub(crate) fn body_unreadable<T>() -> Response<ResponseBody<T>> {
    problem(
        StatusCode::BAD_REQUEST,
        BODY_UNREADABLE,
        "Request body could not be read",
        "reading the request body failed; nothing was done".to_owned(),
        None,
    )
}

pub(crate) fn body_too_large<T>(limit: usize) -> Response<ResponseBody<T>> {
    problem(
        StatusCode::PAYLOAD_TOO_LARGE,
        BODY_TOO_LARGE,
        "Request body too large",
        format!("the request body is over the {limit}-byte limit; nothing was done"),
        member("limit", limit),
    )
}

pub(crate) fn in_flight<T>(retry_after: Duration) -> Response<ResponseBody<T>> {
    let response = problem(
        StatusCode::CONFLICT,
        IN_FLIGHT,
        "A request with this Idempotency-Key is in progress",
        "retry after the time in the Retry-After header to get its response".to_owned(),
        None,
    );
    with_retry_after(response, retry_after)
}

/// `differs`: the parts of the request that differ from the one first sent with the key.
pub(crate) fn payload_mismatch<T>(differs: &[RequestPart]) -> Response<ResponseBody<T>> {
    let named: Vec<&str> = differs.iter().map(RequestPart::as_str).collect();
    let detail = match named.as_slice() {
        [] => "this Idempotency-Key was first used with another request".to_owned(),
        [one] => format!("this Idempotency-Key was first used with another {one}"),
        [init @ .., last] => format!(
            "this Idempotency-Key was first used with another {} and {last}",
            init.join(", ")
        ),
    };
    problem(
        StatusCode::UNPROCESSABLE_ENTITY,
        PAYLOAD_MISMATCH,
        "Idempotency-Key reused with a different request",
        format!("{detail}; use a new key for a new request"),
        member("differs", named),
    )
}

pub(crate) fn response_not_recorded<T>(original: StatusCode) -> Response<ResponseBody<T>> {
    problem(
        StatusCode::GONE,
        RESPONSE_NOT_RECORDED,
        "Response not recorded",
        "the request with this Idempotency-Key was handled, but its response was not kept (over the recording cap, or no room in the ledger when it completed); it is not run again"
            .to_owned(),
        member("original_status", original.as_u16()),
    )
}

pub(crate) fn outcome_unknown<T>() -> Response<ResponseBody<T>> {
    problem(
        StatusCode::INTERNAL_SERVER_ERROR,
        OUTCOME_UNKNOWN,
        "Outcome of an earlier attempt unknown",
        "an earlier request with this Idempotency-Key started but did not finish; it is not run again. Check its effect before retrying under a new key"
            .to_owned(),
        None,
    )
}

pub(crate) fn ledger_unavailable<T>(retry_after: Duration) -> Response<ResponseBody<T>> {
    let response = problem(
        StatusCode::SERVICE_UNAVAILABLE,
        LEDGER_UNAVAILABLE,
        "Idempotency ledger unavailable",
        "the request was not handled because its Idempotency-Key could not be checked; retry later with the same key"
            .to_owned(),
        None,
    );
    with_retry_after(response, retry_after)
}

/// The transactional mode's commit was sent and not answered (see [`COMMIT_UNKNOWN`]).
#[cfg(feature = "postgres")]
pub(crate) fn commit_unknown<T>(retry_after: Duration) -> Response<ResponseBody<T>> {
    let response = problem(
        StatusCode::SERVICE_UNAVAILABLE,
        COMMIT_UNKNOWN,
        "Outcome of the request's commit unknown",
        "the request was handled, but the answer to its commit was lost: it may have taken effect. Retry later with the same key: you get its recorded response if it did, or it runs again if it did not"
            .to_owned(),
        None,
    );
    with_retry_after(response, retry_after)
}

pub(crate) fn ledger_full<T>(retry_after: Duration) -> Response<ResponseBody<T>> {
    // A flood of new keys against a full ledger is answered with this alone, so it must
    // cost no more than serving one: the body is the same every time, written once.
    static BODY: std::sync::OnceLock<Bytes> = std::sync::OnceLock::new();
    let status = StatusCode::SERVICE_UNAVAILABLE;
    let body = BODY.get_or_init(|| {
        problem_body(
            status,
            LEDGER_FULL,
            "Idempotency ledger full",
            "the request was not handled because the idempotency ledger has no room for a new key; retry later with the same key"
                .to_owned(),
            None,
        )
    });
    with_retry_after(problem_with_body(status, body.clone()), retry_after)
}

/// `ledger-full` for a request the ledger can never hold: no `Retry-After`, since no wait
/// makes room for it.
pub(crate) fn ledger_never_fits<T>() -> Response<ResponseBody<T>> {
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        LEDGER_FULL,
        "Idempotency ledger full",
        "the request was not handled because it is heavier than the idempotency ledger's whole budget: it can never fit, and retrying will not help"
            .to_owned(),
        None,
    )
}

pub(crate) fn scope_missing<T>() -> Response<ResponseBody<T>> {
    problem(
        StatusCode::BAD_REQUEST,
        SCOPE_MISSING,
        "Credentials required with an Idempotency-Key",
        "keys are scoped by the Authorization header and this request has none; send your credentials"
            .to_owned(),
        None,
    )
}

pub(crate) fn content_digest<T>(err: &DigestError) -> Response<ResponseBody<T>> {
    match err.algorithm() {
        Some(algorithm) => problem(
            StatusCode::BAD_REQUEST,
            CONTENT_DIGEST_MISMATCH,
            "Content-Digest does not match the body",
            format!("the {algorithm} digest in Content-Digest is not the digest of the body received; nothing was done"),
            member("algorithm", algorithm),
        ),
        None => problem(
            StatusCode::BAD_REQUEST,
            CONTENT_DIGEST_INVALID,
            "Malformed Content-Digest",
            "Content-Digest must be a dictionary of byte sequences (RFC 9530); nothing was done"
                .to_owned(),
            None,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        assert_eq!(retry_after_value(Duration::ZERO), "1");
        assert_eq!(retry_after_value(Duration::from_millis(200)), "1");
        assert_eq!(retry_after_value(Duration::from_secs(2)), "2");
        assert_eq!(retry_after_value(Duration::from_millis(2001)), "3");
    }

    #[tokio::test]
    async fn problems_are_rfc_9457_json() {
        let response = body_too_large::<http_body_util::Full<Bytes>>(10);
        assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(response.headers()[CONTENT_TYPE], PROBLEM_JSON);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let json: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["type"], BODY_TOO_LARGE);
        assert_eq!(json["status"], 413);
        assert_eq!(json["limit"], 10);
        assert!(json["title"].is_string() && json["detail"].is_string());
        let text = String::from_utf8(body.to_vec()).unwrap();
        assert!(text.starts_with(r#"{"type":"https://"#), "{text}");
    }

    #[test]
    fn type_uris_are_stable() {
        // These strings are API: changing one breaks every client that matches on it.
        assert_eq!(
            KEY_MISSING,
            "https://docs.rs/tower-idempotency/latest/tower_idempotency/server/problem/index.html#key-missing"
        );
        for (uri, fragment) in [
            (KEY_INVALID, "key-invalid"),
            (BODY_UNREADABLE, "body-unreadable"),
            (BODY_TOO_LARGE, "body-too-large"),
            (IN_FLIGHT, "in-flight"),
            (PAYLOAD_MISMATCH, "payload-mismatch"),
            (RESPONSE_NOT_RECORDED, "response-not-recorded"),
            (OUTCOME_UNKNOWN, "outcome-unknown"),
            (LEDGER_UNAVAILABLE, "ledger-unavailable"),
            (CONTENT_DIGEST_MISMATCH, "content-digest-mismatch"),
            (CONTENT_DIGEST_INVALID, "content-digest-invalid"),
            (COMMIT_UNKNOWN, "commit-unknown"),
        ] {
            assert_eq!(uri.rsplit_once('#').unwrap().1, fragment);
            assert_eq!(
                uri.rsplit_once('#').unwrap().0,
                KEY_MISSING.rsplit_once('#').unwrap().0
            );
        }
    }
}
