//! The server face in front of an axum app: a sequence of arbitrary requests.
//!
//! Each input is decoded (with `arbitrary::Unstructured`) into up to 16 requests with
//! arbitrary methods, targets, `Idempotency-Key` and `Authorization` headers (none,
//! several, any bytes a header value may hold), `Content-Length` values and bodies, sent
//! in turn to one app (a fresh `MemoryStore` per input) with `tower::ServiceExt::oneshot`.
//!
//! Every answer must be well formed — the handler's own, a replay, or an
//! `application/problem+json` 4xx/5xx whose `status` member matches, with `Retry-After`
//! on 409 and 503 — reads and other methods must reach the handler, and the handler must
//! run at most once per (scope, key). Nothing may panic.
#![no_main]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use axum::body::Body;
use axum::extract::State;
use axum::Router;
use http::header::{AUTHORIZATION, CONTENT_LENGTH, CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use tower::ServiceExt;
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::{HeaderKey, IdempotencyLayer};

/// Handler runs per (`Authorization` values, key) of keyed requests.
type Runs = Arc<Mutex<HashMap<(Vec<Vec<u8>>, String), usize>>>;

async fn handle(State(runs): State<Runs>, req: axum::extract::Request) -> Response<Body> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    if let Some(key) = parts.extensions.get::<HeaderKey>() {
        let auth = parts
            .headers
            .get_all(AUTHORIZATION)
            .iter()
            .map(|v| v.as_bytes().to_vec())
            .collect();
        let mut runs = runs.lock().unwrap();
        let count = runs.entry((auth, key.as_str().to_owned())).or_default();
        *count += 1;
        assert_eq!(*count, 1, "the handler ran twice for one (scope, key)");
    }
    Response::builder()
        .status(StatusCode::CREATED)
        .header("x-handler", "1")
        .body(Body::from(body))
        .unwrap()
}

fn header_bytes(u: &mut Unstructured<'_>, pool: &[&[u8]]) -> Result<Vec<u8>> {
    Ok(if u.ratio(3, 4)? {
        u.choose(pool)?.to_vec()
    } else {
        let len = u.int_in_range(0..=300)?;
        u.bytes(len.min(u.len()))?.to_vec()
    })
}

struct Hostile {
    request: Request<Body>,
    side_effect: bool,
}

fn hostile(u: &mut Unstructured<'_>) -> Result<Option<Hostile>> {
    let method = match u.int_in_range(0..=4)? {
        0 | 1 => Method::POST,
        2 => Method::PATCH,
        3 => Method::GET,
        _ => {
            let len = u.int_in_range(1..=12)?;
            match Method::from_bytes(u.bytes(len.min(u.len()))?) {
                Ok(method) => method,
                Err(_) => return Ok(None),
            }
        }
    };
    let side_effect = method == Method::POST || method == Method::PATCH;
    let path = header_bytes(u, &[b"/charges", b"/charges?x=1", b"/"])?;
    let mut builder = Request::builder().method(method).uri(path.as_slice());
    for _ in 0..u.int_in_range(0..=3)? {
        let key = header_bytes(u, &[b"\"k1\"", b"k1", b"\"k2\"", b"\"\"", b"\"a\\\"b\""])?;
        let Ok(key) = HeaderValue::from_bytes(&key) else {
            return Ok(None);
        };
        builder = builder.header("idempotency-key", key);
    }
    for _ in 0..u.int_in_range(0..=2)? {
        let auth = header_bytes(u, &[b"Bearer a", b"Bearer b"])?;
        let Ok(auth) = HeaderValue::from_bytes(&auth) else {
            return Ok(None);
        };
        builder = builder.header(AUTHORIZATION, auth);
    }
    if u.arbitrary()? {
        let length = header_bytes(u, &[b"0", b"2", b"1048577", b"18446744073709551615"])?;
        let Ok(length) = HeaderValue::from_bytes(&length) else {
            return Ok(None);
        };
        builder = builder.header(CONTENT_LENGTH, length);
    }
    let body = header_bytes(u, &[b"{}", b"{\"amount\":1}"])?;
    Ok(builder.body(Body::from(body)).ok().map(|request| Hostile {
        request,
        side_effect,
    }))
}

async fn check(response: Response<Body>, side_effect: bool) {
    let (parts, body) = response.into_parts();
    let Ok(body) = body.collect().await.map(|b| b.to_bytes()) else {
        panic!("an answer's body failed");
    };
    let from_handler = parts.headers.contains_key("x-handler");
    let replayed = parts.headers.get("idempotent-replayed").is_some();
    if !side_effect {
        assert!(from_handler, "a read did not reach the handler: {parts:?}");
        return;
    }
    if parts.headers.get(CONTENT_TYPE).map(HeaderValue::as_bytes)
        == Some(b"application/problem+json")
    {
        let json: serde_json::Value =
            serde_json::from_slice(&body).expect("a problem body is JSON");
        assert_eq!(json["status"], parts.status.as_u16(), "{json}");
        assert!(
            json["type"].is_string() && json["title"].is_string(),
            "{json}"
        );
        assert!(parts.status.is_client_error() || parts.status.is_server_error());
        if matches!(parts.status.as_u16(), 409 | 503) {
            assert!(parts.headers.contains_key(RETRY_AFTER), "{json}");
        }
    } else {
        assert!(
            from_handler || replayed,
            "neither the handler's nor a replay: {parts:?}"
        );
        assert_eq!(parts.status, StatusCode::CREATED);
    }
}

thread_local! {
    static RUNTIME: tokio::runtime::Runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime");
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let mut requests = Vec::new();
    while requests.len() < 16 && !u.is_empty() {
        match hostile(&mut u) {
            Ok(Some(request)) => requests.push(request),
            Ok(None) => {}
            Err(_) => break,
        }
    }
    let runs = Runs::default();
    let app = Router::new()
        .fallback(handle)
        .with_state(runs.clone())
        .layer(IdempotencyLayer::server(MemoryStore::new()));
    RUNTIME.with(|runtime| {
        runtime.block_on(async {
            for Hostile {
                request,
                side_effect,
            } in requests
            {
                let response = app.clone().oneshot(request).await.expect("Infallible");
                check(response, side_effect).await;
            }
        })
    });
});
