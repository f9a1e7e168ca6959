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
use tower::util::BoxCloneService;
use tower::BoxError;
use tower::{Layer, ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::phase::FailurePhase;
use tower_idempotency::reqwest::ReqwestService;
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::testing::{Fault, ServeHandle, SideEffectService};
use tower_idempotency::{FrozenRetryLayer, IdempotencyLayer, KeyHeader, OperationId, ProviderKeys};

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

/// `inner` behind a boxed service: the type the idempotency layer reads shows no retrying
/// layer, as with a stack of your own that is boxed.
fn hidden<S, ResB>(inner: S) -> BoxCloneService<Request<Full<Bytes>>, Response<ResB>, BoxError>
where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Into<BoxError>,
{
    BoxCloneService::new(inner.map_err(Into::into))
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

/// A transport that counts its sends, boxed under `tower::retry` so that the type the
/// idempotency layer reads shows no retrying layer: only the counted sends can tell.
type Counted = BoxCloneService<Request<Full<Bytes>>, Response<BoxBody>, BoxError>;
type BoxBody = http_body_util::combinators::UnsyncBoxBody<Bytes, BoxError>;

/// The two transports that count their sends: `ReqwestService`, and hyper-util's `Client`
/// (the README's own transport, which counts nothing by itself) wrapped in `SendOnce`.
fn counted_transports(retries: usize) -> [(&'static str, Counted); 2] {
    use http_body_util::BodyExt;
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;
    use tower_idempotency::client::SendOnceLayer;

    let boxed = |response: Response<_>| {
        response.map(|body: _| BodyExt::map_err(body, Into::into).boxed_unsync())
    };
    let reqwest = ServiceBuilder::new()
        .layer(RetryLayer::new(RetryFailures { left: retries }))
        .map_response(boxed)
        .service(ReqwestService::new(reqwest::Client::new()));
    let hyper = ServiceBuilder::new()
        .layer(RetryLayer::new(RetryFailures { left: retries }))
        .map_response(|response: Response<hyper::body::Incoming>| {
            response.map(|body| body.map_err(Into::into).boxed_unsync())
        })
        .layer(SendOnceLayer::new())
        .service(Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>());
    [
        ("reqwest", hidden(reqwest)),
        ("send_once(hyper-util)", hidden(hyper)),
    ]
}

/// `tower::retry` between the idempotency layer and a transport that counts its sends:
/// its resend of the attempt that charged and answered `500` is refused before it leaves,
/// with an error that names the wiring; the operation stays in doubt (the first send
/// reached the provider), so running the step again sends nothing either. One charge.
#[tokio::test]
async fn tower_retry_inside_the_layer_is_refused_before_its_second_send() {
    for (name, transport) in counted_transports(3) {
        let (provider, server) = failing_once().await;
        let uri = server.uri("/charges");
        let client = ServiceBuilder::new()
            .layer(IdempotencyLayer::client(
                MemoryStore::new(),
                ProviderKeys::Ignored,
                KeyHeader::ietf(),
            ))
            .service(transport);

        let err = client
            .clone()
            .oneshot(charge(uri.clone()))
            .await
            .unwrap_err();
        assert!(err.is_retry_inside(), "{name}: {err}");
        assert!(err.to_string().contains("tower::retry"), "{name}: {err}");
        assert!(
            err.to_string().contains("FrozenRetryLayer"),
            "{name}: {err}"
        );
        assert!(
            err.is_in_doubt(),
            "{name}: the first send reached the provider: {err}"
        );
        assert_eq!(err.phase(), Some(FailurePhase::AfterWrite), "{name}");
        assert_eq!(
            provider.effects(),
            1,
            "{name}: the retry layer resent a charge"
        );
        assert_eq!(provider.attempts().len(), 1, "{name}: a second send left");

        // Never released as unsent: the step run again is not sent again.
        let again = client.oneshot(charge(uri)).await.unwrap_err();
        assert!(again.is_unreconciled(), "{name}: {again}");
        assert_eq!(provider.effects(), 1, "{name}");
        server.shutdown().await;
    }
}

/// A first send that failed before it was written (a closed port) leaves nothing in doubt:
/// the retry layer's resend is still refused, and the operation is released, so the step
/// run again sends it.
#[tokio::test]
async fn a_resend_after_a_first_send_that_never_left_releases_the_operation() {
    for (name, transport) in counted_transports(1) {
        let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let uri: http::Uri = format!("http://{}/charges", closed.local_addr().unwrap())
            .parse()
            .unwrap();
        drop(closed);
        let client = ServiceBuilder::new()
            .layer(IdempotencyLayer::client(
                MemoryStore::new(),
                ProviderKeys::Ignored,
                KeyHeader::ietf(),
            ))
            .service(transport);

        let err = client
            .clone()
            .oneshot(charge(uri.clone()))
            .await
            .unwrap_err();
        assert!(err.is_retry_inside(), "{name}: {err}");
        assert_eq!(err.phase(), Some(FailurePhase::PreWrite), "{name}: {err}");
        assert!(!err.is_in_doubt(), "{name}: {err}");

        // Released: a later run claims the operation afresh (and, with the port still
        // closed, fails before writing again) rather than being refused as in doubt.
        let again = client.oneshot(charge(uri)).await.unwrap_err();
        assert!(!again.is_unreconciled(), "{name}: {again}");
        assert!(again.is_retry_inside(), "{name}: {again}");
    }
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
            KeyHeader::ietf(),
        ))
        // Boxed: its type no longer shows the retrying layer, so only the sends
        // counted at run time can tell.
        .service(hidden(
            ServiceBuilder::new()
                .layer(RetryLayer::new(RetryFailures { left: 2 }))
                .layer(FrozenRetryLayer::new(policy))
                .service(provider.clone()),
        ));

    let err = client
        .oneshot(charge("http://payments.local/charges".parse().unwrap()))
        .await
        .unwrap_err();
    assert!(err.is_retry_inside(), "{err}");
    assert!(err.is_in_doubt(), "{err}");
    assert_eq!(provider.effects(), 1, "charged again");
}

/// The newcomer's wiring: `tower::retry` between the idempotency layer and hyper-util's
/// `Client`, which counts no sends. The layer reads the retrying layer in the type of the
/// service it wraps, and refuses every side effect before claiming or sending anything,
/// naming the layer; reads go through.
#[tokio::test]
async fn tower_retry_inside_the_layer_is_refused_by_its_type_before_anything_is_sent() {
    use hyper_util::client::legacy::Client;
    use hyper_util::rt::TokioExecutor;

    let (provider, server) = failing_once().await;
    let store = MemoryStore::new();
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            store.clone(),
            ProviderKeys::Ignored,
            KeyHeader::ietf(),
        ))
        .layer(RetryLayer::new(RetryFailures { left: 3 }))
        .service(Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>());

    let err = client
        .clone()
        .oneshot(charge(server.uri("/charges")))
        .await
        .unwrap_err();
    assert!(err.is_retry_inside(), "{err}");
    assert!(err.to_string().contains("tower::retry"), "{err}");
    assert!(err.to_string().contains("FrozenRetryLayer"), "{err}");
    assert!(!err.is_in_doubt(), "nothing was sent: {err}");
    assert!(provider.attempts().is_empty(), "a byte of it left");
    assert_eq!(store.entry_count(), 0, "nothing claimed");

    let read = Request::get(server.uri("/charges/ch_1"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    assert!(client.oneshot(read).await.is_ok(), "a read is refused");
}

/// The same under a stack built as one: a retrying layer wrapped into the transport the
/// stack is given would resend the stack's own attempts; refused, nothing sent.
#[tokio::test]
async fn tower_retry_in_the_transport_of_a_built_stack_is_refused_by_its_type() {
    let provider = SideEffectService::builder().honour_keys(false).build();
    let client = IdempotencyLayer::client_builder(MemoryStore::new())
        .provider_deduplicates(false)
        .build_stack()
        .unwrap()
        .layer(
            ServiceBuilder::new()
                .layer(RetryLayer::new(RetryFailures { left: 3 }))
                .service(provider.clone()),
        );

    let err = client
        .oneshot(charge("http://payments.local/charges".parse().unwrap()))
        .await
        .unwrap_err();
    assert!(err.is_retry_inside(), "{err}");
    assert!(provider.attempts().is_empty(), "sent");
}

/// Under a `FrozenRetryLayer` stacked by hand, too: its attempts carry no mark a transport
/// could count, but the type shows the retrying layer under it.
#[tokio::test]
async fn tower_retry_under_a_frozen_retry_layer_is_refused_by_its_type() {
    let provider = SideEffectService::builder().honour_keys(false).build();
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Ignored,
            KeyHeader::ietf(),
        ))
        .layer(FrozenRetryLayer::new(RetryPolicy::default()))
        .layer(RetryLayer::new(RetryFailures { left: 3 }))
        .service(provider.clone());

    let err = client
        .oneshot(charge("http://payments.local/charges".parse().unwrap()))
        .await
        .unwrap_err();
    assert!(err.is_retry_inside(), "{err}");
    assert!(provider.attempts().is_empty(), "sent");
}
