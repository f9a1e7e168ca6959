//! Reconcile now: the operator asks the client layer's reconciler about an operation in
//! doubt, over a provider that ignores keys, and the record is settled by its answer,
//! fenced by the look; and the frozen request each record page shows, redacted.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use serde_json::{json, Value};
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::client::ClientLayer;
use tower_idempotency::console::Console;
use tower_idempotency::idempotency::{
    record_or_not_found, InDoubtOperation, LookupReconciler, Reconcile, Reconciled,
};
use tower_idempotency::ledger::{
    Begin, BeginRequest, IdempotencyStore, LedgerKey, MemoryStore, RecordKind, Records,
};
use tower_idempotency::testing::{Fault, SideEffectService, LOOKUP_PATH};
use tower_idempotency::{BoxError, IdempotencyLayer, OperationId, ResponseSource};

use super::harness::{api_record, authorizer, serve, serve_console, Served, PREFIX};

const CARD: &str = "4242424242424242";

fn op() -> OperationId {
    OperationId::new("task-42", "charge-card")
}

fn ledger_key() -> LedgerKey {
    LedgerKey::for_operation(op().key(""))
}

fn charge() -> Request<Full<Bytes>> {
    let body = format!(r#"{{"order_id":"order-42","card":{{"number":"{CARD}","exp":"12/30"}}}}"#);
    let mut req = Request::post("http://payments.local/charges")
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk_live_secret")
        .header("x-api-key", "ak_secret")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    req.extensions_mut().insert(op());
    req
}

/// A provider that ignores keys, as the naive payment APIs do.
fn naive_provider() -> SideEffectService {
    SideEffectService::builder().honour_keys(false).build()
}

/// The kit's lookup: the effect itself, or 404.
fn by_key(provider: &SideEffectService) -> LookupReconciler<SideEffectService> {
    LookupReconciler::by_key(
        provider.clone(),
        LOOKUP_PATH,
        "idempotency_key",
        record_or_not_found,
    )
    .applied_status(StatusCode::CREATED)
}

fn layer(ledger: &MemoryStore, reconciler: Option<Arc<dyn Reconcile>>) -> ClientLayer {
    let builder = IdempotencyLayer::client_builder(ledger.clone()).provider_deduplicates(false);
    match reconciler {
        Some(reconciler) => builder
            .reconcile(move |op: InDoubtOperation| reconciler.reconcile(op))
            .reconcile_timeout(Duration::from_millis(500)),
        None => builder,
    }
    .build()
    .unwrap()
}

/// The caller's run through `layer`; the caller gives up after 300 ms (its process
/// "crashes": the future is dropped), leaving the operation in doubt.
async fn run(layer: &ClientLayer, provider: &SideEffectService) -> Option<http::Response<Bytes>> {
    let stack = ServiceBuilder::new()
        .layer(layer.clone())
        .service(provider.clone());
    let response = tokio::time::timeout(Duration::from_millis(300), stack.oneshot(charge()))
        .await
        .ok()?
        .ok()?;
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Some(http::Response::from_parts(parts, body))
}

/// The first run, `fault` hitting the charge (no answer, or one that cannot tell): the
/// operation is left in doubt.
async fn first_run(ledger: &MemoryStore, provider: &SideEffectService, fault: Fault) {
    provider.push_fault(fault);
    let _ = run(&layer(ledger, None), provider).await;
    let view = ledger
        .inspect(ledger_key())
        .await
        .unwrap()
        .expect("a record");
    assert_eq!(RecordKind::of(&view.state), RecordKind::InDoubt);
}

/// A reconciler answering `answer`, counting how often it is asked.
fn counting(
    answer: fn() -> Result<Reconciled, BoxError>,
) -> (Arc<dyn Reconcile>, Arc<AtomicUsize>) {
    let asked = Arc::new(AtomicUsize::new(0));
    let counter = asked.clone();
    let reconciler = move |_: InDoubtOperation| {
        counter.fetch_add(1, Ordering::SeqCst);
        async move { answer() }
    };
    (Arc::new(reconciler), asked)
}

fn reconcile_now() -> String {
    format!("{}/reconcile-now", api_record(&ledger_key()))
}

async fn look(console: &Served) -> Value {
    console
        .get_as("alice", "act", &api_record(&ledger_key()))
        .await
        .json()["look"]
        .clone()
}

async fn ask(console: &Served, role: &str, look: &Value) -> super::harness::Answer {
    console
        .post_json(
            "alice",
            role,
            &reconcile_now(),
            &json!({"expected": look, "reason": "INC-7: the caller's run gave up"}),
        )
        .await
}

#[tokio::test]
async fn an_applied_operation_is_completed_with_the_providers_record_and_replayed() {
    let (ledger, provider) = (MemoryStore::new(), naive_provider());
    first_run(&ledger, &provider, Fault::CommitThenTimeout).await;
    let layer = layer(&ledger, Some(Arc::new(by_key(&provider))));
    let console = serve(layer.records()).await;

    let answer = ask(&console, "act", &look(&console).await).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.body);
    let answer = answer.json();
    assert_eq!(answer["result"], "resolved");
    assert_eq!(answer["reconciled"], "applied");
    assert_eq!(answer["status"], 201);
    assert_eq!(answer["current"]["state"], "completed");

    // The caller's next run replays the provider's record: nothing is charged again.
    let response = run(&layer, &provider).await.expect("an answer");
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(ResponseSource::of(&response), ResponseSource::Replayed);
    assert!(response.body().starts_with(b"{\"effect_id\":\"eff_1\""));
    assert_eq!(provider.effects(), 1);
}

#[tokio::test]
async fn an_operation_that_never_happened_is_released_and_charged_once_by_the_next_run() {
    let (ledger, provider) = (MemoryStore::new(), naive_provider());
    let unavailable = Fault::ServerError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        commit: false,
    };
    first_run(&ledger, &provider, unavailable).await;
    assert_eq!(provider.effects(), 0);
    let layer = layer(&ledger, Some(Arc::new(by_key(&provider))));
    let console = serve(layer.records()).await;

    let answer = ask(&console, "act", &look(&console).await).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.body);
    let answer = answer.json();
    assert_eq!(answer["result"], "forgotten");
    assert_eq!(answer["reconciled"], "not_applied");
    assert!(ledger.inspect(ledger_key()).await.unwrap().is_none());

    let response = run(&layer, &provider).await.expect("an answer");
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(ResponseSource::of(&response), ResponseSource::Sent);
    assert_eq!(provider.effects(), 1);
}

#[tokio::test]
async fn a_stale_look_is_409_and_the_reconciler_is_not_asked() {
    let (ledger, provider) = (MemoryStore::new(), naive_provider());
    first_run(&ledger, &provider, Fault::CommitThenTimeout).await;
    let (reconciler, asked) = counting(|| Ok(Reconciled::NotApplied));
    let console = serve(layer(&ledger, Some(reconciler)).records()).await;
    let look = look(&console).await;

    // Meanwhile another run resumed it, and failed again.
    let view = ledger.inspect(ledger_key()).await.unwrap().unwrap();
    let resume = BeginRequest::new(
        ledger_key(),
        view.fingerprint,
        Duration::from_secs(30),
        Duration::from_secs(3600),
    );
    let Begin::Resume { token, .. } = ledger.begin(resume).await.unwrap() else {
        panic!("an in-doubt record is resumed");
    };
    ledger
        .mark_in_doubt(ledger_key(), token, Duration::from_secs(3600))
        .await
        .unwrap();

    let answer = ask(&console, "act", &look).await;
    assert_eq!(answer.status, StatusCode::CONFLICT, "{}", answer.body);
    assert_eq!(answer.json()["changed"], json!(["attempts"]));
    assert_eq!(asked.load(Ordering::SeqCst), 0);
    let view = ledger.inspect(ledger_key()).await.unwrap().expect("kept");
    assert_eq!(RecordKind::of(&view.state), RecordKind::InDoubt);
}

#[tokio::test]
async fn a_read_only_operator_is_403_and_the_reconciler_is_not_asked() {
    let (ledger, provider) = (MemoryStore::new(), naive_provider());
    first_run(&ledger, &provider, Fault::CommitThenTimeout).await;
    let (reconciler, asked) = counting(|| Ok(Reconciled::NotApplied));
    let console = serve(layer(&ledger, Some(reconciler)).records()).await;

    let answer = ask(&console, "read", &look(&console).await).await;
    assert_eq!(answer.status, StatusCode::FORBIDDEN, "{}", answer.body);
    assert_eq!(asked.load(Ordering::SeqCst), 0);
    assert!(ledger.inspect(ledger_key()).await.unwrap().is_some());
}

#[tokio::test]
async fn without_a_reconciler_it_is_422() {
    let (ledger, provider) = (MemoryStore::new(), naive_provider());
    first_run(&ledger, &provider, Fault::CommitThenTimeout).await;
    for records in [layer(&ledger, None).records(), Records::new(ledger.clone())] {
        let console = serve(records).await;
        let answer = ask(&console, "act", &look(&console).await).await;
        assert_eq!(
            answer.status,
            StatusCode::UNPROCESSABLE_ENTITY,
            "{}",
            answer.body
        );
        assert_eq!(answer.json()["error"], "no_reconciler");
    }
    let view = ledger.inspect(ledger_key()).await.unwrap().expect("kept");
    assert_eq!(RecordKind::of(&view.state), RecordKind::InDoubt);
}

#[tokio::test]
async fn a_reconciler_that_cannot_tell_fails_or_runs_late_changes_nothing() {
    let (ledger, provider) = (MemoryStore::new(), naive_provider());
    first_run(&ledger, &provider, Fault::CommitThenTimeout).await;
    let (unknown, _) = counting(|| Ok(Reconciled::Unknown));
    let (failing, _) = counting(|| Err("the lookup endpoint is down".into()));
    let late: Arc<dyn Reconcile> = Arc::new(|_: InDoubtOperation| async {
        tokio::time::sleep(Duration::from_secs(5)).await;
        Ok::<_, BoxError>(Reconciled::NotApplied)
    });
    let cases = [
        (unknown, StatusCode::OK, "result", "unknown"),
        (
            failing,
            StatusCode::SERVICE_UNAVAILABLE,
            "error",
            "reconciler_failed",
        ),
        (
            late,
            StatusCode::GATEWAY_TIMEOUT,
            "error",
            "reconciler_timed_out",
        ),
    ];
    for (reconciler, status, field, result) in cases {
        let console = serve(layer(&ledger, Some(reconciler)).records()).await;
        let answer = ask(&console, "act", &look(&console).await).await;
        assert_eq!(answer.status, status, "{}", answer.body);
        assert_eq!(answer.json()[field], result);
        let view = ledger.inspect(ledger_key()).await.unwrap().expect("kept");
        assert_eq!(RecordKind::of(&view.state), RecordKind::InDoubt, "{result}");
        assert_eq!(view.attempts, 1, "{result}");
    }
    assert_eq!(provider.effects(), 1);
}

#[tokio::test]
async fn the_frozen_request_is_shown_redacted_in_the_api() {
    let (ledger, provider) = (MemoryStore::new(), naive_provider());
    first_run(&ledger, &provider, Fault::CommitThenTimeout).await;
    let console = serve_console(
        Console::new(layer(&ledger, None).records(), authorizer)
            .redact_headers(["X-Api-Key"])
            .redact_fields(["/card/number"]),
    )
    .await;

    let answer = console
        .get_as("alice", "read", &api_record(&ledger_key()))
        .await;
    assert_eq!(answer.status, StatusCode::OK);
    assert!(!answer.body.contains("sk_live_secret"), "{}", answer.body);
    assert!(!answer.body.contains("ak_secret"), "{}", answer.body);
    assert!(!answer.body.contains(CARD), "{}", answer.body);
    let request = &answer.json()["request"];
    assert_eq!(request["method"], "POST");
    assert_eq!(request["uri"], "http://payments.local/charges");
    let header = |name: &str| {
        request["headers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|pair| pair[0] == name)
            .map(|pair| pair[1].clone())
    };
    assert_eq!(header("authorization"), Some(json!("[redacted]")));
    assert_eq!(header("x-api-key"), Some(json!("[redacted]")));
    assert_eq!(header("content-type"), Some(json!("application/json")));
    let body: Value = serde_json::from_str(request["body"]["text"].as_str().unwrap()).unwrap();
    assert_eq!(body["card"]["number"], "[redacted]");
    assert_eq!(body["card"]["exp"], "12/30");
    assert_eq!(body["order_id"], "order-42");

    // A list page stays small: no request in it.
    let list = console
        .get_as("alice", "read", &format!("{PREFIX}/api/records"))
        .await
        .json();
    assert!(list["records"][0].get("request").is_none());
}

#[tokio::test]
async fn the_record_page_shows_the_request_redacted_and_the_form_only_with_a_reconciler() {
    let (ledger, provider) = (MemoryStore::new(), naive_provider());
    first_run(&ledger, &provider, Fault::CommitThenTimeout).await;
    let page = format!("{PREFIX}/records/{}", ledger_key().to_hex());
    let form = format!("{PREFIX}/records/{}/reconcile-now", ledger_key().to_hex());

    let with = serve_console(
        Console::new(
            layer(&ledger, Some(Arc::new(by_key(&provider)))).records(),
            authorizer,
        )
        .redact_fields(["/card/number"]),
    )
    .await;
    let shown = with.get_as("alice", "act", &page).await;
    assert_eq!(shown.status, StatusCode::OK);
    assert!(shown.body.contains(&form), "the form: {}", shown.body);
    assert!(shown.body.contains("[redacted]"));
    assert!(!shown.body.contains("sk_live_secret") && !shown.body.contains(CARD));
    // The body's quotes are escaped on the page.
    assert!(shown
        .body
        .contains("&quot;order_id&quot;:&quot;order-42&quot;"));

    // The form works: the reconciler finds the charge.
    let token = csrf_token(&shown.body);
    let look = look(&with).await;
    let answer = with
        .post_form(
            "alice",
            &form,
            &format!(
                "kind=in_doubt&generation={}&attempts=1&fingerprint={}&reason=INC-7&csrf={token}",
                look["generation"].as_str().unwrap(),
                look["fingerprint"].as_str().unwrap(),
            ),
        )
        .await;
    assert_eq!(answer.status, StatusCode::SEE_OTHER, "{}", answer.body);
    assert!(answer.location().ends_with("?flash=reconciled-applied"));
    assert_eq!(provider.effects(), 1);

    // Without a reconciler, no form.
    let (ledger, provider) = (MemoryStore::new(), naive_provider());
    first_run(&ledger, &provider, Fault::CommitThenTimeout).await;
    let without = serve(layer(&ledger, None).records()).await;
    let shown = without.get_as("alice", "act", &page).await;
    assert_eq!(shown.status, StatusCode::OK);
    assert!(!shown.body.contains("reconcile-now"), "{}", shown.body);
    assert!(shown.body.contains("resolve-not-applied"));
}

/// The token a page's forms carry.
fn csrf_token(page: &str) -> String {
    let at = page.find("name=\"csrf\" value=\"").expect("a form's token") + 19;
    page[at..].split('"').next().unwrap().to_owned()
}

#[tokio::test(flavor = "current_thread")]
async fn a_reconcile_now_leaves_an_audit_event_with_what_the_reconciler_found() {
    let (logs, _guard) = crate::capture::events(tracing::Level::INFO);
    let (ledger, provider) = (MemoryStore::new(), naive_provider());
    first_run(&ledger, &provider, Fault::CommitThenTimeout).await;
    let console = serve(layer(&ledger, Some(Arc::new(by_key(&provider)))).records()).await;
    logs.clear();

    let answer = ask(&console, "act", &look(&console).await).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.body);
    let text = logs.text();
    let audit: Vec<&str> = text
        .lines()
        .filter(|line| line.contains("tower_idempotency::console"))
        .collect();
    assert_eq!(audit.len(), 1, "{text}");
    for part in [
        "WARN",
        "operator=alice",
        "action=\"reconcile_now\"",
        "INC-7: the caller's run gave up",
        "receipt_status=201",
        "result=\"resolved\"",
        &ledger_key().to_hex(),
    ] {
        let loose = part.replace('"', "");
        assert!(
            audit[0].contains(part) || audit[0].contains(&loose),
            "{part} in {}",
            audit[0]
        );
    }
}
