//! The console's list and inspect as read-only MCP tools (features `console` and `mcp`):
//! an operator's agent asks what is in doubt, behind the console's authorizer.

use std::sync::Arc;

use axum::body::Body;
use axum::response::Response;
use http::request::Parts;
use http_body_util::BodyExt;
use rmcp::handler::server::router::tool::{ToolRoute, ToolRouter};
use rmcp::model::{CallToolResult, ContentBlock, JsonObject, Tool, ToolAnnotations};
use rmcp::ErrorData;
use serde_json::{json, Value};

use super::{api, Console, Shared};

/// The list tool's name.
pub const LIST_TOOL: &str = "idempotency_records_list";
/// The inspect tool's name.
pub const INSPECT_TOOL: &str = "idempotency_record_inspect";

/// The list's filters, as the API's query string takes them.
const FILTERS: [(&str, &str); 8] = [
    (
        "state",
        "in_flight, in_doubt or completed (repeatable, comma-separated)",
    ),
    ("status", "a recorded status (completed records)"),
    ("older_than", "last changed longer ago than this, e.g. 10m"),
    ("newer_than", "last changed more recently than this"),
    ("scope", "a scope, as the layer names it"),
    ("scope_id", "a scope's digest, 16 hex digits"),
    ("order", "oldest or newest (first)"),
    ("limit", "at most this many records (a page)"),
];

impl Console {
    /// The console's list and inspect as read-only MCP tools, [`LIST_TOOL`] and
    /// [`INSPECT_TOOL`], for an rmcp server's router (`tools + console.mcp_tools()`): an
    /// operator's agent asks what is in doubt. Both are annotated read-only and answer the
    /// API's JSON (`GET api/records`, `GET api/records/{key}`: see the
    /// [module docs](super)), as structured content and as text.
    ///
    /// Every call goes through the console's [authorizer](super::Authorize), which gets
    /// the head of the HTTP request that carried the call (rmcp's Streamable HTTP server
    /// hands it over), or an empty head over a transport without one (stdio): a refusal
    /// is an error result (`isError: true`) holding the API's problem. No action is
    /// offered as a tool: acting stays with a person, in the console.
    ///
    /// ```
    /// use rmcp::handler::server::router::tool::ToolRouter;
    /// use tower_idempotency::console::{Console, Operator, Role};
    /// use tower_idempotency::ledger::{MemoryStore, Records};
    ///
    /// #[derive(Clone)]
    /// struct OpsServer;
    ///
    /// let console = Console::new(Records::new(MemoryStore::new()), |_: &http::request::Parts| {
    ///     Ok(Operator::new("ops-agent", Role::ReadOnly))
    /// });
    /// let tools: ToolRouter<OpsServer> = console.mcp_tools();
    /// assert!(tools.has_route("idempotency_records_list"));
    /// assert!(tools.has_route("idempotency_record_inspect"));
    /// ```
    pub fn mcp_tools<S>(self) -> ToolRouter<S>
    where
        S: Send + Sync + 'static,
    {
        let shared = Arc::new(self.shared);
        ToolRouter::new()
            .with_route(list_route(shared.clone()))
            .with_route(inspect_route(shared))
    }
}

fn read_only() -> ToolAnnotations {
    ToolAnnotations::new().read_only(true)
}

fn list_route<S: Send + Sync + 'static>(shared: Arc<Shared>) -> ToolRoute<S> {
    let mut properties = serde_json::Map::new();
    for (name, description) in FILTERS
        .iter()
        .chain(&[("after", "the cursor of the next page")])
    {
        properties.insert(
            (*name).to_owned(),
            json!({"type": "string", "description": description}),
        );
    }
    let schema = json!({"type": "object", "properties": properties});
    let attr = Tool::new(
        LIST_TOOL,
        "List the idempotency ledger's records (in flight, in doubt, completed), filtered, a page at a time",
        object(schema),
    )
    .annotate(read_only());
    ToolRoute::new_dyn(attr, move |call| {
        let shared = shared.clone();
        let head = head_of(&call.request_context, list_uri(call.arguments.as_ref()));
        Box::pin(async move {
            let response = match head {
                Ok(head) => api::list_answer(&shared, &head).await,
                Err(refused) => return Ok(refused.into()),
            };
            Ok(as_result(response).await.into())
        })
    })
}

fn inspect_route<S: Send + Sync + 'static>(shared: Arc<Shared>) -> ToolRoute<S> {
    let schema = json!({
        "type": "object",
        "properties": {"key": {"type": "string", "description": "the record's key, 64 hex digits"}},
        "required": ["key"],
    });
    let attr = Tool::new(
        INSPECT_TOOL,
        "Show one idempotency ledger record, with its frozen request (secrets redacted)",
        object(schema),
    )
    .annotate(read_only());
    ToolRoute::new_dyn(attr, move |call| {
        let shared = shared.clone();
        let key = call
            .arguments
            .as_ref()
            .and_then(|arguments| arguments.get("key"))
            .and_then(Value::as_str)
            .map(str::to_owned);
        let head = head_of(&call.request_context, "/api/records".to_owned());
        Box::pin(async move {
            let Some(key) = key else {
                return Err(ErrorData::invalid_params(
                    "`key` (a string) is required",
                    None,
                ));
            };
            let response = match head {
                Ok(head) => api::record_answer(&shared, &head, &key).await,
                Err(refused) => return Ok(refused.into()),
            };
            Ok(as_result(response).await.into())
        })
    })
}

/// The head the authorizer judges: the HTTP request's that carried the call, its URI the
/// API's, or an empty one.
fn head_of(
    context: &rmcp::service::RequestContext<rmcp::RoleServer>,
    uri: String,
) -> Result<Parts, CallToolResult> {
    let mut head = match context.extensions.get::<Parts>() {
        Some(parts) => parts.clone(),
        None => http::Request::new(()).into_parts().0,
    };
    head.uri = uri
        .parse()
        .map_err(|_| CallToolResult::error(vec![ContentBlock::text("invalid filters")]))?;
    Ok(head)
}

/// `/api/records?…` with the list's arguments as its query.
fn list_uri(arguments: Option<&JsonObject>) -> String {
    let mut query = form_urlencoded::Serializer::new(String::new());
    for (name, value) in arguments.into_iter().flatten() {
        match value {
            Value::String(text) => query.append_pair(name, text),
            Value::Number(number) => query.append_pair(name, &number.to_string()),
            // Left for the API to refuse by name.
            other => query.append_pair(name, &other.to_string()),
        };
    }
    format!("/api/records?{}", query.finish())
}

/// The API's answer as a tool result: its JSON, as structured content and as text; a
/// refusal (any status but `200`) as an error result.
async fn as_result(response: Response<Body>) -> CallToolResult {
    let ok = response.status().is_success();
    let body = match response.into_body().collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(_) => {
            return CallToolResult::error(vec![ContentBlock::text("the answer could not be read")])
        }
    };
    let value: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    let text = String::from_utf8_lossy(&body).into_owned();
    let mut result = if ok {
        CallToolResult::success(vec![ContentBlock::text(text)])
    } else {
        CallToolResult::error(vec![ContentBlock::text(text)])
    };
    result.structured_content = Some(value);
    result
}

fn object(schema: Value) -> JsonObject {
    match schema {
        Value::Object(object) => object,
        _ => JsonObject::new(),
    }
}
