//! The HTML pages: the list, one record, and the actions' forms, working without scripts.

use std::fmt::Write as _;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::response::Response;
use http::header::LOCATION;
use http::request::Parts;
use http::{HeaderValue, StatusCode};

use super::action::{act as run_action, audit, Acted, Action};
use super::api::{may_act, not_open, unanswered, NO_RECONCILER, NO_REQUEST};
use super::filter::{parse_list, ListRequest};
use super::html::{
    action_forms, escape, human, origin_cell, page, record_fields, request_section, state_text,
};
use super::look::{from_form, parse_key};
use super::problem::Failure;
use super::{is_media_type, prefix, read_body, Operator, Shared};
use crate::idempotency::reconcile::Unanswered;
use crate::ledger::{LedgerKey, ListPage, RecordView};

/// The messages a redirect after an action shows, by the code in its `flash` parameter:
/// fixed texts, so a crafted link cannot make the console say anything else.
const FLASHES: &[(&str, &str)] = &[
    (
        "forgotten",
        "The record was forgotten: the next request with its key runs the operation again.",
    ),
    (
        "resolved",
        "Resolved as not applied: the caller's next run sends the operation again.",
    ),
    (
        "applied",
        "Resolved as applied: the caller's next run replays the outcome you recorded.",
    ),
    (
        "absent",
        "There was no record of that key any more: nothing changed.",
    ),
    (
        "reconciled-applied",
        "The reconciler found the operation applied: the record is completed with the \
         provider's answer, and the caller's next run replays it.",
    ),
    (
        "reconciled-not-applied",
        "The reconciler found the operation did not happen: the record is forgotten, and \
         the caller's next run sends it again.",
    ),
    (
        "unknown",
        "The reconciler could not tell whether the operation happened: nothing changed, and \
         the record stays in doubt.",
    ),
];

/// Where the list is, under the console's prefix.
fn home(base: &str) -> String {
    if base.is_empty() {
        "/".to_owned()
    } else {
        base.to_owned()
    }
}

/// `GET /`: the list, its filter form and the next page's link.
pub(crate) async fn list(State(shared): State<Arc<Shared>>, request: Request) -> Response {
    let (head, _) = request.into_parts();
    let base = prefix(&head);
    list_page(&shared, &head, &base)
        .await
        .unwrap_or_else(|failure| failure_page(&base, &failure))
}

async fn list_page(shared: &Shared, head: &Parts, base: &str) -> Result<Response, Failure> {
    let operator = shared.operator(head)?;
    let list = parse_list(head.uri.query(), &["flash"])?;
    let page_of_records = shared
        .records
        .list(list.query.clone())
        .await
        .map_err(|err| Failure::store(&err))?;
    let mut body = signed_in(&operator);
    body.push_str(&flash(head.uri.query()));
    body.push_str(&filter_form(base, &list));
    body.push_str(&records_table(base, &page_of_records));
    if let Some(next) = page_of_records.next {
        let mut query = form_urlencoded::Serializer::new(String::new());
        for (name, value) in &list.filters {
            query.append_pair(name, value);
        }
        query.append_pair("after", &next.to_string());
        let _ = write!(
            body,
            "<p><a href=\"{}?{}\">Next page</a></p>",
            escape(&home(base)),
            escape(&query.finish())
        );
    }
    Ok(page(StatusCode::OK, &home(base), "Records", &body))
}

/// Who the console takes the reader for, and what they may do.
fn signed_in(operator: &Operator) -> String {
    let role = if operator.role.may_act() {
        "may act"
    } else {
        "read-only"
    };
    format!(
        "<p>Operator: <strong>{}</strong> ({role})</p>",
        escape(&operator.id)
    )
}

/// The message a redirect asked for with `flash`, if it is one of [`FLASHES`].
fn flash(query: Option<&str>) -> String {
    let code = form_urlencoded::parse(query.unwrap_or("").as_bytes())
        .find(|(name, _)| name == "flash")
        .map(|(_, code)| code);
    FLASHES
        .iter()
        .find(|(name, _)| code.as_deref() == Some(*name))
        .map(|(_, text)| format!("<p class=\"flash\">{}</p>", escape(text)))
        .unwrap_or_default()
}

fn filter_form(base: &str, list: &ListRequest) -> String {
    let value = |name: &str| {
        list.filters
            .iter()
            .find(|(filter, _)| filter == name)
            .map(|(_, value)| escape(value))
            .unwrap_or_default()
    };
    let state = value("state");
    let order = value("order");
    let option = |current: &str, value: &str, label: &str| {
        let selected = if current == value { " selected" } else { "" };
        format!("<option value=\"{value}\"{selected}>{label}</option>")
    };
    format!(
        "<form method=\"get\" action=\"{home}\">\
         <label>State <select name=\"state\">{any}{in_doubt}{in_flight}{completed}</select></label>\
         <label>Status (404, 4xx, 200-299) <input name=\"status\" value=\"{status}\"></label>\
         <label>Older than (300s, 5m, 2h, 1d) <input name=\"older_than\" value=\"{older}\"></label>\
         <label>Newer than <input name=\"newer_than\" value=\"{newer}\"></label>\
         <label>Scope <input name=\"scope\" value=\"{scope}\"></label>\
         <label>Scope digest <input name=\"scope_id\" value=\"{scope_id}\"></label>\
         <label>Target starts with (POST https://payments.example/) <input name=\"target\" value=\"{target}\" size=\"40\"></label>\
         <label>Tool <input name=\"tool\" value=\"{tool}\"></label>\
         <label>Task <input name=\"task\" value=\"{task}\"></label>\
         <label>Order <select name=\"order\">{newest}{oldest}</select></label>\
         <label>Page size <input name=\"limit\" value=\"{limit}\"></label>\
         <button type=\"submit\">Filter</button></form>",
        home = escape(&home(base)),
        any = option(&state, "", "any"),
        in_doubt = option(&state, "in_doubt", "in doubt"),
        in_flight = option(&state, "in_flight", "in flight"),
        completed = option(&state, "completed", "completed"),
        status = value("status"),
        older = value("older_than"),
        newer = value("newer_than"),
        scope = value("scope"),
        scope_id = value("scope_id"),
        target = value("target"),
        tool = value("tool"),
        task = value("task"),
        newest = option(&order, "newest", "newest first"),
        oldest = option(&order, "oldest", "oldest first"),
        limit = value("limit"),
    )
}

fn records_table(base: &str, page_of_records: &ListPage) -> String {
    if page_of_records.records.is_empty() {
        return "<p>No record on this page.</p>".to_owned();
    }
    let mut out = String::from(
        "<table><tr><th>Key</th><th>State</th><th>Attempts</th><th>Age</th>\
         <th>Last changed</th><th>Kept for</th><th>Scope digest</th><th>Origin</th></tr>",
    );
    for listed in &page_of_records.records {
        let key = listed.key.to_hex();
        let view = &listed.view;
        let _ = write!(
            out,
            "<tr><td class=\"mono\"><a href=\"{base}/records/{key}\">{short}…</a></td>\
             <td>{state}</td><td>{attempts}</td><td>{age}</td><td>{touched} ago</td>\
             <td>{kept}</td><td class=\"mono\">{scope:016x}</td>\
             <td class=\"mono\">{origin}</td></tr>",
            base = escape(base),
            short = &key[..16],
            state = escape(&state_text(&view.state)),
            attempts = view.attempts,
            age = human(view.age),
            touched = human(view.touched),
            kept = human(view.retention_left),
            scope = view.scope,
            origin = origin_cell(view.origin.as_ref()),
        );
    }
    out.push_str("</table>");
    out
}

/// `GET records/{key}`: one record, and for an operator allowed to act, its actions.
pub(crate) async fn record(
    State(shared): State<Arc<Shared>>,
    Path(key): Path<String>,
    request: Request,
) -> Response {
    let (head, _) = request.into_parts();
    let base = prefix(&head);
    record_page(&shared, &head, &base, &key)
        .await
        .unwrap_or_else(|failure| failure_page(&base, &failure))
}

async fn record_page(
    shared: &Shared,
    head: &Parts,
    base: &str,
    key: &str,
) -> Result<Response, Failure> {
    let operator = shared.operator(head)?;
    let key = parse_key(key)?;
    let view = shared
        .records
        .inspect(key)
        .await
        .map_err(|err| Failure::store(&err))?
        .ok_or_else(Failure::absent)?;
    let mut body = signed_in(&operator);
    body.push_str(&flash(head.uri.query()));
    body.push_str(&record_fields(&key, &view));
    body.push_str(&request_section(&shared.redaction, &view));
    body.push_str(&actions_for(shared, &operator, base, &key, &view));
    Ok(page(StatusCode::OK, &home(base), "Record", &body))
}

fn actions_for(
    shared: &Shared,
    operator: &Operator,
    base: &str,
    key: &LedgerKey,
    view: &RecordView,
) -> String {
    if operator.role.may_act() {
        let reconciles = shared.records.reconciling.is_some();
        action_forms(
            base,
            key,
            view,
            &shared.csrf.token(&operator.id),
            reconciles,
        )
    } else {
        "<p>Your role is read-only: no actions.</p>".to_owned()
    }
}

/// `POST records/{key}/forget`, `POST records/{key}/resolve-not-applied`,
/// `POST records/{key}/resolve-applied` and `POST records/{key}/reconcile-now`, from the
/// record page's forms.
pub(crate) async fn act(
    State(shared): State<Arc<Shared>>,
    Path(key): Path<String>,
    request: Request,
    action: Action,
) -> Response {
    let (head, body) = request.into_parts();
    let base = prefix(&head);
    act_on(&shared, head, body, &base, &key, action)
        .await
        .unwrap_or_else(|failure| failure_page(&base, &failure))
}

async fn act_on(
    shared: &Shared,
    head: Parts,
    body: Body,
    base: &str,
    key: &str,
    action: Action,
) -> Result<Response, Failure> {
    let operator = shared.operator(&head)?;
    let key = parse_key(key)?;
    may_act(&operator, &head, action, &key)?;
    if !is_media_type(&head, "application/x-www-form-urlencoded") {
        return Err(Failure::media_type("application/x-www-form-urlencoded"));
    }
    let body = read_body(body, action).await?;
    // The token first: a forged form learns nothing about the rest of its fields.
    let token = form_urlencoded::parse(&body)
        .find(|(name, _)| name == "csrf")
        .map(|(_, token)| token.into_owned())
        .unwrap_or_default();
    if !shared.csrf.verifies(&operator.id, &token) {
        audit(&operator, action, &key, "", "csrf");
        return Err(Failure::csrf());
    }
    let input = from_form(&body, action)?;
    let acted = run_action(&shared.records, &operator, action, key, &input).await?;
    let record = format!("{}/records/{}", base, key.to_hex());
    Ok(match acted {
        Acted::Forgotten => {
            let code = match action {
                Action::ResolveNotApplied => "resolved",
                Action::ReconcileNow => "reconciled-not-applied",
                Action::Forget | Action::ResolveApplied => "forgotten",
            };
            see_other(&format!("{}?flash={code}", home(base)))
        }
        // The record stays, completed: back to it, to see it so.
        Acted::Resolved { .. } => {
            let code = match action {
                Action::ReconcileNow => "reconciled-applied",
                _ => "applied",
            };
            see_other(&format!("{record}?flash={code}"))
        }
        // Nothing changed: back to the record, still in doubt.
        Acted::Unknown => see_other(&format!("{record}?flash=unknown")),
        Acted::Unanswered(why) => {
            let status = match why {
                Unanswered::Failed => StatusCode::SERVICE_UNAVAILABLE,
                Unanswered::TimedOut => StatusCode::GATEWAY_TIMEOUT,
            };
            not_done(base, &record, status, unanswered(why))
        }
        Acted::NoReconciler => not_done(
            base,
            &record,
            StatusCode::UNPROCESSABLE_ENTITY,
            NO_RECONCILER,
        ),
        Acted::NoRequest => not_done(base, &record, StatusCode::UNPROCESSABLE_ENTITY, NO_REQUEST),
        Acted::Absent => see_other(&format!("{}?flash=absent", home(base))),
        Acted::Changed { current, changed } => {
            let mut body = String::from(
                "<p class=\"problem\">The record moved on since you looked at it: nothing \
                 changed. Look at it as it is now before acting again.</p>",
            );
            if !changed.is_empty() {
                let _ = write!(body, "<p>What changed: {}.</p>", changed.join(", "));
            }
            body.push_str(&as_it_is_now(shared, &operator, base, &key, current));
            page(StatusCode::CONFLICT, &home(base), "Conflict", &body)
        }
        Acted::Live {
            lease_left,
            current,
        } => {
            let mut body = format!(
                "<p class=\"problem\">An owner holds the operation under a live lease ({} \
                 left): nothing changed. Wait for it, or {} with force.</p>",
                human(lease_left),
                match action {
                    Action::ResolveApplied | Action::ReconcileNow => "resolve it",
                    _ => "forget it",
                }
            );
            body.push_str(&as_it_is_now(shared, &operator, base, &key, current));
            page(StatusCode::CONFLICT, &home(base), "Conflict", &body)
        }
        Acted::NotInDoubt => {
            let body = format!(
                "<p class=\"problem\">{}; this one was {} when you looked: nothing \
                 changed.</p><p><a href=\"{}/records/{}\">Back to the record</a></p>",
                escape(&capitalized(not_open(action))),
                escape(&input.expected.kind.as_str().replace('_', " ")),
                escape(base),
                key.to_hex(),
            );
            page(
                StatusCode::UNPROCESSABLE_ENTITY,
                &home(base),
                "Not in doubt",
                &body,
            )
        }
    })
}

/// An action that changed nothing, and why, with the way back to the record.
fn not_done(base: &str, record: &str, status: StatusCode, why: &str) -> Response {
    let body = format!(
        "<p class=\"problem\">{}.</p><p><a href=\"{}\">Back to the record</a></p>",
        escape(&capitalized(why)),
        escape(record),
    );
    page(status, &home(base), "Not done", &body)
}

/// The record as it is now (or that it has gone), with fresh forms carrying its new look.
fn as_it_is_now(
    shared: &Shared,
    operator: &Operator,
    base: &str,
    key: &LedgerKey,
    current: Option<RecordView>,
) -> String {
    match current {
        Some(view) => {
            let mut out = String::from("<h2>As it is now</h2>");
            out.push_str(&record_fields(key, &view));
            out.push_str(&request_section(&shared.redaction, &view));
            out.push_str(&actions_for(shared, operator, base, key, &view));
            out
        }
        None => "<p>It has left the ledger since.</p>".to_owned(),
    }
}

/// `text` with its first letter a capital, to open a sentence.
fn capitalized(text: &str) -> String {
    let mut chars = text.chars();
    chars
        .next()
        .map(|first| first.to_uppercase().chain(chars).collect())
        .unwrap_or_default()
}

fn see_other(location: &str) -> Response {
    let mut response = Response::new(Body::empty());
    *response.status_mut() = StatusCode::SEE_OTHER;
    if let Ok(location) = HeaderValue::from_str(location) {
        response.headers_mut().insert(LOCATION, location);
    }
    response
}

/// A failure as a page: its status, and its message (naming the field at fault).
fn failure_page(base: &str, failure: &Failure) -> Response {
    let title = match failure.status() {
        StatusCode::BAD_REQUEST => "Bad request",
        StatusCode::NOT_FOUND => "No such record",
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => "Refused",
        _ => "Not done",
    };
    let body = format!(
        "<p class=\"problem\" data-error=\"{}\">{}</p>",
        failure.code(),
        escape(failure.message())
    );
    page(failure.status(), &home(base), title, &body)
}
