//! Timing store calls for metrics.

use crate::ledger::StoreError;

/// With feature `metrics`, how long a store call took, in `idempotency_ledger_call_seconds`
/// (labels `call`, and `result`: `ok`, `fenced`, `full`, `timeout`, `unavailable`, `corrupt`).
#[cfg(feature = "metrics")]
pub(super) fn observe<T>(call: &'static str, started: Started, result: &Result<T, StoreError>) {
    let result = match result {
        Ok(_) => "ok",
        Err(err) if err.is_fenced() => "fenced",
        Err(err) if err.is_full() => "full",
        Err(err) if err.is_timeout() => "timeout",
        Err(err) if err.is_unavailable() => "unavailable",
        Err(_) => "corrupt",
    };
    metrics::histogram!("idempotency_ledger_call_seconds", "call" => call, "result" => result)
        .record(started.elapsed().as_secs_f64());
}

#[cfg(not(feature = "metrics"))]
pub(super) fn observe<T>(_: &'static str, _: Started, _: &Result<T, StoreError>) {}

/// When a store call started: read only when metrics will be recorded.
#[cfg(feature = "metrics")]
pub(super) type Started = std::time::Instant;
#[cfg(not(feature = "metrics"))]
#[derive(Clone, Copy)]
pub(super) struct Started;

pub(super) fn start() -> Started {
    #[cfg(feature = "metrics")]
    return std::time::Instant::now();
    #[cfg(not(feature = "metrics"))]
    Started
}
