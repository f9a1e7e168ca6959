//! Exactly-once side effects for retried HTTP calls, as tower middleware.
//!
//! Two failures charge customers twice, and this crate exists to stop both:
//!
//! 1. **Timeout + retry.** The provider charged the card; the answer was lost; the caller
//!    timed out and retried; the card was charged again. The cure: a deterministic key
//!    owned by the orchestrator — derived from its `(task_id, step_id)`, never from the
//!    payload or the model — and a ledger consulted *before* the side effect fires, which
//!    replays the recorded outcome on a repeat.
//! 2. **The retry regenerated the request.** The "retry" re-ran the agent, which reworded
//!    a `summary` and minted a fresh `fulfillment_intent_id` under the same key; no
//!    server-side deduplication can catch that. The cure: freeze the exact request bytes
//!    once, before the first network call, and make every retry resend those bytes.
//!
//! # The stack
//!
//! ```text
//! ServiceBuilder::new()
//!     .layer(IdempotencyLayer::client(store, ProviderKeys::Deduplicates, KeyHeader::ietf()))   // once per logical operation
//!     .layer(FrozenRetryLayer::new(policy))     // freezes bytes, resends them on retry
//!     .service(hyper_util_client)               // or reqwest through an adapter
//! ```
//!
//! The order matters: idempotency outside, retry inside, so the ledger is consulted once
//! per logical operation and every retry inside reuses its key and its frozen bytes. The
//! body is buffered and hashed once even with both layers stacked.
//!
//! ```
//! use bytes::Bytes;
//! use http::Request;
//! use http_body_util::Full;
//! use tower::{ServiceBuilder, ServiceExt};
//! use tower_idempotency::KeyHeader;
//! use tower_idempotency::testing::{Fault, SideEffectService};
//! use tower_idempotency::{
//!     ledger::MemoryStore, retry::RetryPolicy, FrozenRetryLayer, IdempotencyLayer, OperationId,
//! };
//! # use std::time::Duration;
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), tower::BoxError> {
//! // A payments provider that charges, then never answers the first time.
//! let provider = SideEffectService::new().with_faults([Fault::CommitThenTimeout]);
//!
//! // The retry policy goes to both layers: the outer one sizes its lease by it.
//! let policy = RetryPolicy::builder().attempt_timeout(Duration::from_secs(2)).build()?;
//! let client = ServiceBuilder::new()
//!     .layer(IdempotencyLayer::client_builder(MemoryStore::new()).provider_deduplicates(true).key_header(KeyHeader::ietf()).retry_policy(policy.clone()).build()?)
//!     .layer(FrozenRetryLayer::new(policy))
//!     .service(provider.clone());
//!
//! let mut charge = Request::post("http://payments.local/charges")
//!     .body(Full::new(Bytes::from(r#"{"order_id":"order_42","amount_cents":1999}"#)))
//!     .unwrap();
//! charge.extensions_mut().insert(OperationId::new("task-7", "charge_customer"));
//!
//! let response = client.oneshot(charge).await?;
//! assert_eq!(response.status(), 201); // the first charge's answer, on the retry
//! assert_eq!(provider.effects(), 1);  // charged once
//! # Ok(())
//! # }
//! ```
//!
//! # How it works
//!
//! A ledger record per operation moves through four states (see [`ledger`] for the rules
//! every store keeps):
//!
//! ```text
//!            begin                    response recorded
//!  absent ──────────▶ in flight ─────────────────────────▶ completed ──▶ replayed
//!    ▲                 │    │                                   to every later caller
//!    │  failure proven │    │ failure after the bytes may have left,
//!    └─ before writing ┘    │ a "try again" answer, or the lease expired
//!                           ▼
//!                       in doubt ──begin──▶ in flight again, resending the FROZEN bytes
//! ```
//!
//! A different payload under a known operation is *drift*: refused (naming the changed
//! JSON fields) or answered with the original bytes, per [`DriftPolicy`].
//!
//! # Layout
//!
//! - [`key`]: [`OperationId`], [`IdempotencyKey`] and its published derivation, the
//!   `Idempotency-Key` header parser.
//! - [`fingerprint`], [`frozen`]: what a request says, and its bytes captured once.
//! - [`ledger`]: the [`IdempotencyStore`](ledger::IdempotencyStore) protocol,
//!   [`MemoryStore`](ledger::MemoryStore) (in process, byte-budgeted), with feature `redis`
//!   `RedisStore` (one node or a cluster) and with feature `postgres` `PostgresStore` (and
//!   its transactional server mode), each store's runbook in its module's docs.
//! - [`idempotency`]: [`IdempotencyLayer`], one ledger engine under every face.
//! - [`client`]: the client face, for callers of side-effecting APIs.
//! - [`server`]: the server face, IETF `Idempotency-Key` semantics in front of handlers
//!   ([`server::Builder`], RFC 9457 [`problem`](server::problem)s).
//! - [`tool`]: the tool face, for any tool call that is not HTTP (an SDK call, a database
//!   write, a sub-agent): `ToolLayer` and `idempotent_call`.
//! - [`retry`]: [`FrozenRetryLayer`], its policy, backoff and budget.
//! - [`phase`]: whether a failed call may have reached the server.
//! - `grpc` (feature `tonic`): gRPC unary calls over tonic, retried with their frozen
//!   message, and the server face in front of tonic services.
//! - `console` (feature `console`): the operator's console, an axum `Router` (JSON API and
//!   HTML pages) that lists, inspects and resolves records, behind an authorizer.
//! - `testing` (feature `test-util`): a fault-injecting provider double and the store
//!   conformance suite.
//!
//! # Features
//!
//! | feature | default | what |
//! |---|---|---|
//! | `hyper-util` | yes | classify `hyper_util` client errors (connect failures are pre-write) |
//! | `redis` | no | `RedisStore`, the shared ledger for many replicas and crash-and-resume |
//! | `redis-cluster` | no | `RedisStore::cluster_builder`: the same ledger over a Redis Cluster (implies `redis`) |
//! | `postgres` | no | `PostgresStore`, the durable ledger, and `IdempotencyLayer::transactional_server_builder` (a handler's rows and its recorded outcome in one transaction) |
//! | `reqwest` | no | [`reqwest::ReqwestService`](crate::reqwest): the layers in front of a `reqwest::Client`, its errors classified by phase |
//! | `reqwest-middleware` | no | [`reqwest_middleware::IdempotencyMiddleware`](crate::reqwest_middleware): the client face as a `reqwest_middleware::Middleware` |
//! | `axum` | yes | the server face reads axum's `OriginalUri`, so a layer inside `Router::nest` judges the whole path: without it, two accounts' `/accounts/{id}/charges` read as one request (`default-features = false, features = ["hyper-util"]` leaves it out) |
//! | `metrics` | no | `idempotency_decisions_total` (labels `face`, `decision`), `idempotency_ledger_call_seconds` (labels `call`, `result`) and `MemoryStore`'s gauges `idempotency_store_bytes` / `idempotency_store_records` (label `store`) through the `metrics` facade |
//! | `console` | no | `console::Console`: an axum `Router` to nest in your own, where operators list records, inspect one and resolve it (forget, resolve as not applied), fenced by what they saw, behind your authorizer, audited (implies `axum`) |
//! | `tonic` | no | `grpc`: retries for tonic channels that resend a unary call's frozen message (gRFC A6), and the server face in front of tonic services (unary calls keyed, recorded with their trailers, replayed) |
//! | `test-util` | no | `SideEffectService`, `ToolDouble` and the conformance suite |
#![forbid(unsafe_code)]
#![warn(
    missing_docs,
    missing_debug_implementations,
    rust_2018_idioms,
    unreachable_pub
)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod client;
mod config;
#[cfg(feature = "console")]
#[cfg_attr(docsrs, doc(cfg(feature = "console")))]
pub mod console;
pub mod digest;
mod effect;
mod error;
pub mod fingerprint;
pub mod frozen;
#[cfg(feature = "tonic")]
#[cfg_attr(docsrs, doc(cfg(feature = "tonic")))]
pub mod grpc;
pub mod idempotency;
pub mod key;
pub mod ledger;
#[cfg(feature = "mcp")]
#[cfg_attr(docsrs, doc(cfg(feature = "mcp")))]
pub mod mcp;
pub mod phase;
mod provider;
#[cfg(feature = "reqwest")]
#[cfg_attr(docsrs, doc(cfg(feature = "reqwest")))]
pub mod reqwest;
#[cfg(feature = "reqwest-middleware")]
#[cfg_attr(docsrs, doc(cfg(feature = "reqwest-middleware")))]
pub mod reqwest_middleware;
pub mod retry;
pub mod server;
mod swar;
pub mod tool;

pub use client::policy::{DriftPolicy, PayloadDiscarded};
pub use config::ConfigError;
pub use effect::EffectClass;
pub use error::{Drift, Error};
pub use frozen::request::FrozenRequest;
pub use idempotency::engine::BusyPolicy;
pub use idempotency::layer::IdempotencyLayer;
pub use idempotency::source::ResponseSource;
pub use key::derived::IdempotencyKey;
pub use key::header::{HeaderKey, InvalidKey};
pub use key::operation::OperationId;
pub use key::KeyHeader;
pub use provider::ProviderKeys;
pub use retry::layer::FrozenRetryLayer;
pub use server::policy::{InDoubtPolicy, ServerErrorPolicy};

/// A type-erased error, as tower uses.
pub type BoxError = tower::BoxError;

#[cfg(feature = "test-util")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub mod testing;

/// The README's Rust examples, compiled as doctests so the front door never drifts from
/// the API.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
