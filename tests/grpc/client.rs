//! `grpc::ClientLayer` in front of a real channel: an operation's charge sent once, its key
//! in metadata, its answer (status and trailers too) replayed from the client's ledger,
//! a doubtful call resent with its frozen bytes under the same key.

use tonic::transport::Channel;
use tonic::Code;
use tower::ServiceBuilder;
use tower_idempotency::grpc::{ClientLayer, IdempotentClient, Methods, ServerLayer};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::{IdempotencyLayer, KeyHeader, OperationId};

use super::fixture::{serve, serve_guarded, Fault, Provider, Served};
use super::server::{charge, layer_over, methods};
use crate::payments::paths::{CHARGE, GET_CHARGE, LIST_CHARGES};
use crate::payments::payments_client::PaymentsClient;
use crate::payments::GetChargeRequest;

fn client_over(served: &Served, store: &MemoryStore) -> PaymentsClient<IdempotentClient<Channel>> {
    let face = IdempotencyLayer::client_builder(store.clone())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .build()
        .unwrap();
    PaymentsClient::new(
        ServiceBuilder::new()
            .layer(ClientLayer::new(face, methods()))
            .service(served.channel()),
    )
}

fn operation_charge(task: &str) -> tonic::Request<crate::payments::ChargeRequest> {
    let mut request = charge(None, "alice", 1999);
    request
        .extensions_mut()
        .insert(OperationId::new(task, "charge_customer"));
    request
}

#[tokio::test]
async fn an_operation_run_again_is_answered_from_the_ledger_without_a_call() {
    let served = serve_guarded(Provider::default(), layer_over(MemoryStore::new())).await;
    let store = MemoryStore::new();

    let first = client_over(&served, &store)
        .charge(operation_charge("task-7"))
        .await
        .unwrap();
    let again = client_over(&served, &store)
        .charge(operation_charge("task-7"))
        .await
        .unwrap();

    assert_eq!(first.get_ref(), again.get_ref());
    assert_eq!(served.provider.calls(), 1);
    let key = served.provider.seen()[0].headers["idempotency-key"].clone();
    assert_eq!(key.len(), 66, "a derived key, quoted: {key:?}");
}

#[tokio::test]
async fn a_declined_charge_is_the_operations_outcome_replayed_whole() {
    let served = serve(Provider::with_faults([Fault::Decline])).await;
    let store = MemoryStore::new();

    let first = client_over(&served, &store)
        .charge(operation_charge("task-7"))
        .await
        .unwrap_err();
    let again = client_over(&served, &store)
        .charge(operation_charge("task-7"))
        .await
        .unwrap_err();

    assert_eq!(served.provider.calls(), 1);
    assert_eq!(first.code(), Code::FailedPrecondition);
    assert_eq!(again.code(), first.code());
    assert_eq!(again.message(), first.message());
    assert_eq!(again.details(), first.details());
    assert_eq!(
        again.metadata().get("x-decline-code"),
        first.metadata().get("x-decline-code")
    );
}

#[tokio::test]
async fn an_unavailable_answer_leaves_the_operation_in_doubt_and_the_next_run_resends_its_bytes() {
    let served = serve(Provider::with_faults([Fault::Unavailable])).await;
    let store = MemoryStore::new();

    let failed = client_over(&served, &store)
        .charge(operation_charge("task-7"))
        .await
        .unwrap_err();
    let mut regenerated = operation_charge("task-7");
    regenerated
        .get_mut()
        .labels
        .insert("retry".into(), "yes".into());
    let resumed = client_over(&served, &store)
        .charge(regenerated)
        .await
        .unwrap();

    assert_eq!(failed.code(), Code::Unavailable);
    assert_eq!(resumed.get_ref().charge_id, "ch_1");
    assert_eq!(served.provider.effects(), 1);
    let seen = served.provider.seen();
    assert_eq!(seen.len(), 2);
    assert_eq!(
        seen[0].body, seen[1].body,
        "the resume resent the frozen bytes"
    );
    assert_eq!(
        seen[0].headers["idempotency-key"],
        seen[1].headers["idempotency-key"]
    );
}

#[tokio::test]
async fn a_charge_without_an_operation_is_refused_before_sending_and_reads_pass() {
    let served = serve(Provider::default()).await;
    let mut client = client_over(&served, &MemoryStore::new());

    let refused = client
        .charge(charge(None, "alice", 1999))
        .await
        .unwrap_err();
    let read = client
        .get_charge(GetChargeRequest {
            charge_id: "ch_3".into(),
        })
        .await
        .unwrap();

    assert_ne!(refused.code(), Code::Ok);
    assert_eq!(read.get_ref().charge_id, "ch_3");
    assert_eq!(
        served.provider.calls(),
        1,
        "only the read reached the provider"
    );
}

#[tokio::test]
async fn a_charge_to_a_method_the_table_forgot_is_refused_before_sending_not_passed_through() {
    let served = serve(Provider::default()).await;
    let face = IdempotencyLayer::client_builder(MemoryStore::new())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .build()
        .unwrap();
    // A newcomer's table that names the read and forgets the charge.
    let forgetful = tower_idempotency::grpc::Methods::new()
        .reads(crate::payments::paths::GET_CHARGE)
        .server_streaming(crate::payments::paths::LIST_CHARGES);
    let mut client = PaymentsClient::new(
        ServiceBuilder::new()
            .layer(ClientLayer::new(face, forgetful))
            .service(served.channel()),
    );

    let first = client.charge(operation_charge("task-9")).await.unwrap_err();
    let again = client.charge(operation_charge("task-9")).await.unwrap_err();

    assert_eq!(served.provider.calls(), 0, "nothing reached the provider");
    for refused in [first, again] {
        let ours = std::error::Error::source(&refused)
            .and_then(tower_idempotency::Error::find)
            .expect("our error is the status's source");
        assert!(ours.is_method_not_listed(), "{ours}");
        assert!(
            ours.to_string().contains("Charge"),
            "names the method: {ours}"
        );
    }
}

/// The table of [`methods`], with `Charge` declared `IDEMPOTENT`.
fn charge_declared_idempotent() -> Methods {
    Methods::new()
        .idempotent(CHARGE)
        .reads(GET_CHARGE)
        .server_streaming(LIST_CHARGES)
}

fn client_with(
    served: &Served,
    store: &MemoryStore,
    methods: Methods,
) -> PaymentsClient<IdempotentClient<Channel>> {
    let face = IdempotencyLayer::client_builder(store.clone())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .build()
        .unwrap();
    PaymentsClient::new(
        ServiceBuilder::new()
            .layer(ClientLayer::new(face, methods))
            .service(served.channel()),
    )
}

#[tokio::test]
async fn an_idempotent_methods_operation_run_again_is_answered_from_the_ledger_with_its_key_sent() {
    // A charge declared IDEMPOTENT that is not: the operation still runs once.
    let served = serve(Provider::default()).await;
    let store = MemoryStore::new();

    let first = client_with(&served, &store, charge_declared_idempotent())
        .charge(operation_charge("task-7"))
        .await
        .unwrap();
    let again = client_with(&served, &store, charge_declared_idempotent())
        .charge(operation_charge("task-7"))
        .await
        .unwrap();

    assert_eq!(first.get_ref(), again.get_ref());
    assert_eq!(served.provider.effects(), 1);
    let key = served.provider.seen()[0].headers["idempotency-key"].clone();
    assert_eq!(key.len(), 66, "a derived key, quoted: {key:?}");
}

#[tokio::test]
async fn an_idempotent_methods_operation_is_accepted_by_a_server_layer_that_guards_it() {
    let served = serve_guarded(
        Provider::default(),
        ServerLayer::new(
            IdempotencyLayer::server(MemoryStore::new()),
            charge_declared_idempotent(),
        ),
    )
    .await;

    let reply = client_with(&served, &MemoryStore::new(), charge_declared_idempotent())
        .charge(operation_charge("task-7"))
        .await
        .unwrap();

    assert_eq!(reply.get_ref().charge_id, "ch_1");
    assert_eq!(served.provider.effects(), 1);
}

#[tokio::test]
async fn an_idempotent_methods_call_without_an_operation_passes_through_unkeyed() {
    let served = serve(Provider::default()).await;
    let store = MemoryStore::new();

    for _ in 0..2 {
        client_with(&served, &store, charge_declared_idempotent())
            .charge(charge(None, "alice", 1999))
            .await
            .unwrap();
    }

    assert_eq!(served.provider.calls(), 2, "no operation, no ledger");
    assert!(served
        .provider
        .seen()
        .iter()
        .all(|seen| !seen.headers.contains_key("idempotency-key")));
}
