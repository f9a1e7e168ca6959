//! The JSON API: `api/records`, `api/records/{key}` and its actions.

use std::sync::Arc;

use axum::extract::{Path, Request, State};
use axum::response::Response;
use http::request::Parts;
use http::StatusCode;
use serde_json::json;

use super::action::{act as run_action, audit, Acted, Action};
use super::csrf::cross_site_header;
use super::filter::parse_list;
use super::look::{from_json, parse_key, record_json};
use super::problem::{json, Failure};
use super::{is_media_type, read_body, Operator, Shared};
use crate::idempotency::reconcile::Unanswered;
use crate::ledger::LedgerKey;

/// `GET api/records?state=..&status=..&older_than=..&newer_than=..&scope=..&scope_id=..&target=..&tool=..&task=..&order=..&limit=..&after=..`
pub(crate) async fn list(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let (head, _) = request.into_parts();
    answer(list_page(&shared, &head).await)
}

/// `GET api/records`' answer to `head`, refusals included (the MCP list tool's).
#[cfg(feature = "mcp")]
pub(crate) async fn list_answer(shared: &Shared, head: &Parts) -> Response {
    answer(list_page(shared, head).await)
}

/// `GET api/records/{key}`' answer to `head`, refusals included (the MCP inspect tool's).
#[cfg(feature = "mcp")]
pub(crate) async fn record_answer(shared: &Shared, head: &Parts, key: &str) -> Response {
    answer(one_record(shared, head, key).await)
}

async fn list_page(shared: &Shared, head: &Parts) -> Result<Response, Failure> {
    shared.operator(head)?;
    let list = parse_list(head.uri.query(), &[])?;
    let page = shared
        .records
        .list(list.query)
        .await
        .map_err(|err| Failure::store(&err))?;
    let records: Vec<_> = page
        .records
        .iter()
        .map(|listed| record_json(&listed.key, &listed.view))
        .collect();
    let next = page.next.map(|cursor| cursor.to_string());
    Ok(json(
        StatusCode::OK,
        &json!({ "records": records, "next": next }),
    ))
}

/// `GET api/records/{key}`
pub(crate) async fn record(
    State(shared): State<Arc<Shared>>,
    Path(key): Path<String>,
    request: Request,
) -> Response {
    let (head, _) = request.into_parts();
    answer(one_record(&shared, &head, &key).await)
}

async fn one_record(shared: &Shared, head: &Parts, key: &str) -> Result<Response, Failure> {
    shared.operator(head)?;
    let key = parse_key(key)?;
    match shared
        .records
        .inspect(key)
        .await
        .map_err(|err| Failure::store(&err))?
    {
        Some(view) => {
            // The frozen request in this answer only: a list page stays small.
            let mut shown = record_json(&key, &view);
            shown["request"] = view
                .request
                .as_ref()
                .map_or(serde_json::Value::Null, |request| {
                    shared.redaction.request_json(request)
                });
            Ok(json(StatusCode::OK, &shown))
        }
        None => Err(Failure::absent()),
    }
}

/// `POST api/records/{key}/forget`, `POST api/records/{key}/resolve-not-applied`,
/// `POST api/records/{key}/resolve-applied` and `POST api/records/{key}/reconcile-now`.
pub(crate) async fn act(
    State(shared): State<Arc<Shared>>,
    Path(key): Path<String>,
    request: Request,
    action: Action,
) -> Response {
    answer(act_on(&shared, request, &key, action).await)
}

async fn act_on(
    shared: &Shared,
    request: Request,
    key: &str,
    action: Action,
) -> Result<Response, Failure> {
    let (head, body) = request.into_parts();
    let operator = shared.operator(&head)?;
    let key = parse_key(key)?;
    may_act(&operator, &head, action, &key)?;
    if !is_media_type(&head, "application/json") {
        return Err(Failure::media_type("application/json"));
    }
    let input = from_json(&read_body(body, action).await?, action)?;
    let acted = run_action(&shared.records, &operator, action, key, &input).await?;
    Ok(outcome(action, &key, acted))
}

/// Whether `operator` may act, from where the request came: refusals are audited too, as
/// an attempt to act.
pub(crate) fn may_act(
    operator: &Operator,
    head: &Parts,
    action: Action,
    key: &LedgerKey,
) -> Result<(), Failure> {
    if !operator.role.may_act() {
        audit(operator, action, key, "", "forbidden");
        return Err(Failure::read_only());
    }
    if let Some(header) = cross_site_header(&head.headers) {
        audit(operator, action, key, "", "cross_site");
        return Err(Failure::cross_site(header));
    }
    Ok(())
}

/// An action's answer: `200` when done (with the record as it is now, once resolved as
/// applied), and for a reconcile now whose reconciler could not tell (`"result":
/// "unknown"`); `404` absent; `409` with the record as it is now when it moved on or is
/// live; `422` for a resolve or reconcile of a look that is not open, and a reconcile
/// without a reconciler or a frozen request; `503` when the reconciler failed, `504` when
/// it ran past its timeout.
fn outcome(action: Action, key: &LedgerKey, acted: Acted) -> Response {
    let result = acted.as_str();
    let (status, body) = match acted {
        Acted::Forgotten if action == Action::ReconcileNow => (
            StatusCode::OK,
            json!({
                "action": action.as_str(),
                "result": result,
                "reconciled": "not_applied",
                "key": key.to_hex(),
                "message": "the reconciler found the operation did not happen: the record is forgotten, and the caller's next run sends it again",
            }),
        ),
        Acted::Forgotten => (
            StatusCode::OK,
            json!({
                "action": action.as_str(),
                "result": result,
                "key": key.to_hex(),
                "message": "the record is forgotten: the next request with its key runs the operation again",
            }),
        ),
        Acted::Resolved { status, current } if action == Action::ReconcileNow => (
            StatusCode::OK,
            json!({
                "action": action.as_str(),
                "result": result,
                "reconciled": "applied",
                "status": status.as_u16(),
                "key": key.to_hex(),
                "message": "the reconciler found the operation applied: the record is completed with the provider's answer, and the caller's next run replays it",
                "current": current.map(|view| record_json(key, &view)),
            }),
        ),
        Acted::Resolved { status, current } => (
            StatusCode::OK,
            json!({
                "action": action.as_str(),
                "result": result,
                "status": status.as_u16(),
                "key": key.to_hex(),
                "message": "the record is completed with your outcome: the caller's next run replays it instead of sending again",
                "current": current.map(|view| record_json(key, &view)),
            }),
        ),
        Acted::Unknown => (
            StatusCode::OK,
            json!({
                "action": action.as_str(),
                "result": result,
                "key": key.to_hex(),
                "message": UNKNOWN,
            }),
        ),
        Acted::Unanswered(why) => (
            match why {
                Unanswered::Failed => StatusCode::SERVICE_UNAVAILABLE,
                Unanswered::TimedOut => StatusCode::GATEWAY_TIMEOUT,
            },
            json!({
                "error": result,
                "message": unanswered(why),
            }),
        ),
        Acted::NoReconciler => (
            StatusCode::UNPROCESSABLE_ENTITY,
            json!({
                "error": result,
                "message": NO_RECONCILER,
            }),
        ),
        Acted::NoRequest => (
            StatusCode::UNPROCESSABLE_ENTITY,
            json!({
                "error": result,
                "message": NO_REQUEST,
            }),
        ),
        Acted::Absent => (
            StatusCode::NOT_FOUND,
            json!({
                "error": result,
                "message": Failure::absent().message(),
            }),
        ),
        Acted::Changed { current, changed } => (
            StatusCode::CONFLICT,
            json!({
                "error": result,
                "message": "the record moved on since the look: nothing changed; look again",
                "changed": changed,
                "current": current.map(|view| record_json(key, &view)),
            }),
        ),
        Acted::Live {
            lease_left,
            current,
        } => (
            StatusCode::CONFLICT,
            json!({
                "error": result,
                "message": format!(
                    "an owner holds the operation under a live lease: nothing changed; wait, or {} with force",
                    action.path()
                ),
                "lease_left_ms": u64::try_from(lease_left.as_millis()).unwrap_or(u64::MAX),
                "current": current.map(|view| record_json(key, &view)),
            }),
        ),
        Acted::NotInDoubt => (
            StatusCode::UNPROCESSABLE_ENTITY,
            json!({
                "error": result,
                "field": "expected.kind",
                "message": format!("expected.kind: {}; nothing changed", not_open(action)),
            }),
        ),
    };
    json(status, &body)
}

/// Why a resolve of a look that is not open was refused.
pub(crate) fn not_open(action: Action) -> &'static str {
    match action {
        Action::ResolveApplied => {
            "resolve-applied is only for an open record (in doubt, or in flight); a completed \
             one keeps its own outcome"
        }
        Action::ReconcileNow => "reconcile-now is only for a record in doubt",
        _ => "resolve-not-applied is only for a record in doubt",
    }
}

/// What a reconcile now answered `unknown` means.
pub(crate) const UNKNOWN: &str = "the reconciler could not tell whether the operation \
    happened: nothing changed, and the record stays in doubt";

/// Why a reconcile now was refused on a console without a reconciler.
pub(crate) const NO_RECONCILER: &str = "no reconciler: this console's records come from a \
    layer without one (a client layer built with `reconcile` has one)";

/// Why a reconcile now was refused of a record whose frozen request is not shown.
pub(crate) const NO_REQUEST: &str = "the store does not show this record's frozen request: \
    the reconciler cannot be asked about it; nothing changed";

/// Why the reconciler gave no answer: nothing changed.
pub(crate) fn unanswered(why: Unanswered) -> &'static str {
    match why {
        Unanswered::Failed => {
            "the reconciler failed: nothing changed, and the record stays in doubt; try again"
        }
        Unanswered::TimedOut => {
            "the reconciler did not answer in time: nothing changed, and the record stays in \
             doubt; try again"
        }
    }
}

fn answer(result: Result<Response, Failure>) -> Response {
    result.unwrap_or_else(Failure::into_json)
}
