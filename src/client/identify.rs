//! Which ledger record a request belongs to.

use http::header::Entry;

use crate::idempotency::decision::WireKey;
use crate::key::{HeaderKey, OperationId, IDEMPOTENCY_KEY};
use crate::ledger::LedgerKey;
use crate::Error;

use super::face::ClientFace;
/// Which ledger record a request belongs to, setting the header a derived key travels in.
///
/// A caller's own `Idempotency-Key` names an operation **at its target**: the same key sent
/// to two hosts is two operations, and one's record never answers the other. An
/// [`OperationId`] names one operation, wherever it is sent: sent to another target (or
/// with another method, path or body) it is a drift, never a replay of the first target's
/// answer, since the fingerprint covers the whole target.
pub(super) fn identify(
    client: &ClientFace,
    parts: &mut http::request::Parts,
) -> Result<Option<(LedgerKey, WireKey)>, Error> {
    // An operation's key is derived before its header is looked up, so that one lookup
    // finds the key sent (which wins) or makes the derived key's place.
    let derived = parts
        .extensions
        .get::<OperationId>()
        .map(|op| op.key(&client.scope));
    let sent = match derived {
        Some(key) => match parts.headers.entry(&IDEMPOTENCY_KEY) {
            Entry::Occupied(sent) => HeaderKey::from_values(sent.iter()),
            Entry::Vacant(place) => {
                place.insert(key.header_value());
                return Ok(Some((LedgerKey::for_operation(key), WireKey::Derived(key))));
            }
        },
        None => HeaderKey::from_headers(&parts.headers),
    };
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
