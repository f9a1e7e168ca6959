//! `Idempotency-Key` parsing: any header values, one or several.
//!
//! Input: header values separated by `\n` (a byte no header value can hold). Checks that
//! `HeaderKey::from_headers` and `HeaderKey::parse` never panic, that an accepted key is
//! 1 to 255 visible ASCII characters and round-trips through its canonical sf-string,
//! that anything holding a byte outside visible ASCII is refused, and that every refusal
//! has a message.
#![no_main]

use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;
use tower_idempotency::key::MAX_KEY_LEN;
use tower_idempotency::{HeaderKey, InvalidKey};

fn sf_string(key: &str) -> HeaderValue {
    let mut out = String::with_capacity(key.len() + 2);
    out.push('"');
    for c in key.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    HeaderValue::from_str(&out).expect("visible ASCII in quotes is a header value")
}

fuzz_target!(|data: &[u8]| {
    let mut headers = HeaderMap::new();
    for raw in data.split(|&b| b == b'\n') {
        let Ok(value) = HeaderValue::from_bytes(raw) else {
            continue;
        };
        match HeaderKey::parse(&value) {
            Ok(key) => {
                let text = key.as_str();
                assert!((1..=MAX_KEY_LEN).contains(&text.len()), "{text:?}");
                assert!(text.bytes().all(|b| (0x21..=0x7e).contains(&b)), "{text:?}");
                assert_eq!(HeaderKey::parse(&sf_string(text)).as_ref(), Ok(&key));
            }
            Err(err) => {
                assert!(!err.to_string().is_empty());
                if let InvalidKey::InvalidCharacter { byte } = err {
                    assert!(raw.contains(&byte));
                }
            }
        }
        if raw.iter().any(|b| !(0x21..=0x7e).contains(b)) {
            assert!(HeaderKey::parse(&value).is_err(), "{raw:?}");
        }
        headers.append("idempotency-key", value);
    }
    let values: Vec<_> = headers.get_all("idempotency-key").iter().collect();
    let got = HeaderKey::from_headers(&headers);
    match values.as_slice() {
        [] => assert_eq!(got, Ok(None)),
        [one] => assert_eq!(got, HeaderKey::parse(one).map(Some)),
        _ => assert_eq!(got, Err(InvalidKey::Repeated)),
    }
});
