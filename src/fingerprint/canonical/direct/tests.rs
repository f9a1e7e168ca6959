//! The direct writer against the `Value` path: the same bytes, or the same error, for
//! every input; and no fallback for the common shapes of arguments.

use std::collections::{BTreeMap, HashMap};

use proptest::prelude::*;
use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;
use serde_json::Value;

use super::Writer;
use crate::fingerprint::canonical::{freeze, tests::json, to_bytes};

/// The direct writer's bytes, `None` where it gives up.
fn direct<T: Serialize + ?Sized>(value: &T) -> Option<Vec<u8>> {
    let mut writer = Writer::default();
    value.serialize(&mut writer).ok()?;
    Some(writer.finish().to_vec())
}

/// `to_bytes` says what the `Value` path says: the same bytes or the same error.
fn same_as_value_path<T: Serialize + ?Sized>(value: &T) -> Result<(), TestCaseError> {
    match (to_bytes(value), freeze(value)) {
        (Ok(ours), Ok((theirs, _))) => prop_assert_eq!(ours, theirs),
        (Err(ours), Err(theirs)) => prop_assert_eq!(ours.to_string(), theirs.to_string()),
        (ours, theirs) => prop_assert!(false, "{ours:?} but {theirs:?}"),
    }
    if let Some(direct) = direct(value) {
        prop_assert_eq!(&direct[..], &freeze(value).unwrap().0[..]);
    }
    Ok(())
}

/// JSON with plain keys and any finite or non-finite float: the writer's own ground.
fn plain_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        Just(Value::from(-0.0)),
        any::<String>().prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::vec(("[a-z_0-9]{0,6}", inner), 0..6)
                .prop_map(|fields| Value::Object(fields.into_iter().collect())),
        ]
    })
}

#[derive(Clone, Debug, Serialize)]
struct Charge {
    order_id: String,
    amount_cents: u64,
    currency: String,
    refund: Option<f32>,
    tags: Vec<String>,
    limits: HashMap<u16, i8>,
    kind: Kind,
    at: (i128, u128),
    nested: Nested,
}

#[derive(Clone, Debug, Serialize)]
struct Nested {
    z: bool,
    a: Vec<Kind>,
    m: Meters,
}

#[derive(Clone, Debug, Serialize)]
struct Meters(f64);

#[derive(Clone, Debug, Serialize)]
enum Kind {
    Unit,
    Newtype(i32),
    Tuple(u8, String),
    Struct { y: i64, x: char },
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        Just(Kind::Unit),
        any::<i32>().prop_map(Kind::Newtype),
        (any::<u8>(), ".{0,4}").prop_map(|(a, b)| Kind::Tuple(a, b)),
        (any::<i64>(), any::<char>()).prop_map(|(y, x)| Kind::Struct { y, x }),
    ]
}

fn charge() -> impl Strategy<Value = Charge> {
    let head = (".{0,12}", any::<u64>(), "[a-z]{3}", any::<Option<f32>>());
    let tail = (
        prop::collection::vec(".{0,6}", 0..4),
        prop::collection::hash_map(any::<u16>(), any::<i8>(), 0..4),
        kind(),
        (-(1_i128 << 70)..1 << 70, 0..1_u128 << 70),
        (
            any::<bool>(),
            prop::collection::vec(kind(), 0..3),
            any::<f64>(),
        ),
    );
    (head, tail).prop_map(
        |((order_id, amount_cents, currency, refund), (tags, limits, kind, at, nested))| Charge {
            order_id,
            amount_cents,
            currency,
            refund,
            tags,
            limits,
            kind,
            at,
            nested: Nested {
                z: nested.0,
                a: nested.1,
                m: Meters(nested.2),
            },
        },
    )
}

proptest! {
    #[test]
    fn json_values_freeze_as_the_value_path_does(value in json()) {
        same_as_value_path(&value)?;
    }

    #[test]
    fn plain_json_is_written_directly(value in plain_json()) {
        same_as_value_path(&value)?;
        prop_assert!(direct(&value).is_some(), "gave up on {value}");
    }

    #[test]
    fn typed_arguments_freeze_as_the_value_path_does(charge in charge()) {
        same_as_value_path(&charge)?;
        let (at, i64s) = (charge.at, i128::from(i64::MIN)..=i128::from(u64::MAX));
        if i64s.contains(&at.0) && at.1 <= u128::from(u64::MAX) {
            prop_assert!(direct(&charge).is_some(), "gave up on {charge:?}");
        }
    }

    #[test]
    fn maps_freeze_as_the_value_path_does(
        chars in prop::collection::btree_map(any::<char>(), any::<u8>(), 0..6),
        flags in prop::collection::btree_map(any::<bool>(), any::<i16>(), 0..2),
        floats in prop::collection::vec((any::<f64>(), any::<u8>()), 0..3),
        large in prop::collection::hash_map("[a-z]{1,3}", any::<u8>(), 0..48),
        repeats in prop::collection::vec(("[a-c]{1,2}", any::<u8>()), 0..48),
    ) {
        same_as_value_path(&chars)?;
        same_as_value_path(&flags)?;
        same_as_value_path(&Entries(floats))?;
        // Small and large objects are put in order two ways; both find repeated keys.
        same_as_value_path(&large)?;
        prop_assert!(direct(&large).is_some());
        same_as_value_path(&Entries(repeats))?;
    }
}

/// A map serialized entry by entry as listed: repeated keys and any key type.
#[derive(Debug)]
struct Entries<K, V>(Vec<(K, V)>);

impl<K: Serialize, V: Serialize> Serialize for Entries<K, V> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (key, value) in &self.0 {
            map.serialize_entry(key, value)?;
        }
        map.end()
    }
}

/// Bytes, as `serde_bytes` would hand them over.
struct Raw(&'static [u8]);

impl Serialize for Raw {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(self.0)
    }
}

#[test]
fn edge_cases_freeze_as_the_value_path_does() {
    let check = |result: Result<(), TestCaseError>| result.unwrap();
    // Repeated keys: the last value, as the `Value` path keeps it.
    check(same_as_value_path(&Entries(vec![
        ("b", 1),
        ("a", 2),
        ("b", 3),
    ])));
    check(same_as_value_path(&Entries(vec![("a", 1), ("a", 2)])));
    // A key before its own extensions, whatever byte extends it (the quote that ends the
    // shorter one sorts nowhere).
    check(same_as_value_path(&Entries(vec![
        ("a!", 1),
        ("a", 2),
        (" ", 3),
        ("", 4),
    ])));
    assert_eq!(
        direct(&Entries(vec![("a!", 1), ("a", 2), (" ", 3), ("", 4)])).unwrap(),
        br#"{"":4," ":3,"a":2,"a!":1}"#
    );
    // Keys needing escapes, sorted by their own bytes rather than their spelling.
    check(same_as_value_path(&Entries(vec![
        ("\"", 1),
        ("!", 2),
        ("\u{1}", 3),
    ])));
    // Keys the `Value` path refuses or spells itself.
    check(same_as_value_path(&Entries(vec![(vec![1], 1)])));
    check(same_as_value_path(&Entries(vec![(f64::NAN, 1)])));
    check(same_as_value_path(&Entries(vec![(Some(1), 1)])));
    check(same_as_value_path(&Entries(vec![
        (u128::MAX, 1),
        (1_u128, 2),
    ])));
    // Numbers out of `u64`/`i64`, non-finite and negative-zero floats, f32 widened.
    check(same_as_value_path(&(u128::MAX, i128::MIN)));
    check(same_as_value_path(&(
        f64::NAN,
        f64::INFINITY,
        -0.0_f64,
        -0.0_f32,
        0.1_f32,
    )));
    check(same_as_value_path(&Raw(b"\x00\xff")));
    check(same_as_value_path(&(
        (),
        Some(()),
        None::<u8>,
        'é',
        "\u{7f}\"",
    )));
    check(same_as_value_path(&BTreeMap::from([(
        "k",
        Entries(vec![("b", 1), ("a", 2)]),
    )])));
}

#[test]
fn nested_objects_are_each_put_in_order() {
    let value = serde_json::json!({"z": {"y": 1, "b": [{"d": 1, "c": 2}]}, "a": {}});
    let bytes = direct(&value).expect("written directly");
    assert_eq!(bytes, br#"{"a":{},"z":{"b":[{"c":2,"d":1}],"y":1}}"#);
}
