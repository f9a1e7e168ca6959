//! What an operator saw of a record and acts on: keys and looks read from the wire, and
//! records written to it.

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, StatusCode, Version};
use serde_json::{json, Map, Value};

use super::action::Action;
use super::filter::parse_kind;
use super::problem::Failure;
use crate::fingerprint::Fingerprint;
use crate::ledger::{
    Expected, Generation, LedgerKey, Outcome, RecordKind, RecordState, RecordView, StoredResponse,
};

/// The longest reason an action takes: a sentence or two for the audit trail, not a file.
const MAX_REASON: usize = 1000;

/// The largest receipt body a resolve as applied records: a provider's answer, not a file.
pub(crate) const MAX_RECEIPT_BODY: usize = 64 * 1024;

/// The longest content type a receipt takes.
const MAX_CONTENT_TYPE: usize = 256;

/// A record key from a path: 64 hex digits.
pub(crate) fn parse_key(text: &str) -> Result<LedgerKey, Failure> {
    LedgerKey::from_hex(text)
        .ok_or_else(|| Failure::bad_input("key", "not a record key: 64 hex digits"))
}

/// What an action request carries: the look it was made from, why, and for a resolve as
/// applied the outcome to record.
#[derive(Debug)]
pub(crate) struct ActionInput {
    pub(crate) expected: Expected,
    pub(crate) reason: String,
    pub(crate) receipt: Option<Receipt>,
}

/// The outcome an operator records when resolving as applied: what the provider shows.
///
/// One shape for every face, since a record does not say which made it: an HTTP face's
/// record replays it as the provider's response (its status, its content type, its body);
/// a tool face's replays a `200` whose body is the tool's result, as JSON.
#[derive(Debug)]
pub(crate) struct Receipt {
    pub(crate) status: StatusCode,
    pub(crate) content_type: Option<HeaderValue>,
    pub(crate) body: Bytes,
}

impl Receipt {
    /// The outcome the record is completed with.
    pub(crate) fn outcome(&self) -> Outcome {
        let mut headers = HeaderMap::new();
        if let Some(content_type) = &self.content_type {
            headers.insert(http::header::CONTENT_TYPE, content_type.clone());
        }
        Outcome::Response(StoredResponse::new(
            self.status,
            Version::HTTP_11,
            headers,
            self.body.clone(),
        ))
    }

    /// A receipt from its parts as sent, each checked: `status` 100 to 599, a
    /// `content_type` that is a header value, a `body` of at most [`MAX_RECEIPT_BODY`]
    /// bytes, JSON when its content type says so. `field` names each part in a refusal.
    fn read(
        status: Option<u64>,
        content_type: Option<String>,
        body: String,
        field: impl Fn(&str) -> String,
    ) -> Result<Self, Failure> {
        let status = status
            .and_then(|status| u16::try_from(status).ok())
            .filter(|status| (100..=599).contains(status))
            .and_then(|status| StatusCode::from_u16(status).ok())
            .ok_or_else(|| Failure::bad_input(&field("status"), "not a status: 100 to 599"))?;
        let content_type =
            match content_type.map(|text| text.trim().to_owned()) {
                None => None,
                Some(text) if text.is_empty() => None,
                Some(text) if text.len() > MAX_CONTENT_TYPE => {
                    return Err(Failure::bad_input(
                        &field("content_type"),
                        &format!("longer than {MAX_CONTENT_TYPE} characters"),
                    ))
                }
                Some(text) => Some(HeaderValue::from_str(&text).map_err(|_| {
                    Failure::bad_input(&field("content_type"), "not a header value")
                })?),
            };
        if body.len() > MAX_RECEIPT_BODY {
            return Err(Failure::bad_input(
                &field("body"),
                &format!(
                    "longer than {} KiB: record the provider's answer, not a file",
                    MAX_RECEIPT_BODY / 1024
                ),
            ));
        }
        if content_type.as_ref().is_some_and(is_json)
            && serde_json::from_str::<serde::de::IgnoredAny>(&body).is_err()
        {
            return Err(Failure::bad_input(
                &field("body"),
                "not JSON, though its content type says it is",
            ));
        }
        Ok(Self {
            status,
            content_type,
            body: Bytes::from(body),
        })
    }
}

/// Whether a content type is JSON (`application/json`, `application/problem+json`…).
fn is_json(content_type: &HeaderValue) -> bool {
    let essence = content_type
        .to_str()
        .unwrap_or_default()
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    essence == "application/json" || essence.ends_with("+json")
}

/// The look a record shows, in the form an action sends back: `{kind, generation,
/// attempts, fingerprint}`.
pub(crate) fn look_json(view: &RecordView) -> Value {
    let look = Expected::of(view);
    json!({
        "kind": look.kind.as_str(),
        "generation": look.generation.to_string(),
        "attempts": look.attempts,
        "fingerprint": look.fingerprint.to_hex(),
    })
}

/// A record as the API shows it, with the look to act on it by.
pub(crate) fn record_json(key: &LedgerKey, view: &RecordView) -> Value {
    let (status, lease_left, may_have_been_sent) = match view.state {
        RecordState::InFlight {
            lease_left,
            may_have_been_sent,
        } => (None, Some(millis(lease_left)), Some(may_have_been_sent)),
        RecordState::InDoubt => (None, None, None),
        RecordState::Completed { status } => (Some(status.as_u16()), None, None),
    };
    json!({
        "key": key.to_hex(),
        "state": RecordKind::of(&view.state).as_str(),
        "status": status,
        "lease_left_ms": lease_left,
        "may_have_been_sent": may_have_been_sent,
        "attempts": view.attempts,
        "generation": view.generation.to_string(),
        "fingerprint": view.fingerprint.to_hex(),
        "origin": view.origin.as_ref().map(origin_json),
        "age_ms": millis(view.age),
        "touched_ms": millis(view.touched),
        "retention_left_ms": millis(view.retention_left),
        "scope": format!("{:016x}", view.scope),
        "look": look_json(view),
    })
}

/// What a record is of, as the API shows it: `face`, `target` (`target_cut` when it was
/// longer than an origin keeps), and `task_id` and `step_id` (null when no operation id
/// named it).
fn origin_json(origin: &crate::ledger::Origin) -> Value {
    json!({
        "face": origin.face().as_str(),
        "target": origin.target(),
        "target_cut": origin.is_target_cut(),
        "task_id": origin.task_id(),
        "step_id": origin.step_id(),
    })
}

fn millis(duration: std::time::Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Which parts of the look no longer describe `current`.
pub(crate) fn changed_parts(look: &Expected, current: &RecordView) -> Vec<&'static str> {
    let now = Expected::of(current);
    [
        ("generation", look.generation != now.generation),
        ("kind", look.kind != now.kind),
        ("attempts", look.attempts != now.attempts),
        ("fingerprint", look.fingerprint != now.fingerprint),
    ]
    .into_iter()
    .filter_map(|(part, changed)| changed.then_some(part))
    .collect()
}

/// An API action's body: `{"expected": {kind, generation, attempts, fingerprint}, "reason",
/// "force"?}`, and for a resolve as applied `"outcome": {"status", "content_type"?,
/// "body"}`; nothing else.
pub(crate) fn from_json(body: &[u8], action: Action) -> Result<ActionInput, Failure> {
    let body: Value = serde_json::from_slice(body)
        .map_err(|err| Failure::bad_input("body", &format!("not JSON: {err}")))?;
    let Value::Object(mut body) = body else {
        return Err(Failure::bad_input("body", "not a JSON object"));
    };
    let expected = match body.remove("expected") {
        Some(Value::Object(look)) => look_from_json(look)?,
        Some(_) => return Err(Failure::bad_input("expected", "not an object")),
        None => return Err(Failure::bad_input("expected", "missing: the look acted on")),
    };
    let reason = match body.remove("reason") {
        Some(Value::String(reason)) => check_reason(reason)?,
        Some(_) => return Err(Failure::bad_input("reason", "not a string")),
        None => return Err(Failure::bad_input("reason", "missing")),
    };
    let force = match body.remove("force") {
        None => false,
        Some(Value::Bool(force)) => force,
        Some(_) => return Err(Failure::bad_input("force", "not a boolean")),
    };
    let receipt = match (action, body.remove("outcome")) {
        (Action::ResolveApplied, Some(Value::Object(outcome))) => Some(receipt_from_json(outcome)?),
        (Action::ResolveApplied, Some(_)) => {
            return Err(Failure::bad_input("outcome", "not an object"))
        }
        (Action::ResolveApplied, None) => {
            return Err(Failure::bad_input(
                "outcome",
                "missing: the outcome the provider shows ({status, content_type?, body})",
            ))
        }
        (_, Some(_)) => {
            return Err(Failure::bad_input(
                "outcome",
                "only resolve-applied records an outcome",
            ))
        }
        (_, None) => None,
    };
    if let Some(unknown) = body.keys().next() {
        return Err(Failure::bad_input(unknown, "not a field of an action"));
    }
    Ok(ActionInput {
        expected: forced(expected, force, action)?,
        reason,
        receipt,
    })
}

/// A resolve's `outcome`: `{"status": 100..=599, "content_type"?: string, "body": string}`.
fn receipt_from_json(mut outcome: Map<String, Value>) -> Result<Receipt, Failure> {
    let field = |name: &str| format!("outcome.{name}");
    let status = match outcome.remove("status") {
        Some(Value::Number(number)) => Some(number.as_u64().unwrap_or(0)),
        Some(_) => return Err(Failure::bad_input(&field("status"), "not a number")),
        None => return Err(Failure::bad_input(&field("status"), "missing")),
    };
    let content_type = match outcome.remove("content_type") {
        None | Some(Value::Null) => None,
        Some(Value::String(text)) => Some(text),
        Some(_) => return Err(Failure::bad_input(&field("content_type"), "not a string")),
    };
    let body = match outcome.remove("body") {
        Some(Value::String(body)) => body,
        Some(_) => {
            return Err(Failure::bad_input(
                &field("body"),
                "not a string: the receipt's text (JSON as a string)",
            ))
        }
        None => return Err(Failure::bad_input(&field("body"), "missing")),
    };
    if let Some(unknown) = outcome.keys().next() {
        return Err(Failure::bad_input(
            &field(unknown),
            "not a field of an outcome",
        ));
    }
    Receipt::read(status, content_type, body, field)
}

fn look_from_json(mut look: Map<String, Value>) -> Result<Expected, Failure> {
    let mut text = |name: &str| match look.remove(name) {
        Some(Value::String(text)) => Ok(text),
        Some(_) => Err(Failure::bad_input(
            &format!("expected.{name}"),
            "not a string",
        )),
        None => Err(Failure::bad_input(&format!("expected.{name}"), "missing")),
    };
    let kind = parse_look_kind(&text("kind")?, "expected.kind")?;
    let generation = parse_generation(&text("generation")?, "expected.generation")?;
    let fingerprint = parse_fingerprint(&text("fingerprint")?, "expected.fingerprint")?;
    let attempts = match look.remove("attempts") {
        Some(Value::Number(number)) => number
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| Failure::bad_input("expected.attempts", "not a count"))?,
        Some(_) => return Err(Failure::bad_input("expected.attempts", "not a number")),
        None => return Err(Failure::bad_input("expected.attempts", "missing")),
    };
    if let Some(unknown) = look.keys().next() {
        return Err(Failure::bad_input(
            &format!("expected.{unknown}"),
            "not a field of a look",
        ));
    }
    Ok(Expected::new(kind, fingerprint, attempts, generation))
}

/// A page's form: the look in hidden fields, the reason, the token (checked before), for a
/// forget an optional `force` box, and for a resolve as applied the receipt's `status`,
/// `content_type` and `body`.
pub(crate) fn from_form(body: &[u8], action: Action) -> Result<ActionInput, Failure> {
    let mut fields: Vec<(String, String)> = Vec::new();
    for (name, value) in form_urlencoded::parse(body) {
        if fields.iter().any(|(seen, _)| *seen == name) {
            return Err(Failure::bad_input(&name, "given twice"));
        }
        fields.push((name.into_owned(), value.into_owned()));
    }
    let mut take = |name: &str| {
        fields
            .iter()
            .position(|(field, _)| field == name)
            .map(|at| fields.swap_remove(at).1)
    };
    // The token is checked before the form is read (see the pages' handler).
    let _token = take("csrf");
    let required = |value: Option<String>, name: &str| {
        value.ok_or_else(|| Failure::bad_input(name, "missing"))
    };
    let kind = parse_look_kind(&required(take("kind"), "kind")?, "kind")?;
    let generation = parse_generation(&required(take("generation"), "generation")?, "generation")?;
    let fingerprint = parse_fingerprint(
        &required(take("fingerprint"), "fingerprint")?,
        "fingerprint",
    )?;
    let attempts = required(take("attempts"), "attempts")?
        .parse::<u32>()
        .map_err(|_| Failure::bad_input("attempts", "not a count"))?;
    let reason = check_reason(required(take("reason"), "reason")?)?;
    // A checkbox is sent only when ticked.
    let force = take("force").is_some();
    let receipt = if action == Action::ResolveApplied {
        let status = required(take("status"), "status")?;
        let status = Some(status.trim().parse::<u64>().unwrap_or(0));
        let body = required(take("body"), "body")?;
        // A browser sends a textarea's line breaks as CR LF: the receipt is recorded as
        // the operator pasted it.
        let body = body.replace("\r\n", "\n");
        Some(Receipt::read(
            status,
            take("content_type"),
            body,
            str::to_owned,
        )?)
    } else {
        None
    };
    if let Some((unknown, _)) = fields.first() {
        return Err(Failure::bad_input(unknown, "not a field of an action"));
    }
    Ok(ActionInput {
        expected: forced(
            Expected::new(kind, fingerprint, attempts, generation),
            force,
            action,
        )?,
        reason,
        receipt,
    })
}

/// Resolving as not applied and reconciling now are never forced: they are for a record in
/// doubt, which has no owner to override.
fn forced(expected: Expected, force: bool, action: Action) -> Result<Expected, Failure> {
    match (force, action.may_be_forced()) {
        (false, _) => Ok(expected),
        (true, true) => Ok(expected.force()),
        (true, false) => Err(Failure::bad_input(
            "force",
            &format!(
                "{} is never forced: it is only for a record in doubt",
                action.path()
            ),
        )),
    }
}

fn parse_look_kind(text: &str, field: &str) -> Result<RecordKind, Failure> {
    parse_kind(text)
        .ok_or_else(|| Failure::bad_input(field, "not a state: in_flight, in_doubt or completed"))
}

fn parse_generation(text: &str, field: &str) -> Result<Generation, Failure> {
    Generation::from_hex(text)
        .ok_or_else(|| Failure::bad_input(field, "not a generation: 16 hex digits"))
}

fn parse_fingerprint(text: &str, field: &str) -> Result<Fingerprint, Failure> {
    Fingerprint::from_hex(text)
        .ok_or_else(|| Failure::bad_input(field, "not a fingerprint: 64 hex digits"))
}

fn check_reason(reason: String) -> Result<String, Failure> {
    let reason = reason.trim().to_owned();
    if reason.is_empty() {
        return Err(Failure::bad_input(
            "reason",
            "missing: say why, for the audit trail",
        ));
    }
    if reason.chars().count() > MAX_REASON {
        return Err(Failure::bad_input(
            "reason",
            &format!("longer than {MAX_REASON} characters"),
        ));
    }
    Ok(reason)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn look() -> Value {
        json!({"kind": "in_doubt", "generation": "000000000000002a", "attempts": 2,
            "fingerprint": "ab".repeat(32)})
    }

    fn field(result: Result<ActionInput, Failure>) -> String {
        result.unwrap_err().field().unwrap().to_owned()
    }

    #[test]
    fn a_json_look_is_read_back() {
        let body = json!({"expected": look(), "reason": " checked with the provider "});
        let input = from_json(body.to_string().as_bytes(), Action::ResolveNotApplied).unwrap();
        assert_eq!(input.expected.kind, RecordKind::InDoubt);
        assert_eq!(input.expected.generation, Generation::from_u64(42));
        assert_eq!(input.expected.attempts, 2);
        assert!(!input.expected.force);
        assert_eq!(input.reason, "checked with the provider");
    }

    #[test]
    fn malformed_json_names_the_field() {
        let with = |patch: &dyn Fn(&mut Value)| {
            let mut body = json!({"expected": look(), "reason": "r"});
            patch(&mut body);
            field(from_json(body.to_string().as_bytes(), Action::Forget))
        };
        assert_eq!(
            with(&|b| b["expected"]["kind"] = "gone".into()),
            "expected.kind"
        );
        assert_eq!(
            with(&|b| b["expected"]["generation"] = "2a".into()),
            "expected.generation"
        );
        assert_eq!(
            with(&|b| b["expected"]["attempts"] = (-1).into()),
            "expected.attempts"
        );
        assert_eq!(
            with(&|b| b["expected"]["fingerprint"] = "zz".into()),
            "expected.fingerprint"
        );
        assert_eq!(
            with(&|b| b["expected"]["extra"] = 1.into()),
            "expected.extra"
        );
        assert_eq!(with(&|b| b["reason"] = "  ".into()), "reason");
        assert_eq!(with(&|b| b["force"] = "yes".into()), "force");
        assert_eq!(with(&|b| b["sneaky"] = true.into()), "sneaky");
        assert_eq!(field(from_json(b"{", Action::Forget)), "body");
        let forced = json!({"expected": look(), "reason": "r", "force": true});
        assert_eq!(
            field(from_json(
                forced.to_string().as_bytes(),
                Action::ResolveNotApplied
            )),
            "force"
        );
        assert!(
            from_json(forced.to_string().as_bytes(), Action::Forget)
                .unwrap()
                .expected
                .force
        );
    }

    #[test]
    fn a_form_carries_the_look_and_its_token() {
        let form = format!(
            "kind=in_doubt&generation=000000000000002a&attempts=2&fingerprint={}&reason=ok&csrf=t",
            "ab".repeat(32)
        );
        let input = from_form(form.as_bytes(), Action::ResolveNotApplied).unwrap();
        assert_eq!(input.expected.attempts, 2);
        assert_eq!(
            field(from_form(b"kind=in_doubt", Action::Forget)),
            "generation"
        );
        assert_eq!(field(from_form(b"kind=a&kind=b", Action::Forget)), "kind");
    }

    fn resolve_body(outcome: Value) -> Vec<u8> {
        json!({"expected": look(), "reason": "the provider shows the charge", "outcome": outcome})
            .to_string()
            .into_bytes()
    }

    #[test]
    fn a_json_receipt_is_read_back_as_the_outcome() {
        let body = resolve_body(json!({"status": 201, "content_type": "application/json",
            "body": "{\"id\":\"ch_1\"}"}));
        let input = from_json(&body, Action::ResolveApplied).unwrap();
        let Outcome::Response(response) = input.receipt.unwrap().outcome() else {
            panic!("a receipt is a response");
        };
        assert_eq!(response.status(), StatusCode::CREATED);
        assert_eq!(response.headers()["content-type"], "application/json");
        assert_eq!(response.body().as_ref(), b"{\"id\":\"ch_1\"}");
        // No content type: none recorded, and the body is taken as it is.
        let body = resolve_body(json!({"status": 204, "body": ""}));
        let receipt = from_json(&body, Action::ResolveApplied)
            .unwrap()
            .receipt
            .unwrap();
        assert_eq!(receipt.content_type, None);
    }

    #[test]
    fn a_bad_receipt_names_its_field() {
        let refused =
            |outcome: Value| field(from_json(&resolve_body(outcome), Action::ResolveApplied));
        assert_eq!(refused(json!({"status": 99, "body": ""})), "outcome.status");
        assert_eq!(
            refused(json!({"status": 600, "body": ""})),
            "outcome.status"
        );
        assert_eq!(
            refused(json!({"status": "201", "body": ""})),
            "outcome.status"
        );
        assert_eq!(refused(json!({"body": ""})), "outcome.status");
        assert_eq!(refused(json!({"status": 201})), "outcome.body");
        assert_eq!(
            refused(json!({"status": 201, "body": {"id": 1}})),
            "outcome.body"
        );
        assert_eq!(
            refused(json!({"status": 201, "body": "x".repeat(MAX_RECEIPT_BODY + 1)})),
            "outcome.body"
        );
        assert_eq!(
            refused(json!({"status": 201, "content_type": "application/json", "body": "{oops"})),
            "outcome.body"
        );
        assert_eq!(
            refused(json!({"status": 201, "content_type": "text/plain\u{1}", "body": ""})),
            "outcome.content_type"
        );
        assert_eq!(
            refused(json!({"status": 201, "body": "", "extra": 1})),
            "outcome.extra"
        );
        // At the bound, accepted.
        let at_bound = resolve_body(json!({"status": 201, "body": "x".repeat(MAX_RECEIPT_BODY)}));
        assert!(from_json(&at_bound, Action::ResolveApplied).is_ok());
        // Only a resolve as applied takes an outcome, and it needs one.
        let without = json!({"expected": look(), "reason": "r"}).to_string();
        assert_eq!(
            field(from_json(without.as_bytes(), Action::ResolveApplied)),
            "outcome"
        );
        let with = resolve_body(json!({"status": 201, "body": ""}));
        assert_eq!(field(from_json(&with, Action::Forget)), "outcome");
    }

    #[test]
    fn a_resolve_form_carries_its_receipt() {
        let form = |status: &str, body: &str| {
            form_urlencoded::Serializer::new(String::new())
                .append_pair("kind", "in_doubt")
                .append_pair("generation", "000000000000002a")
                .append_pair("attempts", "2")
                .append_pair("fingerprint", &"ab".repeat(32))
                .append_pair("reason", "seen at the provider")
                .append_pair("csrf", "t")
                .append_pair("status", status)
                .append_pair("content_type", "application/json")
                .append_pair("body", body)
                .finish()
        };
        let input = from_form(
            form("201", "{\r\n\"id\": 1\r\n}").as_bytes(),
            Action::ResolveApplied,
        )
        .unwrap();
        let receipt = input.receipt.unwrap();
        assert_eq!(receipt.status, StatusCode::CREATED);
        assert_eq!(receipt.body.as_ref(), b"{\n\"id\": 1\n}");
        assert_eq!(
            field(from_form(form("", "{}").as_bytes(), Action::ResolveApplied)),
            "status"
        );
        assert_eq!(
            field(from_form(
                form("201", "no").as_bytes(),
                Action::ResolveApplied
            )),
            "body"
        );
        // Another action's form takes no receipt.
        let forget = field(from_form(form("201", "{}").as_bytes(), Action::Forget));
        assert!(
            ["status", "content_type", "body"].contains(&forget.as_str()),
            "{forget}"
        );
    }

    #[test]
    fn keys_are_64_hex_digits() {
        assert!(parse_key(&"Ab".repeat(32)).is_ok());
        assert!(parse_key(&"ab".repeat(31)).is_err());
        assert!(parse_key(&format!("{}zz", "ab".repeat(31))).is_err());
        assert!(parse_key(&"é".repeat(32)).is_err());
    }
}
