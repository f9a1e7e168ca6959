//! The actions an operator takes on a record, fenced by the look they took, and the audit
//! trail each one leaves.

use std::time::Duration;

use super::authorize::Operator;
use super::look::{changed_parts, ActionInput};
use super::problem::Failure;
use crate::ledger::{Forget, LedgerKey, RecordKind, RecordView, Records};

/// The target of the console's audit events.
pub(crate) const AUDIT_TARGET: &str = "tower_idempotency::console";

/// What an operator asks to be done to a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Remove the record, whatever its state (a live owner's only when forced).
    Forget,
    /// Say an operation in doubt did not take effect: its record is forgotten, so the
    /// caller's next run sends it again.
    ResolveNotApplied,
}

impl Action {
    /// The name in audit events, metrics and outcomes.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Forget => "forget",
            Self::ResolveNotApplied => "resolve_not_applied",
        }
    }

    /// The last segment of its route.
    pub(crate) fn path(self) -> &'static str {
        match self {
            Self::Forget => "forget",
            Self::ResolveNotApplied => "resolve-not-applied",
        }
    }
}

/// What came of an action.
#[derive(Debug)]
pub(crate) enum Acted {
    /// The record is gone: the next request with its key runs the operation.
    Forgotten,
    /// There was no record; nothing changed.
    Absent,
    /// The record moved on since the look: nothing changed. `current` is how it is now
    /// (`None` if it has left since), `changed` what differs from the look.
    Changed {
        current: Option<RecordView>,
        changed: Vec<&'static str>,
    },
    /// The record is in flight under a live lease: nothing changed.
    Live {
        lease_left: Duration,
        current: Option<RecordView>,
    },
    /// Resolve as not applied, on a look that was not in doubt: nothing was asked of the
    /// store.
    NotInDoubt,
}

impl Acted {
    /// The `result` of audit events and metrics.
    pub(crate) fn as_str(&self) -> &'static str {
        match self {
            Self::Forgotten => "forgotten",
            Self::Absent => "absent",
            Self::Changed { .. } => "changed",
            Self::Live { .. } => "live",
            Self::NotInDoubt => "not_in_doubt",
        }
    }
}

/// Do `action` to the record of `key` if it is still as `input`'s look, and leave the
/// audit event and the count of it whatever came of it.
pub(crate) async fn act(
    records: &Records,
    operator: &Operator,
    action: Action,
    key: LedgerKey,
    input: &ActionInput,
) -> Result<Acted, Failure> {
    let acted = run(records, action, key, input).await;
    let result = match &acted {
        Ok(acted) => acted.as_str(),
        Err(_) => "error",
    };
    audit(operator, action, &key, &input.reason, result);
    acted
}

async fn run(
    records: &Records,
    action: Action,
    key: LedgerKey,
    input: &ActionInput,
) -> Result<Acted, Failure> {
    // The look, not a fresh read, decides: an operator who saw the record in doubt
    // resolves that record, and the store's fence refuses it if it moved on since.
    if action == Action::ResolveNotApplied && input.expected.kind != RecordKind::InDoubt {
        return Ok(Acted::NotInDoubt);
    }
    let forget = records
        .forget(key, input.expected)
        .await
        .map_err(|err| Failure::store(&err))?;
    Ok(match forget {
        Forget::Forgotten => Acted::Forgotten,
        Forget::Absent => Acted::Absent,
        Forget::Live { lease_left } => Acted::Live {
            lease_left,
            current: current(records, key).await?,
        },
        // `Forget` may grow: whatever else refused the removal changed nothing, and the
        // record as it is now tells the operator what stood in the way.
        _ => {
            let current = current(records, key).await?;
            let changed = current
                .as_ref()
                .map(|view| changed_parts(&input.expected, view))
                .unwrap_or_default();
            Acted::Changed { current, changed }
        }
    })
}

async fn current(records: &Records, key: LedgerKey) -> Result<Option<RecordView>, Failure> {
    records
        .inspect(key)
        .await
        .map_err(|err| Failure::store(&err))
}

/// The audit event of an action (or of one refused before it ran: `result` says which),
/// and with feature `metrics` its count. The operator's identity goes into the event only:
/// a metric label per person would grow without bound and spread identities to every
/// dashboard.
pub(crate) fn audit(
    operator: &Operator,
    action: Action,
    key: &LedgerKey,
    reason: &str,
    result: &'static str,
) {
    let action_name = action.as_str();
    if result == "forgotten" {
        // The one console event that lets an operation run again: `WARN`, as the store's
        // own event of the removal.
        tracing::warn!(
            target: AUDIT_TARGET,
            operator = %operator.id,
            role = operator.role.as_str(),
            action = action_name,
            key = %key.to_hex(),
            reason,
            result,
            "an operator acted on a ledger record"
        );
    } else {
        tracing::info!(
            target: AUDIT_TARGET,
            operator = %operator.id,
            role = operator.role.as_str(),
            action = action_name,
            key = %key.to_hex(),
            reason,
            result,
            "an operator's action on a ledger record changed nothing"
        );
    }
    #[cfg(feature = "metrics")]
    metrics::counter!(
        "idempotency_console_actions_total",
        "action" => action_name,
        "result" => result
    )
    .increment(1);
}
