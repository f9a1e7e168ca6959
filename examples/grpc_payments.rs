//! A gRPC payments service and its client, each behind its idempotency layer, over loopback.
//!
//! The provider charges the card, then takes longer than the client waits; the client's
//! retry resends the frozen message under the same key, the server answers "in flight",
//! then replays the first answer. One charge.
//!
//! ```text
//! cargo run --example grpc_payments --features tonic
//! ```

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Endpoint, Server};
use tonic::{Code, Request, Response, Status};
use tower::ServiceBuilder;
use tower_idempotency::grpc::{ClientLayer, Methods, RetryLayer, ServerLayer};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::{IdempotencyLayer, KeyHeader, OperationId};

#[path = "../tests/support/grpc/mod.rs"]
mod payments;

use payments::payments_client::PaymentsClient;
use payments::payments_server::{Payments, PaymentsServer};
use payments::{ChargeReply, ChargeRequest, GetChargeRequest, ListChargesRequest};

/// A provider whose first charge is slow to answer.
#[derive(Default)]
struct Provider {
    charges: AtomicUsize,
}

#[tonic::async_trait]
impl Payments for Provider {
    async fn charge(
        &self,
        request: Request<ChargeRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        let request = request.into_inner();
        let n = self.charges.fetch_add(1, Ordering::SeqCst) + 1;
        println!(
            "provider: charging {} cents for {} (charge #{n})",
            request.amount_cents, request.order_id
        );
        if n == 1 {
            tokio::time::sleep(Duration::from_millis(600)).await;
        }
        Ok(Response::new(ChargeReply {
            charge_id: format!("ch_{n}"),
            order_id: request.order_id,
            amount_cents: request.amount_cents,
        }))
    }

    async fn get_charge(
        &self,
        request: Request<GetChargeRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        Ok(Response::new(ChargeReply {
            charge_id: request.into_inner().charge_id,
            ..ChargeReply::default()
        }))
    }

    type ListChargesStream = tonic::codegen::tokio_stream::Empty<Result<ChargeReply, Status>>;

    async fn list_charges(
        &self,
        _request: Request<ListChargesRequest>,
    ) -> Result<Response<Self::ListChargesStream>, Status> {
        Ok(Response::new(tonic::codegen::tokio_stream::empty()))
    }
}

fn methods() -> Methods {
    Methods::new()
        .unary(payments::paths::CHARGE)
        .reads(payments::paths::GET_CHARGE)
        .server_streaming(payments::paths::LIST_CHARGES)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
    // The server: the server face in front of the generated service.
    let provider = Arc::new(Provider::default());
    let guard = ServerLayer::new(IdempotencyLayer::server(MemoryStore::new()), methods());
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let server = Server::builder()
        .layer(guard)
        .add_service(PaymentsServer::from_arc(provider.clone()))
        .serve_with_incoming(TcpIncoming::from(listener));
    tokio::spawn(server);

    // The client: once per operation outside, retries of the frozen bytes inside.
    let policy = RetryPolicy::builder()
        .attempt_timeout(Duration::from_millis(250))
        .max_attempts(5)
        .build()?;
    let face = IdempotencyLayer::client_builder(MemoryStore::new())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .retry_policy(policy.clone())
        .build()?;
    let retry =
        RetryLayer::new(policy, methods()).retryable_codes([Code::Unavailable, Code::Aborted]);
    let channel = Endpoint::from_shared(format!("http://{addr}"))?.connect_lazy();
    let mut client = PaymentsClient::new(
        ServiceBuilder::new()
            .layer(ClientLayer::new(face, methods()))
            .layer(retry)
            .service(channel),
    );

    let mut charge = Request::new(ChargeRequest {
        request_id: String::new(),
        order_id: "order_42".into(),
        amount_cents: 1999,
        labels: [("channel".to_owned(), "agent".to_owned())].into(),
    });
    charge
        .metadata_mut()
        .insert("authorization", "Bearer sk_test_alice".parse()?);
    charge
        .extensions_mut()
        .insert(OperationId::new("task-7", "charge_customer"));
    let reply = client.charge(charge).await?;

    println!(
        "client: {} (replayed: {})",
        reply.get_ref().charge_id,
        reply.metadata().get("idempotent-replayed").is_some()
    );
    println!("charges made: {}", provider.charges.load(Ordering::SeqCst));
    assert_eq!(provider.charges.load(Ordering::SeqCst), 1);
    Ok(())
}
