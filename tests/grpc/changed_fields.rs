//! Another message under a used key, told as `FAILED_PRECONDITION`: with a method table read
//! from the descriptor set, its message names the top-level fields that changed (never their
//! values); a `map` re-encoded in another order is no changed field; without a descriptor
//! set, and for an answer recorded without digests, no field is named.

use bytes::{BufMut, BytesMut};
use http::{HeaderMap, Request};
use http_body_util::{BodyExt, Full};
use prost::Message;
use tonic::transport::Channel;
use tonic::{Code, Status};
use tower::ServiceExt;
use tower_idempotency::grpc::{Methods, ServerLayer};
use tower_idempotency::ledger::{IdempotencyStore, MemoryStore};
use tower_idempotency::IdempotencyLayer;

use super::descriptor::payments_descriptor_set;
use super::fixture::{serve_guarded, Provider, Served};
use super::server::{charge, layer_over};
use crate::payments::paths::CHARGE;
use crate::payments::payments_client::PaymentsClient;
use crate::payments::ChargeRequest;

/// The server layer with the method table read from the payments descriptor set.
fn described_layer(store: impl IdempotencyStore) -> ServerLayer {
    let methods = Methods::from_descriptor_set(&payments_descriptor_set()).unwrap();
    ServerLayer::new(IdempotencyLayer::server(store), methods)
}

fn client(served: &Served) -> PaymentsClient<Channel> {
    PaymentsClient::new(served.channel())
}

#[tokio::test]
async fn a_changed_amount_is_named_and_the_unchanged_order_id_is_not() {
    let served = serve_guarded(Provider::default(), described_layer(MemoryStore::new())).await;
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
    let message = drift.message();
    assert!(
        message.contains("fields changed: amount_cents"),
        "{message}"
    );
    assert!(!message.contains("order_id"), "{message}");
    // Names, never values.
    assert!(
        !message.contains("1999") && !message.contains("2999"),
        "{message}"
    );
    assert_eq!(served.provider.effects(), 1);
}

#[tokio::test]
async fn every_changed_field_is_named_in_field_number_order() {
    let served = serve_guarded(Provider::default(), described_layer(MemoryStore::new())).await;
    let mut client = client(&served);

    client
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap();
    let mut changed = charge(Some("k-1"), "alice", 2999);
    changed.get_mut().order_id = "order_43".into();
    changed
        .get_mut()
        .labels
        .insert("channel".into(), "web".into());
    let drift = client.charge(changed).await.unwrap_err();

    assert_eq!(drift.code(), Code::FailedPrecondition);
    assert!(
        drift
            .message()
            .contains("fields changed: order_id, amount_cents, labels"),
        "{}",
        drift.message()
    );
}

#[tokio::test]
async fn without_a_descriptor_set_the_refusal_names_no_field() {
    let served = serve_guarded(Provider::default(), layer_over(MemoryStore::new())).await;
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
    assert!(!drift.message().contains("amount_cents"), "{drift:?}");
    assert!(!drift.message().contains("fields changed"), "{drift:?}");
}

#[tokio::test]
async fn an_answer_recorded_without_digests_still_replays_and_its_drift_names_no_field() {
    // Recorded by a layer without a descriptor set: the trailer block of the first format,
    // with no field digests. Then the server is given one, over the same store.
    let store = MemoryStore::new();
    let before = serve_guarded(Provider::default(), layer_over(store.clone())).await;
    let first = client(&before)
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap();
    drop(before);
    let after = serve_guarded(Provider::default(), described_layer(store)).await;
    let mut client = client(&after);

    let replayed = client
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap();
    let drift = client
        .charge(charge(Some("k-1"), "alice", 2999))
        .await
        .unwrap_err();

    assert_eq!(replayed.get_ref(), first.get_ref());
    assert_eq!(
        replayed.metadata().get("idempotent-replayed").unwrap(),
        "true"
    );
    assert_eq!(after.provider.calls(), 0);
    assert_eq!(drift.code(), Code::FailedPrecondition);
    assert!(!drift.message().contains("fields changed"), "{drift:?}");
}

#[tokio::test]
async fn a_map_encoded_in_another_order_is_no_changed_field() {
    let served = serve_guarded(Provider::default(), described_layer(MemoryStore::new())).await;
    let channel = served.channel();
    let labels = [("channel", "web"), ("campaign", "spring")];
    let reversed = [labels[1], labels[0]];

    let first = raw_charge(&channel, "k-1", 1999, &labels).await;
    // The same fields, the map's entries in the other order: other bytes, so still refused
    // (the fingerprint is of the bytes), but no field is named as changed.
    let reordered = raw_charge(&channel, "k-1", 1999, &reversed).await;
    // The amount changed and the map reordered: only the amount is named.
    let amount = raw_charge(&channel, "k-1", 2999, &reversed).await;

    assert_eq!(first.code(), Code::Ok, "{first:?}");
    assert_eq!(reordered.code(), Code::FailedPrecondition);
    assert!(
        reordered.message().contains("no field changed"),
        "{reordered:?}"
    );
    assert!(!reordered.message().contains("labels"), "{reordered:?}");
    assert_eq!(amount.code(), Code::FailedPrecondition);
    assert!(
        amount.message().contains("fields changed: amount_cents;"),
        "{amount:?}"
    );
    assert_eq!(served.provider.effects(), 1);
}

/// A `ChargeRequest` written by hand, its `labels` entries in the order given (prost would
/// write them in its map's hash order), sent as one unary call; its status.
async fn raw_charge(channel: &Channel, key: &str, amount: i64, labels: &[(&str, &str)]) -> Status {
    let mut message = ChargeRequest {
        request_id: String::new(),
        order_id: "order_42".into(),
        amount_cents: amount,
        labels: Default::default(),
    }
    .encode_to_vec();
    for (name, value) in labels {
        let entry = [string_field(1, name), string_field(2, value)].concat();
        message.push(4 << 3 | 2);
        prost::encoding::encode_varint(entry.len() as u64, &mut message);
        message.extend(entry);
    }
    let mut body = BytesMut::new();
    body.put_u8(0);
    body.put_u32(message.len() as u32);
    body.put_slice(&message);
    let request = Request::post(format!("http://payments.local{CHARGE}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("authorization", "Bearer alice")
        .header("idempotency-key", key)
        .body(tonic::body::Body::new(Full::new(body.freeze())))
        .unwrap();
    let response = channel.clone().oneshot(request).await.unwrap();
    let (parts, body) = response.into_parts();
    let collected = body.collect().await.unwrap();
    let trailers = collected.trailers().cloned().unwrap_or_default();
    status_of(&parts.headers)
        .or_else(|| status_of(&trailers))
        .expect("a gRPC status in the headers or the trailers")
}

/// The status in `headers`, if they carry one (a trailers-only answer's, or trailers).
fn status_of(headers: &HeaderMap) -> Option<Status> {
    headers
        .contains_key("grpc-status")
        .then(|| Status::from_header_map(headers))
        .flatten()
}

fn string_field(number: u8, value: &str) -> Vec<u8> {
    let mut out = vec![number << 3 | 2, value.len() as u8];
    out.extend_from_slice(value.as_bytes());
    out
}
