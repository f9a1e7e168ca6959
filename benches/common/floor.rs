//! A yardstick for the client layer, not one of its code paths: the least a client layer
//! that keeps the ledger's promise does per operation, written as plainly as the crate's
//! public parts allow. `benches/op_cost.rs` counts its instructions and allocations
//! (`client_floor`, `client_floor_replay`, `stack_floor`) and `benches/loopback_bench.rs`
//! runs it over hyper (`client_floor`), so that the layer's figures can be read against
//! what the work itself costs.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Full};
use tower::{Service, ServiceExt};
use tower_idempotency::digest::{BodyDigest, CONTENT_DIGEST};
use tower_idempotency::key::IDEMPOTENCY_KEY;
use tower_idempotency::ledger::{
    Begin, BeginRequest, IdempotencyStore, LedgerKey, MemoryStore, Outcome, StoredResponse,
};
use tower_idempotency::{fingerprint::Fingerprint, FrozenRequest, OperationId};

/// The floor over `inner` (see the module docs).
///
/// For one operation it derives the key from the request's `OperationId` and puts it on
/// the request, reads and hashes the body and sends its `Content-Digest`, freezes the
/// request for the operation (`with_operation`: the record shows the operation's task and
/// step, as every record of an `OperationId` must) and claims the operation with it (kept for a resume; fingerprinted as the layer
/// fingerprints it, the absolute URI its target), sends a request rebuilt
/// from the frozen one, reads the answer, records it and hands it back; or, for an
/// operation already recorded, builds the answer from the record. Nothing else: no
/// response marking (`ResponseSource`), no lease guard or renewal, no hand-off to a retry
/// layer, no limits, checks, spans or hooks, and no path but "new operation" and "replay".
/// It reads a one-frame body as the layers do (no buffer list), and records the response's
/// headers by reference (`StoredResponse::new(.., &parts.headers, ..)`), copying them into
/// the record as the layer does; everything it does, the layer does too. Like the layer, it
/// makes the key's and the digest's header values in one allocation. (It hands its inner
/// service the caller's extensions as they are: the hand-written `tower::retry` of
/// `stack_floor` copies none of them into its attempts.)
pub struct Floor<S> {
    pub inner: S,
    pub store: MemoryStore,
    /// Operations answered from the ledger.
    pub replays: u64,
}

/// The client layer's settings as the benches run it.
const LEASE: Duration = super::BENCH_PROTECTION;
const RETENTION: Duration = Duration::from_secs(24 * 3600);

impl<S, ResB> Floor<S>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
    S::Error: std::fmt::Debug,
    ResB: Body<Data = Bytes> + Unpin,
    ResB::Error: std::fmt::Debug,
{
    pub fn new(inner: S, store: MemoryStore) -> Self {
        Self {
            inner,
            store,
            replays: 0,
        }
    }

    /// One operation (see the type's docs); panics on anything but a new operation or a
    /// replay.
    pub async fn call(&mut self, req: Request<Full<Bytes>>) -> Response<Full<Bytes>> {
        let (mut parts, body) = req.into_parts();
        let operation = parts
            .extensions
            .get::<OperationId>()
            .expect("the floor runs operations")
            .clone();
        let key = operation.key("");
        let body = whole(body).await;
        let digest = BodyDigest::of(&body);
        let (key_value, digest_value) = key.header_values_with(&digest);
        parts.headers.insert(&IDEMPOTENCY_KEY, key_value);
        parts.headers.insert(&CONTENT_DIGEST, digest_value);
        let fingerprint = Fingerprint::of_sent(&parts.method, &parts.uri, &digest);
        let frozen =
            FrozenRequest::from_parts(parts.method, parts.uri, parts.version, parts.headers, body)
                .with_operation(&operation);
        let ledger_key = LedgerKey::for_operation(key);
        let claim = BeginRequest::new(ledger_key, fingerprint, LEASE, RETENTION)
            .with_frozen(frozen.clone())
            .with_protected_window(super::BENCH_PROTECTION);
        match self.store.begin(claim).await.expect("the store answers") {
            Begin::Acquired { token } => {
                let attempt = frozen.to_request_with(parts.extensions);
                let response = self
                    .inner
                    .ready()
                    .await
                    .expect("ready")
                    .call(attempt)
                    .await
                    .expect("answered");
                let (parts, body) = response.into_parts();
                let body = whole(body).await;
                let stored =
                    StoredResponse::new(parts.status, parts.version, &parts.headers, body.clone());
                self.store
                    .complete(ledger_key, token, Outcome::Response(stored), RETENTION)
                    .await
                    .expect("recorded");
                Response::from_parts(parts, Full::new(body))
            }
            Begin::Replay(Outcome::Response(stored)) => {
                self.replays += 1;
                let mut response = Response::new(Full::new(stored.body()));
                *response.status_mut() = stored.status();
                *response.headers_mut() = stored.headers();
                response
            }
            other => panic!("the floor only runs new operations and replays, not {other:?}"),
        }
    }
}

/// A body's bytes: a one-frame body without `collect`'s buffer list (the layers read one
/// so too), any other collected.
async fn whole<B>(mut body: B) -> Bytes
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: std::fmt::Debug,
{
    let first = match body.frame().await {
        Some(frame) => frame
            .expect("a body")
            .into_data()
            .unwrap_or_else(|_| Bytes::new()),
        None => return Bytes::new(),
    };
    if body.is_end_stream() {
        return first;
    }
    let rest = body.collect().await.expect("a body").to_bytes();
    let mut all = Vec::with_capacity(first.len() + rest.len());
    all.extend_from_slice(&first);
    all.extend_from_slice(&rest);
    Bytes::from(all)
}

/// [`Floor`] as a `tower::Service`, for harnesses that drive services: each call runs on a
/// clone of the inner service, in a boxed future (one allocation the floor itself does
/// not make).
#[derive(Clone)]
pub struct FloorService<S> {
    pub inner: S,
    pub store: MemoryStore,
}

impl<S, ResB> Service<Request<Full<Bytes>>> for FloorService<S>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: std::fmt::Debug,
    ResB: Body<Data = Bytes> + Unpin + Send + 'static,
    ResB::Error: std::fmt::Debug,
{
    type Response = Response<Full<Bytes>>;
    type Error = std::convert::Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Full<Bytes>>) -> Self::Future {
        let mut floor = Floor::new(self.inner.clone(), self.store.clone());
        Box::pin(async move { Ok(floor.call(req).await) })
    }
}
