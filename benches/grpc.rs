//! What the gRPC layers cost a unary call over loopback.
//!
//! ```text
//! cargo bench --bench grpc --features tonic [-- CALLS]
//! ```
//!
//! A tonic server and a tonic channel in one process, over loopback TCP (HTTP/2), calling the
//! generated payments service of tests/support/grpc. Calls are sequential (one in flight),
//! so each variant's number is a round trip's latency; the variants run in interleaved
//! rounds so that a noisy neighbour hits them all alike. Printed: the mean microseconds per
//! call of each, and the ratios asked of the layers.
//!
//! | variant | client | server |
//! |---|---|---|
//! | `bare` | `PaymentsClient` over a `Channel` | the generated service |
//! | `protected` | `ClientLayer` (a new `OperationId` per call) over `RetryLayer` | `ServerLayer` (`MemoryStore`) |
//! | `retry_layer` | `RetryLayer` over the channel (no failures: the cost of freezing) | the generated service |
//! | `clone_and_retry` | a hand-written retry: the message cloned before each call, re-encoded by tonic on a retry | the generated service |

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint, Server};
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

#[derive(Default)]
struct Provider {
    charges: AtomicU64,
}

#[tonic::async_trait]
impl Payments for Provider {
    async fn charge(
        &self,
        request: Request<ChargeRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        let request = request.into_inner();
        let n = self.charges.fetch_add(1, Ordering::Relaxed);
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

fn charge_message() -> ChargeRequest {
    ChargeRequest {
        request_id: String::new(),
        order_id: "order_42".into(),
        amount_cents: 1999,
        labels: (0..4)
            .map(|i| (format!("label-{i}"), format!("value-{i}")))
            .collect(),
    }
}

fn charge(n: u64) -> Request<ChargeRequest> {
    let mut request = Request::new(charge_message());
    request
        .metadata_mut()
        .insert("authorization", "Bearer sk_bench".parse().unwrap());
    request
        .extensions_mut()
        .insert(OperationId::new(format!("task-{n}"), "charge"));
    request
}

async fn serve(guarded: bool) -> Channel {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let service = PaymentsServer::new(Provider::default());
    let incoming = TcpIncoming::from(listener);
    if guarded {
        let layer = ServerLayer::new(IdempotencyLayer::server(MemoryStore::new()), methods());
        tokio::spawn(
            Server::builder()
                .layer(layer)
                .add_service(service)
                .serve_with_incoming(incoming),
        );
    } else {
        tokio::spawn(
            Server::builder()
                .add_service(service)
                .serve_with_incoming(incoming),
        );
    }
    Endpoint::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap()
}

/// A retry written by hand: the message cloned before each attempt, retried on `UNAVAILABLE`.
async fn clone_and_retry(client: &mut PaymentsClient<Channel>, message: &ChargeRequest) {
    for _ in 0..3 {
        match client.charge(Request::new(message.clone())).await {
            Err(status) if status.code() == Code::Unavailable => continue,
            result => {
                result.unwrap();
                return;
            }
        }
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let calls: u64 = std::env::args()
        .skip(1)
        .find_map(|arg| arg.parse().ok())
        .unwrap_or(2_000);
    let rounds = 5;
    let per_round = calls / rounds;

    let mut bare = PaymentsClient::new(serve(false).await);
    let face = IdempotencyLayer::client_builder(MemoryStore::new())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .build()
        .unwrap();
    let mut protected = PaymentsClient::new(
        ServiceBuilder::new()
            .layer(ClientLayer::new(face, methods()))
            .layer(RetryLayer::new(RetryPolicy::default(), methods()))
            .service(serve(true).await),
    );
    let mut retrying = PaymentsClient::new(
        ServiceBuilder::new()
            .layer(RetryLayer::new(RetryPolicy::default(), methods()))
            .service(serve(false).await),
    );
    let mut hand_written = PaymentsClient::new(serve(false).await);

    let mut spent = [Duration::ZERO; 4];
    let mut operation = 0;
    let message = charge_message();
    // One warm-up round, not counted; each round starts with another variant, so that
    // none always runs first (or last) in a round.
    for round in 0..=rounds {
        for turn in 0..4 {
            let variant = (round as usize + turn) % 4;
            let started = Instant::now();
            for _ in 0..per_round {
                match variant {
                    0 => {
                        bare.charge(Request::new(message.clone())).await.unwrap();
                    }
                    1 => {
                        operation += 1;
                        protected.charge(charge(operation)).await.unwrap();
                    }
                    2 => {
                        retrying
                            .charge(Request::new(message.clone()))
                            .await
                            .unwrap();
                    }
                    _ => clone_and_retry(&mut hand_written, &message).await,
                }
            }
            if round > 0 {
                spent[variant] += started.elapsed();
            }
        }
    }

    let mean = |total: Duration| total.as_secs_f64() * 1e6 / (per_round * rounds) as f64;
    let [bare, protected, retry, hand] = spent.map(mean);
    println!("calls per variant: {}", per_round * rounds);
    println!("bare              {bare:8.1} µs/call");
    println!(
        "protected         {protected:8.1} µs/call   ratio to bare {:.2}x",
        protected / bare
    );
    println!(
        "retry_layer       {retry:8.1} µs/call   ratio to bare {:.2}x",
        retry / bare
    );
    println!(
        "clone_and_retry   {hand:8.1} µs/call   ratio to bare {:.2}x",
        hand / bare
    );
    println!("retry_layer / clone_and_retry {:.2}x", retry / hand);
}
