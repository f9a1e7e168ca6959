//! `PostgresStore` against a real PostgreSQL: the conformance suite, the schema's
//! migration, retention and its sweep, and failing closed.
//!
//! Each test starts its own server (see `support/postgres.rs`; skipped with a notice
//! without the binaries, unless `REQUIRE_POSTGRES=1`) or uses `DATABASE_URL`, and its own
//! schema. PostgreSQL judges leases by its own clock, so the suite sleeps for real.
#![cfg(all(feature = "postgres", feature = "test-util"))]

use crate::support::postgres as postgres_support;

use std::sync::Arc;
use std::time::Duration;

use tower_idempotency::ledger::postgres::SCHEMA_VERSION;
use tower_idempotency::ledger::{
    Begin, BeginRequest, Expected, Forget, IdempotencyStore, LedgerKey, ListQuery, Origin, Outcome,
    PostgresStore, RecordKind, StoredResponse,
};
use tower_idempotency::testing::conformance::{
    inspection_follows_the_record, listing_finds_what_it_asks_for, run_all, sample_fingerprint,
    Clock,
};

async fn store(url: &str) -> PostgresStore {
    let store = PostgresStore::builder(url)
        .schema(postgres_support::fresh_schema())
        .connect()
        .await
        .expect("connect to PostgreSQL");
    store.migrate().await.expect("migrate");
    store
}

fn ok_outcome() -> Outcome {
    Outcome::Response(StoredResponse::new(
        http::StatusCode::CREATED,
        http::Version::HTTP_11,
        http::HeaderMap::new(),
        "ok".into(),
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_passes_the_conformance_suite() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let store = store(pg.url()).await;
    run_all(Arc::new(store.clone()), Clock::real()).await;
    inspection_follows_the_record(&store).await;
    listing_finds_what_it_asks_for(&store, &Clock::real()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_is_idempotent_concurrent_and_refuses_a_newer_schema() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let schema = postgres_support::fresh_schema();
    let connect = || {
        PostgresStore::builder(pg.url())
            .schema(schema.clone())
            .connect()
    };
    let first = connect().await.expect("connect");
    assert_eq!(first.schema_version().await.expect("version"), None);
    // Replicas starting together: each migrates, one does the work.
    let migrations: Vec<_> = (0..4)
        .map(|_| {
            let store = first.clone();
            tokio::spawn(async move { store.migrate().await })
        })
        .collect();
    for migration in migrations {
        assert_eq!(
            migration.await.expect("task").expect("migrate"),
            SCHEMA_VERSION
        );
    }
    assert_eq!(
        first.schema_version().await.expect("version"),
        Some(SCHEMA_VERSION)
    );
    let second = connect().await.expect("connect");
    assert_eq!(second.migrate().await.expect("again"), SCHEMA_VERSION);

    // A schema from a later release is refused, never misread.
    let client = first.pool().get().await.expect("a connection");
    client
        .execute(
            &format!("UPDATE {schema}.schema_version SET version = 99"),
            &[],
        )
        .await
        .expect("bump the version");
    let err = second.migrate().await.unwrap_err();
    assert!(
        err.is_unavailable() && err.to_string().contains("99"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unmigrated_schema_and_a_bad_schema_name_are_clear_errors() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let bare = PostgresStore::builder(pg.url())
        .schema(postgres_support::fresh_schema())
        .connect()
        .await
        .expect("connect");
    let key = LedgerKey::from_bytes([1; 32]);
    let request = BeginRequest::new(
        key,
        sample_fingerprint(),
        Duration::from_secs(1),
        Duration::from_secs(60),
    );
    let err = bare.begin(request).await.unwrap_err();
    assert!(
        err.is_unavailable() && err.to_string().contains("migrate"),
        "{err}"
    );
    let err = PostgresStore::builder(pg.url())
        .schema("x; DROP TABLE y")
        .connect()
        .await
        .unwrap_err();
    assert!(err.to_string().contains("schema"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_deletes_only_expired_records_and_they_read_as_absent_before() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let store = store(pg.url()).await;
    let short = Duration::from_millis(300);
    let mut keys = Vec::new();
    for n in 0..3u8 {
        let key = LedgerKey::from_bytes([n; 32]);
        let begin = BeginRequest::new(key, sample_fingerprint(), Duration::from_millis(100), short);
        let Begin::Acquired { token } = store.begin(begin).await.expect("begin") else {
            panic!("fresh key")
        };
        store
            .complete(key, token, ok_outcome(), short)
            .await
            .expect("complete");
        keys.push(key);
    }
    let kept = LedgerKey::from_bytes([9; 32]);
    let begin = BeginRequest::new(
        kept,
        sample_fingerprint(),
        Duration::from_secs(10),
        Duration::from_secs(600),
    );
    store.begin(begin).await.expect("begin");
    tokio::time::sleep(short + Duration::from_millis(200)).await;
    // Expired but not yet swept: absent to every call.
    assert_eq!(store.inspect(keys[0]).await.expect("inspect"), None);
    assert_eq!(store.sweep().await.expect("sweep"), 3);
    assert_eq!(store.sweep().await.expect("sweep"), 0);
    assert!(store.inspect(kept).await.expect("inspect").is_some());
}

/// A token released beside a record outlasts the record's retention: the sweep keeps the row
/// while the token is remembered, a late `begin` of it is refused, and any other caller
/// claims the key (which ends the marker, and the next sweep has nothing to delete).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_keeps_a_token_released_beside_a_record_past_its_retention() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let store = store(pg.url()).await;
    let short = Duration::from_millis(300);
    let key = LedgerKey::from_bytes([51; 32]);
    let begin = || BeginRequest::new(key, sample_fingerprint(), Duration::from_millis(100), short);
    let Begin::Acquired { token } = store.begin(begin()).await.expect("begin") else {
        panic!("fresh key")
    };
    store
        .complete(key, token, ok_outcome(), short)
        .await
        .expect("complete");
    let late = begin();
    assert!(store
        .abandon(key, late.token)
        .await
        .unwrap_err()
        .is_fenced());
    tokio::time::sleep(short + Duration::from_millis(200)).await;
    assert_eq!(store.inspect(key).await.expect("inspect"), None);
    assert_eq!(store.sweep().await.expect("sweep"), 0);
    let refused = store.begin(late.clone()).await.unwrap_err();
    assert!(refused.is_fenced(), "{refused}");
    assert!(matches!(
        store.begin(begin()).await.expect("begin"),
        Begin::Acquired { .. }
    ));
    assert!(matches!(
        store.begin(late).await.expect("begin"),
        Begin::Busy { .. }
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_stores_on_one_database_give_one_owner() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let a = store(pg.url()).await;
    let b = PostgresStore::builder(pg.url())
        .schema(a.schema().to_owned())
        .connect()
        .await
        .expect("connect");
    let key = LedgerKey::from_bytes([42; 32]);
    let tasks: Vec<_> = (0..64)
        .map(|n| {
            let store = if n % 2 == 0 { a.clone() } else { b.clone() };
            let request = BeginRequest::new(
                key,
                sample_fingerprint(),
                Duration::from_secs(10),
                Duration::from_secs(600),
            );
            tokio::spawn(async move { store.begin(request).await.expect("begin") })
        })
        .collect();
    let mut acquired = 0;
    for task in tasks {
        match task.await.expect("task") {
            Begin::Acquired { .. } => acquired += 1,
            Begin::Busy { .. } => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(acquired, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_database_fails_closed_and_the_store_recovers() {
    let Some(mut pg) = postgres_support::postgres_url().await else {
        return;
    };
    let Some(server) = pg.server() else {
        eprintln!("DATABASE_URL is set: this test needs a private server to stop");
        return;
    };
    let store = PostgresStore::builder(server.url())
        .schema(postgres_support::fresh_schema())
        .operation_timeout(Duration::from_millis(500))
        .connect()
        .await
        .expect("connect");
    store.migrate().await.expect("migrate");
    server.stop();
    let key = LedgerKey::from_bytes([5; 32]);
    let request = BeginRequest::new(
        key,
        sample_fingerprint(),
        Duration::from_secs(1),
        Duration::from_secs(60),
    );
    let err = store.begin(request.clone()).await.unwrap_err();
    assert!(err.is_unavailable() || err.is_timeout(), "{err}");
    server.restart().await;
    // The pool drops the dead connections and makes new ones.
    let mut answer = store.begin(request.clone()).await;
    for _ in 0..20 {
        if answer.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        answer = store.begin(request.clone()).await;
    }
    assert!(matches!(
        answer.expect("begin after restart"),
        Begin::Acquired { .. }
    ));
}

/// A database a version-1 release made, with records in it, is brought to this release's
/// version by `migrate`: its records answer as they did, and the released-token marker
/// works on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_one_schema_with_records_migrates_to_version_two() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let schema = postgres_support::fresh_schema();
    let store = PostgresStore::builder(pg.url())
        .schema(schema.clone())
        .connect()
        .await
        .expect("connect");
    // The schema as a version-1 release left it.
    let client = store.pool().get().await.expect("a connection");
    client
        .batch_execute(&format!(
            "CREATE SCHEMA {schema};
             CREATE TABLE {schema}.schema_version (
                 singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
                 version integer NOT NULL);
             INSERT INTO {schema}.schema_version (version) VALUES (1);
             {}",
            include_str!("../../src/ledger/postgres/schema_v1.sql").replace("{schema}", &schema)
        ))
        .await
        .expect("a version-1 schema");
    // A completed record and one in flight, written by version 1's functions.
    let (done, open) = (
        LedgerKey::from_bytes([21; 32]),
        LedgerKey::from_bytes([22; 32]),
    );
    let request = |key| {
        BeginRequest::new(
            key,
            sample_fingerprint(),
            Duration::from_secs(30),
            Duration::from_secs(600),
        )
    };
    let claim = |request: &BeginRequest| {
        let sql = format!(
            "SELECT r_answer FROM {schema}.begin_op($1, $2, $3, 30000, 600000, true, NULL)"
        );
        let (key, fp, token) = (
            request.key.as_bytes().to_vec(),
            request.fingerprint.as_bytes().to_vec(),
            request.token.as_u128().to_be_bytes().to_vec(),
        );
        let client = &client;
        async move {
            let row = client
                .query_one(&sql, &[&key, &fp, &token])
                .await
                .expect("a version-1 claim");
            assert_eq!(row.get::<_, &str>(0), "acquired");
        }
    };
    let (done_claim, open_claim) = (request(done), request(open));
    claim(&done_claim).await;
    claim(&open_claim).await;
    assert_eq!(store.schema_version().await.expect("version"), Some(1));

    assert_eq!(store.migrate().await.expect("migrate"), SCHEMA_VERSION);
    store
        .complete(
            done,
            done_claim.token,
            ok_outcome(),
            Duration::from_secs(600),
        )
        .await
        .expect("the version-1 claim completes after the upgrade");
    assert!(matches!(
        store.begin(request(done)).await.expect("begin"),
        Begin::Replay(_)
    ));
    assert!(matches!(
        store.begin(request(open)).await.expect("begin"),
        Begin::Busy { .. }
    ));
    // Released, then its late `begin` arrives: refused, and the key stays free.
    store
        .abandon(open, open_claim.token)
        .await
        .expect("release the version-1 claim");
    let late = store.begin(open_claim).await.unwrap_err();
    assert!(late.is_fenced(), "{late}");
    assert!(store.inspect(open).await.expect("inspect").is_none());
    assert!(matches!(
        store.begin(request(open)).await.expect("begin"),
        Begin::Acquired { .. }
    ));
}

/// A database at version 2, with records in it, is brought to version 3 by `migrate`, and
/// its records get a generation without the table being rewritten: derived from when each
/// was created, kept through the record's transitions, and told from the generation of the
/// record the key gets next. A look at a version-2 record forgets it; that look never
/// forgets the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_two_schema_with_records_migrates_and_its_records_keep_their_lives() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let schema = postgres_support::fresh_schema();
    let store = PostgresStore::builder(pg.url())
        .schema(schema.clone())
        .connect()
        .await
        .expect("connect");
    let client = store.pool().get().await.expect("a connection");
    client
        .batch_execute(&format!(
            "CREATE SCHEMA {schema};
             CREATE TABLE {schema}.schema_version (
                 singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
                 version integer NOT NULL);
             INSERT INTO {schema}.schema_version (version) VALUES (2);
             {}
             {}",
            include_str!("../../src/ledger/postgres/schema_v1.sql").replace("{schema}", &schema),
            include_str!("../../src/ledger/postgres/schema_v2.sql").replace("{schema}", &schema)
        ))
        .await
        .expect("a version-2 schema");
    let retention = Duration::from_secs(600);
    let request = |key| {
        BeginRequest::new(
            key,
            sample_fingerprint(),
            Duration::from_secs(30),
            retention,
        )
    };
    // Claimed by version 2's `begin_op`: one to complete after the upgrade, one completed.
    let (open, done) = (
        LedgerKey::from_bytes([31; 32]),
        LedgerKey::from_bytes([32; 32]),
    );
    let (open_claim, done_claim) = (request(open), request(done));
    for claim in [&open_claim, &done_claim] {
        let row = client
            .query_one(
                &format!(
                    "SELECT r_answer FROM {schema}.begin_op($1, $2, $3, 30000, 600000, true, NULL)"
                ),
                &[
                    &claim.key.as_bytes().to_vec(),
                    &claim.fingerprint.as_bytes().to_vec(),
                    &claim.token.as_u128().to_be_bytes().to_vec(),
                ],
            )
            .await
            .expect("a version-2 claim");
        assert_eq!(row.get::<_, &str>(0), "acquired");
    }
    store
        .complete(done, done_claim.token, ok_outcome(), retention)
        .await
        .expect("a version-2 completion");

    assert_eq!(store.migrate().await.expect("migrate"), SCHEMA_VERSION);
    let look = |key| {
        let store = store.clone();
        async move {
            store
                .inspect(key)
                .await
                .expect("inspect")
                .expect("a record")
        }
    };
    // An earlier version's record keeps one generation through its transitions.
    let before = look(open).await.generation;
    store
        .complete(open, open_claim.token, ok_outcome(), retention)
        .await
        .expect("the version-2 claim completes after the upgrade");
    assert_eq!(look(open).await.generation, before);
    assert_eq!(
        look(open).await.generation,
        before,
        "looking changes nothing"
    );

    // Forgotten as seen, claimed and completed again: another life, and the old look is
    // refused.
    let seen = look(done).await;
    assert_eq!(
        store
            .forget(done, Expected::of(&seen))
            .await
            .expect("forget"),
        Forget::Forgotten
    );
    let again = request(done);
    let Begin::Acquired { token } = store.begin(again.clone()).await.expect("begin") else {
        panic!("expected Acquired")
    };
    store
        .complete(done, token, ok_outcome(), retention)
        .await
        .expect("complete");
    assert_ne!(look(done).await.generation, seen.generation);
    assert_eq!(
        store
            .forget(done, Expected::of(&seen))
            .await
            .expect("forget"),
        Forget::Changed
    );
    assert!(matches!(
        store.begin(again).await.expect("begin"),
        Begin::Replay(_)
    ));
}

/// A database at version 3, with a marker and a record in it, is brought to version 4 by
/// `migrate`: the marker version 3 wrote still refuses its token, and a token released while
/// the version-3 record holds the key is remembered beside it, so its late `begin` is refused
/// once that record has left (released by its owner, or forgotten by an operator).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_three_schema_migrates_and_remembers_a_token_released_beside_a_record() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let schema = postgres_support::fresh_schema();
    let store = PostgresStore::builder(pg.url())
        .schema(schema.clone())
        .connect()
        .await
        .expect("connect");
    let client = store.pool().get().await.expect("a connection");
    client
        .batch_execute(&format!(
            "CREATE SCHEMA {schema};
             CREATE TABLE {schema}.schema_version (
                 singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
                 version integer NOT NULL);
             INSERT INTO {schema}.schema_version (version) VALUES (3);
             {}
             {}
             {}",
            include_str!("../../src/ledger/postgres/schema_v1.sql").replace("{schema}", &schema),
            include_str!("../../src/ledger/postgres/schema_v2.sql").replace("{schema}", &schema),
            include_str!("../../src/ledger/postgres/schema_v3.sql").replace("{schema}", &schema)
        ))
        .await
        .expect("a version-3 schema");
    let retention = Duration::from_secs(600);
    let request = |key| {
        BeginRequest::new(
            key,
            sample_fingerprint(),
            Duration::from_secs(30),
            retention,
        )
    };
    let token_of = |request: &BeginRequest| request.token.as_u128().to_be_bytes().to_vec();
    // Version 3's functions: a marker left by a release that found no record, and two
    // claims (one its owner will release, one it will complete and an operator forget).
    let (marked, released, forgotten) = (
        LedgerKey::from_bytes([41; 32]),
        LedgerKey::from_bytes([42; 32]),
        LedgerKey::from_bytes([43; 32]),
    );
    let late_on_marked = request(marked);
    client
        .execute(
            &format!("SELECT {schema}.abandon_op($1, $2, 60000)"),
            &[&marked.as_bytes().to_vec(), &token_of(&late_on_marked)],
        )
        .await
        .expect("a version-3 release");
    let (released_claim, forgotten_claim) = (request(released), request(forgotten));
    for claim in [&released_claim, &forgotten_claim] {
        let row = client
            .query_one(
                &format!(
                    "SELECT r_answer FROM {schema}.begin_op($1, $2, $3, 30000, 600000, true, NULL)"
                ),
                &[
                    &claim.key.as_bytes().to_vec(),
                    &claim.fingerprint.as_bytes().to_vec(),
                    &token_of(claim),
                ],
            )
            .await
            .expect("a version-3 claim");
        assert_eq!(row.get::<_, &str>(0), "acquired");
    }

    assert_eq!(store.migrate().await.expect("migrate"), SCHEMA_VERSION);
    let refused = |answer: Result<Begin, tower_idempotency::ledger::StoreError>, what: &str| {
        assert!(
            matches!(&answer, Err(err) if err.is_fenced()),
            "{what}: expected fenced, got {answer:?}"
        );
    };
    refused(
        store.begin(late_on_marked).await,
        "the version-3 marker's token",
    );

    // Released beside the version-3 record, which its owner then releases.
    let late = request(released);
    assert!(store
        .abandon(released, late.token)
        .await
        .unwrap_err()
        .is_fenced());
    store
        .abandon(released, released_claim.token)
        .await
        .expect("the version-3 claim is released after the upgrade");
    refused(
        store.begin(late.clone()).await,
        "a late begin once released",
    );
    assert!(store.inspect(released).await.expect("inspect").is_none());
    assert!(matches!(
        store.begin(request(released)).await.expect("begin"),
        Begin::Acquired { .. }
    ));

    // Released beside the version-3 record, which completes and is forgotten.
    let late = request(forgotten);
    let _ = store.abandon(forgotten, late.token).await;
    store
        .complete(forgotten, forgotten_claim.token, ok_outcome(), retention)
        .await
        .expect("the version-3 claim completes after the upgrade");
    let seen = store
        .inspect(forgotten)
        .await
        .expect("inspect")
        .expect("a record");
    assert_eq!(
        store
            .forget(forgotten, Expected::of(&seen))
            .await
            .expect("forget"),
        Forget::Forgotten
    );
    refused(store.begin(late).await, "a late begin once forgotten");
    assert!(store.inspect(forgotten).await.expect("inspect").is_none());
    assert!(matches!(
        store.begin(request(forgotten)).await.expect("begin"),
        Begin::Acquired { .. }
    ));
}

/// A schema at `version` (1 to 4), as the release of that version left it.
async fn schema_at(store: &PostgresStore, version: usize) {
    let schema = store.schema();
    let migrations = [
        include_str!("../../src/ledger/postgres/schema_v1.sql"),
        include_str!("../../src/ledger/postgres/schema_v2.sql"),
        include_str!("../../src/ledger/postgres/schema_v3.sql"),
        include_str!("../../src/ledger/postgres/schema_v4.sql"),
    ];
    let steps: Vec<String> = migrations[..version]
        .iter()
        .map(|sql| sql.replace("{schema}", schema))
        .collect();
    store
        .pool()
        .get()
        .await
        .expect("a connection")
        .batch_execute(&format!(
            "CREATE SCHEMA {schema};
             CREATE TABLE {schema}.schema_version (
                 singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
                 version integer NOT NULL);
             INSERT INTO {schema}.schema_version (version) VALUES ({version});
             {}",
            steps.join("\n")
        ))
        .await
        .expect("an earlier release's schema");
}

/// A claim made by `begin_op` itself, as a release before version 4 (or one still running
/// during a rolling upgrade) makes it: with no scope.
async fn claim_as_an_earlier_release(store: &PostgresStore, request: &BeginRequest) {
    let row = store
        .pool()
        .get()
        .await
        .expect("a connection")
        .query_one(
            &format!(
                "SELECT r_answer FROM {}.begin_op($1, $2, $3, 30000, 600000, true, NULL)",
                store.schema()
            ),
            &[
                &request.key.as_bytes().to_vec(),
                &request.fingerprint.as_bytes().to_vec(),
                &request.token.as_u128().to_be_bytes().to_vec(),
            ],
        )
        .await
        .expect("an earlier release's claim");
    assert_eq!(row.get::<_, &str>(0), "acquired");
}

/// A database at version 3, with records in it, is brought to version 4 by `migrate`: its
/// records are listed, of no scope and last touched when claimed, and what happens to them
/// afterwards touches them; a claim made after the upgrade is listed in its scope, one a
/// previous release still makes (a rolling upgrade) in none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_three_schema_migrates_and_its_records_are_listed() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let store = PostgresStore::builder(pg.url())
        .schema(postgres_support::fresh_schema())
        .connect()
        .await
        .expect("connect");
    schema_at(&store, 3).await;
    let retention = Duration::from_secs(600);
    let request = |n: u8| {
        BeginRequest::new(
            LedgerKey::from_bytes([n; 32]),
            sample_fingerprint(),
            Duration::from_secs(30),
            retention,
        )
    };
    let (open, done) = (request(41), request(42));
    claim_as_an_earlier_release(&store, &open).await;
    claim_as_an_earlier_release(&store, &done).await;
    store
        .complete(done.key, done.token, ok_outcome(), retention)
        .await
        .expect("a version-3 completion");

    assert_eq!(store.migrate().await.expect("migrate"), SCHEMA_VERSION);
    let everything = store.list(ListQuery::new()).await.expect("list");
    let keys: Vec<LedgerKey> = everything.records.iter().map(|r| r.key).collect();
    assert_eq!(keys, [done.key, open.key], "newest first");
    assert!(everything.next.is_none());
    for listed in &everything.records {
        assert_eq!(listed.view.scope, 0, "a version-3 record is of no scope");
        assert_eq!(
            listed.view.touched, listed.view.age,
            "a version-3 record reads as last touched when claimed"
        );
        let inspected = store
            .inspect(listed.key)
            .await
            .expect("inspect")
            .expect("a record");
        assert_eq!(
            (inspected.generation, inspected.attempts, inspected.scope),
            (listed.view.generation, listed.view.attempts, 0)
        );
    }
    let in_flight = store
        .list(ListQuery::new().kind(RecordKind::InFlight))
        .await
        .expect("list");
    assert_eq!(in_flight.records.len(), 1);
    assert_eq!(in_flight.records[0].key, open.key);

    // PostgreSQL's clock judges ages: let it move, then settle the version-3 claim.
    tokio::time::sleep(Duration::from_millis(50)).await;
    store
        .mark_in_doubt(open.key, open.token, retention)
        .await
        .expect("the version-3 claim is settled after the upgrade");
    let in_doubt = store
        .list(ListQuery::new().kind(RecordKind::InDoubt))
        .await
        .expect("list");
    assert_eq!(in_doubt.records.len(), 1);
    let view = &in_doubt.records[0].view;
    assert!(
        view.touched < view.age,
        "marked in doubt after its claim: {view:?}"
    );

    let scoped = request(43).with_scope("tenant-after-the-upgrade");
    assert!(matches!(
        store.begin(scoped.clone()).await.expect("begin"),
        Begin::Acquired { .. }
    ));
    let late = request(44);
    claim_as_an_earlier_release(&store, &late).await;
    let in_scope = store
        .list(ListQuery::new().scope("tenant-after-the-upgrade"))
        .await
        .expect("list");
    let keys: Vec<LedgerKey> = in_scope.records.iter().map(|r| r.key).collect();
    assert_eq!(keys, [scoped.key]);
    let unscoped = store
        .list(ListQuery::new().scope("").oldest_first())
        .await
        .expect("list");
    let keys: Vec<LedgerKey> = unscoped.records.iter().map(|r| r.key).collect();
    assert_eq!(keys, [open.key, done.key, late.key]);
}

/// A claim made by `scoped_begin_op`, as a release at version 4 (or one still running
/// during a rolling upgrade) makes it: in its scope, of no origin.
async fn claim_as_version_four(store: &PostgresStore, request: &BeginRequest) {
    let row = store
        .pool()
        .get()
        .await
        .expect("a connection")
        .query_one(
            &format!(
                "SELECT r_answer FROM {}.scoped_begin_op($1, $2, $3, 30000, 600000, true, NULL, $4)",
                store.schema()
            ),
            &[
                &request.key.as_bytes().to_vec(),
                &request.fingerprint.as_bytes().to_vec(),
                &request.token.as_u128().to_be_bytes().to_vec(),
                &(request.scope as i64),
            ],
        )
        .await
        .expect("a version-4 claim");
    assert_eq!(row.get::<_, &str>(0), "acquired");
}

/// A database at version 4, with records in it, is brought to version 5 by `migrate`: its
/// records read as of no origin (inspected and listed, in their scope still), an origin
/// filter lists none of them, and what happens to them afterwards leaves them so; a claim
/// made after the upgrade keeps its origin, one a version-4 release still makes (a rolling
/// upgrade) none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_four_schema_migrates_and_its_records_are_of_no_origin() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let store = PostgresStore::builder(pg.url())
        .schema(postgres_support::fresh_schema())
        .connect()
        .await
        .expect("connect");
    schema_at(&store, 4).await;
    let retention = Duration::from_secs(600);
    let request = |n: u8| {
        BeginRequest::new(
            LedgerKey::from_bytes([n; 32]),
            sample_fingerprint(),
            Duration::from_secs(30),
            retention,
        )
        .with_scope("tenant-a")
    };
    let (open, done) = (request(51), request(52));
    claim_as_version_four(&store, &open).await;
    claim_as_version_four(&store, &done).await;
    store
        .complete(done.key, done.token, ok_outcome(), retention)
        .await
        .expect("a version-4 completion");

    assert_eq!(store.migrate().await.expect("migrate"), SCHEMA_VERSION);
    assert_eq!(SCHEMA_VERSION, 5);
    let listed = store
        .list(ListQuery::new().scope("tenant-a"))
        .await
        .expect("list");
    let keys: Vec<LedgerKey> = listed.records.iter().map(|r| r.key).collect();
    assert_eq!(keys, [done.key, open.key], "newest first, in their scope");
    for record in &listed.records {
        assert_eq!(
            record.view.origin, None,
            "a version-4 record is of no origin"
        );
        let inspected = store
            .inspect(record.key)
            .await
            .expect("inspect")
            .expect("a record");
        assert_eq!(inspected.origin, None);
    }
    store
        .mark_in_doubt(open.key, open.token, retention)
        .await
        .expect("the version-4 claim is settled after the upgrade");
    let view = store
        .inspect(open.key)
        .await
        .expect("inspect")
        .expect("a record");
    assert_eq!(view.origin, None, "a change of state gives no origin");

    let op = tower_idempotency::OperationId::new("task-after-the-upgrade", "step-1");
    let target: http::Uri = "https://payments.example/v1/charges"
        .parse()
        .expect("a URI");
    let origin = Origin::client(&http::Method::POST, &target).with_operation(&op);
    let after = request(53).with_origin(origin.clone());
    assert!(matches!(
        store.begin(after.clone()).await.expect("begin"),
        Begin::Acquired { .. }
    ));
    let late = request(54).with_origin(origin.clone());
    claim_as_version_four(&store, &late).await;
    let view = store
        .inspect(after.key)
        .await
        .expect("inspect")
        .expect("a record");
    assert_eq!(view.origin.as_ref(), Some(&origin));
    let view = store
        .inspect(late.key)
        .await
        .expect("inspect")
        .expect("a record");
    assert_eq!(
        view.origin, None,
        "a version-4 release's claim names no origin"
    );
    for query in [
        ListQuery::new().target("POST https://payments.example/"),
        ListQuery::new().task("task-after-the-upgrade"),
    ] {
        let page = store.list(query.scope("tenant-a")).await.expect("list");
        let keys: Vec<LedgerKey> = page.records.iter().map(|r| r.key).collect();
        assert_eq!(keys, [after.key], "only the claim that named its origin");
        assert_eq!(page.records[0].view.origin.as_ref(), Some(&origin));
    }
}

/// A page looks at a bounded number of records: a list whose filter few records pass
/// comes back in short pages (none, even) that each hand out a cursor, and following them
/// finds every record that passes, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sparse_list_comes_in_bounded_pages_and_misses_nothing() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let store = store(pg.url()).await;
    let schema = store.schema().to_owned();
    // 12,000 completed records, a microsecond apart, every 5,000th a 503, all others 201.
    store
        .pool()
        .get()
        .await
        .expect("a connection")
        .batch_execute(&format!(
            "INSERT INTO {schema}.records
                 (key, fingerprint, state, sent, created_at, retain_until, attempts, status,
                  generation)
             SELECT sha256(int4send(n)), '\\x{fp}'::bytea, 'completed', false,
                    now() - interval '1 hour' + n * interval '1 microsecond',
                    now() + interval '1 hour', 1,
                    CASE WHEN n % 5000 = 0 THEN 503 ELSE 201 END, n
               FROM generate_series(1, 12000) n",
            fp = sample_fingerprint().to_hex()
        ))
        .await
        .expect("seed the records");
    let failures = ListQuery::new().completed_with(
        http::StatusCode::INTERNAL_SERVER_ERROR,
        http::StatusCode::from_u16(599).expect("a status"),
    );
    let mut query = failures.clone();
    let (mut pages, mut found) = (0, Vec::new());
    loop {
        let page = store.list(query.clone()).await.expect("list");
        pages += 1;
        found.extend(page.records.iter().map(|r| r.view.generation.as_u64()));
        match page.next {
            Some(next) => query = failures.clone().after(next),
            None => break,
        }
    }
    assert_eq!(found, [10000, 5000], "newest first, each once");
    assert!(
        pages >= 3,
        "12,000 records in pages that look at 5,000 at most: {pages} pages"
    );
    // A filter the index answers reads no more than its page.
    let page = store
        .list(ListQuery::new().kind(RecordKind::Completed).limit(5))
        .await
        .expect("list");
    assert_eq!(page.records.len(), 5);
    assert!(page.next.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_shows_the_frozen_request_it_keeps() {
    let Some(pg) = postgres_support::postgres_url().await else {
        return;
    };
    let store = store(pg.url()).await;
    assert!(
        tower_idempotency::testing::conformance::inspection_shows_the_frozen_request(&store).await,
        "the PostgreSQL store shows a record's frozen request in doubt"
    );
}
