//! How an operation's owner sends its frozen request: handed to any service as a request
//! ([`Handed`]), or straight into the attempts of the retry layer of a stack built as one
//! ([`Fused`]).
//!
//! The two differ only in how the bytes reach the retry layer and how the exchange learns
//! afterwards whether any attempt may have left (which decides between releasing an
//! operation and leaving it in doubt). [`Handed`] rebuilds a request from the frozen one
//! and leaves a [`Handoff`] in its extensions, which a [`FrozenRetryLayer`] inside (behind
//! any layers in between) finds, checks against what it was handed and reports back
//! through. [`Fused`] knows its inner service is that retry layer: it hands the frozen
//! request over as it is, and reads the answer from the retry layer's own bookkeeping, so
//! an operation costs no hand-off, no second look at the request and no extension.
//!
//! [`FrozenRetryLayer`]: crate::FrozenRetryLayer

use std::future::Future;

use bytes::Bytes;
use http::{Extensions, Request, Response};
use http_body_util::Full;
use tower::util::Oneshot;
use tower::ServiceExt;
use tower_service::Service;

use super::face::ClientFace;
use crate::frozen::{FrozenRequest, Handoff};
use crate::idempotency::decision::Track;
use crate::retry::{FrozenAttempts, FrozenRetry};
use crate::OperationId;

/// How an exchange sends its frozen request through the inner service `S` (see the module
/// docs).
pub(crate) trait Sending<S, ResB>: 'static
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
{
    /// What the exchange keeps of the sending, to ask once the call is over.
    type Link: Send;

    /// The call under way: `inner`'s future, or what stands for it.
    type Call: Future<Output = Result<Response<ResB>, S::Error>>;

    /// Call `inner`, ready, with `frozen` and the caller's `extensions`.
    fn send(
        client: &ClientFace,
        inner: S,
        frozen: FrozenRequest,
        extensions: Extensions,
    ) -> (Self::Call, Self::Link);

    /// The call of a request outside the ledger (a read, or a side effect let through
    /// unprotected): `inner`'s future, or what stands for it.
    type Pass: Future<Output = Result<Response<ResB>, S::Error>>;

    /// Send `frozen` with the caller's `extensions` through `inner` (not yet driven to
    /// readiness), outside the ledger.
    fn pass(inner: S, frozen: &FrozenRequest, extensions: Extensions) -> Self::Pass;

    /// Once `call` is over: whether an attempt before its last one may have reached the
    /// server. The last one speaks for itself (its answer came from the server; its
    /// failure carries its phase), so an answer that says nothing started releases an
    /// operation unless an earlier attempt may have left.
    /// A retry layer inside that reports a longer retry window than the face was told
    /// raises [`RetryWindowExceeded`](crate::idempotency::Signal::RetryWindowExceeded) on
    /// `track`.
    fn may_have_left(
        client: &ClientFace,
        track: &Track,
        link: &Self::Link,
        call: &Self::Call,
    ) -> bool;
}

/// Through any service, as a request rebuilt from the frozen one (see the module docs).
pub(crate) enum Handed {}

impl<S, ResB> Sending<S, ResB> for Handed
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
{
    type Link = Handoff;
    type Call = S::Future;
    type Pass = Oneshot<S, Request<Full<Bytes>>>;

    #[inline(always)]
    fn send(
        client: &ClientFace,
        mut inner: S,
        frozen: FrozenRequest,
        mut extensions: Extensions,
    ) -> (S::Future, Handoff) {
        let handoff = Handoff::new(
            frozen,
            !client.provider_deduplicates,
            client.key_header.clone(),
        );
        extensions.insert(handoff.clone());
        let request = handoff.frozen().to_request_with(extensions);
        (inner.call(request), handoff)
    }

    fn pass(inner: S, frozen: &FrozenRequest, extensions: Extensions) -> Self::Pass {
        inner.oneshot(frozen.to_request_with(extensions))
    }

    fn may_have_left(client: &ClientFace, track: &Track, handoff: &Handoff, _: &S::Future) -> bool {
        client.check_real_retry_window(track, handoff);
        handoff.may_have_been_sent()
    }
}

/// Straight into the attempts of the [`FrozenRetry`] a stack built as one wraps (see the
/// module docs). Its retry policy is the one the client layer was built with, so there is
/// no retry window to check. The call is the retry layer's attempts alone
/// ([`FrozenAttempts`]), without room for a request to read and freeze; so is a request
/// outside the ledger, which the retry layer would otherwise read and freeze a second time.
pub(crate) enum Fused {}

impl<T, ResB> Sending<FrozenRetry<T>, ResB> for Fused
where
    FrozenRetry<T>: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
    FrozenAttempts<T>: Future<
        Output = Result<Response<ResB>, <FrozenRetry<T> as Service<Request<Full<Bytes>>>>::Error>,
    >,
    T: Service<Request<Full<Bytes>>>,
{
    type Link = ();
    type Call = FrozenAttempts<T>;
    type Pass = FrozenAttempts<T>;

    #[inline(always)]
    fn send(
        client: &ClientFace,
        inner: FrozenRetry<T>,
        frozen: FrozenRequest,
        mut extensions: Extensions,
    ) -> (FrozenAttempts<T>, ()) {
        without_operation_id(&mut extensions);
        let key_ignored = !client.provider_deduplicates;
        let key_header = Some(client.key_header.clone());
        (
            inner.send_frozen(frozen, extensions, (key_ignored, key_header)),
            (),
        )
    }

    #[inline(always)]
    fn pass(inner: FrozenRetry<T>, frozen: &FrozenRequest, extensions: Extensions) -> Self::Pass {
        // Nothing here carries a key: a server that ignores keys makes no difference.
        inner.send_frozen(frozen.clone(), extensions, (false, None))
    }

    fn may_have_left(_: &ClientFace, _: &Track, _: &(), call: &FrozenAttempts<T>) -> bool {
        call.earlier_may_have_left()
    }
}

/// The caller's extensions less the [`OperationId`], which the stack has turned into the
/// request's key: every attempt gets a copy of the extensions, and a map the `OperationId`
/// alone filled would cost each attempt three allocations to copy. The transport below
/// gets the key in its header. (Stacked by hand, a layer in between may still read it.)
#[inline(always)]
fn without_operation_id(extensions: &mut Extensions) {
    if extensions.remove::<OperationId>().is_some() && extensions.is_empty() {
        *extensions = Extensions::new();
    }
}
