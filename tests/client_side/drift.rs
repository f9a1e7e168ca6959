//! Drift on the client face: what a request that comes back changed is answered with.
//! Only a regenerated body may join its operation; a changed method or target, or a
//! changed defining field, is refused under every policy, nothing sent.

use bytes::Bytes;
use http::{Request, StatusCode};
use http_body_util::Full;
use tokio::net::TcpListener;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::fingerprint::{PayloadFields, RequestPart};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::testing::{Fault, SideEffectService};
use tower_idempotency::{DriftPolicy, IdempotencyLayer, KeyHeader, OperationId, PayloadDiscarded};

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
        .key_header(KeyHeader::ietf())
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
        .key_header(KeyHeader::ietf())
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

fn client_with(
    policy: Option<DriftPolicy>,
) -> (
    SideEffectService,
    impl tower::Service<
            Request<Full<Bytes>>,
            Response = http::Response<impl http_body::Body>,
            Error = tower_idempotency::Error,
        > + Clone,
) {
    let provider = SideEffectService::new();
    let mut builder = IdempotencyLayer::client_builder(MemoryStore::new())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .defining_fields(PayloadFields::new(["/order_id", "/amount_cents"]).unwrap());
    if let Some(policy) = policy {
        builder = builder.drift_policy(policy);
    }
    let client = ServiceBuilder::new()
        .layer(builder.build().unwrap())
        .service(provider.clone());
    (provider, client)
}

const CHARGE: &str = "http://payments.local/charges";

/// A step identity reused for another order: the order is a defining field, so the second
/// order is refused under the default policy and under `ResendFrozen` alike, never
/// answered with the first order's receipt.
#[tokio::test]
async fn a_changed_defining_field_is_refused_under_every_policy() {
    for policy in [
        None,
        Some(DriftPolicy::ResendFrozen),
        Some(DriftPolicy::Reject),
    ] {
        let (provider, client) = client_with(policy);
        client
            .clone()
            .oneshot(call(
                CHARGE.parse().unwrap(),
                r#"{"order_id":"order_42","amount_cents":1999,"summary":"Order 42"}"#,
            ))
            .await
            .unwrap();
        let refused = client
            .oneshot(call(
                CHARGE.parse().unwrap(),
                r#"{"order_id":"order_43","amount_cents":1999,"summary":"Order 42"}"#,
            ))
            .await
            .err()
            .unwrap_or_else(|| {
                panic!("{policy:?}: another order answered with the first's receipt")
            });
        let drift = refused.drift().expect("a drift error");
        assert_eq!(drift.changed_fields(), Some(&["order_id".to_owned()][..]));
        assert_eq!(provider.effects(), 1, "{policy:?}");
    }
}

/// The same while the first order is in doubt: its frozen bytes are not resent for the
/// second order.
#[tokio::test]
async fn a_changed_defining_field_never_resends_an_in_doubt_operation() {
    for policy in [None, Some(DriftPolicy::ResendFrozen)] {
        let (provider, client) = client_with(policy);
        provider.push_fault(Fault::ServerError {
            status: StatusCode::BAD_GATEWAY,
            commit: true,
        });
        let lost = client
            .clone()
            .oneshot(call(
                CHARGE.parse().unwrap(),
                r#"{"order_id":"order_42","amount_cents":1999}"#,
            ))
            .await
            .unwrap();
        assert_eq!(lost.status(), StatusCode::BAD_GATEWAY);
        let refused = client
            .oneshot(call(
                CHARGE.parse().unwrap(),
                r#"{"order_id":"order_42","amount_cents":2999}"#,
            ))
            .await
            .err()
            .unwrap_or_else(|| panic!("{policy:?}: the first amount resent for the second"));
        assert!(refused.is_drift(), "{policy:?}: {refused}");
        assert_eq!(provider.attempts().len(), 1, "{policy:?}: nothing resent");
    }
}

/// Fields outside the defining ones keep the default: the first call is the operation,
/// and the caller is told what it discarded.
#[tokio::test]
async fn a_reworded_summary_joins_its_operation_and_is_named() {
    for policy in [
        None,
        Some(DriftPolicy::ResendFrozen),
        Some(DriftPolicy::Reject),
    ] {
        let (provider, client) = client_with(policy);
        client
            .clone()
            .oneshot(call(
                CHARGE.parse().unwrap(),
                r#"{"order_id":"order_42","amount_cents":1999,"summary":"Order 42"}"#,
            ))
            .await
            .unwrap();
        let again = client
            .oneshot(call(
                CHARGE.parse().unwrap(),
                r#"{"order_id":"order_42","amount_cents":1999,"summary":"Charge for order 42"}"#,
            ))
            .await
            .unwrap();
        let discarded = again
            .extensions()
            .get::<PayloadDiscarded>()
            .unwrap_or_else(|| panic!("{policy:?}: told"));
        assert_eq!(
            discarded.changed_fields(),
            Some(&["summary".to_owned()][..])
        );
        assert_eq!(provider.effects(), 1, "{policy:?}");
    }
}
