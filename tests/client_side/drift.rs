//! Drift on the client face: what a request that comes back changed is answered with.
//! Only a regenerated body may join its operation; a changed method or target, or a
//! changed defining field, is refused under every policy, nothing sent.

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use tokio::net::TcpListener;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::fingerprint::RequestPart;
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::testing::{Fault, SideEffectService};
use tower_idempotency::{DriftPolicy, IdempotencyLayer, OperationId};

const PAYMENT: &str = r#"{"order_id":"order_42","amount_cents":1999}"#;

fn pay() -> OperationId {
    OperationId::new("task-7", "settle_order")
}

/// `POST` `body` to `uri` as the operation [`pay`].
fn call(uri: http::Uri, body: &'static str) -> Request<Full<Bytes>> {
    let mut req = Request::post(uri)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap();
    req.extensions_mut().insert(pay());
    req
}

/// The provider's attempts at `path`.
fn attempts_at(provider: &SideEffectService, path: &str) -> usize {
    provider
        .attempts()
        .iter()
        .filter(|attempt| attempt.uri().path() == path)
        .count()
}

/// Over loopback HTTP: an `OperationId` sent to `/charges`, then to `/refunds` under an
/// explicit `ResendFrozen`. The refund is refused, naming the changed target: it is not
/// answered with the charge's `201`, and nothing reaches `/refunds`.
#[tokio::test]
async fn resend_frozen_refuses_a_completed_operation_sent_to_another_target() {
    let provider = SideEffectService::new();
    let server = provider
        .clone()
        .serve(TcpListener::bind("127.0.0.1:0").await.unwrap())
        .await
        .unwrap();
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let layer = IdempotencyLayer::client_builder(MemoryStore::new())
        .provider_deduplicates(true)
        .drift_policy(DriftPolicy::ResendFrozen)
        .build()
        .unwrap();
    let client = ServiceBuilder::new().layer(layer).service(http);

    let charged = client
        .clone()
        .oneshot(call(server.uri("/charges"), PAYMENT))
        .await
        .unwrap();
    assert_eq!(charged.status(), StatusCode::CREATED);

    let refused = client
        .oneshot(call(server.uri("/refunds"), PAYMENT))
        .await
        .expect_err("another target is another operation's request");
    let drift = refused.drift().expect("a drift error");
    assert_eq!(
        drift.differing_parts().collect::<Vec<_>>(),
        [RequestPart::Target]
    );
    assert!(refused.to_string().contains("target changed"), "{refused}");
    assert_eq!(attempts_at(&provider, "/refunds"), 0);
    assert_eq!(
        attempts_at(&provider, "/charges"),
        1,
        "the charge not resent"
    );
    assert_eq!(provider.effects(), 1);
}

/// The same in doubt: the charge's answer was lost, and the operation comes back as a
/// refund. Resending the charge's frozen bytes would charge again; it is refused.
#[tokio::test]
async fn resend_frozen_never_resends_an_in_doubt_operation_for_another_target() {
    let provider = SideEffectService::builder()
        .honour_keys(false)
        .faults([Fault::ServerError {
            status: StatusCode::BAD_GATEWAY,
            commit: true,
        }])
        .build();
    let server = provider
        .clone()
        .serve(TcpListener::bind("127.0.0.1:0").await.unwrap())
        .await
        .unwrap();
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let layer = IdempotencyLayer::client_builder(MemoryStore::new())
        .provider_deduplicates(true)
        .drift_policy(DriftPolicy::ResendFrozen)
        .build()
        .unwrap();
    let client = ServiceBuilder::new().layer(layer).service(http);

    let lost = client
        .clone()
        .oneshot(call(server.uri("/charges"), PAYMENT))
        .await
        .unwrap();
    assert_eq!(
        lost.status(),
        StatusCode::BAD_GATEWAY,
        "charged, the answer lost"
    );

    let refused = client
        .oneshot(call(server.uri("/refunds"), PAYMENT))
        .await
        .expect_err("another target is another operation's request");
    assert!(refused.is_drift(), "{refused}");
    assert_eq!(attempts_at(&provider, "/refunds"), 0);
    assert_eq!(
        attempts_at(&provider, "/charges"),
        1,
        "the charge not resent"
    );
    assert_eq!(provider.effects(), 1);
}
