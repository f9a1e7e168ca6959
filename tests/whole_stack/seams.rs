//! Where the pieces meet: the retry layer and the idempotency layer, the server face and
//! axum's router, one tenant and another, an attempt and the next, the engine and a store
//! that loses answers.
//!
//! Each test is named after the guarantee it proves and the defect it pins (`defect N`
//! refers to the reliability review that found it). Time is tokio's paused clock, except
//! against Redis, which judges leases by its own clock.
#![cfg(feature = "test-util")]

#[cfg(feature = "redis")]
use crate::support::orders;
use crate::support::redis as redis_support;

use crate::support::in_place;

use orders::{fast_policy, op, post, source, ORDERS};

use std::convert::Infallible;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::routing::{patch, post as route_post};
use axum::Router;
use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::{service_fn, Layer, ServiceBuilder, ServiceExt};
use tower_idempotency::client::ReleaseOn;
use tower_idempotency::ledger::{
    Begin, BeginRequest, IdempotencyStore, LeaseToken, LedgerKey, MemoryStore, Outcome, StoreError,
    StoreFuture,
};
use tower_idempotency::phase::FailurePhase;
use tower_idempotency::retry::RetryPolicy;
use tower_idempotency::server::problem;
use tower_idempotency::testing::{Fault, SideEffectService};
use tower_idempotency::ProviderKeys;
use tower_idempotency::{
    fingerprint::Fingerprint, BusyPolicy, DriftPolicy, FrozenRequest, FrozenRetryLayer,
    IdempotencyLayer, InDoubtPolicy, KeyHeader, OperationId, ResponseSource,
};

const ORIGINAL: &str = r#"{"order_id":"ord_8f21c3","summary":"Restock: 200 units of SKU-4471","fulfillment_intent_id":"fi_9a7e21"}"#;
const REGENERATED: &str = r#"{"order_id":"ord_8f21c3","summary":"Restock order for 200 units of SKU-4471 after a failed submission","fulfillment_intent_id":"fi_c02b6f"}"#;

async fn body_of<B: http_body::Body>(response: Response<B>) -> Bytes
where
    B::Error: std::fmt::Debug,
{
    response.into_body().collect().await.unwrap().to_bytes()
}

// ---------------------------------------------------------------------------------------
// A store that loses answers, fails writes or is slow: the engine's side of the seam
// ---------------------------------------------------------------------------------------

#[derive(Debug, Default)]
struct Faults {
    /// `begin`s that apply, then lose their reply (a timeout after the script ran).
    lost_begin_replies: AtomicU32,
    /// `complete`s that fail without applying (Redis restarting).
    failed_completes: AtomicU32,
    /// How long each `complete` takes before it applies.
    complete_delay_ms: AtomicU64,
}

fn take(counter: &AtomicU32) -> bool {
    counter
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
        .is_ok()
}

#[derive(Clone, Debug)]
struct FlakyStore {
    inner: Arc<dyn IdempotencyStore>,
    faults: Arc<Faults>,
    /// Answer in place (`StoreFuture::ready`, as `MemoryStore` does) rather than with a
    /// future to await: the layers take such answers outside their retrying path, so the
    /// faults must be handled the same way there. Needs an inner store that answers in
    /// place, and no `complete_delay_ms`.
    in_place: bool,
}

impl FlakyStore {
    fn new(inner: impl IdempotencyStore) -> Self {
        Self {
            inner: Arc::new(inner),
            faults: Arc::default(),
            in_place: false,
        }
    }

    fn in_place(inner: MemoryStore) -> Self {
        Self {
            in_place: true,
            ..Self::new(inner)
        }
    }
}

impl IdempotencyStore for FlakyStore {
    fn begin(&self, request: BeginRequest) -> StoreFuture<'_, Begin> {
        let lose = |answer| match take(&self.faults.lost_begin_replies) {
            true => Err(StoreError::timeout()),
            false => answer,
        };
        if self.in_place {
            return StoreFuture::ready(lose(in_place::at_once(self.inner.begin(request))));
        }
        StoreFuture::new(async move { lose(self.inner.begin(request).await) })
    }

    fn complete(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        outcome: Outcome,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        let failed = || {
            take(&self.faults.failed_completes)
                .then(|| StoreError::unavailable("injected: the ledger restarted"))
        };
        if self.in_place {
            return StoreFuture::ready(match failed() {
                Some(err) => Err(err),
                None => in_place::at_once(self.inner.complete(key, token, outcome, retention)),
            });
        }
        StoreFuture::new(async move {
            let delay = self.faults.complete_delay_ms.load(Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(delay)).await;
            if let Some(err) = failed() {
                return Err(err);
            }
            self.inner.complete(key, token, outcome, retention).await
        })
    }

    fn abandon(&self, key: LedgerKey, token: LeaseToken) -> StoreFuture<'_, ()> {
        self.inner.abandon(key, token)
    }

    fn mark_in_doubt(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        self.inner.mark_in_doubt(key, token, retention)
    }

    fn renew(&self, key: LedgerKey, token: LeaseToken, lease: Duration) -> StoreFuture<'_, ()> {
        self.inner.renew(key, token, lease)
    }
}

// ---------------------------------------------------------------------------------------
// Defect 1: "may have been sent" is sticky across the attempts of an operation
// ---------------------------------------------------------------------------------------

/// Attempt 1 reaches the provider (it commits, then answers 503 or never answers), attempts
/// 2 and 3 are refused at connect. The operation must stay in doubt: the agent's
/// regenerated payload is refused, and the same payload resends the frozen bytes. `built`:
/// through the stack as `build_stack()` builds it, else the two layers stacked by hand.
async fn sent_then_refused_stays_in_doubt(
    store: Arc<dyn IdempotencyStore>,
    first: Fault,
    built: bool,
) {
    let provider = SideEffectService::new().with_faults([
        first.clone(),
        Fault::RefuseBeforeSend,
        Fault::RefuseBeforeSend,
    ]);
    // Refusing drift shows whether the operation stayed claimed: a released one would send
    // the regenerated payload.
    let builder = IdempotencyLayer::client_builder(store)
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .drift_policy(DriftPolicy::Reject);
    let policy = fast_policy(Duration::from_millis(300));
    if built {
        let stack = builder.retry_policy(policy).build_stack().unwrap();
        let client = tower::Layer::layer(&stack, provider.clone());
        return stays_in_doubt_through(client, &provider, first).await;
    }
    let client = ServiceBuilder::new()
        .layer(builder.build().unwrap())
        .layer(FrozenRetryLayer::new(policy))
        .service(provider.clone());
    stays_in_doubt_through(client, &provider, first).await;
}

async fn stays_in_doubt_through<S, RB>(client: S, provider: &SideEffectService, first: Fault)
where
    S: tower::Service<
            Request<Full<Bytes>>,
            Response = Response<RB>,
            Error = tower_idempotency::Error,
        > + Clone,
    RB: std::fmt::Debug,
{
    let err = client.clone().oneshot(post(ORIGINAL)).await.unwrap_err();
    assert!(
        err.phase().is_some_and(FailurePhase::may_have_been_sent),
        "{first:?}: the first attempt may have been sent, whatever the last one did: {err:?}"
    );
    assert_eq!(provider.calls(), 3);
    assert_eq!(provider.effects(), 1);

    // The agent re-runs its step and regenerates the payload: refused, nothing sent.
    let err = client.clone().oneshot(post(REGENERATED)).await.unwrap_err();
    assert!(
        err.is_drift(),
        "{first:?}: the operation was released: {err:?}"
    );
    assert_eq!(
        provider.calls(),
        3,
        "{first:?}: the regenerated payload was sent"
    );

    // The same step, once the provider is back: the frozen bytes, the provider's answer.
    let res = client.oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(source(&res), ResponseSource::Resent, "{first:?}");
    assert_eq!(res.status(), StatusCode::CREATED);
    assert_eq!(provider.effects(), 1, "{first:?}: charged twice");
    for attempt in provider.attempts() {
        assert_eq!(&attempt.body()[..], ORIGINAL.as_bytes());
    }
}

#[tokio::test(start_paused = true)]
async fn memory_a_sent_attempt_then_refused_retries_never_releases_the_operation() {
    for first in [
        Fault::ServerError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            commit: true,
        },
        Fault::CommitThenTimeout,
    ] {
        for built in [true, false] {
            let store = Arc::new(MemoryStore::new());
            sent_then_refused_stays_in_doubt(store, first.clone(), built).await;
        }
    }
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_a_sent_attempt_then_refused_retries_never_releases_the_operation() {
    let Some(redis) = redis_support::redis_url().await else {
        return;
    };
    for (n, first) in [
        Fault::ServerError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            commit: true,
        },
        Fault::CommitThenTimeout,
    ]
    .into_iter()
    .enumerate()
    {
        for built in [true, false] {
            let store = tower_idempotency::ledger::RedisStore::builder(redis.url())
                .prefix(format!("seams:sent:{}:{n}:{built}:", std::process::id()))
                .connect()
                .await
                .unwrap();
            sent_then_refused_stays_in_doubt(Arc::new(store), first.clone(), built).await;
        }
    }
}

#[tokio::test(start_paused = true)]
async fn the_retry_layer_alone_reports_a_sticky_phase() {
    let provider = SideEffectService::new().with_faults([
        Fault::ServerError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            commit: false,
        },
        Fault::RefuseBeforeSend,
        Fault::RefuseBeforeSend,
    ]);
    let client = ServiceBuilder::new()
        .layer(FrozenRetryLayer::new(fast_policy(Duration::from_secs(1))))
        .service(provider.clone());
    let get = Request::get("http://inventory.local/stock")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let err = client.oneshot(get).await.unwrap_err();
    assert_eq!(err.phase(), Some(FailurePhase::AfterWrite), "{err:?}");
}

// ---------------------------------------------------------------------------------------
// Defect 6: the retry layer sends what it is handed
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_layer_between_the_two_keeps_its_change_on_every_attempt() {
    let provider = SideEffectService::new().with_faults([Fault::ServerError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        commit: false,
    }]);
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .map_request(|mut req: Request<Full<Bytes>>| {
            req.headers_mut().insert(
                http::header::AUTHORIZATION,
                HeaderValue::from_static("Bearer sk_test_1"),
            );
            req
        })
        .layer(FrozenRetryLayer::new(fast_policy(Duration::from_secs(1))))
        .service(provider.clone());
    let res = client.oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    let attempts = provider.attempts();
    assert_eq!(attempts.len(), 2);
    for attempt in &attempts {
        assert_eq!(
            attempt.headers().get(http::header::AUTHORIZATION),
            Some(&HeaderValue::from_static("Bearer sk_test_1")),
            "the middle layer's header was thrown away"
        );
        assert_eq!(attempt.headers(), attempts[0].headers());
        assert_eq!(attempt.body(), attempts[0].body());
    }
}

#[tokio::test(start_paused = true)]
async fn a_layer_between_the_two_that_only_recases_the_host_is_kept_on_every_attempt() {
    // `Uri`'s `==` compares hosts without case: taken for the request the idempotency layer
    // froze, this one would go out once as handed and be retried as first frozen.
    let provider = SideEffectService::new().with_faults([Fault::ServerError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        commit: false,
    }]);
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .map_request(|mut req: Request<Full<Bytes>>| {
            *req.uri_mut() = "http://ORDERS.local/orders".parse().unwrap();
            req
        })
        .layer(FrozenRetryLayer::new(fast_policy(Duration::from_secs(1))))
        .service(provider.clone());
    let res = client.oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    let attempts = provider.attempts();
    assert_eq!(attempts.len(), 2);
    for attempt in &attempts {
        assert_eq!(
            attempt.uri().to_string(),
            "http://ORDERS.local/orders",
            "an attempt went out with the host as first frozen, not as handed"
        );
        assert_eq!(attempt.headers(), attempts[0].headers());
        assert_eq!(attempt.body(), attempts[0].body());
    }
}

// ---------------------------------------------------------------------------------------
// Defect 7: ResendFrozen never sends the regenerated bytes
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn resend_frozen_sends_the_first_bytes_even_when_the_owner_releases_meanwhile() {
    let store = Arc::new(MemoryStore::new());
    // Another caller owns the operation with the original bytes, marked so we can tell.
    let mut headers = http::HeaderMap::new();
    headers.insert("x-frozen-by", HeaderValue::from_static("first-owner"));
    let original = FrozenRequest::from_parts(
        Method::POST,
        ORDERS.parse().unwrap(),
        http::Version::HTTP_11,
        headers,
        Bytes::from_static(ORIGINAL.as_bytes()),
    );
    let key = LedgerKey::for_operation(op().key(""));
    let claim = BeginRequest::new(
        key,
        original.fingerprint(),
        Duration::from_secs(10),
        Duration::from_secs(3600),
    )
    .with_frozen(original.clone());
    let Begin::Acquired { token } = store.begin(claim).await.unwrap() else {
        panic!("the first owner claims the operation");
    };

    let provider = SideEffectService::new();
    let client = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(store.clone())
                .provider_deduplicates(true)
                .key_header(KeyHeader::ietf())
                .drift_policy(DriftPolicy::ResendFrozen)
                .busy_policy(BusyPolicy::Wait(Duration::from_secs(30)))
                .build()
                .unwrap(),
        )
        .layer(FrozenRetryLayer::new(fast_policy(Duration::from_secs(1))))
        .service(provider.clone());
    let waiting = tokio::spawn(client.oneshot(post(REGENERATED)));
    tokio::time::sleep(Duration::from_secs(1)).await;
    // The first owner's attempt failed before writing: it releases the operation.
    store.abandon(key, token).await.unwrap();

    let res = waiting.await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    let attempts = provider.attempts();
    assert_eq!(attempts.len(), 1);
    assert_eq!(
        &attempts[0].body()[..],
        ORIGINAL.as_bytes(),
        "ResendFrozen sent the regenerated bytes"
    );
    assert_eq!(attempts[0].headers()["x-frozen-by"], "first-owner");
}

// ---------------------------------------------------------------------------------------
// Defect 8: a caller's own key never answers for another target
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_callers_own_key_sent_to_two_hosts_is_two_operations() {
    let provider = SideEffectService::builder().honour_keys(false).build();
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Ignored,
            KeyHeader::ietf(),
        ))
        .layer(FrozenRetryLayer::new(fast_policy(Duration::from_secs(1))))
        .service(provider.clone());
    let to = |host: &str| {
        Request::post(format!("http://{host}/v1/orders"))
            .header("authorization", "Bearer sk_test")
            .header("idempotency-key", "\"order-42\"")
            .body(Full::new(Bytes::from_static(b"{\"order\":42}")))
            .unwrap()
    };
    let payments = client
        .clone()
        .oneshot(to("payments.example"))
        .await
        .unwrap();
    let shipping = client
        .clone()
        .oneshot(to("shipping.example"))
        .await
        .unwrap();
    assert_eq!(source(&payments), ResponseSource::Sent);
    assert_eq!(
        source(&shipping),
        ResponseSource::Sent,
        "shipping was answered with the payments record"
    );
    assert_eq!(provider.effects(), 2);
    // Each target replays its own.
    let again = client.oneshot(to("shipping.example")).await.unwrap();
    assert_eq!(source(&again), ResponseSource::Replayed);
    assert_eq!(body_of(again).await, body_of(shipping).await);
}

// ---------------------------------------------------------------------------------------
// Review II, hole 1: a caller's own key never answers for another credential
// ---------------------------------------------------------------------------------------

/// A platform sends two merchants' calls through one client layer, each under the
/// merchant's own API key, both keyed `order-1001-charge` with the same target and body:
/// merchant B's charge is sent (never answered with A's record), each replays its own, and
/// a key sent without a credential is refused unless the layer names the principal.
#[tokio::test(start_paused = true)]
async fn a_callers_own_key_sent_under_two_credentials_is_two_operations() {
    let provider = SideEffectService::builder().honour_keys(false).build();
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Ignored,
            KeyHeader::ietf(),
        ))
        .layer(FrozenRetryLayer::new(fast_policy(Duration::from_secs(1))))
        .service(provider.clone());
    let charge = |credential: Option<&str>| {
        let mut req = Request::post("http://payments.example/v1/charges")
            .header("idempotency-key", "\"order-1001-charge\"");
        if let Some(credential) = credential {
            req = req.header("authorization", credential);
        }
        req.body(Full::new(Bytes::from_static(b"{\"amount\":1999}")))
            .unwrap()
    };
    let a = client
        .clone()
        .oneshot(charge(Some("Bearer sk_merchant_a")))
        .await
        .unwrap();
    let b = client
        .clone()
        .oneshot(charge(Some("Bearer sk_merchant_b")))
        .await
        .unwrap();
    assert_eq!(source(&a), ResponseSource::Sent);
    assert_eq!(
        source(&b),
        ResponseSource::Sent,
        "merchant B was answered with merchant A's charge"
    );
    assert_eq!(provider.effects(), 2, "each merchant's charge was sent");
    let again = client
        .clone()
        .oneshot(charge(Some("Bearer sk_merchant_b")))
        .await
        .unwrap();
    assert_eq!(source(&again), ResponseSource::Replayed);
    assert_eq!(body_of(again).await, body_of(b).await);

    // No credential to scope the key by: refused before anything is sent.
    let err = client.clone().oneshot(charge(None)).await.unwrap_err();
    assert!(err.is_missing_scope(), "{err}");
    assert_eq!(provider.calls(), 2);

    // The same rule's opt-outs: a principal named by the user, or one namespace for all.
    let by_tenant = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(MemoryStore::new())
                .provider_deduplicates(true)
                .key_header(KeyHeader::ietf())
                .caller_key_scope(|parts| {
                    let tenant = parts.headers.get("x-tenant").map(|v| v.as_bytes());
                    String::from_utf8_lossy(tenant.unwrap_or_default()).into_owned()
                })
                .build()
                .unwrap(),
        )
        .service(provider.clone());
    let mut keyed = charge(None);
    keyed
        .headers_mut()
        .insert("x-tenant", HeaderValue::from_static("t1"));
    let first = by_tenant.clone().oneshot(keyed).await.unwrap();
    assert_eq!(source(&first), ResponseSource::Sent);
    let mut other = charge(None);
    other
        .headers_mut()
        .insert("x-tenant", HeaderValue::from_static("t2"));
    let second = by_tenant.oneshot(other).await.unwrap();
    assert_eq!(source(&second), ResponseSource::Sent);
    let unscoped = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(MemoryStore::new())
                .provider_deduplicates(true)
                .key_header(KeyHeader::ietf())
                .caller_keys_unscoped()
                .build()
                .unwrap(),
        )
        .service(provider.clone());
    let first = unscoped
        .clone()
        .oneshot(charge(Some("Bearer sk_merchant_a")))
        .await
        .unwrap();
    assert_eq!(source(&first), ResponseSource::Sent);
    let shared = unscoped
        .oneshot(charge(Some("Bearer sk_merchant_b")))
        .await
        .unwrap();
    assert_eq!(
        source(&shared),
        ResponseSource::Replayed,
        "unscoped, by choice"
    );
}

#[tokio::test(start_paused = true)]
async fn an_operation_id_sent_to_another_target_is_a_drift_never_a_replay() {
    let provider = SideEffectService::new();
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .layer(FrozenRetryLayer::new(fast_policy(Duration::from_secs(1))))
        .service(provider.clone());
    client.clone().oneshot(post(ORIGINAL)).await.unwrap();
    let mut elsewhere = post(ORIGINAL);
    *elsewhere.uri_mut() = "http://orders-eu.local/orders".parse().unwrap();
    let err = client.oneshot(elsewhere).await.unwrap_err();
    assert!(err.is_drift(), "{err:?}");
    assert_eq!(provider.calls(), 1);
}

// ---------------------------------------------------------------------------------------
// Defect 11: a cancelled settle still settles
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_caller_dropped_while_its_outcome_is_recorded_still_records_it() {
    let store = FlakyStore::new(MemoryStore::new());
    store
        .faults
        .complete_delay_ms
        .store(5_000, Ordering::SeqCst);
    let provider = SideEffectService::new();
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            store.clone(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .layer(FrozenRetryLayer::new(fast_policy(Duration::from_secs(1))))
        .service(provider.clone());
    // The caller gives up while `complete` is under way.
    let gave_up = tokio::time::timeout(
        Duration::from_secs(1),
        client.clone().oneshot(post(ORIGINAL)),
    );
    assert!(gave_up.await.is_err());
    store.faults.complete_delay_ms.store(0, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(6)).await;

    let started = tokio::time::Instant::now();
    let res = client.oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(
        source(&res),
        ResponseSource::Replayed,
        "the dropped caller's outcome was not recorded"
    );
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "the key was held"
    );
    assert_eq!(provider.calls(), 1);
}

// ---------------------------------------------------------------------------------------
// Defect 13: only an "in progress" 409 is a try-again
// ---------------------------------------------------------------------------------------

fn conflict_provider(
    retry_after: Option<&'static str>,
    calls: Arc<AtomicUsize>,
) -> impl tower::Service<
    Request<Full<Bytes>>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future = impl Send,
> + Clone
       + Send {
    service_fn(move |_req: Request<Full<Bytes>>| {
        calls.fetch_add(1, Ordering::SeqCst);
        async move {
            let mut res = Response::builder().status(StatusCode::CONFLICT);
            if let Some(after) = retry_after {
                res = res.header("retry-after", after);
            }
            Ok::<_, Infallible>(
                res.body(Full::new(Bytes::from_static(
                    b"{\"error\":\"order_exists\"}",
                )))
                .unwrap(),
            )
        }
    })
}

#[tokio::test(start_paused = true)]
async fn a_business_409_is_a_final_recorded_outcome() {
    let calls = Arc::new(AtomicUsize::new(0));
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .layer(FrozenRetryLayer::new(fast_policy(Duration::from_secs(1))))
        .service(conflict_provider(None, calls.clone()));
    let first = client.clone().oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(first.status(), StatusCode::CONFLICT);
    let again = client.oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(source(&again), ResponseSource::Replayed);
    assert_eq!(again.status(), StatusCode::CONFLICT);
    assert_eq!(calls.load(Ordering::SeqCst), 1, "a final 409 was resent");
}

#[tokio::test(start_paused = true)]
async fn an_in_progress_409_leaves_the_operation_open() {
    let calls = Arc::new(AtomicUsize::new(0));
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .layer(FrozenRetryLayer::new(fast_policy(Duration::from_secs(1))))
        .service(conflict_provider(Some("1"), calls.clone()));
    let err = client.clone().oneshot(post(ORIGINAL)).await.unwrap_err();
    assert!(
        err.is_key_in_use() && err.is_in_doubt(),
        "not a final answer: {err}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 3, "retried inside");
    // Open, not recorded: the next run resends the frozen bytes rather than replaying.
    let again = client.oneshot(post(ORIGINAL)).await.unwrap_err();
    assert!(again.is_key_in_use(), "{again}");
    assert_eq!(calls.load(Ordering::SeqCst), 6, "resent, not replayed");
}

// ---------------------------------------------------------------------------------------
// Defect 14: a live owner keeps its lease (client face)
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn a_slow_live_client_owner_is_never_overtaken() {
    let store = Arc::new(MemoryStore::new());
    let provider = SideEffectService::new().with_faults([Fault::Latency(Duration::from_secs(20))]);
    let layer = |busy| {
        IdempotencyLayer::client_builder(store.clone())
            .provider_deduplicates(true)
            .key_header(KeyHeader::ietf())
            .lease(Duration::from_secs(3))
            .busy_policy(busy)
            .build()
            .unwrap()
    };
    // The default policy has no per-attempt timeout: one attempt may outlast many leases.
    let slow = ServiceBuilder::new()
        .layer(layer(BusyPolicy::Fail))
        .layer(FrozenRetryLayer::new(RetryPolicy::default()))
        .service(provider.clone());
    let first = tokio::spawn(slow.clone().oneshot(post(ORIGINAL)));
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let err = slow.clone().oneshot(post(ORIGINAL)).await.unwrap_err();
    assert!(
        err.is_busy(),
        "a second caller took over a live owner: {err:?}"
    );
    let first = first.await.unwrap().unwrap();
    assert_eq!(source(&first), ResponseSource::Sent);
    let replay = slow.oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(source(&replay), ResponseSource::Replayed);
    assert_eq!(provider.calls(), 1);
}

// ---------------------------------------------------------------------------------------
// The server face: routers, scopes, probes, and a ledger that loses answers
// ---------------------------------------------------------------------------------------

/// A handler that counts its runs and answers with the run number and the path it saw.
fn counting_handler(
    runs: Arc<AtomicUsize>,
) -> impl Fn(http::Uri) -> std::future::Ready<(StatusCode, String)> + Clone + Send + Sync + 'static
{
    move |uri: http::Uri| {
        let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
        std::future::ready((
            StatusCode::CREATED,
            format!("{{\"run\":{n},\"path\":\"{uri}\"}}"),
        ))
    }
}

fn keyed(method: Method, path: &str, key: &str, body: &'static str) -> Request<Body> {
    Request::builder()
        .method(method)
        .uri(path)
        .header("authorization", "Bearer alice")
        .header("idempotency-key", format!("\"{key}\""))
        .body(Body::from(body))
        .unwrap()
}

async fn answer(app: &Router, req: Request<Body>) -> (StatusCode, Option<String>, String) {
    let res = app.clone().oneshot(req).await.unwrap();
    let status = res.status();
    let replayed = res
        .headers()
        .get("idempotent-replayed")
        .map(|v| v.to_str().unwrap().to_owned());
    let body = String::from_utf8(body_of(res).await.to_vec()).unwrap();
    (status, replayed, body)
}

fn problem_type(body: &str) -> String {
    let value: serde_json::Value = serde_json::from_str(body).unwrap();
    value["type"].as_str().unwrap_or_default().to_owned()
}

/// What makes the nested test below pass is the `axum` feature (`OriginalUri`): without it,
/// `/accounts/2/charges` reads as `/accounts/1/charges` and is answered with account 1's
/// record. A server layer built from a plain `tower-idempotency = "0.1"` must have it, so
/// it is among the default features.
#[test]
fn the_feature_that_reads_the_nested_path_is_on_by_default() {
    let manifest = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml"));
    let default = manifest
        .lines()
        .find(|line| line.starts_with("default = ["))
        .expect("a default feature set");
    assert!(default.contains("\"axum\""), "{default}");
}

/// Defect 2, over loopback TCP: behind `Router::nest`, the layer sees `/charges` for every
/// account; it must judge `/accounts/1/charges` and `/accounts/2/charges` apart.
#[tokio::test]
async fn nested_routers_never_replay_another_resources_response() {
    let runs = Arc::new(AtomicUsize::new(0));
    let account = Router::new()
        .route("/charges", route_post(counting_handler(runs.clone())))
        .layer(IdempotencyLayer::server(MemoryStore::new()));
    let app = Router::new().nest("/accounts/{id}", account);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let charge = |account: u32, key: &str| {
        Request::post(format!("http://{addr}/accounts/{account}/charges"))
            .header("authorization", "Bearer alice")
            .header("idempotency-key", format!("\"{key}\""))
            .body(Full::new(Bytes::from_static(b"{\"amount_cents\":1999}")))
            .unwrap()
    };
    let first = client.request(charge(1, "k")).await.unwrap();
    assert_eq!(first.status(), StatusCode::CREATED);
    let other = client.request(charge(2, "k")).await.unwrap();
    assert!(
        other.headers().get("idempotent-replayed").is_none(),
        "account 2 was answered with account 1's charge"
    );
    assert_eq!(other.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        problem_type(std::str::from_utf8(&body_of(other).await).unwrap()),
        problem::PAYLOAD_MISMATCH
    );
    // Its own retry still replays its own charge; a new key charges account 2.
    let retry = client.request(charge(1, "k")).await.unwrap();
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    let account_2 = client.request(charge(2, "k2")).await.unwrap();
    assert_eq!(account_2.status(), StatusCode::CREATED);
    assert!(String::from_utf8(body_of(account_2).await.to_vec())
        .unwrap()
        .contains("/charges"));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// Defect 3: one key is one request; reused with another method or path it is a 422.
#[tokio::test]
async fn the_same_key_on_another_method_or_path_is_a_mismatch_never_a_second_run() {
    let runs = Arc::new(AtomicUsize::new(0));
    let handler = counting_handler(runs.clone());
    let app = Router::new()
        .route(
            "/orders/{id}",
            route_post(handler.clone()).merge(patch(handler)),
        )
        .route_layer(IdempotencyLayer::server(MemoryStore::new()));
    let (status, _, _) = answer(&app, keyed(Method::POST, "/orders/1", "k", "{}")).await;
    assert_eq!(status, StatusCode::CREATED);
    for (method, path) in [(Method::PATCH, "/orders/1"), (Method::POST, "/orders/2")] {
        let (status, replayed, body) = answer(&app, keyed(method.clone(), path, "k", "{}")).await;
        assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{method} {path}");
        assert_eq!(replayed, None);
        assert_eq!(problem_type(&body), problem::PAYLOAD_MISMATCH);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Defect 9: no silent shared scope for requests without a principal.
#[tokio::test]
async fn keyed_requests_without_a_principal_are_refused_unless_scoped_explicitly() {
    let runs = Arc::new(AtomicUsize::new(0));
    let cookie = |who: &str| {
        Request::post("/charges")
            .header("cookie", format!("session={who}"))
            .header("idempotency-key", "\"alice-charge-1\"")
            .body(Body::from("{\"amount_cents\":1999}"))
            .unwrap()
    };
    let default = Router::new()
        .route("/charges", route_post(counting_handler(runs.clone())))
        .route_layer(IdempotencyLayer::server(MemoryStore::new()));
    for who in ["alice", "bob"] {
        let (status, _, body) = answer(&default, cookie(who)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST);
        assert_eq!(problem_type(&body), problem::SCOPE_MISSING);
    }
    assert_eq!(runs.load(Ordering::SeqCst), 0);

    // With the session as the scope, Bob sending Alice's key runs his own charge.
    let scoped = Router::new()
        .route("/charges", route_post(counting_handler(runs.clone())))
        .route_layer(
            IdempotencyLayer::server_builder(MemoryStore::new())
                .scope(|parts| {
                    parts
                        .headers
                        .get("cookie")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_owned()
                })
                .build()
                .unwrap(),
        );
    let (alice, _, alice_body) = answer(&scoped, cookie("alice")).await;
    let (bob, bob_replayed, bob_body) = answer(&scoped, cookie("bob")).await;
    assert_eq!((alice, bob), (StatusCode::CREATED, StatusCode::CREATED));
    assert_eq!(bob_replayed, None, "Bob was served Alice's response");
    assert_ne!(alice_body, bob_body);
}

/// Defects 4 and 5 on the server: one tenant's traffic never evicts another's protected
/// outcome; a budget full of protected records refuses new keys with 503.
#[tokio::test(start_paused = true)]
async fn one_tenants_traffic_never_makes_another_tenants_charge_run_twice() {
    let store = MemoryStore::builder().max_bytes(64 * 1024).build();
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route("/charges", route_post(counting_handler(runs.clone())))
        .route_layer(
            IdempotencyLayer::server_builder(store.clone())
                .scope(|parts| {
                    parts
                        .headers
                        .get("x-tenant")
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or("")
                        .to_owned()
                })
                .protected_window(Duration::from_secs(60))
                .build()
                .unwrap(),
        );
    let as_tenant = |tenant: &str, key: String| {
        Request::post("/charges")
            .header("x-tenant", tenant)
            .header("idempotency-key", format!("\"{key}\""))
            .body(Body::from("{\"amount_cents\":1999}"))
            .unwrap()
    };
    let (status, _, a_body) = answer(&app, as_tenant("a", "a-1".into())).await;
    assert_eq!(status, StatusCode::CREATED);

    // Tenant B's ordinary traffic, until the budget is full of protected records.
    let mut refused = None;
    for n in 0..10_000 {
        let res = app
            .clone()
            .oneshot(as_tenant("b", format!("b-{n}")))
            .await
            .unwrap();
        assert!(store.weighted_size() <= store.max_bytes());
        if res.status() == StatusCode::SERVICE_UNAVAILABLE {
            assert!(res.headers().contains_key("retry-after"));
            let body = String::from_utf8(body_of(res).await.to_vec()).unwrap();
            assert_eq!(problem_type(&body), problem::LEDGER_FULL);
            refused = Some(n);
            break;
        }
        assert_eq!(res.status(), StatusCode::CREATED);
    }
    let refused = refused.expect("a full budget refuses new keys");
    assert!(refused > 10, "refused after {refused}");
    assert_eq!(runs.load(Ordering::SeqCst), 1 + refused);
    assert_eq!(store.evictions(), 0);
    // B was refused once protected records reached the high-water mark, past its share:
    // the rest of the budget stays for the other tenants.
    assert!(store.weighted_size() < store.max_bytes());

    // A's retry, seconds later: its outcome, not a second charge.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let (status, replayed, body) = answer(&app, as_tenant("a", "a-1".into())).await;
    assert_eq!(
        (status, replayed.as_deref()),
        (StatusCode::CREATED, Some("true"))
    );
    assert_eq!(body, a_body);

    // Past the protected window the pressure is gone, and B is served again.
    tokio::time::sleep(Duration::from_secs(60)).await;
    let (status, _, _) = answer(&app, as_tenant("b", "b-late".into())).await;
    assert_eq!(status, StatusCode::CREATED);
}

/// Defects 4 and 5 on the client: open records count; a full budget refuses new operations
/// with a typed error and sends nothing; no in-doubt record is lost.
#[tokio::test(start_paused = true)]
async fn a_provider_outage_cannot_grow_the_client_ledger_past_its_budget() {
    const BUDGET: u64 = 256 * 1024;
    let store = MemoryStore::builder().max_bytes(BUDGET).build();
    // During the outage every attempt answers 503 (nothing committed).
    let outage = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let calls = Arc::new(AtomicUsize::new(0));
    let provider = SideEffectService::new();
    let flaky = service_fn({
        let (outage, calls, provider) = (outage.clone(), calls.clone(), provider.clone());
        move |req: Request<Full<Bytes>>| {
            calls.fetch_add(1, Ordering::SeqCst);
            let (down, provider) = (outage.load(Ordering::SeqCst), provider.clone());
            async move {
                if down {
                    let res = Response::builder()
                        .status(503)
                        .body(Full::new(Bytes::new()));
                    return Ok(res.unwrap());
                }
                let res = provider.oneshot(req).await?;
                Ok::<_, tower_idempotency::BoxError>(res)
            }
        }
    });
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            store.clone(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .layer(FrozenRetryLayer::new(fast_policy(Duration::from_secs(1))))
        .service(flaky);
    let body = Bytes::from(vec![b'x'; 10 * 1024]);
    let charge = |n: u32| {
        let mut req = Request::post(ORDERS).body(Full::new(body.clone())).unwrap();
        req.extensions_mut()
            .insert(OperationId::new("outage", n.to_string()));
        req
    };
    let mut in_doubt = Vec::new();
    let mut refused = 0;
    for n in 0..100 {
        let calls_before = calls.load(Ordering::SeqCst);
        match client.clone().oneshot(charge(n)).await {
            Ok(res) => {
                assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
                in_doubt.push(n);
            }
            Err(err) => {
                assert!(err.is_ledger_full(), "{err:?}");
                // What a caller printing the error reads: the cause, and that nothing ran.
                let message = err.to_string();
                assert!(
                    message.starts_with("the idempotency ledger is full")
                        && message.contains("the operation was not started"),
                    "{message}"
                );
                assert_eq!(
                    calls.load(Ordering::SeqCst),
                    calls_before,
                    "sent without a record"
                );
                refused += 1;
            }
        }
        assert!(store.weighted_size() <= BUDGET, "{}", store.weighted_size());
    }
    assert!(refused > 0, "100 × 10 KiB in doubt fit a 256 KiB budget?");
    assert!(!in_doubt.is_empty());
    // The provider is back: every in-doubt operation resumes with its own frozen bytes.
    outage.store(false, Ordering::SeqCst);
    for n in &in_doubt {
        let res = client.clone().oneshot(charge(*n)).await.unwrap();
        assert_eq!(source(&res), ResponseSource::Resent, "operation {n}");
    }
    assert_eq!(provider.effects(), in_doubt.len());
}

/// Defect 10: probing an in-doubt key never extends its life.
#[tokio::test(start_paused = true)]
async fn probes_of_an_in_doubt_key_never_extend_it() {
    let store = MemoryStore::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let retention = Duration::from_secs(10 * 60);
    let app = Router::new()
        .route("/charges", route_post(counting_handler(runs.clone())))
        .route_layer(
            IdempotencyLayer::server_builder(store.clone())
                .scope(|_| "t".to_owned())
                .retention(retention)
                .build()
                .unwrap(),
        );
    // A replica claimed the key and died mid-handler.
    let key = LedgerKey::server("t", "k");
    let fingerprint = Fingerprint::of(&Method::POST, "/charges", b"{}");
    let claim = BeginRequest::new(key, fingerprint, Duration::from_secs(10), retention);
    store.begin(claim).await.unwrap();
    tokio::time::sleep(Duration::from_secs(11)).await;

    // The client keeps retrying, once a minute, for nine minutes.
    for _ in 0..9 {
        let (status, _, body) = answer(&app, keyed(Method::POST, "/charges", "k", "{}")).await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(problem_type(&body), problem::OUTCOME_UNKNOWN);
        tokio::time::sleep(Duration::from_secs(60)).await;
    }
    // Ten minutes after the claim, its retention is over, probes or not.
    tokio::time::sleep(Duration::from_secs(50)).await;
    let (status, _, _) = answer(&app, keyed(Method::POST, "/charges", "k", "{}")).await;
    assert_eq!(status, StatusCode::CREATED, "the probes kept the key alive");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

// ---------------------------------------------------------------------------------------
// Defects 15 and 16: the engine resolves lost answers, on every store
// ---------------------------------------------------------------------------------------

fn server_on(store: FlakyStore, runs: Arc<AtomicUsize>) -> Router {
    Router::new()
        .route("/charges", route_post(counting_handler(runs)))
        .route_layer(IdempotencyLayer::server(store))
}

async fn a_begin_whose_reply_is_lost_is_recognised(store: FlakyStore) {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = server_on(store.clone(), runs.clone());
    let key = format!("lost-begin-{}", fastrand::u64(..));
    store.faults.lost_begin_replies.store(1, Ordering::SeqCst);
    let (status, _, first) = answer(&app, keyed(Method::POST, "/charges", &key, "{}")).await;
    assert_eq!(status, StatusCode::CREATED, "{first}");
    let (status, replayed, again) = answer(&app, keyed(Method::POST, "/charges", &key, "{}")).await;
    assert_eq!(
        (status, replayed.as_deref()),
        (StatusCode::CREATED, Some("true"))
    );
    assert_eq!(again, first);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

async fn a_begin_that_never_got_an_answer_leaves_the_key_runnable(store: FlakyStore) {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = server_on(store.clone(), runs.clone());
    let key = format!("no-answer-{}", fastrand::u64(..));
    store.faults.lost_begin_replies.store(3, Ordering::SeqCst);
    let (status, _, body) = answer(&app, keyed(Method::POST, "/charges", &key, "{}")).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    // The ledger is back; the claim nobody holds is released in the background.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (status, replayed, body) = answer(&app, keyed(Method::POST, "/charges", &key, "{}")).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, None), "{body}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

async fn a_lost_completion_write_is_retried_inside_the_lease(store: FlakyStore) {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = server_on(store.clone(), runs.clone());
    let key = format!("lost-complete-{}", fastrand::u64(..));
    store.faults.failed_completes.store(2, Ordering::SeqCst);
    let (status, _, first) = answer(&app, keyed(Method::POST, "/charges", &key, "{}")).await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, replayed, again) = answer(&app, keyed(Method::POST, "/charges", &key, "{}")).await;
    assert_eq!(
        (status, replayed.as_deref()),
        (StatusCode::CREATED, Some("true")),
        "{again}"
    );
    assert_eq!(again, first);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

#[tokio::test(start_paused = true)]
async fn memory_lost_ledger_answers_resolve() {
    a_begin_whose_reply_is_lost_is_recognised(FlakyStore::new(MemoryStore::new())).await;
    a_begin_that_never_got_an_answer_leaves_the_key_runnable(FlakyStore::new(MemoryStore::new()))
        .await;
    a_lost_completion_write_is_retried_inside_the_lease(FlakyStore::new(MemoryStore::new())).await;
}

/// The same faults from a store that answers in place: the layers take its answers outside
/// their retrying path, and a lost one must count as the first try of that path (three
/// lost `begin` replies are the engine's three tries, not a fourth that succeeds).
#[tokio::test(start_paused = true)]
async fn in_place_lost_ledger_answers_resolve() {
    a_begin_whose_reply_is_lost_is_recognised(FlakyStore::in_place(MemoryStore::new())).await;
    a_begin_that_never_got_an_answer_leaves_the_key_runnable(FlakyStore::in_place(
        MemoryStore::new(),
    ))
    .await;
    a_lost_completion_write_is_retried_inside_the_lease(FlakyStore::in_place(MemoryStore::new()))
        .await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn redis_lost_ledger_answers_resolve() {
    let Some(redis) = redis_support::redis_url().await else {
        return;
    };
    let store = || async {
        FlakyStore::new(
            tower_idempotency::ledger::RedisStore::builder(redis.url())
                .prefix(format!(
                    "seams:lost:{}:{}:",
                    std::process::id(),
                    fastrand::u32(..)
                ))
                .connect()
                .await
                .unwrap(),
        )
    };
    a_begin_whose_reply_is_lost_is_recognised(store().await).await;
    a_begin_that_never_got_an_answer_leaves_the_key_runnable(store().await).await;
    a_lost_completion_write_is_retried_inside_the_lease(store().await).await;
}

/// The in-doubt policy still runs the handler again when asked to (at least once).
#[tokio::test(start_paused = true)]
async fn run_again_takes_an_in_doubt_key_over() {
    let store = MemoryStore::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route("/charges", route_post(counting_handler(runs.clone())))
        .route_layer(
            IdempotencyLayer::server_builder(store.clone())
                .scope(|_| "t".to_owned())
                .in_doubt_policy(InDoubtPolicy::RunAgain)
                .build()
                .unwrap(),
        );
    let key = LedgerKey::server("t", "k");
    let fingerprint = Fingerprint::of(&Method::POST, "/charges", b"{}");
    let claim = BeginRequest::new(
        key,
        fingerprint,
        Duration::from_secs(10),
        Duration::from_secs(3600),
    );
    store.begin(claim).await.unwrap();
    tokio::time::sleep(Duration::from_secs(11)).await;
    let (status, replayed, _) = answer(&app, keyed(Method::POST, "/charges", "k", "{}")).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, None));
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Over the wire, a client may send the request target in origin form (`POST /charges`) or,
/// as through a proxy, in absolute form (`POST http://host/charges`): one resource, one
/// request (RFC 9112 §3.2.2), so the retry is a replay, not a mismatch.
#[tokio::test]
async fn a_retry_in_absolute_form_replays_the_origin_form_request() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route("/charges", route_post(counting_handler(runs.clone())))
        .route_layer(IdempotencyLayer::server(MemoryStore::new()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let send = |target: String| async move {
        let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
        let request = format!(
            "POST {target} HTTP/1.1\r\nhost: {addr}\r\nauthorization: Bearer alice\r\n\
             idempotency-key: \"k\"\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}"
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        let mut answer = String::new();
        stream.read_to_string(&mut answer).await.unwrap();
        answer
    };
    let first = send("/charges".to_owned()).await;
    assert!(first.starts_with("HTTP/1.1 201"), "{first}");
    let again = send(format!("http://{addr}/charges")).await;
    assert!(again.starts_with("HTTP/1.1 201"), "{again}");
    assert!(
        again
            .to_ascii_lowercase()
            .contains("idempotent-replayed: true"),
        "{again}"
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Defect 5's last hidden bytes: hyper hands out header values (and bodies) as slices of its
/// read buffer. A recorded response must own exact-size copies, or each record would keep a
/// whole transport buffer alive, unseen by the store's budget.
#[tokio::test(start_paused = true)]
async fn a_recorded_response_keeps_no_transport_buffer_alive() {
    let read_buffer = Bytes::from(vec![b'a'; 8192]);
    let range = read_buffer.as_ptr() as usize..read_buffer.as_ptr() as usize + read_buffer.len();
    let provider = service_fn({
        let read_buffer = read_buffer.clone();
        move |_req: Request<Full<Bytes>>| {
            let value = HeaderValue::from_maybe_shared(read_buffer.slice(0..16)).unwrap();
            let body = read_buffer.slice(16..64);
            async move {
                let mut res = Response::new(Full::new(body));
                *res.status_mut() = StatusCode::CREATED;
                res.headers_mut().insert("x-charge-id", value);
                Ok::<_, Infallible>(res)
            }
        }
    });
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .service(provider);
    client.clone().oneshot(post(ORIGINAL)).await.unwrap();
    let replay = client.oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(source(&replay), ResponseSource::Replayed);
    let value = replay.headers()["x-charge-id"].as_bytes();
    assert_eq!(value, &b"aaaaaaaaaaaaaaaa"[..]);
    assert!(
        !range.contains(&(value.as_ptr() as usize)),
        "the header pins the read buffer"
    );
    let body = body_of(replay).await;
    assert_eq!(body.len(), 48);
    assert!(
        !range.contains(&(body.as_ptr() as usize)),
        "the body pins the read buffer"
    );
}

// ---------------------------------------------------------------------------------------
// The client stack as one piece, and the mistakes it prevents or reports
// ---------------------------------------------------------------------------------------

#[tokio::test(start_paused = true)]
async fn the_stack_builder_stacks_in_order_and_shares_its_settings() {
    let provider = SideEffectService::new().with_faults([Fault::CommitThenTimeout]);
    let stack = IdempotencyLayer::client_builder(MemoryStore::new())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .retry_policy(fast_policy(Duration::from_secs(1)))
        .body_limit(64)
        .build_stack()
        .unwrap();
    let client = ServiceBuilder::new().layer(stack).service(provider.clone());
    // The idempotency layer outside, the retry layer inside: one effect, the real answer.
    let mut small = Request::post(ORDERS)
        .body(Full::new(Bytes::from_static(b"{\"n\":1}")))
        .unwrap();
    small.extensions_mut().insert(op());
    let res = client.clone().oneshot(small).await.unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    assert_eq!(provider.effects(), 1);
    assert_eq!(provider.calls(), 2);
    // The body limit holds for the stack: nothing is sent over it.
    let err = client.oneshot(post(ORIGINAL)).await.unwrap_err();
    assert!(err.is_body_too_large(), "{err:?}");
    assert_eq!(provider.calls(), 2);
}

/// The kit's fault layer around a handler, inside the server layer: a handler that charges
/// then panics leaves its key in doubt (never run again by default); one that charges then
/// loses its answer to a 500 has that 500 recorded; a slow one makes its duplicate wait.
#[tokio::test(start_paused = true)]
async fn the_fault_layer_shows_what_a_handlers_failures_do_to_its_keys() {
    use tower_idempotency::testing::{FaultLayer, HandlerFault};
    let runs = Arc::new(AtomicUsize::new(0));
    let faults = FaultLayer::new().with_faults([
        HandlerFault::PanicAfterHandler,
        HandlerFault::FailAfterHandler(StatusCode::BAD_GATEWAY),
        HandlerFault::Delay(Duration::from_secs(2)),
    ]);
    let app = Router::new()
        .route("/charges", route_post(counting_handler(runs.clone())))
        .route_layer(faults.clone())
        .route_layer(IdempotencyLayer::server(MemoryStore::new()))
        .layer(tower_http::catch_panic::CatchPanicLayer::new());
    let charge = |key: &str| keyed(Method::POST, "/charges", key, "{}");

    let (status, _, _) = answer(&app, charge("panics")).await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    // The unwinding guard settles in a task of its own (nothing runs in place while a panic
    // unwinds): let it.
    tokio::task::yield_now().await;
    let (_, _, body) = answer(&app, charge("panics")).await;
    assert_eq!(problem_type(&body), problem::OUTCOME_UNKNOWN);

    let (status, _, _) = answer(&app, charge("lost-answer")).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    let (status, replayed, _) = answer(&app, charge("lost-answer")).await;
    assert_eq!(
        (status, replayed.as_deref()),
        (StatusCode::BAD_GATEWAY, Some("true"))
    );

    let slow = tokio::spawn({
        let app = app.clone();
        async move { answer(&app, charge("slow")).await }
    });
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (_, _, body) = answer(&app, charge("slow")).await;
    assert_eq!(problem_type(&body), problem::IN_FLIGHT);
    assert_eq!(slow.await.unwrap().0, StatusCode::CREATED);

    assert_eq!(runs.load(Ordering::SeqCst), 3, "each handler ran once");
    assert_eq!(faults.calls(), 3);
}

// ---------------------------------------------------------------------------------------
// A store away for less than the lease: a live owner's writes land while its lease holds
// ---------------------------------------------------------------------------------------

/// A store that is away (every call fails `unavailable` without applying) inside a window
/// of time, each call taking `call_time` to fail or apply, as calls to a Redis that is
/// restarting or frozen do.
#[derive(Clone, Debug)]
struct AwayStore {
    inner: MemoryStore,
    away: Arc<std::sync::Mutex<(tokio::time::Instant, tokio::time::Instant)>>,
    call_time: Duration,
}

impl AwayStore {
    /// Away from `from` to `until` after now.
    fn new(from: Duration, until: Duration, call_time: Duration) -> Self {
        let now = tokio::time::Instant::now();
        Self {
            inner: MemoryStore::new(),
            away: Arc::new(std::sync::Mutex::new((now + from, now + until))),
            call_time,
        }
    }

    /// Answer `call` (made when the call reaches the store, after its `call_time`), unless
    /// the store is away then.
    fn call<'a, T: Send + 'a>(
        &'a self,
        call: impl FnOnce(&'a MemoryStore) -> StoreFuture<'a, T> + Send + 'a,
    ) -> StoreFuture<'a, T> {
        StoreFuture::new(async move {
            tokio::time::sleep(self.call_time).await;
            let (from, until) = *self.away.lock().unwrap();
            let now = tokio::time::Instant::now();
            if from <= now && now < until {
                return Err(StoreError::unavailable("injected: the ledger is away"));
            }
            call(&self.inner).await
        })
    }
}

impl IdempotencyStore for AwayStore {
    fn begin(&self, request: BeginRequest) -> StoreFuture<'_, Begin> {
        self.call(move |inner| inner.begin(request))
    }

    fn complete(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        outcome: Outcome,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        self.call(move |inner| inner.complete(key, token, outcome, retention))
    }

    fn abandon(&self, key: LedgerKey, token: LeaseToken) -> StoreFuture<'_, ()> {
        self.call(move |inner| inner.abandon(key, token))
    }

    fn mark_in_doubt(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        self.call(move |inner| inner.mark_in_doubt(key, token, retention))
    }

    fn renew(&self, key: LedgerKey, token: LeaseToken, lease: Duration) -> StoreFuture<'_, ()> {
        self.call(move |inner| inner.renew(key, token, lease))
    }
}

/// A server over `store` with a 3 s lease, whose handler takes `work` and counts its runs.
fn slow_server(store: AwayStore, work: Duration, runs: Arc<AtomicUsize>) -> Router {
    let handler = move || {
        let runs = runs.clone();
        async move {
            tokio::time::sleep(work).await;
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            (StatusCode::CREATED, format!("{{\"run\":{n}}}"))
        }
    };
    Router::new()
        .route("/charges", route_post(handler))
        .route_layer(
            IdempotencyLayer::server_builder(store)
                .lease(Duration::from_secs(3))
                .build()
                .unwrap(),
        )
}

/// Reliability II, the chaos test's flake: the handler finished 100 ms into its 3 s lease,
/// the store went away and came back at 2.7 s. Its outcome must be recorded before the
/// lease ends, so a retry after the lease replays it: the completion's retries used to
/// back off to a second, give up a pause before their deadline, and leave the key to
/// expire into doubt (`500 outcome-unknown` for every retry) although the store was back.
#[tokio::test(start_paused = true)]
async fn a_finished_owner_records_its_outcome_when_the_store_is_back_within_the_lease() {
    let runs = Arc::new(AtomicUsize::new(0));
    let store = AwayStore::new(
        Duration::from_millis(50),
        Duration::from_millis(2700),
        Duration::ZERO,
    );
    let app = slow_server(store, Duration::from_millis(100), runs.clone());
    let first = tokio::spawn({
        let app = app.clone();
        async move { answer(&app, keyed(Method::POST, "/charges", "k", "{}")).await }
    });

    // Past the lease of the first claim: only a recorded outcome answers this one well.
    tokio::time::sleep(Duration::from_millis(3200)).await;
    let (status, replayed, again) = answer(&app, keyed(Method::POST, "/charges", "k", "{}")).await;
    assert_eq!(
        (status, replayed.as_deref()),
        (StatusCode::CREATED, Some("true")),
        "{again}"
    );
    let (status, _, first) = first.await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(again, first);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// Reliability II: a live owner whose renewal failed (the store away from 0.5 s to 2.5 s,
/// each call taking 100 ms) renews again as soon as the store is back, inside its 3 s
/// lease. A retry at 3.1 s must find it busy, not in doubt: renewals used to be retried a
/// third of a lease after each failure, the third one after the lease had run out.
#[tokio::test(start_paused = true)]
async fn a_live_owner_renews_its_lease_when_the_store_is_back_within_it() {
    let runs = Arc::new(AtomicUsize::new(0));
    let store = AwayStore::new(
        Duration::from_millis(500),
        Duration::from_millis(2500),
        Duration::from_millis(100),
    );
    let app = slow_server(store, Duration::from_secs(5), runs.clone());
    let first = tokio::spawn({
        let app = app.clone();
        async move { answer(&app, keyed(Method::POST, "/charges", "k", "{}")).await }
    });

    tokio::time::sleep(Duration::from_millis(3100)).await;
    let (status, replayed, body) = answer(&app, keyed(Method::POST, "/charges", "k", "{}")).await;
    assert_ne!(
        problem_type(&body).rsplit('#').next(),
        Some("outcome-unknown"),
        "the live owner's key read as in doubt: {body}"
    );
    assert!(
        status == StatusCode::CONFLICT
            || (status == StatusCode::CREATED && replayed.as_deref() == Some("true")),
        "{status}: {body}"
    );
    let (status, _, _) = first.await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

// ---------------------------------------------------------------------------------------
// Review II, hole 5: an owner that leaves before a byte was sent leaves nothing in doubt
// ---------------------------------------------------------------------------------------

/// A memory store whose `begin` applies at once but answers only after `delay` (a
/// round trip to a distant ledger): the claim exists while its answer is on the way.
#[derive(Debug, Clone)]
struct SlowToAnswer {
    inner: Arc<MemoryStore>,
    delay: Arc<AtomicU64>,
}

impl IdempotencyStore for SlowToAnswer {
    fn begin(&self, request: BeginRequest) -> StoreFuture<'_, Begin> {
        let applied = self.inner.begin(request);
        let delay = Duration::from_millis(self.delay.load(Ordering::SeqCst));
        StoreFuture::new(async move {
            let answer = applied.await;
            tokio::time::sleep(delay).await;
            answer
        })
    }
    fn complete(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        outcome: Outcome,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        self.inner.complete(key, token, outcome, retention)
    }
    fn abandon(&self, key: LedgerKey, token: LeaseToken) -> StoreFuture<'_, ()> {
        self.inner.abandon(key, token)
    }
    fn mark_in_doubt(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        self.inner.mark_in_doubt(key, token, retention)
    }
    fn renew(&self, key: LedgerKey, token: LeaseToken, lease: Duration) -> StoreFuture<'_, ()> {
        self.inner.renew(key, token, lease)
    }
}

/// A provider that answers its first readiness check, then is not ready while `open` is
/// false (a pool whose last connection was just taken by another caller): the layer's own
/// `poll_ready` passes, the operation's call waits, and nothing is sent until it opens.
#[derive(Clone)]
struct Gated {
    open: Arc<std::sync::atomic::AtomicBool>,
    checks: Arc<AtomicUsize>,
    provider: SideEffectService,
}

impl tower::Service<Request<Full<Bytes>>> for Gated {
    type Response = <SideEffectService as tower::Service<Request<Full<Bytes>>>>::Response;
    type Error = <SideEffectService as tower::Service<Request<Full<Bytes>>>>::Error;
    type Future = <SideEffectService as tower::Service<Request<Full<Bytes>>>>::Future;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        if self.checks.fetch_add(1, Ordering::SeqCst) == 0 || self.open.load(Ordering::SeqCst) {
            tower::Service::<Request<Full<Bytes>>>::poll_ready(&mut self.provider, cx)
        } else {
            std::task::Poll::Pending
        }
    }

    fn call(&mut self, req: Request<Full<Bytes>>) -> Self::Future {
        self.provider.call(req)
    }
}

/// The orchestrator's timeout fires while `begin`'s answer is still on the way: the claim
/// was made, nothing was sent. With a provider that does not deduplicate, a claim left to
/// expire would read as in doubt and refuse every later run for the retention.
#[tokio::test(start_paused = true)]
async fn a_caller_that_leaves_during_begins_round_trip_leaves_nothing_in_doubt() {
    let store = SlowToAnswer {
        inner: Arc::new(MemoryStore::new()),
        delay: Arc::new(AtomicU64::new(1_000)),
    };
    let provider = SideEffectService::builder().honour_keys(false).build();
    let client = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(store.clone())
                .provider_deduplicates(false)
                .build()
                .unwrap(),
        )
        .service(provider.clone());
    let gave_up = tokio::time::timeout(
        Duration::from_millis(100),
        client.clone().oneshot(post(ORIGINAL)),
    )
    .await;
    assert!(gave_up.is_err(), "the caller left mid round trip");

    // Long after the lease would have run out, the orchestrator runs the step again.
    store.delay.store(0, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(60)).await;
    let res = client.oneshot(post(ORIGINAL)).await.expect("not in doubt");
    assert_eq!(source(&res), ResponseSource::Sent);
    assert_eq!(provider.effects(), 1);
}

/// The claim was answered, but the inner service never became ready before the caller's
/// timeout: nothing was sent, so the operation is released, not left in doubt.
#[tokio::test(start_paused = true)]
async fn a_caller_that_leaves_before_its_call_leaves_nothing_in_doubt() {
    let provider = SideEffectService::builder().honour_keys(false).build();
    let gated = Gated {
        open: Arc::new(std::sync::atomic::AtomicBool::new(false)),
        checks: Arc::new(AtomicUsize::new(0)),
        provider: provider.clone(),
    };
    let client = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(MemoryStore::new())
                .provider_deduplicates(false)
                .build()
                .unwrap(),
        )
        .service(gated.clone());
    let gave_up = tokio::time::timeout(
        Duration::from_millis(100),
        client.clone().oneshot(post(ORIGINAL)),
    )
    .await;
    assert!(gave_up.is_err(), "the caller left before its call");
    assert!(
        gated.checks.load(Ordering::SeqCst) > 1,
        "the operation waited to call"
    );
    assert_eq!(provider.calls(), 0);

    gated.open.store(true, Ordering::SeqCst);
    tokio::time::sleep(Duration::from_secs(60)).await;
    let res = client.oneshot(post(ORIGINAL)).await.expect("not in doubt");
    assert_eq!(source(&res), ResponseSource::Sent);
    assert_eq!(provider.effects(), 1);
}

// ---------------------------------------------------------------------------------------
// Review II, hole 9: answers that say the operation never started are not recorded
// ---------------------------------------------------------------------------------------

/// A provider that refuses the first call with `refusal` (a stale token, a rate limit)
/// and charges from then on, counting its charges.
fn refuses_once(
    refusal: StatusCode,
    charges: Arc<AtomicUsize>,
) -> impl tower::Service<
    Request<Full<Bytes>>,
    Response = Response<Full<Bytes>>,
    Error = Infallible,
    Future = impl Send,
> + Clone
       + Send
       + 'static {
    let calls = Arc::new(AtomicUsize::new(0));
    service_fn(move |_req: Request<Full<Bytes>>| {
        let (calls, charges) = (calls.clone(), charges.clone());
        async move {
            if calls.fetch_add(1, Ordering::SeqCst) == 0 {
                let mut res = Response::new(Full::new(Bytes::from_static(b"refused")));
                *res.status_mut() = refusal;
                return Ok::<_, Infallible>(res);
            }
            let n = charges.fetch_add(1, Ordering::SeqCst) + 1;
            let mut res = Response::new(Full::new(Bytes::from(format!("charge {n}"))));
            *res.status_mut() = StatusCode::CREATED;
            Ok(res)
        }
    })
}

/// A client stack, boxed so that either composition fits one type.
type Composed = tower::util::BoxCloneService<
    Request<Full<Bytes>>,
    Response<tower_idempotency::idempotency::ResponseBody<Full<Bytes>>>,
    tower_idempotency::Error,
>;

/// The client over `provider` with `policy`: the stack as `build_stack()` builds it
/// (`built`), or the two layers stacked by hand (the frozen request handed on through the
/// extensions).
fn composed<P>(
    built: bool,
    builder: tower_idempotency::client::Builder,
    policy: RetryPolicy,
    provider: P,
) -> Composed
where
    P: tower::Service<Request<Full<Bytes>>, Response = Response<Full<Bytes>>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    P::Future: Send,
{
    // The layer is told the retry policy either way (stacked by hand, for its protected
    // window; built, it also makes the retry layer of it).
    let builder = builder.retry_policy(policy.clone());
    if built {
        let stack = builder.build_stack().unwrap();
        return tower::util::BoxCloneService::new(tower::Layer::layer(&stack, provider));
    }
    tower::util::BoxCloneService::new(
        ServiceBuilder::new()
            .layer(builder.build().unwrap())
            .layer(FrozenRetryLayer::new(policy))
            .service(provider),
    )
}

/// An orchestrator's call gets `401` (its token was stale), `407` or `429`: the
/// answer reaches it, but the operation is released, so the same `OperationId` runs once
/// the token is refreshed (rather than replaying the `401` for 24 h, or refusing the step
/// as in doubt when the provider does not deduplicate).
#[tokio::test(start_paused = true)]
async fn an_answer_that_says_nothing_started_releases_the_operation() {
    for refusal in [401, 407, 429].map(|s| StatusCode::from_u16(s).unwrap()) {
        let charges = Arc::new(AtomicUsize::new(0));
        let client = ServiceBuilder::new()
            .layer(
                IdempotencyLayer::client_builder(MemoryStore::new())
                    .provider_deduplicates(false)
                    .build()
                    .unwrap(),
            )
            .service(refuses_once(refusal, charges.clone()));
        let refused = client.clone().oneshot(post(ORIGINAL)).await.unwrap();
        assert_eq!(refused.status(), refusal);
        let charged = client.clone().oneshot(post(ORIGINAL)).await;
        let charged = charged.unwrap_or_else(|err| panic!("{refusal}: {err}"));
        assert_eq!(
            charged.status(),
            StatusCode::CREATED,
            "{refusal} was recorded"
        );
        assert_eq!(source(&charged), ResponseSource::Sent);
        let again = client.oneshot(post(ORIGINAL)).await.unwrap();
        assert_eq!(source(&again), ResponseSource::Replayed);
        assert_eq!(charges.load(Ordering::SeqCst), 1);
    }
    // Opted out: the refusal is the recorded outcome.
    opted_out_records_the_refusal().await;
}

/// A `408` is sent once the handler has started as often as for a request the server did
/// not wait to receive: axum's `HandleErrorLayer` around a `timeout` (as its docs show)
/// and tower-http's `TimeoutLayer` answer it while the handler may have charged. The client
/// face leaves the operation in doubt: against a provider that ignores keys, the step run
/// again is refused as in doubt rather than charged a second time.
#[tokio::test(start_paused = true)]
async fn a_408_from_a_server_side_timeout_leaves_the_operation_in_doubt() {
    let charges = Arc::new(AtomicUsize::new(0));
    let handler = {
        let charges = charges.clone();
        move || async move {
            charges.fetch_add(1, Ordering::SeqCst);
            // The charge is made; the rest of the handler outlasts the timeout.
            tokio::time::sleep(Duration::from_secs(10)).await;
            StatusCode::CREATED
        }
    };
    let provider = Router::new().route("/orders", route_post(handler)).layer(
        ServiceBuilder::new()
            .layer(axum::error_handling::HandleErrorLayer::new(
                |_: tower::BoxError| async { StatusCode::REQUEST_TIMEOUT },
            ))
            .timeout(Duration::from_secs(1)),
    );
    let policy = RetryPolicy::builder().max_attempts(1).build().unwrap();
    let builder = || {
        IdempotencyLayer::client_builder(MemoryStore::new())
            .provider_deduplicates(false)
            .retry_policy(policy.clone())
    };
    let built = builder().build_stack().unwrap().layer(provider.clone());
    refused_as_in_doubt_after_a_408(built).await;
    let by_hand = ServiceBuilder::new()
        .layer(builder().build().unwrap())
        .layer(FrozenRetryLayer::new(policy.clone()))
        .service(provider);
    refused_as_in_doubt_after_a_408(by_hand).await;
    assert_eq!(
        charges.load(Ordering::SeqCst),
        2,
        "once per stack, never twice"
    );
}

/// The first run of the operation answered `408`, the second refused as in doubt.
async fn refused_as_in_doubt_after_a_408<S, B>(client: S)
where
    S: tower::Service<Request<Full<Bytes>>, Response = Response<B>> + Clone,
    S::Error: std::error::Error + 'static,
{
    let timed_out = client.clone().oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(timed_out.status(), StatusCode::REQUEST_TIMEOUT);
    let again = client.oneshot(post(ORIGINAL)).await.err().expect("refused");
    let err = tower_idempotency::Error::find(&again).expect("our error");
    assert!(err.is_unreconciled(), "{err}");
}

/// The same through the client stack, as `build_stack()` builds it and stacked by hand: the
/// retry layer's one attempt was answered (it reached the server, which said nothing
/// started), and no attempt before it may have left, so the operation is released too.
#[tokio::test(start_paused = true)]
async fn through_the_stack_an_answer_that_says_nothing_started_releases_the_operation() {
    for refusal in [401, 407, 429].map(|s| StatusCode::from_u16(s).unwrap()) {
        for built in [true, false] {
            let charges = Arc::new(AtomicUsize::new(0));
            let provider = refuses_once(refusal, charges.clone());
            // One attempt: a `429` is not retried here, so its answer is the call's.
            let policy = RetryPolicy::builder().max_attempts(1).build().unwrap();
            let builder =
                IdempotencyLayer::client_builder(MemoryStore::new()).provider_deduplicates(false);
            let client = composed(built, builder, policy, provider);
            let refused = client.clone().oneshot(post(ORIGINAL)).await.unwrap();
            assert_eq!(refused.status(), refusal, "built: {built}");
            let charged = client.clone().oneshot(post(ORIGINAL)).await;
            let charged = charged.unwrap_or_else(|err| panic!("{refusal}, built: {built}: {err}"));
            assert_eq!(
                charged.status(),
                StatusCode::CREATED,
                "{refusal}, built: {built}"
            );
            assert_eq!(
                source(&charged),
                ResponseSource::Sent,
                "{refusal}, built: {built}: the operation was left in doubt, not released"
            );
            assert_eq!(charges.load(Ordering::SeqCst), 1);
        }
    }
}

async fn opted_out_records_the_refusal() {
    let charges = Arc::new(AtomicUsize::new(0));
    let client = ServiceBuilder::new()
        .layer(
            IdempotencyLayer::client_builder(MemoryStore::new())
                .provider_deduplicates(true)
                .key_header(KeyHeader::ietf())
                .release_on(ReleaseOn::nothing())
                .build()
                .unwrap(),
        )
        .service(refuses_once(StatusCode::UNAUTHORIZED, charges.clone()));
    client.clone().oneshot(post(ORIGINAL)).await.unwrap();
    let replayed = client.oneshot(post(ORIGINAL)).await.unwrap();
    assert_eq!(replayed.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(source(&replayed), ResponseSource::Replayed);
}

/// Sticky: an attempt that timed out may have charged; a `429` to the retry that followed
/// does not release the operation, which stays in doubt and is resumed, never run afresh;
/// through the stack as `build_stack()` builds it and stacked by hand.
#[tokio::test(start_paused = true)]
async fn a_refusal_after_an_attempt_that_may_have_left_keeps_the_operation_in_doubt() {
    for built in [true, false] {
        let calls = Arc::new(AtomicUsize::new(0));
        let provider = {
            let calls = calls.clone();
            service_fn(move |_req: Request<Full<Bytes>>| {
                let n = calls.fetch_add(1, Ordering::SeqCst);
                async move {
                    let status = match n {
                        0 => {
                            tokio::time::sleep(Duration::from_secs(60)).await;
                            StatusCode::CREATED
                        }
                        1 => StatusCode::TOO_MANY_REQUESTS,
                        _ => StatusCode::CREATED,
                    };
                    let mut res = Response::new(Full::new(Bytes::from_static(b"{}")));
                    *res.status_mut() = status;
                    Ok::<_, Infallible>(res)
                }
            })
        };
        let policy = RetryPolicy::builder()
            .max_attempts(2)
            .backoff(Duration::from_millis(1), Duration::from_millis(5))
            .attempt_timeout(Duration::from_secs(1))
            .no_budget()
            .build()
            .unwrap();
        let builder = IdempotencyLayer::client_builder(MemoryStore::new())
            .provider_deduplicates(true)
            .key_header(KeyHeader::ietf());
        let client = composed(built, builder, policy, provider);
        let limited = client.clone().oneshot(post(ORIGINAL)).await.unwrap();
        assert_eq!(
            limited.status(),
            StatusCode::TOO_MANY_REQUESTS,
            "built: {built}"
        );
        let next = client.oneshot(post(ORIGINAL)).await.unwrap();
        assert_eq!(
            source(&next),
            ResponseSource::Resent,
            "built: {built}: the operation stayed in doubt and its frozen bytes were resent"
        );
    }
}

/// A provider that charges and answers `200` with a problem body whose type is one that
/// releases: a success is recorded as it stands, whatever its body claims, so the repeat
/// replays it and the charge stays one (RFC 9457 problems describe errors). Through the
/// stack built as one and stacked by hand.
#[tokio::test(start_paused = true)]
async fn a_success_whose_body_is_a_releasing_problem_is_recorded() {
    for built in [true, false] {
        let charges = Arc::new(AtomicUsize::new(0));
        let provider = service_fn({
            let charges = charges.clone();
            move |_req: Request<Full<Bytes>>| {
                let charges = charges.clone();
                async move {
                    charges.fetch_add(1, Ordering::SeqCst);
                    let body = format!("{{\"type\":\"{}\"}}", problem::SCOPE_MISSING);
                    let mut res = Response::new(Full::new(Bytes::from(body)));
                    res.headers_mut().insert(
                        http::header::CONTENT_TYPE,
                        HeaderValue::from_static("application/problem+json"),
                    );
                    Ok::<_, Infallible>(res)
                }
            }
        });
        let policy = RetryPolicy::builder().max_attempts(1).build().unwrap();
        let builder = IdempotencyLayer::client_builder(MemoryStore::new())
            .provider_deduplicates(true)
            .key_header(KeyHeader::ietf());
        let client = composed(built, builder, policy, provider);
        let first = client.clone().oneshot(post(ORIGINAL)).await.unwrap();
        assert_eq!(first.status(), StatusCode::OK, "built: {built}");
        assert_eq!(source(&first), ResponseSource::Sent, "built: {built}");
        let again = client.oneshot(post(ORIGINAL)).await.unwrap();
        assert_eq!(
            source(&again),
            ResponseSource::Replayed,
            "built: {built}: the success was released on its body's word"
        );
        assert_eq!(charges.load(Ordering::SeqCst), 1, "built: {built}");
    }
}

/// Over loopback, our own two faces: the client's call reaches the server face without
/// credentials and is refused `400 scope-missing` (the handler never ran, the server's
/// ledger untouched); the client releases the operation, and once the caller sends its
/// credentials the same `OperationId` runs, once.
#[tokio::test]
async fn the_server_faces_scope_missing_is_released_by_the_client_face() {
    let runs = Arc::new(AtomicUsize::new(0));
    let app = Router::new()
        .route(
            "/charges",
            route_post({
                let runs = runs.clone();
                move || async move {
                    runs.fetch_add(1, Ordering::SeqCst);
                    (StatusCode::CREATED, "charged")
                }
            }),
        )
        .layer(IdempotencyLayer::server(MemoryStore::new()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let client = ServiceBuilder::new()
        .layer(IdempotencyLayer::client(
            MemoryStore::new(),
            ProviderKeys::Deduplicates,
            KeyHeader::ietf(),
        ))
        .service(http);
    let charge = |credential: Option<&'static str>| {
        let mut req = Request::post(format!("http://{addr}/charges"));
        if let Some(credential) = credential {
            req = req.header("authorization", credential);
        }
        let mut req = req.body(Full::new(Bytes::from_static(b"{}"))).unwrap();
        req.extensions_mut().insert(op());
        req
    };
    let refused = client.clone().oneshot(charge(None)).await.unwrap();
    assert_eq!(refused.status(), StatusCode::BAD_REQUEST);
    let refused = String::from_utf8(body_of(refused).await.to_vec()).unwrap();
    assert_eq!(problem_type(&refused), problem::SCOPE_MISSING);
    assert_eq!(runs.load(Ordering::SeqCst), 0);

    let charged = client
        .clone()
        .oneshot(charge(Some("Bearer sk_test")))
        .await
        .unwrap();
    assert_eq!(
        charged.status(),
        StatusCode::CREATED,
        "the 400 was replayed"
    );
    assert_eq!(source(&charged), ResponseSource::Sent);
    let again = client
        .oneshot(charge(Some("Bearer sk_test")))
        .await
        .unwrap();
    assert_eq!(source(&again), ResponseSource::Replayed);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// What the transport sees of the caller's extensions, attempt by attempt: a stack built as
/// one hands on every extension but the `OperationId` (which became the key header), on
/// every attempt; the layers stacked by hand hand on all of them, for a layer in between.
#[tokio::test(start_paused = true)]
async fn the_transport_gets_the_callers_extensions_on_every_attempt() {
    #[derive(Clone, Debug, PartialEq)]
    struct TraceContext(&'static str);

    for built in [true, false] {
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let transport = service_fn({
            let seen = seen.clone();
            move |req: Request<Full<Bytes>>| {
                let mut seen = seen.lock().unwrap();
                seen.push((
                    req.extensions().get::<TraceContext>().cloned(),
                    req.extensions().get::<OperationId>().is_some(),
                    req.headers().contains_key("idempotency-key"),
                ));
                // The first attempt is answered "try again", so a second one follows.
                let status = if seen.len() == 1 {
                    StatusCode::SERVICE_UNAVAILABLE
                } else {
                    StatusCode::CREATED
                };
                let response = Response::builder()
                    .status(status)
                    .body(Full::new(Bytes::new()));
                async move { Ok::<_, Infallible>(response.unwrap()) }
            }
        });
        let policy = fast_policy(Duration::from_secs(1));
        let builder = IdempotencyLayer::client_builder(MemoryStore::new())
            .provider_deduplicates(true)
            .key_header(KeyHeader::ietf());
        let client = composed(built, builder, policy, transport);
        let mut req = post(ORIGINAL);
        req.extensions_mut().insert(TraceContext("span-7"));
        let res = client.oneshot(req).await.unwrap();
        assert_eq!(res.status(), StatusCode::CREATED, "built: {built}");
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 2, "built: {built}");
        for (trace, operation_id, key_header) in seen.iter() {
            assert_eq!(trace, &Some(TraceContext("span-7")), "built: {built}");
            assert_eq!(*operation_id, !built, "built: {built}");
            assert!(key_header, "built: {built}");
        }
    }
}

/// The default store holds a lease until its owner lets go: an owner whose future is not
/// polled for many leases (a task busy elsewhere, a `select!` that stopped driving it) is
/// still the owner. A duplicate meanwhile is told busy; it does not resume and resend, and
/// the stalled owner's call, once driven again, is the one effect. (A lease kept by a
/// timer renews only when its owner is polled: stalled like this, it ran out under a live
/// owner and the duplicate took the operation over.)
#[tokio::test(start_paused = true)]
async fn a_stalled_owner_on_the_default_store_is_never_overtaken() {
    let lease = Duration::from_millis(300);
    let provider = SideEffectService::new().with_faults([Fault::Latency(lease * 20)]);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let server = provider.clone().serve(listener).await.unwrap();
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let stack = IdempotencyLayer::client_builder(MemoryStore::new())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .lease(lease)
        .busy_policy(BusyPolicy::Fail)
        .build_stack()
        .unwrap();
    let client = ServiceBuilder::new().layer(stack).service(http);
    let charge = || {
        let mut req = Request::post(server.uri("/charges"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(br#"{"amount":1999}"#)))
            .unwrap();
        req.extensions_mut().insert(op());
        req
    };

    // Drive the owner until its request is with the provider, then stop polling it.
    let mut owner = Box::pin(client.clone().oneshot(charge()));
    while provider.attempts().is_empty() {
        let polled = std::future::poll_fn(|cx| {
            std::task::Poll::Ready(std::future::Future::poll(owner.as_mut(), cx))
        });
        assert!(polled.await.is_pending(), "the provider is slow");
        tokio::task::yield_now().await;
    }
    tokio::time::advance(lease * 10).await;

    let duplicate = client.clone().oneshot(charge()).await;
    assert!(
        duplicate.as_ref().is_err_and(|err| err.is_busy()),
        "ten leases on, the stalled owner still holds the operation: {duplicate:?}"
    );
    assert_eq!(provider.attempts().len(), 1, "nothing was resent");

    let charged = owner.await.expect("the owner's call, driven again");
    assert_eq!(charged.status(), StatusCode::CREATED);
    let again = client.oneshot(charge()).await.unwrap();
    assert_eq!(source(&again), ResponseSource::Replayed);
    assert_eq!(provider.effects(), 1);
}

/// Outside the ledger, through a stack built as one: a read and a side effect let through
/// unprotected (`require_key(false)`) reach the stack's retry layer frozen once, are
/// retried with those bytes exactly, touch no record, and the side effect is marked
/// unprotected.
#[tokio::test(start_paused = true)]
async fn a_stack_built_as_one_retries_what_it_lets_through_with_the_bytes_it_froze() {
    let store = MemoryStore::new();
    let provider = SideEffectService::new().with_faults([
        // The read's first attempt, answered "try again".
        Fault::ServerError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            commit: false,
        },
        // The unprotected side effect's first attempt, refused before a byte left.
        Fault::RefuseBeforeSend,
    ]);
    let client = IdempotencyLayer::client_builder(store.clone())
        .provider_deduplicates(true)
        .key_header(KeyHeader::ietf())
        .require_key(false)
        .retry_policy(fast_policy(Duration::from_secs(1)))
        .build_stack()
        .unwrap()
        .layer(provider.clone());

    let read = Request::get("http://inventory.local/stock?sku=SKU-4471")
        .header("x-trace", "t-1")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let res = client.clone().oneshot(read).await.unwrap();
    assert!(res.status().is_success(), "{}", res.status());
    let attempts = provider.attempts();
    assert_eq!(attempts.len(), 2, "the 503 was retried");
    assert_eq!(attempts[0].method(), Method::GET);
    assert_eq!(attempts[1].uri(), attempts[0].uri());
    assert_eq!(attempts[1].headers(), attempts[0].headers());
    assert_eq!(attempts[1].body(), attempts[0].body());

    let unkeyed = Request::post("http://payments.local/charges")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from_static(br#"{"amount":1999}"#)))
        .unwrap();
    let before = provider.effects_without_key();
    let res = client.oneshot(unkeyed).await.unwrap();
    assert_eq!(res.status(), StatusCode::CREATED);
    assert_eq!(source(&res), ResponseSource::Unprotected);
    let attempts = provider.attempts();
    assert_eq!(
        attempts.len(),
        3,
        "the refused attempt never arrived; its retry did"
    );
    assert_eq!(
        attempts[2].body(),
        &Bytes::from_static(br#"{"amount":1999}"#)
    );
    assert_eq!(provider.effects_without_key(), before + 1, "charged once");
    store.run_pending_tasks().await;
    assert_eq!(
        store.entry_count(),
        0,
        "nothing outside the ledger is recorded"
    );
}

// ---------------------------------------------------------------------------------------
// A `begin` whose answer was lost lands after the key was let go by another caller
// ---------------------------------------------------------------------------------------

/// A store whose next `begin` is held up: answered as timed out at once, applied only when
/// the test lands it (a `begin` queued behind a frozen database, run once it resumes).
#[derive(Clone, Debug)]
struct HeldUpStore {
    inner: MemoryStore,
    hold_next: Arc<std::sync::atomic::AtomicBool>,
    held: Arc<std::sync::Mutex<Vec<BeginRequest>>>,
}

impl HeldUpStore {
    fn new() -> Self {
        Self {
            inner: MemoryStore::new(),
            hold_next: Arc::default(),
            held: Arc::default(),
        }
    }

    /// Apply the held-up `begin`s now, answering what each was answered.
    async fn land(&self) -> Vec<Result<Begin, StoreError>> {
        let held = std::mem::take(&mut *self.held.lock().unwrap());
        let mut answers = Vec::new();
        for request in held {
            answers.push(self.inner.begin(request).await);
        }
        answers
    }
}

impl IdempotencyStore for HeldUpStore {
    fn begin(&self, request: BeginRequest) -> StoreFuture<'_, Begin> {
        StoreFuture::new(async move {
            if self.hold_next.swap(false, Ordering::SeqCst) {
                self.held.lock().unwrap().push(request);
                return Err(StoreError::timeout());
            }
            self.inner.begin(request).await
        })
    }

    fn complete(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        outcome: Outcome,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        self.inner.complete(key, token, outcome, retention)
    }

    fn abandon(&self, key: LedgerKey, token: LeaseToken) -> StoreFuture<'_, ()> {
        self.inner.abandon(key, token)
    }

    fn mark_in_doubt(
        &self,
        key: LedgerKey,
        token: LeaseToken,
        retention: Duration,
    ) -> StoreFuture<'_, ()> {
        self.inner.mark_in_doubt(key, token, retention)
    }

    fn renew(&self, key: LedgerKey, token: LeaseToken, lease: Duration) -> StoreFuture<'_, ()> {
        self.inner.renew(key, token, lease)
    }
}

/// Another replica holds key `k` of scope `t` (as the server layer below derives it).
async fn held_by_another_replica(store: &HeldUpStore) -> (LedgerKey, LeaseToken) {
    let key = LedgerKey::server("t", "k");
    let fingerprint = Fingerprint::of(&Method::POST, "/charges", b"{}");
    let claim = BeginRequest::new(
        key,
        fingerprint,
        Duration::from_secs(10),
        Duration::from_secs(600),
    );
    let Begin::Acquired { token } = store.inner.begin(claim).await.unwrap() else {
        panic!("a fresh key is acquired")
    };
    (key, token)
}

fn server_with_busy_policy(store: HeldUpStore, runs: Arc<AtomicUsize>, busy: BusyPolicy) -> Router {
    Router::new()
        .route("/charges", route_post(counting_handler(runs)))
        .route_layer(
            IdempotencyLayer::server_builder(store)
                .scope(|_| "t".to_owned())
                .busy_policy(busy)
                .build()
                .unwrap(),
        )
}

fn all_refused(landed: &[Result<Begin, StoreError>]) -> bool {
    !landed.is_empty()
        && landed
            .iter()
            .all(|answer| matches!(answer, Err(err) if err.is_fenced()))
}

/// The first `begin` is held up, the second answered busy (another replica holds the key):
/// `409`. The replica lets the key go, then the held-up `begin` lands: it claims nothing
/// (its token was released, and the store remembers it although the replica held the key
/// then), so the client's retry runs the charge, once.
#[tokio::test(start_paused = true)]
async fn a_lost_begin_landing_after_a_busy_answer_and_the_key_let_go_claims_nothing() {
    let store = HeldUpStore::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let app = server_with_busy_policy(store.clone(), runs.clone(), BusyPolicy::Fail);
    let (key, other) = held_by_another_replica(&store).await;

    store.hold_next.store(true, Ordering::SeqCst);
    let (status, _, body) = answer(&app, keyed(Method::POST, "/charges", "k", "{}")).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    tokio::time::sleep(Duration::from_secs(1)).await;

    store.inner.abandon(key, other).await.unwrap();
    let landed = store.land().await;
    assert!(all_refused(&landed), "the late begin claimed: {landed:?}");
    let (status, replayed, body) = answer(&app, keyed(Method::POST, "/charges", "k", "{}")).await;
    assert_eq!((status, replayed), (StatusCode::CREATED, None), "{body}");
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}

/// The same under a wait: the caller keeps waiting after its released token's busy answer,
/// under a fresh token, and takes the key once the replica lets it go; the held-up `begin`
/// then lands and claims nothing.
#[tokio::test(start_paused = true)]
async fn a_caller_waiting_after_a_lost_begin_takes_the_key_under_a_fresh_token() {
    let store = HeldUpStore::new();
    let runs = Arc::new(AtomicUsize::new(0));
    let app = server_with_busy_policy(
        store.clone(),
        runs.clone(),
        BusyPolicy::Wait(Duration::from_secs(5)),
    );
    let (key, other) = held_by_another_replica(&store).await;

    store.hold_next.store(true, Ordering::SeqCst);
    let waiting = tokio::spawn({
        let app = app.clone();
        async move { answer(&app, keyed(Method::POST, "/charges", "k", "{}")).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !waiting.is_finished(),
        "the caller waits while the key is busy"
    );
    store.inner.abandon(key, other).await.unwrap();
    let (status, replayed, body) = waiting.await.unwrap();
    assert_eq!((status, replayed), (StatusCode::CREATED, None), "{body}");

    // The fresh claim ended the released marker: the late `begin` meets its record.
    let landed = store.land().await;
    assert!(
        matches!(landed[..], [Ok(Begin::Replay(_))]),
        "the late begin claimed: {landed:?}"
    );
    let (status, replayed, _) = answer(&app, keyed(Method::POST, "/charges", "k", "{}")).await;
    assert_eq!(
        (status, replayed.as_deref()),
        (StatusCode::CREATED, Some("true"))
    );
    assert_eq!(runs.load(Ordering::SeqCst), 1);
}
