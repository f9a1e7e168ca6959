//! The testing kit (feature `test-util`): prove "one effect per operation" in your own tests.
//!
//! - [`conformance`]: the ledger protocol checked against any [`IdempotencyStore`](crate::ledger::IdempotencyStore).
//! - [`effects`]: [`SideEffectService`], a provider double that counts effects per key and
//!   injects faults (commit then time out, refuse, 5xx, panic, latency), in-process or over HTTP.

pub mod conformance;
pub mod effects;

pub use effects::{
    CapturedRequest, Fault, ServeHandle, SideEffectService, SideEffectServiceBuilder,
};
