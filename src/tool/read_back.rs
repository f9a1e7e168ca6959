//! [`NotReadBack`]: arguments whose frozen form does not read back as themselves.

use std::fmt;

use serde_json::Value;

use crate::fingerprint::canonical;

/// A tool call's arguments froze to JSON that does not read back as them: refused before
/// the first call, the tool not called and the operation released.
///
/// Every retry and every resume (after a crash, in another process) calls the tool with
/// the frozen arguments read back, never with the ones first handed in; arguments that
/// do not survive the trip would leave an operation that no resume can finish. So a new
/// operation's frozen arguments are read back and frozen again before its first call,
/// and the bytes must be the same. The usual causes: a float that is not finite (`NaN`,
/// `±infinity`: JSON has none, they freeze as `null`), a `HashSet` of more than one
/// element (frozen as a JSON array in its iteration order, which the set read back does
/// not share: use a `BTreeSet`; a map's keys are sorted, so a `HashMap` is safe), or a
/// `Serialize` and `Deserialize` that disagree.
///
/// ```
/// use serde::{Deserialize, Serialize};
/// use tower::{Layer, ServiceExt};
/// use tower_idempotency::testing::ToolDouble;
/// use tower_idempotency::tool::{ProviderKeys, ToolCall, ToolError, ToolLayer};
/// use tower_idempotency::{ledger::MemoryStore, OperationId};
///
/// #[derive(Serialize, Deserialize)]
/// struct Transfer { account: String, amount: f64 }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let layer = ToolLayer::builder(MemoryStore::new(), "transfer", ProviderKeys::Ignored)
///     .build()
///     .unwrap();
/// let bank = ToolDouble::new();
/// let transfer = layer.layer(bank.clone());
/// let op = OperationId::new("task-3", "transfer");
/// let call = |amount| ToolCall::new(op.clone(), Transfer { account: "acc_1".into(), amount });
///
/// let refused = transfer.clone().oneshot(call(f64::INFINITY)).await.unwrap_err();
/// let ToolError::NotReadBack(refused) = refused else { panic!("{refused}") };
/// assert_eq!(refused.pointer(), Some("/amount"));
/// assert_eq!(refused.frozen(), Some("null"));
/// assert_eq!(bank.calls(), 0);
///
/// // Nothing ran and the operation was released: corrected, it runs once.
/// transfer.oneshot(call(25.0)).await.unwrap();
/// assert_eq!(bank.effects_of(&op), 1);
/// # }
/// ```
#[derive(Debug)]
pub struct NotReadBack {
    /// The JSON pointer to the first value that did not read back, when found.
    pointer: Option<String>,
    /// That value as it froze.
    frozen: Option<String>,
    /// That value as it froze again once read back; `None` when reading back failed.
    again: Option<String>,
    /// Why reading back failed, when it did.
    error: Option<serde_json::Error>,
}

impl NotReadBack {
    /// Reading `frozen` back failed with `error`.
    pub(crate) fn unreadable(frozen: &[u8], error: serde_json::Error) -> Self {
        let found = serde_json::from_slice::<Value>(frozen)
            .ok()
            .and_then(|value| value_ending_at(&value, error.column()));
        let (pointer, frozen) = found.unzip();
        Self {
            pointer,
            frozen,
            again: None,
            error: Some(error),
        }
    }

    /// `frozen` read back, and froze again as `again`, other bytes.
    pub(crate) fn changed(frozen: &[u8], again: &[u8]) -> Self {
        let parse = |bytes: &[u8]| serde_json::from_slice::<Value>(bytes).ok();
        let (pointer, frozen, again) = match (parse(frozen), parse(again)) {
            (Some(first), Some(again)) => match first_difference(&first, &again) {
                Some((pointer, first, again)) => (Some(pointer), first, again),
                None => (None, None, None),
            },
            _ => (None, None, None),
        };
        Self {
            pointer,
            frozen,
            again,
            error: None,
        }
    }

    /// The JSON pointer (RFC 6901) to the first value that did not read back, when it
    /// could be found: `"/amount"`, `"/lines/2/price"`; `""` for the arguments whole.
    ///
    /// See the [type docs](Self) for an example.
    pub fn pointer(&self) -> Option<&str> {
        self.pointer.as_deref()
    }

    /// That value as it was frozen (canonical JSON, `null` for a float that is not
    /// finite), when it could be found.
    ///
    /// See the [type docs](Self) for an example.
    pub fn frozen(&self) -> Option<&str> {
        self.frozen.as_deref()
    }
}

impl fmt::Display for NotReadBack {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("the tool's arguments do not read back as they were frozen")?;
        match (&self.pointer, &self.frozen) {
            (Some(pointer), Some(frozen)) => write!(f, ": {pointer:?} froze as {frozen}")?,
            (Some(pointer), None) => write!(f, ": at {pointer:?}")?,
            _ => {}
        }
        match (&self.again, &self.error) {
            (_, Some(error)) => write!(f, ", which does not read back ({error})")?,
            (Some(again), None) => write!(f, ", which reads back as {again}")?,
            (None, None) => {}
        }
        f.write_str(
            "; the tool was not called (a float that is not finite freezes as null, a \
             HashSet in its iteration order: use a BTreeSet)",
        )
    }
}

impl std::error::Error for NotReadBack {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.error
            .as_ref()
            .map(|error| error as &(dyn std::error::Error + 'static))
    }
}

/// The innermost value of `value`, written canonically, that ends where a reader of those
/// bytes stopped at 1-based `column` (serde_json reports a value of the wrong type at its
/// end), with its pointer and canonical form.
fn value_ending_at(value: &Value, column: usize) -> Option<(String, String)> {
    let mut written = Vec::new();
    let mut found = None;
    locate(value, &mut written, &mut String::new(), column, &mut found);
    found
}

/// Writes `value` canonically after `written`, noting in `found` the innermost value whose
/// bytes span `column` (the first to finish: an inner value finishes before its parent).
fn locate(
    value: &Value,
    written: &mut Vec<u8>,
    pointer: &mut String,
    column: usize,
    found: &mut Option<(String, String)>,
) {
    let start = written.len();
    match value {
        Value::Array(items) => {
            written.push(b'[');
            for (at, item) in items.iter().enumerate() {
                if at > 0 {
                    written.push(b',');
                }
                let len = pointer.len();
                pointer.push_str(&format!("/{at}"));
                locate(item, written, pointer, column, found);
                pointer.truncate(len);
            }
            written.push(b']');
        }
        Value::Object(members) => {
            let mut sorted: Vec<_> = members.iter().collect();
            sorted.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            written.push(b'{');
            for (at, (name, member)) in sorted.into_iter().enumerate() {
                if at > 0 {
                    written.push(b',');
                }
                canonical::write(&Value::String(name.clone()), written);
                written.push(b':');
                let len = pointer.len();
                pointer.push('/');
                pointer.push_str(&escape(name));
                locate(member, written, pointer, column, found);
                pointer.truncate(len);
            }
            written.push(b'}');
        }
        scalar => canonical::write(scalar, written),
    }
    if found.is_none() && start < column && column <= written.len() {
        let text = String::from_utf8_lossy(&written[start..]).into_owned();
        *found = Some((pointer.clone(), text));
    }
}

/// The first place, in canonical order, where `first` and `again` differ: its pointer and
/// both values there, canonically written (`None` where one side has nothing).
fn first_difference(
    first: &Value,
    again: &Value,
) -> Option<(String, Option<String>, Option<String>)> {
    let written = |value: &Value| {
        let mut out = Vec::new();
        canonical::write(value, &mut out);
        String::from_utf8_lossy(&out).into_owned()
    };
    match (first, again) {
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            a.iter().zip(b).enumerate().find_map(|(at, (x, y))| {
                first_difference(x, y).map(|(rest, x, y)| (format!("/{at}{rest}"), x, y))
            })
        }
        (Value::Object(a), Value::Object(b)) => {
            let mut names: Vec<&String> = a.keys().chain(b.keys()).collect();
            names.sort_unstable_by(|x, y| x.as_bytes().cmp(y.as_bytes()));
            names.dedup();
            names.into_iter().find_map(|name| {
                let here = format!("/{}", escape(name));
                match (a.get(name), b.get(name)) {
                    (Some(x), Some(y)) => {
                        first_difference(x, y).map(|(rest, x, y)| (format!("{here}{rest}"), x, y))
                    }
                    (x, y) => Some((here, x.map(written), y.map(written))),
                }
            })
        }
        (a, b) if a == b => None,
        (a, b) => Some((String::new(), Some(written(a)), Some(written(b)))),
    }
}

/// A member name as a JSON pointer's reference token (RFC 6901).
fn escape(name: &str) -> String {
    name.replace('~', "~0").replace('/', "~1")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unreadable_value_is_found_by_where_reading_stopped() {
        #[derive(serde::Deserialize, Debug)]
        #[allow(dead_code)]
        struct Line {
            price: f64,
        }
        #[derive(serde::Deserialize, Debug)]
        #[allow(dead_code)]
        struct Order {
            lines: Vec<Line>,
            note: String,
        }
        let frozen = br#"{"lines":[{"price":1.5},{"price":null}],"note":"x"}"#;
        let error = serde_json::from_slice::<Order>(frozen).unwrap_err();
        let refused = NotReadBack::unreadable(frozen, error);
        assert_eq!(refused.pointer(), Some("/lines/1/price"));
        assert_eq!(refused.frozen(), Some("null"));
    }

    #[test]
    fn a_value_that_reads_back_otherwise_is_named() {
        let refused = NotReadBack::changed(br#"{"a":{"b~/":[1,2]}}"#, br#"{"a":{"b~/":[2,1]}}"#);
        assert_eq!(refused.pointer(), Some("/a/b~0~1/0"));
        assert_eq!(refused.frozen(), Some("1"));
        assert!(refused.to_string().contains("reads back as 2"), "{refused}");
    }
}
