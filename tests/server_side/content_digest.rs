//! One `Content-Digest` for both faces (RFC 9530), over real loopback HTTP: the client
//! layer sends it, the server layer verifies it, fingerprints by it and names the request a
//! replay answers.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use axum::http::HeaderMap;
use axum::routing::post;
use axum::Router;
use base64::Engine;
use bytes::Bytes;
use http::{HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use sha2::{Digest, Sha512};
use tokio::net::TcpListener;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::digest::{BodyDigest, CONTENT_DIGEST, IDEMPOTENT_REQUEST_DIGEST};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::server::problem;
use tower_idempotency::ProviderKeys;
use tower_idempotency::{IdempotencyLayer, KeyHeader, OperationId};

const BODY: &str = r#"{"order_id":"order-42","amount_cents":1999}"#;

/// A charges endpoint behind the server layer, counting handler runs and echoing the
/// `Content-Digest` the handler was given.
struct Provider {
    base: String,
    runs: Arc<AtomicUsize>,
}

async fn provider() -> Provider {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let app = Router::new()
        .route(
            "/charges",
            post(move |headers: HeaderMap, body: Bytes| {
                let runs = counted.clone();
                async move {
                    let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
                    let seen = headers
                        .get("content-digest")
                        .map(|v| v.to_str().unwrap().to_owned())
                        .unwrap_or_default();
                    let json = serde_json::json!({
                        "charge_id": format!("ch_{n}"),
                        "body_len": body.len(),
                        "content_digest_seen": seen,
                    });
                    (StatusCode::CREATED, axum::Json(json))
                }
            }),
        )
        .route_layer(
            IdempotencyLayer::server_builder(MemoryStore::new())
                .unscoped()
                .build()
                .unwrap(),
        );
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Provider { base, runs }
}

fn hyper_client() -> HyperClient<HttpConnector, Full<Bytes>> {
    HyperClient::builder(TokioExecutor::new()).build_http()
}

/// A hand-made keyed `POST /charges` with `digest` as its `Content-Digest` (none if `None`).
fn charge(base: &str, key: &str, body: &'static str, digest: Option<&str>) -> Request<Full<Bytes>> {
    let mut req = Request::post(format!("{base}/charges"))
        .header("content-type", "application/json")
        .header("idempotency-key", format!("\"{key}\""))
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap();
    if let Some(digest) = digest {
        req.headers_mut()
            .insert(&CONTENT_DIGEST, HeaderValue::from_str(digest).unwrap());
    }
    req
}

async fn send(req: Request<Full<Bytes>>) -> (Response<()>, Value) {
    let response = hyper_client().request(req).await.unwrap();
    let (parts, body) = response.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    let json = serde_json::from_slice(&body).unwrap_or(Value::Null);
    (Response::from_parts(parts, ()), json)
}

fn sha512_field(body: &[u8]) -> String {
    let digest = Sha512::digest(body);
    format!(
        "sha-512=:{}:",
        base64::engine::general_purpose::STANDARD.encode(digest)
    )
}

#[tokio::test]
async fn a_hand_made_mismatch_is_a_400_and_nothing_runs() {
    let provider = provider().await;
    // The digest of other bytes: what a proxy rewriting the body would leave behind.
    let wrong = BodyDigest::of(b"{\"amount_cents\":1}").header_value();
    let (response, problem_body) = send(charge(
        &provider.base,
        "k-mismatch",
        BODY,
        Some(wrong.to_str().unwrap()),
    ))
    .await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(problem_body["type"], problem::CONTENT_DIGEST_MISMATCH);
    assert_eq!(problem_body["algorithm"], "sha-256");
    assert_eq!(provider.runs.load(Ordering::SeqCst), 0);

    // The key was left unused: the same request with its own digest runs, once.
    let right = BodyDigest::of(BODY.as_bytes()).header_value();
    let (response, _) = send(charge(
        &provider.base,
        "k-mismatch",
        BODY,
        Some(right.to_str().unwrap()),
    ))
    .await;
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(provider.runs.load(Ordering::SeqCst), 1);

    // A malformed field is refused as such, and runs nothing either.
    let (response, problem_body) = send(charge(
        &provider.base,
        "k-malformed",
        BODY,
        Some("sha-256=:dG9vIHNob3J0:"),
    ))
    .await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(problem_body["type"], problem::CONTENT_DIGEST_INVALID);
    assert_eq!(provider.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_sha_512_sender_is_verified_and_served() {
    let provider = provider().await;
    let good = sha512_field(BODY.as_bytes());
    let (response, body) = send(charge(&provider.base, "k-512", BODY, Some(&good))).await;
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(body["charge_id"], "ch_1");

    let bad = sha512_field(b"other bytes");
    let (response, problem_body) =
        send(charge(&provider.base, "k-512-bad", BODY, Some(&bad))).await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(problem_body["algorithm"], "sha-512");

    // Unknown algorithms are ignored, next to a verified one.
    let mixed = format!("unixsum=30637, {good}");
    let (response, _) = send(charge(&provider.base, "k-512", BODY, Some(&mixed))).await;
    assert_eq!(response.headers()["idempotent-replayed"], "true");
    assert_eq!(provider.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_sender_without_digest_is_fingerprinted_all_the_same() {
    let provider = provider().await;
    let (response, body) = send(charge(&provider.base, "k-none", BODY, None)).await;
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(body["content_digest_seen"], "");

    // The retry of a peer that does send one is the same request: a replay, not a 422.
    let digest = BodyDigest::of(BODY.as_bytes()).header_value();
    let (response, replayed) = send(charge(
        &provider.base,
        "k-none",
        BODY,
        Some(digest.to_str().unwrap()),
    ))
    .await;
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(response.headers()["idempotent-replayed"], "true");
    assert_eq!(response.headers()[&IDEMPOTENT_REQUEST_DIGEST], digest);
    assert_eq!(replayed["charge_id"], "ch_1");
    assert_eq!(provider.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn client_and_server_agree_on_one_digest_end_to_end() {
    let provider = provider().await;
    let op = OperationId::new("task-7", "charge");
    let request = || {
        let mut req = Request::post(format!("{}/charges", provider.base))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(BODY.as_bytes())))
            .unwrap();
        req.extensions_mut().insert(op.clone());
        req
    };
    let expected = BodyDigest::of(BODY.as_bytes()).header_value();

    // First run: the client sends the digest of the frozen body; the server verified it
    // and passed the request on to the handler as sent.
    let first_client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .service(hyper_client());
    let response = first_client.oneshot(request()).await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let body: Value =
        serde_json::from_slice(&response.into_body().collect().await.unwrap().to_bytes()).unwrap();
    assert_eq!(body["content_digest_seen"], expected.to_str().unwrap());

    // A second process (its own, empty ledger) runs the same operation: the server
    // replays, naming the request it answers with the very digest this client sent.
    let second_client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .service(hyper_client());
    let response = second_client.oneshot(request()).await.unwrap();
    assert_eq!(response.headers()["idempotent-replayed"], "true");
    assert_eq!(response.headers()[&IDEMPOTENT_REQUEST_DIGEST], expected);
    assert_eq!(provider.runs.load(Ordering::SeqCst), 1);
}

// ---------------------------------------------------------------------------------------
// Behind tower-http's request decompression
// ---------------------------------------------------------------------------------------

/// How the server layer and tower-http's `RequestDecompressionLayer` are stacked.
#[derive(Clone, Copy, Debug)]
enum Stacking {
    /// The README's wiring: the layer on the method router, decompression on the router,
    /// so the layer sees the decoded body, without `Content-Encoding` and `Content-Length`.
    DecompressionOutside,
    /// The layer outside: it sees the gzip bytes as sent, `Content-Encoding: gzip` and all.
    LayerOutside,
}

/// `POST /charges` echoing the body its handler got, behind both layers stacked so.
async fn compressed_provider(stacking: Stacking) -> Provider {
    use tower_http::decompression::RequestDecompressionLayer;
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let handler = post(move |body: Bytes| {
        let runs = counted.clone();
        async move {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            let json = serde_json::json!({
                "charge_id": format!("ch_{n}"),
                "body": String::from_utf8(body.to_vec()).unwrap(),
            });
            (StatusCode::CREATED, axum::Json(json))
        }
    });
    let layer = IdempotencyLayer::server_builder(MemoryStore::new())
        .unscoped()
        .build()
        .unwrap();
    let app = match stacking {
        Stacking::DecompressionOutside => Router::new()
            .route("/charges", handler.route_layer(layer))
            .layer(RequestDecompressionLayer::new()),
        Stacking::LayerOutside => Router::new()
            .route("/charges", handler)
            .layer(RequestDecompressionLayer::new())
            .layer(layer),
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Provider { base, runs }
}

fn gzip(body: &[u8]) -> Bytes {
    use std::io::Write;
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(body).unwrap();
    Bytes::from(encoder.finish().unwrap())
}

/// A keyed `POST /charges` of `gzipped` bytes, `Content-Encoding: gzip`, its
/// `Content-Digest` over `digested` (RFC 9530: the content as sent, the gzip bytes).
fn gzipped_charge(base: &str, key: &str, gzipped: &Bytes, digested: &[u8]) -> Request<Full<Bytes>> {
    Request::post(format!("{base}/charges"))
        .header("content-type", "application/json")
        .header("content-encoding", "gzip")
        .header("idempotency-key", format!("\"{key}\""))
        .header(&CONTENT_DIGEST, BodyDigest::of(digested).header_value())
        .body(Full::new(gzipped.clone()))
        .unwrap()
}

#[tokio::test]
async fn a_gzip_request_with_its_content_digest_is_served_and_replayed_however_the_layers_stack() {
    for stacking in [Stacking::DecompressionOutside, Stacking::LayerOutside] {
        let provider = compressed_provider(stacking).await;
        let gzipped = gzip(BODY.as_bytes());
        let (first, json) =
            send(gzipped_charge(&provider.base, "k-gzip", &gzipped, &gzipped)).await;
        assert_eq!(first.status(), StatusCode::CREATED, "{stacking:?}: {json}");
        assert_eq!(
            json["body"], BODY,
            "{stacking:?}: the handler got the decoded body"
        );

        // The retry of the same bytes is the same request: replayed, never run again.
        let (retry, replayed) =
            send(gzipped_charge(&provider.base, "k-gzip", &gzipped, &gzipped)).await;
        assert_eq!(
            retry.status(),
            StatusCode::CREATED,
            "{stacking:?}: {replayed}"
        );
        assert_eq!(
            retry.headers()["idempotent-replayed"],
            "true",
            "{stacking:?}"
        );
        assert_eq!(replayed, json, "{stacking:?}");
        assert_eq!(provider.runs.load(Ordering::SeqCst), 1, "{stacking:?}");

        // The same key with another body is still another request.
        let other = gzip(br#"{"order_id":"order-42","amount_cents":1}"#);
        let (reused, problem_body) =
            send(gzipped_charge(&provider.base, "k-gzip", &other, &other)).await;
        assert_eq!(
            reused.status(),
            StatusCode::UNPROCESSABLE_ENTITY,
            "{stacking:?}"
        );
        assert_eq!(
            problem_body["differs"],
            serde_json::json!(["body"]),
            "{stacking:?}"
        );
        assert_eq!(provider.runs.load(Ordering::SeqCst), 1, "{stacking:?}");
    }
}

#[tokio::test]
async fn behind_decompression_a_digest_of_the_decoded_body_still_verifies_and_a_plain_mismatch_is_still_refused(
) {
    let provider = compressed_provider(Stacking::DecompressionOutside).await;
    let gzipped = gzip(BODY.as_bytes());
    // A sender that digested the decoded bytes: the layer sees those bytes, and they match.
    let (response, json) = send(gzipped_charge(
        &provider.base,
        "k-decoded",
        &gzipped,
        BODY.as_bytes(),
    ))
    .await;
    assert_eq!(response.status(), StatusCode::CREATED, "{json}");
    assert_eq!(provider.runs.load(Ordering::SeqCst), 1);

    // Nothing was decoded: the body is the content as sent, so a digest of other bytes is
    // still a mismatch, and nothing runs.
    let wrong = BodyDigest::of(b"{\"amount_cents\":1}").header_value();
    let (response, problem_body) = send(charge(
        &provider.base,
        "k-plain",
        BODY,
        Some(wrong.to_str().unwrap()),
    ))
    .await;
    assert_eq!(response.status(), StatusCode::BAD_REQUEST);
    assert_eq!(problem_body["type"], problem::CONTENT_DIGEST_MISMATCH);
    assert_eq!(provider.runs.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_chunked_body_behind_decompression_is_still_checked_against_its_digest() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let provider = compressed_provider(Stacking::DecompressionOutside).await;
    let wrong = BodyDigest::of(b"{}").header_value();
    // `Transfer-Encoding: chunked`, no `Content-Length`: the framing is there, nothing
    // decoded the body, so its digest must match.
    let request = format!(
        "POST /charges HTTP/1.1\r\nHost: charges.local\r\nIdempotency-Key: \"k-chunked\"\r\n\
         Content-Digest: {}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n\
         {:x}\r\n{BODY}\r\n0\r\n\r\n",
        wrong.to_str().unwrap(),
        BODY.len()
    );
    let addr = provider.base.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 400"), "{answer}");
    assert!(answer.contains("content-digest-mismatch"), "{answer}");
    assert_eq!(provider.runs.load(Ordering::SeqCst), 0);
}
