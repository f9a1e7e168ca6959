//! The testing kit (feature `test-util`): prove "one effect per operation" in your own tests.
//!
//! - [`conformance`]: the ledger protocol checked against any [`IdempotencyStore`](crate::ledger::IdempotencyStore).
//! - [`model`]: a reference model of the ledger protocol, and a checker that runs any op
//!   sequence against a store and the model side by side (for property tests).
//! - [`SideEffectService`], a provider double that counts effects per key and
//!   injects faults (commit then time out, refuse, 5xx, panic, latency), in-process or over HTTP.
//! - [`FaultLayer`], faults around your **own** handlers (panic, delay, fail or
//!   hang after the work), and [`crash_after`], a hard crash at a chosen point of an operation.
//! - [`ToolDouble`], an SDK-like tool double for the [tool face](crate::tool) that
//!   counts effects per operation and injects the same faults (commit then time out, fail
//!   before, panic, hang).

pub mod conformance;
pub(crate) mod crash;
mod effects;
mod faults;
pub mod model;
mod tool;

pub use effects::{
    CapturedRequest, Fault, ResponseFuture, ServeHandle, SideEffectService,
    SideEffectServiceBuilder, LOOKUP_PATH,
};
pub use faults::{crash_after, FaultLayer, FaultService, HandlerFault};
pub use tool::{ToolDouble, ToolDoubleError, ToolFault};
