//! The double's own tests.

use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use http_body_util::{BodyExt, Full};
use sha2::{Digest, Sha256};
use tokio::time::{timeout, Instant};
use tower::ServiceExt;

use std::io;

use http::header::{CONTENT_TYPE, RETRY_AFTER};
use http::{HeaderMap, Method, Request, Version};

use super::*;
use crate::key::hex;
use crate::phase::{classify, FailurePhase};
use crate::server::IDEMPOTENT_REPLAYED;

fn post(key: Option<&str>, body: &'static str) -> Request<Full<Bytes>> {
    let mut builder = Request::post("http://payments.local/charges");
    if let Some(key) = key {
        builder = builder.header("idempotency-key", format!("\"{key}\""));
    }
    builder
        .body(Full::new(Bytes::from_static(body.as_bytes())))
        .unwrap()
}

async fn send(
    svc: &SideEffectService,
    req: Request<Full<Bytes>>,
) -> io::Result<(StatusCode, HeaderMap, Bytes)> {
    let res = svc.clone().oneshot(req).await?;
    let (parts, body) = res.into_parts();
    Ok((
        parts.status,
        parts.headers,
        body.collect().await.unwrap().to_bytes(),
    ))
}

fn json(body: &Bytes) -> serde_json::Value {
    serde_json::from_slice(body).unwrap()
}

#[tokio::test]
async fn commit_answers_201_with_the_effect_body() {
    let svc = SideEffectService::new();
    let (status, headers, body) = send(&svc, post(Some("k1"), "{\"a\":1}")).await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers[CONTENT_TYPE], "application/json");
    assert!(headers.get(&IDEMPOTENT_REPLAYED).is_none());
    let sha = hex(&Sha256::digest(b"{\"a\":1}"));
    assert_eq!(
        body,
        format!(r#"{{"effect_id":"eff_1","key":"k1","body_sha256":"{sha}"}}"#)
    );

    let (_, _, body) = send(&svc, post(None, "x")).await.unwrap();
    assert_eq!(json(&body)["effect_id"], "eff_2");
    assert_eq!(json(&body)["key"], serde_json::Value::Null);

    assert_eq!(svc.effects(), 2);
    assert_eq!(svc.effects_for_key("k1"), 1);
    assert_eq!(svc.effects_for(Some("k1")), 1);
    assert_eq!(svc.effects_for(None), 1);
    assert_eq!(svc.effects_without_key(), 1);
    assert_eq!(svc.effects_for_key("other"), 0);
    assert_eq!(svc.calls(), 2);
}

#[tokio::test]
async fn without_a_key_every_call_commits() {
    let svc = SideEffectService::new();
    for _ in 0..3 {
        let (status, _, _) = send(&svc, post(None, "same")).await.unwrap();
        assert_eq!(status, StatusCode::CREATED);
    }
    assert_eq!(svc.effects_without_key(), 3);
    assert_eq!(svc.effects(), 3);
}

#[tokio::test]
async fn same_key_same_body_replays_the_first_commit() {
    let svc = SideEffectService::new();
    let (_, _, first) = send(&svc, post(Some("k"), "body")).await.unwrap();
    let (status, headers, again) = send(&svc, post(Some("k"), "body")).await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers[&IDEMPOTENT_REPLAYED], "true");
    assert_eq!(headers[CONTENT_TYPE], "application/json");
    assert_eq!(again, first);
    assert_eq!(svc.effects_for_key("k"), 1);
    assert_eq!(svc.calls(), 2);
    assert_eq!(svc.attempts().len(), 2);
}

#[tokio::test]
async fn quoted_and_bare_keys_are_the_same_key() {
    let svc = SideEffectService::new();
    send(&svc, post(Some("k"), "body")).await.unwrap();
    let bare = Request::post("/charges")
        .header("idempotency-key", "k")
        .body(Full::new(Bytes::from_static(b"body")))
        .unwrap();
    let (_, headers, _) = send(&svc, bare).await.unwrap();
    assert_eq!(headers[&IDEMPOTENT_REPLAYED], "true");
    assert_eq!(svc.effects_for_key("k"), 1);
}

#[tokio::test]
async fn same_key_different_body_is_422_without_an_effect() {
    let svc = SideEffectService::new();
    send(&svc, post(Some("k"), "original")).await.unwrap();
    let (status, headers, body) = send(&svc, post(Some("k"), "regenerated")).await.unwrap();
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(headers[CONTENT_TYPE], "application/json");
    assert_eq!(json(&body)["error"], "idempotency_key_reused");
    assert_eq!(svc.effects_for_key("k"), 1);
}

#[tokio::test(start_paused = true)]
async fn same_key_while_in_progress_is_409_without_an_effect() {
    let svc = SideEffectService::new().with_faults([Fault::Latency(Duration::from_secs(2))]);
    let start = Instant::now();
    let (slow, busy) = tokio::join!(send(&svc, post(Some("k"), "body")), async {
        let res = send(&svc, post(Some("k"), "body")).await;
        // The duplicate is refused at once, while the first is still working.
        assert_eq!(start.elapsed(), Duration::ZERO);
        res
    });
    let (status, headers, body) = busy.unwrap();
    assert_eq!(status, StatusCode::CONFLICT);
    assert_eq!(headers[RETRY_AFTER], "1");
    assert_eq!(json(&body)["error"], "idempotency_key_in_progress");
    assert_eq!(slow.unwrap().0, StatusCode::CREATED);
    assert_eq!(start.elapsed(), Duration::from_secs(2));
    assert_eq!(svc.effects_for_key("k"), 1);
}

#[tokio::test]
async fn honouring_off_commits_every_call() {
    let svc = SideEffectService::builder().honour_keys(false).build();
    send(&svc, post(Some("k"), "one")).await.unwrap();
    let (status, headers, body) = send(&svc, post(Some("k"), "one")).await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert!(headers.get(&IDEMPOTENT_REPLAYED).is_none());
    assert_eq!(json(&body)["effect_id"], "eff_2");
    let (status, _, _) = send(&svc, post(Some("k"), "two")).await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(svc.effects_for_key("k"), 3);
}

#[tokio::test]
async fn malformed_key_is_400_when_honoured_and_no_key_when_not() {
    let bad = || {
        Request::post("/charges")
            .header("idempotency-key", "\"unterminated")
            .body(Full::new(Bytes::from_static(b"x")))
            .unwrap()
    };
    let svc = SideEffectService::new();
    let (status, _, body) = send(&svc, bad()).await.unwrap();
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(json(&body)["error"], "invalid_idempotency_key");
    assert_eq!(svc.effects(), 0);

    let naive = SideEffectService::builder().honour_keys(false).build();
    let (status, _, _) = send(&naive, bad()).await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(naive.effects_without_key(), 1);
}

#[tokio::test(start_paused = true)]
async fn commit_then_timeout_commits_and_never_answers() {
    let svc = SideEffectService::new().with_faults([Fault::CommitThenTimeout]);
    let lost = timeout(Duration::from_secs(30), send(&svc, post(Some("k"), "b"))).await;
    assert!(lost.is_err(), "the caller's timeout must fire");
    assert_eq!(svc.effects_for_key("k"), 1);

    // The answer was recorded for the key: the retry replays it.
    let (status, headers, body) = send(&svc, post(Some("k"), "b")).await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers[&IDEMPOTENT_REPLAYED], "true");
    assert_eq!(json(&body)["effect_id"], "eff_1");
    assert_eq!(svc.effects(), 1);
}

#[tokio::test(start_paused = true)]
async fn commit_then_timeout_against_a_naive_provider_charges_twice() {
    let svc = SideEffectService::builder()
        .honour_keys(false)
        .faults([Fault::CommitThenTimeout])
        .build();
    let lost = timeout(Duration::from_secs(30), send(&svc, post(Some("k"), "b"))).await;
    assert!(lost.is_err());
    send(&svc, post(Some("k"), "b")).await.unwrap();
    assert_eq!(svc.effects_for_key("k"), 2, "the first incident");
}

#[tokio::test]
async fn refuse_before_send_fails_pre_write_without_an_effect() {
    let svc = SideEffectService::new().with_faults([Fault::RefuseBeforeSend]);
    let err = send(&svc, post(Some("k"), "b")).await.unwrap_err();
    assert_eq!(err.kind(), io::ErrorKind::ConnectionRefused);
    assert_eq!(classify(&err, None), FailurePhase::PreWrite);
    assert_eq!(svc.effects(), 0);
    assert_eq!(svc.calls(), 1);
    assert!(svc.attempts().is_empty(), "the provider never saw it");

    // Nothing was claimed: the retry commits.
    let (status, headers, _) = send(&svc, post(Some("k"), "b")).await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert!(headers.get(&IDEMPOTENT_REPLAYED).is_none());
    assert_eq!(svc.effects_for_key("k"), 1);
}

#[tokio::test]
async fn server_error_after_commit_counts_and_replays_the_commit() {
    let svc = SideEffectService::new().with_faults([Fault::ServerError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        commit: true,
    }]);
    let (status, headers, body) = send(&svc, post(Some("k"), "b")).await.unwrap();
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(headers[CONTENT_TYPE], "application/json");
    assert_eq!(json(&body)["error"], "injected_fault");
    assert_eq!(svc.effects_for_key("k"), 1, "500, but the write happened");

    let (status, headers, _) = send(&svc, post(Some("k"), "b")).await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers[&IDEMPOTENT_REPLAYED], "true");
    assert_eq!(svc.effects_for_key("k"), 1);
}

#[tokio::test]
async fn server_error_without_commit_releases_the_key() {
    let svc = SideEffectService::new().with_faults([Fault::ServerError {
        status: StatusCode::SERVICE_UNAVAILABLE,
        commit: false,
    }]);
    let (status, _, _) = send(&svc, post(Some("k"), "b")).await.unwrap();
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(svc.effects(), 0);

    let (status, headers, body) = send(&svc, post(Some("k"), "b")).await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert!(headers.get(&IDEMPOTENT_REPLAYED).is_none());
    assert_eq!(json(&body)["effect_id"], "eff_1");
    assert_eq!(svc.effects_for_key("k"), 1);
}

#[tokio::test]
async fn panic_after_commit_counts_and_panic_before_releases() {
    let svc = SideEffectService::new().with_faults([
        Fault::Panic {
            after_commit: false,
        },
        Fault::Panic { after_commit: true },
    ]);
    let call = |svc: &SideEffectService| {
        let svc = svc.clone();
        tokio::spawn(async move { send(&svc, post(Some("k"), "b")).await })
    };

    let died = call(&svc).await.unwrap_err();
    assert!(died.is_panic());
    assert_eq!(svc.effects(), 0);

    let died = call(&svc).await.unwrap_err();
    assert!(died.is_panic());
    assert_eq!(svc.effects_for_key("k"), 1);

    // The lock survived both panics, and the committed key replays.
    let (_, headers, _) = send(&svc, post(Some("k"), "b")).await.unwrap();
    assert_eq!(headers[&IDEMPOTENT_REPLAYED], "true");
    assert_eq!(svc.effects(), 1);
}

#[tokio::test]
async fn faults_are_consumed_one_per_call_in_order() {
    let error = |status| Fault::ServerError {
        status,
        commit: false,
    };
    let svc = SideEffectService::new()
        .with_faults([error(StatusCode::BAD_GATEWAY), Fault::RefuseBeforeSend]);
    svc.push_fault(error(StatusCode::SERVICE_UNAVAILABLE));
    assert_eq!(
        svc.pending_faults(),
        [
            error(StatusCode::BAD_GATEWAY),
            Fault::RefuseBeforeSend,
            error(StatusCode::SERVICE_UNAVAILABLE),
        ]
    );

    assert_eq!(
        send(&svc, post(None, "b")).await.unwrap().0,
        StatusCode::BAD_GATEWAY
    );
    assert!(send(&svc, post(None, "b")).await.is_err());
    assert_eq!(
        svc.pending_faults(),
        [error(StatusCode::SERVICE_UNAVAILABLE)]
    );
    assert_eq!(
        send(&svc, post(None, "b")).await.unwrap().0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert!(svc.pending_faults().is_empty());
    assert_eq!(
        send(&svc, post(None, "b")).await.unwrap().0,
        StatusCode::CREATED
    );
    assert_eq!(svc.effects(), 1);
    assert_eq!(svc.calls(), 4);
}

#[tokio::test]
async fn a_fault_on_a_replay_answers_without_committing() {
    let svc = SideEffectService::new();
    send(&svc, post(Some("k"), "b")).await.unwrap();
    svc.push_fault(Fault::ServerError {
        status: StatusCode::BAD_GATEWAY,
        commit: true,
    });
    let (status, _, _) = send(&svc, post(Some("k"), "b")).await.unwrap();
    assert_eq!(status, StatusCode::BAD_GATEWAY);
    assert_eq!(svc.effects(), 1, "a replay never commits");
}

#[tokio::test(start_paused = true)]
async fn latency_fault_and_base_latency_use_the_tokio_clock() {
    let svc = SideEffectService::builder()
        .latency(Duration::from_millis(100))
        .faults([Fault::Latency(Duration::from_secs(3))])
        .build();
    let start = Instant::now();
    let (status, _, _) = send(&svc, post(Some("k"), "b")).await.unwrap();
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(start.elapsed(), Duration::from_millis(3100));

    let start = Instant::now();
    let (_, headers, _) = send(&svc, post(Some("k"), "b")).await.unwrap();
    assert_eq!(headers[&IDEMPOTENT_REPLAYED], "true");
    assert_eq!(start.elapsed(), Duration::from_millis(100));
    assert_eq!(svc.effects(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_caller_that_gives_up_does_not_stop_the_provider() {
    let svc = SideEffectService::new().with_faults([Fault::Latency(Duration::from_secs(10))]);
    let gave_up = timeout(Duration::from_secs(1), send(&svc, post(Some("k"), "b"))).await;
    assert!(gave_up.is_err());
    assert_eq!(svc.effects(), 0, "still working");

    // The retry arrives while the first call is still being processed.
    assert_eq!(
        send(&svc, post(Some("k"), "b")).await.unwrap().0,
        StatusCode::CONFLICT
    );

    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(
        svc.effects_for_key("k"),
        1,
        "the provider finished its work"
    );
    let (_, headers, _) = send(&svc, post(Some("k"), "b")).await.unwrap();
    assert_eq!(headers[&IDEMPOTENT_REPLAYED], "true");
}

#[tokio::test]
async fn attempts_record_what_arrived() {
    let svc = SideEffectService::new();
    let req = Request::put("http://orders.local/orders/7?dry=0")
        .version(Version::HTTP_2)
        .header("idempotency-key", "\"o-7\"")
        .header("x-trace", "abc")
        .body(Full::new(Bytes::from_static(b"{\"sku\":1}")))
        .unwrap();
    send(&svc, req).await.unwrap();
    send(&svc, post(None, "second")).await.unwrap();

    let attempts = svc.attempts();
    assert_eq!(attempts.len(), 2);
    let first = &attempts[0];
    assert_eq!(first.method(), Method::PUT);
    assert_eq!(first.uri(), "http://orders.local/orders/7?dry=0");
    assert_eq!(first.version(), Version::HTTP_2);
    assert_eq!(first.headers()["x-trace"], "abc");
    assert_eq!(first.body(), &Bytes::from_static(b"{\"sku\":1}"));
    assert_eq!(first.key(), Some("o-7"));
    assert_eq!(attempts[1].key(), None);
    assert_eq!(attempts[1].body(), &Bytes::from_static(b"second"));
}

#[tokio::test]
async fn reset_forgets_everything() {
    let svc = SideEffectService::new();
    send(&svc, post(Some("k"), "b")).await.unwrap();
    svc.push_fault(Fault::RefuseBeforeSend);
    svc.reset();
    assert_eq!(
        (svc.effects(), svc.calls(), svc.attempts().len()),
        (0, 0, 0)
    );
    assert!(svc.pending_faults().is_empty());

    let (_, headers, body) = send(&svc, post(Some("k"), "b")).await.unwrap();
    assert!(
        headers.get(&IDEMPOTENT_REPLAYED).is_none(),
        "the key was forgotten"
    );
    assert_eq!(json(&body)["effect_id"], "eff_1");
}

#[tokio::test(start_paused = true)]
async fn work_in_flight_at_reset_does_not_touch_the_fresh_state() {
    let svc = SideEffectService::new().with_faults([Fault::Latency(Duration::from_secs(1))]);
    let in_flight = tokio::spawn({
        let svc = svc.clone();
        async move { send(&svc, post(Some("k"), "b")).await }
    });
    tokio::task::yield_now().await;
    svc.reset();
    assert_eq!(in_flight.await.unwrap().unwrap().0, StatusCode::CREATED);
    assert_eq!(svc.effects(), 0);
}

#[test]
fn debug_shows_the_state() {
    let svc = SideEffectService::new().with_faults([Fault::RefuseBeforeSend]);
    let debug = format!("{svc:?}");
    assert!(debug.contains("honour_keys: true"), "{debug}");
    assert!(debug.contains("RefuseBeforeSend"), "{debug}");
}

#[test]
fn clones_share_state_and_the_service_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync + 'static>() {}
    assert_send_sync::<SideEffectService>();
    assert_send_sync::<CapturedRequest>();
    let svc = SideEffectService::new();
    svc.clone().push_fault(Fault::RefuseBeforeSend);
    assert_eq!(svc.pending_faults().len(), 1);
}

/// Like a provider that stores the header it received, the double keeps the key as sent
/// with the effect: a lookup finds it only by those characters, quotes included.
#[tokio::test]
async fn keys_are_kept_as_sent() {
    let svc = SideEffectService::new();
    let lookup = |key: &str| {
        let key = key.replace('"', "%22");
        Request::get(format!(
            "http://payments.local{}?idempotency_key={key}",
            super::LOOKUP_PATH
        ))
        .body(Full::new(Bytes::new()))
        .unwrap()
    };
    send(&svc, post(Some("k"), "a")).await.unwrap();
    assert_eq!(
        send(&svc, lookup("k")).await.unwrap().0,
        StatusCode::NOT_FOUND
    );
    assert_eq!(send(&svc, lookup("\"k\"")).await.unwrap().0, StatusCode::OK);
    assert_eq!(svc.effects_for_key("k"), 1);
}

#[tokio::test]
async fn key_in_use_refuses_without_an_effect_and_releases_the_key() {
    let svc = SideEffectService::new().with_faults([Fault::KeyInUse]);
    let (status, headers, body) = send(&svc, post(Some("k"), "a")).await.unwrap();
    assert_eq!(status, StatusCode::CONFLICT);
    assert!(headers.get(RETRY_AFTER).is_none());
    assert_eq!(json(&body)["error"]["type"], "idempotency_error");
    assert_eq!(svc.effects(), 0);
    let (status, _, _) = send(&svc, post(Some("k"), "a")).await.unwrap();
    assert_eq!(status, StatusCode::CREATED, "the key was released");
    assert_eq!(svc.effects_for_key("k"), 1);
}
