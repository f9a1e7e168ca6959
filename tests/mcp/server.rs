//! The tool server's side: one run per key and caller, replays marked, changed arguments
//! refused by name, outcomes and non-outcomes, keyless calls, and other methods untouched.

use std::time::Duration;

use axum::extract::Request;
use axum::middleware::{from_fn, Next};
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use serde_json::json;
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::mcp::{CallerScope, ToolGuard};
use tower_idempotency::server::problem;

use super::harness::{
    call, duplex, http_client, http_client_with, is_replay, serve_http, serve_http_configured,
    serve_http_with, text, Billing, Effects,
};

fn stdio_guard() -> ToolGuard {
    ToolGuard::builder(
        MemoryStore::new(),
        CallerScope::single_client("orchestrator"),
    )
    .build()
    .unwrap()
}

/// Over HTTP, with one client in the test: the one caller named explicitly.
fn one_http_caller_guard() -> ToolGuard {
    ToolGuard::builder(
        MemoryStore::new(),
        CallerScope::function(|_| Some("orchestrator".to_owned())),
    )
    .build()
    .unwrap()
}

fn charge_42() -> serde_json::Value {
    json!({"order_id": "o-42", "cents": 1999, "summary": "charge order 42"})
}

fn problem_type(error: &rmcp::ServiceError) -> Option<String> {
    match error {
        rmcp::ServiceError::McpError(data) => data
            .data
            .as_ref()
            .and_then(|data| data.get("type"))
            .and_then(|kind| kind.as_str())
            .map(str::to_owned),
        _ => None,
    }
}

fn error_data(error: &rmcp::ServiceError) -> serde_json::Value {
    match error {
        rmcp::ServiceError::McpError(data) => data.data.clone().unwrap_or_default(),
        other => panic!("not a JSON-RPC error: {other:?}"),
    }
}

#[tokio::test]
async fn two_request_ids_one_key_run_once_over_duplex() {
    let effects = Effects::default();
    let client = duplex(Billing::new(&stdio_guard(), effects.clone())).await;
    let first = client
        .call_tool(call("charge", charge_42(), Some("k-1")))
        .await
        .unwrap();
    // A re-issue is a new JSON-RPC request (a new id), with the same key and arguments.
    let again = client
        .call_tool(call("charge", charge_42(), Some("k-1")))
        .await
        .unwrap();
    assert_eq!(effects.charges(), 1, "charged once");
    assert_eq!(text(&again), text(&first));
    assert!(!is_replay(&first));
    assert!(is_replay(&again), "the replay is marked in _meta");
}

#[tokio::test]
async fn two_request_ids_one_key_run_once_over_streamable_http() {
    let effects = Effects::default();
    let guard = one_http_caller_guard();
    let served = effects.clone();
    let (addr, _server) = serve_http(move || Billing::new(&guard, served.clone())).await;
    let client = http_client(addr).await;
    let first = client
        .call_tool(call("charge", charge_42(), Some("k-1")))
        .await
        .unwrap();
    let again = client
        .call_tool(call("charge", charge_42(), Some("k-1")))
        .await
        .unwrap();
    assert_eq!(effects.charges(), 1);
    assert_eq!(text(&again), text(&first));
    assert!(is_replay(&again));
}

#[tokio::test]
async fn two_request_ids_one_key_run_once_over_stateless_streamable_http() {
    // The 2026-07-28 revision: no sessions, plain JSON answers.
    let effects = Effects::default();
    let guard = one_http_caller_guard();
    let served = effects.clone();
    let mut config = rmcp::transport::StreamableHttpServerConfig::default();
    config.legacy_session_mode = false;
    config.json_response = true;
    let (addr, _server) = serve_http_configured(
        move || Billing::new(&guard, served.clone()),
        |app| app,
        config,
    )
    .await;
    let client = http_client(addr).await;
    let first = client
        .call_tool(call("charge", charge_42(), Some("k-1")))
        .await
        .unwrap();
    let again = client
        .call_tool(call("charge", charge_42(), Some("k-1")))
        .await
        .unwrap();
    assert_eq!(effects.charges(), 1);
    assert_eq!(text(&again), text(&first));
    assert!(is_replay(&again));
}

#[tokio::test]
async fn the_key_travels_as_an_http_header_too_and_a_different_meta_key_is_refused() {
    let effects = Effects::default();
    let guard = one_http_caller_guard();
    let served = effects.clone();
    let (addr, _server) = serve_http(move || Billing::new(&guard, served.clone())).await;
    let client = http_client_with(addr, &[("idempotency-key", "\"k-h\"")]).await;
    let first = client
        .call_tool(call("charge", charge_42(), None))
        .await
        .unwrap();
    // The same key in both places is one key.
    let both = client
        .call_tool(call("charge", charge_42(), Some("k-h")))
        .await
        .unwrap();
    assert!(is_replay(&both));
    assert_eq!(text(&both), text(&first));
    // Two different keys: refused, nothing run.
    let conflict = client
        .call_tool(call("charge", charge_42(), Some("k-other")))
        .await
        .unwrap_err();
    assert_eq!(
        problem_type(&conflict).as_deref(),
        Some(problem::KEY_INVALID)
    );
    assert_eq!(error_data(&conflict)["reason"], "meta-and-header-differ");
    assert_eq!(effects.charges(), 1);
}

#[tokio::test]
async fn a_duplicate_in_flight_is_told_to_retry_then_replays() {
    let effects = Effects::gated();
    let client = duplex(Billing::new(&stdio_guard(), effects.clone())).await;
    let first = {
        let peer = client.peer().clone();
        tokio::spawn(async move {
            peer.call_tool(call("charge", charge_42(), Some("k-1")))
                .await
        })
    };
    while effects.started.load(std::sync::atomic::Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let busy = client
        .call_tool(call("charge", charge_42(), Some("k-1")))
        .await
        .unwrap_err();
    assert_eq!(problem_type(&busy).as_deref(), Some(problem::IN_FLIGHT));
    assert!(
        error_data(&busy)["retryAfterMs"].as_u64().is_some(),
        "says when to retry"
    );
    effects.release(1);
    let first = first.await.unwrap().unwrap();
    let again = client
        .call_tool(call("charge", charge_42(), Some("k-1")))
        .await
        .unwrap();
    assert_eq!(text(&again), text(&first));
    assert_eq!(effects.charges(), 1);
}

#[tokio::test]
async fn changed_arguments_under_a_key_are_refused_naming_the_fields() {
    let effects = Effects::default();
    let client = duplex(Billing::new(&stdio_guard(), effects.clone())).await;
    client
        .call_tool(call("charge", charge_42(), Some("k-1")))
        .await
        .unwrap();
    let changed = json!({"order_id": "o-42", "cents": 2999, "summary": "bill the customer"});
    let refused = client
        .call_tool(call("charge", changed, Some("k-1")))
        .await
        .unwrap_err();
    assert_eq!(
        problem_type(&refused).as_deref(),
        Some(problem::PAYLOAD_MISMATCH)
    );
    assert_eq!(
        error_data(&refused)["changedFields"],
        json!(["cents", "summary"])
    );
    assert_eq!(error_data(&refused)["tool"], json!(false));
    if let rmcp::ServiceError::McpError(data) = &refused {
        assert!(data.message.contains("cents, summary"), "{}", data.message);
    }
    // The same key for another tool: refused too, never the charge's result.
    let other_tool = client
        .call_tool(call("lookup", json!({"order_id": "o-42"}), Some("k-1")))
        .await
        .unwrap_err();
    assert_eq!(
        problem_type(&other_tool).as_deref(),
        Some(problem::PAYLOAD_MISMATCH)
    );
    assert_eq!(error_data(&other_tool)["tool"], json!(true));
    assert_eq!(effects.charges(), 1);
}

#[tokio::test]
async fn an_is_error_result_is_an_outcome_and_is_replayed() {
    let effects = Effects::default();
    let client = duplex(Billing::new(&stdio_guard(), effects.clone())).await;
    let declined = json!({"order_id": "o-42", "cents": 0});
    let first = client
        .call_tool(call("charge", declined.clone(), Some("k-0")))
        .await
        .unwrap();
    assert_eq!(first.is_error, Some(true));
    let again = client
        .call_tool(call("charge", declined, Some("k-0")))
        .await
        .unwrap();
    assert_eq!(again.is_error, Some(true));
    assert!(
        is_replay(&again),
        "a tool's error result is its answer, recorded"
    );
}

#[tokio::test]
async fn arguments_that_do_not_parse_are_no_outcome() {
    let effects = Effects::default();
    let client = duplex(Billing::new(&stdio_guard(), effects.clone())).await;
    let malformed = json!({"order_id": "o-42", "cents": "a lot"});
    let refused = client
        .call_tool(call("charge", malformed, Some("k-1")))
        .await
        .unwrap();
    assert_eq!(
        refused.is_error,
        Some(true),
        "rmcp answers a parse error as an error result"
    );
    assert!(!is_replay(&refused));
    // The key was released: the corrected call under it runs, rather than being refused as
    // a changed payload or answered with the parse error.
    let fixed = client
        .call_tool(call("charge", charge_42(), Some("k-1")))
        .await
        .unwrap();
    assert_ne!(fixed.is_error, Some(true));
    assert_eq!(effects.charges(), 1);
}

#[tokio::test]
async fn keyless_calls_pass_through_and_are_counted() {
    let effects = Effects::default();
    let guard = stdio_guard();
    let client = duplex(Billing::new(&guard, effects.clone())).await;
    client
        .call_tool(call("charge", charge_42(), None))
        .await
        .unwrap();
    client
        .call_tool(call("charge", charge_42(), None))
        .await
        .unwrap();
    assert_eq!(
        effects.charges(),
        2,
        "no key, no protection: run as they came"
    );
    assert_eq!(guard.keyless_calls(), 2);
}

#[tokio::test]
async fn required_keys_refuse_keyless_side_effects_but_not_read_only_tools() {
    let effects = Effects::default();
    let guard = ToolGuard::builder(
        MemoryStore::new(),
        CallerScope::single_client("orchestrator"),
    )
    .require_keys(true)
    .build()
    .unwrap();
    let client = duplex(Billing::new(&guard, effects.clone())).await;
    let refused = client
        .call_tool(call("charge", charge_42(), None))
        .await
        .unwrap_err();
    assert_eq!(
        problem_type(&refused).as_deref(),
        Some(problem::KEY_MISSING)
    );
    let read = client
        .call_tool(call("lookup", json!({"order_id": "o-42"}), None))
        .await
        .unwrap();
    assert_eq!(text(&read), "order o-42");
    assert_eq!(effects.charges(), 0);
}

#[tokio::test]
async fn tools_list_and_other_methods_are_untouched() {
    let guarded = duplex(Billing::new(&stdio_guard(), Effects::default())).await;
    let bare = duplex(Billing::bare(Effects::default())).await;
    let listed = guarded.list_all_tools().await.unwrap();
    assert_eq!(listed, bare.list_all_tools().await.unwrap());
    assert_eq!(listed.len(), 3);
    let info = guarded.peer_info().expect("initialized");
    let experimental = info.capabilities.experimental.as_ref().unwrap();
    assert_eq!(experimental["idempotency-key"]["meta"], "idempotency-key");
}

/// Who the caller is, as the authentication layer established it.
#[derive(Clone)]
struct Principal(String);

async fn authenticate(mut request: Request, next: Next) -> Response {
    let token = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok());
    let account = match token {
        Some("Bearer alice-1" | "Bearer alice-2") => "alice",
        Some("Bearer bob") => "bob",
        _ => return StatusCode::UNAUTHORIZED.into_response(),
    };
    request
        .extensions_mut()
        .insert(Principal(account.to_owned()));
    next.run(request).await
}

#[tokio::test]
async fn keys_are_scoped_by_the_principal_of_the_auth_layer() {
    let effects = Effects::default();
    let guard = ToolGuard::builder(
        MemoryStore::new(),
        CallerScope::http_principal(|parts| {
            parts.extensions.get::<Principal>().map(|p| p.0.clone())
        }),
    )
    .build()
    .unwrap();
    let served = effects.clone();
    let (addr, _server) = serve_http_with(
        move || Billing::new(&guard, served.clone()),
        |app| app.layer(from_fn(authenticate)),
    )
    .await;
    let alice = http_client_with(addr, &[("authorization", "Bearer alice-1")]).await;
    let first = alice
        .call_tool(call("charge", charge_42(), Some("k-1")))
        .await
        .unwrap();
    // Alice's token was refreshed: the same caller, so her replay.
    let alice_again = http_client_with(addr, &[("authorization", "Bearer alice-2")]).await;
    let again = alice_again
        .call_tool(call("charge", charge_42(), Some("k-1")))
        .await
        .unwrap();
    assert!(is_replay(&again));
    assert_eq!(text(&again), text(&first));
    // Bob, with the same key and arguments: his own call, never alice's result.
    let bob = http_client_with(addr, &[("authorization", "Bearer bob")]).await;
    let his = bob
        .call_tool(call("charge", charge_42(), Some("k-1")))
        .await
        .unwrap();
    assert!(!is_replay(&his));
    assert_eq!(effects.charges(), 2);
}

#[tokio::test]
async fn a_keyed_call_without_a_principal_is_refused() {
    let effects = Effects::default();
    let guard = ToolGuard::builder(
        MemoryStore::new(),
        CallerScope::http_principal(|parts| {
            parts.extensions.get::<Principal>().map(|p| p.0.clone())
        }),
    )
    .build()
    .unwrap();
    // Over a duplex there is no HTTP request, hence no principal.
    let client = duplex(Billing::new(&guard, effects.clone())).await;
    let refused = client
        .call_tool(call("charge", charge_42(), Some("k-1")))
        .await
        .unwrap_err();
    assert_eq!(
        problem_type(&refused).as_deref(),
        Some(problem::SCOPE_MISSING)
    );
    assert_eq!(effects.charges(), 0);
}

/// Two clients of one Streamable HTTP server, a guard scoped `single_client`: the second
/// client's call, under the same key and arguments as the first's, must not be answered
/// with the first's charge (its own charge lost in silence). The scope is refused over
/// HTTP, loudly, for every keyed call, and the tool never runs under it.
#[tokio::test]
async fn a_single_client_scope_behind_a_shared_http_server_is_refused_loudly() {
    let effects = Effects::default();
    let guard = stdio_guard();
    let served = effects.clone();
    let (addr, _server) = serve_http(move || Billing::new(&guard, served.clone())).await;
    let (alice, bob) = tokio::join!(http_client(addr), http_client(addr));
    for client in [&alice, &bob] {
        let error = client
            .call_tool(call("charge", charge_42(), Some("order-42")))
            .await
            .expect_err("a keyed call under a single-client scope over HTTP is refused");
        assert_eq!(
            problem_type(&error).as_deref(),
            Some(problem::SCOPE_MISSING)
        );
        assert!(error.to_string().contains("single_client"), "{error}");
    }
    assert_eq!(
        effects.charges(),
        0,
        "no charge under a scope shared by all"
    );
    // Keyless calls are not scoped: they still run as they came.
    bob.call_tool(call("charge", charge_42(), None))
        .await
        .unwrap();
    assert_eq!(effects.charges(), 1);
}

/// A tool guarded by name runs once per key over a real transport; a name the router does
/// not have (a misspelt tool, which would be left unguarded and charge on every re-issue)
/// is refused when the router is built.
#[tokio::test]
async fn a_tool_guarded_by_name_runs_once_and_a_misspelt_name_fails_at_build() {
    let effects = Effects::default();
    let client = duplex(Billing::guarding_one(
        &stdio_guard(),
        effects.clone(),
        "charge",
    ))
    .await;
    for _ in 0..2 {
        client
            .call_tool(call("charge", charge_42(), Some("k-1")))
            .await
            .unwrap();
    }
    assert_eq!(effects.charges(), 1, "the guarded tool charged once");

    let guard = stdio_guard();
    let misspelt = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Billing::guarding_one(&guard, Effects::default(), "chrage")
    }));
    let Err(panic) = misspelt else {
        panic!("a misspelt tool name is refused");
    };
    let message = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(message.contains("no tool \"chrage\""), "{message}");
    assert!(
        message.contains("\"charge\""),
        "names the router's tools: {message}"
    );
}
