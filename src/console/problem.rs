//! Why a console request was not served, and the JSON responses the API answers with.

use axum::body::Body;
use axum::response::Response;
use http::header::{CACHE_CONTROL, CONTENT_TYPE, X_CONTENT_TYPE_OPTIONS};
use http::{HeaderValue, StatusCode};

use super::authorize::Refusal;
use crate::ledger::StoreError;

/// A request the console did not serve: its status, a stable code, the field at fault
/// (for malformed input), and a message for the operator.
#[derive(Debug)]
pub(crate) struct Failure {
    status: StatusCode,
    code: &'static str,
    field: Option<String>,
    message: String,
}

impl Failure {
    fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            field: None,
            message: message.into(),
        }
    }

    /// `field` of the request is malformed: `400`, naming it.
    pub(crate) fn bad_input(field: &str, message: &str) -> Self {
        // A hostile field name is cut short: it is echoed back.
        let field: String = field.chars().take(64).collect();
        Self {
            message: format!("{field}: {message}"),
            field: Some(field),
            ..Self::new(StatusCode::BAD_REQUEST, "bad_input", "")
        }
    }

    /// The authorizer refused the request.
    pub(crate) fn refused(refusal: Refusal) -> Self {
        Self::new(refusal.status(), "refused", refusal.message())
    }

    /// A read-only operator asked for an action.
    pub(crate) fn read_only() -> Self {
        Self::new(
            StatusCode::FORBIDDEN,
            "read_only",
            "your role is read-only: actions need an operator allowed to act",
        )
    }

    /// The browser says the request came from another site (`header` says so).
    pub(crate) fn cross_site(header: &str) -> Self {
        Self::new(
            StatusCode::FORBIDDEN,
            "cross_site",
            format!("{header}: an action must come from the console's own pages"),
        )
    }

    /// A form's CSRF token is missing or not this operator's.
    pub(crate) fn csrf() -> Self {
        Self {
            field: Some("csrf".to_owned()),
            ..Self::new(
                StatusCode::FORBIDDEN,
                "csrf",
                "csrf: the form's token is missing or not yours; reload the page and try again",
            )
        }
    }

    /// No record of the key.
    pub(crate) fn absent() -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "absent",
            "no record of this key (never made, forgotten, or past its retention): nothing changed",
        )
    }

    /// The body is not of the media type the route reads.
    pub(crate) fn media_type(expected: &str) -> Self {
        Self {
            field: Some("content-type".to_owned()),
            ..Self::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "media_type",
                format!("content-type: this action reads {expected}"),
            )
        }
    }

    /// The body is larger than any action's (or broke off before its end).
    pub(crate) fn too_large() -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            "the body is larger than an action's, or could not be read whole",
        )
    }

    /// The ledger did not answer.
    pub(crate) fn store(err: &StoreError) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "store",
            format!("the ledger did not answer, nothing is known to have changed: {err}"),
        )
    }

    pub(crate) fn status(&self) -> StatusCode {
        self.status
    }

    pub(crate) fn code(&self) -> &'static str {
        self.code
    }

    #[cfg(test)]
    pub(crate) fn field(&self) -> Option<&str> {
        self.field.as_deref()
    }

    pub(crate) fn message(&self) -> &str {
        &self.message
    }

    /// The API's answer: `{"error", "field"?, "message"}`.
    pub(crate) fn into_json(self) -> Response {
        let mut body = serde_json::json!({ "error": self.code, "message": self.message });
        if let Some(field) = self.field {
            body["field"] = field.into();
        }
        json(self.status, &body)
    }
}

/// A JSON response that no cache keeps: records change, and an operator must see them as
/// they are now.
pub(crate) fn json(status: StatusCode, body: &serde_json::Value) -> Response {
    let mut response = Response::new(Body::from(body.to_string()));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    response
}
