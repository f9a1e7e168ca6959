//! Reading a list's filters from a query string, refusing anything that is not one.

use std::time::Duration;

use http::StatusCode;

use super::problem::Failure;
use crate::ledger::{ListCursor, ListQuery, RecordKind, MAX_PAGE};

/// The parameters a list takes; anything else in the query string is refused, so a
/// misspelt filter never silently lists everything.
const FILTERS: &[&str] = &[
    "state",
    "status",
    "older_than",
    "newer_than",
    "scope",
    "scope_id",
    "target",
    "tool",
    "task",
    "order",
    "limit",
    "after",
];

/// A list request read from its query string: the store's query, and the filters as
/// given (without the cursor), to carry into the next page's link.
#[derive(Debug)]
pub(crate) struct ListRequest {
    pub(crate) query: ListQuery,
    pub(crate) filters: Vec<(String, String)>,
}

/// Read the query string `raw`; `extra` names parameters the caller reads itself (a
/// page's flash message), which are skipped here.
pub(crate) fn parse_list(raw: Option<&str>, extra: &[&str]) -> Result<ListRequest, Failure> {
    let mut query = ListQuery::new();
    let mut filters = Vec::new();
    let mut seen: Vec<String> = Vec::new();
    for (name, value) in form_urlencoded::parse(raw.unwrap_or("").as_bytes()) {
        if extra.contains(&name.as_ref()) {
            continue;
        }
        if !FILTERS.contains(&name.as_ref()) {
            return Err(Failure::bad_input(
                &name,
                "not a filter: state, status, older_than, newer_than, scope, scope_id, target, \
                 tool, task, order, limit and after are",
            ));
        }
        // A form's empty field means "not filtered by this".
        if value.is_empty() {
            continue;
        }
        if name != "state" && seen.iter().any(|seen| *seen == name) {
            return Err(Failure::bad_input(&name, "given twice"));
        }
        seen.push(name.to_string());
        query = apply(query, &name, &value)?;
        if name != "after" {
            filters.push((name.into_owned(), value.into_owned()));
        }
    }
    Ok(ListRequest { query, filters })
}

fn apply(query: ListQuery, name: &str, value: &str) -> Result<ListQuery, Failure> {
    Ok(match name {
        "state" => value.split(',').try_fold(query, |query, state| {
            parse_kind(state.trim())
                .map(|kind| query.kind(kind))
                .ok_or_else(|| {
                    Failure::bad_input(name, "not a state: in_flight, in_doubt or completed")
                })
        })?,
        "status" => {
            let (low, high) = parse_statuses(value).ok_or_else(|| {
                Failure::bad_input(
                    name,
                    "not a status range: a status (404), a class (4xx) or a range (200-299)",
                )
            })?;
            query.completed_with(low, high)
        }
        "older_than" => query.older_than(parse_age(name, value)?),
        "newer_than" => query.newer_than(parse_age(name, value)?),
        "scope" => query.scope(value),
        "scope_id" => query.scope_id(parse_scope_id(value).ok_or_else(|| {
            Failure::bad_input(
                name,
                "not a scope digest: 16 hex digits, as a record shows it",
            )
        })?),
        "target" => query.target(value),
        "tool" => query.tool(value),
        "task" => query.task(value),
        "order" => match value {
            "oldest" => query.oldest_first(),
            "newest" => query.newest_first(),
            _ => return Err(Failure::bad_input(name, "not an order: oldest or newest")),
        },
        "limit" => query.limit(parse_limit(value).ok_or_else(|| {
            Failure::bad_input(name, &format!("not a page size: 1 to {MAX_PAGE}"))
        })?),
        "after" => query.after(
            value
                .parse::<ListCursor>()
                .map_err(|err| Failure::bad_input(name, &err.to_string()))?,
        ),
        _ => unreachable!("only the names of FILTERS are applied"),
    })
}

/// `in_flight`, `in_doubt` or `completed`, as [`RecordKind::as_str`] writes them.
pub(crate) fn parse_kind(text: &str) -> Option<RecordKind> {
    [
        RecordKind::InFlight,
        RecordKind::InDoubt,
        RecordKind::Completed,
    ]
    .into_iter()
    .find(|kind| kind.as_str() == text)
}

/// `404`, `4xx` or `200-299`: the statuses between two bounds, both included.
fn parse_statuses(text: &str) -> Option<(StatusCode, StatusCode)> {
    let status = |digits: &str| {
        (digits.len() == 3 && digits.bytes().all(|b| b.is_ascii_digit()))
            .then(|| StatusCode::from_bytes(digits.as_bytes()).ok())
            .flatten()
    };
    if let Some(class) = text.strip_suffix("xx") {
        let low = status(&format!("{class}00"))?;
        let high = status(&format!("{class}99"))?;
        return Some((low, high));
    }
    let (low, high) = text.split_once('-').unwrap_or((text, text));
    let (low, high) = (status(low)?, status(high)?);
    (low <= high).then_some((low, high))
}

/// An age: a whole number and a unit (`ms`, `s`, `m`, `h`, `d`); a bare number is seconds.
pub(crate) fn parse_age(field: &str, text: &str) -> Result<Duration, Failure> {
    let bad = || Failure::bad_input(field, "not an age: a whole number and ms, s, m, h or d");
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    if digits.is_empty() {
        return Err(bad());
    }
    let amount: u64 = digits.parse().map_err(|_| bad())?;
    let unit_millis: u64 = match unit {
        "ms" => 1,
        "" | "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(bad()),
    };
    let millis = amount.checked_mul(unit_millis).ok_or_else(bad)?;
    Ok(Duration::from_millis(millis))
}

fn parse_scope_id(text: &str) -> Option<u64> {
    crate::key::derived::from_hex16(text)
}

fn parse_limit(text: &str) -> Option<usize> {
    if !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse()
        .ok()
        .filter(|limit| (1..=MAX_PAGE).contains(limit))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::ListOrder;

    fn field_of(raw: &str) -> String {
        parse_list(Some(raw), &[])
            .unwrap_err()
            .field()
            .unwrap()
            .to_owned()
    }

    #[test]
    fn every_filter_is_read() {
        let list = parse_list(
            Some("state=in_doubt,in_flight&status=2xx&older_than=5m&newer_than=2d&scope=t%20a&order=oldest&limit=50"),
            &[],
        )
        .unwrap();
        let query = list.query;
        assert_eq!(
            query.kinds(),
            &[
                RecordKind::InDoubt,
                RecordKind::InFlight,
                RecordKind::Completed
            ]
        );
        assert_eq!(query.scope_filter(), Some(crate::ledger::scope_id("t a")));
        assert_eq!(query.order(), ListOrder::OldestFirst);
        assert_eq!(query.page_limit(), 50);
        assert_eq!(list.filters.len(), 7);
    }

    #[test]
    fn origin_filters_are_read() {
        let list = parse_list(
            Some("target=POST%20https%3A%2F%2Fpayments.example%2F&tool=refund&task=task-42"),
            &[],
        )
        .unwrap();
        assert_eq!(
            list.query.target_filter(),
            Some("POST https://payments.example/")
        );
        assert_eq!(list.query.tool_filter(), Some("refund"));
        assert_eq!(list.query.task_filter(), Some("task-42"));
        assert_eq!(list.filters.len(), 3);
        assert_eq!(field_of("task=a&task=b"), "task");
    }

    #[test]
    fn empty_fields_are_no_filter() {
        let list = parse_list(Some("state=&status=&limit=&target=&tool=&task="), &[]).unwrap();
        assert_eq!(list.query, ListQuery::new());
    }

    #[test]
    fn malformed_filters_name_their_field() {
        assert_eq!(field_of("state=lost"), "state");
        assert_eq!(field_of("status=600-100"), "status");
        assert_eq!(field_of("status=2x"), "status");
        assert_eq!(field_of("older_than=5 minutes"), "older_than");
        assert_eq!(field_of("newer_than=99999999999999999999d"), "newer_than");
        assert_eq!(field_of("scope_id=xyz"), "scope_id");
        assert_eq!(field_of("order=random"), "order");
        assert_eq!(field_of("limit=0"), "limit");
        assert_eq!(field_of("limit=1001"), "limit");
        assert_eq!(field_of("after=0000000000000001.zz"), "after");
        assert_eq!(field_of("stat=in_doubt"), "stat");
        assert_eq!(field_of("limit=5&limit=6"), "limit");
    }

    #[test]
    fn ages_take_units() {
        assert_eq!(parse_age("a", "300").unwrap(), Duration::from_secs(300));
        assert_eq!(parse_age("a", "250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_age("a", "2h").unwrap(), Duration::from_secs(7200));
        assert!(parse_age("a", "h").is_err());
        assert!(parse_age("a", "-5s").is_err());
    }
}
