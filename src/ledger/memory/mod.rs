//! The in-process ledger: every record in a sharded map, under one byte budget.

mod budget;
mod builder;
mod claim;
mod eviction;
#[cfg(all(test, tower_idempotency_loom))]
mod model_check;
mod pressure;
mod record;
mod released;
mod settle;
mod shared;
mod store;
mod sync;

pub use self::builder::MemoryStoreBuilder;
pub use self::store::MemoryStore;
