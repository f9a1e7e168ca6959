//! Writing the pages: escaping, the frame every page shares, and the pieces of a record.

use std::fmt::Write as _;
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use http::header::{
    CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE, REFERRER_POLICY, X_CONTENT_TYPE_OPTIONS,
    X_FRAME_OPTIONS,
};
use http::{HeaderValue, StatusCode};

use super::action::Action;
use super::redact::Redaction;
use crate::ledger::{Expected, LedgerKey, Origin, RecordKind, RecordState, RecordView};

/// Pages run no script, load nothing, are framed by nobody, and post only to themselves:
/// an escaping slip still could not run code or send a form elsewhere.
const POLICY: &str = "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; \
                      frame-ancestors 'none'; base-uri 'none'";

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}\
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.25em .5em;text-align:left}\
.mono{font-family:ui-monospace,monospace}.flash{background:#eef6ee;padding:.5em}\
.problem{background:#fbeaea;padding:.5em}form.action{border:1px solid #ccc;padding:.5em;margin:.5em 0}\
label{display:block;margin:.25em 0}";

/// `text` with every character that means something in HTML (text or attribute) escaped.
pub(crate) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A page: `title` and `body` (already HTML) in the shared frame, with headers that keep it
/// out of caches and frames.
pub(crate) fn page(status: StatusCode, home: &str, title: &str, body: &str) -> Response {
    let html = format!(
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>{title} · idempotency console</title><style>{STYLE}</style></head>\
         <body><p><a href=\"{home}\">Records</a></p><h1>{title}</h1>{body}</body></html>",
        title = escape(title),
        home = escape(home),
    );
    let mut response = Response::new(Body::from(html));
    *response.status_mut() = status;
    let headers = response.headers_mut();
    headers.insert(
        CONTENT_TYPE,
        HeaderValue::from_static("text/html; charset=utf-8"),
    );
    headers.insert(CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(CONTENT_SECURITY_POLICY, HeaderValue::from_static(POLICY));
    headers.insert(X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(REFERRER_POLICY, HeaderValue::from_static("same-origin"));
    response
}

/// A duration as an operator reads it: `3d 4h`, `5m 2s`, `250ms`.
pub(crate) fn human(duration: Duration) -> String {
    let secs = duration.as_secs();
    let (days, hours, minutes, seconds) =
        (secs / 86_400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    match () {
        _ if days > 0 => format!("{days}d {hours}h"),
        _ if hours > 0 => format!("{hours}h {minutes}m"),
        _ if minutes > 0 => format!("{minutes}m {seconds}s"),
        _ if seconds > 0 => format!("{seconds}s"),
        _ => format!("{}ms", duration.as_millis()),
    }
}

/// The state as a word, with what it carries: a status, a lease.
pub(crate) fn state_text(state: &RecordState) -> String {
    match state {
        RecordState::InFlight {
            lease_left,
            may_have_been_sent,
        } => {
            let lease = if lease_left.is_zero() {
                "lease ran out".to_owned()
            } else {
                format!("lease {} left", human(*lease_left))
            };
            let resumed = if *may_have_been_sent { ", resumed" } else { "" };
            format!("in flight ({lease}{resumed})")
        }
        RecordState::InDoubt => "in doubt".to_owned(),
        RecordState::Completed { status } => format!("completed ({})", status.as_u16()),
    }
}

/// A record's fields as a definition list.
pub(crate) fn record_fields(key: &LedgerKey, view: &RecordView) -> String {
    let rows = [
        ("Key", key.to_hex()),
        ("State", state_text(&view.state)),
        ("Attempts", view.attempts.to_string()),
        ("Generation", view.generation.to_string()),
        ("Fingerprint", view.fingerprint.to_hex()),
        ("Age", human(view.age)),
        ("Last changed", format!("{} ago", human(view.touched))),
        ("Kept for", human(view.retention_left)),
        ("Scope digest", format!("{:016x}", view.scope)),
    ];
    let mut out = String::from("<table>");
    for (name, value) in rows {
        let _ = write!(
            out,
            "<tr><th>{name}</th><td class=\"mono\">{}</td></tr>",
            escape(&value)
        );
    }
    out.push_str(&origin_rows(view.origin.as_ref()));
    out.push_str("</table>");
    out
}

/// The record page's rows of what a record is of: the face that made it, its target, and
/// the task and step that named it (each escaped: a target is the caller's text).
fn origin_rows(origin: Option<&Origin>) -> String {
    let Some(origin) = origin else {
        return "<tr><th>Origin</th><td>not known (kept by none of its claims)</td></tr>"
            .to_owned();
    };
    let cut = if origin.is_target_cut() { "…" } else { "" };
    let mut rows = vec![
        ("Made by", format!("the {} face", origin.face())),
        ("Target", format!("{}{cut}", origin.target())),
    ];
    if let (Some(task), Some(step)) = (origin.task_id(), origin.step_id()) {
        rows.push(("Task", task.to_owned()));
        rows.push(("Step", step.to_owned()));
    }
    rows.iter()
        .map(|(name, value)| {
            format!(
                "<tr><th>{name}</th><td class=\"mono\">{}</td></tr>",
                escape(value)
            )
        })
        .collect()
}

/// A record's origin in a list's cell: its target, then its task and step when an
/// operation id named them (escaped); empty when not known.
pub(crate) fn origin_cell(origin: Option<&Origin>) -> String {
    let Some(origin) = origin else {
        return String::new();
    };
    let cut = if origin.is_target_cut() { "…" } else { "" };
    let mut text = format!("{}{cut}", origin.target());
    if let (Some(task), Some(step)) = (origin.task_id(), origin.step_id()) {
        let _ = write!(text, " ({task} / {step})");
    }
    escape(&text)
}

/// The record's frozen request, redacted, if its store shows one.
pub(crate) fn request_section(redaction: &Redaction, view: &RecordView) -> String {
    view.request
        .as_ref()
        .map(|request| redaction.request_html(request))
        .unwrap_or_default()
}

/// The forms of the actions `view` allows, each carrying the look in hidden fields and the
/// operator's token: reconcile now for a record in doubt whose frozen request is shown, on
/// a console that `reconciles`; resolve as applied (with the receipt's fields) for an open
/// record nobody works on (in doubt, or in flight under a lease that ran out), resolve as
/// not applied for a record in doubt, forget for any (with a force box for one in flight).
pub(crate) fn action_forms(
    base: &str,
    key: &LedgerKey,
    view: &RecordView,
    token: &str,
    reconciles: bool,
) -> String {
    let look = Expected::of(view);
    let hidden = format!(
        "<input type=\"hidden\" name=\"kind\" value=\"{}\">\
         <input type=\"hidden\" name=\"generation\" value=\"{}\">\
         <input type=\"hidden\" name=\"attempts\" value=\"{}\">\
         <input type=\"hidden\" name=\"fingerprint\" value=\"{}\">\
         <input type=\"hidden\" name=\"csrf\" value=\"{}\">",
        look.kind.as_str(),
        look.generation,
        look.attempts,
        look.fingerprint.to_hex(),
        escape(token),
    );
    let form = |action: Action, title: &str, warning: &str, extra: &str| {
        format!(
            "<form class=\"action\" method=\"post\" action=\"{base}/records/{key}/{path}\">\
             <h2>{title}</h2><p>{warning}</p>{hidden}\
             <label>Reason (for the audit trail) <input name=\"reason\" required maxlength=\"1000\" size=\"60\"></label>\
             {extra}<button type=\"submit\">{title}</button></form>",
            base = escape(base),
            key = key.to_hex(),
            path = action.path(),
        )
    };
    let mut out = String::new();
    if reconciles && look.kind == RecordKind::InDoubt && view.request.is_some() {
        out.push_str(&form(
            Action::ReconcileNow,
            "Reconcile now",
            "Asks the layer's reconciler whether the operation happened, with the request \
             above: if it did, the record is completed with the provider's answer; if it did \
             not, the record is forgotten and the caller's next run sends it again; if it \
             cannot tell, nothing changes.",
            "",
        ));
    }
    if is_ownerless(&view.state) {
        out.push_str(&form(
            Action::ResolveApplied,
            "Resolve as applied",
            "Only once you have seen with the provider that the effect happened: the record \
             is completed with the outcome you give here, and the caller's next run replays \
             it instead of sending the operation again. For a tool's record, give status 200 \
             and the tool's result as JSON.",
            RECEIPT_FIELDS,
        ));
    }
    if look.kind == RecordKind::InDoubt {
        out.push_str(&form(
            Action::ResolveNotApplied,
            "Resolve as not applied",
            "Only once you have checked with the provider that the effect did not happen: \
             the caller's next run sends the operation again.",
            "",
        ));
    }
    let force = if look.kind == RecordKind::InFlight {
        "<label><input type=\"checkbox\" name=\"force\" value=\"on\"> Force: even while its \
         owner's lease runs (the owner may still be sending it)</label>"
    } else {
        ""
    };
    out.push_str(&form(
        Action::Forget,
        "Forget",
        "Removes the record: the next request with its key runs the operation again.",
        force,
    ));
    out
}

/// The receipt a resolve as applied records: the provider's status, content type and
/// body (at most 64 KiB; JSON when its content type says so).
const RECEIPT_FIELDS: &str = "<label>Status the provider answered (100 to 599) \
     <input name=\"status\" type=\"number\" min=\"100\" max=\"599\" required></label>\
     <label>Content type <input name=\"content_type\" value=\"application/json\" size=\"40\"></label>\
     <label>Body: the provider's answer, its receipt (at most 64 KiB) \
     <textarea name=\"body\" rows=\"8\" cols=\"80\" maxlength=\"65536\"></textarea></label>";

/// Whether no owner works on a record in `state`: in doubt, or in flight under a lease
/// that ran out.
fn is_ownerless(state: &RecordState) -> bool {
    match state {
        RecordState::InDoubt => true,
        RecordState::InFlight { lease_left, .. } => lease_left.is_zero(),
        RecordState::Completed { .. } => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escaping_covers_text_and_attributes() {
        assert_eq!(
            escape(r#"<script>alert('x')</script>&"#),
            "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;&amp;"
        );
        assert_eq!(escape("\" onload=\"x"), "&quot; onload=&quot;x");
    }

    #[test]
    fn an_origin_is_escaped_in_its_cell_and_rows() {
        let origin = Origin::server(&http::Method::POST, "/<script>")
            .with_operation(&crate::OperationId::new("t&1", "s\"2"));
        let cell = origin_cell(Some(&origin));
        assert_eq!(cell, "POST /&lt;script&gt; (t&amp;1 / s&quot;2)");
        let rows = origin_rows(Some(&origin));
        assert!(
            rows.contains("the server face") && rows.contains("t&amp;1"),
            "{rows}"
        );
        assert!(!rows.contains("<script>"), "{rows}");
        assert_eq!(origin_cell(None), "");
        assert!(origin_rows(None).contains("not known"));
    }

    #[test]
    fn durations_read_at_their_scale() {
        assert_eq!(human(Duration::from_millis(250)), "250ms");
        assert_eq!(human(Duration::from_secs(62)), "1m 2s");
        assert_eq!(human(Duration::from_secs(3 * 86_400 + 4 * 3600)), "3d 4h");
    }
}
