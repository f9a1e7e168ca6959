//! Where a `tools/call` carries its key: `_meta["idempotency-key"]`, and the
//! `Idempotency-Key` header of the HTTP request that brought it (Streamable HTTP).

use http::HeaderValue;
use rmcp::service::RequestContext;
use rmcp::RoleServer;

use crate::key::{HeaderKey, InvalidKey, KeyHeader};
use crate::mcp::META_KEY;

/// Why a call's key was refused, before the ledger.
#[derive(Debug)]
pub(super) enum KeyRefusal {
    /// Malformed, in `_meta` or in the header (the server face's reasons).
    Invalid(InvalidKey),
    /// `_meta["idempotency-key"]` is not a JSON string.
    NotAString,
    /// The `_meta` key and the header's name two different keys: which one the client
    /// meant cannot be guessed, and either guess could replay another call's answer.
    Conflict,
}

/// A call's key: as the client chose it, and as the `Idempotency-Key` header value the
/// server face reads (an RFC 8941 sf-string).
#[derive(Debug)]
pub(super) struct CallKey {
    pub(super) text: String,
    pub(super) header: HeaderValue,
}

/// The call's key, or `None` for a keyless call.
pub(super) fn read(context: &RequestContext<RoleServer>) -> Result<Option<CallKey>, KeyRefusal> {
    let in_meta = match context.meta.0 .0.get(META_KEY) {
        None => None,
        Some(serde_json::Value::String(key)) => Some(key.as_str()),
        Some(_) => return Err(KeyRefusal::NotAString),
    };
    let in_header = match context.extensions.get::<http::request::Parts>() {
        Some(parts) => HeaderKey::from_headers(&parts.headers).map_err(KeyRefusal::Invalid)?,
        None => None,
    };
    match (in_meta, in_header) {
        (None, None) => Ok(None),
        (Some(key), None) => spell(key).map(Some),
        (None, Some(header)) => spell(header.as_str()).map(Some),
        (Some(key), Some(header)) if key == header.as_str() => spell(key).map(Some),
        (Some(_), Some(_)) => Err(KeyRefusal::Conflict),
    }
}

/// `key` as the server face's header spells it, refused as the header would be.
fn spell(key: &str) -> Result<CallKey, KeyRefusal> {
    let header = KeyHeader::ietf().spell(key).map_err(KeyRefusal::Invalid)?;
    Ok(CallKey {
        text: key.to_owned(),
        header,
    })
}
