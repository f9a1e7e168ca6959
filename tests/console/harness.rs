//! A console nested under `/_idempotency` in a user's router, served on loopback, and a
//! client that speaks to it as a browser or a script would.

use std::sync::Arc;
use std::time::Duration;

use axum::routing::get;
use axum::Router;
use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use tokio::net::TcpListener;
use tower_idempotency::console::{Console, Operator, Refusal, Role};
use tower_idempotency::fingerprint::Fingerprint;
use tower_idempotency::ledger::{
    Begin, BeginRequest, IdempotencyStore, LedgerKey, MemoryStore, Origin, Records,
};

/// Where the console is nested in the user's router.
pub(crate) const PREFIX: &str = "/_idempotency";

/// The operator headers tests send: `x-operator` names them, `x-role: act` lets them act.
pub(crate) fn authorizer(head: &http::request::Parts) -> Result<Operator, Refusal> {
    let id = head
        .headers
        .get("x-operator")
        .and_then(|value| value.to_str().ok())
        .ok_or_else(|| Refusal::unauthenticated("sign in: no x-operator header"))?;
    if id == "mallory" {
        return Err(Refusal::forbidden("mallory is not on the on-call rota"));
    }
    let role = match head.headers.get("x-role").map(|value| value.as_bytes()) {
        Some(b"act") => Role::Act,
        _ => Role::ReadOnly,
    };
    Ok(Operator::new(id, role))
}

/// A served console and a client for it.
pub(crate) struct Served {
    pub(crate) base: String,
    client: Client<HttpConnector, Full<Bytes>>,
}

/// An answer, read whole.
#[derive(Debug)]
pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: String,
}

impl Answer {
    pub(crate) fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|err| panic!("{err}: {}", self.body))
    }

    pub(crate) fn location(&self) -> &str {
        self.headers["location"].to_str().unwrap()
    }
}

/// Serve `records`' console nested under [`PREFIX`] in a user's router, with the user's
/// own route beside it and their layers around it (one on the nested console, one on the
/// whole app), as users mount it.
pub(crate) async fn serve(records: Records) -> Served {
    serve_console(Console::new(records, authorizer)).await
}

/// Serve `console` as [`serve`] does (its authorizer should be [`authorizer`]).
pub(crate) async fn serve_console(console: Console) -> Served {
    let console = console
        .router()
        .layer(tower_http::catch_panic::CatchPanicLayer::new());
    let app = Router::new()
        .route("/health", get(|| async { "ok" }))
        .nest(PREFIX, console)
        .layer(axum::middleware::from_fn(
            |request: axum::extract::Request, next: axum::middleware::Next| async move {
                let mut response = next.run(request).await;
                response
                    .headers_mut()
                    .insert("x-served-by", "users-app".parse().unwrap());
                response
            },
        ));
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    Served {
        base: format!("http://{addr}"),
        client: Client::builder(TokioExecutor::new()).build_http(),
    }
}

impl Served {
    /// Send `method path` with `headers` and `body`.
    pub(crate) async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Answer {
        let mut request = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = self
            .client
            .request(
                request
                    .body(Full::new(Bytes::from(body.to_owned())))
                    .unwrap(),
            )
            .await
            .unwrap();
        let (head, body) = response.into_parts();
        assert_eq!(
            head.headers["x-served-by"], "users-app",
            "inside the user's layer"
        );
        let body = body.collect().await.unwrap().to_bytes();
        Answer {
            status: head.status,
            headers: head.headers,
            body: String::from_utf8(body.to_vec()).unwrap(),
        }
    }

    /// `GET path` as the operator `id` with `role` (`"act"` or `"read"`).
    pub(crate) async fn get_as(&self, id: &str, role: &str, path: &str) -> Answer {
        self.send(
            Method::GET,
            path,
            &[("x-operator", id), ("x-role", role)],
            "",
        )
        .await
    }

    /// `POST path` with a JSON body, as the operator `id` with `role`.
    pub(crate) async fn post_json(&self, id: &str, role: &str, path: &str, body: &Value) -> Answer {
        self.send(
            Method::POST,
            path,
            &[
                ("x-operator", id),
                ("x-role", role),
                ("content-type", "application/json"),
            ],
            &body.to_string(),
        )
        .await
    }

    /// `POST path` with a form body, as a browser of the operator `id` allowed to act.
    pub(crate) async fn post_form(&self, id: &str, path: &str, form: &str) -> Answer {
        self.send(
            Method::POST,
            path,
            &[
                ("x-operator", id),
                ("x-role", "act"),
                ("content-type", "application/x-www-form-urlencoded"),
                ("sec-fetch-site", "same-origin"),
            ],
            form,
        )
        .await
    }
}

/// A record claimed for `key` in `store` and left in doubt, as a failed attempt leaves it.
pub(crate) async fn in_doubt(store: &MemoryStore, key: LedgerKey, scope: &str) {
    let fingerprint = Fingerprint::of(&Method::POST, "/charges", b"{}");
    let claim = BeginRequest::new(
        key,
        fingerprint,
        Duration::from_secs(30),
        Duration::from_secs(3600),
    )
    .with_scope(scope);
    let Begin::Acquired { token } = store.begin(claim).await.unwrap() else {
        panic!("a fresh key is acquired");
    };
    store
        .mark_in_doubt(key, token, Duration::from_secs(3600))
        .await
        .unwrap();
}

/// A record claimed for `key` with `origin` and left in doubt.
pub(crate) async fn in_doubt_of(store: &MemoryStore, key: LedgerKey, origin: Origin) {
    let fingerprint = Fingerprint::of(&Method::POST, "/charges", b"{}");
    let claim = BeginRequest::new(
        key,
        fingerprint,
        Duration::from_secs(30),
        Duration::from_secs(3600),
    )
    .with_origin(origin);
    let Begin::Acquired { token } = store.begin(claim).await.unwrap() else {
        panic!("a fresh key is acquired");
    };
    store
        .mark_in_doubt(key, token, Duration::from_secs(3600))
        .await
        .unwrap();
}

/// A record claimed for `key` whose owner still holds its lease.
pub(crate) async fn in_flight(store: &MemoryStore, key: LedgerKey) {
    let fingerprint = Fingerprint::of(&Method::POST, "/refunds", b"{}");
    let claim = BeginRequest::new(
        key,
        fingerprint,
        Duration::from_secs(300),
        Duration::from_secs(3600),
    );
    assert!(matches!(
        store.begin(claim).await.unwrap(),
        Begin::Acquired { .. }
    ));
}

/// A console over a fresh store, and the store.
pub(crate) async fn console_over_store() -> (Served, Arc<MemoryStore>) {
    let store = Arc::new(MemoryStore::new());
    let served = serve(Records::new(store.clone())).await;
    (served, store)
}

/// The path of a record's API.
pub(crate) fn api_record(key: &LedgerKey) -> String {
    format!("{PREFIX}/api/records/{}", key.to_hex())
}
