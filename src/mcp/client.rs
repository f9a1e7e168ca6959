//! The orchestrator's side: call a tool on any MCP server once per [`OperationId`], over the
//! tool face.
//!
//! See the [module docs](crate::mcp) for what it does and an example.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rmcp::model::{
    CallToolRequestParams, CallToolResult, JsonObject, MetaObject, RequestMetaObject, Tool,
};
use rmcp::service::{Peer, ServiceError};
use rmcp::RoleClient;
use serde_json::Value;

use crate::ledger::IdempotencyStore;
use crate::mcp::{CAPABILITY, META_KEY};
use crate::server::problem;
use crate::tool::{self, ToolClass, ToolError, ToolLayer, ToolOutput, Verdict};
use crate::{ConfigError, OperationId, ProviderKeys};

/// What a protected MCP call answers: the tool's result (recorded and replayed like any
/// tool face output), or why not.
pub type McpCallResult = Result<ToolOutput<CallToolResult>, ToolError<ServiceError>>;

/// Says what an rmcp client error means for the call's effect: the tool face's
/// [`Verdict`].
///
/// - a refusal a server of this crate answers before the tool ran (busy with the same key,
///   its ledger unavailable or full): before the effect, after the wait it asks for;
/// - any other JSON-RPC error of a caller's mistake (`invalid_params`: arguments or key
///   refused, the tool unknown, a key reused for other arguments): the operation's final
///   answer, recorded: the frozen arguments would be refused again;
/// - everything else (the stream closed, the POST failed mid-way, a timeout, an internal
///   error, `outcome-unknown`): the call may have happened.
///
/// ```
/// use rmcp::ServiceError;
/// use tower_idempotency::mcp::classify;
/// use tower_idempotency::tool::Verdict;
///
/// assert_eq!(classify(&ServiceError::TransportClosed), Verdict::may_have_happened());
/// ```
pub fn classify(error: &ServiceError) -> Verdict {
    let ServiceError::McpError(error) = error else {
        return Verdict::may_have_happened();
    };
    let data = error.data.as_ref();
    let kind = data
        .and_then(|data| data.get("type"))
        .and_then(Value::as_str);
    let retry_after = data
        .and_then(|data| data.get("retryAfterMs"))
        .and_then(Value::as_u64)
        .map(Duration::from_millis);
    let nothing_ran = [
        problem::IN_FLIGHT,
        problem::LEDGER_UNAVAILABLE,
        problem::LEDGER_FULL,
    ];
    if kind.is_some_and(|kind| nothing_ran.contains(&kind)) {
        let verdict = Verdict::before_effect();
        return match retry_after {
            Some(wait) => verdict.retry_after(wait),
            None => verdict,
        };
    }
    if error.code == rmcp::model::ErrorCode::INVALID_PARAMS {
        return Verdict::final_answer(serde_json::to_value(error).unwrap_or(Value::Null));
    }
    Verdict::may_have_happened()
}

/// The classifier of every tool layer of an [`McpClient`].
type Classifier = fn(&ServiceError) -> Verdict;

/// Configures an [`McpClient`]: made by [`McpClient::builder`].
///
/// ```
/// # async fn example(peer: rmcp::Peer<rmcp::RoleClient>) {
/// use tower_idempotency::ledger::MemoryStore;
/// use tower_idempotency::mcp::McpClient;
/// use tower_idempotency::retry::RetryPolicy;
///
/// let client = McpClient::builder(MemoryStore::new(), peer)
///     .scope("billing-agent")
///     .trusted(true) // its readOnlyHint annotations are believed
///     .tool_settings(|tool| tool.retry_policy(RetryPolicy::builder().max_attempts(4).build().unwrap()))
///     .build()
///     .unwrap();
/// # let _ = client;
/// # }
/// ```
pub struct McpClientBuilder {
    store: Arc<dyn IdempotencyStore>,
    peer: Peer<RoleClient>,
    scope: String,
    trusted: bool,
    settings: Arc<dyn Fn(tool::Builder<Classifier>) -> tool::Builder<Classifier> + Send + Sync>,
}

impl fmt::Debug for McpClientBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("McpClientBuilder")
            .field("scope", &self.scope)
            .field("trusted", &self.trusted)
            .finish_non_exhaustive()
    }
}

impl McpClientBuilder {
    /// Mixed into every key, so two orchestrators sharing a ledger (or a server) never
    /// collide on equal task ids. Empty by default.
    ///
    /// See the [builder docs](Self) for an example.
    pub fn scope(mut self, scope: impl Into<String>) -> Self {
        self.scope = scope.into();
        self
    }

    /// Whether this server's `readOnlyHint` annotations are believed: a tool it marks
    /// read-only then passes straight through, outside the ledger. Off by default: an
    /// annotation is the server's claim, and a tool wrongly marked read-only would be
    /// repeated blind. `idempotentHint` is never enough (a repeat with other arguments is
    /// not the same call), and an unannotated tool is a side effect.
    ///
    /// See the [builder docs](Self) for an example.
    pub fn trusted(mut self, trusted: bool) -> Self {
        self.trusted = trusted;
        self
    }

    /// The tool face's settings for every tool: retry policy, lease, retention, busy
    /// policy, drift policy, defining fields, reconciler, `on_outcome`. Its class,
    /// classifier and scope are this builder's.
    ///
    /// See the [builder docs](Self) for an example.
    pub fn tool_settings(
        mut self,
        settings: impl Fn(tool::Builder<Classifier>) -> tool::Builder<Classifier>
            + Send
            + Sync
            + 'static,
    ) -> Self {
        self.settings = Arc::new(settings);
        self
    }

    /// Build the client: whether the server honours keys is read from what it advertised
    /// at initialization ([`CAPABILITY`]).
    ///
    /// Refuses a peer that has not initialized (nothing to read the capability from).
    pub fn build(self) -> Result<McpClient, ConfigError> {
        let Some(info) = self.peer.peer_info() else {
            return Err(ConfigError::new(
                "the MCP peer has not initialized: its capabilities are unknown",
            ));
        };
        let honours = info
            .capabilities
            .experimental
            .as_ref()
            .is_some_and(|experimental| experimental.contains_key(CAPABILITY));
        // The settings are checked here, once, rather than at a tool's first call.
        tool_layer(
            self.store.clone(),
            "settings-check",
            ProviderKeys::Ignored,
            &self.scope,
            ToolClass::SideEffect,
            &*self.settings,
        )?;
        Ok(McpClient {
            shared: Arc::new(ClientShared {
                provider: if honours {
                    ProviderKeys::Deduplicates
                } else {
                    ProviderKeys::Ignored
                },
                store: self.store,
                peer: self.peer,
                scope: self.scope,
                trusted: self.trusted,
                settings: self.settings,
                layers: Mutex::new(HashMap::new()),
                annotations: tokio::sync::OnceCell::new(),
            }),
        })
    }
}

struct ClientShared {
    store: Arc<dyn IdempotencyStore>,
    peer: Peer<RoleClient>,
    scope: String,
    trusted: bool,
    provider: ProviderKeys,
    settings: Arc<dyn Fn(tool::Builder<Classifier>) -> tool::Builder<Classifier> + Send + Sync>,
    /// A tool layer per tool, built at its first call.
    layers: Mutex<HashMap<String, ToolLayer<Classifier>>>,
    /// The server's tools, listed once, for their annotations.
    annotations: tokio::sync::OnceCell<HashMap<String, Tool>>,
}

/// Calls tools on one MCP server once per [`OperationId`]: the key derived from the
/// operation and the tool, the arguments frozen at the first call (canonical JSON) and
/// sent, with the same key, on every re-issue. See the [module docs](crate::mcp).
///
/// Clones share one configuration and one tool layer per tool.
#[derive(Clone)]
pub struct McpClient {
    shared: Arc<ClientShared>,
}

impl fmt::Debug for McpClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("McpClient")
            .field("scope", &self.shared.scope)
            .field("trusted", &self.shared.trusted)
            .field("provider", &self.shared.provider)
            .finish_non_exhaustive()
    }
}

impl McpClient {
    /// Configure a client of the MCP server `peer` (initialized), over `store`.
    ///
    /// See [`McpClientBuilder`] for the settings and an example.
    pub fn builder(store: impl IdempotencyStore, peer: Peer<RoleClient>) -> McpClientBuilder {
        McpClientBuilder {
            store: Arc::new(store),
            peer,
            scope: String::new(),
            trusted: false,
            settings: Arc::new(|tool| tool),
        }
    }

    /// Whether the server said it honours idempotency keys: then a call that may have
    /// arrived is re-issued with its key ([`ProviderKeys::Deduplicates`]); otherwise it is
    /// reconciled or reported in doubt, never resent blind ([`ProviderKeys::Ignored`]).
    ///
    /// See the [module docs](crate::mcp) for an example.
    pub fn provider_keys(&self) -> ProviderKeys {
        self.shared.provider
    }

    /// Call `tool` with `arguments` as the operation `operation`, once.
    ///
    /// See the [module docs](crate::mcp) for an example.
    pub async fn call(
        &self,
        operation: OperationId,
        tool: &str,
        arguments: JsonObject,
    ) -> McpCallResult {
        let layer = self.layer(tool).await;
        let peer = self.shared.peer.clone();
        let name = tool.to_owned();
        tool::idempotent_call(
            &layer,
            operation,
            arguments,
            move |arguments: JsonObject, key| {
                let peer = peer.clone();
                let name = name.clone();
                async move {
                    let mut meta = MetaObject::default();
                    meta.0
                        .insert(META_KEY.to_owned(), Value::String(key.to_hex()));
                    let mut params = CallToolRequestParams::new(name);
                    params.arguments = Some(arguments);
                    params.meta = Some(RequestMetaObject(meta));
                    peer.call_tool(params).await
                }
            },
        )
        .await
    }

    /// The tool layer of `tool`, built at its first call.
    async fn layer(&self, tool: &str) -> ToolLayer<Classifier> {
        if let Some(layer) = self.shared.layers.lock().expect("never poisoned").get(tool) {
            return layer.clone();
        }
        let class = self.class_of(tool).await;
        let shared = &self.shared;
        let layer = tool_layer(
            shared.store.clone(),
            tool,
            shared.provider,
            &shared.scope,
            class,
            &*shared.settings,
        )
        // The settings were built once at `build`, and the name is made valid.
        .expect("settings checked by McpClientBuilder::build");
        let mut layers = shared.layers.lock().expect("never poisoned");
        layers.entry(tool.to_owned()).or_insert(layer).clone()
    }

    /// What `tool` is, from its annotations, failing closed: read-only only when the
    /// server is trusted and says so; anything else (unannotated, `idempotentHint`, a
    /// listing that failed) a side effect.
    async fn class_of(&self, tool: &str) -> ToolClass {
        if !self.shared.trusted {
            return ToolClass::SideEffect;
        }
        let listed = self
            .shared
            .annotations
            .get_or_init(|| async {
                match self.shared.peer.list_all_tools().await {
                    Ok(tools) => tools
                        .into_iter()
                        .map(|tool| (tool.name.to_string(), tool))
                        .collect(),
                    Err(_) => HashMap::new(),
                }
            })
            .await;
        let read_only = listed
            .get(tool)
            .and_then(|tool| tool.annotations.as_ref())
            .and_then(|annotations| annotations.read_only_hint)
            == Some(true);
        if read_only {
            ToolClass::Read
        } else {
            ToolClass::SideEffect
        }
    }
}

/// The tool face's layer for `tool`.
fn tool_layer(
    store: Arc<dyn IdempotencyStore>,
    tool: &str,
    provider: ProviderKeys,
    scope: &str,
    class: ToolClass,
    settings: &(dyn Fn(tool::Builder<Classifier>) -> tool::Builder<Classifier> + Send + Sync),
) -> Result<ToolLayer<Classifier>, ConfigError> {
    let builder =
        ToolLayer::builder(store, layer_name(tool), provider).classify(classify as Classifier);
    settings(builder)
        .class(class)
        .scope(key_scope(scope, tool))
        .build()
}

/// A name the tool face takes (letters, digits, `-`, `_`, `.`) for `tool`: as it is when
/// it is one, else its bytes in hex. It names the fingerprint's target only: the key's
/// scope holds the tool's own name, so two tools never share a key.
fn layer_name(tool: &str) -> String {
    let valid = !tool.is_empty()
        && tool
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if valid {
        tool.to_owned()
    } else {
        let hex: String = tool.bytes().map(|b| format!("{b:02x}")).collect();
        format!("x-{hex}")
    }
}

/// The tool face's scope for `tool`: the user's scope and the tool, length-prefixed so no
/// two pairs meet. The key is then derived from `(this scope, task_id, step_id)`.
fn key_scope(scope: &str, tool: &str) -> String {
    format!("mcp/{}/{scope}/{tool}", scope.len())
}
