//! How the ledger's calls and answers travel: `begin_op`'s parameters and row, tokens as
//! bytes, durations as clamped milliseconds.

use std::time::Duration;

use tokio_postgres::types::ToSql;
use tokio_postgres::Row;

use crate::fingerprint::Fingerprint;
use crate::ledger::{
    Begin, BeginRequest, Generation, LeaseToken, Origin, OriginFace, Outcome, RecordState,
    RecordView, StoreError,
};
use crate::FrozenRequest;

/// Leases and retentions are clamped to about 139 years: far beyond any real use, and
/// well inside PostgreSQL's timestamp range.
const MAX_MS: u128 = 1 << 42;

/// `begin_op`'s parameters, owned so the same call can be made on a pooled connection or
/// inside a transaction.
pub(crate) struct BeginParams<'a> {
    key: &'a [u8],
    fingerprint: &'a [u8],
    token: Vec<u8>,
    lease_ms: i64,
    retention_ms: i64,
    take_over: bool,
    frozen: Option<&'a [u8]>,
    scope: i64,
    /// The origin's face, task and step (`NULL` for none)...
    origin: [Option<&'a str>; 3],
    /// ...and its target.
    target: Option<String>,
}

impl BeginParams<'_> {
    /// `begin_op`'s seven parameters, then the scope `scoped_begin_op` adds, then the
    /// origin `origin_begin_op` adds (face, target, task, step).
    pub(crate) fn as_params(&self) -> [&(dyn ToSql + Sync); 12] {
        let [face, task, step] = &self.origin;
        let target = &self.target;
        [
            &self.key,
            &self.fingerprint,
            &self.token,
            &self.lease_ms,
            &self.retention_ms,
            &self.take_over,
            &self.frozen,
            &self.scope,
            face,
            target,
            task,
            step,
        ]
    }
}

/// `begin`'s parameters for `request`, its frozen request encoded as `frozen` and its
/// origin `origin` ([`BeginRequest::named_origin`]).
pub(crate) fn begin_params<'a>(
    request: &'a BeginRequest,
    frozen: &'a Option<Vec<u8>>,
    origin: Option<&'a Origin>,
) -> BeginParams<'a> {
    BeginParams {
        key: request.key.as_bytes(),
        fingerprint: request.fingerprint.as_bytes(),
        token: token_bytes(request.token).to_vec(),
        lease_ms: millis(request.lease, 0),
        retention_ms: millis(request.retention, 1),
        take_over: request.take_over,
        frozen: frozen.as_deref(),
        scope: scope_column(request.scope),
        origin: origin_columns(origin),
        target: origin.map(Origin::target),
    }
}

/// An origin as its columns hold it but its target: face, task and step.
fn origin_columns(origin: Option<&Origin>) -> [Option<&str>; 3] {
    match origin {
        Some(origin) => [
            Some(origin.face().as_str()),
            origin.task_id(),
            origin.step_id(),
        ],
        None => [None; 3],
    }
}

/// The origin its four columns from `at` show (`None` when its face is `NULL`: a record
/// an earlier version wrote, or one claimed without an origin).
fn origin_of(row: &Row, at: usize) -> Result<Option<Origin>, StoreError> {
    let Some(face) = row.get::<_, Option<&str>>(at) else {
        return Ok(None);
    };
    let face = OriginFace::parse(face)
        .ok_or_else(|| StoreError::corrupt(format!("unknown origin face {face:?}")))?;
    let origin = Origin::new(face, row.get::<_, Option<&str>>(at + 1).unwrap_or_default());
    let operation = (
        row.get::<_, Option<&str>>(at + 2),
        row.get::<_, Option<&str>>(at + 3),
    );
    Ok(Some(match operation {
        (Some(task), Some(step)) => origin.with_operation(&crate::OperationId::new(task, step)),
        _ => origin,
    }))
}

/// A scope digest as its `bigint` column holds it: the same 64 bits.
pub(super) fn scope_column(scope: u64) -> i64 {
    scope as i64
}

/// A `begin` that waited its whole lock wait on a record another transaction holds (a
/// transactional-mode request still running): that operation is in flight.
pub(crate) fn busy_behind_a_transaction(request: &BeginRequest) -> Begin {
    Begin::Busy {
        retry_after: request.lease,
    }
}

/// Turn `begin_op`'s row into the protocol's answer; `token` is the one offered.
pub(crate) fn decode_begin(row: &Row, token: LeaseToken) -> Result<Begin, StoreError> {
    let answer: &str = row.get(0);
    Ok(match answer {
        "acquired" => Begin::Acquired { token },
        "busy" => Begin::Busy {
            retry_after: Duration::from_millis(
                row.get::<_, Option<i64>>(1).unwrap_or(0).max(0) as u64
            ),
        },
        "resume" => Begin::Resume {
            token,
            frozen: optional_frozen(row.get(3))?,
        },
        "in_doubt" => Begin::InDoubt,
        // The caller released this token before its `begin` arrived: refused, no claim.
        "released" => return Err(StoreError::fenced()),
        "replay" => match row.get::<_, Option<&[u8]>>(4) {
            Some(bytes) => Begin::Replay(Outcome::decode(bytes)?),
            None => return Err(StoreError::corrupt("completed record without an outcome")),
        },
        "drift" => Begin::Drift {
            stored: fingerprint(row.get(2))?,
            frozen: optional_frozen(row.get(3))?,
        },
        other => {
            return Err(StoreError::corrupt(format!(
                "unexpected answer from the ledger's begin: {other:?}"
            )))
        }
    })
}

/// Turn `inspect_op`'s row (or a listed record's, in the same columns) into a view; the
/// origin's four columns start at `origin_at`.
pub(super) fn decode_inspect(row: &Row, origin_at: usize) -> Result<RecordView, StoreError> {
    let ms = |index: usize| Duration::from_millis(row.get::<_, i64>(index).max(0) as u64);
    let state = match row.get::<_, &str>(0) {
        "in_flight" => RecordState::InFlight {
            lease_left: ms(4),
            may_have_been_sent: row.get(6),
        },
        "in_doubt" => RecordState::InDoubt,
        "completed" => {
            let status: Option<i16> = row.get(7);
            let status = status
                .and_then(|s| u16::try_from(s).ok())
                .and_then(|s| http::StatusCode::from_u16(s).ok())
                .ok_or_else(|| StoreError::corrupt("completed record without a valid status"))?;
            RecordState::Completed { status }
        }
        other => {
            return Err(StoreError::corrupt(format!(
                "unknown record state {other:?}"
            )))
        }
    };
    Ok(RecordView::new(
        state,
        fingerprint(row.get(1))?,
        u32::try_from(row.get::<_, i32>(2)).unwrap_or(0),
        Generation::from_u64(row.get::<_, i64>(8) as u64),
        ms(3),
        ms(5),
    )
    .with_touched(ms(9))
    .with_scope(row.get::<_, i64>(10) as u64)
    .with_origin(origin_of(row, origin_at)?))
}

/// The frozen request the inspect statement reads beside the view (its `r_frozen` column):
/// `None` for a completed or server-side record.
pub(super) fn inspected_request(row: &Row) -> Result<Option<FrozenRequest>, StoreError> {
    optional_frozen(row.get("r_frozen"))
}

/// A generation as its `bigint` column holds it: the same 64 bits (the database's counter
/// never reaches the sign bit; a generation another store made may, and then matches no row).
pub(super) fn generation_column(generation: Generation) -> i64 {
    generation.as_u64() as i64
}

fn optional_frozen(bytes: Option<&[u8]>) -> Result<Option<FrozenRequest>, StoreError> {
    bytes.map(FrozenRequest::decode).transpose()
}

fn fingerprint(bytes: Option<&[u8]>) -> Result<Fingerprint, StoreError> {
    let bytes: [u8; 32] = bytes
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| StoreError::corrupt("stored fingerprint is not 32 bytes"))?;
    Ok(Fingerprint::from_bytes(bytes))
}

pub(crate) fn outcome_status(outcome: &Outcome) -> i16 {
    let status = match outcome {
        Outcome::Response(response) => response.status(),
        Outcome::Tombstone { status } => *status,
    };
    // Status codes are 100..=999: they fit.
    status.as_u16() as i16
}

/// Tokens travel as their 16 big-endian bytes.
pub(crate) fn token_bytes(token: LeaseToken) -> [u8; 16] {
    token.as_u128().to_be_bytes()
}

/// A duration in whole milliseconds, clamped to `[min, MAX_MS]`.
pub(crate) fn millis(duration: Duration, min: u128) -> i64 {
    // The clamp keeps the value below 2^42, so the cast is lossless.
    duration.as_millis().clamp(min, MAX_MS) as i64
}

/// A duration as the value of a millisecond setting (`statement_timeout`, `lock_timeout`):
/// at least 1 (0 turns the bound off) and at most `i32::MAX`, PostgreSQL's limit for them
/// (about 24.8 days). Past it the server refuses the setting, and with it every connection
/// or transaction: a longer bound is as good as that one.
pub(crate) fn setting_millis(duration: Duration) -> i64 {
    // At least 1 ms: to PostgreSQL a `statement_timeout` or `lock_timeout` of 0 means no
    // bound at all, the opposite of a short one. At most `i32::MAX`: both are `int` settings.
    millis(duration, 1).min(i64::from(i32::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_clamped() {
        assert_eq!(millis(Duration::ZERO, 1), 1);
        assert_eq!(millis(Duration::ZERO, 0), 0);
        assert_eq!(millis(Duration::MAX, 1), 1 << 42);
        assert_eq!(setting_millis(Duration::MAX), i64::from(i32::MAX));
        assert_eq!(setting_millis(Duration::ZERO), 1);
    }

    #[test]
    fn tokens_are_16_bytes_big_endian() {
        assert_eq!(token_bytes(LeaseToken::from_u128(1))[15], 1);
        assert_eq!(token_bytes(LeaseToken::from_u128(u128::MAX)), [0xff; 16]);
    }
}
