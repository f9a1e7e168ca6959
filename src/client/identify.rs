//! Which ledger record a request belongs to.

use crate::idempotency::decision::WireKey;
use crate::key::{HeaderKey, OperationId};
use crate::ledger::LedgerKey;
use crate::Error;

use super::face::ClientFace;
/// Which ledger record a request belongs to. A derived key's header is added when the
/// request is frozen, with its `Content-Digest` (see [`Adding`](crate::frozen::Adding)).
///
/// A caller's own `Idempotency-Key` names an operation **at its target**: the same key sent
/// to two hosts is two operations, and one's record never answers the other. An
/// [`OperationId`] names one operation, wherever it is sent: sent to another target (or
/// with another method, path or body) it is a drift, never a replay of the first target's
/// answer, since the fingerprint covers the whole target.
pub(super) fn identify(
    client: &ClientFace,
    parts: &http::request::Parts,
) -> Result<Option<(LedgerKey, WireKey)>, Error> {
    // A key the caller sent wins over one derived from an `OperationId`.
    let sent = HeaderKey::from_headers(&parts.headers);
    if matches!(sent, Ok(None)) {
        if let Some(op) = parts.extensions.get::<OperationId>() {
            let key = op.key(&client.scope);
            return Ok(Some((LedgerKey::for_operation(key), WireKey::Derived(key))));
        }
    }
    if let Some(key) = sent.map_err(Error::from_invalid_key)? {
        // A caller's own key is the caller's principal's: kept under it, so that another
        // principal's record with the same key never answers this request.
        let principal = client
            .caller_keys
            .of(parts)
            .ok_or_else(Error::missing_scope)?;
        let uri = &parts.uri;
        let ledger_key = LedgerKey::client_header_of(
            &client.scope,
            &principal,
            uri.scheme_str().unwrap_or(""),
            uri.authority().map_or("", |a| a.as_str()),
            key.as_bytes(),
        );
        return Ok(Some((ledger_key, WireKey::Header(key))));
    }
    if client.require_key {
        return Err(Error::missing_key());
    }
    Ok(None)
}
