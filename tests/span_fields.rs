//! Where the layers record their span fields (`key`, `outcome`, `settled`), in a test
//! binary of its own: `tracing`'s level filter is global, so each level this test sets
//! must be the only one alive in the process while it runs.

#[path = "support/capture.rs"]
mod capture;

use std::convert::Infallible;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tower::{service_fn, ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::{IdempotencyLayer, OperationId};
use tracing::Instrument;

/// A side effect that answers `201 Created`.
async fn created<B>(_: Request<B>) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(Response::builder()
        .status(StatusCode::CREATED)
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap())
}

/// One request through the server face and one through the client face, each inside a
/// caller's span that declares the fields the layers record in theirs, then an event in
/// that span, so the capture shows what the caller's span holds.
async fn one_request_per_face(server_key: &str, step: &str) {
    let server = ServiceBuilder::new()
        .layer(IdempotencyLayer::server(MemoryStore::new()))
        .service(service_fn(created));
    let caller = tracing::info_span!(
        "caller",
        key = tracing::field::Empty,
        outcome = tracing::field::Empty,
        settled = tracing::field::Empty,
    );
    async {
        let req = Request::post("/charges")
            .header("idempotency-key", server_key)
            .header("authorization", "Bearer tenant-1")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        let response = server.oneshot(req).await.unwrap();
        assert_eq!(response.status(), StatusCode::CREATED);

        let client = ServiceBuilder::new()
            .layer(IdempotencyLayer::client(MemoryStore::new()))
            .service(service_fn(created));
        let mut req = Request::post("http://pay.local/charges")
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap();
        req.extensions_mut()
            .insert(OperationId::new("task-1", step.to_owned()));
        let response = client.oneshot(req).await.unwrap();
        assert_eq!(response.status(), StatusCode::CREATED);
        tracing::info!("caller done");
    }
    .instrument(caller)
    .await;
}

/// The caller's span holds none of the layers' fields: a span with recorded fields shows
/// them in braces on every line it is part of, its closing line included.
fn assert_caller_span_untouched(text: &str) {
    assert!(text.contains("caller done"), "no closing event in {text}");
    assert!(
        !text.contains("caller{"),
        "the caller's span got a layer's field: {text}"
    );
}

/// The closing line of a layer's span of `face`.
fn closing_line<'a>(text: &'a str, face: &str) -> &'a str {
    text.lines()
        .find(|line| {
            line.contains(&format!("idempotency{{face=\"{face}\"")) && line.contains("close")
        })
        .unwrap_or_else(|| panic!("no {face} span closed in {text}"))
}

/// Whatever the filter, the fields the layers record land in their own spans or nowhere:
/// never in the caller's span, which happens to declare the same names. Under a filter
/// that takes `debug` for the layers, their spans hold the key, the outcome and how the
/// run was settled; under one that does not (`info`, or `debug` for other targets only,
/// which leaves the caller's span current inside the layers), they hold nothing.
#[tokio::test(flavor = "current_thread")]
async fn the_layers_record_their_fields_in_their_own_spans_only() {
    // Widest last: `tracing`'s level hint is global, and only ever raised by a new
    // subscriber while this one test runs in the binary.
    for filter in ["info", "span_fields=debug"] {
        let (logs, _default) = capture::spans(filter);
        one_request_per_face("\"info-run\"", &format!("run-{filter}")).await;
        let text = logs.text();
        assert_caller_span_untouched(&text);
        assert!(!text.contains("idempotency{"), "{filter}: {text}");
    }
    let (logs, _default) = capture::spans("debug");
    one_request_per_face("\"debug-run\"", "debug-run").await;
    let text = logs.text();
    assert_caller_span_untouched(&text);
    let server = closing_line(&text, "server");
    for field in ["key=", "outcome=\"executed\"", "settled=\"recorded\""] {
        assert!(server.contains(field), "no {field} in {server}");
    }
    let client = closing_line(&text, "client");
    assert!(client.contains("key="), "no key in {client}");
}
