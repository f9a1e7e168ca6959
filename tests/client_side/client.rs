//! The client `IdempotencyLayer`, over the public API.
#![cfg(feature = "test-util")]

use crate::support::down;

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{service_fn, ServiceBuilder, ServiceExt};
use tower_idempotency::client::ClientFace;
use tower_idempotency::idempotency::Idempotency;
use tower_idempotency::ledger::{
    Begin, BeginRequest, IdempotencyStore, LedgerKey, MemoryStore, Outcome,
};
use tower_idempotency::phase::FailurePhase;
use tower_idempotency::retry::{FrozenRetry, RetryPolicy};
use tower_idempotency::testing::{Fault, SideEffectService};
use tower_idempotency::ProviderKeys;

use down::DownStore;
use tower_idempotency::fingerprint::PayloadFields;
use tower_idempotency::{
    BusyPolicy, DriftPolicy, EffectClass, FrozenRequest, FrozenRetryLayer, IdempotencyLayer,
    KeyHeader, OperationId, PayloadDiscarded, ResponseSource,
};

const ORIGINAL: &str = r#"{"order_id":"ord_8f21c3","summary":"Restock: 200 units of SKU-4471, expedited freight","total_cents":184200,"fulfillment_intent_id":"fi_9a7e21"}"#;
const REGENERATED: &str = r#"{"order_id":"ord_8f21c3","summary":"Restock order for 200 units of SKU-4471 - expediting after prior submission failed to confirm","total_cents":184200,"fulfillment_intent_id":"fi_c02b6f"}"#;

fn op() -> OperationId {
    OperationId::new("task-9", "create-order")
}

fn source<B>(response: &Response<B>) -> ResponseSource {
    ResponseSource::of(response)
}

fn key_hex() -> String {
    op().key("").to_hex()
}

fn post(body: &'static str) -> Request<Full<Bytes>> {
    let mut req = Request::post("http://orders.local/orders")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap();
    req.extensions_mut().insert(op());
    req
}

type Stack = Idempotency<FrozenRetry<SideEffectService>, ClientFace>;

fn stack_with(layer: IdempotencyLayer<ClientFace>, provider: &SideEffectService) -> Stack {
    let policy = RetryPolicy::builder()
        .attempt_timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    ServiceBuilder::new()
        .layer(layer)
        .layer(FrozenRetryLayer::new(policy))
        .service(provider.clone())
}

fn stack(store: &Arc<MemoryStore>, provider: &SideEffectService) -> Stack {
    stack_with(
        IdempotencyLayer::client(store.clone(), ProviderKeys::Deduplicates, KeyHeader::ietf()),
        provider,
    )
}

async fn body_of<B: http_body::Body>(response: Response<B>) -> Bytes
where
    B::Error: std::fmt::Debug,
{
    response.into_body().collect().await.unwrap().to_bytes()
}

async fn live_records(store: &MemoryStore) -> u64 {
    store.run_pending_tasks().await;
    store.entry_count()
}

#[tokio::test(start_paused = true)]
async fn sixty_four_concurrent_callers_fire_one_effect_and_share_its_outcome() {
    let store = Arc::new(MemoryStore::new());
    let provider = SideEffectService::builder()
        .latency(Duration::from_millis(200))
        .build();
    let svc = stack(&store, &provider);
    let callers: Vec<_> = (0..64)
        .map(|_| {
            let svc = svc.clone();
            tokio::spawn(async move {
                let response = svc.oneshot(post(ORIGINAL)).await.unwrap();
                (response.status(), body_of(response).await)
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for caller in callers {
        outcomes.push(caller.await.unwrap());
    }
    assert_eq!(provider.effects(), 1);
    assert_eq!(
        provider.calls(),
        1,
        "the other 63 never reached the provider"
    );
    let (status, body) = &outcomes[0];
    assert_eq!(*status, StatusCode::CREATED);
    assert!(
        outcomes.iter().all(|o| o == &outcomes[0]),
        "every caller got the same outcome"
    );
    assert!(String::from_utf8_lossy(body).contains("eff_1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_callers_on_two_threads_fire_one_effect() {
    let store = Arc::new(MemoryStore::new());
    let provider = SideEffectService::new();
    let svc = stack(&store, &provider);
    let barrier = Arc::new(tokio::sync::Barrier::new(64));
    let callers: Vec<_> = (0..64)
        .map(|_| {
            let (svc, barrier) = (svc.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                body_of(svc.oneshot(post(ORIGINAL)).await.unwrap()).await
            })
        })
        .collect();
    let mut bodies = Vec::new();
    for caller in callers {
        bodies.push(caller.await.unwrap());
    }
    assert_eq!(provider.effects(), 1);
    assert!(bodies.iter().all(|b| b == &bodies[0]));
}

#[tokio::test]
async fn a_completed_operation_replays_without_calling_the_provider() {
    let store = Arc::new(MemoryStore::new());
    let provider = SideEffectService::new();
    let svc = stack(&store, &provider);
    let first = svc.clone().oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(ResponseSource::of(&first), ResponseSource::Sent);
    // Sent once for a new operation: no mark, so the response costs no extension.
    assert!(first.extensions().get::<ResponseSource>().is_none());
    let first_headers = first.headers().clone();
    let first_body = body_of(first).await;

    let again = svc.clone().oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(ResponseSource::of(&again), ResponseSource::Replayed);
    assert_eq!(again.status(), StatusCode::CREATED);
    assert_eq!(again.headers(), &first_headers);
    assert_eq!(body_of(again).await, first_body);
    assert_eq!(provider.calls(), 1);
    assert_eq!(provider.effects_for_key(&key_hex()), 1);
}

/// Stacked by hand and built as one (`build_stack()`, as the README builds it).
#[tokio::test]
async fn a_replay_carries_its_mark_and_none_of_the_requests_extensions() {
    let provider = SideEffectService::new();
    let by_hand = stack(&Arc::new(MemoryStore::new()), &provider);
    replay_carries_only_its_mark(by_hand, &provider).await;

    let provider = SideEffectService::new();
    let built = tower::Layer::layer(
        &IdempotencyLayer::client_builder(MemoryStore::new())
            .provider_deduplicates(true)
            .key_header(KeyHeader::ietf())
            .build_stack()
            .unwrap(),
        provider.clone(),
    );
    replay_carries_only_its_mark(built, &provider).await;
}

async fn replay_carries_only_its_mark<S, B>(svc: S, provider: &SideEffectService)
where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<B>> + Clone,
    S::Error: std::fmt::Debug,
{
    #[derive(Clone, Debug, PartialEq)]
    struct CallerNote(&'static str);

    let noted = || {
        let mut req = post(ORIGINAL);
        req.extensions_mut().insert(CallerNote("request only"));
        req
    };
    svc.clone().oneshot(noted()).await.unwrap();

    let again = svc.clone().oneshot(noted()).await.unwrap();
    assert_eq!(ResponseSource::of(&again), ResponseSource::Replayed);
    // The replay is answered in the request's (emptied) extension map: what the request
    // carried stays with the request.
    assert!(again.extensions().get::<CallerNote>().is_none());
    assert!(again.extensions().get::<OperationId>().is_none());
    assert_eq!(again.extensions().len(), 1);
    assert_eq!(provider.calls(), 1);
}

#[tokio::test]
async fn the_derived_key_travels_as_an_sf_string() {
    let provider = SideEffectService::new();
    let svc = stack(&Arc::new(MemoryStore::new()), &provider);
    svc.oneshot(post(ORIGINAL)).await.unwrap();
    let sent = &provider.attempts()[0];
    assert_eq!(
        sent.headers()["idempotency-key"],
        format!("\"{}\"", key_hex()).as_str()
    );
    assert_eq!(
        sent.headers()["content-digest"],
        tower_idempotency::digest::BodyDigest::of(ORIGINAL.as_bytes()).header_value()
    );
}

/// The derived key and the body's `Content-Digest` are added together when the request is
/// frozen; a digest the caller sent is kept as sent, beside the derived key.
#[tokio::test]
async fn a_callers_own_content_digest_is_kept_beside_the_derived_key() {
    let provider = SideEffectService::new();
    let svc = stack(&Arc::new(MemoryStore::new()), &provider);
    let mut req = post(ORIGINAL);
    req.headers_mut().insert(
        "content-digest",
        HeaderValue::from_static("sha-256=:c2VudA==:"),
    );
    svc.oneshot(req).await.unwrap();
    let sent = &provider.attempts()[0];
    assert_eq!(
        sent.headers()["idempotency-key"],
        format!("\"{}\"", key_hex()).as_str()
    );
    let digests: Vec<_> = sent.headers().get_all("content-digest").iter().collect();
    assert_eq!(digests, ["sha-256=:c2VudA==:"], "the caller's, alone");
}

#[tokio::test]
async fn a_callers_own_key_is_sent_unchanged_and_deduplicates() {
    let provider = SideEffectService::new();
    let svc = stack(&Arc::new(MemoryStore::new()), &provider);
    for _ in 0..2 {
        let req = Request::post("http://mail.local/send")
            .header("authorization", "Bearer sk_test")
            .header("idempotency-key", "welcome-mail-7")
            .body(Full::new(Bytes::from_static(b"hello")))
            .unwrap();
        svc.clone().oneshot(req).await.unwrap();
    }
    assert_eq!(provider.calls(), 1);
    assert_eq!(
        provider.attempts()[0].headers()["idempotency-key"],
        "welcome-mail-7"
    );
}

/// A caller's key is kept under its target's origin however the URI spells it: a host in
/// another case, or the scheme's default port written out, is the same server, so the
/// second request is never a new operation (a provider that ignores keys would charge
/// twice). It is the first one's, and the spelling that differs is refused as drift.
#[tokio::test]
async fn a_callers_own_key_is_one_operation_however_the_host_is_spelled() {
    for other in ["http://MAIL.local/send", "http://mail.local:80/send"] {
        let provider = SideEffectService::new();
        let svc = stack(&Arc::new(MemoryStore::new()), &provider);
        let send = |uri: &str| {
            Request::post(uri)
                .header("authorization", "Bearer sk_test")
                .header("idempotency-key", "welcome-mail-7")
                .body(Full::new(Bytes::from_static(b"hello")))
                .unwrap()
        };
        svc.clone()
            .oneshot(send("http://mail.local/send"))
            .await
            .unwrap();
        let again = svc.clone().oneshot(send(other)).await;
        if let Err(err) = &again {
            assert!(err.is_drift(), "{other}: {err}");
        }
        assert_eq!(provider.calls(), 1, "{other}: a second operation");
    }
}

/// A request may carry an `OperationId` and a key of its caller's own: the caller's key
/// wins, sent as it came (with the caller's own `Content-Digest`), and names the
/// operation; a malformed or repeated one is refused, whatever the `OperationId` says.
#[tokio::test]
async fn a_callers_own_key_wins_over_an_operation_id_and_is_checked_all_the_same() {
    let store = Arc::new(MemoryStore::new());
    let provider = SideEffectService::new();
    let svc = stack(&store, &provider);
    let with_op_and = |keys: &[&'static str]| {
        let mut req = post(ORIGINAL);
        req.headers_mut()
            .insert("authorization", HeaderValue::from_static("Bearer sk_test"));
        for key in keys {
            req.headers_mut()
                .append("idempotency-key", HeaderValue::from_static(key));
        }
        req
    };

    let mut own = with_op_and(&["welcome-mail-7"]);
    own.headers_mut().insert(
        "content-digest",
        HeaderValue::from_static("sha-256=:c2VudA==:"),
    );
    svc.clone().oneshot(own).await.unwrap();
    let sent = &provider.attempts()[0];
    let keys: Vec<_> = sent.headers().get_all("idempotency-key").iter().collect();
    assert_eq!(
        keys,
        ["welcome-mail-7"],
        "the caller's key, alone, unchanged"
    );
    assert_eq!(sent.headers()["content-digest"], "sha-256=:c2VudA==:");

    // The caller's key named the operation: the same key without the `OperationId` is
    // its replay; the `OperationId` alone is another operation.
    let mut same_key = with_op_and(&["welcome-mail-7"]);
    same_key.extensions_mut().remove::<OperationId>();
    same_key.headers_mut().insert(
        "content-digest",
        HeaderValue::from_static("sha-256=:c2VudA==:"),
    );
    let replay = svc.clone().oneshot(same_key).await.unwrap();
    assert_eq!(source(&replay), ResponseSource::Replayed);
    let derived = svc.clone().oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(source(&derived), ResponseSource::Sent);
    assert_eq!(provider.calls(), 2);

    for keys in [&["has space"][..], &["a", "b"][..]] {
        let err = svc.clone().oneshot(with_op_and(keys)).await.unwrap_err();
        assert!(err.is_invalid_key(), "{keys:?}: {err}");
    }
    assert_eq!(provider.calls(), 2, "nothing more was sent");
}

#[tokio::test]
async fn a_malformed_caller_key_fails_before_anything_is_sent() {
    let store = Arc::new(MemoryStore::new());
    let provider = SideEffectService::new();
    let svc = stack(&store, &provider);
    let req = Request::post("http://mail.local/send")
        .header("idempotency-key", "has space")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let err = svc.oneshot(req).await.unwrap_err();
    assert!(err.is_invalid_key(), "{err}");
    assert_eq!(provider.calls(), 0);
    assert_eq!(live_records(&store).await, 0);
}

#[tokio::test]
async fn a_keyless_side_effect_is_refused_unless_keys_are_made_optional() {
    let store = Arc::new(MemoryStore::new());
    let provider = SideEffectService::new();
    let keyless = || {
        Request::post("http://mail.local/send")
            .body(Full::new(Bytes::new()))
            .unwrap()
    };
    let strict = stack(&store, &provider);
    let err = strict.oneshot(keyless()).await.unwrap_err();
    assert!(err.is_missing_key(), "{err}");
    assert!(err.to_string().contains("OperationId"), "{err}");
    assert_eq!(provider.calls(), 0, "nothing was sent");

    let lenient = stack_with(
        IdempotencyLayer::client_builder(store.clone())
            .provider_deduplicates(true)
            .key_header(KeyHeader::ietf())
            .require_key(false)
            .build()
            .unwrap(),
        &provider,
    );
    lenient.oneshot(keyless()).await.unwrap();
    assert_eq!(provider.effects_without_key(), 1);
    assert_eq!(
        live_records(&store).await,
        0,
        "pass-through never touches the ledger"
    );
}

#[tokio::test]
async fn reads_pass_through_without_a_key_or_a_record() {
    let store = Arc::new(MemoryStore::new());
    let provider = SideEffectService::new();
    let svc = stack(&store, &provider);
    let mut req = Request::get("http://orders.local/orders/1")
        .body(Full::new(Bytes::new()))
        .unwrap();
    req.extensions_mut().insert(op());
    svc.clone().oneshot(req).await.unwrap();
    // A POST declared a read by its extension is treated the same.
    let mut search = post(ORIGINAL);
    search.extensions_mut().insert(EffectClass::Read);
    svc.oneshot(search).await.unwrap();
    assert_eq!(provider.calls(), 2);
    assert!(provider
        .attempts()
        .iter()
        .all(|a| !a.headers().contains_key("idempotency-key")));
    assert_eq!(live_records(&store).await, 0);
}

#[tokio::test]
async fn an_oversized_body_fails_before_anything_is_sent_or_recorded() {
    let store = Arc::new(MemoryStore::new());
    let provider = SideEffectService::new();
    let svc = stack_with(
        IdempotencyLayer::client_builder(store.clone())
            .provider_deduplicates(true)
            .key_header(KeyHeader::ietf())
            .body_limit(16)
            .build()
            .unwrap(),
        &provider,
    );
    let err = svc.oneshot(post(ORIGINAL)).await.unwrap_err();
    assert!(err.is_body_too_large(), "{err}");
    assert_eq!(provider.calls(), 0);
    assert_eq!(live_records(&store).await, 0);
}

/// Stacked by hand with the limit raised on the client layer only: the retry layer inside
/// refuses the body with its own (smaller) limit before any attempt. Nothing left, so the
/// operation is released, not left in doubt: the corrected call goes through, even for a
/// provider that would run an in-doubt operation again.
#[tokio::test]
async fn a_body_refused_by_the_retry_layer_inside_releases_the_operation() {
    let store = Arc::new(MemoryStore::new());
    let provider = SideEffectService::new();
    let layer = |store: &Arc<MemoryStore>| {
        IdempotencyLayer::client_builder(store.clone())
            .body_limit(4 << 20)
            .provider_deduplicates(false)
            .build()
            .unwrap()
    };
    let svc = ServiceBuilder::new()
        .layer(layer(&store))
        .layer(FrozenRetryLayer::new(RetryPolicy::default()))
        .service(provider.clone());
    let mut oversized = post(ORIGINAL);
    *oversized.body_mut() = Full::new(Bytes::from(vec![b' '; 2 << 20]));
    let err = svc.clone().oneshot(oversized).await.unwrap_err();
    assert!(err.is_body_too_large(), "{err}");
    assert_eq!(provider.calls(), 0);
    assert_eq!(live_records(&store).await, 0, "released, not in doubt");

    let response = svc.oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(provider.effects(), 1);
}

#[tokio::test(start_paused = true)]
async fn drift_is_rejected_naming_the_fields_that_changed() {
    let store = Arc::new(MemoryStore::new());
    // The first attempt commits and answers 500; retries are exhausted; the agent re-runs.
    let provider = SideEffectService::new().with_faults([Fault::ServerError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        commit: true,
    }]);
    let layer = IdempotencyLayer::client_builder(store.clone())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .drift_policy(DriftPolicy::Reject)
        .build()
        .unwrap();
    let one_shot = RetryPolicy::builder().max_attempts(1).build().unwrap();
    let svc = ServiceBuilder::new()
        .layer(layer)
        .layer(FrozenRetryLayer::new(one_shot))
        .service(provider.clone());
    let first = svc.clone().oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(first.status(), StatusCode::INTERNAL_SERVER_ERROR);

    let err = svc.oneshot(post(REGENERATED)).await.unwrap_err();
    assert!(err.is_drift(), "{err}");
    let drift = err.drift().unwrap();
    assert_eq!(
        drift.changed_fields().unwrap(),
        ["fulfillment_intent_id", "summary"]
    );
    assert_ne!(drift.stored(), drift.new_fingerprint());
    // The same method and target: the body is what changed, and the error says so.
    assert_eq!(
        drift.differing_parts().collect::<Vec<_>>(),
        [tower_idempotency::fingerprint::RequestPart::Body]
    );
    assert!(
        err.to_string()
            .starts_with("payload drift: fields fulfillment_intent_id, summary changed"),
        "the message leads with the changed fields: {err}"
    );
    assert_eq!(
        provider.calls(),
        1,
        "the regenerated request was never sent"
    );
    assert_eq!(provider.effects(), 1);
}

/// A completed operation's store keeps the digests of its request's fields, not the request:
/// a regenerated payload is still refused naming the fields that changed, and under
/// `ResendFrozen` the outcome first recorded is replayed.
#[tokio::test(start_paused = true)]
async fn drift_after_completion_names_the_fields_or_replays_the_outcome() {
    let store = Arc::new(MemoryStore::new());
    let provider = SideEffectService::new();
    let first = stack(&store, &provider)
        .oneshot(post(ORIGINAL))
        .await
        .unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);

    let reject = IdempotencyLayer::client_builder(store.clone())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .drift_policy(DriftPolicy::Reject)
        .build()
        .unwrap();
    let err = stack_with(reject, &provider)
        .oneshot(post(REGENERATED))
        .await
        .unwrap_err();
    let drift = err.drift().expect("a drift");
    assert_eq!(
        drift.changed_fields().unwrap(),
        ["fulfillment_intent_id", "summary"]
    );

    let resend_frozen = IdempotencyLayer::client_builder(store.clone())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .drift_policy(DriftPolicy::ResendFrozen)
        .build()
        .unwrap();
    let replayed = stack_with(resend_frozen, &provider)
        .oneshot(post(REGENERATED))
        .await
        .unwrap();
    assert_eq!(replayed.status(), StatusCode::CREATED);
    assert_eq!(source(&replayed), ResponseSource::Replayed);
    assert_eq!(provider.calls(), 1, "sent once, by the first call");
}

/// The second incident, as an orchestrator lives it: the step's call committed and answered
/// `500`, the orchestrator re-ran the step, the model regenerated the call. By default the
/// step finishes with the bytes first frozen, and the caller is told what it discarded: on
/// the response, and in the log (for a caller that reads no extension).
#[tokio::test(start_paused = true)]
async fn a_regenerated_call_under_an_operation_id_finishes_by_default_and_says_what_was_discarded()
{
    let (logs, _default) = crate::support::capture::events(tracing::Level::INFO);
    let store = Arc::new(MemoryStore::new());
    let provider = SideEffectService::new().with_faults([Fault::ServerError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        commit: true,
    }]);
    let one_shot = RetryPolicy::builder().max_attempts(1).build().unwrap();
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            store.clone(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .layer(FrozenRetryLayer::new(one_shot))
        .service(provider.clone());
    let first = svc.clone().oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(first.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert!(first.extensions().get::<PayloadDiscarded>().is_none());

    let finished = svc.clone().oneshot(post(REGENERATED)).await.unwrap();
    assert_eq!(finished.status(), StatusCode::CREATED);
    assert_eq!(source(&finished), ResponseSource::Resent);
    let discarded = finished
        .extensions()
        .get::<PayloadDiscarded>()
        .expect("the caller learns its payload was discarded");
    assert_eq!(
        discarded.changed_fields().unwrap(),
        ["fulfillment_intent_id", "summary"]
    );
    assert!(provider
        .attempts()
        .iter()
        .all(|attempt| attempt.body() == ORIGINAL.as_bytes()));

    // Completed now (its store keeps only digests of the fields): replayed, still told.
    let replayed = svc.oneshot(post(REGENERATED)).await.unwrap();
    assert_eq!(source(&replayed), ResponseSource::Replayed);
    let discarded = replayed.extensions().get::<PayloadDiscarded>().unwrap();
    assert_eq!(
        discarded.changed_fields().unwrap(),
        ["fulfillment_intent_id", "summary"]
    );
    assert_eq!(provider.effects(), 1);
    assert_eq!(provider.calls(), 2);
    let told: Vec<_> = logs
        .text()
        .lines()
        .filter(|line| line.contains("a regenerated request joined its operation"))
        .map(str::to_owned)
        .collect();
    assert_eq!(told.len(), 2, "resent and replayed: {}", logs.text());
    assert!(told
        .iter()
        .all(|line| line.contains("fulfillment_intent_id") && line.contains("WARN")));
}

/// A caller's own `Idempotency-Key` reused for another payload is the caller's mistake:
/// refused by default, as before (and as the server face's `422`).
#[tokio::test(start_paused = true)]
async fn a_callers_own_key_still_refuses_a_regenerated_payload_by_default() {
    let store = Arc::new(MemoryStore::new());
    let provider = SideEffectService::new();
    let svc = stack(&store, &provider);
    let keyed = |body: &'static str| {
        let mut req = Request::post("http://orders.local/orders")
            .header("authorization", "Bearer sk_test")
            .header("idempotency-key", "order-ord_8f21c3")
            .body(Full::new(Bytes::from_static(body.as_bytes())))
            .unwrap();
        req.extensions_mut().insert(op()); // the caller's key wins over the derived one
        req
    };
    svc.clone().oneshot(keyed(ORIGINAL)).await.unwrap();
    let err = svc.oneshot(keyed(REGENERATED)).await.unwrap_err();
    assert!(err.is_drift(), "{err}");
    assert_eq!(provider.calls(), 1);
}

/// Judged on the fields that define the order, a reworded summary and a fresh intent id are
/// the same operation even under `Reject`; a changed total is a drift.
#[tokio::test(start_paused = true)]
async fn with_defining_fields_only_a_defining_change_is_drift() {
    let defining = || PayloadFields::new(["/order_id", "/total_cents"]).unwrap();
    let changed_total = r#"{"order_id":"ord_8f21c3","summary":"Restock","total_cents":99,"fulfillment_intent_id":"fi_9a7e21"}"#;
    // In doubt (the full request is on record), then completed (only field digests are).
    for complete_first in [false, true] {
        let store = Arc::new(MemoryStore::new());
        let faults = if complete_first {
            vec![]
        } else {
            vec![Fault::ServerError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                commit: true,
            }]
        };
        let provider = SideEffectService::new().with_faults(faults);
        let one_shot = RetryPolicy::builder().max_attempts(1).build().unwrap();
        let svc = ServiceBuilder::new()
            .layer(
                IdempotencyLayer::client_builder(store.clone())
                    .provider_deduplicates(true)
                    .key_header(KeyHeader::ietf())
                    .drift_policy(DriftPolicy::Reject)
                    .defining_fields(defining())
                    .build()
                    .unwrap(),
            )
            .layer(FrozenRetryLayer::new(one_shot))
            .service(provider.clone());
        svc.clone().oneshot(post(ORIGINAL)).await.unwrap();

        let err = svc.clone().oneshot(post(changed_total)).await.unwrap_err();
        assert!(err.is_drift(), "{complete_first}: {err}");
        assert_eq!(
            err.drift().unwrap().changed_fields().unwrap(),
            ["summary", "total_cents"]
        );

        let finished = svc.oneshot(post(REGENERATED)).await.unwrap();
        assert_eq!(finished.status(), StatusCode::CREATED, "{complete_first}");
        let expected = if complete_first {
            ResponseSource::Replayed
        } else {
            ResponseSource::Resent
        };
        assert_eq!(source(&finished), expected);
        let discarded = finished.extensions().get::<PayloadDiscarded>().unwrap();
        assert_eq!(
            discarded.changed_fields().unwrap(),
            ["fulfillment_intent_id", "summary"]
        );
        assert_eq!(provider.effects(), 1, "{complete_first}");
        assert!(provider
            .attempts()
            .iter()
            .all(|attempt| attempt.body() == ORIGINAL.as_bytes()));
    }
}

/// The failure that puts an operation in doubt says so; one proven before sending does not.
#[tokio::test(start_paused = true)]
async fn the_failure_that_put_the_operation_in_doubt_is_in_doubt() {
    let store = Arc::new(MemoryStore::new());
    let provider =
        SideEffectService::new().with_faults([Fault::CommitThenTimeout, Fault::RefuseBeforeSend]);
    let one_shot = RetryPolicy::builder()
        .max_attempts(1)
        .attempt_timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            store.clone(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .layer(FrozenRetryLayer::new(one_shot))
        .service(provider.clone());
    let err = svc.clone().oneshot(post(ORIGINAL)).await.unwrap_err();
    assert!(err.is_timeout(), "{err}");
    assert!(err.is_in_doubt(), "the timeout put the operation in doubt");
    assert!(!err.is_unreconciled(), "it will be resent, not reconciled");
    assert_eq!(provider.effects(), 1);

    let mut other = post(ORIGINAL);
    other
        .extensions_mut()
        .insert(OperationId::new("task-9", "other-step"));
    let err = svc.oneshot(other).await.unwrap_err();
    assert_eq!(err.phase(), Some(FailurePhase::PreWrite), "{err}");
    assert!(!err.is_in_doubt(), "refused before sending: not in doubt");
}

#[tokio::test(start_paused = true)]
async fn drift_under_resend_frozen_sends_the_original_bytes() {
    let store = Arc::new(MemoryStore::new());
    let provider = SideEffectService::new().with_faults([Fault::ServerError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        commit: true,
    }]);
    let one_shot = RetryPolicy::builder().max_attempts(1).build().unwrap();
    let svc = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(store.clone())
                .provider_deduplicates(true)
                .key_header(KeyHeader::ietf())
                .drift_policy(DriftPolicy::ResendFrozen)
                .build()
                .unwrap(),
        )
        .layer(FrozenRetryLayer::new(one_shot))
        .service(provider.clone());
    svc.clone().oneshot(post(ORIGINAL)).await.unwrap();
    let resumed = svc.oneshot(post(REGENERATED)).await.unwrap();
    assert_eq!(resumed.status(), StatusCode::CREATED);
    assert_eq!(ResponseSource::of(&resumed), ResponseSource::Resent);
    let attempts = provider.attempts();
    assert_eq!(attempts.len(), 2);
    assert!(attempts.iter().all(|a| a.body() == ORIGINAL.as_bytes()));
    assert_eq!(provider.effects(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_crashed_client_is_resumed_with_the_frozen_bytes() {
    let store = Arc::new(MemoryStore::new());
    // The provider commits and the answer never comes back; then the orchestrator dies.
    let provider = SideEffectService::new().with_faults([Fault::CommitThenTimeout]);
    let before_crash = stack(&store, &provider);
    let in_flight = tokio::spawn(async move { before_crash.oneshot(post(ORIGINAL)).await });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(provider.effects(), 1);
    in_flight.abort(); // the whole client stack is dropped; the ledger survives
    let _ = in_flight.await;
    tokio::time::sleep(Duration::from_millis(1)).await;

    // A fresh stack; the agent re-ran and produced a different payload.
    let after_restart = stack_with(
        IdempotencyLayer::client_builder(store.clone())
            .provider_deduplicates(true)
            .key_header(KeyHeader::ietf())
            .drift_policy(DriftPolicy::ResendFrozen)
            .build()
            .unwrap(),
        &provider,
    );
    let response = after_restart.oneshot(post(REGENERATED)).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(ResponseSource::of(&response), ResponseSource::Resent);
    assert!(String::from_utf8_lossy(&body_of(response).await).contains("eff_1"));
    assert_eq!(provider.effects(), 1);
    assert!(provider
        .attempts()
        .iter()
        .all(|a| a.body() == ORIGINAL.as_bytes()));
}

/// A process that died right after `begin` (no chance to mark anything): its lease expires
/// into doubt, and the next run resends what it froze.
#[tokio::test(start_paused = true)]
async fn an_expired_lease_resumes_with_the_stored_request_and_fences_the_dead_owner() {
    let store = Arc::new(MemoryStore::new());
    let key = op().key("");
    let mut headers = http::HeaderMap::new();
    headers.insert("idempotency-key", key.header_value());
    headers.insert(
        "content-type",
        http::HeaderValue::from_static("application/json"),
    );
    let frozen = FrozenRequest::from_parts(
        http::Method::POST,
        "http://orders.local/orders".parse().unwrap(),
        http::Version::HTTP_11,
        headers,
        Bytes::from_static(ORIGINAL.as_bytes()),
    );
    let lease = Duration::from_secs(60);
    let begin = BeginRequest::new(
        LedgerKey::for_operation(key),
        frozen.fingerprint(),
        lease,
        Duration::from_secs(86_400),
    )
    .with_frozen(frozen);
    let Begin::Acquired { token: dead_owner } = store.begin(begin).await.unwrap() else {
        panic!("expected to acquire");
    };

    let provider = SideEffectService::new();
    let svc = stack_with(
        IdempotencyLayer::client_builder(store.clone())
            .provider_deduplicates(true)
            .key_header(KeyHeader::ietf())
            .busy_policy(BusyPolicy::Fail)
            .build()
            .unwrap(),
        &provider,
    );
    let err = svc.clone().oneshot(post(ORIGINAL)).await.unwrap_err();
    assert!(err.is_busy(), "{err}");
    assert!(err.retry_after().unwrap() <= lease);
    assert_eq!(provider.calls(), 0);

    tokio::time::advance(lease + Duration::from_secs(1)).await;
    let response = svc.oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(ResponseSource::of(&response), ResponseSource::Resent);
    assert_eq!(provider.effects(), 1);
    assert_eq!(provider.attempts()[0].body(), ORIGINAL.as_bytes());

    let stale = store
        .complete(
            LedgerKey::for_operation(key),
            dead_owner,
            Outcome::Tombstone {
                status: StatusCode::OK,
            },
            Duration::from_secs(60),
        )
        .await
        .unwrap_err();
    assert!(stale.is_fenced());
}

#[tokio::test(start_paused = true)]
async fn a_retryable_answer_after_the_last_retry_is_resent_later_not_replayed() {
    let store = Arc::new(MemoryStore::new());
    let unavailable = Fault::ServerError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        commit: false,
    };
    let provider = SideEffectService::new().with_faults(vec![unavailable; 3]);
    let svc = stack(&store, &provider);
    let first = svc.clone().oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(first.status(), StatusCode::SERVICE_UNAVAILABLE);
    let later = svc.oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(later.status(), StatusCode::CREATED);
    assert_eq!(ResponseSource::of(&later), ResponseSource::Resent);
    assert_eq!(provider.effects(), 1);
}

#[tokio::test]
async fn an_oversized_response_reaches_its_caller_whole_and_is_never_run_again() {
    let runs = Arc::new(AtomicUsize::new(0));
    let big: Bytes = (0..2 * 1024 * 1024)
        .map(|i| (i % 251) as u8)
        .collect::<Vec<_>>()
        .into();
    let provider = service_fn({
        let (runs, big) = (runs.clone(), big.clone());
        move |_req: Request<Full<Bytes>>| {
            runs.fetch_add(1, Ordering::SeqCst);
            let big = big.clone();
            async move { Ok::<_, Infallible>(Response::new(Full::new(big))) }
        }
    });
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .service(provider);
    let first = svc.clone().oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(
        body_of(first).await,
        big,
        "the first caller gets every byte"
    );
    let err = svc.oneshot(post(ORIGINAL)).await.unwrap_err();
    assert!(err.is_replay_unavailable(), "{err}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_ledger_outage_fails_closed_unless_opted_out() {
    let provider = SideEffectService::new();
    let closed = stack_with(
        IdempotencyLayer::client(DownStore, ProviderKeys::Deduplicates, KeyHeader::ietf()),
        &provider,
    );
    let err = closed.oneshot(post(ORIGINAL)).await.unwrap_err();
    assert!(err.is_store(), "{err}");
    assert_eq!(
        provider.calls(),
        0,
        "no side effect fires without the ledger"
    );

    let open = stack_with(
        IdempotencyLayer::client_builder(DownStore)
            .provider_deduplicates(true)
            .key_header(KeyHeader::ietf())
            .fail_open(true)
            .build()
            .unwrap(),
        &provider,
    );
    assert_eq!(
        open.oneshot(post(ORIGINAL)).await.unwrap().status(),
        StatusCode::CREATED
    );
    assert_eq!(provider.effects(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_pre_write_failure_releases_the_operation() {
    let store = Arc::new(MemoryStore::new());
    let provider = SideEffectService::new().with_faults([Fault::RefuseBeforeSend]);
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            store.clone(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .service(provider.clone());
    let err = svc.clone().oneshot(post(ORIGINAL)).await.unwrap_err();
    assert_eq!(err.phase(), Some(FailurePhase::PreWrite));
    tokio::time::sleep(Duration::from_millis(1)).await;
    // Released, not in doubt: the next run is a first send.
    let response = svc.oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(ResponseSource::of(&response), ResponseSource::Sent);
    assert_eq!(provider.effects(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_users_own_error_type_is_classified_by_their_classifier() {
    #[derive(Debug)]
    struct CircuitOpen;
    impl std::fmt::Display for CircuitOpen {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("circuit open")
        }
    }
    impl std::error::Error for CircuitOpen {}

    let calls = Arc::new(AtomicUsize::new(0));
    let breaker = service_fn({
        let calls = calls.clone();
        move |_req: Request<Full<Bytes>>| {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            async move {
                if n == 0 {
                    Err(CircuitOpen)
                } else {
                    Ok(Response::new(Full::new(Bytes::from_static(b"ok"))))
                }
            }
        }
    });
    let layer = IdempotencyLayer::client_builder(MemoryStore::new())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .classify_phase(|err: &(dyn std::error::Error + 'static)| {
            err.is::<CircuitOpen>().then_some(FailurePhase::PreWrite)
        })
        .build()
        .unwrap();
    let svc = ServiceBuilder::new().layer(layer).service(breaker);
    let err = svc.clone().oneshot(post(ORIGINAL)).await.unwrap_err();
    assert_eq!(err.phase(), Some(FailurePhase::PreWrite));
    tokio::time::sleep(Duration::from_millis(1)).await;
    let response = svc.oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(ResponseSource::of(&response), ResponseSource::Sent);
}

#[test]
fn the_builder_refuses_retention_or_protection_shorter_than_the_retry_window() {
    let short_retention = IdempotencyLayer::client_builder(MemoryStore::new())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .retry_policy(
            tower_idempotency::retry::RetryPolicy::builder()
                .max_elapsed(Duration::from_secs(30))
                .build()
                .unwrap(),
        )
        .lease(Duration::from_secs(60))
        .retention(Duration::from_secs(80))
        .build();
    assert!(short_retention
        .unwrap_err()
        .to_string()
        .contains("retention"));
    // A lease shorter than the retry window is fine: a live owner renews it.
    let _renewed = IdempotencyLayer::client_builder(MemoryStore::new())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .retry_policy(
            tower_idempotency::retry::RetryPolicy::builder()
                .max_elapsed(Duration::from_secs(30))
                .build()
                .unwrap(),
        )
        .lease(Duration::from_secs(5))
        .build()
        .expect("short leases are renewed");
    let short_protection = IdempotencyLayer::client_builder(MemoryStore::new())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .retry_policy(
            tower_idempotency::retry::RetryPolicy::builder()
                .max_elapsed(Duration::from_secs(30))
                .build()
                .unwrap(),
        )
        .lease(Duration::from_secs(5))
        .protected_window(Duration::from_secs(20))
        .build();
    assert!(short_protection
        .unwrap_err()
        .to_string()
        .contains("protected window"));
    let policy = tower_idempotency::retry::RetryPolicy::builder()
        .max_elapsed(Duration::from_secs(600))
        .build()
        .unwrap();
    let from_policy = IdempotencyLayer::client_builder(MemoryStore::new())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .retry_policy(policy.clone())
        .retention(Duration::from_secs(300))
        .build();
    assert!(
        from_policy.unwrap_err().to_string().contains("retention"),
        "the real policy's window is checked"
    );
}

/// A body that counts the frames read out of it.
struct CountedBody {
    chunks: std::collections::VecDeque<Bytes>,
    reads: Arc<AtomicUsize>,
}

impl http_body::Body for CountedBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        let next = self.chunks.pop_front();
        if next.is_some() {
            self.reads.fetch_add(1, Ordering::SeqCst);
        }
        std::task::Poll::Ready(next.map(|chunk| Ok(http_body::Frame::data(chunk))))
    }
}

#[tokio::test(start_paused = true)]
async fn the_body_is_read_once_per_operation_with_both_layers_stacked() {
    let reads = Arc::new(AtomicUsize::new(0));
    let provider = SideEffectService::new().with_faults(vec![
        Fault::ServerError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            commit: false,
        };
        2
    ]);
    let svc = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .layer(FrozenRetryLayer::new(RetryPolicy::default()))
        .service(provider.clone());
    let body = CountedBody {
        chunks: [&b"{\"order_id\":"[..], b"\"order_42\"", b"}"]
            .into_iter()
            .map(Bytes::from_static)
            .collect(),
        reads: reads.clone(),
    };
    let mut req = Request::post("http://payments.local/charges")
        .body(body)
        .unwrap();
    req.extensions_mut().insert(op());
    let response = svc.oneshot(req).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(provider.attempts().len(), 3);
    assert_eq!(
        reads.load(Ordering::SeqCst),
        3,
        "each chunk was read exactly once"
    );
    assert!(provider
        .attempts()
        .iter()
        .all(|a| a.body().as_ref() == b"{\"order_id\":\"order_42\"}"));
}
