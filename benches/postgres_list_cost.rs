//! What a page of `list` costs on PostgreSQL when the store holds a million records,
//! against `DATABASE_URL`.
//!
//! ```text
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres cargo bench --features postgres --bench postgres_list_cost
//! ```
//!
//! Fills a fresh schema with `LIST_COST_ROWS` records (1,000,000 by default) in one
//! `generate_series` insert: claimed over the last day, a microsecond-distinct claim time
//! each, in 100 scopes; 2% in flight, 2% in doubt, the rest completed (1% of those with a
//! `503`). Then times pages of 100 for the queries an operator makes, first pages and pages
//! deep into a list (following cursors), and drops the schema (`LIST_COST_KEEP=1` keeps it,
//! to `EXPLAIN` the store's statements by hand).

use std::time::{Duration, Instant};

use tower_idempotency::ledger::{
    scope_id, IdempotencyStore, ListQuery, PostgresStore, RecordKind, DEFAULT_PAGE,
};
use tower_idempotency::BoxError;

/// Pages timed per query.
const PAGES: usize = 50;

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "set DATABASE_URL")?;
    let rows: i64 = std::env::var("LIST_COST_ROWS")
        .ok()
        .and_then(|rows| rows.parse().ok())
        .unwrap_or(1_000_000);
    let store = PostgresStore::builder(url)
        .schema(format!("list_cost_{:08x}", fastrand::u32(..)))
        .pool_size(1)
        .sweep_every(None)
        .operation_timeout(Duration::from_secs(5))
        .connect()
        .await?;
    store.migrate().await?;
    let started = Instant::now();
    fill(&store, rows).await?;
    println!(
        "{rows} records in {} ({:.1?} to fill and analyze)",
        store.schema(),
        started.elapsed()
    );

    let tenant = "tenant-7";
    let failures = ListQuery::new().completed_with(
        http::StatusCode::INTERNAL_SERVER_ERROR,
        http::StatusCode::from_u16(599).expect("a status"),
    );
    let queries = [
        ("every record, newest first", ListQuery::new()),
        (
            "every record, oldest first",
            ListQuery::new().oldest_first(),
        ),
        ("in doubt", ListQuery::new().kind(RecordKind::InDoubt)),
        (
            "in doubt > 1 h, oldest first",
            ListQuery::new()
                .kind(RecordKind::InDoubt)
                .older_than(Duration::from_secs(3600))
                .oldest_first(),
        ),
        (
            "in flight + in doubt",
            ListQuery::new()
                .kind(RecordKind::InFlight)
                .kind(RecordKind::InDoubt),
        ),
        ("completed 5xx", failures),
        ("one scope", ListQuery::new().scope(tenant)),
        (
            "one scope, in doubt",
            ListQuery::new().scope(tenant).kind(RecordKind::InDoubt),
        ),
        (
            "newer than 1 h",
            ListQuery::new().newer_than(Duration::from_secs(3600)),
        ),
    ];
    println!("pages of {DEFAULT_PAGE}, {PAGES} pages each, following the cursors:");
    for (what, query) in queries {
        time_pages(&store, what, query).await?;
    }
    if std::env::var("LIST_COST_KEEP").is_err() {
        let client = store.pool().get().await?;
        client
            .batch_execute(&format!("DROP SCHEMA {} CASCADE", store.schema()))
            .await?;
    }
    Ok(())
}

/// `rows` records, as described in the module docs.
async fn fill(store: &PostgresStore, rows: i64) -> Result<(), BoxError> {
    let schema = store.schema();
    let scopes: Vec<String> = (0..100)
        .map(|n| (scope_id(&format!("tenant-{n}")) as i64).to_string())
        .collect();
    let client = store.pool().get().await?;
    client.batch_execute("SET statement_timeout = 0").await?;
    // The trigger gives an inserted record its claim's scope (none here): off while the
    // records are seeded with theirs.
    client
        .batch_execute(&format!(
            "ALTER TABLE {schema}.records DISABLE TRIGGER records_touched_on_insert"
        ))
        .await?;
    client
        .batch_execute(&format!(
            "INSERT INTO {schema}.records
                 (key, fingerprint, state, token, lease_until, sent, created_at, retain_until,
                  attempts, outcome, status, generation, scope)
             SELECT sha256(int8send(n)), sha256(int8send(-n)), s.state,
                    CASE WHEN s.state = 'in_flight' THEN '\\x00000000000000000000000000000001'::bytea END,
                    CASE WHEN s.state = 'in_flight' THEN now() + interval '1 minute' END,
                    s.state <> 'in_flight',
                    now() - interval '1 day' + n * (interval '1 day' / {rows}),
                    now() + interval '1 day', 1,
                    CASE WHEN s.state = 'completed' THEN repeat('x', 200)::bytea END,
                    CASE WHEN s.state = 'completed' THEN CASE WHEN n % 100 = 0 THEN 503 ELSE 201 END END,
                    n, (ARRAY[{scopes}]::bigint[])[1 + (n / 7) % 100]
               FROM generate_series(1, {rows}) n,
                    LATERAL (SELECT CASE WHEN n % 50 = 1 THEN 'in_flight'
                                         WHEN n % 50 = 2 THEN 'in_doubt'
                                         ELSE 'completed' END AS state) s",
            scopes = scopes.join(",")
        ))
        .await?;
    client
        .batch_execute(&format!(
            "ALTER TABLE {schema}.records ENABLE TRIGGER records_touched_on_insert"
        ))
        .await?;
    // Its own statement: `VACUUM` refuses to run in the insert's implicit transaction.
    client
        .batch_execute(&format!("VACUUM ANALYZE {schema}.records"))
        .await?;
    Ok(())
}

async fn time_pages(store: &PostgresStore, what: &str, query: ListQuery) -> Result<(), BoxError> {
    // One page to warm the connection's prepared statement and the cache.
    store.list(query.clone()).await?;
    let mut first = Vec::with_capacity(PAGES);
    for _ in 0..PAGES {
        let started = Instant::now();
        store.list(query.clone()).await?;
        first.push(started.elapsed());
    }
    let mut following = Vec::with_capacity(PAGES);
    let (mut listed, mut next) = (0, None);
    for _ in 0..PAGES {
        let page_query = match next {
            Some(cursor) => query.clone().after(cursor),
            None => query.clone(),
        };
        let started = Instant::now();
        let page = store.list(page_query).await?;
        following.push(started.elapsed());
        listed += page.records.len();
        next = page.next;
        if next.is_none() {
            break;
        }
    }
    report(what, "first page", &mut first);
    report(
        what,
        &format!("{} pages on ({listed} listed)", following.len()),
        &mut following,
    );
    Ok(())
}

fn report(what: &str, pages: &str, samples: &mut [Duration]) {
    samples.sort();
    let at = |q: f64| samples[((samples.len() - 1) as f64 * q) as usize];
    println!(
        "{what:<30} {pages:<28} p50 {:>9.2?}   p99 {:>9.2?}   max {:>9.2?}",
        at(0.5),
        at(0.99),
        samples[samples.len() - 1]
    );
}
