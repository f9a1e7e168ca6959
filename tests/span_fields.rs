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

/// The line of the caller's closing event.
fn caller_line(text: &str) -> &str {
    text.lines()
        .find(|line| line.contains("caller done"))
        .unwrap_or_else(|| panic!("no closing event in {text}"))
}

/// Under a subscriber that does not take `debug`, the layers' spans are disabled, and the
/// fields they would have recorded go nowhere: not into the caller's span, which happens
/// to declare the same names. Under one that does, they land in the layers' own spans, and
/// the caller's span still holds nothing of theirs.
#[tokio::test(flavor = "current_thread")]
async fn the_layers_record_their_fields_in_their_own_spans_only() {
    {
        let (logs, _info) = capture::events(tracing::Level::INFO);
        one_request_per_face("\"info-run\"", "info-run").await;
        let text = logs.text();
        let line = caller_line(&text);
        assert!(
            !line.contains("outcome") && !line.contains("settled") && !line.contains("key"),
            "the caller's span got a layer's field: {line}"
        );
        assert!(!text.contains("idempotency{"), "{text}");
    }
    {
        let (logs, _debug) = capture::events(tracing::Level::DEBUG);
        one_request_per_face("\"debug-run\"", "debug-run").await;
        let text = logs.text();
        let line = caller_line(&text);
        assert!(
            !line.contains("outcome") && !line.contains("settled") && !line.contains("key"),
            "the caller's span got a layer's field: {line}"
        );
        for face in ["server", "client"] {
            assert!(
                text.lines()
                    .any(|line| line.contains(&format!("idempotency{{face=\"{face}\" key="))),
                "no {face} span with its key recorded in {text}"
            );
        }
    }
}
