//! Failures as the client face reports them.

use crate::phase::{classify, FailurePhase};
use crate::{BoxError, Error};

use super::face::ClientFace;
/// Keep our own errors as they are; wrap anything else with its phase.
pub(super) fn into_error(error: BoxError, phase: FailurePhase) -> Error {
    match error.downcast::<Error>() {
        Ok(ours) => *ours,
        Err(other) => Error::inner(other, phase),
    }
}

/// A call outside the ledger failed: keep our own errors, wrap the rest with their phase.
pub(super) fn failed_outside(client: &ClientFace, error: BoxError) -> Error {
    let phase = classify(&*error, client.phase_classifier.as_deref());
    into_error(error, phase)
}
