//! The JSON API: filters, looks, fences, roles and hostile input.

use http::{Method, StatusCode};
use serde_json::{json, Value};
use tower_idempotency::ledger::{
    Begin, BeginRequest, IdempotencyStore, LedgerKey, Origin, RecordKind, RecordState,
};

use super::harness::{api_record, console_over_store, in_doubt, in_doubt_of, in_flight, PREFIX};
use crate::capture;

fn key(n: u8) -> LedgerKey {
    LedgerKey::from_bytes([n; 32])
}

fn action(key: &LedgerKey, action: &str) -> String {
    format!("{}/{action}", api_record(key))
}

/// An operator acting on a look taken before the record moved on is answered `409` with
/// the record as it is now and what changed, and the record stays.
#[tokio::test]
async fn a_stale_look_is_refused_with_what_changed_and_nothing_changes() {
    let (console, store) = console_over_store().await;
    in_doubt(&store, key(1), "").await;
    let look = console
        .get_as("alice", "act", &api_record(&key(1)))
        .await
        .json()["look"]
        .clone();
    assert_eq!(look["attempts"], 1);

    // Meanwhile the caller resumed it, and it failed again.
    let resume = BeginRequest::new(
        key(1),
        tower_idempotency::fingerprint::Fingerprint::of(&Method::POST, "/charges", b"{}"),
        std::time::Duration::from_secs(30),
        std::time::Duration::from_secs(3600),
    );
    let Begin::Resume { token, .. } = store.begin(resume).await.unwrap() else {
        panic!("an in-doubt record is resumed");
    };
    store
        .mark_in_doubt(key(1), token, std::time::Duration::from_secs(3600))
        .await
        .unwrap();

    for path in ["forget", "resolve-not-applied"] {
        let stale = console
            .post_json(
                "alice",
                "act",
                &action(&key(1), path),
                &json!({"expected": look, "reason": "checked"}),
            )
            .await;
        assert_eq!(stale.status, StatusCode::CONFLICT, "{}", stale.body);
        let stale = stale.json();
        assert_eq!(stale["error"], "changed");
        assert_eq!(stale["changed"], json!(["attempts"]));
        assert_eq!(stale["current"]["attempts"], 2);
    }
    let view = store.inspect(key(1)).await.unwrap().expect("still there");
    assert_eq!(view.attempts, 2);
    assert_eq!(RecordKind::of(&view.state), RecordKind::InDoubt);
}

#[tokio::test]
async fn a_read_only_operator_lists_and_inspects_but_every_action_is_403() {
    let (console, store) = console_over_store().await;
    in_doubt(&store, key(2), "").await;
    let list = console
        .get_as("bob", "read", &format!("{PREFIX}/api/records"))
        .await;
    assert_eq!(list.status, StatusCode::OK);
    let look = list.json()["records"][0]["look"].clone();
    for path in ["forget", "resolve-not-applied"] {
        let refused = console
            .post_json(
                "bob",
                "read",
                &action(&key(2), path),
                &json!({"expected": look, "reason": "tidying up"}),
            )
            .await;
        assert_eq!(refused.status, StatusCode::FORBIDDEN, "{}", refused.body);
        assert_eq!(refused.json()["error"], "read_only");
    }
    assert!(store.inspect(key(2)).await.unwrap().is_some());
}

#[tokio::test]
async fn the_authorizer_refuses_with_401_or_403_on_every_route() {
    let (console, _store) = console_over_store().await;
    for path in ["", "/api/records", "/records/00"] {
        let anonymous = console
            .send(Method::GET, &format!("{PREFIX}{path}"), &[], "")
            .await;
        assert_eq!(
            anonymous.status,
            StatusCode::UNAUTHORIZED,
            "{path}: {}",
            anonymous.body
        );
    }
    let anonymous_post = console
        .send(
            Method::POST,
            &action(&key(3), "forget"),
            &[("content-type", "application/json")],
            "{}",
        )
        .await;
    assert_eq!(anonymous_post.status, StatusCode::UNAUTHORIZED);
    assert!(anonymous_post.json()["message"]
        .as_str()
        .unwrap()
        .contains("no x-operator header"));
    let banned = console
        .get_as("mallory", "act", &format!("{PREFIX}/api/records"))
        .await;
    assert_eq!(banned.status, StatusCode::FORBIDDEN);
}

/// Whatever a `GET` asks, nothing changes: actions answer `405` to it.
#[tokio::test]
async fn a_get_never_changes_anything() {
    let (console, store) = console_over_store().await;
    in_doubt(&store, key(4), "").await;
    let before = store.inspect(key(4)).await.unwrap();
    for path in [
        action(&key(4), "forget"),
        action(&key(4), "resolve-not-applied"),
        format!("{PREFIX}/records/{}/forget", key(4).to_hex()),
        format!("{PREFIX}/records/{}/resolve-not-applied", key(4).to_hex()),
    ] {
        let answer = console.get_as("alice", "act", &path).await;
        assert_eq!(answer.status, StatusCode::METHOD_NOT_ALLOWED, "{path}");
    }
    for path in [
        api_record(&key(4)),
        format!("{PREFIX}/records/{}", key(4).to_hex()),
    ] {
        assert_eq!(
            console.get_as("alice", "act", &path).await.status,
            StatusCode::OK
        );
    }
    let after = store.inspect(key(4)).await.unwrap();
    assert_eq!(
        before.map(|v| (v.generation, v.attempts)),
        after.map(|v| (v.generation, v.attempts))
    );
}

/// Every malformed input is a `400` naming its field.
#[tokio::test]
async fn hostile_input_is_400_naming_the_field() {
    let (console, store) = console_over_store().await;
    in_doubt(&store, key(5), "").await;
    let field = |answer: super::harness::Answer| {
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{}", answer.body);
        answer.json()["field"].as_str().unwrap().to_owned()
    };
    let list = |query: &str| format!("{PREFIX}/api/records?{query}");
    for (query, expected) in [
        ("after=0000000000000001.not-a-key", "after"),
        ("after=%00%ff", "after"),
        ("state=lost", "state"),
        ("status=200-99", "status"),
        ("older_than=forever", "older_than"),
        ("newer_than=10y", "newer_than"),
        ("limit=0", "limit"),
        ("limit=-1", "limit"),
        ("order=sideways", "order"),
        ("scope_id=12", "scope_id"),
        ("task=a&task=b", "task"),
        ("drop=table", "drop"),
    ] {
        assert_eq!(
            field(console.get_as("alice", "act", &list(query)).await),
            expected,
            "{query}"
        );
    }
    for forged in ["abc", &"zz".repeat(32), &"ab".repeat(33)] {
        let path = format!("{PREFIX}/api/records/{forged}");
        assert_eq!(field(console.get_as("alice", "act", &path).await), "key");
    }
    let look = console
        .get_as("alice", "act", &api_record(&key(5)))
        .await
        .json()["look"]
        .clone();
    let post = |body: Value| {
        let console = &console;
        async move {
            console
                .post_json("alice", "act", &action(&key(5), "forget"), &body)
                .await
        }
    };
    let mut bad_generation = look.clone();
    bad_generation["generation"] = "12".into();
    assert_eq!(
        field(post(json!({"expected": bad_generation, "reason": "r"})).await),
        "expected.generation"
    );
    assert_eq!(
        field(post(json!({"expected": look, "reason": ""})).await),
        "reason"
    );
    assert_eq!(field(post(json!({"expected": look})).await), "reason");
    assert_eq!(field(post(json!({"reason": "r"})).await), "expected");
    assert_eq!(field(post(json!(["not", "an", "object"])).await), "body");
    let forced_resolve = console
        .post_json(
            "alice",
            "act",
            &action(&key(5), "resolve-not-applied"),
            &json!({"expected": look, "reason": "r", "force": true}),
        )
        .await;
    assert_eq!(field(forced_resolve), "force");
    assert!(
        store.inspect(key(5)).await.unwrap().is_some(),
        "nothing changed"
    );
}

/// A JSON action needs its content type, which a cross-site form cannot send; a browser
/// that says the request is cross-site is refused whatever it sends.
#[tokio::test]
async fn a_json_action_needs_its_content_type_and_the_same_origin() {
    let (console, store) = console_over_store().await;
    in_doubt(&store, key(6), "").await;
    let look = console
        .get_as("alice", "act", &api_record(&key(6)))
        .await
        .json()["look"]
        .clone();
    let body = json!({"expected": look, "reason": "checked"}).to_string();
    let as_form = console
        .send(
            Method::POST,
            &action(&key(6), "forget"),
            &[
                ("x-operator", "alice"),
                ("x-role", "act"),
                ("content-type", "text/plain"),
            ],
            &body,
        )
        .await;
    assert_eq!(as_form.status, StatusCode::UNSUPPORTED_MEDIA_TYPE);
    let cross_site = console
        .send(
            Method::POST,
            &action(&key(6), "forget"),
            &[
                ("x-operator", "alice"),
                ("x-role", "act"),
                ("content-type", "application/json"),
                ("origin", "https://evil.example"),
            ],
            &body,
        )
        .await;
    assert_eq!(
        cross_site.status,
        StatusCode::FORBIDDEN,
        "{}",
        cross_site.body
    );
    assert_eq!(cross_site.json()["error"], "cross_site");
    assert!(store.inspect(key(6)).await.unwrap().is_some());
}

/// Resolving as not applied is for a record in doubt only; forgetting a live operation
/// needs force.
#[tokio::test]
async fn resolve_needs_a_record_in_doubt_and_forgetting_a_live_one_needs_force() {
    let (console, store) = console_over_store().await;
    in_flight(&store, key(7)).await;
    let record = console
        .get_as("alice", "act", &api_record(&key(7)))
        .await
        .json();
    assert_eq!(record["state"], "in_flight");
    assert!(record["lease_left_ms"].as_u64().unwrap() > 0);
    let look = record["look"].clone();

    let resolve = console
        .post_json(
            "alice",
            "act",
            &action(&key(7), "resolve-not-applied"),
            &json!({"expected": look, "reason": "looks stuck"}),
        )
        .await;
    assert_eq!(
        resolve.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        resolve.body
    );
    assert_eq!(resolve.json()["error"], "not_in_doubt");

    let forget = |force: bool| {
        let console = &console;
        let look = look.clone();
        async move {
            console
                .post_json(
                    "alice",
                    "act",
                    &action(&key(7), "forget"),
                    &json!({"expected": look, "reason": "owner crashed", "force": force}),
                )
                .await
        }
    };
    let live = forget(false).await;
    assert_eq!(live.status, StatusCode::CONFLICT, "{}", live.body);
    assert_eq!(live.json()["error"], "live");
    assert!(matches!(
        store.inspect(key(7)).await.unwrap().unwrap().state,
        RecordState::InFlight { .. }
    ));
    let forced = forget(true).await;
    assert_eq!(forced.status, StatusCode::OK, "{}", forced.body);
    assert!(store.inspect(key(7)).await.unwrap().is_none());
    let absent = forget(true).await;
    assert_eq!(absent.status, StatusCode::NOT_FOUND);
    assert_eq!(
        console
            .get_as("alice", "act", &api_record(&key(7)))
            .await
            .status,
        StatusCode::NOT_FOUND
    );
}

/// Pages follow their cursor to the end, each record once.
#[tokio::test]
async fn the_list_pages_with_cursors() {
    let (console, store) = console_over_store().await;
    for n in 10..15 {
        in_doubt(&store, key(n), "").await;
    }
    let mut seen = Vec::new();
    let first = format!("{PREFIX}/api/records?state=in_doubt&limit=2&order=oldest");
    let mut path = first.clone();
    loop {
        let page = console.get_as("bob", "read", &path).await;
        assert_eq!(page.status, StatusCode::OK, "{}", page.body);
        let page = page.json();
        let records = page["records"].as_array().unwrap();
        assert!(records.len() <= 2);
        seen.extend(
            records
                .iter()
                .map(|r| r["key"].as_str().unwrap().to_owned()),
        );
        match page["next"].as_str() {
            Some(next) => path = format!("{first}&after={next}"),
            None => break,
        }
    }
    let expected: Vec<String> = (10..15).map(|n| key(n).to_hex()).collect();
    assert_eq!(seen, expected, "oldest first, each once");
}

/// A record shows what it is of, and the list finds records by a target's prefix, a tool
/// and a task, as query parameters.
#[tokio::test(flavor = "current_thread")]
async fn the_list_shows_and_filters_by_origin() {
    let (console, store) = console_over_store().await;
    let charges: http::Uri = "https://payments.example/v1/charges?secret=1"
        .parse()
        .unwrap();
    let op = tower_idempotency::OperationId::new("task-42", "charge");
    in_doubt_of(
        &store,
        key(20),
        Origin::client(&Method::POST, &charges).with_operation(&op),
    )
    .await;
    in_doubt_of(&store, key(21), Origin::tool("refund")).await;
    in_doubt(&store, key(22), "").await;

    let listed = |query: &'static str| {
        let console = &console;
        async move {
            let page = console
                .get_as("bob", "read", &format!("{PREFIX}/api/records?{query}"))
                .await;
            assert_eq!(page.status, StatusCode::OK, "{}", page.body);
            page.json()["records"]
                .as_array()
                .unwrap()
                .iter()
                .map(|r| r["key"].as_str().unwrap().to_owned())
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(
        listed("target=POST%20https%3A%2F%2Fpayments.example%2F").await,
        [key(20).to_hex()]
    );
    assert_eq!(listed("tool=refund").await, [key(21).to_hex()]);
    assert_eq!(
        listed("task=task-42&state=in_doubt").await,
        [key(20).to_hex()]
    );
    assert!(listed("task=task-7").await.is_empty());

    let record = console.get_as("bob", "read", &api_record(&key(20))).await;
    assert_eq!(
        record.json()["origin"],
        json!({
            "face": "client",
            "target": "POST https://payments.example/v1/charges",
            "target_cut": false,
            "task_id": "task-42",
            "step_id": "charge",
        }),
        "no query string: it may hold secrets"
    );
    let record = console.get_as("bob", "read", &api_record(&key(22))).await;
    assert_eq!(
        record.json()["origin"],
        Value::Null,
        "a claim that named none"
    );
}

/// Each action leaves an audit event with the operator, the action, the key, the reason
/// and the result, the refused ones included.
#[tokio::test(flavor = "current_thread")]
async fn every_action_leaves_an_audit_event_with_its_operator_and_reason() {
    let (logs, _guard) = capture::events(tracing::Level::INFO);
    let (console, store) = console_over_store().await;
    in_doubt(&store, key(8), "").await;
    let look = console
        .get_as("alice", "act", &api_record(&key(8)))
        .await
        .json()["look"]
        .clone();
    let refused = console
        .post_json(
            "bob",
            "read",
            &action(&key(8), "forget"),
            &json!({"expected": look, "reason": "r"}),
        )
        .await;
    assert_eq!(refused.status, StatusCode::FORBIDDEN);
    let done = console
        .post_json(
            "alice",
            "act",
            &action(&key(8), "resolve-not-applied"),
            &json!({"expected": look, "reason": "INC-7 no charge found"}),
        )
        .await;
    assert_eq!(done.status, StatusCode::OK);
    let text = logs.text();
    let audit: Vec<&str> = text
        .lines()
        .filter(|line| line.contains("tower_idempotency::console"))
        .collect();
    assert_eq!(audit.len(), 2, "{text}");
    assert!(
        audit[0].contains("operator=bob") && audit[0].contains("forbidden"),
        "{}",
        audit[0]
    );
    let resolved = audit[1];
    for part in [
        "operator=alice",
        "role=\"act\"",
        "resolve_not_applied",
        "INC-7 no charge found",
        "forgotten",
        &key(8).to_hex(),
    ] {
        let loose = part.replace('"', "");
        assert!(
            resolved.contains(part) || resolved.contains(&loose),
            "{part} in {resolved}"
        );
    }
}

/// The body of a resolve as applied: the look, a reason, and the provider's receipt.
fn resolve_applied(look: &Value, outcome: Value) -> Value {
    json!({"expected": look, "reason": "INC-51: the provider shows charge ch_1", "outcome": outcome})
}

fn receipt() -> Value {
    json!({"status": 201, "content_type": "application/json",
        "body": "{\"id\":\"ch_1\",\"status\":\"succeeded\"}"})
}

/// Resolving as applied completes the record in doubt with the operator's receipt, shown at
/// once as completed with its status; a look taken before the record moved on is `409`
/// with what changed, a read-only operator is `403`, a bad receipt `400` naming its field,
/// a completed look `422`; and none of those changes anything.
#[tokio::test]
async fn resolve_applied_is_fenced_by_the_look_and_records_the_operators_receipt() {
    let (console, store) = console_over_store().await;
    in_doubt(&store, key(11), "").await;
    let path = action(&key(11), "resolve-applied");
    let look = console
        .get_as("alice", "act", &api_record(&key(11)))
        .await
        .json()["look"]
        .clone();

    let read_only = console
        .post_json("bob", "read", &path, &resolve_applied(&look, receipt()))
        .await;
    assert_eq!(
        read_only.status,
        StatusCode::FORBIDDEN,
        "{}",
        read_only.body
    );
    assert_eq!(read_only.json()["error"], "read_only");

    for (outcome, field) in [
        (json!({"status": 700, "body": "{}"}), "outcome.status"),
        (json!({"status": 201}), "outcome.body"),
        (
            json!({"status": 201, "body": "x".repeat(64 * 1024 + 1)}),
            "outcome.body",
        ),
        (
            json!({"status": 201, "content_type": "application/json", "body": "not json"}),
            "outcome.body",
        ),
    ] {
        let bad = console
            .post_json("alice", "act", &path, &resolve_applied(&look, outcome))
            .await;
        assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{field}: {}", bad.body);
        assert_eq!(bad.json()["field"], field, "{}", bad.body);
    }
    let no_outcome = console
        .post_json(
            "alice",
            "act",
            &path,
            &json!({"expected": look, "reason": "r"}),
        )
        .await;
    assert_eq!(no_outcome.status, StatusCode::BAD_REQUEST);
    assert_eq!(no_outcome.json()["field"], "outcome");
    let view = store.inspect(key(11)).await.unwrap().unwrap();
    assert_eq!(
        RecordKind::of(&view.state),
        RecordKind::InDoubt,
        "refused, nothing changed"
    );

    // Meanwhile the caller resumed it, and it failed again: the look is stale.
    let resume = BeginRequest::new(
        key(11),
        tower_idempotency::fingerprint::Fingerprint::of(&Method::POST, "/charges", b"{}"),
        std::time::Duration::from_secs(30),
        std::time::Duration::from_secs(3600),
    );
    let Begin::Resume { token, .. } = store.begin(resume).await.unwrap() else {
        panic!("an in-doubt record is resumed");
    };
    store
        .mark_in_doubt(key(11), token, std::time::Duration::from_secs(3600))
        .await
        .unwrap();
    let stale = console
        .post_json("alice", "act", &path, &resolve_applied(&look, receipt()))
        .await;
    assert_eq!(stale.status, StatusCode::CONFLICT, "{}", stale.body);
    let stale = stale.json();
    assert_eq!(stale["error"], "changed");
    assert_eq!(stale["changed"], json!(["attempts"]));
    assert_eq!(stale["current"]["state"], "in_doubt");
    assert_eq!(
        RecordKind::of(&store.inspect(key(11)).await.unwrap().unwrap().state),
        RecordKind::InDoubt
    );

    // With the record's look as it is now: resolved, completed with the receipt's status.
    let fresh = stale["current"]["look"].clone();
    let resolved = console
        .post_json("alice", "act", &path, &resolve_applied(&fresh, receipt()))
        .await;
    assert_eq!(resolved.status, StatusCode::OK, "{}", resolved.body);
    let resolved = resolved.json();
    assert_eq!(resolved["result"], "resolved");
    assert_eq!(resolved["current"]["state"], "completed");
    assert_eq!(resolved["current"]["status"], 201);
    assert_eq!(
        store.inspect(key(11)).await.unwrap().unwrap().state,
        RecordState::Completed {
            status: StatusCode::CREATED
        }
    );
    let Begin::Replay(tower_idempotency::ledger::Outcome::Response(replayed)) = store
        .begin(BeginRequest::new(
            key(11),
            tower_idempotency::fingerprint::Fingerprint::of(&Method::POST, "/charges", b"{}"),
            std::time::Duration::from_secs(30),
            std::time::Duration::from_secs(3600),
        ))
        .await
        .unwrap()
    else {
        panic!("a resolved record replays");
    };
    assert_eq!(
        replayed.body().as_ref(),
        br#"{"id":"ch_1","status":"succeeded"}"#
    );
    assert_eq!(replayed.headers()["content-type"], "application/json");

    // The completed record's own look: it keeps its outcome.
    let completed = resolved["current"]["look"].clone();
    let again = console
        .post_json(
            "alice",
            "act",
            &path,
            &resolve_applied(&completed, json!({"status": 200, "body": "other"})),
        )
        .await;
    assert_eq!(
        again.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{}",
        again.body
    );
    assert_eq!(again.json()["error"], "not_in_doubt");
}

/// A live owner's operation is resolved as applied only when forced; absent is `404`.
#[tokio::test]
async fn resolving_a_live_operation_as_applied_needs_force() {
    let (console, store) = console_over_store().await;
    in_flight(&store, key(12)).await;
    let path = action(&key(12), "resolve-applied");
    let look = console
        .get_as("alice", "act", &api_record(&key(12)))
        .await
        .json()["look"]
        .clone();
    let live = console
        .post_json("alice", "act", &path, &resolve_applied(&look, receipt()))
        .await;
    assert_eq!(live.status, StatusCode::CONFLICT, "{}", live.body);
    assert_eq!(live.json()["error"], "live");
    assert!(matches!(
        store.inspect(key(12)).await.unwrap().unwrap().state,
        RecordState::InFlight { .. }
    ));
    let mut forced = resolve_applied(&look, receipt());
    forced["force"] = true.into();
    let forced = console.post_json("alice", "act", &path, &forced).await;
    assert_eq!(forced.status, StatusCode::OK, "{}", forced.body);
    assert_eq!(forced.json()["current"]["state"], "completed");

    let absent = console
        .post_json(
            "alice",
            "act",
            &action(&key(13), "resolve-applied"),
            &resolve_applied(&look, receipt()),
        )
        .await;
    assert_eq!(absent.status, StatusCode::NOT_FOUND, "{}", absent.body);
}

/// A resolve as applied leaves its audit event: `WARN`, with the operator, the action, the
/// key, the reason, the status recorded and the result.
#[tokio::test(flavor = "current_thread")]
async fn a_resolve_as_applied_leaves_an_audit_event_with_the_status_recorded() {
    let (logs, _guard) = capture::events(tracing::Level::INFO);
    let (console, store) = console_over_store().await;
    in_doubt(&store, key(14), "").await;
    let look = console
        .get_as("alice", "act", &api_record(&key(14)))
        .await
        .json()["look"]
        .clone();
    let done = console
        .post_json(
            "alice",
            "act",
            &action(&key(14), "resolve-applied"),
            &resolve_applied(&look, receipt()),
        )
        .await;
    assert_eq!(done.status, StatusCode::OK, "{}", done.body);
    let text = logs.text();
    let audit: Vec<&str> = text
        .lines()
        .filter(|line| line.contains("tower_idempotency::console"))
        .collect();
    assert_eq!(audit.len(), 1, "{text}");
    for part in [
        "WARN",
        "operator=alice",
        "resolve_applied",
        "INC-51: the provider shows charge ch_1",
        "receipt_status=201",
        "result=\"resolved\"",
        &key(14).to_hex(),
    ] {
        let loose = part.replace('"', "");
        assert!(
            audit[0].contains(part) || audit[0].contains(&loose),
            "{part} in {}",
            audit[0]
        );
    }
}
