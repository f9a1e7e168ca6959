//! MCP tool calls, once: a real rmcp server and client, over an in-process duplex and over
//! Streamable HTTP on loopback, the server's routes behind a `ToolGuard`.

mod mcp {
    mod client;
    mod dropped;
    mod harness;
    mod server;
}
