//! A protected MCP `tools/call` against the bare one, over Streamable HTTP on loopback.
//!
//! ```text
//! cargo bench --features mcp --bench mcp
//! MCP_BENCH_CALLS=2000 MCP_BENCH_ROUNDS=7 cargo bench --features mcp --bench mcp
//! ```
//!
//! Two rmcp servers of the tests' billing tools (`tests/mcp/harness.rs`), stateless with
//! JSON answers (an SSE stream per call waits ~40 ms a call on a delayed acknowledgement
//! over loopback, which would hide the rest), share a tokio runtime of one worker thread;
//! their clients run on another (two cores: one per side).
//! Each round runs every variant once, in a rotated order, `MCP_BENCH_CALLS` sequential
//! calls (default 1,000) of `charge`:
//!
//! | variant | server | call |
//! |---|---|---|
//! | `bare` | no guard | no key |
//! | `protected` | every route behind a `ToolGuard` (`MemoryStore`, one scope) | a new key per call |
//! | `protected_replay` | the same | one fixed key: every call after the first a replay |
//!
//! stdout: per variant the median over rounds of the mean time per call and its ratio to
//! `bare` in the same round:
//!
//! ```text
//! variant=<name> us_per_call=<x> ratio=<r>
//! ```

#[allow(dead_code)]
#[path = "../tests/mcp/harness.rs"]
mod harness;

use std::time::{Duration, Instant};

use harness::{call, http_client, serve_http_configured, Billing, Client, Effects};
use rmcp::transport::StreamableHttpServerConfig;
use serde_json::json;
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::mcp::{CallerScope, ToolGuard};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Variant {
    Bare,
    Protected,
    ProtectedReplay,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Self::Bare => "bare",
            Self::Protected => "protected",
            Self::ProtectedReplay => "protected_replay",
        }
    }
}

async fn run(client: &Client, variant: Variant, round: usize, calls: usize) -> Duration {
    let arguments = json!({"order_id": "o-42", "cents": 1999});
    let started = Instant::now();
    for i in 0..calls {
        let key = match variant {
            Variant::Bare => None,
            Variant::Protected => Some(format!("k-{round}-{i}")),
            Variant::ProtectedReplay => Some("k-replayed".to_owned()),
        };
        let mut params = call("charge", arguments.clone(), None);
        if let Some(key) = key {
            let mut meta = rmcp::model::MetaObject::default();
            meta.0.insert("idempotency-key".into(), key.into());
            params.meta = Some(rmcp::model::RequestMetaObject(meta));
        }
        client.call_tool(params).await.expect("call");
    }
    started.elapsed() / calls as u32
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(|a, b| a.partial_cmp(b).unwrap());
    values[values.len() / 2]
}

fn main() {
    let calls = env("MCP_BENCH_CALLS", 1000);
    let rounds = env("MCP_BENCH_ROUNDS", 5);
    let servers = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (bare_addr, guarded_addr) = servers.block_on(async {
        let guard = ToolGuard::builder(
            MemoryStore::new(),
            CallerScope::function(|_| Some("bench".to_owned())),
        )
        .build()
        .unwrap();
        let effects = Effects::default();
        let bare_effects = effects.clone();
        // Stateless, with plain JSON answers rather than an SSE stream per call: on loopback
        // the stream's framing waits on a delayed acknowledgement (~40 ms a call), which
        // would hide everything else.
        let mut config = StreamableHttpServerConfig::default();
        config.legacy_session_mode = false;
        config.json_response = true;
        let (bare, _) = serve_http_configured(
            move || Billing::bare(bare_effects.clone()),
            |app| app,
            config.clone(),
        )
        .await;
        let (guarded, _) = serve_http_configured(
            move || Billing::new(&guard, effects.clone()),
            |app| app,
            config,
        )
        .await;
        (bare, guarded)
    });
    let clients = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    clients.block_on(async {
        let bare = http_client(bare_addr).await;
        let guarded = http_client(guarded_addr).await;
        let variants = [Variant::Bare, Variant::Protected, Variant::ProtectedReplay];
        // Warm-up: connections, allocator, the replayed key's first run.
        for variant in variants {
            let client = if variant == Variant::Bare {
                &bare
            } else {
                &guarded
            };
            run(client, variant, usize::MAX, calls / 10 + 1).await;
        }
        let mut per_call = vec![Vec::new(); variants.len()];
        let mut ratios = vec![Vec::new(); variants.len()];
        for round in 0..rounds {
            let mut this_round = [0.0; 3];
            for offset in 0..variants.len() {
                let index = (round + offset) % variants.len();
                let variant = variants[index];
                let client = if variant == Variant::Bare {
                    &bare
                } else {
                    &guarded
                };
                let mean = run(client, variant, round, calls).await;
                this_round[index] = mean.as_secs_f64() * 1e6;
                eprintln!(
                    "round {round} {} {:.1} us/call",
                    variant.name(),
                    this_round[index]
                );
            }
            for index in 0..variants.len() {
                per_call[index].push(this_round[index]);
                ratios[index].push(this_round[index] / this_round[0]);
            }
        }
        for (index, variant) in variants.iter().enumerate() {
            println!(
                "variant={} us_per_call={:.1} ratio={:.2}",
                variant.name(),
                median(&mut per_call[index]),
                median(&mut ratios[index])
            );
        }
    });
}
