//! The operator's console: list, inspect and resolve ledger records from a browser or a
//! script, behind an authorizer.
//!
//! An operation left *in doubt* (its attempt may have reached the provider, and nobody
//! knows whether it took effect) waits for its caller's next run, which resends the frozen
//! bytes. When the provider cannot deduplicate, someone has to check by hand and say what
//! happened. The console is where: [`Console::router`] is an axum [`Router`] you nest in
//! your own (`Router::new().nest("/_idempotency", console)`), with
//!
//! - a JSON API: `GET api/records` (a page of records, filtered), `GET api/records/{key}`
//!   (one record, with its frozen request, redacted), `POST api/records/{key}/forget`,
//!   `POST api/records/{key}/resolve-not-applied`, `POST api/records/{key}/resolve-applied`
//!   and `POST api/records/{key}/reconcile-now`;
//! - HTML pages that work without JavaScript: `GET /` (the list, with a filter form),
//!   `GET records/{key}` (one record and its frozen request, redacted, with its actions as
//!   forms: reconcile now, on a console with a reconciler, and resolve as applied and as
//!   not applied for an operation in doubt, forget for any), and the forms' `POST`s.
//!
//! # Who may do what
//!
//! A console cannot be built without an [`Authorize`]: every request goes through it, and
//! it names the [`Operator`] (whose identity goes into the audit events) and their
//! [`Role`], or refuses with `401`/`403`. A read-only operator lists and inspects; every
//! action answers them `403`.
//!
//! ```compile_fail,E0061
//! # use tower_idempotency::console::Console;
//! # use tower_idempotency::ledger::{MemoryStore, Records};
//! // No authorizer, no console.
//! let console = Console::new(Records::new(MemoryStore::new()));
//! ```
//!
//! # Acting on what was seen
//!
//! Every action carries the *look* it was made from (`{kind, generation, attempts,
//! fingerprint}`, as each record shows it under `look`), and the ledger acts only if the
//! record is still so (see [`Expected`](crate::ledger::Expected)): a record that moved on
//! since is answered `409` with how it is now and what changed, and nothing happens.
//!
//! - **Forget** removes the record: the next request with its key runs the operation
//!   again. An operation in flight under a live lease is refused (`409`) unless `force`d.
//! - **Resolve as not applied** is forgetting a record *in doubt*, after checking with the
//!   provider that its effect did not happen: the caller's next run sends it again, once.
//!   Asked of a look that is not in doubt, it is refused with `422`; it is never forced.
//! - **Resolve as applied** completes an open record with the outcome the operator
//!   supplies, after seeing with the provider that its effect happened (its dashboard
//!   shows the charge): the caller's next run replays that outcome instead of sending the
//!   operation again ([`Records::resolve`](crate::ledger::Records::resolve)). The record keeps its fingerprint, so another
//!   payload under its key drifts as from any completed record. Asked of a completed look,
//!   it is refused with `422`; an operation in flight under a live lease is refused (`409`)
//!   unless `force`d. The outcome is `{"status", "content_type"?, "body"}` in the API
//!   (`"outcome"` beside the look), three fields in the record page's form: a status
//!   from 100 to 599, an optional content type, and the body as text, at most 64 KiB
//!   (JSON when the content type says so). A record does not say which face made it, so
//!   one shape serves both: for an HTTP call, the provider's response; for a tool call, a
//!   `200` whose body is the tool's result as JSON, as the tool face records one. A bad
//!   outcome is a `400` naming its field (`outcome.status`…), and nothing changes.
//! - **Reconcile now** asks the layer's [reconciler](crate::idempotency::Reconcile) about
//!   a record in doubt, now rather than at the caller's next run, and settles it by the
//!   answer. The record must still be as seen, in doubt, with its frozen request shown
//!   (else `409`, `422`; the reconciler is not asked). The reconciler gets the
//!   [`InDoubtOperation`](crate::idempotency::InDoubtOperation) the layer would build: the
//!   frozen request, the key as sent (read from it under the layer's key header), the
//!   record's attempts; within the layer's
//!   [`reconcile_timeout`](crate::client::Builder::reconcile_timeout). On
//!   [`Applied`](crate::idempotency::Reconciled::Applied) the record is resolved as applied
//!   with the response found, recorded as the layer records one (`"reconciled":
//!   "applied"`); on [`NotApplied`](crate::idempotency::Reconciled::NotApplied) it is
//!   resolved as not applied (`"reconciled": "not_applied"`); both fenced by the look, as
//!   the operator's own resolves. On [`Unknown`](crate::idempotency::Reconciled::Unknown)
//!   nothing changes, answered `200` with `"result": "unknown"` (an answer, not a
//!   failure); a reconciler that fails or panics is a `503`, one past its timeout a `504`,
//!   and nothing changes either. Only a console over a client layer built with
//!   [`reconcile`](crate::client::Builder::reconcile) has a reconciler (its
//!   [`records`](crate::client::ClientLayer) carry it): on any other (a server layer's,
//!   [`Records::new`]) the action is `422` (`"error": "no_reconciler"`) and its form is
//!   not shown.
//!
//! Each needs a `reason`, and each action, whatever came of it, leaves a `tracing` event
//! (target `tower_idempotency::console`: the operator's id and role, the action, the key,
//! the reason, the result, and for a resolve as applied the status recorded; `WARN` when a
//! record was forgotten or resolved) and with feature `metrics` counts one in
//! `idempotency_console_actions_total` (labels `action`: `forget`, `resolve_not_applied`,
//! `resolve_applied`, `reconcile_now`; `result`: `forgotten`, `resolved`, `absent`,
//! `changed`, `live`, `not_in_doubt`, `unknown`, `reconciler_failed`,
//! `reconciler_timed_out`, `no_reconciler`, `no_request`, `forbidden`, `cross_site`,
//! `csrf`, `error`). Identities are in events only, never in labels.
//!
//! # The frozen request, redacted
//!
//! A record in flight or in doubt keeps the request that may have reached the provider
//! ([`RecordView::request`](crate::ledger::RecordView)), which an operator checks with the
//! provider before acting. One record's page and JSON (`"request": {method, uri, version,
//! headers: [[name, value]…], body: {size, text} | {size, hex_prefix}}`; `null` when its
//! store shows none) show it with its secrets redacted: the values of `Authorization`,
//! `Cookie`, `Proxy-Authorization` and of the headers named with
//! [`redact_headers`](Console::redact_headers), and the JSON body fields named with
//! [`redact_fields`](Console::redact_fields), read `[redacted]`; a body that is not UTF-8
//! is shown as its size and the hex of its first 32 bytes. List pages leave it out.
//!
//! # Hostile input
//!
//! No action runs on a `GET`. Filters, cursors, keys and bodies are validated: anything
//! malformed is a `400` naming the field. The API's `POST`s need
//! `content-type: application/json`, which a cross-site form cannot send; the pages'
//! forms carry a token (HMAC-SHA256 of the operator's id under the console's secret) that
//! a cross-site page cannot read; and a `POST` the browser says came from another site
//! (`Sec-Fetch-Site`, or an `Origin` that is not the `Host`) is refused either way. Every
//! value written into a page is escaped, and pages forbid framing and scripts.
//!
//! # Example
//!
//! ```
//! use axum::Router;
//! use tower_idempotency::console::{Console, Operator, Refusal, Role};
//! use tower_idempotency::ledger::MemoryStore;
//! use tower_idempotency::IdempotencyLayer;
//!
//! let layer = IdempotencyLayer::client_builder(MemoryStore::new())
//!     .provider_deduplicates(false)
//!     .build()
//!     .unwrap();
//!
//! // Your identity check; here, a header a trusted proxy sets after its login.
//! let authorizer = |head: &http::request::Parts| {
//!     match head.headers.get("x-ops-user").and_then(|user| user.to_str().ok()) {
//!         Some(user) => Ok(Operator::new(user, Role::Act)),
//!         None => Err(Refusal::unauthenticated("sign in through the operations proxy")),
//!     }
//! };
//!
//! let app: Router = Router::new()
//!     .nest("/_idempotency", Console::new(layer.records(), authorizer).router());
//! ```

mod action;
mod api;
mod authorize;
mod csrf;
mod filter;
mod html;
mod look;
#[cfg(feature = "mcp")]
mod mcp;
mod pages;
mod problem;
mod redact;

use std::fmt;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::NestedPath;
use axum::routing::{get, post};
use axum::Router;
use http::request::Parts;

pub use authorize::{Authorize, Operator, Refusal, Role};
#[cfg(feature = "mcp")]
pub use mcp::{INSPECT_TOOL, LIST_TOOL};

use action::Action;
use csrf::CsrfKey;
use problem::Failure;
use redact::Redaction;

use crate::ledger::Records;

/// The largest action body read: a look, a reason and a token fit many times over.
const MAX_BODY: usize = 16 * 1024;

/// The largest body a resolve as applied reads: its receipt's [`look::MAX_RECEIPT_BODY`]
/// bytes, escaped (six bytes a character at worst in JSON, three in a form), and the rest.
/// A receipt past its own bound within this is refused by name (`400`).
const MAX_RESOLVE_BODY: usize = 6 * look::MAX_RECEIPT_BODY + MAX_BODY;

/// The operator's console over a ledger: see the [module docs](self).
///
/// ```
/// use tower_idempotency::console::{Console, Operator, Role};
/// use tower_idempotency::ledger::{MemoryStore, Records};
///
/// let console = Console::new(Records::new(MemoryStore::new()), |_: &http::request::Parts| {
///     Ok(Operator::new("on-call", Role::ReadOnly))
/// });
/// let router: axum::Router = console.router();
/// ```
pub struct Console {
    shared: Shared,
}

/// What every handler of a console reads.
pub(crate) struct Shared {
    records: Records,
    authorizer: Box<dyn Authorize>,
    csrf: CsrfKey,
    /// What a record's frozen request hides when shown.
    redaction: Redaction,
}

impl Console {
    /// A console over `records` (a layer's [`records`](crate::IdempotencyLayer::records),
    /// or [`Records::new`] over a store), letting in only whom `authorizer` names.
    ///
    /// Its forms' tokens are signed with a secret drawn from the operating system's
    /// generator; consoles of several replicas behind one address share one with
    /// [`csrf_secret`](Self::csrf_secret).
    ///
    /// # Panics
    ///
    /// If the operating system's random generator cannot be read.
    pub fn new(records: Records, authorizer: impl Authorize) -> Self {
        Self {
            shared: Shared {
                records,
                authorizer: Box::new(authorizer),
                csrf: CsrfKey::random(),
                redaction: Redaction::default(),
            },
        }
    }

    /// Sign the forms' tokens with `secret` (32 random bytes, kept as secret as a session
    /// key): for replicas behind one address, so a form one rendered is accepted by all.
    ///
    /// ```
    /// use tower_idempotency::console::{Console, Operator, Role};
    /// use tower_idempotency::ledger::{MemoryStore, Records};
    ///
    /// # let secret_from_your_vault = [42u8; 32];
    /// let console = Console::new(Records::new(MemoryStore::new()), |_: &http::request::Parts| {
    ///     Ok(Operator::new("on-call", Role::Act))
    /// })
    /// .csrf_secret(secret_from_your_vault);
    /// ```
    pub fn csrf_secret(mut self, secret: [u8; 32]) -> Self {
        self.shared.csrf = CsrfKey::from_secret(secret);
        self
    }

    /// Redact the values of these headers (any case) too, wherever a record's frozen
    /// request is shown; `Authorization`, `Cookie` and `Proxy-Authorization` always are.
    /// Each value is shown as `[redacted]`.
    ///
    /// ```
    /// use tower_idempotency::console::{Console, Operator, Role};
    /// use tower_idempotency::ledger::{MemoryStore, Records};
    ///
    /// let console = Console::new(Records::new(MemoryStore::new()), |_: &http::request::Parts| {
    ///     Ok(Operator::new("on-call", Role::Act))
    /// })
    /// .redact_headers(["X-Api-Key", "x-signature"]);
    /// ```
    pub fn redact_headers<I>(mut self, names: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        self.shared
            .redaction
            .add_headers(names.into_iter().map(Into::into));
        self
    }

    /// Redact these fields of a JSON body, each named by its JSON pointer (RFC 6901:
    /// `/card/number`, `/items/0/cvc`; `""` is the whole body), wherever a record's frozen
    /// request is shown. Each value is shown as `"[redacted]"`, in the body written out
    /// again as compact JSON (its members in key order); a body that is not JSON has no
    /// fields to redact and is shown as it is.
    ///
    /// ```
    /// use tower_idempotency::console::{Console, Operator, Role};
    /// use tower_idempotency::ledger::{MemoryStore, Records};
    ///
    /// let console = Console::new(Records::new(MemoryStore::new()), |_: &http::request::Parts| {
    ///     Ok(Operator::new("on-call", Role::Act))
    /// })
    /// .redact_fields(["/card/number", "/card/cvc"]);
    /// ```
    ///
    /// # Panics
    ///
    /// If a pointer is neither empty nor starts with `/`: it would name no field, and leave
    /// the one it was meant to hide in sight.
    pub fn redact_fields<I>(mut self, pointers: I) -> Self
    where
        I: IntoIterator,
        I::Item: Into<String>,
    {
        self.shared
            .redaction
            .add_fields(pointers.into_iter().map(Into::into));
        self
    }

    /// The console's routes, to nest in your router at any prefix: links and redirects
    /// follow the prefix it is nested at.
    pub fn router(self) -> Router {
        let action =
            |action: Action| post(move |state, key, request| api::act(state, key, request, action));
        let form = |action: Action| {
            post(move |state, key, request| pages::act(state, key, request, action))
        };
        Router::new()
            .route("/", get(pages::list))
            .route("/records/{key}", get(pages::record))
            .route("/records/{key}/forget", form(Action::Forget))
            .route(
                "/records/{key}/resolve-not-applied",
                form(Action::ResolveNotApplied),
            )
            .route(
                "/records/{key}/resolve-applied",
                form(Action::ResolveApplied),
            )
            .route("/records/{key}/reconcile-now", form(Action::ReconcileNow))
            .route("/api/records", get(api::list))
            .route("/api/records/{key}", get(api::record))
            .route("/api/records/{key}/forget", action(Action::Forget))
            .route(
                "/api/records/{key}/resolve-not-applied",
                action(Action::ResolveNotApplied),
            )
            .route(
                "/api/records/{key}/resolve-applied",
                action(Action::ResolveApplied),
            )
            .route(
                "/api/records/{key}/reconcile-now",
                action(Action::ReconcileNow),
            )
            .with_state(Arc::new(self.shared))
    }
}

impl fmt::Debug for Console {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the secret.
        f.debug_struct("Console")
            .field("records", &self.shared.records)
            .finish_non_exhaustive()
    }
}

impl Shared {
    /// The operator behind `head`, or the authorizer's refusal.
    fn operator(&self, head: &Parts) -> Result<Operator, Failure> {
        self.authorizer.authorize(head).map_err(Failure::refused)
    }
}

/// The path the console is nested at (`""` at the root), for links and redirects.
fn prefix(head: &Parts) -> String {
    head.extensions
        .get::<NestedPath>()
        .map(|nested| nested.as_str().trim_end_matches('/').to_owned())
        .unwrap_or_default()
}

/// Whether the request's body is of `media_type` (parameters such as a charset aside).
fn is_media_type(head: &Parts, media_type: &str) -> bool {
    head.headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .is_some_and(|value| value.trim().eq_ignore_ascii_case(media_type))
}

/// An action's body, up to [`MAX_BODY`] ([`MAX_RESOLVE_BODY`] for a resolve as applied,
/// which carries a receipt).
async fn read_body(body: Body, action: Action) -> Result<axum::body::Bytes, Failure> {
    let limit = match action {
        Action::ResolveApplied => MAX_RESOLVE_BODY,
        Action::Forget | Action::ResolveNotApplied | Action::ReconcileNow => MAX_BODY,
    };
    axum::body::to_bytes(body, limit)
        .await
        .map_err(|_| Failure::too_large())
}
