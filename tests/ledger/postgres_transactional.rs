//! The transactional server mode at the seams: handlers of our own behind
//! `IdempotencyLayer::transactional_server_builder`, over real TCP, against a real
//! PostgreSQL (see `support/postgres.rs`). What a handler writes through its
//! `PostgresTransaction` commits with the recorded response, or neither does.
#![cfg(all(feature = "postgres", feature = "axum"))]

use crate::support::postgres as postgres_support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::post;
use axum::Router;
use tower_idempotency::ledger::{PostgresStore, PostgresStoreBuilder, PostgresTransaction};
use tower_idempotency::server::ServerFace;
use tower_idempotency::{BusyPolicy, IdempotencyLayer};

/// A store on a fresh schema, with a `notes` table beside the ledger.
async fn database(url: &str) -> PostgresStore {
    database_with(PostgresStore::builder(url)).await
}

/// [`database`], with the store's own settings.
async fn database_with(builder: PostgresStoreBuilder) -> PostgresStore {
    let store = builder
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

/// The transactional server layer over `store`, its keys unscoped.
/// `/notes` answered by `handler` under the transactional layer (unscoped), inside
/// tower-http's `CatchPanicLayer`: a panicking handler is a `500` to its client.
fn panicking_notes<H, T>(store: &PostgresStore, handler: H) -> Router
where
    H: axum::handler::Handler<T, ()>,
    T: 'static,
{
    Router::new()
        .route("/notes", post(handler))
        .route_layer(unscoped_layer(store))
        .layer(tower_http::catch_panic::CatchPanicLayer::new())
}

fn unscoped_layer(store: &PostgresStore) -> IdempotencyLayer<ServerFace> {
    IdempotencyLayer::transactional_server_builder(store.clone())
        .unscoped()
        .build()
        .expect("layer")
}

/// A handler's write that a business rule then refuses: the write is undone, `422`.
async fn write_then_refuse(tx: &PostgresTransaction, schema: &str, key: &str) -> StatusCode {
    write_note(tx, schema, key).await;
    tx.set_rollback_only();
    StatusCode::UNPROCESSABLE_ENTITY
}

/// A router whose `path` writes the note `key`, then refuses it ([`write_then_refuse`]).
fn refusing(path: &str, schema: String, key: &'static str) -> Router {
    Router::new().route(
        path,
        post(move |tx: PostgresTransaction| async move {
            write_then_refuse(&tx, &schema, key).await
        }),
    )
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
    let layer = unscoped_layer(&store);
    let app = refusing("/notes", schema, "rolled").route_layer(layer);
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

/// An answer that says the request was refused before processing (here a `415`, as axum's
/// `Json` extractor answers) rolls the transaction back and releases the key: whatever the
/// handler wrote is undone, and the same key runs once the caller has fixed its request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_before_processing_rolls_back_and_releases_the_key() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let store = database(pg.url()).await;
    let schema = store.schema().to_owned();
    let calls = Arc::new(AtomicUsize::new(0));
    let handler = {
        let calls = calls.clone();
        move |tx: PostgresTransaction| async move {
            write_note(&tx, &schema, "refused").await;
            if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                StatusCode::UNSUPPORTED_MEDIA_TYPE
            } else {
                StatusCode::CREATED
            }
        }
    };
    let app = Router::new()
        .route("/notes", post(handler))
        .route_layer(unscoped_layer(&store));
    let addr = serve(app).await;
    let refused = post_with_key(addr, "/notes", "refused").await;
    assert_eq!(refused.status(), 415);
    assert_eq!(
        notes(&store, "refused").await,
        0,
        "the refusal's write was kept"
    );
    let created = post_with_key(addr, "/notes", "refused").await;
    assert_eq!(created.status(), 201);
    assert!(!replayed(&created), "the 415 was recorded");
    let replay = post_with_key(addr, "/notes", "refused").await;
    assert!(replayed(&replay));
    assert_eq!(notes(&store, "refused").await, 1);
}

/// A rolled-back request (its handler asked for it, or answered `5xx`) is answered only once
/// its `ROLLBACK` is done: when the answer is in hand, the request's connection is back in
/// the pool, not on its way there from a `ROLLBACK` left to the background, and a retry sent
/// at once finds the key free (`422` again, never `409` in flight). On a current-thread
/// runtime nothing spawned runs between the answer and the look at the pool, so an answer
/// sent before its rollback is caught every time.
#[tokio::test(flavor = "current_thread")]
async fn a_rollback_is_done_before_its_answer_goes_out() {
    use axum::body::Body;
    use tower::ServiceExt;

    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let store = database(pg.url()).await;
    let schema = store.schema().to_owned();
    let layer = unscoped_layer(&store);
    let app = refusing("/refused", schema, "refused")
        .route(
            "/failed",
            post(|| async { StatusCode::INTERNAL_SERVER_ERROR }),
        )
        .route_layer(layer);
    for (path, status) in [
        ("/refused", StatusCode::UNPROCESSABLE_ENTITY),
        ("/failed", StatusCode::INTERNAL_SERVER_ERROR),
    ] {
        for attempt in 0..2 {
            let request = axum::http::Request::post(path)
                .header("idempotency-key", format!("\"{path}\""))
                .body(Body::from("{}"))
                .expect("a request");
            let response = app.clone().oneshot(request).await.expect("an answer");
            let pool = store.pool().status();
            assert_eq!(
                pool.available, pool.size,
                "{path}, attempt {attempt}: answered while the request's connection was still \
                 out, its ROLLBACK left to the background"
            );
            assert_eq!(response.status(), status, "{path}, attempt {attempt}");
        }
    }
    assert_eq!(notes(&store, "refused").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_rolls_back_and_the_retry_runs_again() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let store = database(pg.url()).await;
    let schema = store.schema().to_owned();
    let panics = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let addr = serve(panicking_notes(&store, {
        let panics = panics.clone();
        move |tx: PostgresTransaction| async move {
            write_note(&tx, &schema, "panicky").await;
            if panics.swap(false, std::sync::atomic::Ordering::SeqCst) {
                panic!("the handler fails after its write");
            }
            StatusCode::CREATED
        }
    }))
    .await;
    // Each retry is sent the moment the `500` arrives: the rollback must be done by then,
    // or the retry finds the key's transaction still open (`409`, in flight). Several
    // keys, so that a rollback left to finish on its own would lose the race at least
    // once.
    const ROUNDS: i64 = 12;
    for round in 0..ROUNDS {
        let key = format!("panicky-{round}");
        panics.store(true, std::sync::atomic::Ordering::SeqCst);
        let first = post_with_key(addr, "/notes", &key).await;
        assert_eq!(first.status(), 500, "{key}");
        let retry = post_with_key(addr, "/notes", &key).await;
        assert_eq!(
            retry.status(),
            201,
            "{key}: the key is free the moment the 500 is out"
        );
        assert!(!replayed(&retry), "{key}");
    }
    assert_eq!(
        notes(&store, "panicky").await,
        ROUNDS,
        "each panic rolled its write back; each retry wrote once"
    );
    let again = post_with_key(addr, "/notes", "panicky-0").await;
    assert_eq!(again.status(), 201);
    assert!(replayed(&again));
    assert_eq!(notes(&store, "panicky").await, ROUNDS);
}

/// A handler that panics while a query of its own (one it spawned, through a clone of its
/// transaction) still holds the connection: its transaction could not be rolled back as the
/// panic unwound, so it stayed open, holding the key, until that query ended. The layer
/// waits for the connection and rolls back before the panic goes on to the `500`: the
/// retry sent the moment the `500` arrives runs the handler again rather than finding the
/// key in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_panicking_with_a_query_under_way_is_rolled_back_before_its_500() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let store = database(pg.url()).await;
    let schema = store.schema().to_owned();
    let panics = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let app = panicking_notes(&store, {
        let panics = panics.clone();
        move |tx: PostgresTransaction| async move {
            write_note(&tx, &schema, "busy").await;
            if panics.swap(false, std::sync::atomic::Ordering::SeqCst) {
                let held = tx.clone();
                let (locked, connection_held) = tokio::sync::oneshot::channel();
                tokio::spawn(async move {
                    let client = held.client().await.expect("the transaction");
                    let _ = locked.send(());
                    let _ = client.execute("SELECT pg_sleep(0.5)", &[]).await;
                });
                connection_held
                    .await
                    .expect("the query holds the connection");
                panic!("the handler fails while its own query is under way");
            }
            StatusCode::CREATED
        }
    });
    let addr = serve(app).await;
    let first = post_with_key(addr, "/notes", "busy").await;
    assert_eq!(first.status(), 500);
    let retry = post_with_key(addr, "/notes", "busy").await;
    assert_eq!(
        retry.status(),
        201,
        "the key is free the moment the 500 is out"
    );
    assert!(!replayed(&retry));
    assert_eq!(
        notes(&store, "busy").await,
        1,
        "the panicked write rolled back"
    );
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

/// Serve `/notes` behind `layer`: the handler writes a note for the request's key through
/// its transaction, then takes `handling` (unless the key starts with `quick`) before
/// answering `201`.
async fn serve_notes(
    schema: String,
    handling: Duration,
    layer: IdempotencyLayer<ServerFace>,
) -> SocketAddr {
    let app = Router::new()
        .route(
            "/notes",
            post(
                move |tx: PostgresTransaction, headers: axum::http::HeaderMap| async move {
                    let key = headers["idempotency-key"].to_str().unwrap();
                    let key = key.trim_matches('"').to_owned();
                    write_note(&tx, &schema, &key).await;
                    if !key.starts_with("quick") {
                        tokio::time::sleep(handling).await;
                    }
                    (StatusCode::CREATED, format!("noted {key}"))
                },
            ),
        )
        .route_layer(layer);
    serve(app).await
}

/// A finished operation is replayed, always. Thirty duplicates of a finished request, sent
/// one after the other over real TCP, alternately to two layer instances (two replicas,
/// each with its own pool) over one database, are each answered the recorded `201` as a
/// replay: a replay neither waits for nor is refused by the key's lock, whose release a
/// previous duplicate's `ROLLBACK` may still have on its way. The handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_duplicates_of_a_finished_request_are_all_replays() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let store = database(pg.url()).await;
    let schema = store.schema().to_owned();
    let replica = PostgresStore::builder(pg.url())
        .schema(schema.clone())
        .connect()
        .await
        .expect("connect a second store");
    let instances = [
        serve_notes(schema.clone(), Duration::ZERO, unscoped_layer(&store)).await,
        serve_notes(schema, Duration::ZERO, unscoped_layer(&replica)).await,
    ];
    let client = reqwest::Client::new();
    let send = |addr: SocketAddr| {
        client
            .post(format!("http://{addr}/notes"))
            .header("idempotency-key", "\"finished\"")
            .body("{}")
            .send()
    };
    let first = send(instances[0]).await.expect("an answer");
    assert_eq!(first.status(), StatusCode::CREATED);
    assert!(!replayed(&first));

    let mut answers = Vec::new();
    for duplicate in 0..30 {
        let response = send(instances[duplicate % 2]).await.expect("an answer");
        answers.push((response.status(), replayed(&response)));
    }
    let replays = answers
        .iter()
        .filter(|answer| **answer == (StatusCode::CREATED, true))
        .count();
    assert_eq!(replays, 30, "not every duplicate was a replay: {answers:?}");
    assert_eq!(notes(&store, "finished").await, 1, "the handler ran again");

    // A replay round: finished operations, each sent to both instances at once.
    let keys: Vec<String> = (0..8).map(|op| format!("round-{op}")).collect();
    for key in &keys {
        let response = post_with_key(instances[0], "/notes", key).await;
        assert_eq!(response.status(), StatusCode::CREATED);
    }
    let mut round = tokio::task::JoinSet::new();
    for key in &keys {
        for addr in instances {
            let request = client
                .post(format!("http://{addr}/notes"))
                .header("idempotency-key", format!("\"{key}\""))
                .body("{}")
                .send();
            round.spawn(async move {
                let response = request.await.expect("an answer");
                (response.status(), replayed(&response))
            });
        }
    }
    let answers = round.join_all().await;
    assert!(
        answers
            .iter()
            .all(|answer| *answer == (StatusCode::CREATED, true)),
        "a finished operation was not replayed in the round: {answers:?}"
    );
    for key in &keys {
        assert_eq!(notes(&store, key).await, 1, "{key} ran again");
    }
}

async fn problem_type(response: reqwest::Response) -> String {
    let body = response.bytes().await.expect("a problem body");
    let body: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
    body["type"].as_str().expect("a type").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_duplicate_outlasts_the_operation_timeout_and_replays() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    // Each ledger call may take 400 ms; the duplicate may wait 5 s.
    let store = database_with(
        PostgresStore::builder(pg.url()).operation_timeout(Duration::from_millis(400)),
    )
    .await;
    let layer = IdempotencyLayer::transactional_server_builder(store.clone())
        .unscoped()
        .busy_policy(BusyPolicy::Wait(Duration::from_secs(5)))
        .build()
        .expect("layer");
    let addr = serve_notes(
        store.schema().to_owned(),
        Duration::from_millis(1500),
        layer,
    )
    .await;
    let first = tokio::spawn(async move { post_with_key(addr, "/notes", "long").await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let second = post_with_key(addr, "/notes", "long").await;
    assert_eq!(
        second.status(),
        201,
        "the duplicate waited for the first's commit, past the store's operation timeout"
    );
    assert!(replayed(&second));
    assert_eq!(second.text().await.expect("body"), "noted long");
    assert_eq!(first.await.expect("first").status(), 201);
    assert_eq!(notes(&store, "long").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_that_runs_out_is_a_409_with_retry_after_not_an_outage() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    // Each ledger call may take 400 ms; the duplicate may wait 700 ms, the handler takes 2 s.
    let store = database_with(
        PostgresStore::builder(pg.url()).operation_timeout(Duration::from_millis(400)),
    )
    .await;
    let layer = IdempotencyLayer::transactional_server_builder(store.clone())
        .unscoped()
        .busy_policy(BusyPolicy::Wait(Duration::from_millis(700)))
        .build()
        .expect("layer");
    let addr = serve_notes(store.schema().to_owned(), Duration::from_secs(2), layer).await;
    let first = tokio::spawn(async move { post_with_key(addr, "/notes", "slow").await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let second = post_with_key(addr, "/notes", "slow").await;
    assert_eq!(
        second.status(),
        409,
        "a duplicate that waited out its bound is told the key is in flight, not that the ledger is out"
    );
    assert!(
        second.headers().contains_key("retry-after"),
        "the 409 says when to come back"
    );
    assert_eq!(first.await.expect("first").status(), 201);
    assert_eq!(notes(&store, "slow").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_are_bounded_and_hold_no_pooled_connection() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    // Two connections: the slow request's transaction holds one for its whole handler.
    let store = database_with(
        PostgresStore::builder(pg.url())
            .pool_size(2)
            .operation_timeout(Duration::from_millis(500)),
    )
    .await;
    let layer = IdempotencyLayer::transactional_server_builder(store.clone())
        .unscoped()
        .busy_policy(BusyPolicy::Wait(Duration::from_secs(5)))
        .max_waiters(1)
        .build()
        .expect("layer");
    let addr = serve_notes(
        store.schema().to_owned(),
        Duration::from_millis(1500),
        layer,
    )
    .await;
    let first = tokio::spawn(async move { post_with_key(addr, "/notes", "slow").await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let duplicates: Vec<_> = (0..3)
        .map(|_| {
            tokio::spawn(async move {
                let started = tokio::time::Instant::now();
                let response = post_with_key(addr, "/notes", "slow").await;
                (response, started.elapsed())
            })
        })
        .collect();
    // Meanwhile another key is served: the waiter does not sit on the second connection.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let other = post_with_key(addr, "/notes", "quick-other").await;
    assert_eq!(
        other.status(),
        201,
        "another key is not starved by a waiter"
    );
    assert!(!replayed(&other));

    let (mut replays, mut refused) = (0, 0);
    for duplicate in duplicates {
        let (response, took) = duplicate.await.expect("duplicate");
        match response.status().as_u16() {
            201 => {
                assert!(replayed(&response));
                replays += 1;
            }
            409 => {
                assert!(response.headers().contains_key("retry-after"));
                assert!(
                    took < Duration::from_millis(700),
                    "refused at once, not after waiting ({took:?})"
                );
                refused += 1;
            }
            other => panic!(
                "a duplicate got {other} after {took:?}: {}",
                response.text().await.unwrap_or_default()
            ),
        }
    }
    assert_eq!((replays, refused), (1, 2), "one waiter, two refused");
    assert_eq!(first.await.expect("first").status(), 201);
    assert_eq!(notes(&store, "slow").await, 1);
    assert_eq!(notes(&store, "quick-other").await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_409_leaves_no_error_in_postgresql_s_log() {
    // Its own server, to read its log.
    let Some(server) = postgres_support::PostgresServer::spawn().await else {
        return;
    };
    let store = database(&server.url()).await;
    let layer = unscoped_layer(&store);
    let addr = serve_notes(store.schema().to_owned(), Duration::from_millis(600), layer).await;
    let first = tokio::spawn(async move { post_with_key(addr, "/notes", "busy").await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = tokio::time::Instant::now();
    let duplicate = post_with_key(addr, "/notes", "busy").await;
    assert_eq!(duplicate.status(), 409);
    assert!(duplicate.headers().contains_key("retry-after"));
    assert!(
        started.elapsed() < Duration::from_millis(300),
        "answered at once"
    );
    assert_eq!(first.await.expect("first").status(), 201);
    let log = server.log_text();
    let errors: Vec<_> = log.lines().filter(|line| line.contains("ERROR")).collect();
    assert!(errors.is_empty(), "PostgreSQL logged: {errors:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_whose_answer_is_lost_is_commit_unknown_and_the_retry_replays() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let store = PostgresStore::builder(pg.url())
        .schema(postgres_support::fresh_schema())
        .operation_timeout(Duration::from_millis(300))
        .connect()
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    let schema = store.schema().to_owned();
    // Every commit with a note in it takes 1 s (a deferred trigger): past the store's
    // bound, so the layer gives up on the commit's answer, and the commit then lands.
    store
        .pool()
        .get()
        .await
        .expect("a connection")
        .batch_execute(&format!(
            "CREATE TABLE {schema}.notes (key text NOT NULL);
             CREATE FUNCTION {schema}.slow_commit() RETURNS trigger LANGUAGE plpgsql AS
                 $$ BEGIN PERFORM pg_sleep(1); RETURN NULL; END $$;
             CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON {schema}.notes
                 DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
                 EXECUTE FUNCTION {schema}.slow_commit();"
        ))
        .await
        .expect("create the table");
    let layer = unscoped_layer(&store);
    let addr = serve_notes(schema, Duration::ZERO, layer).await;
    let first = post_with_key(addr, "/notes", "lost").await;
    assert_eq!(first.status(), 503);
    assert!(first.headers().contains_key("retry-after"));
    assert_eq!(
        problem_type(first).await,
        tower_idempotency::server::problem::COMMIT_UNKNOWN,
        "not `ledger-unavailable`: the request may have been handled"
    );
    // The commit landed after all: the retry (once the commit is over) replays it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let retry = loop {
        let retry = post_with_key(addr, "/notes", "lost").await;
        if retry.status() != 409 {
            break retry;
        }
        assert!(tokio::time::Instant::now() < deadline, "still busy");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(retry.status(), 201);
    assert!(replayed(&retry));
    assert_eq!(retry.text().await.expect("body"), "noted lost");
    assert_eq!(notes(&store, "lost").await, 1);
}

/// `BusyPolicy::Wait(Duration::MAX)` ("wait as long as it takes") is documented on
/// `server::Builder::retention` as accepted and saturated to ~139 years, like every other
/// duration of the ledger ("busy wait" named among them), and the engine's mode does so. In
/// the transactional mode every keyed request must still be served: the first one, with
/// nothing in flight, is expected to run the handler and get its `201`.
#[tokio::test]
async fn a_busy_wait_of_duration_max_is_saturated_in_the_transactional_mode() {
    use tower::ServiceExt;
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let store = database(pg.url()).await;
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = runs.clone();
    let layer = IdempotencyLayer::transactional_server_builder(store.clone())
        .unscoped()
        .busy_policy(BusyPolicy::Wait(Duration::MAX))
        .build()
        .expect("a busy wait of Duration::MAX is accepted");
    let app = Router::new()
        .route(
            "/notes",
            post(move || {
                let runs = counted.clone();
                async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    (StatusCode::CREATED, "noted")
                }
            }),
        )
        .route_layer(layer);
    let request = axum::http::Request::post("/notes")
        .header("idempotency-key", "\"max-wait\"")
        .body(axum::body::Body::from("{}"))
        .unwrap();
    // Spawned so that a panic inside the layer is seen as a failed join, not a crash.
    let answer = tokio::spawn(app.oneshot(request)).await;
    let response = answer
        .expect("the layer must not panic on a saturated busy wait")
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The transactional mode's records are listed as the plain mode's are: in the scope the
/// layer gave the request, completed with the handler's status; a request rolled back left
/// no record to list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_transactional_mode_s_records_are_listed_in_their_scope() {
    use tower_idempotency::ledger::{
        scope_id, IdempotencyStore, ListQuery, RecordKind, RecordState,
    };

    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let store = database(pg.url()).await;
    let schema = store.schema().to_owned();
    let handler = move |tx: PostgresTransaction, headers: axum::http::HeaderMap| async move {
        let refuse = headers.contains_key("x-refuse");
        if refuse {
            write_then_refuse(&tx, &schema, "listed").await
        } else {
            write_note(&tx, &schema, "listed").await;
            StatusCode::CREATED
        }
    };
    let layer = IdempotencyLayer::transactional_server_builder(store.clone())
        .scope(|parts| {
            parts
                .headers
                .get("x-tenant")
                .and_then(|tenant| tenant.to_str().ok())
                .unwrap_or("")
                .to_owned()
        })
        .build()
        .expect("layer");
    let addr = serve(
        Router::new()
            .route("/notes", post(handler))
            .route_layer(layer),
    )
    .await;
    let send = |key: &'static str, refuse: bool| async move {
        let request = reqwest::Client::new()
            .post(format!("http://{addr}/notes"))
            .header("idempotency-key", format!("\"{key}\""))
            .header("x-tenant", "tenant-listed");
        let request = if refuse {
            request.header("x-refuse", "1")
        } else {
            request
        };
        request.body("{}").send().await.expect("an answer").status()
    };
    assert_eq!(send("created", false).await, 201);
    assert_eq!(send("refused", true).await, 422);

    let page = store
        .list(ListQuery::new().scope("tenant-listed"))
        .await
        .expect("list");
    assert_eq!(page.records.len(), 1, "{page:?}");
    assert!(page.next.is_none());
    let listed = &page.records[0];
    assert_eq!(
        listed.view.state,
        RecordState::Completed {
            status: StatusCode::CREATED
        }
    );
    assert_eq!(listed.view.scope, scope_id("tenant-listed"));
    let inspected = store
        .inspect(listed.key)
        .await
        .expect("inspect")
        .expect("the listed record");
    assert_eq!(
        (inspected.generation, inspected.scope, inspected.attempts),
        (
            listed.view.generation,
            listed.view.scope,
            listed.view.attempts
        ),
        "listed as inspected"
    );
    let completed = store
        .list(
            ListQuery::new()
                .scope("tenant-listed")
                .kind(RecordKind::Completed),
        )
        .await
        .expect("list");
    assert_eq!(completed.records.len(), 1);
    let elsewhere = store
        .list(ListQuery::new().scope("another-tenant"))
        .await
        .expect("list");
    assert!(elsewhere.records.is_empty());
    assert_eq!(notes(&store, "listed").await, 1);
}
