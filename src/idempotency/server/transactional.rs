//! The transactional server mode: the claim, the handler's writes and the recorded outcome
//! in one PostgreSQL transaction (see
//! [`IdempotencyLayer::transactional_server_builder`](crate::IdempotencyLayer::transactional_server_builder)).

use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tower_service::Service;

use super::body::RequestBody;
use super::{outcome, problem, recording, settled, ServerFace};
use crate::digest::BodyDigest;
use crate::idempotency::body::{buffer_up_to, ResponseBody};
use crate::idempotency::engine::BusyPolicy;
use crate::ledger::postgres::OpenTransaction;
use crate::ledger::{Begin, BeginRequest, LeaseToken, LedgerKey, PostgresStore, StoreError};
use crate::BoxError;

/// Open the request's transaction with its claim.
pub(super) async fn claim(
    database: &PostgresStore,
    begin: &BeginRequest,
    busy: BusyPolicy,
) -> Result<(Begin, OpenTransaction), StoreError> {
    // Under `Fail`, the store's lock wait (100 ms by default): long enough to ride out the
    // brief locks of a sweep or of the table growing under I/O pressure (a fresh key must
    // not be answered busy), short enough to be "at once" for a duplicate's client.
    let lock_wait = match busy {
        // Waiting on the first request's row lock is waiting for its commit, after which
        // the claim reads its record and replays it: no polling.
        BusyPolicy::Wait(limit) => limit.max(database.lock_wait()),
        BusyPolicy::Fail => database.lock_wait(),
    };
    database.begin_in_transaction(begin, lock_wait).await
}

/// Run the handler with the transaction in its request, then commit its writes with the
/// recorded response, or roll both back.
pub(super) async fn execute<S, B, ResBody>(
    inner: S,
    server: Arc<ServerFace>,
    (key, digest): (LedgerKey, BodyDigest),
    token: LeaseToken,
    transaction: OpenTransaction,
    mut request: Request<RequestBody<B>>,
) -> Result<Response<ResponseBody<ResBody>>, S::Error>
where
    S: Service<Request<RequestBody<B>>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body<Data = Bytes>,
    ResBody: Body<Data = Bytes> + Unpin + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    request.extensions_mut().insert(transaction.handle());
    let mut inner = inner;
    let handling = inner.call(request);
    // A panic unwinding through here, or a cancelled request, drops `transaction`: it
    // rolls back, and the key is free again. As in the engine's mode, a client that goes
    // away does not cancel the handler (the layer's future finishes in the background):
    // its transaction still commits with its record, and the client's retry replays it.
    match handling.await {
        Ok(response) => Ok(commit(&server, key, &digest, token, transaction, response).await),
        Err(err) => {
            settled("rolled-back");
            drop(transaction);
            Err(err)
        }
    }
}

async fn commit<ResBody>(
    server: &ServerFace,
    key: LedgerKey,
    digest: &BodyDigest,
    token: LeaseToken,
    transaction: OpenTransaction,
    response: Response<ResBody>,
) -> Response<ResponseBody<ResBody>>
where
    ResBody: Body<Data = Bytes> + Unpin,
    ResBody::Error: Into<BoxError>,
{
    if response.status().is_server_error() || transaction.is_rollback_only() {
        settled("rolled-back");
        drop(transaction);
        return response.map(ResponseBody::inner);
    }
    let (parts, body) = response.into_parts();
    let buffered = buffer_up_to(body, server.response_limit)
        .await
        .map_err(Into::<BoxError>::into);
    let buffered = match buffered {
        Ok(buffered) => buffered,
        Err(err) => {
            // Nothing is committed: the retry runs the handler again, and that is right.
            tracing::warn!(%err, "the handler's response body failed; rolling back");
            settled("rolled-back");
            drop(transaction);
            outcome("transaction-failed");
            return problem::ledger_unavailable(server.retry_after);
        }
    };
    let (recorded, body, how) = recording(server, &parts, buffered, digest);
    match transaction
        .commit_with(key, token, &recorded, server.ledger.retention)
        .await
    {
        Ok(()) => {
            settled(how);
            Response::from_parts(parts, body)
        }
        Err(err) => {
            // Rolled back, or unknown: either way the retry is right (it replays the
            // record, or finds none and runs again). The handler's answer must not reach
            // the client as if it had happened.
            tracing::error!(%err, "the request's transaction did not commit");
            settled("rolled-back");
            outcome("transaction-failed");
            problem::ledger_unavailable(server.retry_after)
        }
    }
}
