//! `grpc::ServerLayer` in front of a real tonic service over loopback: the HTTP server
//! face's scenarios (key syntax, in flight, drift, replay, scoping, ledger down, concurrent
//! duplicates) told in gRPC status codes, and replays byte-identical in status and trailers.

use std::time::Duration;

use tonic::codec::CompressionEncoding;
use tonic::metadata::MetadataValue;
use tonic::transport::Channel;
use tonic::Code;
use tower_idempotency::grpc::{KeySource, Methods, ServerLayer};
use tower_idempotency::ledger::{IdempotencyStore, MemoryStore};
use tower_idempotency::IdempotencyLayer;

use super::fixture::{serve_guarded, Fault, Provider, Served};
use crate::payments::paths::{CHARGE, GET_CHARGE, LIST_CHARGES};
use crate::payments::payments_client::PaymentsClient;
use crate::payments::{ChargeRequest, GetChargeRequest, ListChargesRequest};
use crate::support::down::DownStore;

pub(super) fn methods() -> Methods {
    Methods::new()
        .unary(CHARGE)
        .reads(GET_CHARGE)
        .server_streaming(LIST_CHARGES)
}

pub(super) fn layer_over(store: impl IdempotencyStore) -> ServerLayer {
    ServerLayer::new(IdempotencyLayer::server(store), methods())
}

async fn guarded(provider: Provider) -> Served {
    serve_guarded(provider, layer_over(MemoryStore::new())).await
}

fn client(served: &Served) -> PaymentsClient<Channel> {
    PaymentsClient::new(served.channel())
}

/// A charge of `amount` by `caller` (its `authorization`), under `key` if any.
pub(super) fn charge(
    key: Option<&str>,
    caller: &str,
    amount: i64,
) -> tonic::Request<ChargeRequest> {
    let mut request = tonic::Request::new(ChargeRequest {
        request_id: String::new(),
        order_id: "order_42".into(),
        amount_cents: amount,
        labels: Default::default(),
    });
    let metadata = request.metadata_mut();
    metadata.insert("authorization", format!("Bearer {caller}").parse().unwrap());
    if let Some(key) = key {
        metadata.insert("idempotency-key", key.parse().unwrap());
    }
    request
}

#[tokio::test]
async fn a_keyed_charge_sent_again_is_replayed_not_charged_again() {
    let served = guarded(Provider::default()).await;
    let mut client = client(&served);

    let first = client
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap();
    let again = client
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap();

    assert_eq!(served.provider.effects(), 1);
    assert_eq!(first.get_ref(), again.get_ref());
    assert_eq!(again.metadata().get("idempotent-replayed").unwrap(), "true");
    assert!(first.metadata().get("idempotent-replayed").is_none());
}

#[tokio::test]
async fn a_recorded_error_is_replayed_identical_in_code_message_details_and_metadata() {
    let served = guarded(Provider::with_faults([Fault::Decline])).await;
    let mut client = client(&served);

    let first = client
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap_err();
    let again = client
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap_err();

    assert_eq!(
        served.provider.calls(),
        1,
        "the decline is the key's outcome"
    );
    assert_eq!(first.code(), Code::FailedPrecondition);
    assert_eq!(again.code(), first.code());
    assert_eq!(again.message(), first.message());
    assert_eq!(again.details(), first.details());
    assert_eq!(again.details(), b"\x08\x01\x12\x03abc");
    assert_eq!(
        again.metadata().get("x-decline-code"),
        first.metadata().get("x-decline-code")
    );
    let raw = |status: &tonic::Status, name: &str| {
        status.metadata().clone().into_headers().get(name).cloned()
    };
    for name in ["grpc-message", "grpc-status-details-bin"] {
        assert_eq!(raw(&again, name), raw(&first, name), "{name}");
    }
}

#[tokio::test]
async fn a_missing_or_malformed_key_is_an_invalid_argument_and_nothing_runs() {
    let served = guarded(Provider::default()).await;
    let mut client = client(&served);

    let missing = client
        .charge(charge(None, "alice", 1999))
        .await
        .unwrap_err();
    let mut malformed = charge(None, "alice", 1999);
    malformed
        .metadata_mut()
        .insert("idempotency-key", MetadataValue::from_static("two, keys"));
    let malformed = client.charge(malformed).await.unwrap_err();

    assert_eq!(missing.code(), Code::InvalidArgument);
    assert_eq!(malformed.code(), Code::InvalidArgument);
    assert_eq!(served.provider.calls(), 0);
}

#[tokio::test]
async fn another_message_under_a_used_key_is_a_failed_precondition() {
    let served = guarded(Provider::default()).await;
    let mut client = client(&served);

    client
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap();
    let drift = client
        .charge(charge(Some("k-1"), "alice", 2999))
        .await
        .unwrap_err();

    assert_eq!(drift.code(), Code::FailedPrecondition);
    assert_eq!(served.provider.effects(), 1);
}

#[tokio::test]
async fn a_key_in_flight_is_aborted_with_a_pushback() {
    let served = guarded(Provider::with_faults([Fault::ChargeThenStall(
        Duration::from_millis(400),
    )]))
    .await;
    let mut first_client = client(&served);
    let first = tokio::spawn(async move {
        first_client
            .charge(charge(Some("k-1"), "alice", 1999))
            .await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;

    let busy = client(&served)
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap_err();

    assert_eq!(busy.code(), Code::Aborted);
    let pushback: u64 = busy
        .metadata()
        .get("grpc-retry-pushback-ms")
        .unwrap()
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(pushback >= 1, "{pushback}");
    first.await.unwrap().unwrap();
    assert_eq!(served.provider.effects(), 1);
}

#[tokio::test]
async fn keys_are_scoped_by_caller_and_a_keyed_call_without_one_is_unauthenticated() {
    let served = guarded(Provider::default()).await;
    let mut client = client(&served);

    let alice = client
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap();
    let bob = client
        .charge(charge(Some("k-1"), "bob", 1999))
        .await
        .unwrap();
    let mut anonymous = charge(Some("k-1"), "alice", 1999);
    anonymous.metadata_mut().remove("authorization");
    let anonymous = client.charge(anonymous).await.unwrap_err();

    assert_ne!(alice.get_ref().charge_id, bob.get_ref().charge_id);
    assert_eq!(served.provider.effects(), 2);
    assert_eq!(anonymous.code(), Code::Unauthenticated);
}

#[tokio::test]
async fn a_ledger_that_is_down_answers_unavailable_and_nothing_runs() {
    let served = serve_guarded(Provider::default(), layer_over(DownStore)).await;

    let status = client(&served)
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap_err();

    assert_eq!(status.code(), Code::Unavailable);
    assert!(status.metadata().get("grpc-retry-pushback-ms").is_some());
    assert_eq!(served.provider.calls(), 0);
}

#[tokio::test]
async fn reads_and_streaming_methods_pass_through_without_a_key() {
    let served = guarded(Provider::default()).await;
    let mut client = client(&served);

    let read = client
        .get_charge(GetChargeRequest {
            charge_id: "ch_9".into(),
        })
        .await
        .unwrap();
    let mut stream = client
        .list_charges(ListChargesRequest {
            order_id: "order_42".into(),
        })
        .await
        .unwrap()
        .into_inner();

    assert_eq!(read.get_ref().charge_id, "ch_9");
    assert_eq!(stream.message().await.unwrap().unwrap().charge_id, "ch_1");
    assert_eq!(
        stream.message().await.unwrap_err().code(),
        Code::Unavailable
    );
}

#[tokio::test]
async fn a_method_the_table_does_not_name_is_refused_not_run_unguarded() {
    let layer = ServerLayer::new(
        IdempotencyLayer::server(MemoryStore::new()),
        Methods::new().reads(GET_CHARGE),
    );
    let served = serve_guarded(Provider::default(), layer).await;

    let refused = client(&served)
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap_err();

    assert_eq!(refused.code(), Code::Internal);
    assert!(refused.message().contains(CHARGE), "{}", refused.message());
    assert_eq!(served.provider.calls(), 0);
}

#[tokio::test]
async fn the_key_can_come_from_the_request_message() {
    let layer = layer_over(MemoryStore::new()).key_source(KeySource::field(1));
    let served = serve_guarded(Provider::default(), layer).await;
    let mut client = client(&served);
    let with_request_id = |id: &str| {
        let mut request = charge(None, "alice", 1999);
        request.get_mut().request_id = id.into();
        request
    };

    let first = client.charge(with_request_id("req-1")).await.unwrap();
    let again = client.charge(with_request_id("req-1")).await.unwrap();
    let missing = client.charge(with_request_id("")).await.unwrap_err();

    assert_eq!(first.get_ref(), again.get_ref());
    assert_eq!(served.provider.effects(), 1);
    assert_eq!(missing.code(), Code::InvalidArgument);
}

#[tokio::test]
async fn a_handlers_unavailable_with_pushback_is_released_so_the_retry_runs() {
    let served = guarded(Provider::with_faults([Fault::Pushback("10")])).await;
    let mut client = client(&served);

    let turned_away = client
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap_err();
    let retried = client
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap();

    assert_eq!(turned_away.code(), Code::Unavailable);
    assert_eq!(retried.get_ref().charge_id, "ch_1");
    assert_eq!(served.provider.calls(), 2);
    assert_eq!(served.provider.effects(), 1);
}

#[tokio::test]
async fn an_answer_first_sent_to_a_gzip_client_is_replayed_to_one_that_accepts_no_compression() {
    let served = guarded(Provider::default()).await;
    let mut gzip = client(&served).accept_compressed(CompressionEncoding::Gzip);
    let mut plain = client(&served);

    let first = gzip
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap();
    let replayed = plain
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap();

    assert_eq!(first.get_ref(), replayed.get_ref());
    assert_eq!(served.provider.effects(), 1);
}

#[tokio::test]
async fn sixty_four_concurrent_duplicates_charge_once() {
    let served = guarded(Provider::with_faults([Fault::ChargeThenStall(
        Duration::from_millis(100),
    )]))
    .await;
    let calls = (0..64).map(|_| {
        let mut client = client(&served);
        tokio::spawn(async move { client.charge(charge(Some("k-64"), "alice", 1999)).await })
    });

    let mut answered = 0;
    for call in calls.collect::<Vec<_>>() {
        match call.await.unwrap() {
            Ok(reply) => {
                assert_eq!(reply.get_ref().charge_id, "ch_1");
                answered += 1;
            }
            Err(status) => assert_eq!(status.code(), Code::Aborted, "{status:?}"),
        }
    }

    assert!(answered >= 1);
    assert_eq!(served.provider.effects(), 1);
}
