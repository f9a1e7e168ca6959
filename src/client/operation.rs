//! One keyed operation through the client face, as hand-written futures: freeze the
//! request, claim the operation, then send it as its owner ([`Exchange`]) or replay it.
//!
//! Futures of their own rather than `async fn`s, so that the operation is a type that can
//! be named and held in place: the layer's future is not boxed, and nested `async fn`s no
//! longer each keep a copy of what they are handed. The rare paths (a store that awaits,
//! drift, resuming or reconciling an operation in doubt, fail open, a failure to settle)
//! stay `async` and are boxed when taken.
//!
//! # Why each transition is safe
//!
//! The one rule: **no byte of a keyed request leaves before the ledger holds the operation
//! and its frozen bytes**, and the ledger never forgets an operation whose bytes may have
//! left. Each step keeps it:
//!
//! - `Freezing → operate`: the body is read whole (up to the limit) before `begin` is
//!   asked. A body that fails or overflows ends the operation here, before the ledger is
//!   touched: nothing was claimed, nothing needs releasing.
//! - `operate`: `begin` carries the frozen request (`with_frozen`), so the claim and the
//!   bytes a resume will resend are written in one store call. There is no moment at which
//!   the ledger holds a claim without the bytes: a crash right after `begin` leaves an
//!   operation that the next run resumes with exactly these bytes, never with its own.
//! - `Acquired → Exchanging`: the lease token goes into a guard before the inner service is
//!   even asked to be ready (see [`Exchange`]); dropping the future from here on settles
//!   the operation from the guard, never leaves it claimed for ever.
//! - `Replay`: answered from the record alone; the inner service is never called, so a
//!   replay cannot become a second effect.
//! - Anything else (busy, drift, in doubt, a store that must be awaited) goes to the slow
//!   path with the inner service unused: it is the slow path's to call, at most once.

use crate::idempotency::wiring::Wiring;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::Body;
use http_body_util::Full;
use pin_project_lite::pin_project;
use tower_service::Service;

use super::exchange::{Answer, Exchange, Keyed};
use super::face::ClientFace;
use super::failure::failed_outside;
use super::identify::identify;
use super::resolve::{operate_after, replay};
use super::send::Sending;
use crate::effect::EffectClass;
use crate::frozen::{check_declared_length, Adding, CollectRequest, FrozenRequest};
use crate::idempotency::body::ResponseBody;
use crate::idempotency::decision::{self, Decision, Face, Track, WireKey};
use crate::ledger::{Begin, LedgerKey};
use crate::ResponseSource;
use crate::{BoxError, Error};

/// A rare path of an operation, boxed: while the inner service may still be called, it
/// lives as long as that service (`'a`).
type Slow<'a, ResB> = Pin<Box<dyn Future<Output = Answer<ResB>> + Send + 'a>>;

pin_project! {
    /// One logical operation through the client face (see the module docs); `M` is how
    /// its owner sends the frozen request ([`Sending`]).
    pub(crate) struct Operation<'a, S, B, ResB, M>
    where
        S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
        M: Sending<S, ResB>,
    {
        // Called once: the retries, if any, are its own.
        inner: Option<S>,
        client: Arc<ClientFace>,
        started: Option<tokio::time::Instant>,
        #[pin]
        step: Step<'a, S, B, ResB, M>,
    }
}

pin_project! {
    #[project = StepProj]
    enum Step<'a, S, B, ResB, M>
    where
        S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
        M: Sending<S, ResB>,
    {
        Refused { error: Option<Error> },
        Freezing {
            #[pin]
            collect: CollectRequest<B>,
            key: Option<(LedgerKey, WireKey)>,
            side_effect: bool,
        },
        // Outside the ledger; the frozen request when it is an unprotected side effect.
        PassingThrough {
            #[pin]
            call: M::Pass,
            unprotected: Option<FrozenRequest>,
        },
        Exchanging { #[pin] exchange: Exchange<S, ResB, M> },
        Slow { future: Slow<'a, ResB> },
        Done,
    }
}

impl<'a, S, B, ResB, M> Operation<'a, S, B, ResB, M>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
    M: Sending<S, ResB>,
    B: Body,
{
    /// The operation of `req`: its key (or the refusal of a missing or malformed one),
    /// then its body read up to the limit.
    #[inline(always)]
    pub(crate) fn new(
        inner: S,
        client: Arc<ClientFace>,
        req: Request<B>,
        started: Option<tokio::time::Instant>,
    ) -> Self {
        let (parts, body) = req.into_parts();
        // A `reqwest-middleware` chain: what follows the middleware is not a type to read.
        let admission = Admission::of(&client, Wiring::UNKNOWN, &parts, &body);
        Self::held(inner, client, (parts, body), admission, started)
    }

    /// The operation of a request taken apart, once [`Admission::of`] has looked at it.
    /// One expression, so that the head and body are moved once, into the step, and the
    /// operation is built where its caller holds it.
    #[inline(always)]
    pub(crate) fn held(
        inner: S,
        client: Arc<ClientFace>,
        (parts, body): (http::request::Parts, B),
        admission: Admission,
        started: Option<tokio::time::Instant>,
    ) -> Self {
        Self {
            inner: Some(inner),
            step: match admission.key {
                Ok(key) => Step::Freezing {
                    collect: CollectRequest::checked(parts, body, client.body_limit),
                    key,
                    side_effect: admission.side_effect,
                },
                Err(error) => Step::Refused { error: Some(error) },
            },
            client,
            started,
        }
    }
}

/// What the client face makes of a request before it holds it: whether it is a side
/// effect, and its key, or why it is refused (a missing or malformed key, a body that says
/// it is over the limit). Small, so that it can be made inside the request's span (its
/// warnings belong there) while the request's head stays where it is.
pub(crate) struct Admission {
    side_effect: bool,
    key: Result<Option<(LedgerKey, WireKey)>, Error>,
}

impl Admission {
    /// Look at a request's head and body.
    #[inline(always)]
    pub(crate) fn of<B: Body>(
        client: &ClientFace,
        wiring: Wiring,
        parts: &http::request::Parts,
        body: &B,
    ) -> Self {
        let side_effect = EffectClass::resolve(&parts.method, &parts.extensions).is_side_effect();
        let key = if side_effect {
            wiring
                .check()
                .and_then(|()| client.check_layer_order(&parts.extensions))
                .and_then(|()| identify(client, parts))
        } else {
            Ok(None)
        };
        let key = key.and_then(|key| {
            check_declared_length(&parts.headers, body, client.body_limit)?;
            Ok(key)
        });
        Self { side_effect, key }
    }
}

impl<'a, S, B, ResB, M> Future for Operation<'a, S, B, ResB, M>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>> + Send + 'a,
    M: Sending<S, ResB>,
    S::Future: Send,
    M::Call: Send,
    S::Error: Into<BoxError>,
    B: Body,
    B::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Unpin + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    type Output = Answer<ResB>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            let next = match this.step.as_mut().project() {
                StepProj::Refused { error } => {
                    let error = error
                        .take()
                        .expect("ResponseFuture polled after completion");
                    Next::Answer(Err(error))
                }
                StepProj::Freezing {
                    collect,
                    key,
                    side_effect,
                } => match std::task::ready!(collect.poll(cx)) {
                    Err(error) => Next::Answer(Err(error)),
                    Ok((parts, body)) => {
                        let inner = this.inner.take().expect("called once");
                        let key = key.take();
                        // A keyed request carries `Content-Digest` of its frozen body, hashed
                        // once with the fingerprint, so the server can check that the bytes
                        // it got are the bytes we froze.
                        let adding = match &key {
                            None => Adding::Nothing,
                            Some((_, WireKey::Derived(key))) => Adding::Digest {
                                derived_key: Some((key, &this.client.key_header)),
                            },
                            Some(_) => Adding::Digest { derived_key: None },
                        };
                        let (frozen, extensions) = FrozenRequest::of_collected(parts, body, adding);
                        match key {
                            None => Next::Step(Step::PassingThrough {
                                call: M::pass(inner, &frozen, extensions),
                                unprotected: side_effect.then_some(frozen),
                            }),
                            Some((key, wire)) => {
                                let keyed = Keyed {
                                    key,
                                    frozen,
                                    extensions,
                                    track: tracked(wire),
                                };
                                let step = this.step.as_mut();
                                match operate(inner, this.client, keyed, *this.started, step) {
                                    Some(answer) => Next::Answer(answer),
                                    None => continue,
                                }
                            }
                        }
                    }
                },
                StepProj::PassingThrough { call, unprotected } => {
                    let response = std::task::ready!(call.poll(cx))
                        .map_err(|error| failed_outside(this.client, error.into()));
                    Next::Answer(response.map(|response| {
                        let mut response = response.map(ResponseBody::inner);
                        if let Some(frozen) = unprotected.take() {
                            this.client.report_unprotected(&frozen);
                            response
                                .extensions_mut()
                                .insert(ResponseSource::Unprotected);
                        }
                        response
                    }))
                }
                StepProj::Exchanging { exchange } => {
                    // Reported by reference and returned from here: the answer moves as
                    // little as it can on the common path.
                    let (answer, track) = std::task::ready!(exchange.poll(cx));
                    report(this.client, &track, *this.started, &answer);
                    this.step.set(Step::Done);
                    return Poll::Ready(answer);
                }
                StepProj::Slow { future } => {
                    Next::Answer(std::task::ready!(future.as_mut().poll(cx)))
                }
                StepProj::Done => panic!("ResponseFuture polled after completion"),
            };
            match next {
                Next::Step(step) => this.step.set(step),
                Next::Answer(answer) => {
                    this.step.set(Step::Done);
                    return Poll::Ready(answer);
                }
            }
        }
    }
}

/// Where a step leaves the operation: another step, or its answer.
// The next step is built once and moved into place; boxing it is what these futures avoid.
#[allow(clippy::large_enum_variant)]
enum Next<'a, S, B, ResB, M>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
    M: Sending<S, ResB>,
{
    Step(Step<'a, S, B, ResB, M>),
    Answer(Answer<ResB>),
}

/// The operation's decision log, its key also recorded in the span.
fn tracked(wire: WireKey) -> Track {
    decision::record_in_layer_span("key", tracing::field::display(decision::KeyDigest(&wire)));
    Track::new(Face::Client, Some(wire))
}

/// Tell the hook what the operation came to.
fn report<T>(
    client: &ClientFace,
    track: &Track,
    started: Option<tokio::time::Instant>,
    answer: &Answer<T>,
) {
    let status = answer.as_ref().ok().map(|response| response.status());
    track.report(client.on_outcome.as_ref(), started, status);
}

/// Tell the hook what the operation came to, and pass its answer on.
fn reported<T>(
    client: &ClientFace,
    track: &Track,
    started: Option<tokio::time::Instant>,
    answer: Answer<T>,
) -> Answer<T> {
    report(client, track, started, &answer);
    answer
}

/// The ledger's part: `begin` in place, then send as the owner or replay; anything else
/// (a store that awaits, a lost answer, drift, doubt, a refusal) by the boxed slow path.
/// The next step is built straight into `step` (its future is the operation's largest
/// part, and each move of it a copy); a replay's answer comes back.
#[inline(always)]
fn operate<'a, S, B, ResB, M>(
    inner: S,
    client: &Arc<ClientFace>,
    keyed: Keyed,
    started: Option<tokio::time::Instant>,
    mut step: Pin<&mut Step<'a, S, B, ResB, M>>,
) -> Option<Answer<ResB>>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>> + Send + 'a,
    M: Sending<S, ResB>,
    S::Future: Send,
    M::Call: Send,
    S::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Unpin + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let mut begin = client
        .ledger
        .request(keyed.key, keyed.frozen.fingerprint())
        .with_frozen(keyed.frozen.clone());
    if !client.provider_deduplicates {
        // The server would run an in-doubt operation again: only ever look at one.
        begin = begin.probe();
    }
    let answered = match client.ledger.begin_in_place(&begin, client.busy) {
        Ok(answered) => answered,
        // Boxed: waiting and asking again are the rare path; held in place, their state
        // would weigh on every operation's future.
        Err(lost) => {
            let client = client.clone();
            step.set(Step::Slow {
                future: Box::pin(async move {
                    let answered = client.ledger.begin_after(begin, client.busy, lost).await;
                    slowly::<S, ResB, M>(inner, &client, keyed, answered, started).await
                }),
            });
            return None;
        }
    };
    match answered {
        Ok(Begin::Acquired { token }) => {
            keyed.track.decided(Decision::Acquired);
            step.set(Step::Exchanging {
                exchange: Exchange::of_keyed(inner, client.clone(), keyed, token),
            });
            None
        }
        Ok(Begin::Replay(outcome)) => {
            keyed.track.decided(Decision::Replayed);
            let answer = replay(outcome, keyed.extensions);
            Some(reported(client, &keyed.track, started, answer))
        }
        answered => {
            let client = client.clone();
            step.set(Step::Slow {
                future: Box::pin(async move {
                    slowly::<S, ResB, M>(inner, &client, keyed, answered, started).await
                }),
            });
            None
        }
    }
}

/// The slow path: act on the ledger's answer as [`operate_after`] does, then tell the hook.
async fn slowly<S, ResB, M>(
    inner: S,
    client: &Arc<ClientFace>,
    keyed: Keyed,
    answered: Result<Begin, crate::ledger::StoreError>,
    started: Option<tokio::time::Instant>,
) -> Answer<ResB>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResB>>,
    M: Sending<S, ResB>,
    S::Error: Into<BoxError>,
    ResB: Body<Data = Bytes> + Unpin + Send + 'static,
    ResB::Error: Into<BoxError>,
{
    let Keyed {
        key,
        frozen,
        extensions,
        track,
    } = keyed;
    let answer =
        operate_after::<S, ResB, M>(inner, client, key, frozen, extensions, &track, answered).await;
    reported(client, &track, started, answer)
}
