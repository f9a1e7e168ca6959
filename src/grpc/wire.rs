//! What the gRPC layers read and write on the wire: status codes, `grpc-timeout`,
//! `grpc-retry-pushback-ms`, `grpc-previous-rpc-attempts`.

use std::time::Duration;

use http::{HeaderMap, HeaderValue, StatusCode};
use tonic::Code;

/// The header a status travels under: in the trailers, or in the headers of a
/// trailers-only answer.
pub(crate) const GRPC_STATUS: &str = "grpc-status";
/// The deadline a client gives a call (gRPC over HTTP/2, "Timeout").
pub(crate) const GRPC_TIMEOUT: &str = "grpc-timeout";
/// gRFC A6: how long the server asks the client to wait before retrying (negative or
/// malformed: do not retry).
pub(crate) const RETRY_PUSHBACK: &str = "grpc-retry-pushback-ms";
/// gRFC A6: how many attempts came before this one.
pub(crate) const PREVIOUS_ATTEMPTS: &str = "grpc-previous-rpc-attempts";

/// The status of an answer whose headers say it: a trailers-only answer (its `grpc-status`
/// in the headers), or an HTTP error from something that is not a gRPC server (a proxy's
/// `503`), mapped as gRPC's HTTP-to-gRPC table maps it. `None`: a gRPC answer whose status
/// will come in its trailers.
pub(crate) fn status_in_head(status: StatusCode, headers: &HeaderMap) -> Option<Code> {
    if let Some(code) = headers.get(GRPC_STATUS) {
        return Some(Code::from_bytes(code.as_bytes()));
    }
    (status != StatusCode::OK).then(|| code_of_http_status(status))
}

/// gRPC's "HTTP to gRPC Status Code Mapping", for answers that carry no `grpc-status`.
pub(crate) fn code_of_http_status(status: StatusCode) -> Code {
    match status.as_u16() {
        400 => Code::Internal,
        401 => Code::Unauthenticated,
        403 => Code::PermissionDenied,
        404 => Code::Unimplemented,
        429 | 502 | 503 | 504 => Code::Unavailable,
        _ => Code::Unknown,
    }
}

/// What a server's `grpc-retry-pushback-ms` asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pushback {
    /// No pushback: the client's own backoff decides.
    Absent,
    /// Retry after exactly this long.
    After(Duration),
    /// Do not retry (a negative or malformed value, as gRFC A6 reads it).
    Refused,
}

/// The pushback in `headers` (the trailers of an answer, or the headers of a trailers-only
/// one).
pub(crate) fn pushback(headers: &HeaderMap) -> Pushback {
    let Some(value) = headers.get(RETRY_PUSHBACK) else {
        return Pushback::Absent;
    };
    match value
        .to_str()
        .ok()
        .and_then(|text| text.parse::<u64>().ok())
    {
        Some(ms) => Pushback::After(Duration::from_millis(ms)),
        None => Pushback::Refused,
    }
}

/// The call's timeout from its `grpc-timeout` (at most 8 digits and a unit), if valid.
pub(crate) fn timeout(headers: &HeaderMap) -> Option<Duration> {
    let text = headers.get(GRPC_TIMEOUT)?.as_bytes();
    let (digits, unit) = text.split_at(text.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let value: u64 = std::str::from_utf8(digits).ok()?.parse().ok()?;
    Some(match unit {
        b"H" => Duration::from_secs(value * 3600),
        b"M" => Duration::from_secs(value * 60),
        b"S" => Duration::from_secs(value),
        b"m" => Duration::from_millis(value),
        b"u" => Duration::from_micros(value),
        b"n" => Duration::from_nanos(value),
        _ => return None,
    })
}

/// A `grpc-timeout` value for `remaining`, in the finest unit that fits 8 digits (never
/// longer than `remaining`, so a retry never outlives the caller's deadline).
pub(crate) fn timeout_value(remaining: Duration) -> HeaderValue {
    const MAX: u128 = 99_999_999;
    let candidates = [
        (remaining.as_nanos(), "n"),
        (remaining.as_micros(), "u"),
        (remaining.as_millis(), "m"),
        (u128::from(remaining.as_secs()), "S"),
        (u128::from(remaining.as_secs() / 60), "M"),
        (u128::from(remaining.as_secs() / 3600), "H"),
    ];
    let (value, unit) = candidates
        .into_iter()
        .find(|(value, _)| *value <= MAX)
        .unwrap_or((MAX, "H"));
    HeaderValue::try_from(format!("{value}{unit}")).expect("digits and a unit are a valid value")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(name: &'static str, value: &'static str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(name, HeaderValue::from_static(value));
        headers
    }

    #[test]
    fn timeouts_read_every_unit_and_refuse_what_the_spec_does_not_allow() {
        let read = |value| timeout(&headers(GRPC_TIMEOUT, value));
        assert_eq!(read("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(read("3M"), Some(Duration::from_secs(180)));
        assert_eq!(read("4S"), Some(Duration::from_secs(4)));
        assert_eq!(read("250m"), Some(Duration::from_millis(250)));
        assert_eq!(read("7u"), Some(Duration::from_micros(7)));
        assert_eq!(read("99999999n"), Some(Duration::from_nanos(99_999_999)));
        for bad in ["", "m", "123456789m", "12x", "-1S", "1.5S"] {
            assert_eq!(read(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_written_timeout_reads_back_no_longer_than_it_was() {
        for nanos in [
            1,
            999,
            99_999_999,
            100_000_000,
            123_456_789_012,
            u64::MAX / 4,
        ] {
            let remaining = Duration::from_nanos(nanos);
            let value = timeout_value(remaining);
            let back = timeout(&headers_of(value)).expect("a valid grpc-timeout");
            assert!(back <= remaining, "{remaining:?} -> {back:?}");
            // Eight digits of the finest unit that fits lose less than a ten-thousandth.
            assert!(
                remaining - back <= remaining / 10_000,
                "{remaining:?} -> {back:?}"
            );
        }
    }

    fn headers_of(value: HeaderValue) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(GRPC_TIMEOUT, value);
        headers
    }

    #[test]
    fn pushback_is_a_wait_or_a_refusal() {
        assert_eq!(pushback(&HeaderMap::new()), Pushback::Absent);
        assert_eq!(
            pushback(&headers(RETRY_PUSHBACK, "1500")),
            Pushback::After(Duration::from_millis(1500))
        );
        assert_eq!(pushback(&headers(RETRY_PUSHBACK, "-1")), Pushback::Refused);
        assert_eq!(
            pushback(&headers(RETRY_PUSHBACK, "soon")),
            Pushback::Refused
        );
    }

    #[test]
    fn a_status_in_the_head_is_read_and_http_errors_are_mapped() {
        let unavailable = headers(GRPC_STATUS, "14");
        assert_eq!(
            status_in_head(StatusCode::OK, &unavailable),
            Some(Code::Unavailable)
        );
        assert_eq!(status_in_head(StatusCode::OK, &HeaderMap::new()), None);
        assert_eq!(
            status_in_head(StatusCode::SERVICE_UNAVAILABLE, &HeaderMap::new()),
            Some(Code::Unavailable)
        );
        assert_eq!(
            status_in_head(StatusCode::NOT_FOUND, &HeaderMap::new()),
            Some(Code::Unimplemented)
        );
    }
}
