//! Reconciling in-doubt operations against a provider that ignores `Idempotency-Key`: the
//! reconciler under every fault of the testing kit, effects counted by the provider.
//!
//! Each test first leaves one operation in doubt the way it happens in production (the
//! charge lands, the answer never arrives, the orchestrator gives up), then resumes it with
//! a reconciler whose lookup suffers the fault under test. In-process on a paused clock;
//! the last tests go over real loopback HTTP.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use tokio::net::TcpListener;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::idempotency::{
    record_or_not_found, Decision, InDoubtOperation, LookupReconciler, Reconcile, Reconciled,
};
use tower_idempotency::ledger::{IdempotencyStore, LedgerKey, MemoryStore, RecordState};
use tower_idempotency::testing::{Fault, SideEffectService, LOOKUP_PATH};
use tower_idempotency::ProviderKeys;
use tower_idempotency::{BoxError, IdempotencyLayer, KeyHeader, OperationId, ResponseSource};

const BODY: &[u8] = br#"{"order_id":"order-42","amount_cents":1999}"#;
const CHARGES: &str = "http://payments.local/charges";

fn op() -> OperationId {
    OperationId::new("task-42", "charge-card")
}

fn charge() -> Request<Full<Bytes>> {
    let mut req = Request::post(CHARGES)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(BODY)))
        .unwrap();
    req.extensions_mut().insert(op());
    req
}

/// A provider that ignores keys, as the naive payment APIs do.
fn naive_provider() -> SideEffectService {
    SideEffectService::builder().honour_keys(false).build()
}

fn by_key(provider: &SideEffectService) -> LookupReconciler<SideEffectService> {
    // The kit's lookup answers the effect itself, or 404.
    LookupReconciler::by_key(
        provider.clone(),
        LOOKUP_PATH,
        "idempotency_key",
        record_or_not_found,
    )
    .applied_status(StatusCode::CREATED)
}

/// The orchestrator's first run: `fault` hits the charge, and the orchestrator gives up
/// after 5 s (its process "crashes": the future is dropped).
async fn first_run(ledger: &MemoryStore, provider: &SideEffectService, fault: Fault) {
    provider.push_fault(fault);
    let stack = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(ledger.clone())
                .provider_deduplicates(false)
                .build()
                .unwrap(),
        )
        .service(provider.clone());
    let _ = tokio::time::timeout(Duration::from_secs(5), stack.oneshot(charge())).await;
}

/// The resumed run, with `reconciler`.
async fn resume(
    ledger: &MemoryStore,
    provider: &SideEffectService,
    reconciler: impl Reconcile,
) -> Result<http::Response<Bytes>, tower_idempotency::Error> {
    let stack = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(ledger.clone())
                .provider_deduplicates(false)
                .reconcile(reconciler)
                .reconcile_timeout(Duration::from_secs(2))
                .build()
                .unwrap(),
        )
        .service(provider.clone());
    let response = stack.oneshot(charge()).await?;
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Ok(http::Response::from_parts(parts, body))
}

fn ledger_key() -> LedgerKey {
    LedgerKey::for_operation(op().key(""))
}

async fn state(ledger: &MemoryStore) -> RecordState {
    ledger.inspect(ledger_key()).await.unwrap().unwrap().state
}

fn effects(provider: &SideEffectService) -> usize {
    provider.effects_for_operation(&op(), "")
}

/// The charges the provider received (lookups are not among them).
fn charges_sent(provider: &SideEffectService) -> usize {
    provider.attempts().len()
}

/// A lookup that suffers `fault` leaves the operation in doubt: the caller gets the in-doubt
/// error, nothing is sent again, and a later run with a working lookup resolves it.
async fn unknown_when_the_lookup_suffers(fault: Fault) {
    let (ledger, provider) = (MemoryStore::new(), naive_provider());
    first_run(&ledger, &provider, Fault::CommitThenTimeout).await;

    provider.push_fault(fault.clone());
    let err = resume(&ledger, &provider, by_key(&provider))
        .await
        .unwrap_err();
    assert!(err.is_unreconciled(), "{fault:?}: {err}");
    // The error says the reconciler was asked, and a failure of its own is the source.
    assert!(
        err.to_string().contains("the reconciler"),
        "{fault:?}: {err}"
    );
    assert_eq!(
        std::error::Error::source(&err).is_some(),
        err.to_string().contains("failed"),
        "{fault:?}: {err}"
    );
    assert_eq!(effects(&provider), 1, "{fault:?}: nothing was sent again");
    assert_eq!(charges_sent(&provider), 1, "{fault:?}");
    assert_eq!(state(&ledger).await, RecordState::InDoubt, "{fault:?}");

    let response = resume(&ledger, &provider, by_key(&provider)).await.unwrap();
    assert_eq!(ResponseSource::of(&response), ResponseSource::Reconciled);
    assert_eq!(effects(&provider), 1);
}

#[tokio::test(start_paused = true)]
async fn applied_the_provider_response_is_recorded_and_returned() {
    let (ledger, provider) = (MemoryStore::new(), naive_provider());
    first_run(&ledger, &provider, Fault::CommitThenTimeout).await;
    assert_eq!(effects(&provider), 1);
    assert_eq!(state(&ledger).await, RecordState::InDoubt);

    let response = resume(&ledger, &provider, by_key(&provider)).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(ResponseSource::of(&response), ResponseSource::Reconciled);
    // The real response: the first (and only) commit's.
    assert!(response.body().starts_with(b"{\"effect_id\":\"eff_1\""));
    assert_eq!(effects(&provider), 1);
    assert_eq!(charges_sent(&provider), 1, "nothing sent again");
    assert_eq!(provider.lookups(), 1);
    assert!(matches!(
        state(&ledger).await,
        RecordState::Completed {
            status: StatusCode::CREATED
        }
    ));

    // Recorded: the next run replays it without asking anyone.
    let replay = resume(&ledger, &provider, by_key(&provider)).await.unwrap();
    assert_eq!(ResponseSource::of(&replay), ResponseSource::Replayed);
    assert_eq!(replay.body(), response.body());
    assert_eq!(provider.lookups(), 1);
}

#[tokio::test(start_paused = true)]
async fn the_outcome_hook_names_the_reconciliation() {
    let (ledger, provider) = (MemoryStore::new(), naive_provider());
    first_run(&ledger, &provider, Fault::CommitThenTimeout).await;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let hook = seen.clone();
    let stack = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(ledger.clone())
                .provider_deduplicates(false)
                .reconcile(by_key(&provider))
                .on_outcome(move |event| {
                    hook.lock()
                        .unwrap()
                        .push((event.decision(), event.status()));
                })
                .build()
                .unwrap(),
        )
        .service(provider.clone());
    stack.oneshot(charge()).await.unwrap();
    assert_eq!(
        *seen.lock().unwrap(),
        [(Decision::Reconciled, Some(StatusCode::CREATED))]
    );
}

#[tokio::test(start_paused = true)]
async fn not_applied_the_frozen_bytes_are_sent_once() {
    let (ledger, provider) = (MemoryStore::new(), naive_provider());
    // A 503 without the write: in doubt to the client, which cannot tell.
    first_run(
        &ledger,
        &provider,
        Fault::ServerError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            commit: false,
        },
    )
    .await;
    assert_eq!(effects(&provider), 0);
    assert_eq!(state(&ledger).await, RecordState::InDoubt);

    let response = resume(&ledger, &provider, by_key(&provider)).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(ResponseSource::of(&response), ResponseSource::Resent);
    assert_eq!(effects(&provider), 1);
    let attempts = provider.attempts();
    assert_eq!(attempts.len(), 2);
    assert_eq!(attempts[0].body(), attempts[1].body(), "the frozen bytes");
}

#[tokio::test(start_paused = true)]
async fn unknown_when_the_lookup_answers_an_error() {
    unknown_when_the_lookup_suffers(Fault::ServerError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        commit: false,
    })
    .await;
}

#[tokio::test(start_paused = true)]
async fn unknown_when_the_reconciler_times_out() {
    // The lookup never answers (the kit's hang) and then merely answers late.
    unknown_when_the_lookup_suffers(Fault::CommitThenTimeout).await;
    unknown_when_the_lookup_suffers(Fault::Latency(Duration::from_secs(60))).await;
}

#[tokio::test(start_paused = true)]
async fn unknown_when_the_reconciler_fails() {
    unknown_when_the_lookup_suffers(Fault::RefuseBeforeSend).await;

    // Its failure reaches the caller as the error's source, not only a log line.
    let (ledger, provider) = (MemoryStore::new(), naive_provider());
    first_run(&ledger, &provider, Fault::CommitThenTimeout).await;
    let failing = |_: InDoubtOperation| async {
        Err::<Reconciled, BoxError>("the provider's search is down".into())
    };
    let err = resume(&ledger, &provider, failing).await.unwrap_err();
    assert!(err.is_unreconciled(), "{err}");
    assert!(err.to_string().contains("the reconciler failed"), "{err}");
    let source = std::error::Error::source(&err).expect("the reconciler's failure");
    assert_eq!(source.to_string(), "the provider's search is down");
}

#[tokio::test(start_paused = true)]
async fn unknown_when_the_reconciler_panics() {
    // The kit's provider panics inside the lookup…
    unknown_when_the_lookup_suffers(Fault::Panic {
        after_commit: false,
    })
    .await;
    // …and a reconciler panics before returning a future at all.
    let (ledger, provider) = (MemoryStore::new(), naive_provider());
    first_run(&ledger, &provider, Fault::CommitThenTimeout).await;
    let panicking = |_: InDoubtOperation| -> std::future::Ready<Result<Reconciled, BoxError>> {
        panic!("a reconciler bug")
    };
    let err = resume(&ledger, &provider, panicking).await.unwrap_err();
    assert!(err.is_unreconciled());
    assert_eq!(effects(&provider), 1);
    assert_eq!(state(&ledger).await, RecordState::InDoubt);
}

#[tokio::test(start_paused = true)]
async fn unknown_from_the_reconciler_stays_in_doubt() {
    let (ledger, provider) = (MemoryStore::new(), naive_provider());
    first_run(&ledger, &provider, Fault::CommitThenTimeout).await;
    let asked = Arc::new(Mutex::new(Vec::new()));
    let seen = asked.clone();
    let unsure = move |op: InDoubtOperation| {
        seen.lock().unwrap().push(op);
        async { Ok::<_, BoxError>(Reconciled::Unknown) }
    };
    let err = resume(&ledger, &provider, unsure).await.unwrap_err();
    assert!(err.is_unreconciled());
    assert!(err.to_string().contains("cannot tell"), "{err}");
    assert!(std::error::Error::source(&err).is_none(), "{err}");
    assert_eq!(effects(&provider), 1);
    assert_eq!(charges_sent(&provider), 1);

    // What it was asked: the frozen request, the key on the wire, the attempts made.
    let asked = asked.lock().unwrap();
    let [question] = &asked[..] else {
        panic!("asked once")
    };
    assert_eq!(question.frozen().body().as_ref(), BODY);
    assert_eq!(question.key(), op().key("").to_hex());
    assert_eq!(
        question.attempts(),
        Some(2),
        "the first claim and this take-over"
    );
    assert_eq!(
        question.payload_field("order_id").as_deref(),
        Some("order-42")
    );
}

#[tokio::test(start_paused = true)]
async fn two_resumes_reconcile_once_and_the_second_replays() {
    let (ledger, provider) = (MemoryStore::new(), naive_provider());
    first_run(&ledger, &provider, Fault::CommitThenTimeout).await;
    // The lookup is slow, so the second resume arrives while the first reconciles.
    provider.push_fault(Fault::Latency(Duration::from_millis(500)));
    let asked = Arc::new(AtomicUsize::new(0));
    let reconciler = {
        let (asked, lookup) = (asked.clone(), by_key(&provider));
        Arc::new(move |op: InDoubtOperation| {
            asked.fetch_add(1, Ordering::SeqCst);
            lookup.reconcile(op)
        })
    };
    let (a, b) = tokio::join!(
        resume(&ledger, &provider, {
            let r = reconciler.clone();
            move |op| r(op)
        }),
        resume(&ledger, &provider, {
            let r = reconciler.clone();
            move |op| r(op)
        }),
    );
    let mut sources: Vec<_> = [a.unwrap(), b.unwrap()]
        .iter()
        .map(ResponseSource::of)
        .collect();
    sources.sort_by_key(|s| format!("{s:?}"));
    assert_eq!(
        sources,
        [ResponseSource::Reconciled, ResponseSource::Replayed]
    );
    assert_eq!(asked.load(Ordering::SeqCst), 1, "one owner reconciles");
    assert_eq!(effects(&provider), 1);
}

#[tokio::test(start_paused = true)]
async fn a_deduplicating_provider_is_reconciled_only_when_asked_to() {
    // A provider that honours keys: by default the in-doubt charge is resent (and
    // deduplicated by the provider); with `reconcile_when_deduplicating` it is looked up.
    for reconcile_first in [false, true] {
        let (ledger, provider) = (MemoryStore::new(), SideEffectService::new());
        provider.push_fault(Fault::CommitThenTimeout);
        let first = ServiceBuilder::new()
            .layer(IdempotencyLayer::client(
                ledger.clone(),
                ProviderKeys::Deduplicates,
                KeyHeader::ietf(),
            ))
            .service(provider.clone());
        let _ = tokio::time::timeout(Duration::from_secs(5), first.oneshot(charge())).await;

        let stack = ServiceBuilder::new()
            .layer(
                IdempotencyLayer::client_builder(ledger.clone())
                    .provider_deduplicates(true)
                    .key_header(KeyHeader::ietf())
                    .reconcile(by_key(&provider))
                    .reconcile_when_deduplicating(reconcile_first)
                    .build()
                    .unwrap(),
            )
            .service(provider.clone());
        let response = stack.oneshot(charge()).await.unwrap();
        let expected = if reconcile_first {
            ResponseSource::Reconciled
        } else {
            ResponseSource::Resent
        };
        assert_eq!(response.extensions().get(), Some(&expected));
        assert_eq!(provider.lookups(), usize::from(reconcile_first));
        assert_eq!(charges_sent(&provider), 2 - usize::from(reconcile_first));
        assert_eq!(effects(&provider), 1);
    }
}

#[tokio::test(start_paused = true)]
async fn a_reference_in_the_payload_finds_the_operation_too() {
    // The provider files the charge under the order id the payload carries.
    let (ledger, provider) = (MemoryStore::new(), naive_provider());
    let by_order = SideEffectService::builder().honour_keys(false).build();
    first_run(&ledger, &provider, Fault::CommitThenTimeout).await;
    let filed = Request::post("http://payments.local/charges")
        .header("idempotency-key", "order-42")
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap();
    by_order.clone().oneshot(filed).await.unwrap();

    let lookup = LookupReconciler::by_payload_field(
        by_order.clone(),
        LOOKUP_PATH,
        "idempotency_key",
        "order_id",
        record_or_not_found,
    );
    let response = resume(&ledger, &provider, lookup).await.unwrap();
    assert_eq!(ResponseSource::of(&response), ResponseSource::Reconciled);
    assert_eq!(by_order.lookups(), 1);
    assert_eq!(effects(&provider), 1);
}

fn hyper_client() -> HyperClient<HttpConnector, Full<Bytes>> {
    HyperClient::builder(TokioExecutor::new()).build_http()
}

#[tokio::test]
async fn over_loopback_a_crash_after_sending_resolves_to_the_real_response() {
    let provider = naive_provider();
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = provider.clone().serve(listener).await.unwrap();
    let ledger = MemoryStore::new();
    let request = || {
        let mut req = Request::post(server.uri("/charges"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(BODY)))
            .unwrap();
        req.extensions_mut().insert(op());
        req
    };

    // Sent, committed, never answered: the orchestrator gives up.
    provider.push_fault(Fault::CommitThenTimeout);
    let first = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(ledger.clone())
                .provider_deduplicates(false)
                .build()
                .unwrap(),
        )
        .service(hyper_client());
    let gave_up = tokio::time::timeout(Duration::from_millis(300), first.oneshot(request())).await;
    assert!(gave_up.is_err());

    // Resumed: looked up over HTTP, the real response recorded and returned.
    let resumed = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(ledger.clone())
                .provider_deduplicates(false)
                .reconcile(
                    LookupReconciler::by_key(
                        hyper_client(),
                        LOOKUP_PATH,
                        "idempotency_key",
                        record_or_not_found,
                    )
                    .applied_status(StatusCode::CREATED),
                )
                .build()
                .unwrap(),
        )
        .service(hyper_client());
    let response = resumed.oneshot(request()).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(ResponseSource::of(&response), ResponseSource::Reconciled);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    assert!(body.starts_with(b"{\"effect_id\":\"eff_1\""));
    assert_eq!(effects(&provider), 1);
    assert_eq!(provider.lookups(), 1);

    // A lookup the provider cannot answer (the connection drops) leaves a fresh in-doubt
    // operation in doubt over HTTP too.
    let op2 = OperationId::new("task-43", "charge-card");
    let with_op2 = || {
        let mut req = request();
        req.extensions_mut().insert(op2.clone());
        req
    };
    provider.push_fault(Fault::CommitThenTimeout);
    let first = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(ledger.clone())
                .provider_deduplicates(false)
                .build()
                .unwrap(),
        )
        .service(hyper_client());
    let _ = tokio::time::timeout(Duration::from_millis(300), first.oneshot(with_op2())).await;
    provider.push_fault(Fault::Panic {
        after_commit: false,
    });
    let resumed = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(ledger.clone())
                .provider_deduplicates(false)
                .reconcile(LookupReconciler::by_key(
                    hyper_client(),
                    LOOKUP_PATH,
                    "idempotency_key",
                    record_or_not_found,
                ))
                .build()
                .unwrap(),
        )
        .service(hyper_client());
    let err = resumed.oneshot(with_op2()).await.unwrap_err();
    assert!(err.is_unreconciled());
    assert_eq!(provider.effects_for_operation(&op2, ""), 1);
}

/// A reconciler that read the provider over hyper hands back a response sliced out of the
/// transport's read buffer, as the client layer's own responses are. The outcome it
/// records owns exact-size copies: a record must never keep that buffer alive for its
/// retention, unseen by the store's budget.
#[tokio::test(start_paused = true)]
async fn a_reconciled_outcome_keeps_no_transport_buffer_alive() {
    let (ledger, provider) = (MemoryStore::new(), naive_provider());
    first_run(&ledger, &provider, Fault::CommitThenTimeout).await;
    let read_buffer = Bytes::from(vec![b'a'; 8192]);
    let start = read_buffer.as_ptr() as usize;
    let range = start..start + read_buffer.len();
    let found = {
        let read_buffer = read_buffer.clone();
        move |_: InDoubtOperation| {
            let mut response = http::Response::new(read_buffer.slice(16..64));
            *response.status_mut() = StatusCode::CREATED;
            let value = http::HeaderValue::from_maybe_shared(read_buffer.slice(0..16)).unwrap();
            response.headers_mut().insert("x-charge-id", value);
            std::future::ready(Ok::<_, BoxError>(Reconciled::Applied(response)))
        }
    };
    let reconciled = resume(&ledger, &provider, found).await.unwrap();
    assert_eq!(ResponseSource::of(&reconciled), ResponseSource::Reconciled);

    let replay = resume(&ledger, &provider, by_key(&provider)).await.unwrap();
    assert_eq!(ResponseSource::of(&replay), ResponseSource::Replayed);
    let value = replay.headers()["x-charge-id"].as_bytes();
    assert_eq!(value, &[b'a'; 16][..]);
    assert!(
        !range.contains(&(value.as_ptr() as usize)),
        "the header pins the read buffer"
    );
    assert_eq!(replay.body().len(), 48);
    assert!(
        !range.contains(&(replay.body().as_ptr() as usize)),
        "the body pins the read buffer"
    );
    assert_eq!(effects(&provider), 1);
}

/// A provider's search endpoint, as many payment APIs have one: `GET /charges/search?
/// idempotency_key=<key as stored>` answers `200 {"data":[…]}`, an empty list when nothing
/// matches. Made of the testing kit's lookup, which keeps keys as sent.
fn search_endpoint(
    provider: &SideEffectService,
) -> tower::util::BoxCloneSyncService<Request<Full<Bytes>>, http::Response<Full<Bytes>>, BoxError> {
    let provider = provider.clone();
    tower::util::BoxCloneSyncService::new(tower::service_fn(move |req: Request<Full<Bytes>>| {
        let provider = provider.clone();
        async move {
            let query = req.uri().query().unwrap_or_default().to_owned();
            let lookup = Request::get(format!("http://payments.local{LOOKUP_PATH}?{query}"))
                .body(Full::new(Bytes::new()))?;
            let found = provider.oneshot(lookup).await?;
            let data = match found.status() {
                StatusCode::OK => {
                    let body = found.into_body().collect().await?.to_bytes();
                    format!("[{}]", String::from_utf8(body.to_vec())?)
                }
                _ => "[]".to_owned(),
            };
            let body = Full::new(Bytes::from(format!("{{\"data\":{data}}}")));
            Ok::<_, BoxError>(http::Response::new(body))
        }
    }))
}

/// How the search's answer reads: an empty list is "never happened", one charge is the
/// charge (recorded as its `201`), anything else cannot be told.
fn search_result(response: http::Response<Bytes>) -> Reconciled {
    if !response.status().is_success() {
        return Reconciled::Unknown;
    }
    let found: Option<serde_json::Value> = serde_json::from_slice(response.body()).ok();
    match found
        .as_ref()
        .and_then(|found| found["data"].as_array())
        .map(Vec::as_slice)
    {
        Some([]) => Reconciled::NotApplied,
        Some([charge]) => Reconciled::Applied(
            http::Response::builder()
                .status(StatusCode::CREATED)
                .header("content-type", "application/json")
                .body(Bytes::from(charge.to_string()))
                .unwrap(),
        ),
        _ => Reconciled::Unknown,
    }
}

/// The first run of `op` against `provider` on `ledger`: `fault` hits the charge, and the
/// orchestrator gives up after 300 ms.
async fn first_run_on(
    ledger: impl IdempotencyStore,
    provider: &SideEffectService,
    fault: Fault,
    op: &OperationId,
) {
    provider.push_fault(fault);
    let stack = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(ledger)
                .provider_deduplicates(false)
                .lease(Duration::from_secs(1))
                .build()
                .unwrap(),
        )
        .service(provider.clone());
    let mut req = charge();
    req.extensions_mut().insert(op.clone());
    let _ = tokio::time::timeout(Duration::from_millis(300), stack.oneshot(req)).await;
}

/// The resumed run of `op`, with `reconciler`, then a replay by a third run.
async fn resume_on(
    ledger: impl IdempotencyStore + Clone,
    provider: &SideEffectService,
    reconciler: impl Reconcile + Clone,
    op: &OperationId,
) -> [(StatusCode, ResponseSource, Bytes); 2] {
    let mut answers = Vec::new();
    for _ in 0..2 {
        let stack = ServiceBuilder::new()
            .layer(
                IdempotencyLayer::client_builder(ledger.clone())
                    .provider_deduplicates(false)
                    .lease(Duration::from_secs(1))
                    .busy_policy(tower_idempotency::BusyPolicy::Wait(Duration::from_secs(5)))
                    .reconcile(reconciler.clone())
                    .build()
                    .unwrap(),
            )
            .service(provider.clone());
        let mut req = charge();
        req.extensions_mut().insert(op.clone());
        let response = stack.oneshot(req).await.unwrap();
        let (status, source) = (response.status(), ResponseSource::of(&response));
        let body = response.into_body().collect().await.unwrap().to_bytes();
        answers.push((status, source, body));
    }
    answers.try_into().unwrap()
}

/// A charge that never happened, left in doubt, and a search that finds nothing: the
/// charge is made once, and its own `201` is what is recorded and replayed, never the
/// search's empty list.
async fn an_empty_search_is_not_a_charge(ledger: impl IdempotencyStore + Clone) {
    let provider = naive_provider();
    let op = OperationId::new("task-77", "charge-card");
    let unavailable = Fault::ServerError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        commit: false,
    };
    first_run_on(ledger.clone(), &provider, unavailable, &op).await;
    assert_eq!(provider.effects(), 0);

    let search = LookupReconciler::by_key(
        search_endpoint(&provider),
        "/charges/search",
        "idempotency_key",
        search_result,
    );
    let [resumed, replayed] = resume_on(ledger, &provider, search, &op).await;
    assert_eq!(
        provider.effects_for_operation(&op, ""),
        1,
        "charged exactly once"
    );
    assert_eq!(resumed.0, StatusCode::CREATED);
    assert_eq!(resumed.1, ResponseSource::Resent);
    assert!(resumed.2.starts_with(b"{\"effect_id\":\"eff_1\""));
    assert_eq!(replayed.0, StatusCode::CREATED, "the charge's own answer");
    assert_eq!(replayed.1, ResponseSource::Replayed);
    assert_eq!(replayed.2, resumed.2);
}

/// A charge that happened, its answer lost, and a provider that stores the key as sent:
/// the lookup by key finds it (the quoted sf-string the header carried), and nothing is
/// sent again.
async fn a_charge_stored_under_the_quoted_key_is_found(ledger: impl IdempotencyStore + Clone) {
    let provider = naive_provider();
    let op = OperationId::new("task-78", "charge-card");
    first_run_on(ledger.clone(), &provider, Fault::CommitThenTimeout, &op).await;
    assert_eq!(provider.effects(), 1);

    let [resumed, replayed] = resume_on(ledger, &provider, by_key(&provider), &op).await;
    assert_eq!(
        provider.effects_for_operation(&op, ""),
        1,
        "charged exactly once"
    );
    assert_eq!(provider.attempts().len(), 1, "nothing sent again");
    assert_eq!(resumed.1, ResponseSource::Reconciled);
    assert_eq!(resumed.0, StatusCode::CREATED);
    assert_eq!(replayed.1, ResponseSource::Replayed);
    assert_eq!(replayed.2, resumed.2);
}

#[tokio::test]
async fn an_empty_search_is_not_a_charge_on_memory() {
    an_empty_search_is_not_a_charge(MemoryStore::new()).await;
}

#[tokio::test]
async fn a_charge_stored_under_the_quoted_key_is_found_on_memory() {
    a_charge_stored_under_the_quoted_key_is_found(MemoryStore::new()).await;
}

#[cfg(feature = "redis")]
#[test]
fn an_empty_search_is_not_a_charge_on_redis() {
    crate::support::redis::on_redis("reconcile-search", |store| {
        an_empty_search_is_not_a_charge(store)
    });
}

#[cfg(feature = "redis")]
#[test]
fn a_charge_stored_under_the_quoted_key_is_found_on_redis() {
    crate::support::redis::on_redis("reconcile-quoted", |store| {
        a_charge_stored_under_the_quoted_key_is_found(store)
    });
}

/// A fresh schema on a PostgreSQL server of the test's own; `None`: skipped.
#[cfg(feature = "postgres")]
async fn on_postgres() -> Option<(
    crate::support::postgres::PostgresHandle,
    Arc<dyn IdempotencyStore>,
)> {
    let pg = crate::support::postgres::postgres_url().await?;
    let store = tower_idempotency::ledger::PostgresStore::builder(pg.url())
        .schema(crate::support::postgres::fresh_schema())
        .connect()
        .await
        .expect("connect to PostgreSQL");
    store.migrate().await.expect("migrate");
    Some((pg, Arc::new(store)))
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn an_empty_search_is_not_a_charge_on_postgres() {
    let Some((_pg, store)) = on_postgres().await else {
        return;
    };
    an_empty_search_is_not_a_charge(store).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn a_charge_stored_under_the_quoted_key_is_found_on_postgres() {
    let Some((_pg, store)) = on_postgres().await else {
        return;
    };
    a_charge_stored_under_the_quoted_key_is_found(store).await;
}

/// The reading for an endpoint that answers the operation's own record, pointed by mistake
/// at a search that found nothing (`200 {"data":[]}`): the operation is never recorded as
/// done with the search's empty list for its answer; it stays in doubt and the caller is
/// told so, with nothing charged.
#[tokio::test]
async fn the_record_reading_never_takes_an_empty_search_for_a_charge() {
    let ledger = MemoryStore::new();
    let provider = naive_provider();
    let op = OperationId::new("task-79", "charge-card");
    let unavailable = Fault::ServerError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        commit: false,
    };
    first_run_on(ledger.clone(), &provider, unavailable, &op).await;
    assert_eq!(provider.effects(), 0);

    let search = LookupReconciler::by_key(
        search_endpoint(&provider),
        "/charges/search",
        "idempotency_key",
        record_or_not_found,
    );
    for run in 0..2 {
        let stack = ServiceBuilder::new()
            .layer(
                IdempotencyLayer::client_builder(ledger.clone())
                    .provider_deduplicates(false)
                    .reconcile(search.clone())
                    .build()
                    .unwrap(),
            )
            .service(provider.clone());
        let mut req = charge();
        req.extensions_mut().insert(op.clone());
        let err = stack
            .oneshot(req)
            .await
            .expect_err("an empty search settles nothing");
        assert!(err.is_in_doubt(), "run {run}: {err:?}");
    }
    assert_eq!(provider.effects(), 0, "nothing charged, nothing sent blind");
    assert!(provider.lookups() >= 2, "each run asked the search");
}
