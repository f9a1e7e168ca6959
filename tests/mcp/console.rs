//! The console's list and inspect as read-only MCP tools, over Streamable HTTP on
//! loopback, behind the console's authorizer.

use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::model::{ServerCapabilities, ServerConfig};
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{tool_handler, ServerHandler};
use serde_json::json;
use tower::{service_fn, Layer, ServiceExt};
use tower_idempotency::console::{Console, Operator, Refusal, Role, INSPECT_TOOL, LIST_TOOL};
use tower_idempotency::ledger::{MemoryStore, Records};
use tower_idempotency::tool::{ProviderKeys, ToolCall, ToolLayer};
use tower_idempotency::OperationId;

use super::harness::{call, http_client_with};

#[derive(Clone)]
struct Ops {
    tool_router: ToolRouter<Self>,
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Ops {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
    }
}

fn authorizer(head: &http::request::Parts) -> Result<Operator, Refusal> {
    match head
        .headers
        .get("x-ops-user")
        .and_then(|user| user.to_str().ok())
    {
        Some(user) => Ok(Operator::new(user, Role::ReadOnly)),
        None => Err(Refusal::unauthenticated(
            "sign in through the operations proxy",
        )),
    }
}

/// A charge left in doubt: its tool failed after it may have run.
async fn one_in_doubt(store: &MemoryStore) {
    let layer = ToolLayer::builder(store.clone(), "charge", ProviderKeys::Ignored)
        .build()
        .unwrap();
    let tool = layer.layer(service_fn(|_: ToolCall<serde_json::Value>| async {
        Err::<String, _>(std::io::Error::other("connection reset"))
    }));
    let op = OperationId::new("task-7", "charge");
    let _ = tool
        .oneshot(ToolCall::new(op, json!({"order_id": "o-42"})))
        .await;
}

#[tokio::test]
async fn an_operators_agent_lists_and_inspects_what_is_in_doubt() {
    let store = MemoryStore::new();
    one_in_doubt(&store).await;
    let records = Records::new(store.clone());
    let make = move || {
        let console = Console::new(records.clone(), authorizer);
        Ok(Ops {
            tool_router: console.mcp_tools(),
        })
    };
    let service = StreamableHttpService::new(
        make,
        LocalSessionManager::default().into(),
        StreamableHttpServerConfig::default(),
    );
    let app = axum::Router::new().nest_service("/mcp", service);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let agent = http_client_with(addr, &[("x-ops-user", "ops-agent")]).await;
    let tools = agent.list_all_tools().await.unwrap();
    assert_eq!(tools.len(), 2);
    assert!(tools
        .iter()
        .all(|tool| tool.annotations.as_ref().and_then(|a| a.read_only_hint) == Some(true)));

    let listed = agent
        .call_tool(call(LIST_TOOL, json!({"state": "in_doubt"}), None))
        .await
        .unwrap();
    assert_ne!(listed.is_error, Some(true), "{listed:?}");
    let records = &listed.structured_content.as_ref().unwrap()["records"];
    assert_eq!(records.as_array().unwrap().len(), 1);
    let key = records[0]["key"].as_str().unwrap().to_owned();

    let inspected = agent
        .call_tool(call(INSPECT_TOOL, json!({"key": key}), None))
        .await
        .unwrap();
    let shown = inspected.structured_content.unwrap();
    assert_eq!(shown["state"], "in_doubt", "{shown}");
    assert!(
        shown["request"]["uri"]
            .as_str()
            .unwrap()
            .ends_with("/tools/charge"),
        "{shown}"
    );

    // Without an operator, the authorizer refuses: an error result, nothing shown.
    let stranger = http_client_with(addr, &[]).await;
    let refused = stranger
        .call_tool(call(LIST_TOOL, json!({}), None))
        .await
        .unwrap();
    assert_eq!(refused.is_error, Some(true));
    assert!(refused.structured_content.unwrap().get("records").is_none());
}
