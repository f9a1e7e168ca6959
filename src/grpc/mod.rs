//! gRPC unary calls, once: retries that resend the frozen message, and the server face in
//! front of tonic services.
//!
//! tonic is built on tower, yet `tower::retry` cannot retry its calls: a request's body is a
//! stream, and a stream cannot be cloned. [`RetryLayer`] freezes a unary call's encoded
//! message once (the 5-byte gRPC prefix and the message, under the policy's body limit) and
//! sends every attempt with exactly those bytes; only the metadata may change between
//! attempts.
//!
//! # Which calls, and when (gRFC A6)
//!
//! - **Which calls**: the methods a [`Methods`] table names as unary or server-streaming
//!   (listed by hand, or read from the service's descriptor set with
//!   [`Methods::from_descriptor_set`], streaming flags and `idempotency_level` included).
//!   On the wire a unary call looks like a streaming one, so a method the table does not
//!   name is passed through untouched, sent once.
//! - **Committed once the answer's headers arrive**: an answer whose headers do not carry
//!   its status (a normal answer, whose status comes in its trailers) is returned as it is,
//!   whatever its trailers say later. Only a *trailers-only* answer (its `grpc-status` in
//!   its headers) or an HTTP error from a proxy (mapped by gRPC's HTTP-to-gRPC table: a
//!   `503` is `UNAVAILABLE`) can be retried, when its code is retryable (`UNAVAILABLE`
//!   unless [`RetryLayer::retryable_codes`] says otherwise).
//! - **Only what cannot charge twice**: a failure proven to happen before anything was
//!   written (tonic's `ConnectError`, a refused connection) is always retried. A call that
//!   may have reached the server (a retryable status, a reset, a timed-out attempt, which is
//!   read as `UNAVAILABLE`) is resent only when resending is harmless: the method is
//!   `NO_SIDE_EFFECTS` or `IDEMPOTENT` in the table, or the call carries an idempotency key
//!   in its metadata (under the policy's [key header](crate::retry::RetryPolicyBuilder::key_header),
//!   `idempotency-key` by default) for a server that deduplicates.
//! - **`grpc-retry-pushback-ms`**: a server's pushback replaces the backoff (full jitter
//!   otherwise); a negative or malformed one ends the retries.
//! - **`grpc-previous-rpc-attempts`** is sent on every retry; **`grpc-timeout`**, when the
//!   caller set one, is the caller's deadline: each attempt is sent with what is left of it,
//!   and no retry starts after it.
//! - **Throttling**: the policy's retry budget (a fifth of recent calls plus a floor) is
//!   asked before every retry, so a failing service is not sent three times its load.
//! - Attempts, backoff, the overall deadline (`max_elapsed`) and the per-attempt timeout are
//!   the policy's, as on the HTTP face. The answer of a call that took more than one attempt
//!   carries an [`Attempts`](crate::retry::Attempts) extension.
//!
//! # Example
//!
//! Between a tonic channel and the client generated for it:
//!
//! ```
//! use tonic::transport::Channel;
//! use tower::ServiceBuilder;
//! use tower_idempotency::grpc::{Methods, RetryLayer};
//! use tower_idempotency::retry::RetryPolicy;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let methods = Methods::new()
//!     .unary("/payments.v1.Payments/Charge")
//!     .reads("/payments.v1.Payments/GetCharge");
//! let channel = Channel::from_static("http://127.0.0.1:50051").connect_lazy();
//! let channel = ServiceBuilder::new()
//!     .layer(RetryLayer::new(RetryPolicy::default(), methods))
//!     .service(channel);
//! // Any generated client takes it: `PaymentsClient::new(channel)`.
//! let client = tonic::client::Grpc::new(channel);
//! # let _ = client;
//! # }
//! ```
//!
//! # The server layer
//!
//! [`ServerLayer`] puts the [server face](crate::server) in front of a tonic service: the
//! face built as usual (`IdempotencyLayer::server_builder(store)`: its store, scope,
//! lease, retention, in-doubt policy and response allow-list), with the same ledger and the
//! same state machine, every refusal told as a gRPC status. Put it around the tonic server's
//! routes, `Server::builder().layer(layer)`.
//!
//! Its store is what makes a resent call a replay, so it must outlive the process and be
//! shared by every replica: a `MemoryStore` forgets its keys when the server restarts, and
//! a replica never sees another's, so a call resent after a restart, or to another
//! replica, runs again. Behind more than one process, or where a restart can fall between
//! a charge and its resend, use a shared, durable store (`RedisStore`, `PostgresStore`).
//!
//! - **Which calls**: the unary methods of its [`Methods`] table, but the
//!   `NO_SIDE_EFFECTS` ones ([`Methods::reads`]), which pass through as reads. **Streaming
//!   methods and reads are passed through untouched**, with no key needed and nothing
//!   recorded; but a read that arrives with a key in the key's metadata entry is guarded
//!   like a side effect (its caller takes it for one and resends it under the key, so a
//!   side effect the table calls a read runs once, not once per resend). A call to a method the table does not name is refused with `INTERNAL`
//!   (saying so): run unguarded, a unary method left out of the table would be charged
//!   again by every retry, in silence. Name every method of the services behind the layer,
//!   a health check's and reflection's too (as [`Methods::reads`] or streaming), or put the
//!   layer on the one service (`ServiceBuilder::new().layer(layer).service(PaymentsServer::new(..))`)
//!   rather than on the whole server.
//! - **The key**: from metadata `idempotency-key` (the face's syntax: a bare token or a
//!   quoted string), another metadata entry, or a `string` field of the request message
//!   (AIP-155's `request_id`, AEP-155's `idempotency_key`): see [`KeySource`]. Keys are
//!   scoped as on the HTTP face: by the `authorization` metadata unless the face was given
//!   a scope function.
//! - **The fingerprint** is the face's: the method's path and the message's bytes as they
//!   arrived. A client resending frozen bytes (as [`RetryLayer`] does) matches; a message
//!   encoded afresh matches when its encoding is the same bytes. prost writes a `map` field
//!   in its hash order, which may differ between processes: generate such messages with
//!   `BTreeMap` (`tonic_prost_build::configure().btree_map(["."])`) if a client may
//!   re-encode one under its key.
//! - **Replays** answer the recorded headers (through the face's allow-list, as on the HTTP
//!   face, plus `idempotent-replayed: true`), the data frames byte for byte and the
//!   trailers, all of them: status, message, details and the status's metadata. A
//!   trailers-only answer is replayed trailers-only.
//! - **Released, not recorded**: a handler's `UNAVAILABLE` or `RESOURCE_EXHAUSTED` with a
//!   `grpc-retry-pushback-ms` (it turned the call away before doing anything), as an HTTP
//!   handler's `503` with `Retry-After`. The face's
//!   [`ServerErrorPolicy`](crate::ServerErrorPolicy) applies to the codes gRPC makes of
//!   HTTP's `5xx`, its server errors: `INTERNAL`, `UNKNOWN`, `DATA_LOSS` and `UNAVAILABLE`
//!   (see the table below). Every other status is the key's outcome.
//! - **What changed**: with a table read from the service's descriptor set
//!   ([`Methods::from_descriptor_set`]), each top-level field of a guarded call's message is
//!   digested (8 bytes of a SHA-256; a `map` field's entries in any order are one value, a
//!   repeated field's elements in their order) and the digests are recorded with the
//!   answer. A later call under the key with another message is refused with a
//!   `FAILED_PRECONDITION` that names the fields that changed (`fields changed:
//!   amount_cents`), never their values; a nested message is named by the top-level field
//!   that holds it, a field the descriptor does not declare by its number. Nothing is named
//!   without a descriptor set, for a compressed message, or when the answer under the key
//!   was recorded without digests.
//! - **Compression**: a protected call reaches its handler without its
//!   `grpc-accept-encoding`, so no recorded answer is compressed and a replay suits any
//!   client. Requests may be compressed as usual (but not when the key is in the message).
//! - **Cancellation**: the face runs the handler on its own task, so a client that hangs up
//!   (or tonic's `grpc-timeout`, which wraps outside the layer) does not drop a call whose
//!   effect already ran: its answer is still recorded.
//!
//! | the call | status |
//! |---|---|
//! | to a method the table does not name | `INTERNAL` |
//!
//! | the handler's status | [`ServerErrorPolicy::Record`](crate::ServerErrorPolicy::Record) (default) | [`ServerErrorPolicy::Release`](crate::ServerErrorPolicy::Release) |
//! |---|---|---|
//! | `UNAVAILABLE` or `RESOURCE_EXHAUSTED` with `grpc-retry-pushback-ms` | released | released |
//! | `INTERNAL`, `UNKNOWN`, `DATA_LOSS`, `UNAVAILABLE` | recorded, replayed | released: the retry runs the handler again |
//! | any other, `OK` included | recorded, replayed | recorded, replayed |
//!
//! | the face says | status |
//! |---|---|
//! | key missing or malformed, message unreadable | `INVALID_ARGUMENT` |
//! | keyed, but no principal to scope the key by | `UNAUTHENTICATED` |
//! | message over the body limit | `RESOURCE_EXHAUSTED` |
//! | the key's first call is in flight | `ABORTED`, with `grpc-retry-pushback-ms` |
//! | another message (or method) under the key | `FAILED_PRECONDITION`, saying so (naming the changed fields, see above) |
//! | the key's answer was too large to record | `ALREADY_EXISTS` |
//! | the key's first call started and never finished (in doubt) | `UNKNOWN` |
//! | ledger unavailable or full | `UNAVAILABLE`, with `grpc-retry-pushback-ms`; nothing ran |
//! | completed | the recorded answer, `idempotent-replayed: true` |
//!
//! ```
//! use std::convert::Infallible;
//! use tower::{service_fn, Layer, ServiceExt};
//! use tower_idempotency::grpc::{KeySource, Methods, ServerLayer};
//! use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() {
//! let methods = Methods::new()
//!     .unary("/payments.v1.Payments/Charge")
//!     .reads("/payments.v1.Payments/GetCharge");
//! let layer = ServerLayer::new(IdempotencyLayer::server(MemoryStore::new()), methods)
//!     .key_source(KeySource::field(1)); // AIP-155: `string request_id = 1;`
//! // tonic::transport::Server::builder().layer(layer).add_service(PaymentsServer::new(payments))
//!
//! // A tonic service stands in for the generated server here.
//! let payments = service_fn(|_req: http::Request<tonic::body::Body>| async {
//!     Ok::<_, Infallible>(http::Response::new(tonic::body::Body::default()))
//! });
//! // A charge whose message has no request id: refused, the handler never runs.
//! let keyless = http::Request::post("http://payments.local/payments.v1.Payments/Charge")
//!     .header("content-type", "application/grpc")
//!     .body(tonic::body::Body::new(http_body_util::Full::new(
//!         bytes::Bytes::from_static(&[0, 0, 0, 0, 0]),
//!     )))
//!     .unwrap();
//! let response = layer.layer(payments).oneshot(keyless).await.unwrap();
//! assert_eq!(response.headers()["grpc-status"], "3"); // INVALID_ARGUMENT
//! # }
//! ```
//!
//! # The client layer
//!
//! [`ClientLayer`] puts the [client face](crate::client) in front of a channel, outside a
//! [`RetryLayer`]: a unary call with side effects runs once per
//! [`OperationId`](crate::OperationId) (in the request's extensions:
//! `request.extensions_mut().insert(..)`), with its key derived from it and sent in
//! metadata under the face's [key header](crate::client::Builder::key_header) (the
//! server layer reads `idempotency-key`: `KeyHeader::ietf()`). The face is built as on HTTP,
//! with the required [`provider_deduplicates`](crate::client::Builder::provider_deduplicates)
//! choice, and given the [`RetryLayer`]'s policy
//! ([`retry_policy`](crate::client::Builder::retry_policy)) so that its lease outlasts the
//! retries; reads and streaming methods pass through, and so does an `IDEMPOTENT` method's
//! call without an `OperationId` (retried freely). An `IDEMPOTENT` call that carries one
//! is kept once per operation like a side effect: a re-run step is answered from the
//! ledger, and the provider (whose [`ServerLayer`] guards such methods) gets its key. A call to a method the table does
//! not name is refused before it is sent ([`Error::is_method_not_listed`](crate::Error::is_method_not_listed)):
//! a unary side effect the table forgot would otherwise go out with no key and no ledger.
//!
//! Its answer (headers, data and trailers, whatever its status) is recorded, and the next
//! run of the operation gets it back without a call; a call that may have left and failed
//! leaves the operation in doubt, and the next run resends the **frozen** message under the
//! same key. A gRPC answer is HTTP `200` with its status in its trailers; the face judges
//! it by its code:
//!
//! | code | the operation |
//! |---|---|
//! | `RESOURCE_EXHAUSTED`, `UNAUTHENTICATED` | released: nothing ran, the next run sends it |
//! | `ABORTED` (a key in use, with its pushback) | in doubt: the next run resends under the key |
//! | `UNAVAILABLE`, `UNKNOWN`, `INTERNAL`, `DEADLINE_EXCEEDED`, `CANCELLED`, `DATA_LOSS` | in doubt: the next run resends under the key |
//! | every other code, `OK` included | completed: the answer is recorded and replayed |
//! | no answer: a failure before anything was written | released |
//! | no answer: a failure after the call may have left | in doubt |
//!
//! `UNAVAILABLE` is held in doubt rather than taken as "never sent": a server may answer it
//! after its effect ran, and resending under the key is always safe where the provider
//! deduplicates, while releasing would send a second call without that protection.
//!
//! ```
//! use tonic::transport::Channel;
//! use tower::ServiceBuilder;
//! use tower_idempotency::grpc::{ClientLayer, Methods, RetryLayer};
//! use tower_idempotency::retry::RetryPolicy;
//! use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer, KeyHeader, OperationId};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tower_idempotency::ConfigError> {
//! let methods = Methods::new()
//!     .unary("/payments.v1.Payments/Charge")
//!     .reads("/payments.v1.Payments/GetCharge");
//! // The retry policy goes to both layers: the face sizes its lease by it.
//! let policy = RetryPolicy::default();
//! let face = IdempotencyLayer::client_builder(MemoryStore::new())
//!     .provider_deduplicates(true) // the server runs the gRPC ServerLayer
//!     .key_header(KeyHeader::ietf())
//!     .retry_policy(policy.clone())
//!     .build()?;
//! let channel = Channel::from_static("http://127.0.0.1:50051").connect_lazy();
//! let channel = ServiceBuilder::new()
//!     .layer(ClientLayer::new(face, methods.clone())) // once per operation
//!     .layer(RetryLayer::new(policy, methods)) // resends the frozen bytes
//!     .service(channel);
//! let client = tonic::client::Grpc::new(channel); // or `PaymentsClient::new(channel)`
//!
//! let mut charge = tonic::Request::new(());
//! charge.extensions_mut().insert(OperationId::new("task-7", "charge_customer"));
//! # let _ = (client, charge);
//! # Ok(())
//! # }
//! ```

mod client;
mod descriptor;
mod fields;
mod key;
mod methods;
mod protowire;
mod recorded;
mod retry;
mod server;
mod wire;

pub use client::{ClientFuture, ClientLayer, IdempotentClient};
pub use descriptor::InvalidDescriptorSet;
pub use key::KeySource;
pub use methods::{Method, MethodEffect, MethodKind, Methods};
pub use retry::{ResponseFuture, Retry, RetryLayer};
pub use server::{IdempotentService, ServerFuture, ServerLayer};
