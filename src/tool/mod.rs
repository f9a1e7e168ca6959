//! The tool face: once per operation for **any** tool call, not only HTTP.
//!
//! An agent's side effects are tool calls: a vendor SDK (`charges.create(..)`), an email
//! API, a database write, an in-process sub-agent. [`ToolLayer`] protects any
//! `tower::Service<ToolCall<A>>` on the same ledger, the same stores and the same protocol
//! as the HTTP client face:
//!
//! - the key is derived from `(scope, task_id, step_id)` of the orchestrator's
//!   [`OperationId`](crate::OperationId); the ledger is consulted before the call, the
//!   outcome recorded and replayed; a busy operation is waited for, a live owner keeps its
//!   lease (held by the default store, renewed on the others), records are protected from
//!   eviction for the retry window, and an unavailable ledger fails closed (the tool is not
//!   called);
//! - the arguments are **frozen** at first sight of the operation (canonical JSON, stored
//!   with the claim) and every attempt, every resume after a crash, calls the tool with the
//!   thawed frozen arguments, never regenerated ones; a new operation's frozen arguments
//!   are read back and frozen again before its first call, and arguments that do not
//!   read back as themselves are refused with nothing called ([`NotReadBack`]);
//! - a regenerated call (the model rewrote its `summary`) goes on with the frozen arguments
//!   by default, and its output says what was discarded ([`ToolOutput::discarded`]);
//!   [`DriftPolicy::Reject`](crate::DriftPolicy::Reject) refuses it instead;
//!   [`defining_fields`](Builder::defining_fields) names the fields that say what the
//!   operation is (the order, the amount, the recipient), never discarded: a change there
//!   is refused under every policy, a change elsewhere goes on and is named; a record of
//!   another tool under the same `OperationId` is refused, never answered nor resent;
//! - the key reaches the tool ([`ToolCall::key`]) for a provider that deduplicates on it;
//!   whether it does is a choice the builder requires ([`ProviderKeys`]);
//! - a tool error is classified by phase ([`Verdict`]): before the effect (released, unless
//!   an earlier attempt of the call may have happened), may have happened (in doubt:
//!   resumed with the frozen arguments, or reconciled), or a final answer (recorded and
//!   replayed, as "card declined"); the tool's readiness is awaited before an attempt
//!   counts as sent;
//! - a response over the [cap](Builder::response_limit) is returned and kept as a
//!   tombstone, which a replay cannot answer;
//! - [`idempotent_call`] is the same for code that is not a tower service.
//!
//! # Why these types
//!
//! The request is [`ToolCall<A>`]: the operation, the arguments and (from the layer) the
//! key, so one value carries everything the ledger and the tool need, and the inner
//! service's request type is the layer's — the layer slots into any stack of tool
//! services. Arguments and response are any `serde` type; they are frozen and recorded as
//! JSON because JSON is what models emit and tools take, it is self-describing (changed
//! fields can be named, fields picked by JSON pointer), and `serde_json` is already a
//! dependency of the crate. The form is **canonical** (object keys sorted, no whitespace),
//! so equal arguments are equal bytes. A sequence keeps its order, though, and a
//! `HashSet` is a sequence to serde: it freezes in its iteration order, which two sets of
//! the same elements need not share (equal sets, two fingerprints: a drift) and which the
//! set read back for a retry need not keep (a new operation's first call is then
//! refused, [`NotReadBack`]). Use a `BTreeSet` (or a sorted `Vec`) for set-valued arguments; a
//! `HashMap` is safe, a map's keys being sorted. In the ledger, a frozen call is a
//! [`FrozenRequest`](crate::FrozenRequest) `POST /tools/{name}` whose body is those bytes,
//! and an outcome a stored response (`200` with the JSON response, `422` with a final
//! answer): the stores need nothing new, and every store the client face runs on runs
//! this face.
//!
//! # Example
//!
//! ```
//! use serde::{Deserialize, Serialize};
//! use tower::{service_fn, Layer, ServiceExt};
//! use tower_idempotency::fingerprint::PayloadFields;
//! use tower_idempotency::ledger::MemoryStore;
//! use tower_idempotency::tool::{ProviderKeys, ToolCall, ToolLayer};
//! use tower_idempotency::OperationId;
//!
//! #[derive(Serialize, Deserialize)]
//! struct Charge { order_id: String, cents: u64, summary: String }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let layer = ToolLayer::builder(MemoryStore::new(), "charge_customer", ProviderKeys::Ignored)
//!     .scope("billing-agent")
//!     // What the operation is: never discarded, a change there is refused.
//!     .defining_fields(PayloadFields::new(["/order_id", "/cents"]).unwrap())
//!     .build()
//!     .unwrap();
//! // A key-less SDK call: it must run once per operation.
//! let charge = layer.layer(service_fn(|call: ToolCall<Charge>| async move {
//!     Ok::<_, std::io::Error>(format!("ch_for_{}", call.arguments().order_id))
//! }));
//!
//! let op = OperationId::new("task-7", "charge");
//! let first = Charge { order_id: "o-42".into(), cents: 1999, summary: "charge o-42".into() };
//! let receipt = charge.clone().oneshot(ToolCall::new(op.clone(), first)).await.unwrap();
//! assert_eq!(receipt.value(), "ch_for_o-42");
//!
//! // The model regenerated the call on a retry: the first outcome is replayed, and the
//! // caller learns which fields were discarded.
//! let regenerated = Charge { order_id: "o-42".into(), cents: 1999, summary: "bill the customer".into() };
//! let again = charge.clone().oneshot(ToolCall::new(op.clone(), regenerated)).await.unwrap();
//! assert_eq!(again.value(), "ch_for_o-42");
//! assert_eq!(again.discarded().unwrap().changed_fields(), Some(&["summary".to_owned()][..]));
//!
//! // The step's identity reused for another order: refused, never the first receipt.
//! let other = Charge { order_id: "o-43".into(), cents: 1999, summary: "charge o-43".into() };
//! let refused = charge.oneshot(ToolCall::new(op, other)).await.unwrap_err();
//! assert!(refused.idempotency_error().unwrap().is_drift());
//! # }
//! ```

mod builder;
mod face;
mod function;
mod layer;
mod operation;
mod read_back;
mod service;
mod types;

/// The tool face names it here too, beside [`ToolLayer::builder`] which requires it.
pub use crate::provider::ProviderKeys;
pub use builder::Builder;
pub use function::idempotent_call;
pub use layer::ToolLayer;
pub use read_back::NotReadBack;
pub use service::{ToolFuture, ToolService};
pub use types::{
    applied, frozen_arguments, ClassifyToolError, Discarded, FinalAnswer, MayHaveHappened,
    ToolCall, ToolClass, ToolError, ToolOutput, ToolSource, Verdict,
};
