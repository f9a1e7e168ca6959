//! Listing records: filters, order, cursors, and a look that changes nothing.

use std::collections::HashSet;
use std::time::Duration;

use http::StatusCode;

use super::{acquire, fresh_key, frozen, request, response, Clock, RETENTION};
use crate::ledger::{
    scope_id, BeginRequest, Expected, Forget, IdempotencyStore, LedgerKey, ListQuery, ListedRecord,
    Origin, OriginFace, Outcome, RecordKind, Resolve, StoredResponse,
};
use crate::OperationId;

/// How long the oldest record of a check waits before the others are made: the line
/// between "older than" and "newer than" sits half way.
const GAP: Duration = Duration::from_secs(2);

/// Between two records of a check, so that each is claimed at its own instant (a store may
/// keep claim times to the millisecond).
const STEP: Duration = Duration::from_millis(10);

/// The longest list a check follows, in pages: a store that never ends a list fails.
const MOST_PAGES: usize = 1000;

/// Four records in one fresh scope, claimed in this order: completed `201`, in doubt,
/// completed `409` (a tombstone), in flight under a long lease. The first two are steps of
/// one task sent by the client face, the third a tool's call in another task, the last a
/// request the server face received.
struct Seeded {
    scope: String,
    /// The task of the first two records.
    task: String,
    completed: LedgerKey,
    in_doubt: LedgerKey,
    conflict: LedgerKey,
    in_flight: LedgerKey,
    /// When the seeding ended.
    at: tokio::time::Instant,
}

impl Seeded {
    /// Newest first.
    fn newest_first(&self) -> Vec<LedgerKey> {
        vec![self.in_flight, self.conflict, self.in_doubt, self.completed]
    }

    /// The origin each record was claimed with.
    fn origin_of(&self, key: LedgerKey) -> Origin {
        let charges = "https://payments.example/v1/charges"
            .parse()
            .expect("a URI");
        let refunds = "https://payments.example/v1/refunds"
            .parse()
            .expect("a URI");
        if key == self.completed {
            Origin::client(&http::Method::POST, &charges)
                .with_operation(&OperationId::new(self.task.as_str(), "charge"))
        } else if key == self.in_doubt {
            Origin::client(&http::Method::POST, &refunds)
                .with_operation(&OperationId::new(self.task.as_str(), "refund"))
        } else if key == self.conflict {
            Origin::tool("send_email")
                .with_operation(&OperationId::new(format!("{}-other", self.task), "notify"))
        } else {
            Origin::server(&http::Method::PUT, "/orders/7")
        }
    }
}

async fn seed(store: &dyn IdempotencyStore, clock: &Clock) -> Seeded {
    // A scope of its own: the store may hold other checks' (or a shared backend's) records.
    let scope = format!("conformance-listing-{:032x}", fastrand::u128(..));
    let task = format!("conformance-task-{:032x}", fastrand::u128(..));
    let (completed, in_doubt, conflict, in_flight) =
        (fresh_key(), fresh_key(), fresh_key(), fresh_key());
    let mut seeded = Seeded {
        at: tokio::time::Instant::now(),
        scope: scope.clone(),
        task,
        completed,
        in_doubt,
        conflict,
        in_flight,
    };
    let origins = |key| seeded.origin_of(key);
    let claim = |key: LedgerKey, body: &'static str| {
        let scope = scope.clone();
        let origin = origins(key);
        async move {
            let req = frozen(body);
            acquire(
                store,
                request(key, &req).with_scope(&scope).with_origin(origin),
            )
            .await
        }
    };
    let owner = claim(completed, "{\"listed\":1}").await;
    store
        .complete(completed, owner, response("201"), RETENTION)
        .await
        .expect("complete");
    clock.advance(GAP).await;

    let owner = claim(in_doubt, "{\"listed\":2}").await;
    clock.advance(STEP).await;
    store
        .mark_in_doubt(in_doubt, owner, RETENTION)
        .await
        .expect("mark");
    clock.advance(STEP).await;

    let owner = claim(conflict, "{\"listed\":3}").await;
    let tombstone = Outcome::Tombstone {
        status: StatusCode::CONFLICT,
    };
    store
        .complete(conflict, owner, tombstone, RETENTION)
        .await
        .expect("complete");
    clock.advance(STEP).await;

    let req = frozen("{\"listed\":4}");
    let long_lease = BeginRequest::new(in_flight, req.fingerprint(), RETENTION, RETENTION)
        .with_frozen(req)
        .with_scope(&scope)
        .with_origin(origins(in_flight));
    acquire(store, long_lease).await;
    seeded.at = tokio::time::Instant::now();
    seeded
}

/// Every record of `query`'s list, following its cursors to the end.
async fn whole_list(store: &dyn IdempotencyStore, query: ListQuery) -> Vec<ListedRecord> {
    let mut listed = Vec::new();
    let mut query = query;
    for _ in 0..MOST_PAGES {
        let page = store.list(query.clone()).await.expect("list");
        assert!(
            page.records.len() <= query.page_limit(),
            "listing: a page held {} records, past its limit of {}",
            page.records.len(),
            query.page_limit()
        );
        listed.extend(page.records);
        match page.next {
            Some(cursor) => query = query.after(cursor),
            None => return listed,
        }
    }
    panic!("listing: a list did not end within {MOST_PAGES} pages");
}

async fn keys_of(store: &dyn IdempotencyStore, query: ListQuery) -> Vec<LedgerKey> {
    whole_list(store, query)
        .await
        .into_iter()
        .map(|record| record.key)
        .collect()
}

/// `list` finds a scope's records by state, status and age, newest or oldest first, a
/// page at a time without a record listed twice or left out, shows each as `inspect`
/// does with its scope's digest, and changes nothing.
pub async fn listing_finds_what_it_asks_for(store: &dyn IdempotencyStore, clock: &Clock) {
    let seeded = seed(store, clock).await;
    let scoped = || ListQuery::new().scope(&seeded.scope);
    let newest_first = seeded.newest_first();

    // First, while the ages are fresh: the line between old and new sits half a gap past
    // the time gone since the seeding, so a slow store (or a loaded machine) moves both
    // groups past it by the same amount and never the new ones across it.
    let line = || GAP / 2 + seeded.at.elapsed();
    assert_eq!(
        keys_of(store, scoped().older_than(line())).await,
        [seeded.completed],
        "listing: older than"
    );
    assert_eq!(
        keys_of(store, scoped().newer_than(line())).await,
        [seeded.in_flight, seeded.conflict, seeded.in_doubt],
        "listing: newer than"
    );

    assert_eq!(
        keys_of(store, scoped()).await,
        newest_first,
        "listing: a scope's records, newest first"
    );
    let mut oldest_first = newest_first.clone();
    oldest_first.reverse();
    assert_eq!(
        keys_of(store, scoped().oldest_first()).await,
        oldest_first,
        "listing: a scope's records, oldest first"
    );
    for limit in [1, 2, 3] {
        assert_eq!(
            keys_of(store, scoped().limit(limit)).await,
            newest_first,
            "listing: pages of {limit} follow one another without a gap or a repeat"
        );
        assert_eq!(
            keys_of(store, scoped().limit(limit).oldest_first()).await,
            oldest_first,
            "listing: pages of {limit}, oldest first"
        );
    }

    assert_eq!(
        keys_of(store, scoped().kind(RecordKind::InDoubt)).await,
        [seeded.in_doubt],
        "listing: by state, in doubt"
    );
    assert_eq!(
        keys_of(
            store,
            scoped()
                .kind(RecordKind::InFlight)
                .kind(RecordKind::InDoubt)
        )
        .await,
        [seeded.in_flight, seeded.in_doubt],
        "listing: by two states"
    );
    assert_eq!(
        keys_of(store, scoped().kind(RecordKind::Completed)).await,
        [seeded.conflict, seeded.completed],
        "listing: by state, completed"
    );
    assert_eq!(
        keys_of(
            store,
            scoped().completed_with(StatusCode::OK, StatusCode::from_u16(299).expect("a status"))
        )
        .await,
        [seeded.completed],
        "listing: completed with a success"
    );
    assert_eq!(
        keys_of(
            store,
            scoped().completed_with(StatusCode::CONFLICT, StatusCode::CONFLICT)
        )
        .await,
        [seeded.conflict],
        "listing: completed with a 409 (a tombstone's status)"
    );
    let other_scope = format!("{}-other", seeded.scope);
    assert!(
        keys_of(store, ListQuery::new().scope(&other_scope))
            .await
            .is_empty(),
        "listing: another scope's list holds none of these records"
    );

    listed_by_origin(store, &seeded).await;
    listed_as_inspected(store, &seeded).await;
    a_forgotten_record_is_not_listed(store, &seeded).await;
    a_resolved_record_is_listed_completed(store, &seeded).await;
}

/// `list` finds records by what they are of: a prefix of their target, a tool's name, a
/// task, alone or with the other filters, a page at a time.
async fn listed_by_origin(store: &dyn IdempotencyStore, seeded: &Seeded) {
    let scoped = || ListQuery::new().scope(&seeded.scope);
    let payments = [seeded.in_doubt, seeded.completed];
    assert_eq!(
        keys_of(store, scoped().target("POST https://payments.example/")).await,
        payments,
        "listing: by a target's prefix"
    );
    for limit in [1, 2] {
        assert_eq!(
            keys_of(
                store,
                scoped()
                    .target("POST https://payments.example/")
                    .limit(limit)
            )
            .await,
            payments,
            "listing: by a target's prefix, pages of {limit}"
        );
    }
    assert_eq!(
        keys_of(
            store,
            scoped().target("POST https://payments.example/v1/ch")
        )
        .await,
        [seeded.completed],
        "listing: by a longer target prefix"
    );
    assert_eq!(
        keys_of(store, scoped().target("PUT /orders/")).await,
        [seeded.in_flight],
        "listing: by a server face's target"
    );
    assert!(
        keys_of(store, scoped().target("GET ")).await.is_empty(),
        "listing: a target prefix no record has"
    );
    assert_eq!(
        keys_of(store, scoped().tool("send_email")).await,
        [seeded.conflict],
        "listing: by a tool's name"
    );
    assert!(
        keys_of(store, scoped().tool("send")).await.is_empty(),
        "listing: a tool's name is matched whole"
    );
    assert_eq!(
        keys_of(store, scoped().task(&seeded.task)).await,
        payments,
        "listing: by a task"
    );
    assert_eq!(
        keys_of(store, scoped().task(&seeded.task).kind(RecordKind::InDoubt)).await,
        [seeded.in_doubt],
        "listing: by a task and a state"
    );
    assert_eq!(
        keys_of(store, scoped().task(&seeded.task).oldest_first().limit(1)).await,
        [seeded.completed, seeded.in_doubt],
        "listing: by a task, oldest first, a record a page"
    );
}

/// Each listed record shows what `inspect` shows (after every list above: listing changed
/// none of them), its scope's digest, and a last touch no older than its claim.
async fn listed_as_inspected(store: &dyn IdempotencyStore, seeded: &Seeded) {
    let listed = whole_list(store, ListQuery::new().scope(&seeded.scope)).await;
    let positions: HashSet<u64> = listed.iter().map(|record| record.position).collect();
    assert_eq!(
        positions.len(),
        listed.len(),
        "listing: records claimed at different instants share a position"
    );
    for record in listed {
        let inspected = store
            .inspect(record.key)
            .await
            .expect("inspect")
            .expect("listing: a listed record is there to inspect");
        let (seen, now) = (&record.view, &inspected);
        assert_eq!(
            (
                RecordKind::of(&seen.state),
                seen.fingerprint,
                seen.attempts,
                seen.generation
            ),
            (
                RecordKind::of(&now.state),
                now.fingerprint,
                now.attempts,
                now.generation
            ),
            "listing: a listed record shows what inspect shows"
        );
        assert_eq!(
            seen.scope,
            scope_id(&seeded.scope),
            "listing: a listed record shows its scope's digest"
        );
        let origin = seeded.origin_of(record.key);
        assert_eq!(
            (seen.origin.as_ref(), now.origin.as_ref()),
            (Some(&origin), Some(&origin)),
            "listing: a listed record shows its claim's origin, as inspect does"
        );
        let face = if record.key == seeded.conflict {
            OriginFace::Tool
        } else if record.key == seeded.in_flight {
            OriginFace::Server
        } else {
            OriginFace::Client
        };
        assert_eq!(origin.face(), face);
        assert!(
            seen.touched <= seen.age,
            "listing: touched after its claim: {seen:?}"
        );
    }
}

/// A record forgotten on an operator's word leaves the list at once.
async fn a_forgotten_record_is_not_listed(store: &dyn IdempotencyStore, seeded: &Seeded) {
    let seen = store
        .inspect(seeded.conflict)
        .await
        .expect("inspect")
        .expect("a record");
    assert_eq!(
        store
            .forget(seeded.conflict, Expected::of(&seen))
            .await
            .expect("forget"),
        Forget::Forgotten
    );
    assert_eq!(
        keys_of(store, ListQuery::new().scope(&seeded.scope)).await,
        [seeded.in_flight, seeded.in_doubt, seeded.completed],
        "listing: a forgotten record is still listed"
    );
}

/// A record in doubt that an operator resolves as applied leaves the in-doubt list at once
/// and is listed completed, at its claim's place, with the status of the operator's outcome.
async fn a_resolved_record_is_listed_completed(store: &dyn IdempotencyStore, seeded: &Seeded) {
    let seen = store
        .inspect(seeded.in_doubt)
        .await
        .expect("inspect")
        .expect("a record");
    let receipt = Outcome::Response(StoredResponse::new(
        StatusCode::ACCEPTED,
        http::Version::HTTP_11,
        http::HeaderMap::new(),
        bytes::Bytes::from_static(b"{\"id\":\"ch_1\"}"),
    ));
    assert_eq!(
        store
            .resolve(seeded.in_doubt, Expected::of(&seen), receipt, RETENTION)
            .await
            .expect("resolve"),
        Resolve::Resolved
    );
    let scoped = || ListQuery::new().scope(&seeded.scope);
    assert!(
        keys_of(store, scoped().kind(RecordKind::InDoubt))
            .await
            .is_empty(),
        "listing: a resolved record is still listed in doubt"
    );
    assert_eq!(
        keys_of(store, scoped().kind(RecordKind::Completed)).await,
        [seeded.in_doubt, seeded.completed],
        "listing: a resolved record is listed completed, at its claim's place"
    );
    assert_eq!(
        keys_of(
            store,
            scoped().completed_with(StatusCode::ACCEPTED, StatusCode::ACCEPTED)
        )
        .await,
        [seeded.in_doubt],
        "listing: a resolved record is listed with its receipt's status"
    );
}
