//! Which ledger record a request belongs to.

use crate::idempotency::decision::WireKey;
use crate::key::OperationId;
use crate::ledger::LedgerKey;
use crate::Error;

use super::face::ClientFace;
/// Which ledger record a request belongs to. A derived key's header is added when the
/// request is frozen, with its `Content-Digest` (see [`Adding`](crate::frozen::Adding)).
/// A caller's own key is read from the header the provider reads it from
/// ([`KeyHeader`](crate::key::KeyHeader)), in either form.
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
    let sent = client.key_header.read(&parts.headers);
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
        let scheme = uri.scheme_str().unwrap_or("");
        let ledger_key = LedgerKey::client_header_of(
            &client.scope,
            &principal,
            &scheme.to_ascii_lowercase(),
            &origin_authority(scheme, uri.authority()),
            key.as_bytes(),
        );
        return Ok(Some((ledger_key, WireKey::Header(key))));
    }
    if client.require_key {
        return Err(Error::missing_key());
    }
    Ok(None)
}

/// The authority a caller's key is kept under, as one origin spells it whichever way it
/// was written (RFC 3986 §6.2.2–6.2.3): the host in lower case, the port as a number and
/// left out when it is the scheme's default or empty, no user information (an origin has
/// none). So `https://PAY.example`, `https://pay.example:443` and `https://u@pay.example:`
/// are one target, as they are one server.
fn origin_authority<'a>(
    scheme: &str,
    authority: Option<&'a http::uri::Authority>,
) -> std::borrow::Cow<'a, str> {
    let Some(authority) = authority else {
        return "".into();
    };
    let default_port = match scheme.to_ascii_lowercase().as_str() {
        "http" => Some(80),
        "https" => Some(443),
        _ => None,
    };
    let port = authority
        .port_u16()
        .filter(|port| Some(*port) != default_port);
    let host = authority.host();
    // Written as it would be rebuilt: no copy.
    if port.is_none()
        && authority.as_str() == host
        && !host.bytes().any(|byte| byte.is_ascii_uppercase())
    {
        return host.into();
    }
    let host = host.to_ascii_lowercase();
    match port {
        Some(port) => format!("{host}:{port}").into(),
        None => host.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::origin_authority;

    fn origin(uri: &str) -> String {
        let uri: http::Uri = uri.parse().unwrap();
        origin_authority(uri.scheme_str().unwrap_or(""), uri.authority()).into_owned()
    }

    #[test]
    fn one_origin_however_it_is_spelled() {
        for spelled in [
            "https://pay.example/charges",
            "https://PAY.Example/charges",
            "https://pay.example:443/charges",
            "HTTPS://pay.EXAMPLE:443/charges",
        ] {
            assert_eq!(origin(spelled), "pay.example", "{spelled}");
        }
        assert_eq!(origin("http://pay.example:80/"), "pay.example");
        // Another port is another server; so is another scheme's default.
        assert_eq!(origin("https://pay.example:8443/"), "pay.example:8443");
        assert_eq!(origin("http://pay.example:443/"), "pay.example:443");
        assert_eq!(origin("https://[::1]:443/"), "[::1]");
        assert_eq!(origin("https://user@Pay.example/"), "pay.example");
        assert_eq!(origin("https://pay.example:/"), "pay.example");
        assert_eq!(origin("https://pay.example:08443/"), "pay.example:8443");
        assert_eq!(origin("/charges"), "");
    }
}
