//! The fields of a JSON payload that define its operation.
//!
//! An agent that re-runs a step regenerates its call: the `order_id` and the
//! `amount_cents` come from the task, but the `summary` is reworded and a fresh
//! `fulfillment_intent_id` is minted. Judged on the whole payload, the rerun is a
//! different request. Judged on [`PayloadFields`] — JSON pointers (RFC 6901) to the fields
//! that say *what* the operation is — it is the same operation with different wording.
//! AWS Powertools' payload validation works the same way: a JMESPath picks the part of an
//! event whose change is an error.
//!
//! The selection has a canonical encoding ([`PayloadFields::canonical`]): equal selections
//! give equal bytes whatever the field order or whitespace of the payloads, so it can be
//! digested and compared.

use std::fmt;

use serde_json::Value;

use super::canonical;
use crate::digest::BodyDigest;
use crate::ConfigError;

/// JSON pointers (RFC 6901) to the fields of a payload that define its operation; the
/// other fields (free text, ids minted per call) may change between runs without making
/// the payload a different operation.
///
/// A pointer names one field, at any depth (`/order_id`, `/customer/id`, `/items/0/sku`);
/// `""` is the whole payload. A field the payload lacks is part of the selection too:
/// adding or removing a defining field changes it.
///
/// ```
/// use serde_json::json;
/// use tower_idempotency::fingerprint::PayloadFields;
///
/// let fields = PayloadFields::new(["/order_id", "/amount_cents"]).unwrap();
/// let first = json!({"order_id": "order_42", "amount_cents": 1999, "summary": "Charge order 42"});
/// let rerun = json!({"summary": "Charging the customer for order 42", "amount_cents": 1999, "order_id": "order_42"});
/// assert!(fields.changed(&first, &rerun).is_empty()); // the same operation, reworded
/// assert_eq!(fields.canonical(&first), fields.canonical(&rerun));
///
/// let other = json!({"order_id": "order_42", "amount_cents": 2999});
/// assert_eq!(fields.changed(&first, &other), ["/amount_cents"]);
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PayloadFields {
    /// Sorted and without repeats, so two selections of the same fields encode alike.
    pointers: Vec<String>,
}

impl PayloadFields {
    /// The fields at `pointers`, each a JSON pointer: `""` or `/`-separated reference
    /// tokens, with `~0` for `~` and `~1` for `/` (RFC 6901). Refuses an empty list (it
    /// would make every payload the same operation; use `""` for the whole payload) and a
    /// malformed pointer.
    ///
    /// ```
    /// use tower_idempotency::fingerprint::PayloadFields;
    ///
    /// assert!(PayloadFields::new(["/order_id", "/line_items/0/sku"]).is_ok());
    /// assert!(PayloadFields::new(["order_id"]).is_err()); // a pointer starts with `/`
    /// assert!(PayloadFields::new(Vec::<String>::new()).is_err());
    /// ```
    pub fn new<I, P>(pointers: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = P>,
        P: Into<String>,
    {
        let mut pointers: Vec<String> = pointers.into_iter().map(Into::into).collect();
        if pointers.is_empty() {
            return Err(ConfigError::new(
                "payload fields need at least one JSON pointer (\"\" selects the whole payload)",
            ));
        }
        if let Some(bad) = pointers.iter().find(|pointer| !is_json_pointer(pointer)) {
            return Err(ConfigError::new(format!(
                "{bad:?} is not a JSON pointer: it must be \"\" or start with '/', with '~' \
                 only as \"~0\" or \"~1\""
            )));
        }
        pointers.sort();
        pointers.dedup();
        Ok(Self { pointers })
    }

    /// The pointers, sorted.
    ///
    /// ```
    /// use tower_idempotency::fingerprint::PayloadFields;
    ///
    /// let fields = PayloadFields::new(["/b", "/a", "/b"]).unwrap();
    /// assert_eq!(fields.pointers().collect::<Vec<_>>(), ["/a", "/b"]);
    /// ```
    pub fn pointers(&self) -> impl Iterator<Item = &str> {
        self.pointers.iter().map(String::as_str)
    }

    /// The pointers whose fields differ between `old` and `new` (present in one only, or
    /// with unequal values), sorted.
    ///
    /// ```
    /// use serde_json::json;
    /// use tower_idempotency::fingerprint::PayloadFields;
    ///
    /// let fields = PayloadFields::new(["/customer/id", "/amount_cents"]).unwrap();
    /// let old = json!({"customer": {"id": "cus_1"}, "amount_cents": 100});
    /// let new = json!({"customer": {"id": "cus_2"}, "amount_cents": 100});
    /// assert_eq!(fields.changed(&old, &new), ["/customer/id"]);
    /// ```
    pub fn changed(&self, old: &Value, new: &Value) -> Vec<&str> {
        self.pointers()
            .filter(|pointer| old.pointer(pointer) != new.pointer(pointer))
            .collect()
    }

    /// The selection of `value`, canonically encoded: a JSON array holding, for each
    /// pointer in order, `[pointer, value]` when the field is present and `[pointer]` when
    /// it is not, with object members sorted by name and no whitespace. Equal selections
    /// give equal bytes; field order and whitespace in the payload never matter.
    ///
    /// ```
    /// use serde_json::json;
    /// use tower_idempotency::fingerprint::PayloadFields;
    ///
    /// let fields = PayloadFields::new(["/order", "/note"]).unwrap();
    /// let value = json!({"order": {"id": "o_1", "amount": 5}, "summary": "x"});
    /// assert_eq!(fields.canonical(&value), br#"[["/note"],["/order",{"amount":5,"id":"o_1"}]]"#);
    /// ```
    pub fn canonical(&self, value: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        out.push(b'[');
        for (n, pointer) in self.pointers.iter().enumerate() {
            if n > 0 {
                out.push(b',');
            }
            out.push(b'[');
            canonical::write(&Value::String(pointer.clone()), &mut out);
            if let Some(field) = value.pointer(pointer) {
                out.push(b',');
                canonical::write(field, &mut out);
            }
            out.push(b']');
        }
        out.push(b']');
        out
    }

    /// The SHA-256 of the [canonical](Self::canonical) selection of a JSON `body`; `None`
    /// when the body is not JSON.
    ///
    /// ```
    /// use tower_idempotency::fingerprint::PayloadFields;
    ///
    /// let fields = PayloadFields::new(["/order_id"]).unwrap();
    /// let a = fields.digest(br#"{"order_id":"o_1","summary":"first"}"#);
    /// let b = fields.digest(br#"{ "summary": "second", "order_id": "o_1" }"#);
    /// assert!(a.is_some());
    /// assert_eq!(a, b);
    /// assert_eq!(fields.digest(b"not json"), None);
    /// ```
    pub fn digest(&self, body: &[u8]) -> Option<BodyDigest> {
        let value: Value = serde_json::from_slice(body).ok()?;
        Some(BodyDigest::of(&self.canonical(&value)))
    }

    /// Whether a change to the top-level member `name` may change the selection: some
    /// pointer reaches into it (or selects the whole payload). How a change known only by
    /// its top-level field names is judged.
    ///
    /// ```
    /// use tower_idempotency::fingerprint::PayloadFields;
    ///
    /// let fields = PayloadFields::new(["/customer/id", "/a~1b"]).unwrap();
    /// assert!(fields.covers_member("customer"));
    /// assert!(fields.covers_member("a/b"));
    /// assert!(!fields.covers_member("summary"));
    /// ```
    pub fn covers_member(&self, name: &str) -> bool {
        self.pointers_into(name).next().is_some()
    }

    /// The pointers that reach into the top-level member `name` (or select the whole
    /// payload).
    pub(crate) fn pointers_into<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> {
        self.pointers().filter(move |pointer| {
            let Some(rest) = pointer.strip_prefix('/') else {
                return true; // "": the whole payload
            };
            let first = rest.split('/').next().unwrap_or("");
            unescape(first) == name
        })
    }
}

impl fmt::Debug for PayloadFields {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("PayloadFields")
            .field(&self.pointers)
            .finish()
    }
}

/// RFC 6901: empty, or `/`-prefixed tokens in which `~` only starts `~0` or `~1`.
fn is_json_pointer(pointer: &str) -> bool {
    if pointer.is_empty() {
        return true;
    }
    if !pointer.starts_with('/') {
        return false;
    }
    let bytes = pointer.as_bytes();
    bytes
        .iter()
        .enumerate()
        .all(|(at, &byte)| byte != b'~' || matches!(bytes.get(at + 1), Some(b'0' | b'1')))
}

/// A reference token as the member name it stands for.
fn unescape(token: &str) -> String {
    // `~1` first would turn `~01` into `~1` and then `/`: RFC 6901 §4 decodes `~1` first
    // only because it then decodes `~0`, which cannot make a new `~1`.
    token.replace("~1", "/").replace("~0", "~")
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    #[test]
    fn a_missing_field_differs_from_a_null_one() {
        let fields = PayloadFields::new(["/note"]).unwrap();
        assert_ne!(
            fields.canonical(&json!({})),
            fields.canonical(&json!({"note": null}))
        );
        assert_eq!(
            fields.changed(&json!({}), &json!({"note": null})),
            ["/note"]
        );
    }

    #[test]
    fn escaped_pointers_reach_names_with_slashes_and_tildes() {
        let fields = PayloadFields::new(["/a~1b", "/c~0d"]).unwrap();
        let value = json!({"a/b": 1, "c~d": 2});
        assert_eq!(fields.canonical(&value), br#"[["/a~1b",1],["/c~0d",2]]"#);
        assert!(fields.covers_member("c~d"));
        assert!(PayloadFields::new(["/a~2"]).is_err());
        assert!(PayloadFields::new(["/a~"]).is_err());
    }

    #[test]
    fn the_whole_payload_covers_every_member() {
        let fields = PayloadFields::new([""]).unwrap();
        assert!(fields.covers_member("anything"));
        assert_eq!(fields.changed(&json!({"a": 1}), &json!({"a": 2})), [""]);
    }

    /// Any JSON value, a few levels deep.
    fn json_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            "[a-z ~/]{0,6}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map("[a-c]{1,2}", inner, 0..4)
                    .prop_map(|members| Value::Object(members.into_iter().collect())),
            ]
        })
    }

    /// `value` printed with its object members in reverse order and extra whitespace.
    fn reordered(value: &Value) -> String {
        match value {
            Value::Object(members) => {
                let mut printed: Vec<String> = members
                    .iter()
                    .map(|(name, member)| format!(" {} :\n {} ", json!(name), reordered(member)))
                    .collect();
                printed.reverse();
                format!("{{ {} }}", printed.join(" , "))
            }
            Value::Array(items) => format!(
                "[ {} ]",
                items.iter().map(reordered).collect::<Vec<_>>().join(" ,\t")
            ),
            scalar => scalar.to_string(),
        }
    }

    proptest! {
        #[test]
        fn field_order_and_whitespace_never_change_the_selection(
            value in json_value(),
            pointers in prop::collection::vec("(/[a-c]{1,2}){0,3}", 1..4),
        ) {
            let fields = PayloadFields::new(pointers).unwrap();
            let compact = serde_json::to_vec(&value).unwrap();
            let spaced = reordered(&value);
            prop_assert_eq!(fields.digest(&compact), fields.digest(spaced.as_bytes()));
            let reparsed: Value = serde_json::from_str(&spaced).unwrap();
            prop_assert!(fields.changed(&value, &reparsed).is_empty());
        }

        #[test]
        fn equal_encodings_mean_equal_selections(a in json_value(), b in json_value()) {
            let fields = PayloadFields::new(["/a", "/b/c", ""]).unwrap();
            let same = fields.canonical(&a) == fields.canonical(&b);
            prop_assert_eq!(same, fields.changed(&a, &b).is_empty());
        }
    }
}
