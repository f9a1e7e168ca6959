//! What a request tells the world once it is decided: the `outcome` and `settled` fields of
//! its `idempotency` span, and the builder's `on_outcome` hook.

use http::Response;

use crate::idempotency::decision::{record_in_layer_span, OutcomeHook, Track};

/// Record what the layer decided for this request (once per request).
pub(super) fn outcome(what: &'static str) {
    record_in_layer_span("outcome", what);
}

/// Record how a handler run's lease was settled (once per run).
pub(super) fn settled(how: &'static str) {
    record_in_layer_span("settled", how);
}

/// What the [`on_outcome`](super::ServerBuilder::on_outcome) hook hears of, once the request is
/// answered.
pub(super) struct Report {
    pub(super) track: Track,
    pub(super) hook: Option<OutcomeHook>,
    pub(super) started: Option<tokio::time::Instant>,
}

impl Report {
    /// Tell the hook what the request was answered.
    pub(super) fn answered<T, E>(&self, answered: &Result<Response<T>, E>) {
        let status = answered.as_ref().ok().map(|response| response.status());
        self.track.report(self.hook.as_ref(), self.started, status);
    }

    /// Tell the hook what the request was answered, and pass the answer on.
    pub(super) fn answer<T, E>(&self, answered: Result<Response<T>, E>) -> Result<Response<T>, E> {
        self.answered(&answered);
        answered
    }
}
