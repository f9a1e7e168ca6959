//! The transactional server mode at the seams: handlers of our own behind
//! `IdempotencyLayer::transactional_server_builder`, over real TCP, against a real
//! PostgreSQL (see `support/postgres.rs`). What a handler writes through its
//! `PostgresTransaction` commits with the recorded response, or neither does.
#![cfg(all(feature = "postgres", feature = "axum"))]

#[path = "support/postgres.rs"]
mod postgres_support;

use std::net::SocketAddr;
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use tower_idempotency::ledger::{PostgresStore, PostgresTransaction};
use tower_idempotency::{BusyPolicy, IdempotencyLayer};

/// A store on a fresh schema, with a `notes` table beside the ledger.
async fn database(url: &str) -> PostgresStore {
    let store = PostgresStore::builder(url)
        .schema(postgres_support::fresh_schema())
        .connect()
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    let table = format!("{}.notes", store.schema());
    store
        .pool()
        .get()
        .await
        .expect("a connection")
        .batch_execute(&format!("CREATE TABLE {table} (key text NOT NULL)"))
        .await
        .expect("create the table");
    store
}

/// Write one note for the request through its transaction.
async fn write_note(tx: &PostgresTransaction, schema: &str, key: &str) {
    tx.client()
        .await
        .expect("the request's transaction")
        .execute(
            &format!("INSERT INTO {schema}.notes (key) VALUES ($1)"),
            &[&key],
        )
        .await
        .expect("insert");
}

async fn notes(store: &PostgresStore, key: &str) -> i64 {
    let client = store.pool().get().await.expect("a connection");
    client
        .query_one(
            &format!(
                "SELECT count(*) FROM {}.notes WHERE key = $1",
                store.schema()
            ),
            &[&key],
        )
        .await
        .expect("count")
        .get(0)
}

async fn serve(app: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("address");
    tokio::spawn(async move { axum::serve(listener, app).await });
    addr
}

async fn post_with_key(addr: SocketAddr, path: &str, key: &str) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("http://{addr}{path}"))
        .header("idempotency-key", format!("\"{key}\""))
        .body("{}")
        .send()
        .await
        .expect("an answer")
}

fn replayed(response: &reqwest::Response) -> bool {
    response.headers().get("idempotent-replayed").is_some()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_request_leaves_no_write_and_no_record() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let store = database(pg.url()).await;
    let schema = store.schema().to_owned();
    let layer = IdempotencyLayer::transactional_server_builder(store.clone())
        .unscoped()
        .build()
        .expect("layer");
    let app = Router::new()
        .route(
            "/notes",
            post(move |tx: PostgresTransaction| async move {
                write_note(&tx, &schema, "rolled").await;
                // A business rule says no, after the write: undo it, answer 422.
                tx.set_rollback_only();
                StatusCode::UNPROCESSABLE_ENTITY
            }),
        )
        .route_layer(layer);
    let addr = serve(app).await;
    for _ in 0..2 {
        let response = post_with_key(addr, "/notes", "rolled").await;
        assert_eq!(response.status(), 422);
        assert!(
            !replayed(&response),
            "nothing was recorded, so nothing replays"
        );
    }
    assert_eq!(notes(&store, "rolled").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_rolls_back_and_the_retry_runs_again() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let store = database(pg.url()).await;
    let schema = store.schema().to_owned();
    let layer = IdempotencyLayer::transactional_server_builder(store.clone())
        .unscoped()
        .build()
        .expect("layer");
    let panics = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let app = Router::new()
        .route(
            "/notes",
            post({
                let panics = panics.clone();
                move |tx: PostgresTransaction| async move {
                    write_note(&tx, &schema, "panicky").await;
                    if panics.swap(false, std::sync::atomic::Ordering::SeqCst) {
                        panic!("the handler fails after its write");
                    }
                    StatusCode::CREATED
                }
            }),
        )
        .route_layer(layer)
        .layer(tower_http::catch_panic::CatchPanicLayer::new());
    let addr = serve(app).await;
    let first = post_with_key(addr, "/notes", "panicky").await;
    assert_eq!(first.status(), 500);
    assert_eq!(
        notes(&store, "panicky").await,
        0,
        "the panic rolled the write back"
    );
    let retry = post_with_key(addr, "/notes", "panicky").await;
    assert_eq!(retry.status(), 201);
    assert!(!replayed(&retry));
    let again = post_with_key(addr, "/notes", "panicky").await;
    assert_eq!(again.status(), 201);
    assert!(replayed(&again));
    assert_eq!(notes(&store, "panicky").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_wait_policy_a_duplicate_waits_for_the_commit_and_replays_it() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let store = database(pg.url()).await;
    let schema = store.schema().to_owned();
    let layer = IdempotencyLayer::transactional_server_builder(store.clone())
        .unscoped()
        .busy_policy(BusyPolicy::Wait(Duration::from_secs(5)))
        .build()
        .expect("layer");
    let app = Router::new()
        .route(
            "/notes",
            post(move |tx: PostgresTransaction| async move {
                write_note(&tx, &schema, "slow").await;
                tokio::time::sleep(Duration::from_millis(300)).await;
                (StatusCode::CREATED, "noted")
            }),
        )
        .route_layer(layer);
    let addr = serve(app).await;
    let first = tokio::spawn(async move { post_with_key(addr, "/notes", "slow").await });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let second = post_with_key(addr, "/notes", "slow").await;
    let first = first.await.expect("first");
    assert_eq!(first.status(), 201);
    assert_eq!(second.status(), 201);
    assert!(!replayed(&first) && replayed(&second));
    assert_eq!(second.text().await.expect("body"), "noted");
    assert_eq!(notes(&store, "slow").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_open_is_refused_and_the_store_bounds_its_connections() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let store = PostgresStore::builder(pg.url())
        .schema(postgres_support::fresh_schema())
        .operation_timeout(Duration::from_millis(750))
        .lock_wait(Duration::from_millis(40))
        .connect()
        .await
        .expect("connect");
    let err = IdempotencyLayer::transactional_server_builder(store.clone())
        .fail_open(true)
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("fail_open"), "{err}");
    let client = store.pool().get().await.expect("a connection");
    let show = |name: &'static str| {
        let client = &client;
        async move {
            client
                .query_one(&format!("SHOW {name}"), &[])
                .await
                .expect("show")
                .get::<_, String>(0)
        }
    };
    assert_eq!(show("statement_timeout").await, "750ms");
    assert_eq!(show("lock_timeout").await, "40ms");
}
