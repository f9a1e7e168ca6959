//! A gRPC answer's trailers are recorded on every store: a declined charge replayed from
//! Redis, a Redis Cluster and PostgreSQL as it was first answered, and a server restarted
//! over Redis that replays instead of charging again.

use tower_idempotency::ledger::{IdempotencyStore, PostgresStore, RedisStore};

use super::fixture::{serve_guarded, serve_guarded_on, Fault, Provider};
use super::server::{charge, layer_over};
use crate::payments::payments_client::PaymentsClient;
use crate::support::postgres::{fresh_schema, postgres_url};
use crate::support::redis::{redis_url, RedisServer};
use crate::support::redis_cluster::RedisCluster;

/// A declined charge and its retry through `store`: the retry is the first answer again,
/// code, message, details and metadata, and the provider was called once.
async fn a_decline_is_replayed_whole(store: impl IdempotencyStore) {
    let served = serve_guarded(Provider::with_faults([Fault::Decline]), layer_over(store)).await;
    let mut client = PaymentsClient::new(served.channel());

    let first = client
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap_err();
    let again = client
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap_err();

    assert_eq!(served.provider.calls(), 1, "{first:?}");
    assert_eq!(again.code(), first.code());
    assert_eq!(again.message(), first.message());
    assert_eq!(again.details(), first.details());
    assert_eq!(
        again.metadata().get("x-decline-code"),
        first.metadata().get("x-decline-code")
    );
    assert_eq!(again.metadata().get("idempotent-replayed").unwrap(), "true");
}

#[tokio::test]
async fn redis_replays_a_grpc_answer_with_its_trailers() {
    let Some(redis) = redis_url().await else {
        return;
    };
    let store = RedisStore::builder(redis.url()).connect().await.unwrap();
    a_decline_is_replayed_whole(store).await;
}

#[tokio::test]
async fn a_redis_cluster_replays_a_grpc_answer_with_its_trailers() {
    let Some(cluster) = RedisCluster::spawn(3, 0).await else {
        return;
    };
    let store = RedisStore::cluster_builder(cluster.urls())
        .connect()
        .await
        .unwrap();
    a_decline_is_replayed_whole(store).await;
}

#[tokio::test]
async fn postgres_replays_a_grpc_answer_with_its_trailers() {
    let Some(postgres) = postgres_url().await else {
        return;
    };
    let store = PostgresStore::builder(postgres.url())
        .schema(fresh_schema())
        .connect()
        .await
        .unwrap();
    store.migrate().await.unwrap();
    a_decline_is_replayed_whole(store).await;
}

#[tokio::test]
async fn a_server_restarted_over_a_restarted_redis_replays_instead_of_charging_again() {
    let Some(mut redis) = RedisServer::spawn_durable().await else {
        return;
    };
    let provider = Provider::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let store = RedisStore::builder(redis.url()).connect().await.unwrap();
    let before = serve_guarded_on(listener, provider.clone(), layer_over(store)).await;
    let first = PaymentsClient::new(before.channel())
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap();

    // The service and its ledger go down and come back: a new process, the same Redis data.
    drop(before);
    redis.restart().await;
    let listener = rebind(addr).await;
    let store = RedisStore::builder(redis.url()).connect().await.unwrap();
    let after = serve_guarded_on(listener, provider.clone(), layer_over(store)).await;
    let again = PaymentsClient::new(after.channel())
        .charge(charge(Some("k-1"), "alice", 1999))
        .await
        .unwrap();

    assert_eq!(again.get_ref(), first.get_ref());
    assert_eq!(provider.effects(), 1);
}

/// The port a stopped server held, bound again (the kernel may hold it a moment).
async fn rebind(addr: std::net::SocketAddr) -> tokio::net::TcpListener {
    for _ in 0..50 {
        if let Ok(listener) = tokio::net::TcpListener::bind(addr).await {
            return listener;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    panic!("{addr} could not be bound again");
}
