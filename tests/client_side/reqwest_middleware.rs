//! The client face as a reqwest-middleware `Middleware` (feature `reqwest-middleware`), over
//! loopback TCP against the testing kit's provider, with and without `reqwest-retry`.
#![cfg(all(feature = "reqwest-middleware", feature = "test-util"))]

use std::time::Duration;

use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use reqwest_retry::policies::ExponentialBackoff;
use reqwest_retry::RetryTransientMiddleware;
use tokio::net::TcpListener;
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::reqwest_middleware::IdempotencyMiddleware;
use tower_idempotency::testing::{CapturedRequest, Fault, ServeHandle, SideEffectService};
use tower_idempotency::{
    DriftPolicy, Error, IdempotencyLayer, KeyHeader, OperationId, PayloadDiscarded, ResponseSource,
};

const ORDER: &str = r#"{"order_id":"order_42","amount_cents":1999}"#;
const ATTEMPT_TIMEOUT: Duration = Duration::from_millis(300);

fn op() -> OperationId {
    OperationId::new("task-7", "charge_customer")
}

async fn serve(provider: &SideEffectService) -> ServeHandle {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    provider.clone().serve(listener).await.unwrap()
}

fn middleware() -> IdempotencyMiddleware {
    IdempotencyMiddleware::new(
        IdempotencyLayer::client_builder(MemoryStore::new())
            .provider_deduplicates(true)
            .key_header(KeyHeader::ietf())
            .retry_policy(
                tower_idempotency::retry::RetryPolicy::builder()
                    .max_elapsed(Duration::from_secs(5))
                    .build()
                    .unwrap(),
            )
            .build()
            .unwrap(),
    )
}

/// As the module docs recommend: `reqwest-retry` outside, the ledger inside.
fn retrying_client(ledger: IdempotencyMiddleware) -> ClientWithMiddleware {
    let retries = ExponentialBackoff::builder()
        .retry_bounds(Duration::from_millis(5), Duration::from_millis(20))
        .build_with_max_retries(3);
    ClientBuilder::new(reqwest::Client::new())
        .with(RetryTransientMiddleware::new_with_policy(retries))
        .with(ledger)
        .build()
}

async fn charge(
    client: &ClientWithMiddleware,
    server: &ServeHandle,
    body: &'static str,
) -> reqwest_middleware::Result<reqwest::Response> {
    client
        .post(server.uri("/charges").to_string())
        .header("content-type", "application/json")
        .header("x-request-source", "orchestrator")
        .body(body)
        .timeout(ATTEMPT_TIMEOUT)
        .with_extension(op())
        .send()
        .await
}

fn source(response: &reqwest::Response) -> ResponseSource {
    ResponseSource::in_extensions(response.extensions())
}

/// Every attempt the provider saw carried the same method, target, headers and body.
fn assert_byte_identical(attempts: &[CapturedRequest]) {
    let first = &attempts[0];
    for later in &attempts[1..] {
        assert_eq!(later.method(), first.method());
        assert_eq!(later.uri(), first.uri());
        assert_eq!(later.headers(), first.headers());
        assert_eq!(later.body(), first.body());
    }
}

#[tokio::test]
async fn commit_then_timeout_with_reqwest_retry_outside_charges_once_and_the_repeat_replays() {
    let provider = SideEffectService::new().with_faults([Fault::CommitThenTimeout]);
    let server = serve(&provider).await;
    let client = retrying_client(middleware());

    let response = charge(&client, &server, ORDER).await.unwrap();
    assert_eq!(response.status(), reqwest::StatusCode::CREATED);
    assert_eq!(
        source(&response),
        ResponseSource::Resent,
        "reqwest-retry's retry went through the ledger and resumed the operation"
    );
    assert_eq!(response.url().path(), "/charges");
    let first = response.bytes().await.unwrap();
    assert_eq!(provider.effects(), 1, "charged once");
    assert_eq!(provider.effects_for_operation(&op(), ""), 1);
    let attempts = provider.attempts();
    assert_eq!(attempts.len(), 2, "the timed-out attempt was resent once");
    assert_byte_identical(&attempts);
    assert!(attempts[0].key().is_some(), "the derived key travels");

    // The orchestrator runs the step again: the recorded answer, without a request.
    let again = charge(&client, &server, ORDER).await.unwrap();
    assert_eq!(source(&again), ResponseSource::Replayed);
    assert_eq!(
        again.url().path(),
        "/charges",
        "a replay has the request's URL"
    );
    assert_eq!(again.bytes().await.unwrap(), first);
    assert_eq!(provider.calls(), 2);
}

#[tokio::test]
async fn without_a_retry_layer_the_next_run_resends_the_stored_bytes_not_the_new_ones() {
    let provider = SideEffectService::new().with_faults([Fault::CommitThenTimeout]);
    let server = serve(&provider).await;
    let rejecting = IdempotencyMiddleware::new(
        IdempotencyLayer::client_builder(MemoryStore::new())
            .provider_deduplicates(true)
            .key_header(KeyHeader::ietf())
            .retry_policy(
                tower_idempotency::retry::RetryPolicy::builder()
                    .max_elapsed(Duration::from_secs(5))
                    .build()
                    .unwrap(),
            )
            .drift_policy(DriftPolicy::Reject)
            .build()
            .unwrap(),
    );
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(rejecting)
        .build();

    // The attempt times out: reqwest's own error comes back, as without the middleware.
    let err = charge(&client, &server, ORDER).await.unwrap_err();
    assert!(err.is_timeout(), "{err:?}");
    assert!(!err.is_middleware());

    // The agent re-ran and reworded the call: refused as drift, nothing sent.
    let regenerated = r#"{"order_id":"order_42","amount_cents":1999,"note":"retry"}"#;
    let err = charge(&client, &server, regenerated).await.unwrap_err();
    let reqwest_middleware::Error::Middleware(ours) = err else {
        panic!("a refusal of ours is a middleware error: {err:?}");
    };
    let ours = ours.downcast::<tower_idempotency::Error>().unwrap();
    assert!(ours.is_drift(), "{ours:?}");
    assert_eq!(provider.attempts().len(), 1);

    // The orchestrator's next run of the step: resumed with the stored bytes.
    let response = charge(&client, &server, ORDER).await.unwrap();
    assert_eq!(source(&response), ResponseSource::Resent);
    assert_eq!(provider.effects(), 1);
    let attempts = provider.attempts();
    assert_eq!(attempts.len(), 2);
    assert_byte_identical(&attempts);
}

#[tokio::test]
async fn a_refused_connection_is_pre_write_and_releases_the_operation() {
    // A port nobody listens on: reqwest's connect error, seen through the chain.
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = closed.local_addr().unwrap();
    drop(closed);
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(middleware())
        .build();
    let send = || {
        client
            .post(format!("http://{addr}/charges"))
            .body(ORDER)
            .with_extension(op())
            .send()
    };
    let err = send().await.unwrap_err();
    assert!(err.is_connect(), "{err:?}");

    // Released, not in doubt: once the provider is up on that port, the operation is sent
    // as new.
    let provider = SideEffectService::new();
    let _server = provider
        .clone()
        .serve(TcpListener::bind(addr).await.unwrap())
        .await
        .unwrap();
    let response = send().await.unwrap();
    assert_eq!(source(&response), ResponseSource::Sent);
    assert_eq!(provider.effects(), 1);
}

/// The README's stack with reqwest-retry in front, and one call whose `OperationId` was
/// forgotten, against a provider that commits and then times out: refused before a byte
/// leaves, with an error naming what is missing (the charge would otherwise happen twice).
#[tokio::test]
async fn a_side_effect_without_an_operation_id_is_refused_not_charged_twice() {
    let provider = SideEffectService::new().with_faults([Fault::CommitThenTimeout]);
    let server = serve(&provider).await;
    let client = retrying_client(middleware());
    let err = client
        .post(server.uri("/charges").to_string())
        .body(ORDER)
        .timeout(ATTEMPT_TIMEOUT)
        .send()
        .await
        .unwrap_err();
    assert!(err.to_string().contains("no OperationId"), "{err}");
    assert_eq!(
        provider.calls(),
        0,
        "nothing was sent, so nothing was charged"
    );
}

#[tokio::test]
async fn reads_and_keyless_side_effects_pass_through_marked_when_keys_are_optional() {
    let provider = SideEffectService::new();
    let server = serve(&provider).await;
    let lenient = IdempotencyMiddleware::new(
        IdempotencyLayer::client_builder(MemoryStore::new())
            .provider_deduplicates(true)
            .key_header(KeyHeader::ietf())
            .require_key(false)
            .build()
            .unwrap(),
    );
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(lenient)
        .build();
    let keyless = client
        .post(server.uri("/charges").to_string())
        .body(ORDER)
        .send()
        .await
        .unwrap();
    assert_eq!(source(&keyless), ResponseSource::Unprotected);
    assert!(provider.attempts()[0].key().is_none());
    let read = client
        .get(server.uri("/charges").to_string())
        .send()
        .await
        .unwrap();
    assert!(read.extensions().get::<ResponseSource>().is_none());
    assert_eq!(source(&read), ResponseSource::Sent);
}

/// The incident the default exists for, on the recommended stack: every attempt of the first
/// run times out (the first one after charging), the orchestrator re-runs the step and the
/// model regenerates the call. The run finishes with the first bytes, charged once, and the
/// response says which fields of the new payload were discarded.
#[tokio::test]
async fn after_a_timeout_a_regenerated_call_finishes_with_one_effect_and_carries_the_marker() {
    let provider = SideEffectService::new().with_faults([
        Fault::CommitThenTimeout,
        Fault::CommitThenTimeout,
        Fault::CommitThenTimeout,
        Fault::CommitThenTimeout,
    ]);
    let server = serve(&provider).await;
    let client = retrying_client(middleware());

    let err = charge(&client, &server, ORDER).await.unwrap_err();
    let timed_out = std::iter::successors(Some(&err as &(dyn std::error::Error + 'static)), |e| {
        e.source()
    })
    .any(|e| {
        // reqwest-retry's `RetryError::WithRetries` holds the last attempt's error.
        e.downcast_ref::<reqwest_middleware::Error>()
            .is_some_and(reqwest_middleware::Error::is_timeout)
    });
    assert!(timed_out, "every attempt timed out: {err:?}");
    assert!(Error::find(&err).is_none(), "a transport failure, not ours");
    assert_eq!(provider.effects(), 1);

    let regenerated =
        r#"{"order_id":"order_42","amount_cents":1999,"summary":"Charge for order 42, retried"}"#;
    let response = charge(&client, &server, regenerated).await.unwrap();
    assert_eq!(response.status(), reqwest::StatusCode::CREATED);
    assert_eq!(source(&response), ResponseSource::Resent);
    let discarded = response
        .extensions()
        .get::<PayloadDiscarded>()
        .expect("the caller learns its payload was discarded");
    assert_eq!(discarded.changed_fields().unwrap(), ["summary"]);
    assert_eq!(provider.effects(), 1, "charged once");
    assert!(provider
        .attempts()
        .iter()
        .all(|attempt| &attempt.body()[..] == ORDER.as_bytes()));
}

/// With `reqwest-retry` in front, a refusal of ours comes back two wrappers deep (its
/// `RetryError` forwards `source` past the error it holds): `Error::find` still reaches it.
#[tokio::test]
async fn error_find_reaches_our_refusal_behind_reqwest_retry() {
    let provider = SideEffectService::new();
    let server = serve(&provider).await;
    let rejecting = IdempotencyMiddleware::new(
        IdempotencyLayer::client_builder(MemoryStore::new())
            .provider_deduplicates(true)
            .key_header(KeyHeader::ietf())
            .retry_policy(
                tower_idempotency::retry::RetryPolicy::builder()
                    .max_elapsed(Duration::from_secs(5))
                    .build()
                    .unwrap(),
            )
            .drift_policy(DriftPolicy::Reject)
            .build()
            .unwrap(),
    );
    let client = retrying_client(rejecting);
    charge(&client, &server, ORDER).await.unwrap();

    let regenerated = r#"{"order_id":"order_42","amount_cents":1999,"note":"retry"}"#;
    let err = charge(&client, &server, regenerated).await.unwrap_err();
    let ours = Error::find(&err).expect("our error, through reqwest-retry's wrappers");
    assert!(ours.is_drift(), "{ours}");
    assert_eq!(ours.drift().unwrap().changed_fields().unwrap(), ["note"]);
    assert!(
        err.to_string()
            .starts_with("payload drift: field note changed"),
        "{err}"
    );
    assert_eq!(provider.calls(), 1);
}
