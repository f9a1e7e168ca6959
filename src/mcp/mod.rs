//! MCP tool calls, once: both sides of the Model Context Protocol wire (feature `mcp`,
//! over [`rmcp`]).
//!
//! An orchestrator calls `tools/call` on a tool server; the response stream drops or times
//! out after the effect, and the call is issued again. The protocol gives no help: a
//! re-issue is a new JSON-RPC request with a new id (the 2026-07-28 revision removed
//! sessions and stream resumption), so the id cannot deduplicate it. This module gives the
//! call a key, and runs the tool once per key on the server, and once per operation on the
//! client.
//!
//! # The convention (a proposal others can adopt)
//!
//! - **The key** travels in the call's `params._meta["idempotency-key"]` ([`META_KEY`]), a
//!   JSON string of 1 to 255 visible ASCII characters; over Streamable HTTP it may travel
//!   instead (or as well, with the same value) as the HTTP header `Idempotency-Key`, an
//!   RFC 8941 string as the IETF draft spells it. A call carrying two different keys is
//!   refused. One key names one call: the same tool, the same arguments.
//! - **A replay** is the recorded `CallToolResult`, its `_meta` holding
//!   `"idempotent-replayed": true` ([`REPLAYED_META`]).
//! - **A server that honours keys** says so at initialization, in an experimental
//!   capability: `capabilities.experimental["idempotency-key"] = {"meta": "idempotency-key",
//!   "header": "Idempotency-Key"}` ([`CAPABILITY`], [`advertise`]).
//! - **Refusals** are JSON-RPC errors whose `data` is an RFC 9457 problem object: its
//!   `type` is one of the [server face's problem types](crate::server::problem) (compare
//!   it as a string), with `retryAfterMs` when the server says when to come back.
//!   A caller's mistake is `-32602` (invalid params), the rest `-32603`.
//!
//! # The tool server: [`ToolGuard`]
//!
//! [`ToolGuard::router`] wraps every route of an rmcp `ToolRouter` (or
//! [`ToolGuard::tool`] one of them); `tools/list` and every other method are untouched.
//! A protected `tools/call` goes through the [server face](crate::server) on the same
//! ledger, stores and protocol as HTTP requests:
//!
//! | the call | answer | ledger |
//! |---|---|---|
//! | no key | runs as it came, counted ([`ToolGuard::keyless_calls`], and `idempotency_mcp_keyless_calls_total{tool}` with feature `metrics`); refused `key-missing` for a tool not annotated read-only when keys are [required](ToolGuardBuilder::require_keys) | not touched |
//! | key malformed, not a string, or `_meta` and header disagree | `key-invalid` | not touched |
//! | keyed, but no caller to scope it by ([`CallerScope`]) | `scope-missing` | not touched |
//! | new key | the tool's result | recorded, `isError: true` included |
//! | same key, in flight | `in-flight` with `retryAfterMs` (or, under a [waiting busy policy](crate::BusyPolicy::Wait), the first call's result) | unchanged |
//! | same key, other tool or arguments | `payload-mismatch`, `data.changedFields` naming the argument fields that changed (when the first call's result is recorded), `data.tool` whether the tool differs | unchanged |
//! | same key, done | the recorded result, marked a replay | unchanged |
//! | same key, its first call never finished (the process died) | `outcome-unknown` (at most once; see [`InDoubtPolicy`](crate::InDoubtPolicy)) | in doubt |
//!
//! What is an outcome: a `CallToolResult`, `isError: true` included (the tool ran and said
//! so). What is not: a JSON-RPC error raised before the tool's code ran (an unknown tool,
//! arguments that do not parse: rmcp turns those into an error result *after* the guard,
//! which sees `invalid_params`), and a round of a multi-round call that answers "input
//! required" (the call goes on; the follow-up round's `inputResponses` and `requestState`
//! are fingerprinted with the arguments, so a key names one multi-round call: start another
//! with a new key). Other JSON-RPC errors of the tool may come after
//! its effect: the key is left in doubt. Never fingerprinted: `_meta` (the client adds a
//! fresh `progressToken` per request) and the JSON-RPC id.
//!
//! **A dropped stream is not a lost outcome.** Over Streamable HTTP a client's hang-up
//! cancels the request (rmcp cancels its token, `ctx.ct`). A protected tool runs under a
//! token of its own, on a task of its own: an effect under way finishes, its result is
//! recorded, and the re-issued call is answered with it. (A tool can no longer be
//! cancelled by its client: that is the point.) A process that dies mid-effect still
//! strands its call: the key reads in doubt, never runs twice.
//!
//! **The caller** is a required choice ([`CallerScope`]): the principal the user's
//! authentication layer put in the HTTP request's extensions, a function of the call's
//! context, or one fixed scope for a single-client transport such as stdio. One caller's
//! key never replays, blocks or probes another's.
//!
//! With rmcp's `#[tool_handler]`, keep the guarded router in the server's state and pass
//! `router = self.tool_router`: without it, the macro rebuilds the router per call and the
//! guard is bypassed. A server is cloned for each keyed call (its handler runs on a task
//! of its own): keep its state behind `Arc`s.
//!
//! ```
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use std::sync::Arc;
//!
//! use rmcp::handler::server::{router::tool::ToolRouter, wrapper::Parameters};
//! use rmcp::model::{CallToolRequestParams, MetaObject, RequestMetaObject, ServerCapabilities, ServerConfig};
//! use rmcp::{schemars, tool, tool_handler, tool_router, ServerHandler, ServiceExt};
//! use tower_idempotency::ledger::MemoryStore;
//! use tower_idempotency::mcp::{self, CallerScope, ToolGuard};
//!
//! #[derive(serde::Deserialize, schemars::JsonSchema)]
//! struct Charge { order_id: String, cents: u64 }
//!
//! #[derive(Clone)]
//! struct Billing { charges: Arc<AtomicUsize>, tool_router: ToolRouter<Self> }
//!
//! #[tool_router]
//! impl Billing {
//!     fn new(guard: &ToolGuard) -> Self {
//!         // Guarded once, kept in the state: every call goes through the guard.
//!         Self { charges: Arc::default(), tool_router: guard.router(Self::tool_router()) }
//!     }
//!
//!     #[tool(description = "Charge an order")]
//!     async fn charge(&self, Parameters(charge): Parameters<Charge>) -> String {
//!         let n = self.charges.fetch_add(1, Ordering::SeqCst) + 1;
//!         format!("ch_{}_{n} ({} cents)", charge.order_id, charge.cents)
//!     }
//! }
//!
//! #[tool_handler(router = self.tool_router)]
//! impl ServerHandler for Billing {
//!     fn get_info(&self) -> ServerConfig {
//!         let mut capabilities = ServerCapabilities::builder().enable_tools().build();
//!         mcp::advertise(&mut capabilities); // "this server honours keys"
//!         ServerConfig::new(capabilities)
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // Over stdio (here an in-process pipe), the server has one client.
//! let guard = ToolGuard::builder(MemoryStore::new(), CallerScope::single_client("orchestrator")).build()?;
//! let server = Billing::new(&guard);
//! let charges = server.charges.clone();
//! let (server_io, client_io) = tokio::io::duplex(64 * 1024);
//! tokio::spawn(async move { server.serve(server_io).await.unwrap().waiting().await });
//! let client = ().serve(client_io).await?;
//!
//! let keyed_call = || {
//!     let mut meta = MetaObject::default();
//!     meta.0.insert(mcp::META_KEY.into(), "order-42-charge".into());
//!     let mut params = CallToolRequestParams::new("charge");
//!     params.arguments = serde_json::json!({"order_id": "o-42", "cents": 1999}).as_object().cloned();
//!     params.meta = Some(RequestMetaObject(meta));
//!     params
//! };
//! let first = client.call_tool(keyed_call()).await?;
//! // The answer was lost; the call is issued again, a new request with the same key.
//! let again = client.call_tool(keyed_call()).await?;
//! assert_eq!(charges.load(Ordering::SeqCst), 1, "charged once");
//! assert_eq!(again.content, first.content);
//! assert_eq!(again.meta.unwrap().0[mcp::REPLAYED_META], true);
//! # Ok(())
//! # }
//! ```
//!
//! Over Streamable HTTP, behind authentication, scope by the principal:
//! `CallerScope::http_principal(|parts| parts.extensions.get::<Principal>().map(|p| p.0.clone()))`
//! (see [`CallerScope`]).
//!
//! # The orchestrator: [`McpClient`]
//!
//! [`McpClient::call`] calls a tool on any MCP server as an [`OperationId`](crate::OperationId)
//! does on the [tool face](crate::tool), whose ledger, retries and reconciler it uses:
//!
//! - the key is derived from `(scope, task_id, step_id)` and the tool's name (two tools in
//!   one step have two keys), sent as `_meta["idempotency-key"]` (64 hex digits);
//! - the arguments are frozen at the operation's first call, as canonical JSON, and every
//!   re-issue (a new request id) sends the same key and the same arguments, whatever the
//!   model regenerated (the output says what was [discarded](crate::tool::ToolOutput::discarded));
//! - a server that advertises [`CAPABILITY`] is taken to deduplicate
//!   ([`ProviderKeys::Deduplicates`](crate::ProviderKeys::Deduplicates)): an attempt that
//!   may have arrived (a closed stream, a timeout) is re-issued with its key, and answered
//!   with the first run's result. Against a server without it
//!   ([`ProviderKeys::Ignored`](crate::ProviderKeys::Ignored)), such an attempt is in
//!   doubt: reconciled (the tool face's [reconciler](crate::tool::Builder::reconcile)) or
//!   reported, never resent blind;
//! - errors are classified by [`classify`]; a result with `isError: true` is the
//!   tool's answer, recorded;
//! - tool classes come from annotations, failing closed: `readOnlyHint` passes a tool
//!   straight through only on a server marked [trusted](McpClientBuilder::trusted);
//!   `idempotentHint` alone never makes a repeat safe; an unannotated tool is a side effect.
//!
//! rmcp's own retries are safe under this: its client re-sends a POST once when the server
//! answers `404` session-expired (the call was not handled), and resumes a broken SSE
//! stream by `Last-Event-ID` (the same response, not a second call). Both revisions rmcp
//! speaks, with and without sessions, carry `_meta` alike. Multi-round calls ("input
//! required") are not driven by [`McpClient::call`]: rmcp's `call_tool` answers them
//! `UnexpectedResponse`, which is classified as may-have-happened.
//!
//! ```
//! # use std::sync::Arc;
//! # use rmcp::handler::server::{router::tool::ToolRouter, wrapper::Parameters};
//! # use rmcp::model::{ServerCapabilities, ServerConfig};
//! # use rmcp::{schemars, tool, tool_handler, tool_router, ServerHandler, ServiceExt};
//! # #[derive(serde::Deserialize, schemars::JsonSchema)]
//! # struct Email { to: String, subject: String }
//! # #[derive(Clone)]
//! # struct Mailer { tool_router: ToolRouter<Self> }
//! # #[tool_router]
//! # impl Mailer {
//! #     #[tool(description = "Send an email")]
//! #     async fn send_email(&self, Parameters(email): Parameters<Email>) -> String { format!("sent to {}", email.to) }
//! # }
//! # #[tool_handler(router = self.tool_router)]
//! # impl ServerHandler for Mailer {
//! #     fn get_info(&self) -> ServerConfig { ServerConfig::new(ServerCapabilities::builder().enable_tools().build()) }
//! # }
//! use tower_idempotency::ledger::MemoryStore;
//! use tower_idempotency::mcp::McpClient;
//! use tower_idempotency::{OperationId, ProviderKeys};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let (server_io, client_io) = tokio::io::duplex(64 * 1024);
//! # tokio::spawn(async move { let _ = Mailer { tool_router: Mailer::tool_router() }.serve(server_io).await.unwrap().waiting().await; });
//! // Any MCP server: this one does not advertise keys.
//! let session = ().serve(client_io).await?;
//! let mailer = McpClient::builder(MemoryStore::new(), session.peer().clone())
//!     .scope("support-agent")
//!     .build()?;
//! assert_eq!(mailer.provider_keys(), ProviderKeys::Ignored);
//!
//! let op = OperationId::new("ticket-981", "send-apology");
//! let email = serde_json::json!({"to": "ada@example.com", "subject": "Sorry"});
//! let sent = mailer.call(op.clone(), "send_email", email.as_object().cloned().unwrap()).await?;
//! // The step ran again (a crash, a retry of the agent's loop), with regenerated words:
//! let regenerated = serde_json::json!({"to": "ada@example.com", "subject": "Our apologies"});
//! let again = mailer.call(op, "send_email", regenerated.as_object().cloned().unwrap()).await?;
//! assert_eq!(again.value().content, sent.value().content, "sent once");
//! assert!(again.discarded().is_some());
//! # Ok(())
//! # }
//! ```

mod client;
mod server;

pub use client::{classify, McpCallResult, McpClient, McpClientBuilder};
pub use server::{CallerScope, ToolGuard, ToolGuardBuilder};

/// Where a `tools/call` carries its idempotency key: `params._meta["idempotency-key"]`, a
/// JSON string.
pub const META_KEY: &str = "idempotency-key";

/// The `_meta` member of a replayed result: `"idempotent-replayed": true`.
pub const REPLAYED_META: &str = "idempotent-replayed";

/// The experimental capability a server that honours keys advertises.
pub const CAPABILITY: &str = "idempotency-key";

/// Say in `capabilities` that this server honours idempotency keys: the experimental
/// capability [`CAPABILITY`], `{"meta": "idempotency-key", "header": "Idempotency-Key"}`.
/// A client of this module treats a server without it as one that ignores keys.
///
/// ```
/// use rmcp::model::ServerCapabilities;
///
/// let mut capabilities = ServerCapabilities::builder().enable_tools().build();
/// tower_idempotency::mcp::advertise(&mut capabilities);
/// assert!(capabilities.experimental.unwrap().contains_key("idempotency-key"));
/// ```
pub fn advertise(capabilities: &mut rmcp::model::ServerCapabilities) {
    let mut honours = serde_json::Map::new();
    honours.insert(
        "meta".to_owned(),
        serde_json::Value::String(META_KEY.to_owned()),
    );
    honours.insert(
        "header".to_owned(),
        serde_json::Value::String("Idempotency-Key".to_owned()),
    );
    capabilities
        .experimental
        .get_or_insert_with(Default::default)
        .insert(CAPABILITY.to_owned(), honours);
}
