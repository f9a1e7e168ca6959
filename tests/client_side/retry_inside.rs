//! A retrying layer that is not ours (`tower::retry`) between the client `IdempotencyLayer`
//! and the transport: it would resend an attempt that may have charged, blind to the
//! provider's keys. The crate's transport (and a `FrozenRetryLayer` under it) refuses the
//! second send of one attempt before any of it leaves, and the operation is settled as
//! the first send's outcome dictates.
#![cfg(all(feature = "reqwest", feature = "test-util"))]

use std::future::{ready, Ready};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tokio::net::TcpListener;
use tower::retry::RetryLayer;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::phase::FailurePhase;
use tower_idempotency::reqwest::ReqwestService;
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::testing::{Fault, ServeHandle, SideEffectService};
use tower_idempotency::{FrozenRetryLayer, IdempotencyLayer, OperationId, ProviderKeys};

const ORDER: &str = r#"{"order_id":"order_42","amount_cents":1999}"#;

/// A `tower::retry` policy as people write them: up to `left` more tries on a `5xx` or an
/// error, cloning the request whole, extensions included.
#[derive(Clone)]
struct RetryFailures {
    left: usize,
}

impl<ResB, E> tower::retry::Policy<Request<Full<Bytes>>, Response<ResB>, E> for RetryFailures {
    type Future = Ready<()>;

    fn retry(
        &mut self,
        _: &mut Request<Full<Bytes>>,
        result: &mut Result<Response<ResB>, E>,
    ) -> Option<Self::Future> {
        let failed = result
            .as_ref()
            .map_or(true, |response| response.status().is_server_error());
        (failed && self.left > 0).then(|| {
            self.left -= 1;
            ready(())
        })
    }

    fn clone_request(&mut self, req: &Request<Full<Bytes>>) -> Option<Request<Full<Bytes>>> {
        let mut clone = Request::new(req.body().clone());
        *clone.method_mut() = req.method().clone();
        *clone.uri_mut() = req.uri().clone();
        *clone.version_mut() = req.version();
        *clone.headers_mut() = req.headers().clone();
        *clone.extensions_mut() = req.extensions().clone();
        Some(clone)
    }
}

fn charge(uri: http::Uri) -> Request<Full<Bytes>> {
    let mut req = Request::post(uri)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(ORDER.as_bytes())))
        .unwrap();
    req.extensions_mut()
        .insert(OperationId::new("task-7", "charge_customer"));
    req
}

/// A provider that ignores keys, charging and then answering `500` once, over loopback.
async fn failing_once() -> (SideEffectService, ServeHandle) {
    let provider = SideEffectService::builder().honour_keys(false).build();
    provider.push_fault(Fault::ServerError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        commit: true,
    });
    let server = provider
        .clone()
        .serve(TcpListener::bind("127.0.0.1:0").await.unwrap())
        .await
        .unwrap();
    (provider, server)
}

/// `tower::retry` between the idempotency layer and `ReqwestService`: its resend of the
/// attempt that charged and answered `500` is refused before it leaves, with an error that
/// names the wiring; the operation stays in doubt (the first send reached the provider),
/// so running the step again sends nothing either. One charge.
#[tokio::test]
async fn tower_retry_inside_the_layer_is_refused_before_its_second_send() {
    let (provider, server) = failing_once().await;
    let uri = server.uri("/charges");
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Ignored,
        ))
        .layer(RetryLayer::new(RetryFailures { left: 3 }))
        .service(ReqwestService::new(reqwest::Client::new()));

    let err = client
        .clone()
        .oneshot(charge(uri.clone()))
        .await
        .unwrap_err();
    assert!(err.is_retry_inside(), "{err}");
    assert!(err.to_string().contains("tower::retry"), "{err}");
    assert!(err.to_string().contains("FrozenRetryLayer"), "{err}");
    assert!(
        err.is_in_doubt(),
        "the first send reached the provider: {err}"
    );
    assert_eq!(err.phase(), Some(FailurePhase::AfterWrite));
    assert_eq!(provider.effects(), 1, "the retry layer resent a charge");
    assert_eq!(provider.attempts().len(), 1, "a second send left");

    // Never released as unsent: the step run again is not sent again.
    let again = client.oneshot(charge(uri)).await.unwrap_err();
    assert!(again.is_unreconciled(), "{again}");
    assert_eq!(provider.effects(), 1);
}

/// A first send that failed before it was written (a closed port) leaves nothing in doubt:
/// the retry layer's resend is still refused, and the operation is released, so the step
/// run again sends it.
#[tokio::test]
async fn a_resend_after_a_first_send_that_never_left_releases_the_operation() {
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let uri: http::Uri = format!("http://{}/charges", closed.local_addr().unwrap())
        .parse()
        .unwrap();
    drop(closed);
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Ignored,
        ))
        .layer(RetryLayer::new(RetryFailures { left: 1 }))
        .service(ReqwestService::new(reqwest::Client::new()));

    let err = client
        .clone()
        .oneshot(charge(uri.clone()))
        .await
        .unwrap_err();
    assert!(err.is_retry_inside(), "{err}");
    assert_eq!(err.phase(), Some(FailurePhase::PreWrite), "{err}");
    assert!(!err.is_in_doubt(), "{err}");

    // Released: a later run claims the operation afresh (and, with the port still closed,
    // fails before writing again) rather than being refused as in doubt.
    let again = client.oneshot(charge(uri)).await.unwrap_err();
    assert!(!again.is_unreconciled(), "{again}");
    assert!(again.is_retry_inside(), "{again}");
}

/// `tower::retry` outside a `FrozenRetryLayer`, both inside the idempotency layer: the
/// `FrozenRetryLayer` is handed the operation a second time, and refuses it before it sends
/// anything. Its own retries are the operation's, and go through.
#[tokio::test]
async fn tower_retry_around_a_frozen_retry_layer_is_refused_at_the_second_hand_over() {
    let provider = SideEffectService::builder().honour_keys(false).build();
    provider.push_fault(Fault::ServerError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        commit: true,
    });
    let policy = RetryPolicy::builder()
        .attempt_timeout(Duration::from_secs(2))
        .no_budget()
        .build()
        .unwrap();
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Ignored,
        ))
        .layer(RetryLayer::new(RetryFailures { left: 2 }))
        .layer(FrozenRetryLayer::new(policy))
        .service(provider.clone());

    let err = client
        .oneshot(charge("http://payments.local/charges".parse().unwrap()))
        .await
        .unwrap_err();
    assert!(err.is_retry_inside(), "{err}");
    assert!(err.is_in_doubt(), "{err}");
    assert_eq!(provider.effects(), 1, "charged again");
}
