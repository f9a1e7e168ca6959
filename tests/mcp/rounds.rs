//! A multi-round `tools/call` under one key, at the route: "input required" is not the
//! call's outcome (the key is released, the call goes on), and the follow-up round is
//! fingerprinted with what the client answered.
//!
//! rmcp's transports refuse an "input required" answer at the revision they negotiate, so
//! the guarded router is called directly, with a real server peer in the call's context.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use rmcp::handler::server::router::tool::{ToolRoute, ToolRouter};
use rmcp::handler::server::tool::ToolCallContext;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, InputRequiredResult,
    NumberOrString, Tool,
};
use rmcp::service::{RequestContext, RunningService};
use rmcp::{ErrorData, RoleClient, RoleServer, ServerHandler, ServiceExt};
use serde_json::{json, Value};
use tower_idempotency::ledger::{IdempotencyStore, LedgerKey, MemoryStore, RecordState};
use tower_idempotency::mcp::{CallerScope, ToolGuard};
use tower_idempotency::server::problem;

use super::harness::{is_replay, text};

const SCOPE: &str = "orchestrator";

/// The server whose tool asks for an approval before it acts.
#[derive(Clone, Default)]
struct Approvals {
    /// Rounds that asked for input: no effect.
    asked: Arc<AtomicUsize>,
    /// Approved transfers: the effect.
    transfers: Arc<AtomicUsize>,
}

impl ServerHandler for Approvals {}

impl Approvals {
    fn transfers(&self) -> usize {
        self.transfers.load(Ordering::SeqCst)
    }

    fn asked(&self) -> usize {
        self.asked.load(Ordering::SeqCst)
    }

    /// `transfer`: without input responses it asks for an approval (round one); with
    /// them, it transfers once per run and answers which transfer it made.
    fn route(&self) -> ToolRoute<Self> {
        let attr = Tool::new(
            "transfer",
            "moves money once approved",
            serde_json::Map::new(),
        );
        ToolRoute::new_dyn(attr, |call: ToolCallContext<'_, Self>| {
            let server = call.service.clone();
            let approved = call.input_responses.is_some();
            Box::pin(async move {
                if !approved {
                    server.asked.fetch_add(1, Ordering::SeqCst);
                    let round = InputRequiredResult::from_request_state("awaiting-approval");
                    return Ok::<_, ErrorData>(CallToolResponse::InputRequired(round));
                }
                let n = server.transfers.fetch_add(1, Ordering::SeqCst) + 1;
                Ok(
                    CallToolResult::success(vec![ContentBlock::text(format!("transfer {n}"))])
                        .into(),
                )
            })
        })
    }
}

/// A server peer, from a server served over an in-process duplex (rmcp makes peers only
/// for a running service); the client is kept so that the peer stays connected.
async fn server_peer(
    server: Approvals,
) -> (
    RunningService<RoleServer, Approvals>,
    RunningService<RoleClient, ()>,
) {
    let (server_io, client_io) = tokio::io::duplex(64 * 1024);
    let (running, client) = tokio::join!(server.serve(server_io), ().serve(client_io));
    (
        running.expect("server starts"),
        client.expect("client starts"),
    )
}

/// Round `id` of the call `transfer` under `key`, with what the client answered.
fn round(
    id: i64,
    key: &str,
    input_responses: Option<Value>,
    peer: &rmcp::Peer<RoleServer>,
) -> (CallToolRequestParams, RequestContext<RoleServer>) {
    let mut params = CallToolRequestParams::new("transfer");
    params.arguments = json!({"from": "acc-1", "to": "acc-2", "cents": 5000})
        .as_object()
        .cloned();
    if let Some(responses) = input_responses {
        let responses: BTreeMap<String, Value> =
            serde_json::from_value(responses).expect("an object");
        params.input_responses = Some(responses);
        params.request_state = Some("awaiting-approval".to_owned());
    }
    let mut context = RequestContext::new(NumberOrString::Number(id), peer.clone());
    context
        .meta
        .0
         .0
        .insert("idempotency-key".to_owned(), Value::from(key));
    (params, context)
}

async fn call(
    router: &ToolRouter<Approvals>,
    server: &Approvals,
    (params, context): (CallToolRequestParams, RequestContext<RoleServer>),
) -> Result<CallToolResponse, ErrorData> {
    router
        .call(ToolCallContext::new(server, params, context))
        .await
}

fn complete(answer: Result<CallToolResponse, ErrorData>) -> CallToolResult {
    match answer {
        Ok(CallToolResponse::Complete(result)) => result,
        other => panic!("not a complete result: {other:?}"),
    }
}

fn approve() -> Option<Value> {
    Some(json!({"approval": {"action": "accept", "content": {"approved": true}}}))
}

fn decline() -> Option<Value> {
    Some(json!({"approval": {"action": "decline"}}))
}

#[tokio::test]
async fn input_required_releases_the_key_and_the_follow_up_runs_once_fingerprinted() {
    let server = Approvals::default();
    let (running, _client) = server_peer(server.clone()).await;
    let peer = running.peer().clone();
    let store = MemoryStore::new();
    let guard = ToolGuard::builder(store.clone(), CallerScope::single_client(SCOPE))
        .build()
        .unwrap();
    let router = guard.router(ToolRouter::new().with_route(server.route()));
    let key = LedgerKey::server(SCOPE, "k-transfer");

    // Round one asks for input: no outcome, so no record holds the key.
    let first = call(&router, &server, round(1, "k-transfer", None, &peer)).await;
    assert!(
        matches!(first, Ok(CallToolResponse::InputRequired(_))),
        "round one asks: {first:?}"
    );
    assert!(store.inspect(key).await.unwrap().is_none(), "released");
    // The client re-issues round one (its answer was lost): it asks again, unrefused.
    let again = call(&router, &server, round(2, "k-transfer", None, &peer)).await;
    assert!(matches!(again, Ok(CallToolResponse::InputRequired(_))));
    assert_eq!((server.asked(), server.transfers()), (2, 0));
    assert!(
        store.inspect(key).await.unwrap().is_none(),
        "still released"
    );

    // The follow-up round runs the tool once, and its result is recorded.
    let done = complete(call(&router, &server, round(3, "k-transfer", approve(), &peer)).await);
    assert_eq!(server.transfers(), 1);
    assert_eq!(text(&done), "transfer 1");
    assert!(!is_replay(&done));
    let view = store.inspect(key).await.unwrap().expect("recorded");
    assert!(matches!(view.state, RecordState::Completed { .. }));

    // The follow-up re-issued: replayed, not run again.
    let replay = complete(call(&router, &server, round(4, "k-transfer", approve(), &peer)).await);
    assert_eq!(server.transfers(), 1, "transferred once");
    assert_eq!(text(&replay), "transfer 1");
    assert!(is_replay(&replay));

    // A follow-up that answered otherwise, under the same key: another call, refused.
    let changed = call(&router, &server, round(5, "k-transfer", decline(), &peer)).await;
    let error = changed.expect_err("other input responses under the key are refused");
    let kind = error
        .data
        .as_ref()
        .and_then(|data| data.get("type"))
        .cloned();
    assert_eq!(
        kind,
        Some(Value::from(problem::PAYLOAD_MISMATCH)),
        "{error:?}"
    );
    // And round one under the used key: its fingerprint differs too (no responses).
    let restarted = call(&router, &server, round(6, "k-transfer", None, &peer)).await;
    assert!(
        restarted.is_err(),
        "a used key does not start the call over"
    );
    assert_eq!((server.asked(), server.transfers()), (2, 1));

    drop(running);
}
