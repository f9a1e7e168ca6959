//! Where the layers record their span fields (`key`, `outcome`, `settled`), in a test
//! binary of its own: `tracing`'s level filter is global, so each level this test sets
//! must be the only one alive in the process while it runs.

mod support;

use support::capture;

use std::convert::Infallible;

use axum::middleware::{self, Next};
use axum::routing::post;
use axum::Router;
use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use tower::{service_fn, ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::ProviderKeys;
use tower_idempotency::{FrozenRetryLayer, IdempotencyLayer, KeyHeader, OperationId};
use tracing::Instrument;

/// A side effect that answers `201 Created`.
async fn created<B>(_: Request<B>) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(Response::builder()
        .status(StatusCode::CREATED)
        .body(Full::new(Bytes::from_static(b"{}")))
        .unwrap())
}

/// A caller's span that declares the fields the layers record in theirs.
fn caller_span() -> tracing::Span {
    tracing::info_span!(
        "caller",
        key = tracing::field::Empty,
        outcome = tracing::field::Empty,
        settled = tracing::field::Empty,
    )
}

/// A middleware of the application's own around the routes, as tracing layers are: the
/// request runs in the caller's span, which then logs that it is done.
async fn in_caller_span(req: axum::extract::Request, next: Next) -> axum::response::Response {
    let span = caller_span();
    let response = next.run(req).instrument(span.clone()).await;
    span.in_scope(|| tracing::info!("caller done"));
    response
}

/// One request through each face, composed as applications compose them: the server
/// layer on a nested axum route under a middleware of the application's own that runs
/// the request in its span; the client layer over the retry layer, called from inside the
/// application's span. Each caller's span logs once it is done, so the capture shows what
/// it holds.
async fn one_request_per_face(server_key: &str, step: &str) {
    let charges = Router::new()
        .route("/charges", post(|| async { (StatusCode::CREATED, "{}") }))
        .route_layer(IdempotencyLayer::server(MemoryStore::new()));
    let app = Router::new()
        .nest("/v1", charges)
        .layer(middleware::from_fn(in_caller_span));
    let req = Request::post("/v1/charges")
        .header("idempotency-key", server_key)
        .header("authorization", "Bearer tenant-1")
        .body(axum::body::Body::from("{}"))
        .unwrap();
    let response = app.oneshot(req).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);

    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .layer(FrozenRetryLayer::default())
        .service(service_fn(created));
    let caller = caller_span();
    async {
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
