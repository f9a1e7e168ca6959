//! `MemoryStore` against the store conformance suite.
#![cfg(feature = "test-util")]

use std::sync::Arc;

use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::testing::conformance::{
    inspection_follows_the_record, listing_finds_what_it_asks_for, run_all, Clock,
};

#[tokio::test(start_paused = true)]
async fn memory_store_passes_the_conformance_suite() {
    run_all(Arc::new(MemoryStore::new()), Clock::tokio_paused()).await;
    inspection_follows_the_record(&MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_passes_the_conformance_suite_on_real_time_and_threads() {
    run_all(Arc::new(MemoryStore::new()), Clock::real()).await;
}

/// A `begin` whose answer was lost, released while another caller held the key, lands late
/// once that caller's record has left: it must be refused, never claim (every store runs
/// the same case in `run_all`).
#[tokio::test(start_paused = true)]
async fn memory_store_refuses_a_late_begin_released_while_another_caller_held_the_key() {
    tower_idempotency::testing::conformance::a_release_outlasts_another_callers_record(
        &MemoryStore::new(),
    )
    .await;
}

#[tokio::test(start_paused = true)]
async fn memory_store_lists_its_records() {
    let clock = Clock::tokio_paused();
    listing_finds_what_it_asks_for(&MemoryStore::new(), &clock).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_lists_its_records_on_real_time_and_threads() {
    let clock = Clock::real();
    listing_finds_what_it_asks_for(&MemoryStore::new(), &clock).await;
}

#[tokio::test(start_paused = true)]
async fn memory_store_shows_the_frozen_request_it_keeps() {
    assert!(
        tower_idempotency::testing::conformance::inspection_shows_the_frozen_request(
            &MemoryStore::new()
        )
        .await,
        "the memory store shows a record's frozen request in doubt"
    );
}
