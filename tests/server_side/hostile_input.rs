//! Hostile input: whatever a client, a server or a corrupted ledger hands the crate's parsers,
//! they never panic, stay bounded in time and memory, and answer with a clear error.
//!
//! Property tests (proptest, small case counts so the whole file runs in seconds) over
//! every public entry point that reads bytes someone else chose:
//!
//! - the `Idempotency-Key` parser ([`HeaderKey`], [`InvalidKey`]);
//! - `Retry-After` ([`retry_after`]);
//! - the ledger record decoders ([`Outcome::decode`], [`FrozenRequest::decode`]), with a
//!   per-thread allocation tracker so a forged length cannot make them reserve gigabytes;
//! - the JSON drift report ([`Drift::between`]) on arbitrary, deep and huge JSON;
//! - the server face in front of an axum app, driven in-process with `oneshot`.
//!
//! The `fuzz/` directory runs the same entry points under libFuzzer.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use axum::body::Body;
use axum::extract::State;
use axum::Router;
use bytes::Bytes;
use http::header::{AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER};
use http::{
    HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Uri, Version,
};
use http_body_util::BodyExt;
use proptest::prelude::*;
use serde_json::{json, Value};
use tower::ServiceExt;
use tower_idempotency::key::MAX_KEY_LEN;
use tower_idempotency::ledger::{MemoryStore, Outcome, StoreError, StoredResponse};
use tower_idempotency::retry::retry_after;
use tower_idempotency::server::problem;
use tower_idempotency::{
    fingerprint::Fingerprint, Drift, FrozenRequest, HeaderKey, IdempotencyLayer, InvalidKey,
};

// ---------------------------------------------------------------------------------------
// An allocation tracker: what the current thread asked the allocator for, while asked to
// ---------------------------------------------------------------------------------------

/// Forwards to the system allocator; on a thread that is [`tracked`], it also notes the
/// largest single request and the sum of all requests. Other threads (other tests running
/// in parallel) are not counted.
struct Tracking;

thread_local! {
    static TRACKING: Cell<bool> = const { Cell::new(false) };
    static LARGEST: Cell<usize> = const { Cell::new(0) };
    static TOTAL: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    // `try_with`: never touch a thread-local being torn down. The cells are `const`
    // initialised and have no destructor, so reading them never allocates.
    let _ = TRACKING.try_with(|on| {
        if on.get() {
            let _ = LARGEST.try_with(|largest| largest.set(largest.get().max(size)));
            let _ = TOTAL.try_with(|total| total.set(total.get().saturating_add(size)));
        }
    });
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged; the
// bookkeeping only touches `Cell`s of the current thread.
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: the caller upholds `GlobalAlloc::alloc`'s contract; passed on as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated by `System` through this allocator with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        // SAFETY: as for `dealloc`; the caller upholds `realloc`'s contract.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Tracking = Tracking;

#[derive(Debug, Clone, Copy)]
struct Allocations {
    largest: usize,
    total: usize,
}

/// Run `f`, noting what this thread allocated meanwhile.
fn tracked<R>(f: impl FnOnce() -> R) -> (R, Allocations) {
    LARGEST.with(|c| c.set(0));
    TOTAL.with(|c| c.set(0));
    TRACKING.with(|c| c.set(true));
    let result = f();
    TRACKING.with(|c| c.set(false));
    let allocations = Allocations {
        largest: LARGEST.with(Cell::get),
        total: TOTAL.with(Cell::get),
    };
    (result, allocations)
}

/// What decoding `input` may allocate at most: its own size a few times over (the copied
/// body, header names and values, their map), plus a fixed allowance for the map's table.
fn decode_budget(input: &[u8]) -> usize {
    64 * 1024 + 8 * input.len()
}

// ---------------------------------------------------------------------------------------
// Strategies shared by several targets
// ---------------------------------------------------------------------------------------

fn is_visible_ascii(byte: u8) -> bool {
    (0x21..=0x7e).contains(&byte)
}

/// What a bare key is made of: RFC 9110 `tchar`, and the `:` and `/` of an sf-token.
fn is_token_byte(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~:/".contains(&byte)
}

/// Why a bare value is refused for its byte `byte`, one that is not a token byte.
fn bare_refusal(byte: u8) -> InvalidKey {
    if is_visible_ascii(byte) {
        InvalidKey::NotAToken { byte }
    } else {
        InvalidKey::InvalidCharacter { byte }
    }
}

/// Bytes a `HeaderValue` may hold, skewed towards the interesting ones: quotes,
/// backslashes, spaces, tabs (the only control byte a header value can carry) and
/// obs-text.
fn header_byte() -> impl Strategy<Value = u8> {
    prop_oneof![
        6 => 0x21u8..=0x7e,
        2 => Just(b'"'),
        2 => Just(b'\\'),
        1 => Just(b' '),
        1 => Just(b'\t'),
        1 => 0x80u8..=0xff,
    ]
}

/// Any header value, as bytes (every one is accepted by `HeaderValue::from_bytes`).
fn header_bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(header_byte(), 0..=max)
}

fn header_value(bytes: &[u8]) -> HeaderValue {
    HeaderValue::from_bytes(bytes).expect("the strategies only make valid header values")
}

/// A valid key: 1 to 255 visible ASCII characters.
fn visible_key(max: usize) -> impl Strategy<Value = String> {
    proptest::collection::vec(0x21u8..=0x7e, 1..=max)
        .prop_map(|bytes| String::from_utf8(bytes).expect("ASCII"))
}

/// `key` as an RFC 8941 sf-string.
fn sf_string(key: &[u8]) -> Vec<u8> {
    let mut out = vec![b'"'];
    for &byte in key {
        if byte == b'"' || byte == b'\\' {
            out.push(b'\\');
        }
        out.push(byte);
    }
    out.push(b'"');
    out
}

fn parse(raw: &[u8]) -> Result<HeaderKey, InvalidKey> {
    HeaderKey::parse(&header_value(raw))
}

// ---------------------------------------------------------------------------------------
// The Idempotency-Key parser
// ---------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// A valid key round-trips, sent bare or as an sf-string (escapes and all).
    #[test]
    fn a_valid_key_round_trips_bare_and_quoted(key in visible_key(MAX_KEY_LEN)) {
        let quoted = parse(&sf_string(key.as_bytes())).unwrap();
        prop_assert_eq!(quoted.as_str(), key.as_str());
        prop_assert_eq!(quoted.to_string(), key.clone());
        // Bare, it is a key when it is one token, and refused for its first delimiter
        // otherwise (a comma, a quote, …): quoting is how such a key is sent.
        if key.bytes().all(is_token_byte) {
            let bare = parse(key.as_bytes()).unwrap();
            prop_assert_eq!(&bare, &quoted);
        } else if !key.starts_with('"') {
            let first = key.bytes().find(|&b| !is_token_byte(b)).unwrap();
            prop_assert_eq!(parse(key.as_bytes()), Err(InvalidKey::NotAToken { byte: first }));
        }
    }

    /// A key with a byte that is not visible ASCII (a space, a tab, obs-text) is refused,
    /// naming that byte, in either form.
    #[test]
    fn a_control_space_or_non_ascii_byte_is_invalid(
        key in visible_key(100),
        bad in prop_oneof![Just(b'\t'), Just(b' '), 0x80u8..=0xff],
        at in any::<prop::sample::Index>(),
    ) {
        let mut raw = key.into_bytes();
        let at = at.index(raw.len() + 1);
        raw.insert(at, bad);
        prop_assert_eq!(
            parse(&sf_string(&raw)),
            Err(InvalidKey::InvalidCharacter { byte: bad })
        );
        if raw[0] != b'"' {
            // Bare, the first byte that is not a token byte is named: the bad one, or a
            // delimiter before it.
            let first = *raw.iter().find(|&&b| !is_token_byte(b)).unwrap();
            prop_assert_eq!(parse(&raw), Err(bare_refusal(first)));
        }
    }

    /// Over 255 characters (after unescaping) is `TooLong`, with the length.
    #[test]
    fn an_overlong_key_is_too_long(key in visible_key(2000).prop_filter("long", |k| k.len() > MAX_KEY_LEN)) {
        prop_assert_eq!(
            parse(&sf_string(key.as_bytes())),
            Err(InvalidKey::TooLong { len: key.len() })
        );
        if key.bytes().all(is_token_byte) {
            prop_assert_eq!(parse(key.as_bytes()), Err(InvalidKey::TooLong { len: key.len() }));
        }
    }

    /// Any header value at all: no panic; an accepted key is 1 to 255 visible ASCII
    /// characters and round-trips through its canonical sf-string; a refusal explains
    /// itself; bytes outside visible ASCII are never accepted.
    #[test]
    fn any_header_value_parses_or_is_refused_clearly(raw in header_bytes(300)) {
        match parse(&raw) {
            Ok(key) => {
                let text = key.as_str();
                prop_assert!((1..=MAX_KEY_LEN).contains(&text.len()), "{text:?}");
                prop_assert!(text.bytes().all(is_visible_ascii), "{text:?}");
                prop_assert_eq!(parse(&sf_string(text.as_bytes())), Ok(key.clone()));
                // Quotes and backslashes are only ever the sf-string's own.
                if raw.first() != Some(&b'"') {
                    prop_assert_eq!(text.as_bytes(), &raw[..]);
                }
            }
            Err(err) => {
                prop_assert!(!err.to_string().is_empty());
                if let InvalidKey::InvalidCharacter { byte } = err {
                    prop_assert!(!is_visible_ascii(byte) && raw.contains(&byte));
                }
                if raw.first() != Some(&b'"') {
                    // A bare token is refused for its first byte that is not a token byte,
                    // else for its length.
                    let expected = match raw.iter().find(|&&b| !is_token_byte(b)) {
                        Some(&byte) => bare_refusal(byte),
                        None if raw.is_empty() => InvalidKey::Empty,
                        None => InvalidKey::TooLong { len: raw.len() },
                    };
                    prop_assert_eq!(err, expected);
                }
            }
        }
        if raw.iter().any(|&b| !is_visible_ascii(b)) {
            prop_assert!(parse(&raw).is_err());
        }
    }

    /// Quoted garbage: an escape other than `\"` and `\\`, or a bare `"` inside, is
    /// `BadSfString`, never a key with the escape half-applied.
    #[test]
    fn a_bad_escape_is_a_bad_sf_string(
        prefix in visible_key(50),
        escaped in (0x21u8..=0x7e).prop_filter("not a valid escape", |b| *b != b'"' && *b != b'\\'),
    ) {
        let mut inner = sf_string(prefix.as_bytes());
        inner.pop(); // the closing quote
        inner.extend_from_slice(&[b'\\', escaped, b'"']);
        prop_assert_eq!(parse(&inner), Err(InvalidKey::BadSfString));
        // An opening quote without its closing one (if the key ends in an escaped quote,
        // what is left ends in a lone backslash: no better).
        let mut unterminated = sf_string(prefix.as_bytes());
        unterminated.pop();
        prop_assert_eq!(parse(&unterminated), Err(InvalidKey::BadSfString));
    }

    /// `from_headers`: absent is `None`, repeated is `Repeated` whatever the values (even
    /// valid and identical ones), and one value is exactly `parse`.
    #[test]
    fn from_headers_reads_exactly_one_value(values in proptest::collection::vec(header_bytes(40), 0..5)) {
        let mut headers = HeaderMap::new();
        for value in &values {
            headers.append("idempotency-key", header_value(value));
        }
        let got = HeaderKey::from_headers(&headers);
        match values.len() {
            0 => prop_assert_eq!(got, Ok(None)),
            1 => prop_assert_eq!(got, parse(&values[0]).map(Some)),
            _ => prop_assert_eq!(got, Err(InvalidKey::Repeated)),
        }
    }
}

#[test]
fn huge_and_many_keys_are_refused_in_linear_time() {
    let started = Instant::now();
    // A megabyte of key, bare and quoted.
    let huge = "k".repeat(1 << 20);
    assert_eq!(
        parse(huge.as_bytes()),
        Err(InvalidKey::TooLong { len: 1 << 20 })
    );
    assert_eq!(
        parse(&sf_string(huge.as_bytes())),
        Err(InvalidKey::TooLong { len: 1 << 20 })
    );
    // A megabyte of escapes unescapes to half a megabyte.
    let escapes = sf_string(&vec![b'\\'; 1 << 19]);
    assert_eq!(parse(&escapes), Err(InvalidKey::TooLong { len: 1 << 19 }));
    // Ten thousand copies of the header: refused as repeated without reading them.
    let mut headers = HeaderMap::new();
    for _ in 0..10_000 {
        headers.append("idempotency-key", HeaderValue::from_static("\"k\""));
    }
    assert_eq!(HeaderKey::from_headers(&headers), Err(InvalidKey::Repeated));
    assert!(started.elapsed() < Duration::from_secs(5));
    // Edge cases the properties may not hit.
    assert_eq!(parse(b"\""), Err(InvalidKey::BadSfString));
    assert_eq!(parse(b"\"\\\""), Err(InvalidKey::BadSfString));
    assert_eq!(parse(b"\"\\\"\"").unwrap().as_str(), "\"");
    // A quote inside a bare value is a delimiter, not part of a key.
    assert_eq!(parse(b"a\""), Err(InvalidKey::NotAToken { byte: b'"' }));
    assert_eq!(parse(b"\"\""), Err(InvalidKey::Empty));
    assert_eq!(parse(b""), Err(InvalidKey::Empty));
}

// ---------------------------------------------------------------------------------------
// Retry-After
// ---------------------------------------------------------------------------------------

fn retry_after_of(values: &[&[u8]]) -> Option<Duration> {
    let mut headers = HeaderMap::new();
    for value in values {
        headers.append(RETRY_AFTER, header_value(value));
    }
    retry_after(&headers)
}

fn optional_whitespace() -> impl Strategy<Value = String> {
    "[ \t]{0,3}"
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// delay-seconds parse to that many seconds, surrounding whitespace allowed.
    #[test]
    fn digits_are_that_many_seconds(secs in any::<u64>(), before in optional_whitespace(), after in optional_whitespace()) {
        let text = format!("{before}{secs}{after}");
        prop_assert_eq!(retry_after_of(&[text.as_bytes()]), Some(Duration::from_secs(secs)));
    }

    /// More digits than a `u64` holds still means "later than any deadline".
    #[test]
    fn too_many_digits_saturate(digits in "[0-9]{1,60}") {
        let expected = digits.parse::<u64>().unwrap_or(u64::MAX);
        prop_assert_eq!(retry_after_of(&[digits.as_bytes()]), Some(Duration::from_secs(expected)));
    }

    /// Anything else is `None` or an HTTP-date; never a panic.
    #[test]
    fn anything_else_is_none_or_a_date(raw in header_bytes(80)) {
        let got = retry_after_of(&[&raw]);
        if let Some(delay) = got {
            let text = std::str::from_utf8(&raw).expect("only ASCII values are read").trim();
            let digits = !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit());
            prop_assert!(
                digits || httpdate::parse_http_date(text).is_ok(),
                "{text:?} read as {delay:?}"
            );
        }
    }

    /// Signs, fractions, units and lists are not delay-seconds.
    #[test]
    fn signed_fractional_or_suffixed_numbers_are_none(
        n in 0u64..1_000_000,
        form in prop_oneof![Just("-{}"), Just("+{}"), Just("{}.5"), Just("{}s"), Just("{}, 1"), Just("0x{}"), Just("{} 1")],
    ) {
        let text = form.replace("{}", &n.to_string());
        prop_assert_eq!(retry_after_of(&[text.as_bytes()]), None, "{}", text);
    }

    /// Several `Retry-After` headers are ambiguous: `None`.
    #[test]
    fn several_values_are_none(a in any::<u32>(), b in any::<u32>()) {
        let (a, b) = (a.to_string(), b.to_string());
        prop_assert_eq!(retry_after_of(&[a.as_bytes(), b.as_bytes()]), None);
    }

    /// An HTTP-date in the future is about that far away; one in the past is zero.
    #[test]
    fn dates_are_the_time_until_them(secs in 0u64..1_000_000_000) {
        let now = SystemTime::now();
        let future = httpdate::fmt_http_date(now + Duration::from_secs(secs));
        let got = retry_after_of(&[future.as_bytes()]).expect("a date");
        // The date drops sub-seconds, and time passes while we look.
        prop_assert!(got <= Duration::from_secs(secs), "{got:?} > {secs}s");
        prop_assert!(got + Duration::from_secs(3) >= Duration::from_secs(secs), "{got:?} << {secs}s");
        let past = httpdate::fmt_http_date(now - Duration::from_secs(secs + 2));
        prop_assert_eq!(retry_after_of(&[past.as_bytes()]), Some(Duration::ZERO));
    }
}

#[test]
fn retry_after_edge_cases() {
    assert_eq!(retry_after_of(&[]), None);
    assert_eq!(retry_after_of(&[b""]), None);
    assert_eq!(retry_after_of(&[b" \t "]), None);
    assert_eq!(retry_after_of(&[b"0"]), Some(Duration::ZERO));
    assert_eq!(retry_after_of(&[b"007"]), Some(Duration::from_secs(7)));
    // obs-text is not a string the parser reads.
    assert_eq!(retry_after_of(&["٣".as_bytes()]), None);
    assert_eq!(retry_after_of(&[&[b'1', 0xff]]), None);
    // The latest date HTTP can write.
    let far = retry_after_of(&[b"Fri, 31 Dec 9999 23:59:59 GMT"]).unwrap();
    assert!(far > Duration::from_secs(7_000 * 365 * 24 * 3600));
    // Obsolete date forms are dates too.
    assert_eq!(
        retry_after_of(&[b"Sunday, 06-Nov-94 08:49:37 GMT"]),
        Some(Duration::ZERO)
    );
    assert_eq!(
        retry_after_of(&[b"Sun Nov  6 08:49:37 1994"]),
        Some(Duration::ZERO)
    );
    assert_eq!(retry_after_of(&[b"Sun, 06 Nov 1994 08:49:37 XYZ"]), None);
    let digits = "9".repeat(100_000);
    assert_eq!(
        retry_after_of(&[digits.as_bytes()]),
        Some(Duration::from_secs(u64::MAX))
    );
}

// ---------------------------------------------------------------------------------------
// Ledger records
// ---------------------------------------------------------------------------------------

fn header_name() -> impl Strategy<Value = HeaderName> {
    prop_oneof![
        "[a-z0-9!#$%&'*+.^_`|~-]{1,24}"
            .prop_map(|name| HeaderName::from_bytes(name.as_bytes()).unwrap()),
        prop::sample::select(vec![
            CONTENT_TYPE,
            http::header::LOCATION,
            http::header::SET_COOKIE,
            http::header::LINK,
            http::header::ETAG,
        ]),
    ]
}

fn headers() -> impl Strategy<Value = HeaderMap> {
    proptest::collection::vec((header_name(), header_bytes(40)), 0..10).prop_map(|pairs| {
        let mut headers = HeaderMap::new();
        for (name, value) in pairs {
            headers.append(name, header_value(&value));
        }
        headers
    })
}

fn version() -> impl Strategy<Value = Version> {
    prop::sample::select(vec![
        Version::HTTP_09,
        Version::HTTP_10,
        Version::HTTP_11,
        Version::HTTP_2,
        Version::HTTP_3,
    ])
}

fn status() -> impl Strategy<Value = StatusCode> {
    (100u16..=999).prop_map(|code| StatusCode::from_u16(code).unwrap())
}

fn body(max: usize) -> impl Strategy<Value = Bytes> {
    proptest::collection::vec(any::<u8>(), 0..=max).prop_map(Bytes::from)
}

fn outcome() -> impl Strategy<Value = Outcome> {
    prop_oneof![
        3 => (status(), version(), headers(), body(300)).prop_map(|(status, version, headers, body)| {
            Outcome::Response(StoredResponse::new(status, version, headers, body))
        }),
        1 => status().prop_map(|status| Outcome::Tombstone { status }),
    ]
}

fn method() -> impl Strategy<Value = Method> {
    prop_oneof![
        prop::sample::select(vec![
            Method::GET,
            Method::POST,
            Method::PUT,
            Method::PATCH,
            Method::DELETE,
            Method::HEAD,
            Method::OPTIONS,
            Method::CONNECT,
            Method::TRACE,
        ]),
        "[A-Za-z0-9!#$%&'*+.^_`|~-]{1,20}".prop_map(|m| Method::from_bytes(m.as_bytes()).unwrap()),
    ]
}

fn uri() -> impl Strategy<Value = Uri> {
    let path =
        "(/[A-Za-z0-9._~%!$&'()*+,;=:@-]{0,12}){0,4}(\\?[A-Za-z0-9._~%!$&'()*+,;=:@/?-]{0,20})?";
    prop_oneof![
        path.prop_map(|p| if p.is_empty() { "/".to_owned() } else { p }),
        (
            prop::sample::select(vec!["http", "https", "custom+scheme"]),
            "[a-z0-9.-]{1,20}(:[0-9]{1,5})?",
            path
        )
            .prop_map(|(scheme, authority, path)| format!("{scheme}://{authority}{path}")),
        Just("*".to_owned()),
        "[a-z0-9.-]{1,20}:[0-9]{1,5}",
    ]
    .prop_filter_map("a valid URI", |text| text.parse::<Uri>().ok())
}

fn frozen_request() -> impl Strategy<Value = FrozenRequest> {
    (method(), uri(), version(), headers(), body(300)).prop_map(
        |(method, uri, version, headers, body)| {
            FrozenRequest::from_parts(method, uri, version, headers, body)
        },
    )
}

fn assert_outcomes_equal(a: &Outcome, b: &Outcome) {
    match (a, b) {
        (Outcome::Response(a), Outcome::Response(b)) => {
            assert_eq!(a.status(), b.status());
            assert_eq!(a.version(), b.version());
            assert_eq!(a.headers(), b.headers());
            assert_eq!(a.body(), b.body());
        }
        (Outcome::Tombstone { status: a }, Outcome::Tombstone { status: b }) => {
            assert_eq!(a, b)
        }
        (a, b) => panic!("{a:?} decoded as {b:?}"),
    }
}

fn assert_requests_equal(a: &FrozenRequest, b: &FrozenRequest) {
    assert_eq!(a.method(), b.method());
    assert_eq!(a.uri(), b.uri());
    assert_eq!(a.version(), b.version());
    assert_eq!(a.headers(), b.headers());
    assert_eq!(a.body(), b.body());
}

/// Damage done to an encoded record.
#[derive(Debug, Clone)]
enum Mutation {
    /// Flip bits of one byte.
    Xor {
        at: prop::sample::Index,
        mask: u8,
    },
    /// Overwrite four bytes with a forged big-endian length or count.
    Forge {
        at: prop::sample::Index,
        value: u32,
    },
    Truncate(prop::sample::Index),
    Insert {
        at: prop::sample::Index,
        byte: u8,
    },
    Remove(prop::sample::Index),
    Append(Vec<u8>),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let forged = prop_oneof![
        Just(u32::MAX),
        Just(u32::MAX / 2),
        Just(1 << 30),
        Just(1 << 20),
        Just(0),
        any::<u32>(),
    ];
    prop_oneof![
        (any::<prop::sample::Index>(), 1u8..=255).prop_map(|(at, mask)| Mutation::Xor { at, mask }),
        (any::<prop::sample::Index>(), forged)
            .prop_map(|(at, value)| Mutation::Forge { at, value }),
        any::<prop::sample::Index>().prop_map(Mutation::Truncate),
        (any::<prop::sample::Index>(), any::<u8>())
            .prop_map(|(at, byte)| Mutation::Insert { at, byte }),
        any::<prop::sample::Index>().prop_map(Mutation::Remove),
        proptest::collection::vec(any::<u8>(), 1..8).prop_map(Mutation::Append),
    ]
}

fn mutate(mut bytes: Vec<u8>, mutations: &[Mutation]) -> Vec<u8> {
    for mutation in mutations {
        let len = bytes.len();
        match mutation {
            Mutation::Xor { at, mask } if len > 0 => bytes[at.index(len)] ^= mask,
            Mutation::Forge { at, value } if len >= 4 => {
                let at = at.index(len - 3);
                bytes[at..at + 4].copy_from_slice(&value.to_be_bytes());
            }
            Mutation::Truncate(at) => bytes.truncate(at.index(len + 1)),
            Mutation::Insert { at, byte } => bytes.insert(at.index(len + 1), *byte),
            Mutation::Remove(at) if len > 0 => {
                bytes.remove(at.index(len));
            }
            Mutation::Append(tail) => bytes.extend_from_slice(tail),
            _ => {}
        }
    }
    bytes
}

/// Decoding is `Ok` or a corrupt-record error, and bounded in what it allocates.
fn check_decode<T>(input: &[u8], decode: impl FnOnce(&[u8]) -> Result<T, StoreError>) {
    let (result, allocations) = tracked(|| decode(input));
    if let Err(err) = result {
        assert!(err.is_corrupt(), "{err:?}");
        assert!(!err.to_string().is_empty());
    }
    assert!(
        allocations.largest <= decode_budget(input)
            && allocations.total <= 4 * decode_budget(input),
        "decoding {} bytes allocated {allocations:?}",
        input.len()
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn outcomes_round_trip(outcome in outcome()) {
        let decoded = Outcome::decode(&outcome.encode()).unwrap();
        assert_outcomes_equal(&outcome, &decoded);
    }

    #[test]
    fn frozen_requests_round_trip(request in frozen_request()) {
        let decoded = FrozenRequest::decode(&request.encode()).unwrap();
        assert_requests_equal(&request, &decoded);
    }

    /// The fingerprint survives the round trip too (absolute URIs with an empty path and a
    /// query, `http://h?q`, included: see `a_round_tripped_request_keeps_its_fingerprint`).
    #[test]
    fn frozen_requests_keep_their_fingerprint(request in frozen_request()) {
        let decoded = FrozenRequest::decode(&request.encode()).unwrap();
        prop_assert_eq!(decoded.fingerprint(), request.fingerprint());
    }

    #[test]
    fn a_damaged_outcome_decodes_or_is_corrupt(
        outcome in outcome(),
        mutations in proptest::collection::vec(mutation(), 1..4),
    ) {
        let damaged = mutate(outcome.encode(), &mutations);
        check_decode(&damaged, Outcome::decode);
        check_decode(&damaged, FrozenRequest::decode);
    }

    #[test]
    fn a_damaged_frozen_request_decodes_or_is_corrupt(
        request in frozen_request(),
        mutations in proptest::collection::vec(mutation(), 1..4),
    ) {
        let damaged = mutate(request.encode(), &mutations);
        check_decode(&damaged, FrozenRequest::decode);
        check_decode(&damaged, Outcome::decode);
    }

    #[test]
    fn garbage_decodes_or_is_corrupt(garbage in proptest::collection::vec(any::<u8>(), 0..600)) {
        check_decode(&garbage, Outcome::decode);
        check_decode(&garbage, FrozenRequest::decode);
        // And with a valid version byte, so the decoders get further in.
        let mut versioned = vec![1];
        versioned.extend_from_slice(&garbage);
        check_decode(&versioned, Outcome::decode);
        check_decode(&versioned, FrozenRequest::decode);
    }
}

/// `1 || tag 0 || status || version` of an `Outcome::Response`, before its headers.
fn response_head() -> Vec<u8> {
    let mut bytes = vec![1, 0];
    bytes.extend_from_slice(&200u16.to_be_bytes());
    bytes.push(2);
    bytes
}

#[test]
fn forged_counts_and_lengths_allocate_nothing_big() {
    let forged = [u32::MAX, u32::MAX / 2, 1 << 30, 1 << 24];
    for value in forged {
        // A header count.
        let mut bytes = response_head();
        bytes.extend_from_slice(&value.to_be_bytes());
        check_decode(&bytes, Outcome::decode);
        // A header name's length, after a count of one.
        let mut bytes = response_head();
        bytes.extend_from_slice(&1u32.to_be_bytes());
        bytes.extend_from_slice(&value.to_be_bytes());
        bytes.extend_from_slice(b"x-a");
        check_decode(&bytes, Outcome::decode);
        // The body's length.
        let mut bytes = response_head();
        bytes.extend_from_slice(&0u32.to_be_bytes());
        bytes.extend_from_slice(&value.to_be_bytes());
        bytes.extend_from_slice(b"body");
        check_decode(&bytes, Outcome::decode);
        // A frozen request's method and URI lengths.
        let mut bytes = vec![1];
        bytes.extend_from_slice(&value.to_be_bytes());
        bytes.extend_from_slice(b"POST");
        check_decode(&bytes, FrozenRequest::decode);
        let mut bytes = vec![1, 0, 0, 0, 4];
        bytes.extend_from_slice(b"POST");
        bytes.extend_from_slice(&value.to_be_bytes());
        bytes.extend_from_slice(b"/");
        check_decode(&bytes, FrozenRequest::decode);
    }
    // Every error is a clear "corrupt", and tells what was wrong.
    for garbage in [&[][..], &[0], &[2], &[1], &[1, 7], &[1, 1, 0, 0]] {
        let err = Outcome::decode(garbage).unwrap_err();
        assert!(err.is_corrupt(), "{garbage:?}: {err:?}");
    }
    let err = Outcome::decode(&[9, 0]).unwrap_err();
    assert!(format!("{err:?}").contains("version 9"), "{err:?}");
}

/// A record of `count` headers with distinct names (the names `h0`, `h1`, …), empty values.
fn record_with_distinct_headers(count: u32) -> Vec<u8> {
    let mut bytes = response_head();
    bytes.extend_from_slice(&count.to_be_bytes());
    for n in 0..count {
        let name = format!("h{n}");
        bytes.extend_from_slice(&(name.len() as u32).to_be_bytes());
        bytes.extend_from_slice(name.as_bytes());
        bytes.extend_from_slice(&0u32.to_be_bytes());
    }
    bytes.extend_from_slice(&0u32.to_be_bytes()); // the body
    bytes
}

#[test]
fn many_values_of_one_header_decode() {
    // `HeaderMap` bounds distinct names, not values: 40 000 values of one name are a map
    // an encoder can be handed, and must come back.
    let mut headers = HeaderMap::new();
    for n in 0..40_000u32 {
        headers.append("x-many", HeaderValue::from(n));
    }
    let outcome = Outcome::Response(StoredResponse::new(
        StatusCode::OK,
        Version::HTTP_11,
        headers,
        Bytes::new(),
    ));
    assert_outcomes_equal(&outcome, &Outcome::decode(&outcome.encode()).unwrap());
    // Right at the most distinct names a `HeaderMap` holds: still fine, and replayable.
    let Outcome::Response(stored) =
        Outcome::decode(&record_with_distinct_headers(24_576)).expect("decodes")
    else {
        panic!("a response")
    };
    assert_eq!(stored.headers().len(), 24_576);
}

/// A record listing more distinct header names than an `http::HeaderMap` can hold (24 577
/// or more, a ~340 KB record) is corrupt: `HeaderMap::append` would panic past its
/// `MAX_SIZE`, so a forged Redis record could crash the request that reads it.
#[test]
fn too_many_distinct_header_names_are_corrupt_not_a_panic() {
    let bytes = record_with_distinct_headers(24_577);
    let err = Outcome::decode(&bytes).unwrap_err();
    assert!(err.is_corrupt(), "{err:?}");
    // The same header block inside a frozen request.
    let mut request = vec![1, 0, 0, 0, 4];
    request.extend_from_slice(b"POST");
    request.extend_from_slice(&1u32.to_be_bytes());
    request.extend_from_slice(b"/");
    request.push(2);
    request.extend_from_slice(&bytes[5..]);
    let err = FrozenRequest::decode(&request).unwrap_err();
    assert!(err.is_corrupt(), "{err:?}");
}

/// A frozen request to an absolute URI with an empty path and a query
/// (`http://payments.local?charge=1`) keeps its fingerprint through the record encoding,
/// which writes the URI through `Uri`'s `Display` (printing the empty path as `/`): an empty
/// path is `/` to the fingerprint too, so `http://h?q` and `http://h/?q`, one resource, are
/// one request.
#[test]
fn a_round_tripped_request_keeps_its_fingerprint() {
    let frozen = FrozenRequest::from_parts(
        Method::POST,
        "http://payments.local?charge=1".parse().unwrap(),
        Version::HTTP_11,
        HeaderMap::new(),
        Bytes::from_static(b"{}"),
    );
    let decoded = FrozenRequest::decode(&frozen.encode()).unwrap();
    assert_eq!(decoded.uri(), frozen.uri());
    assert_eq!(decoded.fingerprint(), frozen.fingerprint());
    let with_slash = FrozenRequest::from_parts(
        Method::POST,
        "http://payments.local/?charge=1".parse().unwrap(),
        Version::HTTP_11,
        HeaderMap::new(),
        Bytes::from_static(b"{}"),
    );
    assert_eq!(with_slash.fingerprint(), frozen.fingerprint());
}

// ---------------------------------------------------------------------------------------
// The JSON drift report
// ---------------------------------------------------------------------------------------

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        // Floats that print and parse back exactly.
        (-1_000_000i32..1_000_000).prop_map(|n| Value::from(f64::from(n) / 8.0)),
        any::<String>().prop_map(Value::from),
        "[a-c\"\\\\\\x00\\x7fé😀]{0,4}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            proptest::collection::btree_map(field_name(), inner, 0..4)
                .prop_map(|map| Value::Object(map.into_iter().collect())),
        ]
    })
}

fn field_name() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "[a-e]{1,2}",
        1 => any::<String>(),
        1 => Just(String::new()),
    ]
}

/// What happens to one field of the old object in the new one.
#[derive(Debug, Clone)]
enum Edit {
    Keep,
    Remove,
    Replace(Value),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        3 => Just(Edit::Keep),
        1 => Just(Edit::Remove),
        2 => json_value().prop_map(Edit::Replace),
    ]
}

fn drift(old: &[u8], new: &[u8]) -> Drift {
    Drift::between(
        Fingerprint::of(&Method::POST, "/", old),
        old,
        Fingerprint::of(&Method::POST, "/", new),
        new,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Two JSON objects: exactly the top-level fields whose values differ (changed,
    /// added, removed) are named, sorted; nested changes name their top-level field.
    #[test]
    fn drift_names_exactly_the_fields_that_differ(
        old in proptest::collection::btree_map(field_name(), json_value(), 0..8),
        edits in proptest::collection::vec(edit(), 8),
        added in proptest::collection::btree_map(field_name(), json_value(), 0..3),
        pretty in any::<bool>(),
    ) {
        let mut new = old.clone();
        for ((name, _), edit) in old.iter().zip(&edits) {
            match edit {
                Edit::Keep => {}
                Edit::Remove => { new.remove(name); }
                Edit::Replace(value) => { new.insert(name.clone(), value.clone()); }
            }
        }
        for (name, value) in added {
            new.insert(name, value);
        }
        let expected: Vec<String> = old
            .keys()
            .chain(new.keys())
            .filter(|name| old.get(*name) != new.get(*name))
            .cloned()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let old_json = serde_json::to_vec(&old).unwrap();
        // Layout is not drift: the same values, pretty-printed, are the same fields.
        let new_json = if pretty { serde_json::to_vec_pretty(&new) } else { serde_json::to_vec(&new) }.unwrap();
        let report = drift(&old_json, &new_json);
        prop_assert_eq!(report.changed_fields(), Some(&expected[..]));
        prop_assert!(report.to_string().contains("nothing was sent"));
        // And the other way round.
        let back = drift(&new_json, &old_json);
        prop_assert_eq!(back.changed_fields(), Some(&expected[..]));
    }

    /// Anything that is not two JSON objects names no fields; nothing panics.
    #[test]
    fn non_objects_and_garbage_name_no_fields(
        a in prop_oneof![
            json_value().prop_filter("not an object", |v| !v.is_object()).prop_map(|v| serde_json::to_vec(&v).unwrap()),
            proptest::collection::vec(any::<u8>(), 0..100).prop_filter("not an object", |bytes| {
                serde_json::from_slice::<serde_json::Map<String, Value>>(bytes).is_err()
            }),
        ],
        b in json_value().prop_map(|v| serde_json::to_vec(&v).unwrap()),
    ) {
        prop_assert!(drift(&a, &b).changed_fields().is_none());
        prop_assert!(drift(&b, &a).changed_fields().is_none());
    }

    /// Arbitrary bytes on both sides: no panic, and a report only for two objects.
    #[test]
    fn arbitrary_bytes_never_panic(
        a in proptest::collection::vec(any::<u8>(), 0..200),
        b in proptest::collection::vec(any::<u8>(), 0..200),
    ) {
        let report = drift(&a, &b);
        let both_objects = serde_json::from_slice::<serde_json::Map<String, Value>>(&a).is_ok()
            && serde_json::from_slice::<serde_json::Map<String, Value>>(&b).is_ok();
        prop_assert_eq!(report.changed_fields().is_some(), both_objects);
    }
}

fn nested(depth: usize, open: &str, close: &str) -> Vec<u8> {
    let mut json = String::from(r#"{"deep":"#);
    json.push_str(&open.repeat(depth));
    json.push_str("null");
    json.push_str(&close.repeat(depth));
    json.push('}');
    json.into_bytes()
}

#[test]
fn deep_json_neither_overflows_the_stack_nor_hangs() {
    let flat = br#"{"deep":1}"#;
    let started = Instant::now();
    for depth in [10, 100, 126, 127, 128, 129, 1_000, 200_000] {
        for (open, close) in [("[", "]"), (r#"{"a":"#, "}")] {
            let deep = nested(depth, open, close);
            let report = drift(flat, &deep);
            // Within serde_json's recursion limit the field is named; past it the body is
            // not read as JSON at all. Never a stack overflow.
            if depth < 100 {
                assert_eq!(
                    report.changed_fields(),
                    Some(&["deep".to_owned()][..]),
                    "{depth}"
                );
            }
            let _ = drift(&deep, &deep);
        }
    }
    // Unterminated nesting.
    let _ = drift(flat, &vec![b'['; 1 << 20]);
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
fn huge_json_is_compared_in_linear_time() {
    let old: serde_json::Map<String, Value> = (0..20_000)
        .map(|n| (format!("field_{n}"), json!({ "n": n, "s": "x".repeat(8) })))
        .collect();
    let mut new = old.clone();
    new.insert("field_13337".to_owned(), json!(null));
    new.insert("zz_added".to_owned(), json!([1, 2, 3]));
    let started = Instant::now();
    let report = drift(
        &serde_json::to_vec(&old).unwrap(),
        &serde_json::to_vec(&new).unwrap(),
    );
    assert_eq!(
        report.changed_fields(),
        Some(&["field_13337".to_owned(), "zz_added".to_owned()][..])
    );
    // A megabyte-long string value.
    let long = json!({ "s": "y".repeat(1 << 20) });
    let report = drift(br#"{"s":""}"#, &serde_json::to_vec(&long).unwrap());
    assert_eq!(report.changed_fields(), Some(&["s".to_owned()][..]));
    assert!(started.elapsed() < Duration::from_secs(10));
}

#[test]
fn escaped_and_literal_spellings_are_one_field() {
    // `\u00e9` and `é` are the same name and the same value.
    let report = drift(br#"{"caf\u00e9":"\u00e9"}"#, "{\"café\":\"é\"}".as_bytes());
    assert_eq!(report.changed_fields(), Some(&[][..]));
}

// ---------------------------------------------------------------------------------------
// The server face, in front of an axum app
// ---------------------------------------------------------------------------------------

/// Whose key a keyed request used: its `Authorization` values (the default scope is their
/// hash) and its key.
type ScopedKey = (Vec<Vec<u8>>, String);

/// What the handler saw.
#[derive(Clone, Default)]
struct Handler {
    /// Handler runs per (`Authorization` values, key) of keyed requests.
    runs: Arc<Mutex<HashMap<ScopedKey, usize>>>,
    total: Arc<AtomicUsize>,
    /// Yield this many times before answering, so concurrent requests overlap.
    dawdle: usize,
}

async fn handle(State(handler): State<Handler>, req: axum::extract::Request) -> Response<Body> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .expect("a buffered body reads")
        .to_bytes();
    for _ in 0..handler.dawdle {
        tokio::task::yield_now().await;
    }
    let run = handler.total.fetch_add(1, Ordering::SeqCst) + 1;
    if let Some(key) = parts.extensions.get::<HeaderKey>() {
        let auth = parts
            .headers
            .get_all(AUTHORIZATION)
            .iter()
            .map(|v| v.as_bytes().to_vec())
            .collect();
        *handler
            .runs
            .lock()
            .unwrap()
            .entry((auth, key.as_str().to_owned()))
            .or_default() += 1;
    }
    Response::builder()
        .status(StatusCode::CREATED)
        .header(CONTENT_TYPE, "text/plain")
        .header("x-handler", run)
        .body(Body::from(format!("run {run}: {} bytes", body.len())))
        .unwrap()
}

fn app(handler: Handler) -> Router {
    Router::new()
        .fallback(handle)
        .with_state(handler)
        .layer(IdempotencyLayer::server(MemoryStore::new()))
}

/// One hostile request.
#[derive(Debug, Clone)]
struct Hostile {
    method: Method,
    path: String,
    keys: Vec<Vec<u8>>,
    auth: Vec<Vec<u8>>,
    content_length: Option<Vec<u8>>,
    body: Vec<u8>,
}

fn hostile_request() -> impl Strategy<Value = Hostile> {
    let method = prop_oneof![
        4 => Just(Method::POST),
        2 => Just(Method::PATCH),
        1 => method(),
    ];
    let path = prop_oneof![
        3 => prop::sample::select(vec!["/charges".to_owned(), "/charges?x=1".to_owned()]),
        // An origin-form target (what a server is handed): a path, maybe a query.
        1 => uri().prop_filter_map("an origin-form target", |u| {
            let pq = u.path_and_query().map_or("/", |pq| pq.as_str());
            pq.starts_with('/').then(|| pq.to_owned())
        }),
    ];
    // Few keys, so they repeat and meet the ledger again; and every kind of garbage.
    let key = prop_oneof![
        8 => prop::sample::select(vec![
            b"\"k1\"".to_vec(),
            b"k1".to_vec(),
            b"\"k2\"".to_vec(),
            b"\"a\\\"b\"".to_vec(),
        ]),
        1 => visible_key(MAX_KEY_LEN).prop_map(|k| sf_string(k.as_bytes())),
        1 => header_bytes(300),
        1 => (256usize..5000).prop_map(|n| vec![b'k'; n]),
        1 => Just(Vec::new()),
        1 => Just(b"\"\"".to_vec()),
    ];
    let keys = prop_oneof![
        1 => Just(Vec::new()),
        6 => key.clone().prop_map(|k| vec![k]),
        1 => proptest::collection::vec(key, 2..4),
    ];
    let credential = prop_oneof![
        6 => prop::sample::select(vec![b"Bearer a".to_vec(), b"Bearer b".to_vec()]),
        1 => header_bytes(60),
    ];
    let auth = prop_oneof![
        1 => Just(Vec::new()),
        6 => credential.clone().prop_map(|c| vec![c]),
        1 => proptest::collection::vec(credential, 2..4),
    ];
    let content_length = prop_oneof![
        4 => Just(None),
        1 => any::<u64>().prop_map(|n| Some(n.to_string().into_bytes())),
        1 => (1_048_577u64..10_000_000_000).prop_map(|n| Some(n.to_string().into_bytes())),
        1 => "[0-9]{20,40}".prop_map(|n| Some(n.into_bytes())),
        1 => "[a-z ,;-]{0,10}".prop_map(|n| Some(n.into_bytes())),
    ];
    let body = prop_oneof![
        3 => prop::sample::select(vec![b"{}".to_vec(), br#"{"amount":1}"#.to_vec()]),
        1 => proptest::collection::vec(any::<u8>(), 0..2000),
    ];
    (method, path, keys, auth, content_length, body).prop_map(
        |(method, path, keys, auth, content_length, body)| Hostile {
            method,
            path,
            keys,
            auth,
            content_length,
            body,
        },
    )
}

impl Hostile {
    fn request(&self) -> Request<Body> {
        let mut req = Request::builder()
            .method(self.method.clone())
            .uri(&self.path);
        for key in &self.keys {
            req = req.header("idempotency-key", header_value(key));
        }
        for credential in &self.auth {
            req = req.header(AUTHORIZATION, header_value(credential));
        }
        if let Some(length) = &self.content_length {
            req = req.header(CONTENT_LENGTH, header_value(length));
        }
        req.body(Body::from(self.body.clone())).unwrap()
    }

    /// A `Content-Length` that declares more than the default 1 MiB body limit.
    fn declares_too_much(&self) -> bool {
        self.content_length
            .as_ref()
            .and_then(|v| std::str::from_utf8(v).ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .is_some_and(|n| n > 1 << 20)
    }
}

/// An answer, read whole.
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Answer {
    async fn read(response: Response<Body>) -> Self {
        let (parts, body) = response.into_parts();
        Self {
            status: parts.status,
            headers: parts.headers,
            body: body
                .collect()
                .await
                .expect("every answer's body reads")
                .to_bytes(),
        }
    }

    fn by_handler(&self) -> bool {
        self.headers.contains_key("x-handler")
    }

    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .map(|v| v.as_bytes())
            == Some(b"true")
    }

    /// The problem `type` of a problem+json answer, after checking its shape.
    fn problem(&self) -> Option<String> {
        if self.headers.get(CONTENT_TYPE)?.as_bytes() != b"application/problem+json" {
            return None;
        }
        let json: Value = serde_json::from_slice(&self.body)
            .unwrap_or_else(|err| panic!("problem body is not JSON ({err}): {:?}", self.body));
        assert_eq!(json["status"], self.status.as_u16(), "{json}");
        assert!(
            json["title"].is_string() && json["detail"].is_string(),
            "{json}"
        );
        assert!(
            self.status.is_client_error() || self.status.is_server_error(),
            "{json}"
        );
        if matches!(self.status.as_u16(), 409 | 503) {
            let after = self
                .headers
                .get(RETRY_AFTER)
                .expect("409/503 advise a delay");
            assert!(after.to_str().unwrap().parse::<u64>().unwrap() >= 1);
        }
        let kind = json["type"].as_str().expect("a type URI").to_owned();
        assert!(
            kind.starts_with("https://docs.rs/tower-idempotency/"),
            "{kind}"
        );
        Some(kind)
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// The fingerprint of a keyed request, as the model sees it: method, target, body.
type Seen = (Method, String, Vec<u8>);

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// A sequence of hostile requests against one app: every answer is well formed and the
    /// one the IETF draft and the crate's docs promise, checked against a model; the
    /// handler runs at most once per (scope, key); nothing panics.
    #[test]
    fn the_server_answers_hostile_requests_exactly_as_documented(
        distinct in proptest::collection::vec(hostile_request(), 1..10),
        order in proptest::collection::vec((any::<prop::sample::Index>(), prop::bool::weighted(0.2)), 1..24),
    ) {
        // Requests drawn again and again from a few, so retries (replays) are common, some
        // with their body changed under the same key (mismatches).
        let requests: Vec<Hostile> = order
            .iter()
            .map(|(i, changed)| {
                let mut hostile = distinct[i.index(distinct.len())].clone();
                if *changed {
                    hostile.body.push(b'!');
                }
                hostile
            })
            .collect();
        let handler = Handler::default();
        let app = app(handler.clone());
        let mut model: HashMap<ScopedKey, (Seen, Bytes)> = HashMap::new();
        runtime().block_on(async {
            for hostile in &requests {
                let answer = Answer::read(app.clone().oneshot(hostile.request()).await.unwrap()).await;
                let problem = answer.problem();
                let side_effect = hostile.method == Method::POST || hostile.method == Method::PATCH;
                if !side_effect {
                    assert!(answer.by_handler() && problem.is_none(), "{hostile:?}: {answer:?}");
                    continue;
                }
                let expected_problem = match hostile.keys.len() {
                    0 => Some(problem::KEY_MISSING),
                    1 => match parse(&hostile.keys[0]) {
                        Err(_) => Some(problem::KEY_INVALID),
                        Ok(_) if hostile.auth.is_empty() => Some(problem::SCOPE_MISSING),
                        Ok(_) if hostile.declares_too_much() => Some(problem::BODY_TOO_LARGE),
                        Ok(_) => None,
                    },
                    _ => Some(problem::KEY_INVALID),
                };
                if let Some(expected) = expected_problem {
                    assert_eq!(problem.as_deref(), Some(expected), "{hostile:?}: {answer:?}");
                    assert!(!answer.by_handler());
                    continue;
                }
                let key = parse(&hostile.keys[0]).unwrap().as_str().to_owned();
                let seen = (hostile.method.clone(), hostile.path.clone(), hostile.body.clone());
                match model.get(&(hostile.auth.clone(), key.clone())) {
                    None => {
                        assert!(
                            answer.status == StatusCode::CREATED && answer.by_handler() && !answer.replayed(),
                            "{hostile:?}: {answer:?}"
                        );
                        model.insert((hostile.auth.clone(), key), (seen, answer.body.clone()));
                    }
                    Some((first, body)) if *first == seen => {
                        assert!(
                            answer.status == StatusCode::CREATED && answer.replayed() && !answer.by_handler(),
                            "{hostile:?}: {answer:?}"
                        );
                        assert_eq!(&answer.body, body);
                        assert_eq!(answer.headers.get(CONTENT_TYPE).unwrap(), "text/plain");
                    }
                    Some(_) => {
                        assert_eq!(problem.as_deref(), Some(problem::PAYLOAD_MISMATCH), "{hostile:?}: {answer:?}");
                    }
                }
            }
        });
        for (scope_key, runs) in handler.runs.lock().unwrap().iter() {
            prop_assert_eq!(*runs, 1, "{:?} ran {} times", scope_key, runs);
        }
        prop_assert_eq!(handler.runs.lock().unwrap().len(), model.len());
    }

    /// Concurrent duplicates of one hostile-but-valid request: the handler runs once, the
    /// others are told it is in flight or get its replay.
    #[test]
    fn concurrent_duplicates_run_the_handler_once(
        key in visible_key(MAX_KEY_LEN),
        credential in header_bytes(40).prop_filter("a credential", |c| !c.is_empty()),
        body in proptest::collection::vec(any::<u8>(), 0..300),
        copies in 2usize..12,
        dawdle in 0usize..8,
    ) {
        let handler = Handler { dawdle, ..Handler::default() };
        let app = app(handler.clone());
        let answers = runtime().block_on(async {
            let mut tasks = tokio::task::JoinSet::new();
            for _ in 0..copies {
                let req = Request::post("/charges")
                    .header("idempotency-key", header_value(&sf_string(key.as_bytes())))
                    .header(AUTHORIZATION, header_value(&credential))
                    .body(Body::from(body.clone()))
                    .unwrap();
                let app = app.clone();
                tasks.spawn(async move { Answer::read(app.oneshot(req).await.unwrap()).await });
            }
            tasks.join_all().await
        });
        prop_assert_eq!(handler.total.load(Ordering::SeqCst), 1);
        let mut ran = 0;
        for answer in &answers {
            match answer.problem() {
                Some(kind) => prop_assert_eq!(kind, problem::IN_FLIGHT),
                None if answer.by_handler() => ran += 1,
                None => prop_assert!(answer.replayed(), "{:?}", answer),
            }
        }
        prop_assert_eq!(ran, 1);
    }
}

#[test]
fn huge_headers_and_bodies_get_clear_refusals() {
    runtime().block_on(async {
        let handler = Handler::default();
        let app = app(handler.clone());
        let send = |req: Request<Body>| {
            let app = app.clone();
            async move { Answer::read(app.oneshot(req).await.unwrap()).await }
        };
        let post = || Request::post("/charges").header(AUTHORIZATION, "Bearer a");

        // A megabyte of key.
        let answer = send(
            post()
                .header("idempotency-key", "k".repeat(1 << 20))
                .body(Body::from("{}"))
                .unwrap(),
        )
        .await;
        assert_eq!(answer.problem().as_deref(), Some(problem::KEY_INVALID));
        assert_eq!(answer.status, StatusCode::BAD_REQUEST);

        // A thousand copies of the key header.
        let mut req = post();
        for _ in 0..1000 {
            req = req.header("idempotency-key", "\"k\"");
        }
        let answer = send(req.body(Body::from("{}")).unwrap()).await;
        assert_eq!(answer.problem().as_deref(), Some(problem::KEY_INVALID));
        let reason: Value = serde_json::from_slice(&answer.body).unwrap();
        assert_eq!(reason["reason"], "repeated");

        // A body over the limit, truthfully declared or not.
        for length in [None, Some("1"), Some("garbage")] {
            let mut req = post().header("idempotency-key", "\"big\"");
            if let Some(length) = length {
                req = req.header(CONTENT_LENGTH, length);
            }
            let answer = send(req.body(Body::from(vec![b'x'; (1 << 20) + 1])).unwrap()).await;
            assert_eq!(
                answer.problem().as_deref(),
                Some(problem::BODY_TOO_LARGE),
                "{length:?}"
            );
        }
        // A declared length of u64::MAX with a tiny body.
        let answer = send(
            post()
                .header("idempotency-key", "\"big\"")
                .header(CONTENT_LENGTH, u64::MAX.to_string())
                .body(Body::from("{}"))
                .unwrap(),
        )
        .await;
        assert_eq!(answer.problem().as_deref(), Some(problem::BODY_TOO_LARGE));
        // The refused key was never used: the same key now runs.
        let answer = send(
            post()
                .header("idempotency-key", "\"big\"")
                .body(Body::from("{}"))
                .unwrap(),
        )
        .await;
        assert!(answer.by_handler(), "{answer:?}");
        assert_eq!(handler.total.load(Ordering::SeqCst), 1);
    });
}
