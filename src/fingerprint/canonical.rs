//! Canonical JSON: the one byte form of a tool call's arguments and of a payload's
//! defining fields.
//!
//! Arguments are frozen as JSON with every object's keys sorted (by their UTF-8 bytes), no
//! whitespace, and numbers as `serde_json` writes them (`-0.0` written as `0.0`, which it
//! equals). Equal values therefore freeze to equal bytes whatever the order a map or a
//! struct listed its fields in, and whatever whitespace a model put in a JSON string it was
//! parsed from: field order and formatting never make drift.
//!
//! "As `serde_json` writes them" holds for an `f32` too: it freezes as the number its JSON
//! holds, its shortest decimal that reads back as the same `f32` (`19.9_f32` freezes as
//! `19.9`, not as the `f64` it widens to, `19.899999618530273`), spelled as that decimal
//! parsed into a `serde_json::Value` is. So a typed call and the JSON it is written as
//! (what a model emits, what a resumed run parses) are one operation. A float that is not finite freezes
//! as `null`, as `serde_json` writes it; the tool face refuses arguments that do not read
//! back as themselves.

use std::cell::RefCell;

use bytes::Bytes;
use serde::Serialize;
use serde_json::{Map, Number, Value};

use crate::swar::{bytes_below, bytes_equal};

mod direct;

/// The most buffer memory a thread keeps between calls of [`to_bytes`].
const KEEP: usize = 64 * 1024;

/// `value` as canonical JSON bytes: those of [`freeze`], written straight from `value`
/// into a buffer the thread keeps (no JSON value is built, the buffers are reused), then
/// copied out, one allocation of exactly their size. Whatever the direct writer does
/// not spell itself (see its module), [`freeze`] does.
pub(crate) fn to_bytes<T: Serialize + ?Sized>(value: &T) -> Result<Bytes, serde_json::Error> {
    thread_local! {
        static WRITER: RefCell<direct::Writer> = RefCell::default();
    }
    let direct = WRITER
        .try_with(|writer| {
            // Already borrowed only if `value`'s own serialization freezes something.
            let mut writer = writer.try_borrow_mut().ok()?;
            writer.clear();
            let written = value.serialize(&mut *writer).ok();
            let bytes = written.map(|()| writer.finish());
            writer.trim(KEEP);
            bytes
        })
        .ok()
        .flatten();
    match direct {
        Some(bytes) => Ok(bytes),
        None => freeze(value).map(|(bytes, _)| bytes),
    }
}

/// `value` as canonical JSON bytes, and as the JSON value they were written from.
///
/// The value is read from the JSON `serde_json` writes for `value`, not made by
/// `serde_json::to_value`: that one widens an `f32` to the `f64` it stands for, and the
/// `f32`'s own shortest spelling, the one its JSON carries, would be lost (with
/// `float_roundtrip`, reading a float back is exact, so nothing else changes).
pub(crate) fn freeze<T: Serialize + ?Sized>(
    value: &T,
) -> Result<(Bytes, Value), serde_json::Error> {
    let value: Value = serde_json::from_slice(&serde_json::to_vec(value)?)?;
    let mut out = Vec::with_capacity(64);
    write(&value, &mut out);
    Ok((Bytes::from(out), value))
}

/// The number serde_json writes for `value`: the `f32`'s shortest decimal that reads back
/// as it, as the `f64` nearest that decimal (`19.9`, where widening gives
/// `19.899999618530273`). What a typed call's JSON holds, so the typed call and its JSON
/// freeze alike. Non-finite stays non-finite (frozen as `null`).
pub(crate) fn f32_as_written(value: f32) -> f64 {
    // An `f32` takes at most 16 bytes of JSON (`-1.17549435e-38`): written on the stack.
    let mut buffer = [0_u8; 32];
    let mut cursor = std::io::Cursor::new(&mut buffer[..]);
    let written = serde_json::to_writer(&mut cursor, &value).is_ok();
    let len = usize::try_from(cursor.position()).unwrap_or(0);
    let decimal = std::str::from_utf8(&buffer[..len]).ok().filter(|_| written);
    // `null` (not finite) does not parse: widened, it stays what it was.
    decimal
        .and_then(|text| text.parse().ok())
        .unwrap_or(f64::from(value))
}

/// Appends `value` to `out` as canonical JSON.
pub(crate) fn write(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(number) => write_number(number, out),
        Value::String(text) => write_string(text, out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write(item, out);
            }
            out.push(b']');
        }
        Value::Object(fields) => write_object(fields, out),
    }
}

/// Keys sorted here rather than trusted to the map: with `serde_json`'s `preserve_order`
/// feature (which any crate in a build may turn on) a `Map` keeps insertion order.
fn write_object(fields: &Map<String, Value>, out: &mut Vec<u8>) {
    let mut sorted: Vec<(&String, &Value)> = fields.iter().collect();
    sorted.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    out.push(b'{');
    for (i, (key, value)) in sorted.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_string(key, out);
        out.push(b':');
        write(value, out);
    }
    out.push(b'}');
}

fn write_number(number: &Number, out: &mut Vec<u8>) {
    // `-0.0 == 0.0`: equal values, one spelling.
    if number.as_f64() == Some(0.0) && number.is_f64() {
        out.extend_from_slice(b"0.0");
        return;
    }
    // Written as `Display` spells it (serde_json formats both alike), without a `String`.
    serde_json::to_writer(&mut *out, number).expect("writing to a Vec never fails");
}

fn write_string(text: &str, out: &mut Vec<u8>) {
    // serde_json's escaping is deterministic: one spelling per string. It escapes only the
    // quote, the backslash and the control characters, so a string holding none of them
    // (most argument values) is spelled as its own bytes between quotes: copied whole
    // instead of escaped byte by byte, the same bytes either way.
    if needs_no_escape(text.as_bytes()) {
        out.reserve(text.len() + 2);
        out.push(b'"');
        out.extend_from_slice(text.as_bytes());
        out.push(b'"');
        return;
    }
    serde_json::to_writer(&mut *out, text).expect("writing to a Vec never fails");
}

/// Whether `bytes` holds no byte that JSON requires escaped (`"`, `\\`, below `0x20`).
/// Short strings (most keys and many values) as two words; longer ones in one pass over
/// all of it without an early exit (a string needing an escape is rare), a reduction the
/// compiler turns into vector compares: folded as `bool`s, which it keeps as the compares'
/// own masks (as `u8`s it masks each compare down to `0`/`1` first), 64 bytes at a time
/// (fewer instructions per byte than one fold over the whole slice).
fn needs_no_escape(bytes: &[u8]) -> bool {
    fn any_escape(bytes: &[u8]) -> bool {
        bytes.iter().fold(false, |any, &b| {
            any | (b < 0x20) | (b == b'"') | (b == b'\\')
        })
    }
    if bytes.len() <= 16 {
        return !short_has_escape(bytes);
    }
    let mut chunks = bytes.chunks_exact(64);
    let mut any = false;
    for chunk in &mut chunks {
        any |= any_escape(chunk);
    }
    !(any | any_escape(chunks.remainder()))
}

/// Whether `bytes` (16 at most) holds a byte JSON requires escaped: padded with `@` (which
/// it does not) to two words, each tested for a byte below `0x20`, a `"` and a `\\` by the
/// carry tricks that are exact for "is there any such byte" (a carry only ever spreads
/// from a byte that matched).
fn short_has_escape(bytes: &[u8]) -> bool {
    let mut padded = [b'@'; 16];
    padded[..bytes.len()].copy_from_slice(bytes);
    let has_escape = |word: &[u8]| {
        let word = u64::from_le_bytes(word.try_into().expect("eight bytes"));
        bytes_below(word, 0x20) | bytes_equal(word, b'"') | bytes_equal(word, b'\\') != 0
    };
    has_escape(&padded[..8]) | has_escape(&padded[8..])
}

/// The top-level fields of two frozen argument sets that differ (added, removed or
/// changed), sorted; `None` when either is not a JSON object.
pub(crate) fn changed_fields(first: &[u8], now: &[u8]) -> Option<Vec<String>> {
    let first: Map<String, Value> = serde_json::from_slice(first).ok()?;
    let now: Map<String, Value> = serde_json::from_slice(now).ok()?;
    let mut changed: Vec<String> = first
        .iter()
        .filter(|(key, value)| now.get(*key) != Some(*value))
        .map(|(key, _)| key.clone())
        .chain(now.keys().filter(|key| !first.contains_key(*key)).cloned())
        .collect();
    changed.sort_unstable();
    Some(changed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::{BTreeMap, HashMap};

    #[test]
    fn keys_are_sorted_and_whitespace_dropped() {
        let parsed: Value =
            serde_json::from_str("{ \"b\" : [1, {\"z\":1,\"a\":2}],\n \"a\": \"x\" }").unwrap();
        let (bytes, _) = freeze(&parsed).unwrap();
        assert_eq!(&bytes[..], br#"{"a":"x","b":[1,{"a":2,"z":1}]}"#);
    }

    proptest! {
        #[test]
        fn strings_are_spelled_as_serde_json_spells_them(text in any::<String>(), plain in "[ -~]{0,80}") {
            for text in [text, plain] {
                let mut ours = Vec::new();
                write_string(&text, &mut ours);
                prop_assert_eq!(ours, serde_json::to_vec(&text).unwrap());
            }
        }
    }

    proptest! {
        /// The escape check, short words and long vectors alike, against the plain rule.
        #[test]
        fn the_escape_check_finds_every_escape(bytes in prop::collection::vec(any::<u8>(), 0..160), pick in any::<prop::sample::Index>(), bad in prop_oneof![0_u8..0x20, Just(b'"'), Just(b'\\')]) {
            let plain = |bytes: &[u8]| !bytes.iter().any(|&b| b < 0x20 || b == b'"' || b == b'\\');
            let clean: Vec<u8> = bytes.iter().map(|&b| if plain(&[b]) { b } else { b'a' }).collect();
            prop_assert!(needs_no_escape(&clean));
            prop_assert_eq!(needs_no_escape(&bytes), plain(&bytes));
            for len in 1..=clean.len().min(40) {
                let mut one = clean[..len].to_vec();
                one[pick.index(len)] = bad;
                prop_assert!(!needs_no_escape(&one), "{:?}", one);
            }
        }
    }

    #[test]
    fn escaped_strings_are_spelled_as_serde_json_spells_them() {
        for text in [
            "a\"b",
            "back\\slash",
            "tab\there",
            "\u{1}",
            "sixteen bytes ok\n",
            "\u{7f}é",
        ] {
            let mut ours = Vec::new();
            write_string(text, &mut ours);
            assert_eq!(ours, serde_json::to_vec(text).unwrap(), "{text:?}");
        }
    }

    #[test]
    fn an_f32_freezes_as_serde_json_writes_it() {
        assert_eq!(&to_bytes(&19.9_f32).unwrap()[..], b"19.9");
        assert_eq!(&freeze(&19.9_f32).unwrap().0[..], b"19.9");
        assert_eq!(
            &to_bytes(&[0.1_f32, -0.0, 3.0]).unwrap()[..],
            b"[0.1,0.0,3.0]"
        );
        assert_eq!(
            to_bytes(&19.9_f32).unwrap(),
            to_bytes(&serde_json::from_str::<Value>("19.9").unwrap()).unwrap()
        );
    }

    #[test]
    fn an_f32_freezes_as_the_number_its_json_holds() {
        // serde_json writes this `f32` as `1.4829705e+13`; read into a `Value`, it is
        // written `14829705000000.0`: the frozen form is the number, spelled once.
        let json: Value =
            serde_json::from_slice(&serde_json::to_vec(&1.4829705e13_f32).unwrap()).unwrap();
        assert_eq!(
            to_bytes(&1.4829705e13_f32).unwrap(),
            to_bytes(&json).unwrap()
        );
        assert!(f32_as_written(f32::NAN).is_nan());
        assert_eq!(f32_as_written(-1.175_494_4e-38), -1.175_494_4e-38);
    }

    /// Arguments with floats of both widths, as code types them.
    #[derive(Serialize, serde::Deserialize)]
    struct Floats {
        wide: f64,
        narrow: f32,
        narrows: Vec<f32>,
    }

    proptest! {
        /// A typed call and its own JSON (as serde_json writes it, parsed back as a model's
        /// call or a resumed run's would be) freeze to the same bytes, through the direct
        /// writer and the `Value` path alike; an `f64` freezes as its `to_value` does too;
        /// and finite numbers read back from the frozen bytes as themselves.
        #[test]
        fn typed_floats_freeze_as_their_json(wide in any::<f64>(), narrow in any::<f32>()) {
            let typed = Floats { wide, narrow, narrows: vec![narrow, -narrow, narrow / 3.0] };
            let json: Value = serde_json::from_slice(&serde_json::to_vec(&typed).unwrap()).unwrap();
            let frozen = to_bytes(&typed).unwrap();
            prop_assert_eq!(&frozen, &freeze(&typed).unwrap().0);
            prop_assert_eq!(&frozen, &to_bytes(&json).unwrap());
            prop_assert_eq!(&frozen, &freeze(&json).unwrap().0);
            prop_assert_eq!(
                to_bytes(&wide).unwrap(),
                freeze(&serde_json::to_value(wide).unwrap()).unwrap().0
            );
            if wide.is_finite() && narrow.is_finite() {
                let back: Floats = serde_json::from_slice(&frozen).unwrap();
                prop_assert!(back.wide == wide && back.narrow == narrow);
                prop_assert_eq!(to_bytes(&back).unwrap(), frozen);
            }
        }
    }

    #[test]
    fn negative_zero_is_written_as_zero() {
        assert_eq!(freeze(&-0.0_f64).unwrap().0, freeze(&0.0_f64).unwrap().0);
    }

    #[test]
    fn changed_fields_name_added_removed_and_changed() {
        let changed = changed_fields(br#"{"a":1,"b":2,"c":3}"#, br#"{"a":1,"b":5,"d":4}"#);
        assert_eq!(changed.unwrap(), ["b", "c", "d"]);
        assert_eq!(changed_fields(b"[1]", b"{}"), None);
    }

    pub(super) fn json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            // Eighths: exact in binary and in short decimals, so parsing them back is exact
            // (serde_json parses other floats to within an ulp unless `float_roundtrip`).
            any::<i32>().prop_map(|i| Value::from(f64::from(i) / 8.0)),
            ".{0,8}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
                prop::collection::vec((".{0,6}", inner), 0..5)
                    .prop_map(|fields| Value::Object(fields.into_iter().collect())),
            ]
        })
    }

    proptest! {
        /// Equal values freeze to equal bytes, whatever order their fields came in and
        /// however they were formatted, and the bytes read back as the value.
        #[test]
        fn equal_values_freeze_to_equal_bytes(value in json(), seed in any::<u64>()) {
            let (bytes, _) = freeze(&value).unwrap();
            // Pretty-printed, then parsed back: whitespace never changes the freeze.
            let pretty: Value = serde_json::from_str(&serde_json::to_string_pretty(&value).unwrap()).unwrap();
            prop_assert_eq!(&freeze(&pretty).unwrap().0, &bytes);
            // Fields listed in another order (a HashMap's is random per map).
            let reordered = reorder(&value, seed);
            prop_assert_eq!(&freeze(&reordered).unwrap().0, &bytes);
            let back: Value = serde_json::from_slice(&bytes).unwrap();
            prop_assert_eq!(freeze(&back).unwrap().0, bytes);
        }

        /// A map type's iteration order never reaches the bytes.
        #[test]
        fn map_types_freeze_alike(fields in prop::collection::vec((".{0,6}", any::<i32>()), 0..8)) {
            let hashed: HashMap<String, i32> = fields.iter().cloned().collect();
            let sorted: BTreeMap<String, i32> = hashed.iter().map(|(k, v)| (k.clone(), *v)).collect();
            prop_assert_eq!(freeze(&hashed).unwrap().0, freeze(&sorted).unwrap().0);
        }
    }

    /// `value` with every object's fields rebuilt in a shuffled insertion order.
    fn reorder(value: &Value, seed: u64) -> Value {
        match value {
            Value::Array(items) => Value::Array(items.iter().map(|v| reorder(v, seed)).collect()),
            Value::Object(fields) => {
                let mut entries: Vec<(&String, &Value)> = fields.iter().collect();
                let mut rng = fastrand::Rng::with_seed(seed);
                rng.shuffle(&mut entries);
                Value::Object(
                    entries
                        .into_iter()
                        .map(|(k, v)| (k.clone(), reorder(v, seed)))
                        .collect(),
                )
            }
            other => other.clone(),
        }
    }
}
