//! The HTML pages: links under the nest's prefix, forms that carry the look and a token,
//! CSRF refusals, and escaping.

use http::{Method, StatusCode};
use tower_idempotency::ledger::{IdempotencyStore, LedgerKey, Origin};

use super::harness::{console_over_store, in_doubt, in_doubt_of, PREFIX};

fn key(n: u8) -> LedgerKey {
    LedgerKey::from_bytes([n; 32])
}

fn record_page(key: &LedgerKey) -> String {
    format!("{PREFIX}/records/{}", key.to_hex())
}

/// The value of the first hidden field `name` of `html`.
fn hidden(html: &str, name: &str) -> String {
    let marker = format!("name=\"{name}\" value=\"");
    let start = html
        .find(&marker)
        .unwrap_or_else(|| panic!("no {name} in {html}"))
        + marker.len();
    html[start..].split('"').next().unwrap().to_owned()
}

/// The resolve form of a record page, filled in as the operator would.
fn resolve_form(html: &str, csrf: &str, reason: &str) -> String {
    form_urlencoded::Serializer::new(String::new())
        .append_pair("kind", &hidden(html, "kind"))
        .append_pair("generation", &hidden(html, "generation"))
        .append_pair("attempts", &hidden(html, "attempts"))
        .append_pair("fingerprint", &hidden(html, "fingerprint"))
        .append_pair("csrf", csrf)
        .append_pair("reason", reason)
        .finish()
}

#[tokio::test]
async fn the_list_and_the_record_page_link_under_the_prefix_and_show_the_record() {
    let (console, store) = console_over_store().await;
    in_doubt(&store, key(1), "tenant-a").await;
    let list = console.get_as("alice", "act", PREFIX).await;
    assert_eq!(list.status, StatusCode::OK, "{}", list.body);
    assert!(list.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/html"));
    assert!(list.headers["content-security-policy"]
        .to_str()
        .unwrap()
        .contains("frame-ancestors 'none'"));
    assert!(
        list.body
            .contains(&format!("href=\"{}\"", record_page(&key(1)))),
        "{}",
        list.body
    );
    assert!(
        list.body.contains(&format!("action=\"{PREFIX}\"")),
        "the filter form stays under the prefix"
    );
    assert!(list.body.contains("in doubt"));

    let page = console.get_as("alice", "act", &record_page(&key(1))).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    assert!(page.body.contains(&key(1).to_hex()));
    assert!(page.body.contains("Scope digest"));
    assert!(page.body.contains(&format!(
        "action=\"{}/resolve-not-applied\"",
        record_page(&key(1))
    )));
    assert!(page
        .body
        .contains(&format!("action=\"{}/forget\"", record_page(&key(1)))));
    assert_eq!(hidden(&page.body, "kind"), "in_doubt");
    assert_eq!(hidden(&page.body, "csrf").len(), 64);

    let read_only = console.get_as("bob", "read", &record_page(&key(1))).await;
    assert_eq!(read_only.status, StatusCode::OK);
    assert!(
        !read_only.body.contains("<form class=\"action\""),
        "no actions for a reader"
    );

    let absent = console.get_as("alice", "act", &record_page(&key(2))).await;
    assert_eq!(absent.status, StatusCode::NOT_FOUND);
}

/// The next page's link keeps the filters and stays under the prefix.
#[tokio::test]
async fn the_next_page_link_keeps_the_filters() {
    let (console, store) = console_over_store().await;
    in_doubt(&store, key(5), "").await;
    in_doubt(&store, key(6), "").await;
    let first = console
        .get_as(
            "bob",
            "read",
            &format!("{PREFIX}?state=in_doubt&order=oldest&limit=1"),
        )
        .await;
    assert_eq!(first.status, StatusCode::OK, "{}", first.body);
    assert!(first.body.contains(&key(5).to_hex()[..16]));
    let marker =
        format!("<a href=\"{PREFIX}?state=in_doubt&amp;order=oldest&amp;limit=1&amp;after=");
    let start = first
        .body
        .find(&marker)
        .unwrap_or_else(|| panic!("{}", first.body));
    let href = first.body[start + "<a href=\"".len()..]
        .split('"')
        .next()
        .unwrap();
    let second = console
        .get_as("bob", "read", &href.replace("&amp;", "&"))
        .await;
    assert_eq!(second.status, StatusCode::OK, "{}", second.body);
    assert!(second.body.contains(&key(6).to_hex()[..16]));
    assert!(!second.body.contains(&key(5).to_hex()[..16]));
}

/// The form resolves with its token, redirects to the list with a fixed message; without
/// the token, with a wrong one, with another operator's, or from another site, nothing
/// happens.
#[tokio::test]
async fn a_form_acts_only_with_its_operators_token_and_from_the_same_origin() {
    let (console, store) = console_over_store().await;
    in_doubt(&store, key(3), "").await;
    let page = console
        .get_as("alice", "act", &record_page(&key(3)))
        .await
        .body;
    let token = hidden(&page, "csrf");
    let bobs_token = hidden(
        &console
            .get_as("bob", "act", &record_page(&key(3)))
            .await
            .body,
        "csrf",
    );
    assert_ne!(token, bobs_token, "a token is its operator's");
    let path = format!("{}/resolve-not-applied", record_page(&key(3)));

    let without = form_urlencoded::Serializer::new(String::new())
        .append_pair("kind", "in_doubt")
        .append_pair("reason", "no token")
        .finish();
    for form in [
        without,
        resolve_form(&page, "", "empty token"),
        resolve_form(&page, &"0".repeat(64), "forged token"),
        resolve_form(&page, &bobs_token, "bob's token"),
    ] {
        let refused = console.post_form("alice", &path, &form).await;
        assert_eq!(
            refused.status,
            StatusCode::FORBIDDEN,
            "{form}: {}",
            refused.body
        );
        assert!(refused.body.contains("csrf"), "{}", refused.body);
    }
    let cross_site = console
        .send(
            Method::POST,
            &path,
            &[
                ("x-operator", "alice"),
                ("x-role", "act"),
                ("content-type", "application/x-www-form-urlencoded"),
                ("sec-fetch-site", "cross-site"),
            ],
            &resolve_form(&page, &token, "from evil.example"),
        )
        .await;
    assert_eq!(cross_site.status, StatusCode::FORBIDDEN);
    assert!(
        store.inspect(key(3)).await.unwrap().is_some(),
        "nothing changed"
    );

    let done = console
        .post_form(
            "alice",
            &path,
            &resolve_form(&page, &token, "INC-9 checked"),
        )
        .await;
    assert_eq!(done.status, StatusCode::SEE_OTHER, "{}", done.body);
    assert_eq!(done.location(), format!("{PREFIX}?flash=resolved"));
    assert!(store.inspect(key(3)).await.unwrap().is_none());
    let list = console.get_as("alice", "act", done.location()).await;
    assert!(
        list.body.contains("Resolved as not applied"),
        "{}",
        list.body
    );
}

/// A form made from a look the record has moved on from is answered `409`, showing what
/// changed and the record as it is now.
#[tokio::test]
async fn a_stale_form_shows_what_changed() {
    let (console, store) = console_over_store().await;
    in_doubt(&store, key(4), "").await;
    let page = console
        .get_as("alice", "act", &record_page(&key(4)))
        .await
        .body;
    let token = hidden(&page, "csrf");
    let forget = format!("{}/forget", record_page(&key(4)));
    // Another operator forgets it, and the caller runs it again: another life of the key.
    let first = console
        .post_form(
            "carol",
            &forget,
            &resolve_form(
                &page,
                &hidden(
                    &console
                        .get_as("carol", "act", &record_page(&key(4)))
                        .await
                        .body,
                    "csrf",
                ),
                "dup",
            ),
        )
        .await;
    assert_eq!(first.status, StatusCode::SEE_OTHER, "{}", first.body);
    in_doubt(&store, key(4), "").await;

    let stale = console
        .post_form("alice", &forget, &resolve_form(&page, &token, "late"))
        .await;
    assert_eq!(stale.status, StatusCode::CONFLICT, "{}", stale.body);
    assert!(
        stale.body.contains("What changed: generation"),
        "{}",
        stale.body
    );
    assert!(stale.body.contains("As it is now"));
    assert!(store.inspect(key(4)).await.unwrap().is_some());
}

/// Whatever a request writes into a page comes back escaped.
#[tokio::test]
async fn hostile_values_are_escaped_in_pages() {
    let (console, _store) = console_over_store().await;
    let hostile = "\"><script>alert(1)</script>";
    let query: String = form_urlencoded::Serializer::new(String::new())
        .append_pair("scope", hostile)
        .finish();
    let list = console
        .get_as("alice", "act", &format!("{PREFIX}?{query}"))
        .await;
    assert_eq!(list.status, StatusCode::OK, "{}", list.body);
    assert!(!list.body.contains("<script>"), "{}", list.body);
    assert!(list.body.contains("&quot;&gt;&lt;script&gt;"));

    let operator = console.get_as("<b>eve</b>", "read", PREFIX).await;
    assert_eq!(operator.status, StatusCode::OK);
    assert!(
        operator.body.contains("&lt;b&gt;eve&lt;/b&gt;"),
        "{}",
        operator.body
    );
    assert!(!operator.body.contains("<b>eve"));

    let bad_field: String = form_urlencoded::Serializer::new(String::new())
        .append_pair(hostile, "1")
        .finish();
    let refused = console
        .get_as("alice", "act", &format!("{PREFIX}?{bad_field}"))
        .await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    assert!(!refused.body.contains("<script>"), "{}", refused.body);
    assert!(refused.body.contains("not a filter"));
}

/// The resolve-as-applied form of a record page, filled in with a receipt.
fn resolve_applied_form(html: &str, csrf: &str, status: &str, body: &str) -> String {
    form_urlencoded::Serializer::new(String::new())
        .append_pair("kind", &hidden(html, "kind"))
        .append_pair("generation", &hidden(html, "generation"))
        .append_pair("attempts", &hidden(html, "attempts"))
        .append_pair("fingerprint", &hidden(html, "fingerprint"))
        .append_pair("csrf", csrf)
        .append_pair("reason", "INC-51: the provider shows the charge")
        .append_pair("status", status)
        .append_pair("content_type", "application/json")
        .append_pair("body", body)
        .finish()
}

/// A record in doubt offers resolve as applied; its form acts only with the operator's
/// token, refuses a bad receipt naming the field, and otherwise completes the record and
/// leads back to it, completed with the receipt's status.
#[tokio::test]
async fn the_resolve_applied_form_needs_its_token_and_shows_the_record_completed() {
    let (console, store) = console_over_store().await;
    in_doubt(&store, key(9), "").await;
    let page = console
        .get_as("alice", "act", &record_page(&key(9)))
        .await
        .body;
    assert!(
        page.contains(&format!(
            "action=\"{}/resolve-applied\"",
            record_page(&key(9))
        )),
        "{page}"
    );
    assert!(page.contains("name=\"body\""), "{page}");
    let token = hidden(&page, "csrf");
    let path = format!("{}/resolve-applied", record_page(&key(9)));
    let receipt = r#"{"id":"ch_1"}"#;

    for forged in ["", &"0".repeat(64)] {
        let refused = console
            .post_form(
                "alice",
                &path,
                &resolve_applied_form(&page, forged, "201", receipt),
            )
            .await;
        assert_eq!(refused.status, StatusCode::FORBIDDEN, "{}", refused.body);
        assert!(refused.body.contains("csrf"), "{}", refused.body);
    }
    let bad = console
        .post_form(
            "alice",
            &path,
            &resolve_applied_form(&page, &token, "42", receipt),
        )
        .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{}", bad.body);
    assert!(bad.body.contains("status: not a status"), "{}", bad.body);
    assert!(matches!(
        store.inspect(key(9)).await.unwrap().unwrap().state,
        tower_idempotency::ledger::RecordState::InDoubt
    ));

    let done = console
        .post_form(
            "alice",
            &path,
            &resolve_applied_form(&page, &token, "201", receipt),
        )
        .await;
    assert_eq!(done.status, StatusCode::SEE_OTHER, "{}", done.body);
    assert_eq!(
        done.location(),
        format!("{}?flash=applied", record_page(&key(9)))
    );
    let record = console.get_as("alice", "act", done.location()).await;
    assert!(
        record.body.contains("Resolved as applied"),
        "{}",
        record.body
    );
    assert!(record.body.contains("completed (201)"), "{}", record.body);
    assert!(
        !record.body.contains("/resolve-applied\""),
        "a completed record offers no resolve: {}",
        record.body
    );
}

/// The list shows each record's origin in a column, and filters by it from its form; the
/// record page shows the origin's parts. A target is the caller's text: escaped.
#[tokio::test(flavor = "current_thread")]
async fn the_origin_shows_in_the_list_and_on_the_record_page_escaped() {
    let (console, store) = console_over_store().await;
    let op = tower_idempotency::OperationId::new("task-<b>", "step-1");
    in_doubt_of(
        &store,
        key(30),
        Origin::server(&Method::POST, "/orders/<script>").with_operation(&op),
    )
    .await;
    in_doubt_of(&store, key(31), Origin::tool("refund")).await;

    let list = console.get_as("alice", "act", PREFIX).await;
    assert_eq!(list.status, StatusCode::OK, "{}", list.body);
    assert!(list.body.contains("<th>Origin</th>"), "{}", list.body);
    assert!(
        list.body
            .contains("POST /orders/&lt;script&gt; (task-&lt;b&gt; / step-1)"),
        "{}",
        list.body
    );
    assert!(!list.body.contains("<script>"));
    for field in ["target", "tool", "task"] {
        assert!(
            list.body.contains(&format!("name=\"{field}\"")),
            "the filter form has {field}"
        );
    }

    let filtered = console
        .get_as("alice", "act", &format!("{PREFIX}?tool=refund"))
        .await;
    assert_eq!(filtered.status, StatusCode::OK, "{}", filtered.body);
    assert!(filtered.body.contains(&record_page(&key(31))));
    assert!(!filtered.body.contains(&record_page(&key(30))));
    assert!(
        filtered.body.contains("name=\"tool\" value=\"refund\""),
        "the form keeps the filter"
    );

    let page = console.get_as("alice", "act", &record_page(&key(30))).await;
    assert_eq!(page.status, StatusCode::OK, "{}", page.body);
    assert!(page.body.contains("the server face"), "{}", page.body);
    assert!(page.body.contains("POST /orders/&lt;script&gt;"));
    assert!(page.body.contains("task-&lt;b&gt;"));
    assert!(!page.body.contains("<script>"));
}
