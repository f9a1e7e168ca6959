//! The in-process ledger: every record in a sharded map, under one byte budget.
//!
//! [`MemoryStore`]'s docs say what it promises (and how to size it); this says how the
//! code keeps those promises under concurrency, file by file:
//!
//! | file | role |
//! |---|---|
//! | `store.rs` | the [`MemoryStore`] handle, what it tells of itself, and the ledger protocol on top of the pieces below |
//! | `builder.rs` | [`MemoryStoreBuilder`]: the budget and the scopes' share of it |
//! | `shared.rs` | what every clone shares (`Inner`), its shards, its locks |
//! | `claim.rs` | `begin`: a new claim, or what the record says |
//! | `settle.rs` | writes under an owner's token: `complete`, and the fencing every settle shares |
//! | `budget.rs` | bytes in and out of the budget, and eviction to make room |
//! | `pressure.rs` | protected bytes, warnings, refusals, each scope's share |
//! | `record.rs` | a record, its states and its weight |
//! | `listing.rs` | `list`: a page of records, each shard read in chunks under its lock |
//! | `released.rs` | tokens released on keys (a release outlasts a late claim) |
//! | `eviction.rs` | the eviction order of completed records |
//! | `sync.rs` | the locks and atomics, swapped for loom's by the model check (`model_check.rs`) |
//!
//! # The locks, and what each protects
//!
//! - **A shard's mutex** (`Inner::shards`, 64 of them, a key's shard chosen by its first
//!   byte) protects the shard's records *and* its released tokens. Every transition of a
//!   key runs under it from its first read to its last write: a `begin` reads the record
//!   (or its absence, and the released tokens) and claims in one step, so two callers never
//!   both acquire a key and a late `begin` never slips past the release of its token; a
//!   settle checks the owner's token and writes under the same lock, so a write fenced a
//!   moment ago can never land. Nothing is awaited under it.
//! - **The eviction order's mutex** (`Inner::evictable`) protects the order of completed
//!   records. A record and its entry change together under the record's shard lock, which
//!   may take the eviction lock inside it; eviction looks at the order's front under the
//!   eviction lock alone, releases it, then takes the front record's shard lock and checks
//!   that the entry still names that life of the key (its generation). So locks are only ever
//!   taken shard first, then eviction order: no two callers can wait on each other.
//!
//! # The atomics, and why relaxed ordering is enough
//!
//! - **`used`, the budget**, is reserved before a record enters its shard (a
//!   compare-and-swap that never lets it pass `max_bytes`), and given back after a record
//!   leaves. Two claims racing for the last room cannot both take it; the count never has
//!   to agree with a map at one instant, only never to exceed the budget, which each
//!   reservation checks by itself. The per-scope counts and `completed_bytes` follow the
//!   same reservations.
//! - **`scope_bytes`**, each scope's bytes, follow the same reservations; a claim or a
//!   completion judged against its scope's share reads them, and the protected bytes, at
//!   that moment (under the record's shard lock, then the eviction order's). Two of one
//!   scope racing may both pass by the weight of the other: a share is held to within the
//!   records in flight at one instant, not to the byte.
//! - **`next_pressure_check`, `warned_*`, `last_claim`, `last_window_us`,
//!   `open_expiry_floor`** are hints: a stale read delays a warning or a sweep by one
//!   look, and never changes what a record says. `next_pressure_check` is
//!   advanced by a compare-and-swap, so one caller per second does the look.
//! - **The settle notifications** (`Inner::settled`, a watch channel per shard) are sent
//!   after the shard lock is released. A waiter subscribes *before* its `begin` takes that
//!   lock, so the lock orders its subscription before the settle's check for listeners,
//!   and no wake-up is lost; a settle of a neighbour in the same shard wakes a waiter for
//!   nothing, and it asks `begin` again.
//!
//! The model check (`model_check.rs`, run under loom) runs two or three tasks on one or
//! two keys through every interleaving of these locks and atomics and checks the answers
//! against the reference model: one owner, fencing, no lost wake-up, the budget held.

mod budget;
mod builder;
mod claim;
mod eviction;
#[cfg(all(test, not(tower_idempotency_loom)))]
mod list_tests;
mod listing;
#[cfg(all(test, tower_idempotency_loom))]
mod model_check;
mod pressure;
mod record;
mod released;
mod settle;
mod shared;
mod store;
mod sync;
// Plain tokio: the loom build's locks only run inside its model.
#[cfg(all(test, not(tower_idempotency_loom)))]
mod tests;

pub use self::builder::MemoryStoreBuilder;
pub use self::store::MemoryStore;
