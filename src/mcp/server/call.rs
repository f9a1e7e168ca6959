//! One `tools/call` through a protected route: its key, its caller, the server face, and
//! the server face's answer as MCP's.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use rmcp::handler::server::tool::{DynCallToolHandler, ToolCallContext};
use rmcp::model::{CallToolRequestParams, CallToolResponse, CallToolResult, ErrorCode, MetaObject};
use rmcp::ErrorData;
use serde_json::{json, Map, Value};
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

use super::key::{self, KeyRefusal};
use super::route::{Handoff, Pending, Recorded};
use super::{ServedBy, Shared};
use crate::fingerprint::canonical;
use crate::ledger::{Begin, BeginRequest, FieldDigests, LedgerKey, Outcome, RecordState};
use crate::mcp::REPLAYED_META;
use crate::server::{problem, IDEMPOTENT_REPLAYED};

/// The answer of a protected route.
pub(super) type CallAnswer = Result<CallToolResponse, ErrorData>;

/// What the caller's scope is named by, in the synthesized request's extensions.
#[derive(Clone)]
pub(super) struct ResolvedScope(pub(super) String);

/// A `tools/call` of a protected route (see the [module docs](crate::mcp)).
pub(super) async fn guarded<S>(
    shared: Arc<Shared>,
    served_by: ServedBy<S>,
    handler: Arc<DynCallToolHandler<S>>,
    read_only: bool,
    call: ToolCallContext<'_, S>,
) -> CallAnswer
where
    S: Clone + Send + Sync + 'static,
{
    let key = match key::read(&call.request_context) {
        Ok(key) => key,
        Err(refused) => return Err(key_refused(refused).await),
    };
    let Some(key) = key else {
        return keyless(&shared, handler, read_only, call).await;
    };
    if shared
        .scope
        .is_single_client_over_http(&call.request_context)
    {
        return Err(single_client_over_http().await);
    }
    let Some(scope) = shared.scope.of(&call.request_context) else {
        return Err(problem_error(problem::scope_missing::<Full<Bytes>>()).await);
    };
    let arguments = call.arguments.clone().unwrap_or_default();
    let Ok(argument_bytes) = canonical::to_bytes(&arguments) else {
        return Err(ErrorData::invalid_params(
            "the arguments are not JSON",
            None,
        ));
    };
    // The fingerprinted body: the arguments and, for a follow-up round of a multi-round
    // call, what the client answered and the state it echoed. Never `_meta` (a fresh
    // `progressToken` per request) nor the JSON-RPC id (new for every re-issue).
    let body = json!({
        "arguments": arguments,
        "inputResponses": call.input_responses,
        "requestState": call.request_state,
    });
    let Ok(body) = canonical::to_bytes(&body) else {
        return Err(ErrorData::invalid_params(
            "the input responses are not JSON",
            None,
        ));
    };
    let argument_fields = FieldDigests::of(&argument_bytes)
        .map(|digests| {
            base64::Engine::encode(
                &base64::engine::general_purpose::STANDARD,
                digests.entries(),
            )
        })
        .unwrap_or_default();
    let slot = Arc::new(Mutex::new(None));
    let ToolCallContext {
        mut request_context,
        service,
        name,
        arguments,
        input_responses,
        request_state,
        ..
    } = call;
    // A client's hang-up cancels the request's token; the effect under way must finish
    // and be recorded instead, so that the re-issued call replays it (see the module docs).
    request_context.ct = CancellationToken::new();
    let mut params = CallToolRequestParams::new(name.clone());
    params.arguments = arguments;
    params.input_responses = input_responses;
    params.request_state = request_state;
    let pending = Pending {
        service: service.clone(),
        handler,
        params,
        context: request_context,
        slot: slot.clone(),
        argument_fields,
    };
    let mut request = Request::new(Full::new(body));
    *request.method_mut() = Method::POST;
    *request.uri_mut() = shared.target(&name);
    request
        .headers_mut()
        .insert(crate::key::IDEMPOTENCY_KEY.clone(), key.header);
    request
        .extensions_mut()
        .insert(ResolvedScope(scope.clone()));
    request.extensions_mut().insert(Handoff::new(pending));
    let answer = served_by.oneshot(request).await;
    if let Some(ran) = slot.lock().expect("never poisoned").take() {
        // This call ran the tool: its own answer, whole.
        return ran;
    }
    let response = answer?;
    if response.headers().contains_key(&IDEMPOTENT_REPLAYED) {
        return replayed(response).await;
    }
    refused(&shared, response, (&scope, &key.text), &argument_bytes).await
}

/// A call without a key: run as it came, counted.
async fn keyless<S>(
    shared: &Shared,
    handler: Arc<DynCallToolHandler<S>>,
    read_only: bool,
    call: ToolCallContext<'_, S>,
) -> CallAnswer {
    if shared.require_keys && !read_only {
        return Err(problem_error(problem::key_missing::<Full<Bytes>>(&Method::POST)).await);
    }
    shared.keyless.fetch_add(1, Ordering::Relaxed);
    #[cfg(feature = "metrics")]
    metrics::counter!("idempotency_mcp_keyless_calls_total", "tool" => call.name.to_string())
        .increment(1);
    tracing::debug!(tool = %call.name, "tools/call without an idempotency key: passed through");
    handler(call).await
}

/// A recorded result, marked as a replay in its `_meta`.
async fn replayed<B>(response: Response<B>) -> CallAnswer
where
    B: http_body::Body<Data = Bytes>,
{
    let body = collect(response.into_body()).await;
    let Ok(recorded) = serde_json::from_slice::<Recorded>(&body) else {
        return Err(ErrorData::internal_error(
            "the recorded result of this idempotency key cannot be read",
            None,
        ));
    };
    let mut result: CallToolResult = recorded.result;
    result
        .meta
        .get_or_insert_with(MetaObject::default)
        .0
        .insert(REPLAYED_META.to_owned(), Value::Bool(true));
    Ok(CallToolResponse::Complete(result))
}

/// The server face's refusal as a JSON-RPC error; a changed payload names its fields.
async fn refused<B>(
    shared: &Shared,
    response: Response<B>,
    (scope, key): (&str, &str),
    arguments: &[u8],
) -> CallAnswer
where
    B: http_body::Body<Data = Bytes>,
{
    let mut error = problem_error(response).await;
    let is_mismatch = error
        .data
        .as_ref()
        .and_then(|data| data.get("type"))
        .is_some_and(|kind| kind == problem::PAYLOAD_MISMATCH);
    if is_mismatch {
        let changed = changed_fields(shared, LedgerKey::server(scope, key), arguments).await;
        describe_mismatch(&mut error, changed);
    }
    Err(error)
}

/// Names what a call reusing a key changed: the tool (the target), and the argument
/// fields when the first call's result is recorded with their digests.
fn describe_mismatch(error: &mut ErrorData, changed: Option<Vec<String>>) {
    let Some(Value::Object(data)) = error.data.as_mut() else {
        return;
    };
    let tool_differs = data
        .get("differs")
        .and_then(Value::as_array)
        .is_some_and(|parts| parts.iter().any(|part| part == "target"));
    let mut message = String::from("this idempotency key was first used for another call");
    if tool_differs {
        message.push_str(" of another tool");
    }
    match &changed {
        Some(fields) if !fields.is_empty() => {
            message.push_str(&format!("; changed arguments: {}", fields.join(", ")));
        }
        _ => {}
    }
    message.push_str("; a key names one call: use a new key for a new call");
    data.insert("tool".to_owned(), Value::Bool(tool_differs));
    data.insert(
        "changedFields".to_owned(),
        changed.map_or(Value::Null, |fields| json!(fields)),
    );
    error.message = message.into();
}

/// The argument fields changed since the call recorded under `key`, when its result is
/// recorded (a call still in flight, or in doubt, has no result to read them from).
///
/// The record is read with a probe `begin` under its own fingerprint, which answers a
/// completed record's outcome and changes nothing; only on this refusal's path.
async fn changed_fields(shared: &Shared, key: LedgerKey, arguments: &[u8]) -> Option<Vec<String>> {
    let store = &shared.store;
    let view = store.inspect(key).await.ok()??;
    if !matches!(view.state, RecordState::Completed { .. }) {
        return None;
    }
    let probe = BeginRequest::new(key, view.fingerprint, PROBE_LEASE, PROBE_LEASE).probe();
    match store.begin(probe).await.ok()? {
        Begin::Replay(Outcome::Response(stored)) => {
            let recorded: Recorded = serde_json::from_slice(&stored.body()).ok()?;
            let entries = base64::Engine::decode(
                &base64::engine::general_purpose::STANDARD,
                recorded.argument_fields,
            )
            .ok()?;
            FieldDigests::from_entries(&entries).changed_fields(arguments)
        }
        // The record went away between the two looks and the probe claimed the key:
        // give it back at once, unused.
        Begin::Acquired { token } => {
            let _ = store.abandon(key, token).await;
            None
        }
        _ => None,
    }
}

/// The lease of a probe that finds no record (see [`changed_fields`]): it is given back at once.
const PROBE_LEASE: std::time::Duration = std::time::Duration::from_secs(1);

/// A keyed call over HTTP under a single-client scope: `scope-missing`, saying why (one
/// scope for every client that connects would serve one client another's result).
async fn single_client_over_http() -> ErrorData {
    let mut error = problem_error(problem::scope_missing::<Full<Bytes>>()).await;
    error.message = "CallerScope::single_client is for a transport with one client (stdio), \
        but this call came over HTTP, which any client can reach: scope keys by the caller \
        (CallerScope::http_principal), or name the single caller with CallerScope::function"
        .into();
    error
}

/// A refused key as a JSON-RPC error.
async fn key_refused(refused: KeyRefusal) -> ErrorData {
    let (reason, detail) = match refused {
        KeyRefusal::Invalid(invalid) => {
            return problem_error(problem::key_invalid::<Full<Bytes>>(&invalid)).await
        }
        KeyRefusal::NotAString => (
            "not-a-string",
            "_meta[\"idempotency-key\"] must be a JSON string",
        ),
        KeyRefusal::Conflict => (
            "meta-and-header-differ",
            "_meta[\"idempotency-key\"] and the Idempotency-Key header name different keys: send one key",
        ),
    };
    ErrorData::invalid_params(
        detail,
        Some(json!({"type": problem::KEY_INVALID, "status": 400, "reason": reason})),
    )
}

/// A problem response of the server face as a JSON-RPC error: its problem object as the
/// error's `data` (its `type` URI is API), `retryAfterMs` from `Retry-After`; a caller's
/// mistake (4xx, but a busy key) is `invalid_params`, the rest `internal_error`.
async fn problem_error<B>(response: Response<B>) -> ErrorData
where
    B: http_body::Body<Data = Bytes>,
{
    let status = response.status();
    let retry_after = response
        .headers()
        .get(http::header::RETRY_AFTER)
        .and_then(|value| value.to_str().ok())
        .and_then(|seconds| seconds.parse::<u64>().ok());
    let body = collect(response.into_body()).await;
    let mut data = match serde_json::from_slice::<Value>(&body) {
        Ok(Value::Object(problem)) => problem,
        _ => Map::new(),
    };
    if let Some(seconds) = retry_after {
        data.insert(
            "retryAfterMs".to_owned(),
            json!(seconds.saturating_mul(1000)),
        );
    }
    let message = match (data.get("title"), data.get("detail")) {
        (Some(Value::String(title)), Some(Value::String(detail))) => format!("{title}: {detail}"),
        (Some(Value::String(title)), _) => title.clone(),
        _ => format!("refused ({status})"),
    };
    let code = if status.is_client_error() && status != StatusCode::CONFLICT {
        ErrorCode::INVALID_PARAMS
    } else {
        ErrorCode::INTERNAL_ERROR
    };
    ErrorData::new(code, message, Some(Value::Object(data)))
}

/// A body's bytes; a body that fails reads as empty (every caller then answers an error).
async fn collect<B>(body: B) -> Bytes
where
    B: http_body::Body<Data = Bytes>,
{
    match body.collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(_) => Bytes::new(),
    }
}
