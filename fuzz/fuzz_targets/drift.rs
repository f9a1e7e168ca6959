//! The JSON drift report: two arbitrary bodies.
//!
//! Input: two bodies, the first two bytes giving the first one's length. The report never
//! panics nor overflows the stack (deep nesting), names fields only for two JSON objects,
//! and then names them sorted, once each, each present in one of the two bodies, and none
//! when the bodies are equal.
#![no_main]

use http::Method;
use libfuzzer_sys::fuzz_target;
use serde_json::{Map, Value};
use tower_idempotency::{Drift, fingerprint::Fingerprint};

fuzz_target!(|data: &[u8]| {
    let Some((len, rest)) = data.split_first_chunk::<2>() else {
        return;
    };
    let split = usize::from(u16::from_be_bytes(*len)).min(rest.len());
    let (old, new) = rest.split_at(split);
    let drift = Drift::between(
        Fingerprint::of(&Method::POST, "/", old),
        old,
        Fingerprint::of(&Method::POST, "/", new),
        new,
    );
    let _ = drift.to_string();
    let old: Option<Map<String, Value>> = serde_json::from_slice(old).ok();
    let new: Option<Map<String, Value>> = serde_json::from_slice(new).ok();
    match (old, new, drift.changed_fields()) {
        (Some(old), Some(new), Some(fields)) => {
            assert!(fields.windows(2).all(|w| w[0] < w[1]), "{fields:?}");
            for field in fields {
                assert_ne!(old.get(field), new.get(field), "{field:?}");
            }
            if old == new {
                assert!(fields.is_empty());
            }
            let differing = old.iter().filter(|(k, v)| new.get(*k) != Some(v)).count()
                + new.keys().filter(|k| !old.contains_key(*k)).count();
            assert_eq!(fields.len(), differing);
        }
        (Some(_), Some(_), None) => panic!("two objects and no report"),
        (_, _, Some(fields)) => panic!("a report {fields:?} without two objects"),
        (_, _, None) => {}
    }
});
