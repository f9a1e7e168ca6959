//! What a request tells the world once it is decided: the `outcome` and `settled` fields of
//! its `idempotency` span, and the builder's `on_outcome` hook.

use http::Response;

use super::face::ServerFace;
use crate::idempotency::decision::{self, record_in_layer_span, Face, OutcomeHook, Track, WireKey};
use crate::HeaderKey;

/// Record what the layer decided for this request (once per request).
pub(super) fn outcome(what: &'static str) {
    record_in_layer_span("outcome", what);
}

/// Record how a handler run's lease was settled (once per run).
pub(super) fn settled(how: &'static str) {
    record_in_layer_span("settled", how);
}

/// What the [`on_outcome`](crate::server::Builder::on_outcome) hook hears of, once the request is
/// answered.
pub(super) struct Report {
    pub(super) track: Track,
    pub(super) hook: Option<OutcomeHook>,
    pub(super) started: Option<tokio::time::Instant>,
}

impl Report {
    /// What the hook will hear of the request with `key`: every answer once its body is
    /// read is reported, refusals included.
    pub(super) fn for_key(
        server: &ServerFace,
        key: &HeaderKey,
        started: Option<tokio::time::Instant>,
    ) -> Report {
        // Kept for the decision events and the hook only when they could use it: it is a copy.
        let hook = server.on_outcome.clone();
        let wire = (hook.is_some() || tracing::enabled!(tracing::Level::WARN))
            .then(|| WireKey::Header(key.clone()));
        let track = Track::new(Face::Server, wire);
        if let Some(wire) = track.wire() {
            decision::record_in_layer_span(
                "key",
                tracing::field::display(decision::KeyDigest(wire)),
            );
        }
        Report {
            track,
            hook,
            started,
        }
    }

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
