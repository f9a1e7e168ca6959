//! The tool server's side: routes of an rmcp [`ToolRouter`] that run once per key and
//! caller.
//!
//! See the [module docs](crate::mcp) for what a protected route answers and an example.

mod call;
mod key;
mod route;

use std::borrow::Cow;
use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use rmcp::handler::server::router::tool::{ToolRoute, ToolRouter};
use rmcp::service::RequestContext;
use rmcp::RoleServer;

use crate::ledger::IdempotencyStore;
use crate::server::ServerService;
use crate::ConfigError;

use call::ResolvedScope;
use route::RouteService;

/// The server face a protected route's calls go through.
type ServedBy<S> = ServerService<RouteService<S>>;

/// Who a call's key belongs to: the choice [`ToolGuard::builder`] requires. One caller's
/// key can never replay, block or probe another's.
///
/// There is no default: a server that scoped every caller alike would serve one client
/// another's recorded result for the same key and arguments.
///
/// ```
/// use tower_idempotency::mcp::CallerScope;
///
/// /// What the user's authentication layer puts in the HTTP request's extensions.
/// #[derive(Clone)]
/// struct Principal(String);
///
/// // Over Streamable HTTP, behind an authentication layer: the principal it established.
/// let by_principal = CallerScope::http_principal(|parts| {
///     parts.extensions.get::<Principal>().map(|principal| principal.0.clone())
/// });
/// // Over stdio: one client per server process.
/// let stdio = CallerScope::single_client("the-orchestrator");
/// # let _ = (by_principal, stdio);
/// ```
#[derive(Clone)]
pub struct CallerScope(ScopeKind);

/// A principal read from the HTTP request's head.
type FromHttp = Arc<dyn Fn(&http::request::Parts) -> Option<String> + Send + Sync>;
/// A scope read from the call's context.
type FromContext = Arc<dyn Fn(&RequestContext<RoleServer>) -> Option<String> + Send + Sync>;

#[derive(Clone)]
enum ScopeKind {
    Http(FromHttp),
    Context(FromContext),
    Single(String),
}

impl fmt::Debug for CallerScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.0 {
            ScopeKind::Http(_) => f.write_str("CallerScope::http_principal(..)"),
            ScopeKind::Context(_) => f.write_str("CallerScope::function(..)"),
            // The name may be a tenant's: not shown.
            ScopeKind::Single(_) => f.write_str("CallerScope::single_client(..)"),
        }
    }
}

impl CallerScope {
    /// The principal the user's authentication layer established, read from the HTTP
    /// request that carried the call (rmcp's Streamable HTTP server hands its
    /// `http::request::Parts` to the call, extensions included). A keyed call answered
    /// `None`, or not carried by HTTP at all, is refused (`scope-missing`).
    ///
    /// See the [type docs](Self) for an example.
    pub fn http_principal<F>(principal: F) -> Self
    where
        F: Fn(&http::request::Parts) -> Option<String> + Send + Sync + 'static,
    {
        Self(ScopeKind::Http(Arc::new(principal)))
    }

    /// A function of the call's rmcp request context (its extensions, its peer). A keyed
    /// call answered `None` is refused (`scope-missing`).
    ///
    /// ```
    /// use tower_idempotency::mcp::CallerScope;
    ///
    /// #[derive(Clone)]
    /// struct Tenant(String);
    ///
    /// let by_tenant = CallerScope::function(|context| {
    ///     context.extensions.get::<Tenant>().map(|tenant| tenant.0.clone())
    /// });
    /// # let _ = by_tenant;
    /// ```
    pub fn function<F>(scope: F) -> Self
    where
        F: Fn(&RequestContext<RoleServer>) -> Option<String> + Send + Sync + 'static,
    {
        Self(ScopeKind::Context(Arc::new(scope)))
    }

    /// One scope for every call: for a transport with a single client, such as stdio (a
    /// server process per client). Over a transport shared by several clients, any of
    /// them sending another's key and arguments would be served the other's result, its
    /// own effect lost: so a keyed call that came over HTTP (Streamable HTTP serves every
    /// client that connects) is refused under this scope, `scope-missing`, and never
    /// runs. Behind HTTP, scope by the principal ([`http_principal`](Self::http_principal)),
    /// or, if one client is all there can ever be, say so with
    /// [`function`](Self::function)`(|_| Some(name))`.
    ///
    /// See the [type docs](Self) for an example.
    pub fn single_client(name: impl Into<String>) -> Self {
        Self(ScopeKind::Single(name.into()))
    }

    /// Whether this is a single-client scope and the call came over HTTP, a transport
    /// shared by every client that connects (see [`single_client`](Self::single_client)).
    fn is_single_client_over_http(&self, context: &RequestContext<RoleServer>) -> bool {
        matches!(self.0, ScopeKind::Single(_))
            && context.extensions.get::<http::request::Parts>().is_some()
    }

    fn of(&self, context: &RequestContext<RoleServer>) -> Option<String> {
        match &self.0 {
            ScopeKind::Http(principal) => context
                .extensions
                .get::<http::request::Parts>()
                .and_then(|parts| principal(parts)),
            ScopeKind::Context(scope) => scope(context),
            ScopeKind::Single(name) => Some(name.clone()),
        }
    }
}

/// What every protected route of a guard shares.
struct Shared {
    store: Arc<dyn IdempotencyStore>,
    scope: CallerScope,
    require_keys: bool,
    keyless: AtomicU64,
    layer: crate::server::ServerLayer,
}

impl Shared {
    /// The synthesized request's target: the tool's name, so that one key reused for
    /// another tool is a changed call, never the other tool's result.
    fn target(&self, tool: &str) -> http::Uri {
        let mut target = String::from("/mcp/tools/");
        for byte in tool.bytes() {
            if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'_' | b'.' | b'~') {
                target.push(char::from(byte));
            } else {
                target.push_str(&format!("%{byte:02X}"));
            }
        }
        target.parse().expect("percent-encoded: a valid path")
    }
}

/// Configures a [`ToolGuard`]: made by [`ToolGuard::builder`].
///
/// The ledger's settings (lease, retention, busy policy, in-doubt policy, response limit,
/// `on_outcome`…) are the server face's: set them with [`ledger`](Self::ledger).
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency::ledger::MemoryStore;
/// use tower_idempotency::mcp::{CallerScope, ToolGuard};
/// use tower_idempotency::BusyPolicy;
///
/// let guard = ToolGuard::builder(MemoryStore::new(), CallerScope::single_client("stdio"))
///     .require_keys(true)
///     .ledger(|server| server.busy_policy(BusyPolicy::Wait(Duration::from_secs(5))))
///     .build()
///     .unwrap();
/// # let _ = guard;
/// ```
pub struct ToolGuardBuilder {
    store: Arc<dyn IdempotencyStore>,
    scope: CallerScope,
    require_keys: bool,
    server: crate::server::Builder,
}

impl fmt::Debug for ToolGuardBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolGuardBuilder")
            .field("scope", &self.scope)
            .field("require_keys", &self.require_keys)
            .field("server", &self.server)
            .finish_non_exhaustive()
    }
}

impl ToolGuardBuilder {
    /// Refuse a keyless call of a tool not annotated read-only (`readOnlyHint: true`),
    /// with `key-missing`. Off by default: most MCP clients send no key, and a keyless
    /// call then runs as it came (counted: [`ToolGuard::keyless_calls`], and with feature
    /// `metrics` `idempotency_mcp_keyless_calls_total{tool}`).
    ///
    /// See the [builder docs](Self) for an example.
    pub fn require_keys(mut self, require: bool) -> Self {
        self.require_keys = require;
        self
    }

    /// The ledger's settings, on the server face's builder: lease, retention, protected
    /// window, busy policy and waiters, response limit, in-doubt policy, fail open,
    /// `on_outcome`. Its scope, key requirement, side-effect methods and cancellation on
    /// disconnect are this builder's own and are set over what `settings` chose.
    ///
    /// See the [builder docs](Self) for an example.
    pub fn ledger(
        mut self,
        settings: impl FnOnce(crate::server::Builder) -> crate::server::Builder,
    ) -> Self {
        self.server = settings(self.server);
        self
    }

    /// Check the settings and build the guard.
    ///
    /// ```
    /// # use tower_idempotency::{ledger::MemoryStore, mcp::{CallerScope, ToolGuard}};
    /// let too_short = ToolGuard::builder(MemoryStore::new(), CallerScope::single_client("stdio"))
    ///     .ledger(|server| server.retention(std::time::Duration::from_millis(1)))
    ///     .build();
    /// assert!(too_short.is_err());
    /// ```
    pub fn build(self) -> Result<ToolGuard, ConfigError> {
        let layer = self
            .server
            .scope(|head| {
                head.extensions
                    .get::<ResolvedScope>()
                    .map(|scope| scope.0.clone())
                    .unwrap_or_default()
            })
            // Whether a key is required is decided per tool, before the server face.
            .require_key(false)
            .side_effect_methods([http::Method::POST])
            // A client's hang-up must not cancel an effect under way (see the module docs).
            .cancel_on_disconnect(false)
            .build()?;
        Ok(ToolGuard {
            shared: Arc::new(Shared {
                store: self.store,
                scope: self.scope,
                require_keys: self.require_keys,
                keyless: AtomicU64::new(0),
                layer,
            }),
        })
    }
}

/// Protects the routes of an rmcp [`ToolRouter`]: a `tools/call` carrying a key runs its
/// tool once per key and caller. See the [module docs](crate::mcp).
///
/// Clones share one ledger handle, one configuration and one count of keyless calls.
#[derive(Clone)]
pub struct ToolGuard {
    shared: Arc<Shared>,
}

impl fmt::Debug for ToolGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolGuard")
            .field("scope", &self.shared.scope)
            .field("require_keys", &self.shared.require_keys)
            .finish_non_exhaustive()
    }
}

impl ToolGuard {
    /// Configure a guard over `store`, its calls' keys scoped by `scope`.
    ///
    /// See [`ToolGuardBuilder`] for the settings and an example.
    pub fn builder(store: impl IdempotencyStore, scope: CallerScope) -> ToolGuardBuilder {
        let store: Arc<dyn IdempotencyStore> = Arc::new(store);
        ToolGuardBuilder {
            server: crate::IdempotencyLayer::server_builder(store.clone()),
            store,
            scope,
            require_keys: false,
        }
    }

    /// Every route of `router`, protected. Pass the returned router to rmcp's
    /// `#[tool_handler(router = self.tool_router)]` (kept in the server's state), not a
    /// router rebuilt per call, or calls bypass the guard.
    ///
    /// See the [module docs](crate::mcp) for an example.
    pub fn router<S>(&self, router: ToolRouter<S>) -> ToolRouter<S>
    where
        S: Clone + Send + Sync + 'static,
    {
        let mut router = router;
        let names: Vec<Cow<'static, str>> = router.map.keys().cloned().collect();
        for name in names {
            if let Some(route) = router.map.remove(&name) {
                router.map.insert(name, self.route(route));
            }
        }
        router
    }

    /// The route of the tool `name` in `router`, protected; the others as they were.
    ///
    /// # Panics
    ///
    /// If `router` has no tool `name` (a misspelt name would otherwise leave the tool it
    /// meant unguarded, its re-issued calls run again): a mistake in the server's code,
    /// reported when the router is built.
    ///
    /// ```
    /// # use tower_idempotency::{ledger::MemoryStore, mcp::{CallerScope, ToolGuard}};
    /// use rmcp::handler::server::router::tool::{ToolRoute, ToolRouter};
    /// use rmcp::model::{CallToolResult, ContentBlock, Tool};
    ///
    /// #[derive(Clone)]
    /// struct Server;
    ///
    /// let send_email = ToolRoute::<Server>::new_dyn(Tool::new("send_email", "sends", serde_json::Map::new()), |_call| {
    ///     Box::pin(async { Ok(CallToolResult::success(vec![ContentBlock::text("sent")]).into()) })
    /// });
    /// let guard = ToolGuard::builder(MemoryStore::new(), CallerScope::single_client("stdio")).build().unwrap();
    /// let router = guard.tool(ToolRouter::new().with_route(send_email), "send_email");
    /// assert!(router.has_route("send_email"));
    ///
    /// // A name the router does not have is a mistake, not a no-op.
    /// let misspelt = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| guard.tool(router, "send_mail")));
    /// assert!(misspelt.is_err());
    /// ```
    pub fn tool<S>(&self, mut router: ToolRouter<S>, name: &str) -> ToolRouter<S>
    where
        S: Clone + Send + Sync + 'static,
    {
        let Some(route) = router.map.remove(name) else {
            let mut names: Vec<&str> = router.map.keys().map(|name| name.as_ref()).collect();
            names.sort_unstable();
            panic!(
                "ToolGuard::tool: the router has no tool {name:?} to guard (its tools: {names:?})"
            );
        };
        router
            .map
            .insert(Cow::Owned(name.to_owned()), self.route(route));
        router
    }

    /// One route, protected.
    ///
    /// ```
    /// # use tower_idempotency::{ledger::MemoryStore, mcp::{CallerScope, ToolGuard}};
    /// use rmcp::handler::server::router::tool::ToolRoute;
    /// use rmcp::model::{CallToolResult, ContentBlock, Tool};
    ///
    /// #[derive(Clone)]
    /// struct Server;
    ///
    /// let guard = ToolGuard::builder(MemoryStore::new(), CallerScope::single_client("stdio")).build().unwrap();
    /// let attr = Tool::new("ping", "answers pong", serde_json::Map::new());
    /// let route = ToolRoute::<Server>::new_dyn(attr, |_call| {
    ///     Box::pin(async { Ok(CallToolResult::success(vec![ContentBlock::text("pong")]).into()) })
    /// });
    /// let protected = guard.route(route);
    /// assert_eq!(protected.name(), "ping");
    /// ```
    pub fn route<S>(&self, route: ToolRoute<S>) -> ToolRoute<S>
    where
        S: Clone + Send + Sync + 'static,
    {
        let read_only = route
            .attr
            .annotations
            .as_ref()
            .and_then(|annotations| annotations.read_only_hint)
            == Some(true);
        let handler = route.call.clone();
        let shared = self.shared.clone();
        let served_by: ServedBy<S> = tower_layer::Layer::layer(&shared.layer, RouteService::new());
        ToolRoute::new_dyn(route.attr, move |call| {
            Box::pin(call::guarded(
                shared.clone(),
                served_by.clone(),
                handler.clone(),
                read_only,
                call,
            ))
        })
    }

    /// How many keyless calls the guard's routes passed through (run as they came).
    ///
    /// ```
    /// # use tower_idempotency::{ledger::MemoryStore, mcp::{CallerScope, ToolGuard}};
    /// let guard = ToolGuard::builder(MemoryStore::new(), CallerScope::single_client("stdio")).build().unwrap();
    /// assert_eq!(guard.keyless_calls(), 0);
    /// ```
    pub fn keyless_calls(&self) -> u64 {
        self.shared
            .keyless
            .load(std::sync::atomic::Ordering::Relaxed)
    }
}
