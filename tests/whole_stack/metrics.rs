//! The `metrics` feature: decisions counted per face and outcome, ledger calls timed.
#![cfg(all(feature = "metrics", feature = "test-util"))]

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use metrics_util::MetricKind;
use tower::{ServiceBuilder, ServiceExt};
use tower_idempotency::ledger::MemoryStore;
use tower_idempotency::testing::SideEffectService;
use tower_idempotency::ProviderKeys;
use tower_idempotency::{IdempotencyLayer, KeyHeader, OperationId};

#[test]
fn decisions_are_counted_and_ledger_calls_timed() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    metrics::with_local_recorder(&recorder, || {
        runtime.block_on(async {
            let client = ServiceBuilder::new()
                .layer(IdempotencyLayer::client(
                    MemoryStore::new(),
                    ProviderKeys::Deduplicates,
                    KeyHeader::ietf(),
                ))
                .service(SideEffectService::new());
            for _ in 0..2 {
                let mut req = Request::post("http://payments.local/charges")
                    .body(Full::new(Bytes::from_static(b"{}")))
                    .unwrap();
                req.extensions_mut()
                    .insert(OperationId::new("task", "charge"));
                client.clone().oneshot(req).await.unwrap();
            }
        })
    });

    let mut counters = Vec::new();
    let mut histograms = Vec::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let (kind, key) = key.into_parts();
        let labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        match (kind, value) {
            (MetricKind::Counter, DebugValue::Counter(n)) => {
                counters.push((key.name().to_owned(), labels, n))
            }
            (MetricKind::Histogram, DebugValue::Histogram(samples)) => {
                histograms.push((key.name().to_owned(), labels, samples.len()))
            }
            _ => {}
        }
    }
    let counter = |decision: &str| {
        counters
            .iter()
            .find(|(name, labels, _)| {
                name == "idempotency_decisions_total"
                    && labels.contains(&"face=client".to_owned())
                    && labels.contains(&format!("decision={decision}"))
            })
            .map(|(_, _, n)| *n)
    };
    assert_eq!(counter("acquired"), Some(1), "{counters:?}");
    assert_eq!(counter("replayed"), Some(1), "{counters:?}");
    let timed = |call: &str| {
        histograms
            .iter()
            .find(|(name, labels, _)| {
                name == "idempotency_ledger_call_seconds"
                    && labels.contains(&format!("call={call}"))
                    && labels.contains(&"result=ok".to_owned())
            })
            .map(|(_, _, n)| *n)
    };
    assert_eq!(timed("begin"), Some(2), "{histograms:?}");
    assert_eq!(timed("complete"), Some(1), "{histograms:?}");
}

/// The gauges of a `MemoryStore` follow what it holds, and a dropped store takes its share
/// out of the series every store adds to.
#[test]
fn the_memory_store_reports_its_bytes_and_records_as_gauges() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let gauges = || {
        let mut found = (None, None);
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let (_, key) = key.into_parts();
            let labelled = key
                .labels()
                .any(|l| l.key() == "store" && l.value() == "memory");
            if let (true, DebugValue::Gauge(value)) = (labelled, value) {
                match key.name() {
                    "idempotency_store_bytes" => found.0 = Some(value.into_inner()),
                    "idempotency_store_records" => found.1 = Some(value.into_inner()),
                    _ => {}
                }
            }
        }
        found
    };
    let (store, other) =
        metrics::with_local_recorder(&recorder, || (MemoryStore::new(), MemoryStore::new()));
    runtime.block_on(async {
        let client = ServiceBuilder::new()
            .layer(IdempotencyLayer::client(
                store.clone(),
                ProviderKeys::Deduplicates,
                KeyHeader::ietf(),
            ))
            .service(SideEffectService::new());
        let other_client = ServiceBuilder::new()
            .layer(IdempotencyLayer::client(
                other.clone(),
                ProviderKeys::Deduplicates,
                KeyHeader::ietf(),
            ))
            .service(SideEffectService::new());
        for (task, client) in [("a", &client), ("b", &client), ("c", &other_client)] {
            let mut req = Request::post("http://payments.local/charges")
                .body(Full::new(Bytes::from_static(b"{\"amount\":1}")))
                .unwrap();
            req.extensions_mut()
                .insert(OperationId::new(task, "charge"));
            client.clone().oneshot(req).await.unwrap();
        }
    });
    assert_eq!(store.entry_count(), 2);
    // The debugging recorder resets a gauge as it reads it: each read below is the change
    // since the one before.
    let (mine, others) = (store.weighted_size() as f64, other.weighted_size() as f64);
    assert_eq!(
        gauges(),
        (Some(mine + others), Some(3.0)),
        "both stores, added up"
    );

    drop(other);
    assert_eq!(
        gauges(),
        (Some(-others), Some(-1.0)),
        "a dropped store takes its share out"
    );
    drop(store);
    assert_eq!(gauges(), (Some(-mine), Some(-2.0)));
}

/// `Records::publish_doubt_gauges`: the count of operations in doubt and the age of the
/// oldest, kept current as operations fall into doubt and are resolved.
#[test]
fn gauges_follow_the_operations_in_doubt() {
    use std::time::Duration;
    use tower_idempotency::fingerprint::Fingerprint;
    use tower_idempotency::ledger::{
        Begin, BeginRequest, Expected, IdempotencyStore, LedgerKey, Records,
    };

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // One snapshot for both: the debugging recorder hands each value out once.
    let gauges = || {
        let mut found = (None, None);
        for (key, _, _, value) in snapshotter.snapshot().into_vec() {
            let (_, key) = key.into_parts();
            let labelled = key
                .labels()
                .any(|l| l.key() == "store" && l.value() == "payments");
            if let (true, DebugValue::Gauge(value)) = (labelled, value) {
                match key.name() {
                    "idempotency_in_doubt_operations" => found.0 = Some(value.into_inner()),
                    "idempotency_in_doubt_oldest_seconds" => found.1 = Some(value.into_inner()),
                    _ => {}
                }
            }
        }
        found
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    let store = std::sync::Arc::new(MemoryStore::new());
    let records = Records::new(store.clone());
    let every = Duration::from_secs(15);
    // Spawned on the runtime, its gauges registered with this test's recorder.
    let _gauges = {
        let _entered = runtime.enter();
        metrics::with_local_recorder(&recorder, || {
            records.publish_doubt_gauges("payments", every)
        })
    };
    let fp = Fingerprint::of(&http::Method::POST, "/charges", b"{}");
    let in_doubt = |n: u8| {
        let store = store.clone();
        async move {
            let key = LedgerKey::from_bytes([n; 32]);
            let request =
                BeginRequest::new(key, fp, Duration::from_secs(10), Duration::from_secs(3600));
            let Begin::Acquired { token } = store.begin(request).await.unwrap() else {
                panic!("a fresh key is acquired");
            };
            store
                .mark_in_doubt(key, token, Duration::from_secs(3600))
                .await
                .unwrap();
            key
        }
    };
    runtime.block_on(async {
        let first = in_doubt(1).await;
        tokio::time::sleep(Duration::from_secs(100)).await;
        in_doubt(2).await;
        tokio::time::sleep(every).await;
        let (count, oldest) = gauges();
        assert_eq!(count, Some(2.0));
        let oldest = oldest.expect("the age of the oldest");
        assert!((100.0..=130.0).contains(&oldest), "{oldest}");

        // The oldest is resolved by an operator: the next reading counts one, younger.
        let seen = store.inspect(first).await.unwrap().unwrap();
        store.forget(first, Expected::of(&seen)).await.unwrap();
        tokio::time::sleep(every).await;
        let (count, oldest) = gauges();
        assert_eq!(count, Some(1.0));
        let oldest = oldest.expect("the age of the oldest");
        assert!(oldest <= 30.0, "{oldest}");
    });
}
