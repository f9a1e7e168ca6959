//! MCP tool calls, once.

pub mod client;
pub mod server;

pub use client::McpClient;
pub use server::{CallerScope, ToolGuard};

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
