//! The actions an operator takes on a record, fenced by the look they took, and the audit
//! trail each one leaves.

use std::time::Duration;

use http::StatusCode;

use super::authorize::Operator;
use super::look::{changed_parts, ActionInput};
use super::problem::Failure;
use crate::idempotency::reconcile::{ask_telling_why, Reconciled, Unanswered};
use crate::ledger::{Expected, Forget, LedgerKey, RecordKind, RecordView, Records, Resolve};

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
    /// Say an operation in doubt took effect, with its receipt: its record is completed
    /// with the outcome the operator supplies, so the caller's next run replays it.
    ResolveApplied,
    /// Ask the layer's reconciler about an operation in doubt now, and settle it by its
    /// answer: resolved as applied with the response it found, or as not applied.
    ReconcileNow,
}

impl Action {
    /// The name in audit events, metrics and outcomes.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Forget => "forget",
            Self::ResolveNotApplied => "resolve_not_applied",
            Self::ResolveApplied => "resolve_applied",
            Self::ReconcileNow => "reconcile_now",
        }
    }

    /// The last segment of its route.
    pub(crate) fn path(self) -> &'static str {
        match self {
            Self::Forget => "forget",
            Self::ResolveNotApplied => "resolve-not-applied",
            Self::ResolveApplied => "resolve-applied",
            Self::ReconcileNow => "reconcile-now",
        }
    }

    /// Whether it may be forced past a live owner's lease: a resolve as not applied and a
    /// reconcile now are for a record in doubt, which has no owner to override.
    pub(crate) fn may_be_forced(self) -> bool {
        matches!(self, Self::Forget | Self::ResolveApplied)
    }
}

/// What came of an action.
#[derive(Debug)]
pub(crate) enum Acted {
    /// The record is gone: the next request with its key runs the operation.
    Forgotten,
    /// The record is completed with the operator's outcome (or the one the reconciler
    /// found), of `status`: the next request with its key replays it. `current` is how it
    /// is now (`None` if it left since).
    Resolved {
        status: StatusCode,
        current: Option<RecordView>,
    },
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
    /// A resolve of a look that was not open (not in doubt, for resolve as not applied;
    /// completed, for resolve as applied), or of a record completed since it was seen as
    /// such: nothing changed.
    NotInDoubt,
    /// The reconciler could not tell whether the operation happened: nothing changed.
    Unknown,
    /// The reconciler failed or ran past its timeout: nothing changed.
    Unanswered(Unanswered),
    /// A reconcile now on a console without a reconciler: nothing was asked.
    NoReconciler,
    /// A reconcile now of a record whose store does not show its frozen request: nothing
    /// was asked.
    NoRequest,
}

impl Acted {
    /// The `result` of audit events and metrics.
    pub(crate) fn as_str(&self) -> &'static str {
        match self {
            Self::Forgotten => "forgotten",
            Self::Resolved { .. } => "resolved",
            Self::Absent => "absent",
            Self::Changed { .. } => "changed",
            Self::Live { .. } => "live",
            Self::NotInDoubt => "not_in_doubt",
            Self::Unknown => "unknown",
            Self::Unanswered(Unanswered::Failed) => "reconciler_failed",
            Self::Unanswered(Unanswered::TimedOut) => "reconciler_timed_out",
            Self::NoReconciler => "no_reconciler",
            Self::NoRequest => "no_request",
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
    let (result, status) = match &acted {
        Ok(Acted::Resolved { status, .. }) => ("resolved", Some(status.as_u16())),
        Ok(acted) => (acted.as_str(), None),
        Err(_) => ("error", None),
    };
    audit_with(operator, action, &key, (&input.reason, status), result);
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
    match action {
        Action::ReconcileNow if records.reconciling.is_none() => Ok(Acted::NoReconciler),
        Action::ResolveNotApplied | Action::ReconcileNow
            if input.expected.kind != RecordKind::InDoubt =>
        {
            Ok(Acted::NotInDoubt)
        }
        Action::ReconcileNow => reconcile_now(records, key, &input.expected).await,
        Action::ResolveApplied if input.expected.kind == RecordKind::Completed => {
            Ok(Acted::NotInDoubt)
        }
        Action::ResolveApplied => resolve_applied(records, key, input).await,
        Action::Forget | Action::ResolveNotApplied => forget(records, key, input).await,
    }
}

/// Complete the record with the operator's receipt, if it is still the open record seen.
async fn resolve_applied(
    records: &Records,
    key: LedgerKey,
    input: &ActionInput,
) -> Result<Acted, Failure> {
    let Some(receipt) = &input.receipt else {
        return Err(Failure::bad_input(
            "outcome",
            "missing: the outcome the provider shows",
        ));
    };
    resolve(records, key, &input.expected, receipt.outcome()).await
}

/// Complete the record with `outcome`, if it is still the open record `look` saw.
async fn resolve(
    records: &Records,
    key: LedgerKey,
    look: &Expected,
    outcome: crate::ledger::Outcome,
) -> Result<Acted, Failure> {
    let status = outcome_status(&outcome);
    let resolved = records
        .resolve(key, *look, outcome)
        .await
        .map_err(|err| Failure::store(&err))?;
    Ok(match resolved {
        Resolve::Resolved => Acted::Resolved {
            status,
            current: current(records, key).await?,
        },
        Resolve::Absent => Acted::Absent,
        Resolve::NotInDoubt => Acted::NotInDoubt,
        Resolve::Live { lease_left } => Acted::Live {
            lease_left,
            current: current(records, key).await?,
        },
        // `Resolve` may grow: whatever else refused it changed nothing, and the record as
        // it is now tells the operator what stood in the way.
        _ => changed(records, key, look).await?,
    })
}

fn outcome_status(outcome: &crate::ledger::Outcome) -> StatusCode {
    match outcome {
        crate::ledger::Outcome::Response(response) => response.status(),
        crate::ledger::Outcome::Tombstone { status } => *status,
    }
}

/// Ask the layer's reconciler about the record in doubt `look` saw, and settle it by the
/// answer, fenced by the look as the operator's own resolves are: what it found is
/// recorded as the outcome (as the layer records it), or the record is forgotten so the
/// caller's next run sends the operation again. The reconciler is asked only of a record
/// still as seen, with the frozen request it keeps; a record that moves on while it is
/// asked is refused by the store's fence.
async fn reconcile_now(
    records: &Records,
    key: LedgerKey,
    look: &Expected,
) -> Result<Acted, Failure> {
    let Some(reconciling) = &records.reconciling else {
        return Ok(Acted::NoReconciler);
    };
    let Some(view) = current(records, key).await? else {
        return Ok(Acted::Absent);
    };
    // Asked only of the record seen: a look that no longer describes it asks nothing.
    let changed = changed_parts(look, &view);
    if !changed.is_empty() {
        return Ok(Acted::Changed {
            current: Some(view),
            changed,
        });
    }
    let Some(frozen) = view.request else {
        return Ok(Acted::NoRequest);
    };
    let operation = reconciling.operation(&key, frozen, view.attempts);
    let verdict = ask_telling_why(&*reconciling.reconciler, operation, reconciling.timeout).await;
    match verdict {
        Ok(Reconciled::Applied(found)) => {
            resolve(records, key, look, reconciling.outcome_of(&found)).await
        }
        Ok(Reconciled::NotApplied) => forget_seen(records, key, look).await,
        Ok(Reconciled::Unknown) => Ok(Acted::Unknown),
        Err(why) => Ok(Acted::Unanswered(why)),
    }
}

/// Remove the record, if it is still as seen.
async fn forget(records: &Records, key: LedgerKey, input: &ActionInput) -> Result<Acted, Failure> {
    forget_seen(records, key, &input.expected).await
}

/// Remove the record, if it is still as `look` saw it.
async fn forget_seen(records: &Records, key: LedgerKey, look: &Expected) -> Result<Acted, Failure> {
    let forget = records
        .forget(key, *look)
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
        _ => changed(records, key, look).await?,
    })
}

/// The record moved on since `look`: how it is now, and what differs.
async fn changed(records: &Records, key: LedgerKey, look: &Expected) -> Result<Acted, Failure> {
    let current = current(records, key).await?;
    let changed = current
        .as_ref()
        .map(|view| changed_parts(look, view))
        .unwrap_or_default();
    Ok(Acted::Changed { current, changed })
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
    audit_with(operator, action, key, (reason, None), result);
}

/// [`audit`], with the status of the receipt a resolve as applied recorded (`None` for
/// the other actions).
fn audit_with(
    operator: &Operator,
    action: Action,
    key: &LedgerKey,
    (reason, receipt_status): (&str, Option<u16>),
    result: &'static str,
) {
    let action_name = action.as_str();
    if matches!(result, "forgotten" | "resolved") {
        // The console events that change what the key's next request does (run again, or
        // replay an outcome nobody's call returned): `WARN`, as the store's own events.
        tracing::warn!(
            target: AUDIT_TARGET,
            operator = %operator.id,
            role = operator.role.as_str(),
            action = action_name,
            key = %key.to_hex(),
            reason,
            receipt_status,
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
