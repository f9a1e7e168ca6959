//! The incidents this crate exists to stop, reproduced over real loopback HTTP.
//!
//! An axum "provider" plays a payments API (deduplicates on `Idempotency-Key`, as Stripe
//! does) and a fulfillment service (deduplicates internally on `fulfillment_intent_id`, as
//! in the second incident). An orchestrator calls them through a hyper-util client, first
//! with the stack teams write by hand, then with ours:
//!
//! 1. **Charge after a timeout.** The charge lands, the answer is slow, the caller's timeout
//!    fires, the retry charges again.
//! 2. **The retry regenerated the request.** The fulfillment service answers a transient
//!    500 after writing the row; the "retry" re-runs the agent, which rewords `summary` and
//!    mints a fresh `fulfillment_intent_id`. Then the orchestrator re-runs the whole agent
//!    step, which our layer catches as drift, naming the fields that changed.
//! 3. **Crash and resume.** The orchestrator dies after its request left; it comes back,
//!    the agent regenerates the payload, and the call is made again.
//! 4. **A provider that ignores keys.** The charge lands, the orchestrator dies before the
//!    answer; on resume a resend would charge again. Ours asks the provider whether it
//!    happened (reconciliation) and returns the provider's own record.
//!
//! 5. **The same at the tool-call level.** `create_order` through an SDK-like tool (no HTTP
//!    request to wrap; the SDK ignores keys): a timeout after the write, the step re-run,
//!    the call regenerated. Ours keeps the frozen arguments and reconciles.
//!
//! 6. **An MCP tool call whose stream drops.** An agent calls
//!    `charge_customer` on an MCP tool server over Streamable HTTP; the tool charges, the
//!    provider's answer is slow, the agent's timeout closes the stream and the call is
//!    issued again (a new JSON-RPC id). Ours: the tool server's routes behind a
//!    `ToolGuard`, the agent an `McpClient`: the re-issue carries the operation's key and
//!    is answered with the first run's result.
//!
//! 7. **The operator's part.** A provider that ignores keys, and whose lookup is down,
//!    leaves a charge in doubt: it is not sent again blind. The on-call operator lists it
//!    through the console's JSON API, resolves it as not applied, and the next run charges.
//!
//! Every count in the final table is read from the provider's own records.
//!
//! ```text
//! cargo run --example agent_incidents
//! ```
//!
//! With `REDIS_URL` set (and the `redis` feature on), the ledger is Redis and scenario 3's
//! crash kills a real child process.

use std::collections::HashMap;
use std::future::{ready, Ready};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use bytes::Bytes;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use tower::retry::Policy;
use tower::{BoxError, ServiceBuilder, ServiceExt};
use tower_idempotency::client::ClientFace;
use tower_idempotency::ledger::{IdempotencyStore, MemoryStore};
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::{
    DriftPolicy, FrozenRetryLayer, HeaderKey, IdempotencyLayer, KeyHeader, OperationId,
    ResponseSource,
};

// ---------------------------------------------------------------------------------------
// The provider: a payments API and a fulfillment service, with scripted trouble.
// ---------------------------------------------------------------------------------------

/// What the next request to a route suffers.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Trouble {
    None,
    /// Do the work, then answer only after this long (the caller has given up by then).
    SlowAnswer(Duration),
    /// Do the work, then answer 500 (connection pool exhausted on the way out).
    ErrorAfterWrite,
}

#[derive(Default)]
struct Books {
    /// Charges per order id.
    charges: Vec<Value>,
    /// Responses remembered per `Idempotency-Key` (payments deduplicate on the key).
    charges_by_key: HashMap<String, Value>,
    /// Fulfillment rows; the service deduplicates on `fulfillment_intent_id` only.
    orders: Vec<Value>,
    next_trouble: HashMap<&'static str, Trouble>,
}

#[derive(Clone, Default)]
struct Provider(Arc<Mutex<Books>>);

impl Provider {
    fn trouble_next(&self, route: &'static str, trouble: Trouble) {
        self.0.lock().unwrap().next_trouble.insert(route, trouble);
    }

    fn take_trouble(&self, route: &'static str) -> Trouble {
        self.0
            .lock()
            .unwrap()
            .next_trouble
            .remove(route)
            .unwrap_or(Trouble::None)
    }

    fn charges_for(&self, order_id: &str) -> usize {
        let books = self.0.lock().unwrap();
        books
            .charges
            .iter()
            .filter(|c| c["order_id"] == order_id)
            .count()
    }

    fn order_rows_for(&self, order_id: &str) -> usize {
        let books = self.0.lock().unwrap();
        books
            .orders
            .iter()
            .filter(|o| o["order_id"] == order_id)
            .count()
    }

    fn order_rows(&self, order_id: &str) -> Vec<Value> {
        let books = self.0.lock().unwrap();
        books
            .orders
            .iter()
            .filter(|o| o["order_id"] == order_id)
            .cloned()
            .collect()
    }
}

async fn answer_after(
    trouble: Trouble,
    status: StatusCode,
    body: Value,
) -> (StatusCode, Json<Value>) {
    match trouble {
        Trouble::SlowAnswer(delay) => {
            tokio::time::sleep(delay).await;
            (status, Json(body))
        }
        Trouble::ErrorAfterWrite => (
            StatusCode::INTERNAL_SERVER_ERROR,
            Json(json!({"error": "connection pool exhausted"})),
        ),
        Trouble::None => (status, Json(body)),
    }
}

/// `POST /charges`: charges a card; deduplicates on `Idempotency-Key` like Stripe.
async fn charge(
    State(provider): State<Provider>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let key = HeaderKey::from_headers(&headers).ok().flatten();
    let trouble = provider.take_trouble("charges");
    let receipt = {
        let mut books = provider.0.lock().unwrap();
        match key
            .as_ref()
            .and_then(|k| books.charges_by_key.get(k.as_str()))
        {
            Some(earlier) => earlier.clone(),
            None => {
                let charge = json!({
                    "charge_id": format!("ch_{}", books.charges.len() + 1),
                    "order_id": body["order_id"],
                    "amount_cents": body["amount_cents"],
                });
                books.charges.push(charge.clone());
                if let Some(key) = &key {
                    books
                        .charges_by_key
                        .insert(key.as_str().to_owned(), charge.clone());
                }
                charge
            }
        }
    };
    answer_after(trouble, StatusCode::CREATED, receipt).await
}

/// `POST /orders`: creates a fulfillment row; deduplicates on `fulfillment_intent_id`.
async fn create_order(
    State(provider): State<Provider>,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let trouble = provider.take_trouble("orders");
    let row = {
        let mut books = provider.0.lock().unwrap();
        let existing = books
            .orders
            .iter()
            .find(|o| o["fulfillment_intent_id"] == body["fulfillment_intent_id"])
            .cloned();
        existing.unwrap_or_else(|| {
            books.orders.push(body.clone());
            body
        })
    };
    answer_after(trouble, StatusCode::CREATED, row).await
}

async fn start_provider() -> (Provider, String) {
    let provider = Provider::default();
    let app = Router::new()
        .route("/charges", post(charge))
        .route("/orders", post(create_order))
        .with_state(provider.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (provider, base)
}

// ---------------------------------------------------------------------------------------
// The agent: asked twice, it never writes the same tool call twice.
// ---------------------------------------------------------------------------------------

#[derive(Default)]
struct Agent {
    runs: u32,
}

impl Agent {
    /// Reason about the restock and produce the `create_order` tool call.
    fn create_order_call(&mut self) -> Value {
        self.runs += 1;
        let summary = if self.runs == 1 {
            "Restock: 200 units of SKU-4471, expedited freight".to_owned()
        } else {
            "Restock order for 200 units of SKU-4471 - expediting after prior submission failed to confirm"
                .to_owned()
        };
        json!({
            "order_id": "ord_8f21c3",
            "summary": summary,
            "total_cents": 184200,
            // A fresh UUID-like id on every run: nothing told the model to keep the old one.
            "fulfillment_intent_id": format!("fi_{:06x}", fresh_id()),
        })
    }
}

fn fresh_id() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u8(1);
    (hasher.finish() & 0xff_ffff) as u32
}

fn json_post(uri: &str, body: &Value) -> Request<Full<Bytes>> {
    Request::post(uri)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap()
}

// ---------------------------------------------------------------------------------------
// The stacks.
// ---------------------------------------------------------------------------------------

type Hyper = HyperClient<HttpConnector, Full<Bytes>>;

fn hyper_client() -> Hyper {
    HyperClient::builder(TokioExecutor::new()).build_http()
}

/// The retry policy teams write by hand with `tower::retry`: buffer, clone, retry on error.
#[derive(Clone)]
struct NaiveRetry {
    retries_left: usize,
}

impl<Res> Policy<Request<Full<Bytes>>, Res, BoxError> for NaiveRetry {
    type Future = Ready<()>;

    fn retry(
        &mut self,
        _: &mut Request<Full<Bytes>>,
        result: &mut Result<Res, BoxError>,
    ) -> Option<Self::Future> {
        if result.is_err() && self.retries_left > 0 {
            self.retries_left -= 1;
            Some(ready(()))
        } else {
            None
        }
    }

    fn clone_request(&mut self, req: &Request<Full<Bytes>>) -> Option<Request<Full<Bytes>>> {
        Some(req.clone())
    }
}

const CALL_TIMEOUT: Duration = Duration::from_millis(300);

fn our_retry_policy() -> RetryPolicy {
    RetryPolicy::builder()
        .attempt_timeout(CALL_TIMEOUT)
        .backoff(Duration::from_millis(20), Duration::from_millis(200))
        .max_elapsed(Duration::from_secs(1))
        .build()
        .expect("valid retry policy")
}

/// Where the ledger lives: in this process, or in Redis when `REDIS_URL` is set (and the
/// `redis` feature is on), where it outlives the processes that use it.
#[derive(Clone, Debug)]
enum LedgerChoice {
    Memory,
    #[cfg(feature = "redis")]
    Redis {
        url: String,
        prefix: String,
    },
}

impl std::fmt::Display for LedgerChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Memory => f.write_str("in this process (MemoryStore)"),
            #[cfg(feature = "redis")]
            Self::Redis { prefix, .. } => write!(f, "Redis at REDIS_URL, keys under {prefix}"),
        }
    }
}

static LEDGER: std::sync::OnceLock<LedgerChoice> = std::sync::OnceLock::new();

fn choose_ledger() -> LedgerChoice {
    #[cfg(feature = "redis")]
    if let Ok(url) = std::env::var("REDIS_URL") {
        // A namespace per run, so records of earlier runs never answer for this one.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        let prefix = format!("agent_incidents:{nanos}:");
        return LedgerChoice::Redis { url, prefix };
    }
    LedgerChoice::Memory
}

async fn ledger() -> Arc<dyn IdempotencyStore> {
    match LEDGER.get().expect("ledger chosen in main") {
        LedgerChoice::Memory => Arc::new(MemoryStore::new()),
        #[cfg(feature = "redis")]
        LedgerChoice::Redis { url, prefix } => Arc::new(
            tower_idempotency::ledger::RedisStore::builder(url.clone())
                .prefix(prefix.clone())
                .connect()
                .await
                .expect("REDIS_URL is reachable"),
        ),
    }
}

/// Our client layer. The lease is short so that, after a crash nothing could clean up
/// after (a SIGKILL), the resumed orchestrator waits seconds, not a minute.
fn our_layer(store: Arc<dyn IdempotencyStore>, drift: DriftPolicy) -> IdempotencyLayer<ClientFace> {
    IdempotencyLayer::client_builder(store)
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .lease(Duration::from_secs(2))
        .retry_policy(
            tower_idempotency::retry::RetryPolicy::builder()
                .max_elapsed(Duration::from_secs(1))
                .build()
                .unwrap(),
        )
        .drift_policy(drift)
        .build()
        .expect("valid client settings")
}

// ---------------------------------------------------------------------------------------
// The scenarios.
// ---------------------------------------------------------------------------------------

struct Row {
    scenario: &'static str,
    naive: usize,
    ours: usize,
    note: String,
}

async fn charge_after_timeout(provider: &Provider, base: &str) -> Row {
    let uri = format!("{base}/charges");
    let body = json!({"order_id": "order_42", "amount_cents": 1999});

    // Naive: tower::retry around a timeout, no key.
    provider.trouble_next("charges", Trouble::SlowAnswer(Duration::from_millis(800)));
    let naive = ServiceBuilder::new()
        .retry(NaiveRetry { retries_left: 2 })
        .timeout(CALL_TIMEOUT)
        .service(hyper_client().map_err(BoxError::from));
    let naive_result = naive.oneshot(json_post(&uri, &body)).await;
    let naive_charges = provider.charges_for("order_42");
    println!(
        "  naive: {} after retrying; charges for order_42: {naive_charges}",
        status_of(&naive_result)
    );

    // Ours: the same charge of order_42. The key comes from (task_id, step_id); retries
    // resend the frozen bytes.
    let op = OperationId::new("task-1", "charge_customer");
    println!(
        "  ours:  the key derived from (task-1, charge_customer), sent on every attempt:\n         Idempotency-Key: {}",
        op.key("").header_value().to_str().expect("a derived key is ASCII")
    );
    provider.trouble_next("charges", Trouble::SlowAnswer(Duration::from_millis(800)));
    let ours = ServiceBuilder::new()
        .layer(our_layer(ledger().await, DriftPolicy::Reject))
        .layer(FrozenRetryLayer::new(our_retry_policy()))
        .service(hyper_client());
    let mut req = json_post(&uri, &body);
    req.extensions_mut().insert(op);
    let response = ours
        .oneshot(req)
        .await
        .expect("our stack gets the real answer");
    let receipt = response.into_body().collect().await.unwrap().to_bytes();
    let our_charges = provider.charges_for("order_42") - naive_charges;
    println!(
        "  ours:  201 {}; charges for order_42 made by this stack: {our_charges}",
        String::from_utf8_lossy(&receipt)
    );
    Row {
        scenario: "1. charge after a timeout",
        naive: naive_charges,
        ours: our_charges,
        note: "the retry carried the derived key; the provider answered with the first charge"
            .into(),
    }
}

async fn retry_regenerated_the_request(provider: &Provider, base: &str) -> Row {
    let uri = format!("{base}/orders");

    // Naive: "retry" = ask the agent again and send whatever it produces.
    let mut agent = Agent::default();
    provider.trouble_next("orders", Trouble::ErrorAfterWrite);
    let client = hyper_client();
    let mut runs = Vec::new();
    for _attempt in 0..3 {
        let call = agent.create_order_call();
        runs.push(call["fulfillment_intent_id"].clone());
        let response = client.request(json_post(&uri, &call)).await.unwrap();
        if response.status().is_success() {
            break;
        }
    }
    let naive_rows = provider.order_rows_for("ord_8f21c3");
    println!(
        "  naive: the agent ran {} times; rows for ord_8f21c3: {naive_rows}",
        agent.runs
    );
    for row in provider.order_rows("ord_8f21c3") {
        let intent = &row["fulfillment_intent_id"];
        let run = runs.iter().position(|id| id == intent).map_or(0, |i| i + 1);
        println!(
            "         agent run {run}: {} {}",
            intent.as_str().unwrap_or_default(),
            row["summary"]
        );
    }

    // Ours: the agent runs once; the retry resends its frozen bytes.
    let mut agent = Agent::default();
    let ours = ServiceBuilder::new()
        .layer(our_layer(ledger().await, DriftPolicy::Reject))
        .layer(FrozenRetryLayer::new(our_retry_policy()))
        .service(hyper_client());
    let call = agent.create_order_call();
    let restock = |call: &Value| {
        let mut call = call.clone();
        call["order_id"] = json!("ord_restock_2");
        let mut req = json_post(&uri, &call);
        req.extensions_mut()
            .insert(OperationId::new("task-2", "create_order"));
        req
    };
    provider.trouble_next("orders", Trouble::ErrorAfterWrite);
    let response = ours.clone().oneshot(restock(&call)).await.unwrap();
    println!(
        "  ours:  agent run 1: {}; {} after a 500, the retry resent its frozen bytes",
        call["fulfillment_intent_id"].as_str().unwrap_or_default(),
        response.status(),
    );

    // The orchestrator re-runs the whole agent step: new bytes under the same operation.
    let rerun = agent.create_order_call();
    let err = ours
        .oneshot(restock(&rerun))
        .await
        .expect_err("a regenerated payload is refused");
    let fields = err
        .drift()
        .and_then(|d| d.changed_fields())
        .map(|f| f.join(", "))
        .unwrap_or_default();
    println!(
        "  ours:  agent run 2 (the orchestrator re-ran the step): {}, refused as drift; changed fields: {fields}",
        rerun["fulfillment_intent_id"].as_str().unwrap_or_default()
    );
    let our_rows = provider.order_rows_for("ord_restock_2");
    println!("         rows for ord_restock_2: {our_rows}");
    Row {
        scenario: "2. 500, then a retry that regenerated the request",
        naive: naive_rows,
        ours: our_rows,
        note: format!("re-run caught as drift: {fields}"),
    }
}

async fn crash_and_resume(provider: &Provider, base: &str) -> Row {
    let uri = format!("{base}/orders");

    // Naive: the orchestrator dies mid-call; on resume the agent step runs again.
    let order = |call: &Value, order_id: &str| {
        let mut call = call.clone();
        call["order_id"] = json!(order_id);
        call
    };
    let mut agent = Agent::default();
    provider.trouble_next("orders", Trouble::SlowAnswer(Duration::from_millis(800)));
    let first = order(&agent.create_order_call(), "ord_crash_naive");
    let in_flight = tokio::spawn({
        let req = json_post(&uri, &first);
        async move { hyper_client().request(req).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    in_flight.abort(); // the orchestrator process is gone
    let resumed = order(&agent.create_order_call(), "ord_crash_naive");
    hyper_client()
        .request(json_post(&uri, &resumed))
        .await
        .unwrap();
    let naive_rows = provider.order_rows_for("ord_crash_naive");
    println!("  naive: crashed, resumed, re-ran the agent; rows: {naive_rows}");

    // Ours: same crash; the resumed stack resends what was frozen before the first send.
    let store = ledger().await;
    let mut agent = Agent::default();
    let op = OperationId::new("task-3", "create_order");
    provider.trouble_next("orders", Trouble::SlowAnswer(Duration::from_millis(800)));
    let first = order(&agent.create_order_call(), "ord_crash_ours");
    match LEDGER.get().expect("ledger chosen") {
        LedgerChoice::Memory => {
            let in_flight = tokio::spawn(send_as_orchestrator(
                store.clone(),
                uri.clone(),
                first.clone(),
            ));
            tokio::time::sleep(Duration::from_millis(200)).await;
            in_flight.abort(); // the whole client stack is dropped; only the ledger survives
            tokio::time::sleep(Duration::from_millis(20)).await;
            println!("  ours:  the orchestrator task was dropped mid-call (in-process ledger)");
        }
        #[cfg(feature = "redis")]
        LedgerChoice::Redis { url, prefix } => {
            // A real process boundary: a child orchestrator sends, then is SIGKILLed.
            let mut child = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--orchestrator-child",
                    url,
                    prefix,
                    &uri,
                    &first.to_string(),
                ])
                .spawn()
                .expect("spawn the orchestrator process");
            while provider.order_rows_for("ord_crash_ours") == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            child.kill().expect("SIGKILL");
            child.wait().unwrap();
            println!("  ours:  orchestrator process {} was SIGKILLed after its request left (Redis ledger)", child.id());
        }
    }

    let after_restart = ServiceBuilder::new()
        .layer(our_layer(store.clone(), DriftPolicy::ResendFrozen))
        .layer(FrozenRetryLayer::new(our_retry_policy()))
        .service(hyper_client());
    let regenerated = order(&agent.create_order_call(), "ord_crash_ours");
    let mut req = json_post(&uri, &regenerated);
    req.extensions_mut().insert(op);
    let response = after_restart.oneshot(req).await.expect("resumed");
    let how = match ResponseSource::of(&response) {
        ResponseSource::Resent => "resent the frozen bytes",
        ResponseSource::Replayed => "replayed the recorded answer",
        ResponseSource::Sent => "sent for the first time",
        _ => "sent unprotected",
    };
    let row: Value =
        serde_json::from_slice(&response.into_body().collect().await.unwrap().to_bytes()).unwrap();
    let our_rows = provider.order_rows_for("ord_crash_ours");
    println!(
        "  ours:  resumed ({how}); the provider answered with {} (the first run's id); rows: {our_rows}",
        row["fulfillment_intent_id"]
    );
    assert_eq!(row["fulfillment_intent_id"], first["fulfillment_intent_id"]);
    Row {
        scenario: "3. crash after sending, then resume",
        naive: naive_rows,
        ours: our_rows,
        note: "resent the frozen bytes, not the regenerated payload".into(),
    }
}

/// A provider that ignores `Idempotency-Key` (the testing kit's, served over HTTP): the
/// orchestrator crashes after its charge left; on resume, resending would charge again.
/// Ours asks the provider first (`GET /effects?idempotency_key=…`) and records what it says.
async fn crash_against_a_provider_that_ignores_keys() -> Row {
    use tower_idempotency::idempotency::{record_or_not_found, LookupReconciler};
    use tower_idempotency::testing::{Fault, SideEffectService, LOOKUP_PATH};

    let provider = SideEffectService::builder().honour_keys(false).build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = provider.clone().serve(listener).await.unwrap();
    let uri = server.uri("/charges").to_string();
    let body = json!({"order_id": "order_44", "amount_cents": 1999});
    // Crash once the charge has landed (its answer never comes: the kit holds it).
    let crash_after_charge = |task: tokio::task::JoinHandle<()>, key: String| {
        let provider = provider.clone();
        async move {
            while provider.effects_for_key(&key) == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            task.abort();
        }
    };

    // Naive: a key on the request, which this provider ignores; the resumed run resends.
    provider.push_fault(Fault::CommitThenTimeout);
    let naive_key = "order_44-charge";
    let keyed = || {
        let mut req = json_post(&uri, &body);
        req.headers_mut()
            .insert("idempotency-key", http::HeaderValue::from_static(naive_key));
        req
    };
    let first = tokio::spawn({
        let req = keyed();
        async move {
            let _ = hyper_client().request(req).await;
        }
    });
    crash_after_charge(first, naive_key.to_owned()).await;
    hyper_client().request(keyed()).await.unwrap();
    let naive_charges = provider.effects_for_key(naive_key);
    println!("  naive: crashed, resumed, resent under the same key; charges: {naive_charges}");

    // Ours: the same crash; the resumed run reconciles before anything is resent.
    let store = ledger().await;
    let op = OperationId::new("task-4", "charge_customer");
    let stack = |reconcile: bool| {
        let builder = IdempotencyLayer::client_builder(store.clone())
            .lease(Duration::from_secs(2))
            .retry_policy(
                tower_idempotency::retry::RetryPolicy::builder()
                    .max_elapsed(Duration::from_secs(1))
                    .build()
                    .unwrap(),
            )
            .provider_deduplicates(false);
        let builder = if reconcile {
            builder.reconcile(
                LookupReconciler::by_key(
                    hyper_client(),
                    LOOKUP_PATH,
                    "idempotency_key",
                    record_or_not_found,
                )
                .applied_status(StatusCode::CREATED),
            )
        } else {
            builder
        };
        ServiceBuilder::new()
            .layer(builder.build().expect("valid client settings"))
            .service(hyper_client())
    };
    let charge = || {
        let mut req = json_post(&uri, &body);
        req.extensions_mut().insert(op.clone());
        req
    };
    provider.push_fault(Fault::CommitThenTimeout);
    let first = tokio::spawn({
        let (stack, req) = (stack(false), charge());
        async move {
            let _ = stack.oneshot(req).await;
        }
    });
    crash_after_charge(first, op.key("").to_hex()).await;
    // Let the dropped stack settle its lease (in doubt), as it does on a real shutdown.
    tokio::time::sleep(Duration::from_millis(20)).await;
    println!("  ours:  the orchestrator task was dropped after its charge left");

    let response = stack(true).oneshot(charge()).await.expect("reconciled");
    let source = ResponseSource::of(&response);
    assert_eq!(source, ResponseSource::Reconciled);
    let receipt: Value =
        serde_json::from_slice(&response.into_body().collect().await.unwrap().to_bytes()).unwrap();
    let our_charges = provider.effects_for_operation(&op, "");
    println!(
        "  ours:  resumed: reconciled with the provider, which has {} on record; recorded and \
         returned to the caller; charges: {our_charges}",
        receipt["effect_id"]
    );
    server.shutdown().await;
    Row {
        scenario: "4. provider ignores keys, crash, then resume",
        naive: naive_charges,
        ours: our_charges,
        note: "asked the provider before resending; its answer was recorded and returned".into(),
    }
}

/// The operator's part: a provider that ignores keys answers `503` to the first charge
/// (nothing was charged: it failed before committing), and its lookup is down too, so the
/// operation stays in doubt and the next run is refused rather than charging blind. The
/// on-call operator finds it through the console's JSON, checks with the provider (no
/// charge), and resolves it as not applied, fenced by the look it was found with; the next
/// run charges. Answers the charges the provider counts.
async fn an_operator_resolves_an_operation_in_doubt() -> usize {
    use http::request::Parts;
    use tower_idempotency::console::{Console, Operator, Refusal, Role};
    use tower_idempotency::idempotency::{record_or_not_found, LookupReconciler};
    use tower_idempotency::testing::{Fault, SideEffectService, LOOKUP_PATH};
    use tower_idempotency::FrozenRetryLayer;

    let provider = SideEffectService::builder().honour_keys(false).build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = provider.clone().serve(listener).await.unwrap();
    let uri = server.uri("/charges").to_string();
    let lookup_down = tower::service_fn(|_: Request<Full<Bytes>>| {
        ready(Ok::<_, BoxError>(
            http::Response::builder()
                .status(StatusCode::SERVICE_UNAVAILABLE)
                .body(Full::new(Bytes::from_static(
                    b"lookup down for maintenance",
                )))
                .unwrap(),
        ))
    });
    let once = RetryPolicy::builder().max_attempts(1).build().unwrap();
    let layer = IdempotencyLayer::client_builder(ledger().await)
        .provider_deduplicates(false)
        .retry_policy(once.clone())
        .reconcile(LookupReconciler::by_key(
            lookup_down,
            LOOKUP_PATH,
            "idempotency_key",
            record_or_not_found,
        ))
        .build()
        .expect("valid client settings");
    let records = layer.records();
    let client = ServiceBuilder::new()
        .layer(layer)
        .layer(FrozenRetryLayer::new(once))
        .service(hyper_client());
    let op = OperationId::new("task-6", "charge_customer");
    let charge = || {
        let mut req = json_post(&uri, &json!({"order_id": "order_46", "amount_cents": 1999}));
        req.extensions_mut().insert(op.clone());
        req
    };

    provider.push_fault(Fault::ServerError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        commit: false,
    });
    let first = client.clone().oneshot(charge()).await;
    println!(
        "  the charge: {}; the lookup: 503 as well",
        status_of(&first)
    );
    let refused = client.clone().oneshot(charge()).await.map(|_| ());
    let refused = refused.expect_err("in doubt: not sent again blind");
    assert!(refused.is_unreconciled());
    println!("  the step run again: refused, in doubt until someone decides ({refused})");

    // The operator's place, nested in the service's router, behind its sign-in.
    let on_call = |_: &Parts| Ok::<_, Refusal>(Operator::new("on-call", Role::Act));
    let app = Router::new().nest("/_idempotency", Console::new(records, on_call).router());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let console = format!("http://{}/_idempotency", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let read = |response: http::Response<hyper::body::Incoming>| async move {
        let body = response.into_body().collect().await.unwrap().to_bytes();
        serde_json::from_slice::<Value>(&body).unwrap()
    };
    let list = hyper_client()
        .request(
            Request::get(format!("{console}/api/records?state=in_doubt"))
                .body(Full::default())
                .unwrap(),
        )
        .await
        .unwrap();
    let found = read(list).await["records"][0].clone();
    println!(
        "  GET /_idempotency/api/records?state=in_doubt: {}… ({}, attempts: {})",
        &found["key"].as_str().unwrap()[..16],
        found["state"],
        found["attempts"]
    );
    let resolve = json_post(
        &format!(
            "{console}/api/records/{}/resolve-not-applied",
            found["key"].as_str().unwrap()
        ),
        &json!({"expected": found["look"], "reason": "INC-46: no charge at the provider"}),
    );
    let resolved = read(hyper_client().request(resolve).await.unwrap()).await;
    println!(
        "  POST .../resolve-not-applied with that look: {}",
        resolved["result"]
    );

    let charged = client.oneshot(charge()).await;
    let charges = provider.effects();
    println!(
        "  the step run again: {}; charges: {charges}",
        status_of(&charged)
    );
    server.shutdown().await;
    charges
}

/// The tool-call level: `create_order` through an SDK-like tool (no HTTP request to wrap,
/// and the SDK ignores keys). Its first call writes the order, then times out; the
/// orchestrator re-runs the step and the model regenerates the call (new `summary`, new
/// `fulfillment_intent_id`). Naive: the SDK is called again, a second order. Ours
/// (`tool::ToolLayer`): the arguments first frozen stand, the provider's lookup finds the
/// first order, and the caller is told which regenerated fields were discarded.
async fn regenerated_tool_call_over_an_sdk() -> Row {
    use tower::Layer;
    use tower_idempotency::idempotency::{InDoubtOperation, Reconciled};
    use tower_idempotency::testing::{ToolDouble, ToolFault};
    use tower_idempotency::tool::{applied, ProviderKeys, ToolCall, ToolLayer};

    let op = OperationId::new("task-5", "create_order");
    // Naive: the orchestrator calls the SDK for each run of the step.
    let sdk = ToolDouble::new().with_faults([ToolFault::CommitThenTimeout]);
    let mut agent = Agent::default();
    for run in 1..=2 {
        let call = ToolCall::new(op.clone(), agent.create_order_call());
        let answer = sdk.clone().oneshot(call).await;
        println!(
            "  naive: run {run}: {}",
            if answer.is_ok() { "ok" } else { "timed out" }
        );
        if answer.is_ok() {
            break;
        }
    }
    let naive = sdk.effects_of(&op);

    // Ours: the same SDK and agent behind the tool face, with the provider's lookup.
    let sdk = ToolDouble::new().with_faults([ToolFault::CommitThenTimeout]);
    let lookup = sdk.clone();
    let tool = ToolLayer::builder(ledger().await, "create_order", ProviderKeys::Ignored)
        .classify(ToolDouble::classifier())
        // The provider's lookup: the orders it holds for this step.
        .reconcile(move |_: InDoubtOperation| {
            let lookup = lookup.clone();
            async move {
                let op = OperationId::new("task-5", "create_order");
                Ok(match lookup.arguments_of(&op).first() {
                    Some(made) => applied(&json!({"receipt": "found", "arguments": made}))?,
                    None => Reconciled::NotApplied,
                })
            }
        })
        .build()
        .expect("valid tool settings")
        .layer(sdk.clone());
    let mut agent = Agent::default();
    for run in 1..=2 {
        let call = ToolCall::new(op.clone(), agent.create_order_call());
        match tool.clone().oneshot(call).await {
            Ok(out) => {
                println!(
                    "  ours:  run {run}: {:?}; order {} kept; discarded regenerated fields {:?}",
                    out.source(),
                    out.value()["arguments"]["fulfillment_intent_id"],
                    out.discarded()
                        .and_then(|d| d.changed_fields())
                        .unwrap_or_default(),
                );
                break;
            }
            Err(err) => println!("  ours:  run {run}: {err}"),
        }
    }
    Row {
        scenario: "5. SDK tool: timeout, the model regenerates the call",
        naive,
        ours: sdk.effects_of(&op),
        note: "the frozen arguments stand; the provider's lookup found the first order".into(),
    }
}

/// One orchestrator run of the `create_order` step through our stack.
async fn send_as_orchestrator(
    store: Arc<dyn IdempotencyStore>,
    uri: String,
    call: Value,
) -> Result<
    http::Response<tower_idempotency::idempotency::ResponseBody<hyper::body::Incoming>>,
    tower_idempotency::Error,
> {
    let stack = ServiceBuilder::new()
        .layer(our_layer(store, DriftPolicy::ResendFrozen))
        .layer(FrozenRetryLayer::new(our_retry_policy()))
        .service(hyper_client());
    let mut req = json_post(&uri, &call);
    req.extensions_mut()
        .insert(OperationId::new("task-3", "create_order"));
    stack.oneshot(req).await
}

// ---------------------------------------------------------------------------------------
// 7. An MCP tool call whose stream drops (feature `mcp`).
// ---------------------------------------------------------------------------------------

#[cfg(feature = "mcp")]
mod mcp_tool_server {
    use rmcp::handler::server::{router::tool::ToolRouter, wrapper::Parameters};
    use rmcp::model::{ServerCapabilities, ServerConfig};
    use rmcp::{schemars, tool, tool_handler, tool_router, ServerHandler};
    use serde_json::json;
    use tower::ServiceExt;
    use tower_idempotency::mcp::{self, ToolGuard};

    #[derive(serde::Deserialize, schemars::JsonSchema)]
    pub struct Charge {
        order_id: String,
        amount_cents: u64,
    }

    /// An MCP tool server whose `charge_customer` charges through the payments API.
    #[derive(Clone)]
    pub struct Payments {
        base: String,
        guarded: bool,
        tool_router: ToolRouter<Self>,
    }

    #[tool_router]
    impl Payments {
        pub fn new(base: String, guard: Option<&ToolGuard>) -> Self {
            let tools = Self::tool_router();
            Self {
                base,
                guarded: guard.is_some(),
                tool_router: match guard {
                    Some(guard) => guard.router(tools),
                    None => tools,
                },
            }
        }

        #[tool(description = "Charge a customer for an order")]
        async fn charge_customer(&self, Parameters(charge): Parameters<Charge>) -> String {
            let body = json!({"order_id": charge.order_id, "amount_cents": charge.amount_cents});
            let request = super::json_post(&format!("{}/charges", self.base), &body);
            match super::hyper_client().oneshot(request).await {
                Ok(response) => format!("charged: {}", response.status()),
                Err(err) => format!("charge failed: {err}"),
            }
        }
    }

    #[tool_handler(router = self.tool_router)]
    impl ServerHandler for Payments {
        fn get_info(&self) -> ServerConfig {
            let mut capabilities = ServerCapabilities::builder().enable_tools().build();
            if self.guarded {
                mcp::advertise(&mut capabilities);
            }
            ServerConfig::new(capabilities)
        }
    }
}

#[cfg(feature = "mcp")]
async fn mcp_tool_call_whose_stream_drops(provider: &Provider, base: &str) -> Row {
    use mcp_tool_server::Payments;
    use rmcp::model::CallToolRequestParams;
    use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
    use rmcp::transport::{StreamableHttpClientTransport, StreamableHttpService};
    use rmcp::ServiceExt as _;
    use tower_idempotency::mcp::{CallerScope, McpClient, ToolGuard};

    /// Serve `payments` over Streamable HTTP on loopback; an agent's session with it.
    async fn session(payments: Payments) -> rmcp::service::RunningService<rmcp::RoleClient, ()> {
        let service = StreamableHttpService::new(
            move || Ok(payments.clone()),
            LocalSessionManager::default().into(),
            Default::default(),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().nest_service("/mcp", service);
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        let transport = StreamableHttpClientTransport::from_uri(format!("http://{addr}/mcp"));
        ().serve(transport).await.expect("the agent connects")
    }
    let charge = || json!({"order_id": "order_47", "amount_cents": 1999});

    // Naive: the agent's own timeout, then the call issued again.
    provider.trouble_next("charges", Trouble::SlowAnswer(Duration::from_millis(800)));
    let agent = session(Payments::new(base.to_owned(), None)).await;
    for attempt in 1..=2 {
        let mut params = CallToolRequestParams::new("charge_customer");
        params.arguments = charge().as_object().cloned();
        match tokio::time::timeout(CALL_TIMEOUT, agent.call_tool(params)).await {
            Ok(result) => {
                let answer = result
                    .ok()
                    .and_then(|r| r.content.first()?.as_text().map(|t| t.text.clone()));
                println!("  naive: attempt {attempt}: {}", answer.unwrap_or_default());
            }
            Err(_) => println!(
                "  naive: attempt {attempt}: timed out; the stream closed, the call issued again"
            ),
        }
    }
    let naive = provider.charges_for("order_47");
    println!("  naive: charges for order_47: {naive}");

    // Ours: the routes behind a ToolGuard; the agent an McpClient.
    provider.trouble_next("charges", Trouble::SlowAnswer(Duration::from_millis(800)));
    let guard = ToolGuard::builder(
        MemoryStore::new(),
        CallerScope::function(|_| Some("agent".to_owned())),
    )
    .build()
    .unwrap();
    let agent = session(Payments::new(base.to_owned(), Some(&guard))).await;
    let client = McpClient::builder(ledger().await, agent.peer().clone())
        .tool_settings(|tool| {
            tool.retry_policy(
                RetryPolicy::builder()
                    .attempt_timeout(CALL_TIMEOUT)
                    .max_elapsed(Duration::from_secs(5))
                    .build()
                    .unwrap(),
            )
        })
        .build()
        .unwrap();
    let op = OperationId::new("task-7", "charge_customer");
    let result = client
        .call(
            op,
            "charge_customer",
            charge().as_object().cloned().unwrap(),
        )
        .await
        .expect("the re-issue is answered");
    let replayed = result
        .value()
        .meta
        .as_ref()
        .and_then(|meta| meta.0.get("idempotent-replayed"))
        .is_some();
    let ours = provider.charges_for("order_47") - naive;
    println!(
        "  ours:  the re-issue carried _meta[\"idempotency-key\"]; answered {:?} (a replay: {replayed}); charges made by this stack: {ours}",
        result.value().content.first().and_then(|c| c.as_text()).map(|t| t.text.clone()).unwrap_or_default()
    );
    Row {
        scenario: "6. MCP tool call: the stream drops, re-issued",
        naive,
        ours,
        note: "the re-issue carried the operation's key; the tool server replayed the first run"
            .into(),
    }
}

fn status_of<B, E: std::fmt::Display>(result: &Result<http::Response<B>, E>) -> String {
    match result {
        Ok(response) => response.status().to_string(),
        Err(err) => format!("error ({err})"),
    }
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    #[cfg(feature = "redis")]
    if args.get(1).map(String::as_str) == Some("--orchestrator-child") {
        // The doomed orchestrator of scenario 3: send, and be killed while waiting.
        let [url, prefix, uri, body] = [&args[2], &args[3], &args[4], &args[5]];
        LEDGER
            .set(LedgerChoice::Redis {
                url: url.clone(),
                prefix: prefix.clone(),
            })
            .unwrap();
        let call: Value = serde_json::from_str(body).unwrap();
        let _ = send_as_orchestrator(ledger().await, uri.clone(), call).await;
        return;
    }
    let _ = args;
    LEDGER.set(choose_ledger()).unwrap();
    let (provider, base) = start_provider().await;
    println!("ledger: {}", LEDGER.get().unwrap());
    println!("provider listening on {base}\n");

    println!("1. charge_customer(order_42): the answer is slower than the caller's timeout");
    let one = charge_after_timeout(&provider, &base).await;
    println!("\n2. create_order: a transient 500 after the row was written");
    let two = retry_regenerated_the_request(&provider, &base).await;
    println!("\n3. create_order: the orchestrator crashes after sending, then resumes");
    let three = crash_and_resume(&provider, &base).await;
    println!("\n4. charge_customer(order_44): a provider that ignores keys; crash after sending");
    let four = crash_against_a_provider_that_ignores_keys().await;
    println!("\n5. create_order through an SDK-like tool: a timeout after the write, then the");
    println!("   orchestrator re-runs the step and the model regenerates the call");
    let five = regenerated_tool_call_over_an_sdk().await;

    #[allow(unused_mut)]
    let mut rows = vec![one, two, three, four, five];
    #[cfg(feature = "mcp")]
    {
        println!(
            "\n6. charge_customer(order_47) as an MCP tool over Streamable HTTP: the provider's"
        );
        println!(
            "   answer is slow, the agent's timeout closes the stream, the call is issued again"
        );
        rows.push(mcp_tool_call_whose_stream_drops(&provider, &base).await);
    }
    println!(
        "\n{:<52} {:>13} {:>12}",
        "scenario", "naive effects", "our effects"
    );
    println!("{}", "-".repeat(79));
    for row in &rows {
        println!("{:<52} {:>13} {:>12}", row.scenario, row.naive, row.ours);
    }
    println!();
    for row in &rows {
        println!("{}: {}", row.scenario, row.note);
    }
    println!(
        "\n7. The operator's part: charge_customer(order_46) to a provider that ignores keys,"
    );
    println!("   whose lookup is down, fails with a 503; the operation stays in doubt");
    let operator_charges = an_operator_resolves_an_operation_in_doubt().await;

    let held = rows.iter().all(|r| r.naive >= 2 && r.ours == 1);
    if !held || operator_charges != 1 {
        eprintln!("\nexpected every naive count >= 2, every count of ours == 1, and one charge");
        eprintln!("after the operator's resolution");
        std::process::exit(1);
    }
}
