//! The tool's handler as the server face's inner service: a keyed call is handed over
//! through the synthesized request's extensions, run, and answered as the HTTP response
//! the server face records (or releases).

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use rmcp::handler::server::tool::{DynCallToolHandler, ToolCallContext};
use rmcp::model::{CallToolRequestParams, CallToolResponse, CallToolResult, ErrorCode};
use rmcp::service::RequestContext;
use rmcp::{ErrorData, RoleServer};
use serde::{Deserialize, Serialize};
use tower_service::Service;

use crate::server::{NotProcessed, RequestBody};

/// What the handler answered, for the caller whose call ran it: the answer itself, whole,
/// rather than the recorded copy (an answer that is not recorded, "input required" or a
/// JSON-RPC error, has no recorded copy).
pub(super) type Slot = Arc<Mutex<Option<Result<CallToolResponse, ErrorData>>>>;

/// A keyed call, handed to [`RouteService`] through the request's extensions (which must be
/// `Clone`: the call itself is taken out once).
pub(super) struct Handoff<S>(Arc<Mutex<Option<Pending<S>>>>);

impl<S> Clone for Handoff<S> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<S> Handoff<S> {
    pub(super) fn new(pending: Pending<S>) -> Self {
        Self(Arc::new(Mutex::new(Some(pending))))
    }
}

/// Everything a call of the tool needs, owned: the handler may run on a task of its own,
/// past the client's hang-up.
pub(super) struct Pending<S> {
    /// The server, cloned: rmcp lends it to the handler for the call only.
    pub(super) service: S,
    pub(super) handler: Arc<DynCallToolHandler<S>>,
    pub(super) params: CallToolRequestParams,
    pub(super) context: RequestContext<RoleServer>,
    pub(super) slot: Slot,
    /// The digests of the arguments' top-level fields, recorded with the result so that a
    /// later call with other arguments under the key can be told which fields changed.
    pub(super) argument_fields: String,
}

/// What is recorded for a complete call: its result and its arguments' field digests.
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct Recorded {
    pub(super) result: CallToolResult,
    pub(super) argument_fields: String,
}

/// The server face's inner service: runs the handed-over call.
pub(super) struct RouteService<S>(std::marker::PhantomData<fn() -> S>);

impl<S> RouteService<S> {
    pub(super) fn new() -> Self {
        Self(std::marker::PhantomData)
    }
}

impl<S> Clone for RouteService<S> {
    fn clone(&self) -> Self {
        Self::new()
    }
}

impl<S> fmt::Debug for RouteService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RouteService")
    }
}

type Answer = Result<Response<Full<Bytes>>, ErrorData>;

impl<S> Service<Request<RequestBody<Full<Bytes>>>> for RouteService<S>
where
    S: Send + Sync + 'static,
{
    type Response = Response<Full<Bytes>>;
    type Error = ErrorData;
    type Future = Pin<Box<dyn Future<Output = Answer> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), ErrorData>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<RequestBody<Full<Bytes>>>) -> Self::Future {
        let pending = request
            .extensions()
            .get::<Handoff<S>>()
            .and_then(|handoff| handoff.0.lock().expect("never poisoned").take());
        Box::pin(async move {
            match pending {
                Some(pending) => run(pending).await,
                // Only a request this module did not make: nothing ran.
                None => Ok(not_processed(StatusCode::INTERNAL_SERVER_ERROR)),
            }
        })
    }
}

/// Run the call and answer what the server face is to do with it.
async fn run<S>(pending: Pending<S>) -> Answer {
    let Pending {
        service,
        handler,
        params,
        context,
        slot,
        argument_fields,
    } = pending;
    let answer = handler(ToolCallContext::new(&service, params, context)).await;
    let settle = match &answer {
        // A result is the call's outcome, `isError: true` included: the tool ran and said
        // so, and running it again could do its effect again.
        Ok(CallToolResponse::Complete(result)) => {
            let recorded = Recorded {
                result: result.clone(),
                argument_fields,
            };
            match serde_json::to_vec(&recorded) {
                Ok(body) => Ok(Response::builder()
                    .header(http::header::CONTENT_TYPE, "application/json")
                    .body(Full::new(Bytes::from(body)))
                    .expect("a valid response")),
                // It ran, and cannot be recorded: in doubt, never run again.
                Err(_) => Err(ErrorData::internal_error(
                    "the tool result could not be recorded",
                    None,
                )),
            }
        }
        // "Input required" is a round of a call that goes on, and a task is answered by
        // `tasks/get`: neither is the call's outcome. Released: the next round (its input
        // responses in the fingerprint) claims the key afresh.
        Ok(_) => Ok(not_processed(StatusCode::ACCEPTED)),
        // Raised before the tool's code ran (unknown tool, arguments that do not parse):
        // nothing happened, and the key stays unused.
        Err(error) if before_handler(error) => Ok(not_processed(StatusCode::BAD_REQUEST)),
        // Anything else may come after the effect: the key is left in doubt.
        Err(error) => Err(error.clone()),
    };
    *slot.lock().expect("never poisoned") = Some(answer);
    settle
}

/// The JSON-RPC errors raised before a tool's own code runs: rmcp's argument parsing and
/// routing answer `invalid_params`, a malformed request `invalid_request` or `parse_error`.
fn before_handler(error: &ErrorData) -> bool {
    [
        ErrorCode::INVALID_PARAMS,
        ErrorCode::INVALID_REQUEST,
        ErrorCode::METHOD_NOT_FOUND,
        ErrorCode::PARSE_ERROR,
    ]
    .contains(&error.code)
}

/// An answer the server face releases the key for, whatever its status.
fn not_processed(status: StatusCode) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::new()));
    *response.status_mut() = status;
    response.extensions_mut().insert(NotProcessed);
    response
}
