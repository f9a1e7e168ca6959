//! The responses the double answers with, and reading a lookup's key.

use bytes::Bytes;
use http::header::{HeaderValue, CONTENT_TYPE};
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;

use super::LOOKUP_PATH;
use crate::key::hex;

/// The body of a commit's `201`, fields in a fixed order so tests can compare bytes.
pub(super) fn effect_body(effect_id: usize, key: Option<&str>, body_sha256: &[u8; 32]) -> Bytes {
    // serde_json escapes the key: a key may hold `"` or `\`.
    let key = serde_json::to_string(&key).expect("a string or null serializes");
    Bytes::from(format!(
        r#"{{"effect_id":"eff_{effect_id}","key":{key},"body_sha256":"{}"}}"#,
        hex(body_sha256)
    ))
}

/// The key a lookup asks about, if `req` is one (`GET /effects?idempotency_key=…`).
pub(super) fn lookup_key<B>(req: &Request<B>) -> Option<String> {
    if req.method() != Method::GET || req.uri().path() != LOOKUP_PATH {
        return None;
    }
    let query = req.uri().query().unwrap_or("");
    let encoded = query
        .split('&')
        .find_map(|pair| pair.strip_prefix("idempotency_key="))
        .unwrap_or("");
    Some(percent_decode(encoded))
}

pub(super) fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = (bytes[i] == b'%')
            .then(|| text.get(i + 1..i + 3))
            .flatten()
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escaped {
            Some(byte) => {
                out.push(byte);
                i += 3;
            }
            None => {
                out.push(if bytes[i] == b'+' { b' ' } else { bytes[i] });
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub(super) fn created(body: Bytes) -> Response<Full<Bytes>> {
    json_response(StatusCode::CREATED, body)
}

pub(super) fn injected_error(status: StatusCode) -> Response<Full<Bytes>> {
    json_error(
        status,
        "injected_fault",
        "SideEffectService: injected Fault::ServerError",
    )
}

/// Stripe's answer to a request whose key another request is still using.
pub(super) fn key_in_use() -> Response<Full<Bytes>> {
    let body = serde_json::json!({
        "error": {
            "type": "idempotency_error",
            "message": "There is currently another in-progress request using this idempotency key.",
        }
    });
    json_response(StatusCode::CONFLICT, Bytes::from(body.to_string()))
}

pub(super) fn json_error(status: StatusCode, error: &str, message: &str) -> Response<Full<Bytes>> {
    let body = serde_json::json!({ "error": error, "message": message }).to_string();
    json_response(status, Bytes::from(body))
}

pub(super) fn json_response(status: StatusCode, body: Bytes) -> Response<Full<Bytes>> {
    let mut res = Response::new(Full::new(body));
    *res.status_mut() = status;
    res.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    res
}
