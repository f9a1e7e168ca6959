//! `Retry-After` parsing: any header values.
//!
//! Input: header values separated by `\n`. One value: `None`, or delay-seconds parsed to
//! exactly that many seconds (saturating), or an HTTP-date. Several values: `None`.
#![no_main]

use std::time::Duration;

use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;
use tower_idempotency::retry::retry_after;

fuzz_target!(|data: &[u8]| {
    let mut headers = HeaderMap::new();
    for raw in data.split(|&b| b == b'\n') {
        if let Ok(value) = HeaderValue::from_bytes(raw) {
            headers.append(http::header::RETRY_AFTER, value);
        }
    }
    let got = retry_after(&headers);
    let values: Vec<_> = headers.get_all(http::header::RETRY_AFTER).iter().collect();
    match values.as_slice() {
        [] => assert_eq!(got, None),
        [one] => {
            let text = one.to_str().map(str::trim);
            match text {
                Ok(text) if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) => {
                    let secs = text.parse::<u64>().unwrap_or(u64::MAX);
                    assert_eq!(got, Some(Duration::from_secs(secs)), "{text:?}");
                }
                Ok(text) => {
                    if got.is_some() {
                        assert!(httpdate::parse_http_date(text).is_ok(), "{text:?}");
                    }
                }
                Err(_) => assert_eq!(got, None),
            }
        }
        _ => assert_eq!(got, None),
    }
});
