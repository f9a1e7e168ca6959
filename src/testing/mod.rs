//! The testing kit (feature `test-util`): prove "one effect per operation" in your own tests.
//!
//! - [`conformance`]: the ledger protocol checked against any [`IdempotencyStore`](crate::ledger::IdempotencyStore).

pub mod conformance;
