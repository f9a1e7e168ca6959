//! The method table: which calls are unary, and which only read.
//!
//! On the wire a unary call and a server-streaming one look alike (one request message, then
//! a response), and the server sees no `GrpcMethod` extension at all: only the request's path
//! names the method. The layers therefore act on the methods a table names, by path, and pass
//! every other call through untouched.

use std::collections::HashMap;
use std::sync::Arc;

use super::fields::MessageFields;

/// How a method's messages travel, as its `.proto` declares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MethodKind {
    /// One request message, one response message: what the layers protect.
    Unary,
    /// One request message, a stream of responses: retried before its response headers
    /// arrive, otherwise passed through.
    ServerStreaming,
    /// A stream of request messages: passed through untouched.
    ClientStreaming,
    /// Streams both ways: passed through untouched.
    Bidirectional,
}

/// What calling a method does, as its `idempotency_level` option declares it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MethodEffect {
    /// `NO_SIDE_EFFECTS`: a read. Retried freely; the server layer needs no key for it.
    NoSideEffects,
    /// `IDEMPOTENT`: calling it twice does what calling it once does. Retried freely; the
    /// server layer still records it under a key.
    Idempotent,
    /// `IDEMPOTENCY_UNKNOWN` (the default): a side effect, resent only under a key.
    SideEffect,
}

/// One method of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Method {
    /// How its messages travel.
    pub kind: MethodKind,
    /// What calling it does.
    pub effect: MethodEffect,
}

impl Method {
    /// Whether resending it cannot make a second effect.
    pub fn is_retry_safe(self) -> bool {
        !matches!(self.effect, MethodEffect::SideEffect)
    }

    /// Whether its single request message can be frozen (unary or server-streaming).
    pub fn has_one_request(self) -> bool {
        matches!(self.kind, MethodKind::Unary | MethodKind::ServerStreaming)
    }
}

/// The methods the gRPC layers know, by full path (`/package.Service/Method`).
///
/// A call to a method the table does not name is passed through untouched: the layers never
/// guess whether a request body is one message or an endless stream.
///
/// ```
/// use tower_idempotency::grpc::{Methods, MethodEffect, MethodKind};
///
/// let methods = Methods::new()
///     .unary("/payments.v1.Payments/Charge")
///     .reads("/payments.v1.Payments/GetCharge")
///     .server_streaming("/payments.v1.Payments/ListCharges");
/// let charge = methods.get("/payments.v1.Payments/Charge").unwrap();
/// assert_eq!(charge.kind, MethodKind::Unary);
/// assert_eq!(charge.effect, MethodEffect::SideEffect);
/// assert!(methods.get("/payments.v1.Payments/Refund").is_none());
/// ```
#[derive(Clone, Debug, Default)]
pub struct Methods {
    by_path: Arc<HashMap<Box<str>, Method>>,
    /// The top-level fields of a unary method's input message, by name, when the table
    /// was read from a descriptor set: how the server layer names the fields a call that
    /// reuses a key changed.
    inputs: Arc<HashMap<Box<str>, Arc<MessageFields>>>,
}

impl Methods {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// Add `path` as a method of `kind` with `effect` (a later entry for a path replaces an
    /// earlier one, and what a descriptor set said of its input message).
    pub fn method(mut self, path: &str, kind: MethodKind, effect: MethodEffect) -> Self {
        Arc::make_mut(&mut self.by_path).insert(path.into(), Method { kind, effect });
        if self.inputs.contains_key(path) {
            Arc::make_mut(&mut self.inputs).remove(path);
        }
        self
    }

    /// Name the top-level fields of the input message of the method at `path`.
    pub(super) fn with_input_fields(mut self, path: &str, fields: MessageFields) -> Self {
        Arc::make_mut(&mut self.inputs).insert(path.into(), Arc::new(fields));
        self
    }

    /// The top-level fields of the input message of the method at `path`, when the table
    /// was read from a descriptor set that declares it.
    pub(super) fn input_fields(&self, path: &str) -> Option<&Arc<MessageFields>> {
        self.inputs.get(path)
    }

    /// Add a unary method with side effects (`idempotency_level` left unset).
    pub fn unary(self, path: &str) -> Self {
        self.method(path, MethodKind::Unary, MethodEffect::SideEffect)
    }

    /// Add a unary `NO_SIDE_EFFECTS` method: a read.
    pub fn reads(self, path: &str) -> Self {
        self.method(path, MethodKind::Unary, MethodEffect::NoSideEffects)
    }

    /// Add a unary `IDEMPOTENT` method.
    pub fn idempotent(self, path: &str) -> Self {
        self.method(path, MethodKind::Unary, MethodEffect::Idempotent)
    }

    /// Add a server-streaming method (whose effect is left unset).
    pub fn server_streaming(self, path: &str) -> Self {
        self.method(path, MethodKind::ServerStreaming, MethodEffect::SideEffect)
    }

    /// The method at `path`, if the table names it.
    pub fn get(&self, path: &str) -> Option<Method> {
        self.by_path.get(path).copied()
    }

    /// How many methods the table names.
    pub fn len(&self) -> usize {
        self.by_path.len()
    }

    /// Whether the table names no method.
    pub fn is_empty(&self) -> bool {
        self.by_path.is_empty()
    }
}
