//! Effect classes: which calls need protecting.

use http::{Extensions, Method};

/// What a call does to the world, which decides how the layers treat it.
///
/// Only [`SideEffect`](EffectClass::SideEffect) calls go through the ledger; the others pass
/// straight through the [`IdempotencyLayer`](crate::IdempotencyLayer) and are retried
/// freely by the [`FrozenRetryLayer`](crate::FrozenRetryLayer).
///
/// By default the method decides ([`EffectClass::of_method`]): `POST` and `PATCH` are side
/// effects, safe methods are reads, `PUT` and `DELETE` are idempotent writes. Insert an
/// `EffectClass` into a request's extensions to override it, e.g. for a `POST` search
/// endpoint that only reads, or a `PUT` that sends an email.
///
/// ```
/// use tower_idempotency::EffectClass;
///
/// let mut req = http::Request::post("http://search.local/query").body(()).unwrap();
/// assert_eq!(EffectClass::of_request(&req), EffectClass::SideEffect);
/// req.extensions_mut().insert(EffectClass::Read);
/// assert_eq!(EffectClass::of_request(&req), EffectClass::Read);
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EffectClass {
    /// Changes nothing (`get_order_status`). Retry freely.
    Read,
    /// Lands on the same end state however often it runs (`set_status(order, shipped)`).
    IdempotentWrite,
    /// Every run is a new real-world effect (`charge_card`, `send_email`). Protected.
    SideEffect,
}

impl EffectClass {
    /// The default class of a method.
    ///
    /// ```
    /// # use tower_idempotency::EffectClass;
    /// assert_eq!(EffectClass::of_method(&http::Method::PATCH), EffectClass::SideEffect);
    /// assert_eq!(EffectClass::of_method(&http::Method::PUT), EffectClass::IdempotentWrite);
    /// assert_eq!(EffectClass::of_method(&http::Method::HEAD), EffectClass::Read);
    /// ```
    pub fn of_method(method: &Method) -> Self {
        match *method {
            Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE => Self::Read,
            Method::PUT | Method::DELETE => Self::IdempotentWrite,
            // POST, PATCH, CONNECT and extension methods: assume the worst.
            _ => Self::SideEffect,
        }
    }

    /// The class of a request: its extension override, else its method's default.
    pub fn of_request<B>(req: &http::Request<B>) -> Self {
        Self::resolve(req.method(), req.extensions())
    }

    /// The class given a method and extensions.
    pub fn resolve(method: &Method, extensions: &Extensions) -> Self {
        extensions
            .get::<Self>()
            .copied()
            .unwrap_or_else(|| Self::of_method(method))
    }

    /// `true` for [`SideEffect`](EffectClass::SideEffect).
    pub fn is_side_effect(self) -> bool {
        self == Self::SideEffect
    }
}
