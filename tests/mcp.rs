//! MCP tool calls, once: a real rmcp server and client, over an in-process duplex and over
//! Streamable HTTP on loopback, the server's routes behind a `ToolGuard`.

#[cfg(feature = "redis")]
#[path = "support/redis.rs"]
mod redis_support;

mod mcp {
    mod client;
    mod console;
    mod dropped;
    #[cfg(feature = "redis")]
    mod faults;
    mod harness;
    mod metrics;
    mod rounds;
    mod server;
}
