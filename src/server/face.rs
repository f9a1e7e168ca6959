//! The server face's configuration, as the builder checked it: what every stage of a
//! request reads, and never writes. Shared by all of a layer's services and requests
//! through one `Arc`, so it needs no lock: nothing in it changes after `build`.

use std::fmt;
use std::time::Duration;

use http::header::HeaderName;
use http::request::Parts;
use http::{Method, Request, Response, StatusCode};

use super::policy::{InDoubtPolicy, NotProcessed, ServerErrorPolicy};
use crate::effect::EffectClass;
use crate::idempotency::decision::OutcomeHook;
use crate::idempotency::engine::{BusyPolicy, Ledger};
use crate::idempotency::scope::Scope;
use crate::ledger::LedgerKey;
use crate::IdempotencyLayer;

/// The server face's configuration (see [`Builder`](crate::server::Builder) and the
/// [module docs](super)).
pub struct ServerFace {
    pub(super) ledger: Ledger,
    pub(super) scope: Scope,
    pub(super) methods: Vec<Method>,
    pub(super) require_key: bool,
    pub(super) busy: BusyPolicy,
    pub(crate) body_limit: usize,
    pub(super) response_limit: usize,
    pub(super) replay_headers: Vec<HeaderName>,
    pub(super) server_errors: ServerErrorPolicy,
    /// Answers that say the request was refused before it was processed.
    pub(super) released: Vec<StatusCode>,
    pub(super) in_doubt: InDoubtPolicy,
    pub(super) fail_open: bool,
    pub(super) cancel_on_disconnect: bool,
    pub(super) retry_after: Duration,
    pub(super) on_outcome: Option<OutcomeHook>,
    /// The transactional mode's database: each keyed request runs in one transaction.
    #[cfg(feature = "postgres")]
    pub(super) transactional: Option<crate::ledger::PostgresStore>,
}

impl fmt::Debug for ServerFace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerFace")
            .field("ledger", &self.ledger)
            .field("methods", &self.methods)
            .field("require_key", &self.require_key)
            .field("busy", &self.busy)
            .field("body_limit", &self.body_limit)
            .field("response_limit", &self.response_limit)
            .field("replay_headers", &self.replay_headers)
            .field("server_errors", &self.server_errors)
            .field("released", &self.released)
            .field("in_doubt", &self.in_doubt)
            .field("fail_open", &self.fail_open)
            .field("cancel_on_disconnect", &self.cancel_on_disconnect)
            .field("retry_after", &self.retry_after)
            .finish_non_exhaustive()
    }
}

impl ServerFace {
    /// The store of this face's ledger.
    #[cfg(feature = "tonic")]
    pub(crate) fn store(&self) -> &std::sync::Arc<dyn crate::ledger::IdempotencyStore> {
        &self.ledger.store
    }

    /// The ledger key of the record a request with `head` claims (its `Idempotency-Key`,
    /// scoped as this face scopes keys); `None` without a well-formed key or a principal.
    /// The derivation `call` makes (`service.rs`), step for step.
    pub(crate) fn ledger_key(&self, head: &Parts) -> Option<LedgerKey> {
        let key = crate::HeaderKey::from_headers(&head.headers).ok()??;
        let scope = self.scope.of(head)?;
        Some(LedgerKey::server_of(&scope, key.as_bytes()))
    }

    /// Whether a handler's server error releases the key
    /// ([`ServerErrorPolicy::Release`]) rather than being recorded.
    #[cfg(feature = "tonic")]
    pub(crate) fn releases_server_errors(&self) -> bool {
        self.server_errors == ServerErrorPolicy::Release
    }

    /// Whether `req` goes through the ledger: its [`EffectClass`] when a layer outside set
    /// one, else its method.
    pub(super) fn is_side_effect<B>(&self, req: &Request<B>) -> bool {
        // An explicit class wins over the method: a layer outside that set one knows the
        // route (a `PUT` that charges, a `POST` that only searches); the method is a guess.
        match req.extensions().get::<EffectClass>() {
            Some(class) => class.is_side_effect(),
            None => self.methods.contains(req.method()),
        }
    }

    /// Whether the handler's answer releases the key rather than being recorded: an answer
    /// the handler marked [`NotProcessed`], a `503` with `Retry-After` (a refusal for load,
    /// like a `429`), a `5xx` under [`ServerErrorPolicy::Release`], or an answer that says
    /// the request was refused before it was processed
    /// ([`release_statuses`](crate::server::Builder::release_statuses)).
    #[inline]
    pub(super) fn releases<B>(&self, response: &Response<B>) -> bool {
        let status = response.status();
        // A success is an outcome whatever the list says, and is judged in two compares
        // (and one look at the extensions, empty unless something put one there).
        is_marked_not_processed(response)
            || (status.is_server_error() && self.server_errors == ServerErrorPolicy::Release)
            || (!status.is_success() && self.released.contains(&status))
            || is_shed_for_load(response)
    }
}

/// The handler said it did nothing (see [`NotProcessed`]).
#[inline]
fn is_marked_not_processed<B>(response: &Response<B>) -> bool {
    response.extensions().get::<NotProcessed>().is_some()
}

/// A `503` that says when to come back refuses the request for the server's load, before
/// processing it (RFC 9110, 15.6.4), as a `429` does: recorded, it would be replayed for
/// the whole retention, without its point (the `Retry-After`), and the key would be stuck.
/// A `503` without one may come from a handler that failed after its effect, and follows
/// the [`ServerErrorPolicy`].
#[inline]
fn is_shed_for_load<B>(response: &Response<B>) -> bool {
    response.status() == StatusCode::SERVICE_UNAVAILABLE
        && response.headers().contains_key(http::header::RETRY_AFTER)
}

impl IdempotencyLayer<ServerFace> {
    /// An operator's handle on this layer's ledger: look at the record a request head
    /// (its `Idempotency-Key` and whatever the layer's scope reads, e.g. `Authorization`)
    /// leads to, as this layer keys it, and forget it, fenced. See
    /// [`Records`](crate::ledger::Records).
    ///
    /// ```
    /// use axum::http::Request;
    /// use tower_idempotency::{ledger::MemoryStore, IdempotencyLayer};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_idempotency::ledger::StoreError> {
    /// let layer = IdempotencyLayer::server(MemoryStore::new());
    /// let (head, ()) = Request::post("/charges")
    ///     .header("authorization", "Bearer tenant-1")
    ///     .header("idempotency-key", "\"order-17\"")
    ///     .body(())
    ///     .unwrap()
    ///     .into_parts();
    /// let records = layer.records();
    /// let key = records.request_key(&head).expect("keyed and scoped");
    /// assert!(records.inspect(key).await?.is_none());
    /// # Ok(())
    /// # }
    /// ```
    pub fn records(&self) -> crate::ledger::Records {
        let face = self.face().clone();
        let store = face.ledger.store.clone();
        let retention = face.ledger.retention;
        // The derivation `call` makes (`service.rs`), step for step: an operator's look-up
        // must land on the very record a request with this head would claim. A malformed or
        // repeated key finds nothing, as the layer never lets one reach the ledger.
        crate::ledger::Records::server(store, move |head: &Parts| face.ledger_key(head), retention)
    }
}
