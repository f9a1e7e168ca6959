//! The server layer's service: `call` sorts each request, cheaply and before any await,
//! into one of three roads: straight through to the handler (reads, and keyless requests
//! when a key is optional), an answer of its own (a missing or malformed key, no scope, a
//! body declared too large), or the keyed road of [`staged`](super::staged).

use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use super::admit::{self, Admit};
use super::body::RequestBody;
use super::face::ServerFace;
use super::future::ResponseFuture;
use super::head::KeyedHead;
use super::problem;
use super::report::outcome;
use super::staged::Keyed;
use crate::frozen::{check_length, CollectRequest};
use crate::idempotency::body::ResponseBody;
use crate::idempotency::decision::request_span;
use crate::idempotency::Idempotency;
use crate::ledger::{scope_id, LedgerKey};
use crate::BoxError;

impl<S, B, ResBody> Service<Request<B>> for Idempotency<S, ServerFace>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, B, ResBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let server = &*self.face;
        // Reads and keyless requests cost one method check: no span, no box, no buffering.
        if !server.is_side_effect(&req) {
            return ResponseFuture::pass_through(self.inner.call(req.map(RequestBody::streaming)));
        }
        let head = KeyedHead::of(req.headers());
        let key = match head.key {
            Ok(Some(key)) => key,
            Ok(None) if !server.require_key => {
                return ResponseFuture::pass_through(
                    self.inner.call(req.map(RequestBody::streaming)),
                );
            }
            Ok(None) => {
                tracing::debug!(outcome = "key-missing", method = %req.method(), "refused: no Idempotency-Key");
                return ResponseFuture::answer(problem::key_missing(req.method()));
            }
            Err(invalid) => {
                tracing::debug!(outcome = "key-invalid", %invalid, "refused: malformed Idempotency-Key");
                return ResponseFuture::answer(problem::key_invalid(&invalid));
            }
        };
        let span = request_span!(
            face = "server",
            key = tracing::field::Empty,
            outcome = tracing::field::Empty,
            settled = tracing::field::Empty,
        );
        let entered = span.enter();
        let (parts, body) = req.into_parts();
        let (ledger_key, scope_id) = {
            // The scope stays in this block: it may name a tenant, and neither logs nor the
            // ledger ever see it, only the hashes it goes into (the second, short, gives the
            // scope its share of a store's budget).
            let Some(scope) = server.scope.of(&parts) else {
                outcome("scope-missing");
                return ResponseFuture::answer(problem::scope_missing());
            };
            (
                LedgerKey::server_of(&scope, key.as_bytes()),
                scope_id(&scope),
            )
        };
        // Read and limit the body before any lease is taken: a refused body leaves the key
        // unused.
        if let Err(err) = check_length(head.declared_length, &body, server.body_limit) {
            return ResponseFuture::answer(admit::refused_body(server, &err));
        }
        drop(entered);
        let started = server.on_outcome.is_some().then(tokio::time::Instant::now);
        // The instance `poll_ready` readied goes with this request, and a fresh clone
        // stays behind for the next `poll_ready`: the handler is called later, from
        // another future, and tower only promises readiness for the instance polled.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let detach = !self.face.cancel_on_disconnect;
        // Built in one expression, its parts moved once: the future is the largest thing
        // a request makes here, and each move of a part of it is a copy.
        ResponseFuture::keyed(Keyed::new(
            Admit::new(
                inner,
                self.face.clone(),
                (key, ledger_key, scope_id),
                head.content_digest,
                CollectRequest::checked(parts, body, server.body_limit),
                started,
            ),
            span,
            detach,
        ))
    }
}
