//! A dropped stream is not a lost outcome: over real Streamable HTTP on loopback, a client
//! that hangs up mid-effect (rmcp then cancels the request's token) and re-issues the call
//! gets one effect and the first answer; without the guard, two.

use std::sync::atomic::Ordering;
use std::time::Duration;

use rmcp::model::CallToolResult;
use serde_json::json;
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::mcp::{CallerScope, ToolGuard};
use tower_idempotency::server::problem;

use super::harness::{call, http_client, is_replay, serve_http, text, Billing, Client, Effects};

fn charge_42() -> serde_json::Value {
    json!({"order_id": "o-42", "cents": 1999})
}

/// Start the charge under `key` and hang up once the charge is made.
async fn hang_up_mid_effect(client: &Client, effects: &Effects, key: Option<&'static str>) {
    let peer = client.peer().clone();
    let call = tokio::spawn(async move { peer.call_tool(call("charge", charge_42(), key)).await });
    effects.started(1).await;
    // Dropping the call's future is the client's hang-up: rmcp's client closes the
    // response stream and tells the server the request is cancelled.
    call.abort();
    let _ = call.await;
}

/// Re-issue the call (a new request id) until it is no longer in flight.
async fn reissue(client: &Client, key: Option<&'static str>) -> CallToolResult {
    loop {
        match client.call_tool(call("charge", charge_42(), key)).await {
            Ok(result) => return result,
            Err(rmcp::ServiceError::McpError(error))
                if error
                    .data
                    .as_ref()
                    .and_then(|d| d.get("type"))
                    .and_then(|t| t.as_str())
                    == Some(problem::IN_FLIGHT) =>
            {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(other) => panic!("re-issue failed: {other:?}"),
        }
    }
}

#[tokio::test]
async fn a_stream_dropped_mid_effect_then_reissued_gives_one_effect_and_the_first_answer() {
    let effects = Effects::gated();
    let guard = ToolGuard::builder(
        MemoryStore::new(),
        CallerScope::function(|_| Some("orchestrator".to_owned())),
    )
    .build()
    .unwrap();
    let served = effects.clone();
    let (addr, _server) = serve_http(move || Billing::new(&guard, served.clone())).await;
    let client = http_client(addr).await;

    hang_up_mid_effect(&client, &effects, Some("k-drop")).await;
    // The effect under way finishes after the hang-up, and its outcome is recorded.
    effects.release(1);
    let again = reissue(&client, Some("k-drop")).await;

    assert_eq!(effects.charges(), 1, "one effect");
    assert_eq!(text(&again), "ch_o-42_1", "the first run's answer");
    assert!(is_replay(&again));
    assert_eq!(
        effects.cancelled.load(Ordering::SeqCst),
        0,
        "the protected handler ran under a token the hang-up does not cancel"
    );
}

#[tokio::test]
async fn a_client_gone_mid_effect_and_another_reissuing_gets_the_recorded_answer() {
    let effects = Effects::gated();
    let guard = ToolGuard::builder(
        MemoryStore::new(),
        CallerScope::function(|_| Some("orchestrator".to_owned())),
    )
    .build()
    .unwrap();
    let served = effects.clone();
    let (addr, _server) = serve_http(move || Billing::new(&guard, served.clone())).await;
    let first = http_client(addr).await;
    hang_up_mid_effect(&first, &effects, Some("k-gone")).await;
    // The whole client goes: its session and connections closed.
    first.cancel().await.unwrap();
    effects.release(1);
    let second = http_client(addr).await;
    let again = reissue(&second, Some("k-gone")).await;
    assert_eq!(effects.charges(), 1);
    assert_eq!(text(&again), "ch_o-42_1");
}

#[tokio::test]
async fn without_the_guard_the_same_drop_charges_twice() {
    let effects = Effects::gated();
    let served = effects.clone();
    let (addr, _server) = serve_http(move || Billing::bare(served.clone())).await;
    let client = http_client(addr).await;
    hang_up_mid_effect(&client, &effects, None).await;
    // The hang-up cancelled the handler's token: it gave up after charging.
    while effects.cancelled.load(Ordering::SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    effects.release(1);
    let again = reissue(&client, None).await;
    assert_eq!(effects.charges(), 2, "the naive re-issue charged again");
    assert_eq!(text(&again), "ch_o-42_2");
}
