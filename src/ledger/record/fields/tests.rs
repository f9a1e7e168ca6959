use http::Method;
use proptest::prelude::*;
use serde_json::{json, Value};

use super::*;
use crate::{fingerprint::Fingerprint, Drift};

fn changed(old: &[u8], new: &[u8]) -> Option<Vec<String>> {
    FieldDigests::of(old)?.changed_fields(new)
}

/// What a comparison of the parsed bodies names.
fn parsed(old: &[u8], new: &[u8]) -> Option<Vec<String>> {
    let fp = Fingerprint::of(&Method::POST, "/", b"");
    Drift::between(fp, old, fp, new)
        .changed_fields()
        .map(<[String]>::to_vec)
}

#[test]
fn names_changed_added_and_removed_fields() {
    let old = br#"{"order_id":"ord_8f21c3","summary":"a","total_cents":1,"gone":true}"#;
    let new = br#"{"order_id":"ord_8f21c3","summary":"b","total_cents":1,"fresh":1}"#;
    assert_eq!(changed(old, new).unwrap(), ["fresh", "gone", "summary"]);
}

#[test]
fn layout_and_spelling_are_no_change() {
    let old = br#" { "a\"b" : "x\\\"}y" , "n": {"k": [1, "]", {"z": "}"}], "j": 1.50}, "caf\u00e9": "\u00e9" } "#;
    let new = "{\"a\\\"b\":\"x\\\\\\\"}y\",\"n\":{\"j\":1.5,\"k\":[1,\"]\",{\"z\":\"}\"}]},\"café\":\"é\"}";
    assert_eq!(changed(old, new.as_bytes()).unwrap(), Vec::<String>::new());
    assert_eq!(parsed(old, new.as_bytes()).unwrap(), Vec::<String>::new());
    let moved = br#"{"a\"b":"x\\\"}y","n":{"k":[1,"]",{"z":"{"}],"j":1.5},"caf\u00e9":"e"}"#;
    assert_eq!(changed(old, moved).unwrap(), ["café", "n"]);
}

#[test]
fn the_last_of_a_repeated_name_counts() {
    let old = br#"{"a":1,"a":2}"#;
    assert_eq!(changed(old, br#"{"a":2}"#).unwrap(), Vec::<String>::new());
    assert_eq!(changed(old, br#"{"a":1}"#).unwrap(), ["a"]);
    assert_eq!(parsed(old, br#"{"a":1}"#).unwrap(), ["a"]);
}

#[test]
fn bodies_that_are_not_objects_have_no_fields() {
    for body in [
        &b""[..],
        b"[1]",
        b"\"s\"",
        b"{",
        b"{\"a\"}",
        b"{\"a\":1,}",
        b"{\"a\":1} x",
        b"{\"a\":\"unterminated}",
        b"{\"a\":tru}",
        b"{\"a\":[1,}",
    ] {
        assert!(FieldDigests::of(body).is_none(), "{body:?}");
    }
    assert_eq!(changed(b"{}", b"{}").unwrap(), Vec::<String>::new());
    assert!(changed(b"{}", b"nope").is_none());
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        (-1e6f64..1e6).prop_map(Value::from),
        "[ -~é\"\\\\\n]{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            proptest::collection::btree_map("[a-z\"]{1,3}", inner, 0..4)
                .prop_map(|map| Value::Object(map.into_iter().collect())),
        ]
    })
}

proptest! {
    /// Long strings (digested 32 bytes at a time, then the rest) read alike however they are
    /// escaped, and a change of any one byte of one names its field.
    #[test]
    fn long_strings_read_alike_escaped_and_a_changed_byte_names_them(
        text in "[a-y]{0,200}",
        at in any::<proptest::sample::Index>(),
    ) {
        let plain = format!(r#"{{"s":"{text}","n":1}}"#);
        let escaped: String = text.chars().map(|c| format!("\\u{:04x}", c as u32)).collect();
        let escaped = format!(r#"{{"s":"{escaped}","n":1}}"#);
        prop_assert_eq!(changed(plain.as_bytes(), escaped.as_bytes()).unwrap(), Vec::<String>::new());
        if !text.is_empty() {
            let mut other = text.into_bytes();
            let at = at.index(other.len());
            other[at] += 1;
            let other = format!(r#"{{"s":"{}","n":1}}"#, String::from_utf8(other).unwrap());
            prop_assert_eq!(changed(plain.as_bytes(), other.as_bytes()).unwrap(), ["s"]);
        }
    }

    /// Against a comparison of the parsed bodies: the same fields named, whatever the
    /// nesting, escaping and layout.
    #[test]
    fn names_the_fields_a_parser_finds(
        old in proptest::collection::btree_map("[a-z\"\\\\é]{1,4}", json_value(), 0..6),
        new in proptest::collection::btree_map("[a-z\"\\\\é]{1,4}", json_value(), 0..6),
        keep in any::<bool>(),
        pretty in any::<bool>(),
    ) {
        let new = if keep { old.clone() } else { new };
        let old_body = serde_json::to_vec(&old).unwrap();
        let new_body = if pretty {
            serde_json::to_vec_pretty(&new)
        } else {
            serde_json::to_vec(&new)
        }
        .unwrap();
        prop_assert_eq!(changed(&old_body, &new_body), parsed(&old_body, &new_body));
    }

    /// The digests gathered at a face's defining pointers tell a change at each of them
    /// as a comparison of the parsed bodies does (what a store that keeps the whole request
    /// lets a face find), at any depth; and they name no field of their own.
    #[test]
    fn pointer_digests_tell_a_change_as_the_parsed_bodies_do(
        old in proptest::collection::btree_map("[ab]", json_value(), 0..3),
        new in proptest::collection::btree_map("[ab]", json_value(), 0..3),
        keep in any::<bool>(),
        pointers in proptest::collection::vec("(/[ab01]){1,3}", 1..4),
    ) {
        let new = if keep { old.clone() } else { new };
        let old_body = serde_json::to_vec(&old).unwrap();
        let new_body = serde_json::to_vec_pretty(&new).unwrap();
        let fields = crate::fingerprint::PayloadFields::new(pointers).unwrap();
        let mut gathered = Gathered::new();
        prop_assert!(gathered.of_body(&old_body));
        gathered.of_pointers(&old_body, &fields);
        let digests = FieldDigests::from_entries(gathered.entries());
        // As a face sees them: parsed from the bytes.
        let old: Value = serde_json::from_slice(&old_body).unwrap();
        let new: Value = serde_json::from_slice(&new_body).unwrap();
        for pointer in fields.pointers() {
            prop_assert_eq!(
                digests.pointer_changed(pointer, &new),
                Some(old.pointer(pointer) != new.pointer(pointer)),
                "{}", pointer
            );
        }
        prop_assert_eq!(digests.changed_fields(&new_body), parsed(&old_body, &new_body));
    }

    /// Wherever its end falls against the blocks and words it is read in, a string is
    /// found to end at its quote, digested as its contents are, or found escaped.
    #[test]
    fn finds_the_end_of_a_string_of_any_length(len in 0usize..100, end in prop_oneof![Just(b'"'), Just(b'\\')]) {
        let mut body = b"\"".to_vec();
        body.extend((0..len).map(|n| b'a' + (n % 26) as u8));
        body.push(end);
        body.extend_from_slice(b"x\"tail");
        let (at, plain) = plain_string(&body, 1).unwrap();
        if end == b'"' {
            prop_assert_eq!(at, 1 + len);
            prop_assert_eq!(plain, Some(digest(STRING_SEED, &body[1..1 + len])));
        } else {
            prop_assert_eq!(at, 1 + len + 2);
            prop_assert_eq!(plain, None);
        }
    }

    /// Words of eight, then `memchr`: the same first `"` or `\\` as a byte at a time, in
    /// strings mostly of letters, whatever falls where.
    #[test]
    fn finds_the_first_quote_or_backslash(
        bytes in proptest::collection::vec(
            prop_oneof![8 => b'a'..=b'z', 1 => Just(b'"'), 1 => Just(b'\\'), 1 => any::<u8>()],
            0..80,
        )
    ) {
        let naive = bytes.iter().position(|b| *b == b'"' || *b == b'\\');
        prop_assert_eq!(quote_or_backslash(&bytes), naive);
    }

    #[test]
    fn finds_the_first_quote(bytes in proptest::collection::vec(any::<u8>(), 0..40)) {
        prop_assert_eq!(find_quote(&bytes), bytes.iter().position(|b| *b == b'"'));
    }
}

#[test]
fn a_flat_payload_is_summed_up_in_a_few_bytes_a_field() {
    let body = serde_json::to_vec(&json!({
        "order_id": "order_000000000001",
        "summary": "x".repeat(1000),
    }))
    .unwrap();
    let fields = FieldDigests::of(&body).unwrap();
    assert_eq!(
        fields.0.len(),
        2 * (2 + DIGEST_LEN) + "order_id".len() + "summary".len()
    );
}

#[test]
fn many_fields_are_all_kept() {
    let body = |changed: usize| {
        let fields: serde_json::Map<String, Value> = (0..40)
            .map(|n| {
                (
                    format!("field_{n:02}"),
                    json!(n + usize::from(n == changed)),
                )
            })
            .collect();
        serde_json::to_vec(&Value::Object(fields)).unwrap()
    };
    let fields = FieldDigests::of(&body(usize::MAX)).unwrap();
    assert_eq!(fields.0.len(), 40 * (2 + DIGEST_LEN + "field_00".len()));
    assert_eq!(fields.changed_fields(&body(37)).unwrap(), ["field_37"]);
    assert_eq!(
        fields.changed_fields(&body(usize::MAX)).unwrap(),
        Vec::<String>::new()
    );
}

/// Every byte of a value is read, wherever it falls against the blocks, the words and the
/// last word padded with zeros: a value of any length up to four blocks and a half digests
/// apart from itself with any one byte changed, from itself one byte longer, and from the
/// same bytes as the other kind of value.
#[test]
fn every_byte_and_the_length_count() {
    let mut seen = std::collections::HashSet::new();
    for len in 0..=144 {
        let value: Vec<u8> = (0..len).map(|n| b'a' + (n % 26) as u8).collect();
        let as_string = digest(STRING_SEED, &value);
        assert!(seen.insert(as_string), "length {len}: a digest seen before");
        assert_ne!(as_string, digest(VALUE_SEED, &value), "length {len}");
        for at in 0..len {
            let mut changed = value.clone();
            changed[at] ^= 0x01;
            assert_ne!(
                as_string,
                digest(STRING_SEED, &changed),
                "length {len}, byte {at}"
            );
        }
        let mut longer = value.clone();
        longer.push(0);
        assert_ne!(
            as_string,
            digest(STRING_SEED, &longer),
            "length {len}, a zero added"
        );
    }
}
