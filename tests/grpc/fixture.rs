//! A payments provider double served by a real tonic server over loopback: it counts the
//! charges it makes, fails on a script, and keeps every request as it arrived on the wire.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request};
use http_body_util::{BodyExt, Full};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tonic::codec::CompressionEncoding;
use tonic::codegen::tokio_stream;
use tonic::metadata::MetadataValue;
use tonic::transport::server::TcpIncoming;
use tonic::transport::{Channel, Endpoint};
use tonic::{Response, Status};
use tower_idempotency::grpc::ServerLayer;

use crate::payments::payments_server::{Payments, PaymentsServer};
use crate::payments::{ChargeReply, ChargeRequest, GetChargeRequest, ListChargesRequest};

/// What the provider does with one call, in the order calls arrive.
#[derive(Clone, Debug)]
pub enum Fault {
    /// Answer `UNAVAILABLE` before doing anything (trailers-only).
    Unavailable,
    /// Answer `UNAVAILABLE` with this `grpc-retry-pushback-ms`, before doing anything.
    Pushback(&'static str),
    /// Charge, then hold the answer this long.
    ChargeThenStall(Duration),
    /// Charge, then answer `UNAVAILABLE` as if it had not: the side effect happened.
    ChargeThenUnavailable,
    /// Decline: `FAILED_PRECONDITION` with a message, details and metadata, nothing charged.
    Decline,
    /// Fail with this code before charging (a rolled-back failure).
    Fail(tonic::Code),
}

/// One request as the server received it.
#[derive(Clone, Debug)]
pub struct Seen {
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

#[derive(Debug, Default)]
struct State {
    effects: AtomicUsize,
    calls: AtomicUsize,
    script: Mutex<VecDeque<Fault>>,
    seen: Mutex<Vec<Seen>>,
}

/// The provider; clones share their counts and script.
#[derive(Clone, Debug, Default)]
pub struct Provider {
    state: Arc<State>,
}

impl Provider {
    pub fn with_faults(faults: impl IntoIterator<Item = Fault>) -> Self {
        let provider = Self::default();
        provider.state.script.lock().unwrap().extend(faults);
        provider
    }

    /// Charges made.
    pub fn effects(&self) -> usize {
        self.state.effects.load(Ordering::SeqCst)
    }

    /// Calls that reached a handler.
    pub fn calls(&self) -> usize {
        self.state.calls.load(Ordering::SeqCst)
    }

    /// Every request as it arrived, in order.
    pub fn seen(&self) -> Vec<Seen> {
        self.state.seen.lock().unwrap().clone()
    }

    fn next_fault(&self) -> Option<Fault> {
        self.state.calls.fetch_add(1, Ordering::SeqCst);
        self.state.script.lock().unwrap().pop_front()
    }

    fn charge_once(&self, request: &ChargeRequest) -> ChargeReply {
        let n = self.state.effects.fetch_add(1, Ordering::SeqCst) + 1;
        ChargeReply {
            charge_id: format!("ch_{n}"),
            order_id: request.order_id.clone(),
            amount_cents: request.amount_cents,
        }
    }
}

fn unavailable_with_pushback(pushback: &'static str) -> Status {
    let mut status = Status::unavailable("provider overloaded");
    status.metadata_mut().insert(
        "grpc-retry-pushback-ms",
        MetadataValue::from_static(pushback),
    );
    status
}

/// A decline with everything a status can carry: a message needing percent-encoding,
/// binary details and custom metadata.
pub fn declined() -> Status {
    let mut metadata = tonic::metadata::MetadataMap::new();
    metadata.insert(
        "x-decline-code",
        MetadataValue::from_static("insufficient_funds"),
    );
    Status::with_details_and_metadata(
        tonic::Code::FailedPrecondition,
        "card declined: solde insuffisant (€)",
        Bytes::from_static(b"\x08\x01\x12\x03abc"),
        metadata,
    )
}

#[tonic::async_trait]
impl Payments for Provider {
    async fn charge(
        &self,
        request: tonic::Request<ChargeRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        let request = request.into_inner();
        match self.next_fault() {
            Some(Fault::Unavailable) => Err(Status::unavailable("provider restarting")),
            Some(Fault::Pushback(ms)) => Err(unavailable_with_pushback(ms)),
            Some(Fault::ChargeThenStall(stall)) => {
                let reply = self.charge_once(&request);
                tokio::time::sleep(stall).await;
                Ok(Response::new(reply))
            }
            Some(Fault::ChargeThenUnavailable) => {
                self.charge_once(&request);
                Err(Status::unavailable("provider restarting"))
            }
            Some(Fault::Decline) => Err(declined()),
            Some(Fault::Fail(code)) => Err(Status::new(code, "the charge failed and rolled back")),
            None => Ok(Response::new(self.charge_once(&request))),
        }
    }

    async fn get_charge(
        &self,
        request: tonic::Request<GetChargeRequest>,
    ) -> Result<Response<ChargeReply>, Status> {
        match self.next_fault() {
            Some(
                Fault::Unavailable | Fault::ChargeThenUnavailable | Fault::Decline | Fault::Fail(_),
            ) => Err(Status::unavailable("provider restarting")),
            Some(Fault::Pushback(ms)) => Err(unavailable_with_pushback(ms)),
            Some(Fault::ChargeThenStall(stall)) => {
                tokio::time::sleep(stall).await;
                Ok(Response::new(ChargeReply::default()))
            }
            None => Ok(Response::new(ChargeReply {
                charge_id: request.into_inner().charge_id,
                ..ChargeReply::default()
            })),
        }
    }

    type ListChargesStream = tokio_stream::Iter<std::vec::IntoIter<Result<ChargeReply, Status>>>;

    /// One charge, then `UNAVAILABLE` in the trailers: an answer committed by its headers.
    async fn list_charges(
        &self,
        request: tonic::Request<ListChargesRequest>,
    ) -> Result<Response<Self::ListChargesStream>, Status> {
        self.next_fault();
        let order_id = request.into_inner().order_id;
        let items = vec![
            Ok(ChargeReply {
                charge_id: "ch_1".into(),
                order_id,
                amount_cents: 100,
            }),
            Err(Status::unavailable("stream cut")),
        ];
        Ok(Response::new(tokio_stream::iter(items)))
    }
}

/// A provider served over loopback until dropped.
#[derive(Debug)]
pub struct Served {
    pub addr: SocketAddr,
    pub provider: Provider,
    _shutdown: oneshot::Sender<()>,
}

impl Served {
    /// A channel to the server, connecting on first use.
    pub fn channel(&self) -> Channel {
        Endpoint::from_shared(format!("http://{}", self.addr))
            .unwrap()
            .connect_lazy()
    }
}

/// Serve `provider` on a free loopback port, keeping each request's bytes as they arrived.
pub async fn serve(provider: Provider) -> Served {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    serve_on(listener, provider, addr).await
}

/// Serve `provider` on `listener`.
pub async fn serve_on(listener: TcpListener, provider: Provider, addr: SocketAddr) -> Served {
    let (shutdown, stopped) = oneshot::channel::<()>();
    let server = tonic::transport::Server::builder()
        .layer(capture(&provider))
        .add_service(PaymentsServer::new(provider.clone()))
        .serve_with_incoming_shutdown(TcpIncoming::from(listener), async {
            stopped.await.ok();
        });
    tokio::spawn(server);
    Served {
        addr,
        provider,
        _shutdown: shutdown,
    }
}

/// Serve `provider` behind the server `layer`, on a free loopback port; it compresses
/// answers with gzip for clients that accept it.
pub async fn serve_guarded(provider: Provider, layer: ServerLayer) -> Served {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    serve_guarded_on(listener, provider, layer).await
}

/// Serve `provider` behind the server `layer` on `listener`.
pub async fn serve_guarded_on(
    listener: TcpListener,
    provider: Provider,
    layer: ServerLayer,
) -> Served {
    let addr = listener.local_addr().unwrap();
    let (shutdown, stopped) = oneshot::channel::<()>();
    let service = PaymentsServer::new(provider.clone())
        .send_compressed(CompressionEncoding::Gzip)
        .accept_compressed(CompressionEncoding::Gzip);
    let server = tonic::transport::Server::builder()
        .layer(capture(&provider))
        .layer(layer)
        .add_service(service)
        .serve_with_incoming_shutdown(TcpIncoming::from(listener), async {
            stopped.await.ok();
        });
    tokio::spawn(server);
    Served {
        addr,
        provider,
        _shutdown: shutdown,
    }
}

fn capture<S>(provider: &Provider) -> impl tower::Layer<S, Service = Capture<S>> + Clone {
    let provider = provider.clone();
    tower::layer::layer_fn(move |inner| Capture {
        inner,
        provider: provider.clone(),
    })
}

/// Keeps each request's path, metadata and body bytes before the service reads them.
#[derive(Clone, Debug)]
struct Capture<S> {
    inner: S,
    provider: Provider,
}

impl<S> tower::Service<Request<tonic::body::Body>> for Capture<S>
where
    S: tower::Service<Request<tonic::body::Body>> + Clone + Send + 'static,
    S::Future: Send,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future =
        std::pin::Pin<Box<dyn std::future::Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<tonic::body::Body>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let provider = self.provider.clone();
        Box::pin(async move {
            let (parts, body) = req.into_parts();
            let body = body
                .collect()
                .await
                .map(|c| c.to_bytes())
                .unwrap_or_default();
            provider.state.seen.lock().unwrap().push(Seen {
                path: parts.uri.path().to_owned(),
                headers: parts.headers.clone(),
                body: body.clone(),
            });
            let req = Request::from_parts(parts, tonic::body::Body::new(Full::new(body)));
            inner.call(req).await
        })
    }
}
