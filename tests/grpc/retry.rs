//! `grpc::RetryLayer` between a generated tonic client and a real channel: gRFC A6 retries
//! that resend the frozen message byte for byte, and never a side effect that may have run.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use prost::Message;
use tokio::net::TcpStream;
use tonic::transport::{Channel, Endpoint};
use tonic::Code;
use tower::retry::budget::TpsBudget;
use tower::ServiceBuilder;
use tower_idempotency::grpc::{Methods, Retry, RetryLayer};
use tower_idempotency::retry::{Attempts, RetryPolicy};

use super::fixture::{serve, Fault, Provider, Served};
use crate::payments::paths::{CHARGE, GET_CHARGE, LIST_CHARGES};
use crate::payments::payments_client::PaymentsClient;
use crate::payments::{ChargeRequest, GetChargeRequest, ListChargesRequest};

fn methods() -> Methods {
    Methods::new()
        .unary(CHARGE)
        .reads(GET_CHARGE)
        .server_streaming(LIST_CHARGES)
}

fn quick_policy() -> RetryPolicy {
    RetryPolicy::builder()
        .max_attempts(4)
        .backoff(Duration::from_millis(1), Duration::from_millis(5))
        .build()
        .unwrap()
}

fn client_over(channel: Channel, layer: RetryLayer) -> PaymentsClient<Retry<Channel>> {
    PaymentsClient::new(ServiceBuilder::new().layer(layer).service(channel))
}

fn client(served: &Served) -> PaymentsClient<Retry<Channel>> {
    client_over(served.channel(), RetryLayer::new(quick_policy(), methods()))
}

fn charge_request(key: Option<&str>) -> tonic::Request<ChargeRequest> {
    let labels: HashMap<String, String> = (0..8)
        .map(|i| (format!("label-{i}"), format!("value-{i}")))
        .collect();
    let mut request = tonic::Request::new(ChargeRequest {
        request_id: String::new(),
        order_id: "order_42".into(),
        amount_cents: 1999,
        labels,
    });
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert("idempotency-key", key.parse().unwrap());
    }
    request
}

fn read_request() -> tonic::Request<GetChargeRequest> {
    tonic::Request::new(GetChargeRequest {
        charge_id: "ch_1".into(),
    })
}

fn header<'a>(seen: &'a super::fixture::Seen, name: &str) -> Option<&'a str> {
    seen.headers.get(name).map(|value| value.to_str().unwrap())
}

#[tokio::test]
async fn a_read_answered_unavailable_is_resent_with_the_same_bytes_and_its_attempt_count() {
    let served = serve(Provider::with_faults([
        Fault::Unavailable,
        Fault::Unavailable,
    ]))
    .await;

    let response = client(&served).get_charge(read_request()).await.unwrap();

    assert_eq!(response.get_ref().charge_id, "ch_1");
    assert_eq!(
        response.extensions().get::<Attempts>(),
        Some(&Attempts::new(3))
    );
    let seen = served.provider.seen();
    assert_eq!(seen.len(), 3);
    assert!(seen.iter().all(|s| s.path == GET_CHARGE));
    assert!(
        seen.iter().all(|s| s.body == seen[0].body),
        "every attempt sent the same bytes"
    );
    let previous: Vec<_> = seen
        .iter()
        .map(|s| header(s, "grpc-previous-rpc-attempts"))
        .collect();
    assert_eq!(previous, [None, Some("1"), Some("2")]);
}

#[tokio::test]
async fn a_keyed_charge_with_a_map_field_is_resent_byte_for_byte_and_charged_once() {
    let served = serve(Provider::with_faults([Fault::Unavailable])).await;

    let response = client(&served)
        .charge(charge_request(Some("order_42-charge")))
        .await
        .unwrap();

    assert_eq!(response.get_ref().charge_id, "ch_1");
    assert_eq!(served.provider.effects(), 1);
    let seen = served.provider.seen();
    assert_eq!(seen.len(), 2);
    // The map's entries travel in hash order: only the frozen bytes make the two equal.
    assert_eq!(seen[0].body, seen[1].body);
    let sent = ChargeRequest::decode(&seen[1].body[5..]).unwrap();
    assert_eq!(sent.labels.len(), 8);
    assert_eq!(header(&seen[1], "idempotency-key"), Some("order_42-charge"));
}

#[tokio::test]
async fn a_charge_without_a_key_is_never_resent_once_it_may_have_arrived() {
    let served = serve(Provider::with_faults([Fault::ChargeThenUnavailable])).await;

    let status = client(&served)
        .charge(charge_request(None))
        .await
        .unwrap_err();

    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(served.provider.calls(), 1);
    assert_eq!(served.provider.effects(), 1);
}

#[tokio::test]
async fn a_charge_whose_connection_was_refused_is_retried_because_it_never_left() {
    let served = serve(Provider::default()).await;
    let addr = served.addr;
    let connects = Arc::new(AtomicUsize::new(0));
    let connector = tower::service_fn({
        let connects = connects.clone();
        move |_uri: http::Uri| {
            let first = connects.fetch_add(1, Ordering::SeqCst) == 0;
            async move {
                if first {
                    return Err(io::Error::from(io::ErrorKind::ConnectionRefused));
                }
                TcpStream::connect(addr).await.map(TokioIo::new)
            }
        }
    });
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect_with_connector_lazy(connector);
    let mut client = client_over(channel, RetryLayer::new(quick_policy(), methods()));

    let response = client.charge(charge_request(None)).await.unwrap();

    assert_eq!(response.get_ref().charge_id, "ch_1");
    assert_eq!(connects.load(Ordering::SeqCst), 2);
    assert_eq!(served.provider.calls(), 1);
    assert_eq!(served.provider.effects(), 1);
}

#[tokio::test]
async fn a_servers_pushback_sets_the_pause_before_the_retry() {
    let served = serve(Provider::with_faults([Fault::Pushback("300")])).await;
    let started = Instant::now();

    client(&served).get_charge(read_request()).await.unwrap();

    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(served.provider.calls(), 2);
}

#[tokio::test]
async fn a_negative_or_malformed_pushback_ends_the_retries() {
    for pushback in ["-1", "soon"] {
        let served = serve(Provider::with_faults([Fault::Pushback(pushback)])).await;

        let status = client(&served)
            .get_charge(read_request())
            .await
            .unwrap_err();

        assert_eq!(status.code(), Code::Unavailable);
        assert_eq!(served.provider.calls(), 1, "pushback {pushback}");
    }
}

#[tokio::test]
async fn an_answer_whose_headers_arrived_is_committed_and_never_retried() {
    let served = serve(Provider::default()).await;
    let mut request = tonic::Request::new(ListChargesRequest {
        order_id: "order_42".into(),
    });
    request
        .metadata_mut()
        .insert("idempotency-key", "list-1".parse().unwrap());

    let mut stream = client(&served)
        .list_charges(request)
        .await
        .unwrap()
        .into_inner();

    assert_eq!(stream.message().await.unwrap().unwrap().charge_id, "ch_1");
    let status = stream.message().await.unwrap_err();
    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(served.provider.calls(), 1);
}

#[tokio::test]
async fn each_attempt_carries_what_is_left_of_the_callers_deadline() {
    let served = serve(Provider::with_faults([Fault::Pushback("100")])).await;
    let mut request = read_request();
    request.set_timeout(Duration::from_secs(5));

    client(&served).get_charge(request).await.unwrap();

    let seen = served.provider.seen();
    let timeouts: Vec<u64> = seen
        .iter()
        .map(|s| {
            let value = header(s, "grpc-timeout").unwrap();
            assert!(value.ends_with('u') || value.ends_with('m'), "{value}");
            let digits: u64 = value[..value.len() - 1].parse().unwrap();
            if value.ends_with('m') {
                digits * 1000
            } else {
                digits
            }
        })
        .collect();
    assert_eq!(timeouts.len(), 2);
    assert!(timeouts[1] + 100_000 <= timeouts[0], "{timeouts:?}");
}

#[tokio::test]
async fn no_retry_starts_after_the_callers_deadline() {
    let served = serve(Provider::with_faults([Fault::Pushback("500")])).await;
    let mut request = read_request();
    request.set_timeout(Duration::from_millis(200));

    let status = client(&served).get_charge(request).await.unwrap_err();

    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(served.provider.calls(), 1);
}

#[tokio::test]
async fn an_empty_budget_throttles_every_retry() {
    let served = serve(Provider::with_faults([Fault::Unavailable])).await;
    let empty = Arc::new(TpsBudget::new(Duration::from_secs(10), 0, 0.0));
    let policy = RetryPolicy::builder().budget(empty).build().unwrap();
    let mut client = client_over(served.channel(), RetryLayer::new(policy, methods()));

    let status = client.get_charge(read_request()).await.unwrap_err();

    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(served.provider.calls(), 1);
}

#[tokio::test]
async fn only_the_configured_codes_are_retried() {
    let served = serve(Provider::with_faults([Fault::Unavailable])).await;
    let layer = RetryLayer::new(quick_policy(), methods()).retryable_codes([Code::Aborted]);

    let status = client_over(served.channel(), layer)
        .get_charge(read_request())
        .await
        .unwrap_err();

    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(served.provider.calls(), 1);
}

#[tokio::test]
async fn a_method_the_table_does_not_name_is_passed_through_once() {
    let served = serve(Provider::with_faults([Fault::Unavailable])).await;
    let layer = RetryLayer::new(quick_policy(), Methods::new().unary(CHARGE));

    let status = client_over(served.channel(), layer)
        .get_charge(read_request())
        .await
        .unwrap_err();

    assert_eq!(status.code(), Code::Unavailable);
    assert_eq!(served.provider.calls(), 1);
}

#[tokio::test]
async fn a_timed_out_charge_without_a_key_is_not_resent() {
    let served = serve(Provider::with_faults([Fault::ChargeThenStall(
        Duration::from_millis(300),
    )]))
    .await;
    let policy = RetryPolicy::builder()
        .attempt_timeout(Duration::from_millis(50))
        .backoff(Duration::from_millis(1), Duration::from_millis(5))
        .build()
        .unwrap();
    let mut client = client_over(served.channel(), RetryLayer::new(policy, methods()));

    let status = client.charge(charge_request(None)).await.unwrap_err();
    tokio::time::sleep(Duration::from_millis(400)).await;

    assert_ne!(status.code(), Code::Ok);
    assert_eq!(served.provider.calls(), 1);
    assert_eq!(served.provider.effects(), 1);
}

#[tokio::test]
async fn a_message_over_the_body_limit_is_refused_before_sending() {
    let served = serve(Provider::default()).await;
    let policy = RetryPolicy::builder().body_limit(16).build().unwrap();
    let mut client = client_over(served.channel(), RetryLayer::new(policy, methods()));

    let status = client.charge(charge_request(None)).await.unwrap_err();

    assert_ne!(status.code(), Code::Ok);
    assert_eq!(served.provider.calls(), 0);
}

/// Random scripts of faults on a keyless charge: whatever the order, the provider charges
/// at most once, and a call it answered after charging is never sent again.
#[tokio::test]
async fn random_fault_scripts_never_charge_a_keyless_call_twice() {
    let mut rng = fastrand::Rng::with_seed(0x5eed_6a7c);
    for _ in 0..24 {
        let script: Vec<Fault> = (0..rng.usize(0..4))
            .map(|_| match rng.u8(0..3) {
                0 => Fault::Unavailable,
                1 => Fault::ChargeThenUnavailable,
                _ => Fault::Pushback("1"),
            })
            .collect();
        let served = serve(Provider::with_faults(script.clone())).await;

        let result = client(&served).charge(charge_request(None)).await;

        let provider = &served.provider;
        assert!(provider.effects() <= 1, "{script:?}");
        assert_eq!(provider.calls(), 1, "no resend without a key: {script:?}");
        assert_eq!(result.is_ok(), script.is_empty(), "{script:?}");
    }
}
