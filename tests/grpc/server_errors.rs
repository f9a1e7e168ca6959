//! The face's `ServerErrorPolicy` applied to a handler's gRPC status: `INTERNAL`, `UNKNOWN`,
//! `DATA_LOSS` and `UNAVAILABLE` are its server errors. Under `Record` (the default) they are
//! the key's outcome, replayed; under `Release` the key is released and the retry runs the
//! handler again. Every other status is recorded under both.

use tonic::transport::Channel;
use tonic::Code;
use tower_idempotency::grpc::ServerLayer;
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::{IdempotencyLayer, ServerErrorPolicy};

use super::fixture::{serve_guarded, Fault, Provider, Served};
use super::server::{charge, layer_over, methods};
use crate::payments::payments_client::PaymentsClient;

fn releasing_layer() -> ServerLayer {
    let face = IdempotencyLayer::server_builder(MemoryStore::new())
        .server_error_policy(ServerErrorPolicy::Release)
        .build()
        .unwrap();
    ServerLayer::new(face, methods())
}

fn client(served: &Served) -> PaymentsClient<Channel> {
    PaymentsClient::new(served.channel())
}

#[tokio::test]
async fn under_release_an_internal_releases_the_key_and_the_retry_runs_the_handler_again() {
    let provider = Provider::with_faults([Fault::Fail(Code::Internal)]);
    let served = serve_guarded(provider, releasing_layer()).await;
    let mut client = client(&served);

    let failed = client
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap_err();
    let retried = client
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap();
    let replayed = client
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap();

    assert_eq!(failed.code(), Code::Internal);
    assert!(retried.metadata().get("idempotent-replayed").is_none());
    assert_eq!(retried.get_ref().charge_id, "ch_1");
    // The success is the key's outcome.
    assert_eq!(
        replayed.metadata().get("idempotent-replayed").unwrap(),
        "true"
    );
    assert_eq!(served.provider.calls(), 2);
    assert_eq!(served.provider.effects(), 1);
}

#[tokio::test]
async fn under_record_an_internal_is_the_keys_outcome_replayed_without_a_second_run() {
    let provider = Provider::with_faults([Fault::Fail(Code::Internal)]);
    let served = serve_guarded(provider, layer_over(MemoryStore::new())).await;
    let mut client = client(&served);

    let failed = client
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap_err();
    let again = client
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap_err();

    assert_eq!(failed.code(), Code::Internal);
    assert_eq!(again.code(), Code::Internal);
    assert_eq!(again.message(), failed.message());
    assert_eq!(again.metadata().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(served.provider.calls(), 1);
}

#[tokio::test]
async fn under_release_every_server_error_code_is_released_and_other_codes_are_recorded() {
    for code in [
        Code::Internal,
        Code::Unknown,
        Code::DataLoss,
        Code::Unavailable,
    ] {
        let served = serve_guarded(
            Provider::with_faults([Fault::Fail(code)]),
            releasing_layer(),
        )
        .await;
        let mut client = client(&served);

        let failed = client
            .charge(charge(Some("k-1"), "alice", 1999))
            .await
            .unwrap_err();
        let retried = client.charge(charge(Some("k-1"), "alice", 1999)).await;

        assert_eq!(failed.code(), code);
        assert!(retried.is_ok(), "{code:?}: {retried:?}");
        assert_eq!(served.provider.calls(), 2, "{code:?}");
    }
    for code in [
        Code::FailedPrecondition,
        Code::InvalidArgument,
        Code::NotFound,
        Code::DeadlineExceeded,
    ] {
        let served = serve_guarded(
            Provider::with_faults([Fault::Fail(code)]),
            releasing_layer(),
        )
        .await;
        let mut client = client(&served);

        let failed = client
            .charge(charge(Some("k-1"), "alice", 1999))
            .await
            .unwrap_err();
        let again = client
            .charge(charge(Some("k-1"), "alice", 1999))
            .await
            .unwrap_err();

        assert_eq!(failed.code(), code);
        assert_eq!(again.code(), code);
        assert_eq!(again.metadata().get("idempotent-replayed").unwrap(), "true");
        assert_eq!(served.provider.calls(), 1, "{code:?}");
    }
}

#[tokio::test]
async fn under_record_an_unavailable_without_pushback_is_recorded_and_one_with_it_released() {
    let served = serve_guarded(
        Provider::with_faults([Fault::Fail(Code::Unavailable), Fault::Pushback("10")]),
        layer_over(MemoryStore::new()),
    )
    .await;
    let mut client = client(&served);

    let failed = client
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap_err();
    let again = client
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap_err();
    let pushed_back = client
        .charge(charge(Some("k-2"), "alice", 1999))
        .await
        .unwrap_err();
    let retried = client
        .charge(charge(Some("k-2"), "alice", 1999))
        .await
        .unwrap();

    assert_eq!(failed.code(), Code::Unavailable);
    assert_eq!(again.metadata().get("idempotent-replayed").unwrap(), "true");
    assert_eq!(pushed_back.code(), Code::Unavailable);
    assert!(retried.metadata().get("idempotent-replayed").is_none());
    // k-1 once, k-2 twice.
    assert_eq!(served.provider.calls(), 3);
    assert_eq!(served.provider.effects(), 1);
}
