//! The transactional server mode: the claim, the handler's writes and the recorded outcome
//! in one PostgreSQL transaction (see
//! [`IdempotencyLayer::transactional_server_builder`](crate::IdempotencyLayer::transactional_server_builder)).
//!
//! # What the transaction buys, and what holds the key
//!
//! In the engine's mode the claim, the handler's effect and the record are three separate
//! writes, and a crash between the second and the third leaves a key in doubt. Here they
//! are one transaction: PostgreSQL either commits the handler's writes **with** the
//! record, or neither. So a key is never in doubt in this mode: a process that dies
//! mid-handler leaves nothing behind (the server rolls back an abandoned transaction),
//! and the retry runs the handler again, correctly, because nothing of the first run
//! survived.
//!
//! There is no lease guard and no renewal. The key is held by the transaction itself:
//! its claim takes a transaction-scoped advisory lock on the key, which PostgreSQL holds
//! exactly as long as the transaction is open and frees on commit, rollback, or a lost
//! connection. A concurrent claim takes the same lock without waiting and, finding it
//! taken, answers busy; that is the only mutual exclusion, and it lives in the database,
//! so it holds across processes. A finished operation's record is read before the lock is
//! asked for, so its duplicates replay it and take no lock: a replay is never answered
//! busy because an earlier duplicate's transaction has not yet ended.
//!
//! Dropping an [`OpenTransaction`] rolls it back. Every path that must not commit (an
//! error, a `5xx`, a rollback request, a failed body, a panic, a cancelled future) ends by
//! dropping it, and the key is free again: correct, because the rollback proves nothing
//! of the handler's writes took effect.

use std::future::Future;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use tokio::time::Instant;
use tower_service::Service;

use super::body::RequestBody;
use super::execute::poll_catching_unwind;
use super::face::ServerFace;
use super::problem;
use super::replay::recording;
use super::report::{outcome, settled};
use crate::digest::BodyDigest;
use crate::idempotency::body::{buffer_up_to, ResponseBody};
use crate::idempotency::engine::{BusyPolicy, LONGEST};
use crate::ledger::postgres::{CommitError, OpenTransaction};
use crate::ledger::{Begin, BeginRequest, LeaseToken, LedgerKey, PostgresStore, StoreError};
use crate::BoxError;

/// The first pause between two claims of a key another transaction holds, under
/// [`BusyPolicy::Wait`]; it doubles up to [`MAX_BUSY_POLL`].
const FIRST_BUSY_POLL: Duration = Duration::from_millis(10);
const MAX_BUSY_POLL: Duration = Duration::from_millis(200);

/// Open the request's transaction with its claim. A key another request holds is busy at
/// once (the claim never waits on it in the database); under [`BusyPolicy::Wait`] the
/// claim is made again, backing off, until it is not busy or the bound runs out. Between
/// two tries a waiter holds no connection (its transaction is rolled back) but a place
/// among the layer's [waiters](crate::server::Builder::max_waiters): past that bound it is
/// answered busy at once.
pub(super) async fn claim(
    server: &ServerFace,
    database: &PostgresStore,
    begin: &BeginRequest,
) -> Result<(Begin, Option<OpenTransaction>), StoreError> {
    let give_up_at = match server.busy {
        BusyPolicy::Wait(limit) => Instant::now() + limit.min(LONGEST),
        BusyPolicy::Fail => Instant::now(),
    };
    let mut pause = FIRST_BUSY_POLL;
    let mut permit = None;
    loop {
        let (answer, transaction) = database.begin_in_transaction(begin).await?;
        if !matches!(answer, Begin::Busy { .. }) {
            return Ok((answer, Some(transaction)));
        }
        // Rolled back now: the connection goes back to the pool while we wait. Holding it
        // across the pause would tie up one pooled connection per waiting duplicate, and
        // a storm of duplicates would then starve the handlers that hold the keys.
        drop(transaction);
        let now = Instant::now();
        if now >= give_up_at {
            return Ok((answer, None));
        }
        // The permit is taken on the first busy answer and held until this request stops
        // waiting (it is dropped with `permit` on return): it counts waiters, not tries.
        if let (None, Some(limit)) = (&permit, &server.ledger.waiters) {
            match limit.try_enter() {
                Some(entered) => permit = Some(entered),
                // A storm of duplicates: answer busy now rather than queue one more.
                None => return Ok((answer, None)),
            }
        }
        tokio::time::sleep(pause.min(give_up_at - now)).await;
        pause = (pause * 2).min(MAX_BUSY_POLL);
    }
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
    // The handler gets a handle on the transaction, never the transaction itself: only
    // this function may commit it, and only together with the record.
    request.extensions_mut().insert(transaction.handle());
    let mut inner = inner;
    // A cancelled request drops `transaction`: it rolls back, and the key is free again.
    // As in the engine's mode, a client that goes away does not cancel the handler (the
    // layer's future finishes in the background): its transaction still commits with its
    // record, and the client's retry replays it.
    match unwinding_caught(inner.call(request)).await {
        Ok(Ok(response)) => Ok(commit(&server, key, &digest, token, transaction, response).await),
        Ok(Err(err)) => {
            settled("rolled-back");
            transaction.rollback().await;
            Err(err)
        }
        // A panicking handler: rolled back before the panic goes on to whatever answers
        // it (a `CatchPanicLayer`'s `500`), so that a retry sent at once finds the key
        // free. Dropped as the panic unwound, the transaction would roll back in a task
        // of its own, and a retry could still find it open: `409`, in flight.
        Err(panic) => {
            settled("rolled-back");
            transaction.rollback().await;
            std::panic::resume_unwind(panic)
        }
    }
}

/// `handling`'s output, or the panic it raised. The future is dropped before this
/// returns (and with it whatever the handler held, its handle on the transaction
/// included), and never polled again after a panic.
async fn unwinding_caught<F: Future>(
    handling: F,
) -> Result<F::Output, Box<dyn std::any::Any + Send>> {
    let mut handling = std::pin::pin!(handling);
    std::future::poll_fn(|cx| match poll_catching_unwind(handling.as_mut(), cx) {
        Ok(polled) => polled.map(Ok),
        Err(panic) => Poll::Ready(Err(panic)),
    })
    .await
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
    // A `5xx` rolls back whatever the `ServerErrorPolicy`: unlike the engine's mode, the
    // rollback *proves* that nothing happened, so the retry may run the handler again. An
    // answer that says the request was refused before processing, or that the handler
    // marked `NotProcessed`, rolls back too.
    if response.status().is_server_error()
        || server.releases(&response)
        || transaction.is_rollback_only()
    {
        settled("rolled-back");
        transaction.rollback().await;
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
            transaction.rollback().await;
            outcome("transaction-failed");
            return problem::ledger_unavailable(server.retry_after);
        }
    };
    // The record and the handler's writes commit in one `COMMIT`: after it, a retry
    // replays; before it, a retry finds the key free (and runs again, as it should, since
    // nothing was written). There is no moment in which one is visible without the other.
    let (recorded, body, how) = recording(server, &parts, buffered, digest);
    match transaction
        .commit_with(key, token, &recorded, server.ledger.retention)
        .await
    {
        Ok(()) => {
            settled(how);
            Response::from_parts(parts, body)
        }
        Err(CommitError::RolledBack(err)) => {
            // Nothing happened: the retry runs the handler again, and that is right. The
            // handler's answer must not reach the client as if it had happened.
            tracing::error!(%err, "the request's transaction was rolled back at its commit");
            settled("rolled-back");
            outcome("transaction-failed");
            problem::ledger_unavailable(server.retry_after)
        }
        Err(CommitError::Unknown(err)) => {
            // It may have committed: the retry replays the record, or, finding none, runs
            // the handler again; either is right. But this caller must not be told that
            // nothing happened, nor be shown the handler's answer as certain.
            tracing::error!(%err, "the request's commit was sent but not answered");
            settled("commit-unknown");
            outcome("commit-unknown");
            problem::commit_unknown(server.retry_after)
        }
    }
}
