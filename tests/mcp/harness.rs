//! A billing tool server built with rmcp's macros, its routes behind a `ToolGuard`, served
//! over an in-process duplex or over Streamable HTTP on loopback; and clients for both.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{
    CallToolRequestParams, CallToolResult, ContentBlock, MetaObject, RequestMetaObject,
    ServerCapabilities, ServerConfig,
};
use rmcp::service::{RequestContext, RunningService};
use rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::{
    schemars, tool, tool_handler, tool_router, ErrorData, RoleClient, RoleServer, ServerHandler,
    ServiceExt,
};
use serde::Deserialize;
use tokio::sync::Semaphore;
use tower_idempotency::mcp::ToolGuard;

/// What the billing server's tools did: effects counted where they commit.
#[derive(Clone, Default)]
pub struct Effects {
    pub charges: Arc<AtomicUsize>,
    pub lookups: Arc<AtomicUsize>,
    pub labels: Arc<AtomicUsize>,
    /// While set, a charge waits here (mid-effect) for a permit.
    pub gate: Option<Arc<Semaphore>>,
    /// Charges made, waiting at the gate or past it.
    pub started: Arc<AtomicUsize>,
    /// Charges that gave up at the gate, their request's token cancelled.
    pub cancelled: Arc<AtomicUsize>,
}

impl Effects {
    pub fn gated() -> Self {
        Self {
            gate: Some(Arc::new(Semaphore::new(0))),
            ..Self::default()
        }
    }

    pub fn charges(&self) -> usize {
        self.charges.load(Ordering::SeqCst)
    }

    /// Wait until `n` charges were made.
    pub async fn started(&self, n: usize) {
        while self.started.load(Ordering::SeqCst) < n {
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    pub fn release(&self, permits: usize) {
        self.gate.as_ref().expect("gated").add_permits(permits);
    }
}

#[derive(Deserialize, schemars::JsonSchema)]
pub struct Charge {
    pub order_id: String,
    pub cents: u64,
}

#[derive(Deserialize, schemars::JsonSchema)]
pub struct Lookup {
    pub order_id: String,
}

#[derive(Clone)]
pub struct Billing {
    effects: Effects,
    /// Whether its routes are guarded, and so whether it advertises keys.
    guarded: bool,
    tool_router: ToolRouter<Self>,
}

#[tool_router]
impl Billing {
    pub fn new(guard: &ToolGuard, effects: Effects) -> Self {
        Self {
            effects,
            guarded: true,
            tool_router: guard.router(Self::tool_router()),
        }
    }

    /// A server whose one tool `name` is guarded ([`ToolGuard::tool`]), the others not.
    pub fn guarding_one(guard: &ToolGuard, effects: Effects, name: &str) -> Self {
        Self {
            effects,
            guarded: true,
            tool_router: guard.tool(Self::tool_router(), name),
        }
    }

    /// A bare server: no guard.
    pub fn bare(effects: Effects) -> Self {
        Self {
            effects,
            guarded: false,
            tool_router: Self::tool_router(),
        }
    }

    /// Charges at once (the effect), then answers: slowly, while the gate is closed, and
    /// as rmcp tools should, giving up when the request's token is cancelled (the client
    /// hung up) — after the charge, which cannot be undone.
    #[tool(description = "Charge an order")]
    async fn charge(
        &self,
        Parameters(charge): Parameters<Charge>,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResult, ErrorData> {
        if charge.cents == 0 {
            return Ok(CallToolResult::error(vec![ContentBlock::text(
                "declined: zero amount",
            )]));
        }
        let n = self.effects.charges.fetch_add(1, Ordering::SeqCst) + 1;
        self.effects.started.fetch_add(1, Ordering::SeqCst);
        if let Some(gate) = &self.effects.gate {
            tokio::select! {
                permit = gate.acquire() => permit.expect("open").forget(),
                () = context.ct.cancelled() => {
                    self.effects.cancelled.fetch_add(1, Ordering::SeqCst);
                    return Err(ErrorData::internal_error("cancelled after charging", None));
                }
            }
        }
        Ok(CallToolResult::success(vec![ContentBlock::text(format!(
            "ch_{}_{n}",
            charge.order_id
        ))]))
    }

    /// Sets a label: the server says a repeat is harmless, which a client must not take on
    /// trust alone.
    #[tool(description = "Label an order", annotations(idempotent_hint = true))]
    async fn label(&self, Parameters(lookup): Parameters<Lookup>) -> String {
        self.effects.labels.fetch_add(1, Ordering::SeqCst);
        format!("labelled {}", lookup.order_id)
    }

    #[tool(description = "Look an order up", annotations(read_only_hint = true))]
    async fn lookup(&self, Parameters(lookup): Parameters<Lookup>) -> String {
        self.effects.lookups.fetch_add(1, Ordering::SeqCst);
        format!("order {}", lookup.order_id)
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Billing {
    fn get_info(&self) -> ServerConfig {
        let mut capabilities = ServerCapabilities::builder().enable_tools().build();
        if self.guarded {
            tower_idempotency::mcp::advertise(&mut capabilities);
        }
        ServerConfig::new(capabilities)
    }
}

pub type Client = RunningService<RoleClient, ()>;

/// A client and server over an in-process duplex.
pub async fn duplex(server: Billing) -> Client {
    let (server_io, client_io) = tokio::io::duplex(64 * 1024);
    tokio::spawn(async move {
        let running = server.serve(server_io).await.expect("server starts");
        let _ = running.waiting().await;
    });
    ().serve(client_io).await.expect("client starts")
}

/// Serve `make` over Streamable HTTP on a loopback port; the server task's handle stops it.
pub async fn serve_http(
    make: impl Fn() -> Billing + Send + Sync + 'static,
) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    serve_http_with(make, |app| app).await
}

/// [`serve_http`], the app wrapped by `wrap` (an authentication layer).
pub async fn serve_http_with(
    make: impl Fn() -> Billing + Send + Sync + 'static,
    wrap: impl FnOnce(axum::Router) -> axum::Router,
) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    serve_http_configured(make, wrap, StreamableHttpServerConfig::default()).await
}

/// [`serve_http_with`], the transport configured by `config`.
pub async fn serve_http_configured(
    make: impl Fn() -> Billing + Send + Sync + 'static,
    wrap: impl FnOnce(axum::Router) -> axum::Router,
    config: StreamableHttpServerConfig,
) -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let service = StreamableHttpService::new(
        move || Ok(make()),
        LocalSessionManager::default().into(),
        config,
    );
    let app = wrap(axum::Router::new().nest_service("/mcp", service));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    (addr, task)
}

/// A client over Streamable HTTP.
pub async fn http_client(addr: SocketAddr) -> Client {
    http_client_with(addr, &[]).await
}

/// A client over Streamable HTTP whose every request carries `headers`.
pub async fn http_client_with(addr: SocketAddr, headers: &[(&'static str, &str)]) -> Client {
    let mut map = reqwest::header::HeaderMap::new();
    for (name, value) in headers {
        map.insert(*name, value.parse().unwrap());
    }
    let client = reqwest::Client::builder()
        .default_headers(map)
        .build()
        .unwrap();
    let config = StreamableHttpClientTransportConfig::with_uri(format!("http://{addr}/mcp"));
    let transport = StreamableHttpClientTransport::with_client(client, config);
    ().serve(transport).await.expect("client connects")
}

/// A `tools/call` of `tool` with `arguments`, under `key` in `_meta` when given.
pub fn call(
    tool: &'static str,
    arguments: serde_json::Value,
    key: Option<&str>,
) -> CallToolRequestParams {
    let mut params = CallToolRequestParams::new(tool);
    params.arguments = arguments.as_object().cloned();
    if let Some(key) = key {
        let mut meta = MetaObject::default();
        meta.0.insert("idempotency-key".into(), key.into());
        params.meta = Some(RequestMetaObject(meta));
    }
    params
}

/// The first text content of a result.
pub fn text(result: &CallToolResult) -> String {
    result
        .content
        .iter()
        .find_map(|block| block.as_text().map(|text| text.text.clone()))
        .unwrap_or_default()
}

/// Whether a result is marked as a replay.
pub fn is_replay(result: &CallToolResult) -> bool {
    result
        .meta
        .as_ref()
        .and_then(|meta| meta.0.get("idempotent-replayed"))
        == Some(&serde_json::Value::Bool(true))
}
