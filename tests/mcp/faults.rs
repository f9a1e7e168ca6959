//! Randomized faults over real Streamable HTTP, the tool server's ledger in Redis: an
//! attempt timed out (the stream dropped) and re-issued, and the tool server killed
//! mid-effect and started again on the same ledger. Every operation's effect happens at
//! most once, and exactly once for every operation answered.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use serde_json::json;
use tower_idempotency::ledger::RedisStore;
use tower_idempotency::mcp::{CallerScope, McpClient, ToolGuard};
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::OperationId;

use super::harness::{http_client, serve_http, text, Billing, Effects};
use crate::redis_support::RedisServer;

/// A tool server in a runtime of its own: killing it drops every task it runs, mid-effect
/// handlers included, as a crashed process would.
struct ToolServer {
    runtime: Option<tokio::runtime::Runtime>,
    addr: SocketAddr,
}

impl ToolServer {
    fn start(redis_url: String, prefix: String, effects: Effects) -> Self {
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap();
            let addr = runtime.block_on(async move {
                let store = RedisStore::builder(&redis_url)
                    .prefix(prefix)
                    .connect()
                    .await
                    .unwrap();
                let guard = ToolGuard::builder(
                    store,
                    CallerScope::function(|_| Some("orchestrator".to_owned())),
                )
                // A dead owner's call turns in doubt within half a second.
                .ledger(|server| server.lease(Duration::from_millis(500)))
                .build()
                .unwrap();
                let (addr, _task) = serve_http(move || Billing::new(&guard, effects.clone())).await;
                addr
            });
            Self {
                runtime: Some(runtime),
                addr,
            }
        })
        .join()
        .unwrap()
    }

    fn kill(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

impl Drop for ToolServer {
    fn drop(&mut self) {
        self.kill();
    }
}

#[derive(Clone, Copy, Debug)]
enum Fault {
    None,
    /// The first attempt's stream stays silent past the attempt timeout and is dropped.
    Timeout,
    /// The tool server dies mid-effect and is started again on the same ledger.
    Restart,
}

fn orchestrator(
    session: &super::harness::Client,
    ledger: &tower_idempotency::ledger::MemoryStore,
) -> McpClient {
    McpClient::builder(ledger.clone(), session.peer().clone())
        .tool_settings(|tool| {
            tool.retry_policy(
                RetryPolicy::builder()
                    .max_attempts(5)
                    .attempt_timeout(Duration::from_millis(150))
                    .build()
                    .unwrap(),
            )
        })
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn randomized_drops_timeouts_and_restarts_keep_one_effect_per_operation() {
    let Some(redis) = RedisServer::spawn().await else {
        return;
    };
    let seed = std::env::var("MCP_FAULT_SEED")
        .ok()
        .and_then(|seed| seed.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    eprintln!("MCP_FAULT_SEED={seed}");
    let mut rng = fastrand::Rng::with_seed(seed);
    let prefix = format!("mcp-faults:{seed:016x}:");
    let effects = Effects::gated();
    let mut server = ToolServer::start(redis.url(), prefix.clone(), effects.clone());
    let ledger = tower_idempotency::ledger::MemoryStore::new();
    let mut session = http_client(server.addr).await;
    let mut answers = HashMap::new();
    let mut faults = Vec::new();
    for i in 0..10 {
        let fault = [Fault::None, Fault::Timeout, Fault::Restart][rng.usize(..3)];
        faults.push(fault);
        let order = format!("o-{i}");
        let op = OperationId::new("task-faults", format!("charge-{i}"));
        let arguments = json!({"order_id": order, "cents": 100 + i})
            .as_object()
            .cloned()
            .unwrap();
        let started = effects.started.load(std::sync::atomic::Ordering::SeqCst);
        let client = orchestrator(&session, &ledger);
        let answer = match fault {
            Fault::None => {
                effects.release(1);
                client.call(op, "charge", arguments).await
            }
            Fault::Timeout => {
                let gate = effects.clone();
                tokio::spawn(async move {
                    gate.started(started + 1).await;
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    gate.release(1);
                });
                client.call(op, "charge", arguments).await
            }
            Fault::Restart => {
                let call = {
                    let (client, op, arguments) = (client.clone(), op.clone(), arguments.clone());
                    tokio::spawn(async move { client.call(op, "charge", arguments).await })
                };
                effects.started(started + 1).await;
                // The tool server dies mid-effect, and the orchestrator's attempt with it.
                server.kill();
                call.abort();
                let _ = call.await;
                server = ToolServer::start(redis.url(), prefix.clone(), effects.clone());
                session = http_client(server.addr).await;
                // The orchestrator asks again for the operation, on the new server.
                orchestrator(&session, &ledger)
                    .call(op, "charge", arguments)
                    .await
            }
        };
        let effects_of_op = effects.started.load(std::sync::atomic::Ordering::SeqCst) - started;
        assert_eq!(
            effects_of_op, 1,
            "{order} ({fault:?}): one effect (seed {seed})"
        );
        answers.insert(order, (fault, answer));
    }
    let started = effects.started.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(
        started, 10,
        "one effect per operation (faults {faults:?}, seed {seed})"
    );
    for (order, (fault, answer)) in &answers {
        match (fault, answer) {
            (_, Ok(output)) => {
                assert!(
                    text(output.value()).starts_with(&format!("ch_{order}_")),
                    "{order}: {:?}",
                    output.value()
                );
            }
            // A call that died with its server cannot be known: reported (in doubt on the
            // orchestrator's ledger, `outcome-unknown` from the server's), never run twice.
            (Fault::Restart, Err(error)) => {
                let in_doubt = error.idempotency_error().is_some_and(|e| e.is_in_doubt());
                let unknown = matches!(
                    error.tool_error(),
                    Some(rmcp::ServiceError::McpError(data))
                        if data.data.as_ref().and_then(|d| d.get("type")).and_then(|t| t.as_str())
                            == Some(tower_idempotency::server::problem::OUTCOME_UNKNOWN)
                );
                assert!(in_doubt || unknown, "{order}: {error:?}");
            }
            (fault, Err(error)) => panic!("{order} ({fault:?}) failed: {error:?} (seed {seed})"),
        }
    }
}
