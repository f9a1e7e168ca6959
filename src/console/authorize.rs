//! Who is asking: [`Authorize`] turns a request head into an [`Operator`] or a [`Refusal`].

use std::fmt;

use http::request::Parts;
use http::StatusCode;

/// Turns a request into the operator making it, or refuses it: every request to the
/// console, page or API, read or action, passes through it first.
///
/// The console has no authentication of its own: it trusts what this says. Check whatever
/// your deployment already has (a session cookie, a bearer token checked against your
/// identity provider, a header a trusted proxy sets after its own login) and say who the
/// operator is and what they may do. Implemented for closures too.
///
/// ```
/// use tower_idempotency::console::{Authorize, Operator, Refusal, Role};
///
/// // A header set by the authenticating proxy in front; only `ops-lead` may act.
/// let authorizer = |head: &http::request::Parts| {
///     let user = head
///         .headers
///         .get("x-authenticated-user")
///         .and_then(|value| value.to_str().ok())
///         .ok_or_else(|| Refusal::unauthenticated("sign in through the proxy"))?;
///     let role = if user == "ops-lead" { Role::Act } else { Role::ReadOnly };
///     Ok(Operator::new(user, role))
/// };
///
/// let (head, ()) = http::Request::get("/").header("x-authenticated-user", "ops-lead")
///     .body(()).unwrap().into_parts();
/// assert_eq!(authorizer.authorize(&head).unwrap().role, Role::Act);
/// ```
pub trait Authorize: Send + Sync + 'static {
    /// The operator behind `head`, or why the request is refused.
    fn authorize(&self, head: &Parts) -> Result<Operator, Refusal>;
}

impl<F> Authorize for F
where
    F: Fn(&Parts) -> Result<Operator, Refusal> + Send + Sync + 'static,
{
    fn authorize(&self, head: &Parts) -> Result<Operator, Refusal> {
        self(head)
    }
}

/// What an operator may do.
///
/// ```
/// use tower_idempotency::console::Role;
///
/// assert!(Role::Act.may_act());
/// assert!(!Role::ReadOnly.may_act());
/// assert_eq!(Role::ReadOnly.as_str(), "read_only");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Role {
    /// List and inspect records; every action is refused with `403`.
    ReadOnly,
    /// List, inspect, and act on records (forget, resolve as not applied).
    Act,
}

impl Role {
    /// Whether the role allows actions.
    pub fn may_act(self) -> bool {
        matches!(self, Self::Act)
    }

    /// `read_only` or `act`, as the audit events name it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ReadOnly => "read_only",
            Self::Act => "act",
        }
    }
}

/// The person (or automation) behind a request, as the [authorizer](Authorize) names them:
/// their identity goes into every audit event of their actions.
///
/// ```
/// use tower_idempotency::console::{Operator, Role};
///
/// let operator = Operator::new("alice@example.com", Role::ReadOnly);
/// assert_eq!(operator.id, "alice@example.com");
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Operator {
    /// Who they are: an e-mail, a user name, a service account.
    pub id: String,
    /// What they may do.
    pub role: Role,
}

impl Operator {
    /// The operator `id` with `role`.
    pub fn new(id: impl Into<String>, role: Role) -> Self {
        Self {
            id: id.into(),
            role,
        }
    }
}

/// Why the [authorizer](Authorize) refused a request: answered `401` (nobody recognised)
/// or `403` (recognised, not allowed), with the message as the body.
///
/// The message is shown to whoever asked, so it should say what to do, not why a
/// credential failed.
///
/// ```
/// use http::StatusCode;
/// use tower_idempotency::console::Refusal;
///
/// let refusal = Refusal::forbidden("the console is for the payments on-call only");
/// assert_eq!(refusal.status(), StatusCode::FORBIDDEN);
/// assert_eq!(Refusal::unauthenticated("sign in").status(), StatusCode::UNAUTHORIZED);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    status: StatusCode,
    message: String,
}

impl Refusal {
    /// Nobody recognised (no credentials, or ones that do not check out): `401`.
    pub fn unauthenticated(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: message.into(),
        }
    }

    /// Recognised, but not allowed at the console: `403`.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::FORBIDDEN,
            message: message.into(),
        }
    }

    /// `401` or `403`.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// What the refused caller is told.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status, self.message)
    }
}

impl std::error::Error for Refusal {}
