//! Both gRPC layers together over loopback: the client's `RetryLayer` resending a keyed
//! charge's frozen bytes, the server's `ServerLayer` in front of the provider. A commit
//! followed by a timeout, a response lost with its connection, and 64 concurrent duplicates
//! each charge once.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::copy_bidirectional;
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::{Channel, Endpoint};
use tonic::Code;
use tower::ServiceBuilder;
use tower_idempotency::grpc::{Methods, Retry, RetryLayer, ServerLayer};
use tower_idempotency::retry::{Attempts, RetryPolicy};
use tower_idempotency::IdempotencyLayer;

use super::fixture::{serve_guarded, Fault, Provider, Served};
use super::server::{charge, layer_over, methods};
use crate::payments::paths::{CHARGE, GET_CHARGE, LIST_CHARGES};
use crate::payments::payments_client::PaymentsClient;
use crate::payments::GetChargeRequest;
use tower_idempotency::ledger::MemoryStore;

/// A client that retries `UNAVAILABLE` and a key in use (`ABORTED`), with `attempt_timeout`.
fn retrying_client(channel: Channel, attempt_timeout: Duration) -> PaymentsClient<Retry<Channel>> {
    let policy = RetryPolicy::builder()
        .max_attempts(5)
        .attempt_timeout(attempt_timeout)
        .backoff(Duration::from_millis(5), Duration::from_millis(50))
        .build()
        .unwrap();
    let layer =
        RetryLayer::new(policy, methods()).retryable_codes([Code::Unavailable, Code::Aborted]);
    PaymentsClient::new(ServiceBuilder::new().layer(layer).service(channel))
}

async fn guarded(provider: Provider) -> Served {
    let layer = layer_over(MemoryStore::new());
    serve_guarded(provider, layer).await
}

#[tokio::test]
async fn a_charge_committed_then_timed_out_is_answered_by_its_replay() {
    let served = guarded(Provider::with_faults([Fault::ChargeThenStall(
        Duration::from_millis(400),
    )]))
    .await;
    let mut client = retrying_client(served.channel(), Duration::from_millis(150));

    let reply = client
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap();

    assert_eq!(reply.get_ref().charge_id, "ch_1");
    assert_eq!(reply.metadata().get("idempotent-replayed").unwrap(), "true");
    assert!(reply.extensions().get::<Attempts>().unwrap().get() >= 2);
    assert_eq!(served.provider.effects(), 1);
    let seen = served.provider.seen();
    assert!(
        seen.iter().all(|s| s.body == seen[0].body),
        "every attempt sent the frozen bytes"
    );
}

#[tokio::test]
async fn a_charge_whose_response_was_lost_with_its_connection_is_charged_once() {
    let provider = Provider::with_faults([Fault::ChargeThenStall(Duration::from_millis(200))]);
    let served = guarded(provider.clone()).await;
    let proxy = cutting_proxy(served.addr, provider.clone()).await;
    let channel = Endpoint::from_shared(format!("http://{proxy}"))
        .unwrap()
        .connect_lazy();
    let mut client = retrying_client(channel, Duration::from_secs(5));

    let reply = client
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap();

    assert_eq!(reply.get_ref().charge_id, "ch_1");
    assert_eq!(reply.metadata().get("idempotent-replayed").unwrap(), "true");
    assert!(reply.extensions().get::<Attempts>().unwrap().get() >= 2);
    assert_eq!(provider.effects(), 1);
}

/// A proxy to `server` that cuts its first connection the moment `provider` has charged:
/// the request arrived and ran, and its response is lost with the connection.
async fn cutting_proxy(server: SocketAddr, provider: Provider) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let cut_done = Arc::new(AtomicBool::new(false));
    tokio::spawn(async move {
        loop {
            let Ok((mut client, _)) = listener.accept().await else {
                return;
            };
            let mut upstream = TcpStream::connect(server).await.unwrap();
            let cut = !cut_done.swap(true, Ordering::SeqCst);
            let provider = provider.clone();
            tokio::spawn(async move {
                if !cut {
                    let _ = copy_bidirectional(&mut client, &mut upstream).await;
                    return;
                }
                tokio::select! {
                    _ = copy_bidirectional(&mut client, &mut upstream) => {}
                    _ = charged(&provider) => {} // both sockets dropped: the connection is cut
                }
            });
        }
    });
    addr
}

async fn charged(provider: &Provider) {
    while provider.effects() == 0 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test]
async fn sixty_four_concurrent_retrying_duplicates_all_get_the_one_charge() {
    let served = guarded(Provider::with_faults([Fault::ChargeThenStall(
        Duration::from_millis(100),
    )]))
    .await;
    let calls: Vec<_> = (0..64)
        .map(|_| {
            let mut client = retrying_client(served.channel(), Duration::from_secs(5));
            tokio::spawn(async move { client.charge(charge(Some("k-64"), "alice", 1999)).await })
        })
        .collect();

    for call in calls {
        let reply = call.await.unwrap().unwrap();
        assert_eq!(reply.get_ref().charge_id, "ch_1");
    }

    assert_eq!(served.provider.effects(), 1);
}

#[tokio::test]
async fn a_keyed_charge_the_servers_table_calls_a_read_is_still_charged_once() {
    // The server's table mistakes the charge for a read; the client knows better and keys it.
    let misnamed = Methods::new()
        .reads(CHARGE)
        .reads(GET_CHARGE)
        .server_streaming(LIST_CHARGES);
    let layer = ServerLayer::new(IdempotencyLayer::server(MemoryStore::new()), misnamed);
    let served = serve_guarded(
        Provider::with_faults([Fault::ChargeThenStall(Duration::from_millis(400))]),
        layer,
    )
    .await;
    let mut client = retrying_client(served.channel(), Duration::from_millis(150));

    let reply = client
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap();

    assert!(reply.extensions().get::<Attempts>().unwrap().get() >= 2);
    assert_eq!(reply.get_ref().charge_id, "ch_1");
    assert_eq!(served.provider.effects(), 1);
}

#[tokio::test]
async fn a_read_without_a_key_still_passes_through_unrecorded() {
    let layer = ServerLayer::new(IdempotencyLayer::server(MemoryStore::new()), methods());
    let served = serve_guarded(Provider::default(), layer).await;
    let mut client = PaymentsClient::new(served.channel());
    let read = || GetChargeRequest {
        charge_id: "ch_9".into(),
    };

    let first = client.get_charge(read()).await.unwrap();
    let again = client.get_charge(read()).await.unwrap();

    assert!(first.metadata().get("idempotent-replayed").is_none());
    assert!(again.metadata().get("idempotent-replayed").is_none());
    assert_eq!(
        served.provider.calls(),
        2,
        "no key, no ledger: each read runs"
    );
}
