//! How the scripts' arguments and replies are encoded: tokens and fingerprints as hex,
//! durations as clamped milliseconds, replies as tagged arrays.

use std::time::Duration;

use ::redis::Value;

use crate::fingerprint::Fingerprint;
use crate::ledger::{
    Begin, Generation, LeaseToken, LedgerKey, ListCursor, ListPage, ListedRecord, Origin,
    OriginFace, Outcome, StoreError,
};
use crate::FrozenRequest;

/// Lua numbers are doubles and `PEXPIRE` rejects times that overflow when added to the
/// clock: clamp leases and retentions to about 139 years, far beyond any real use.
const MAX_TTL_MS: u128 = 1 << 42;

/// Turn `forget`'s reply into the protocol's answer.
pub(super) fn decode_forget(reply: &[Value]) -> Result<crate::ledger::Forget, StoreError> {
    use crate::ledger::Forget;
    match tag(reply)? {
        b"forgotten" => Ok(Forget::Forgotten),
        b"absent" => Ok(Forget::Absent),
        b"changed" => Ok(Forget::Changed),
        b"live" => match reply.get(1) {
            Some(Value::Int(ms)) => Ok(Forget::Live {
                lease_left: Duration::from_millis(u64::try_from(*ms).unwrap_or(0)),
            }),
            _ => Err(unexpected(reply)),
        },
        _ => Err(unexpected(reply)),
    }
}

/// Turn `resolve`'s reply into the protocol's answer.
pub(super) fn decode_resolve(reply: &[Value]) -> Result<crate::ledger::Resolve, StoreError> {
    use crate::ledger::Resolve;
    match tag(reply)? {
        b"resolved" => Ok(Resolve::Resolved),
        b"absent" => Ok(Resolve::Absent),
        b"changed" => Ok(Resolve::Changed),
        b"not_in_doubt" => Ok(Resolve::NotInDoubt),
        b"live" => match reply.get(1) {
            Some(Value::Int(ms)) => Ok(Resolve::Live {
                lease_left: Duration::from_millis(u64::try_from(*ms).unwrap_or(0)),
            }),
            _ => Err(unexpected(reply)),
        },
        _ => Err(unexpected(reply)),
    }
}

/// Turn `begin`'s reply into the protocol's answer; `token` is the one offered to the script.
pub(super) fn decode_begin(reply: &[Value], token: LeaseToken) -> Result<Begin, StoreError> {
    // The script never makes a token of its own: an owner it names is always the caller's,
    // so the answer carries back the token the caller offered.
    match tag(reply)? {
        b"acquired" => Ok(Begin::Acquired { token }),
        b"busy" => match reply.get(1) {
            Some(Value::Int(ms)) => Ok(Begin::Busy {
                retry_after: Duration::from_millis(u64::try_from(*ms).unwrap_or(0)),
            }),
            _ => Err(unexpected(reply)),
        },
        // No frozen request on the server side (nothing was stored): `None`, not corrupt.
        b"resume" => Ok(Begin::Resume {
            token,
            frozen: optional_frozen(reply.get(1))?,
        }),
        b"in_doubt" => Ok(Begin::InDoubt),
        // The caller released this token before its `begin` arrived: refused, no claim.
        b"released" => Err(StoreError::fenced()),
        // A completed record always has its outcome (`complete` writes both in one step);
        // one without is damage, never to be read as "nothing to replay".
        b"replay" => match reply.get(1) {
            Some(Value::BulkString(bytes)) => Ok(Begin::Replay(Outcome::decode(bytes)?)),
            _ => Err(StoreError::corrupt("completed record without an outcome")),
        },
        b"drift" => {
            let stored = match reply.get(1) {
                Some(Value::BulkString(hex)) => parse_fingerprint(hex)?,
                _ => return Err(unexpected(reply)),
            };
            Ok(Begin::Drift {
                stored,
                frozen: optional_frozen(reply.get(2))?,
            })
        }
        _ => Err(unexpected(reply)),
    }
}

/// Turn `inspect`'s reply into a view.
pub(super) fn decode_inspect(
    reply: &[Value],
) -> Result<Option<crate::ledger::RecordView>, StoreError> {
    use crate::ledger::{RecordState, RecordView};
    if tag(reply)? == b"absent" {
        return Ok(None);
    }
    let text = |i: usize| match reply.get(i) {
        Some(Value::BulkString(bytes)) => Ok(bytes.as_slice()),
        _ => Err(unexpected(reply)),
    };
    let int = |i: usize| match reply.get(i) {
        Some(Value::Int(n)) => Ok(u64::try_from(*n).unwrap_or(0)),
        _ => Err(unexpected(reply)),
    };
    let ms = |i: usize| int(i).map(Duration::from_millis);
    let generation = match text(9)? {
        b"" => legacy_generation(int(10)?),
        hex => parse_generation(hex)?,
    };
    let state = match text(1)? {
        b"in_flight" => RecordState::InFlight {
            lease_left: ms(5)?,
            may_have_been_sent: text(7)? == b"1",
        },
        b"in_doubt" => RecordState::InDoubt,
        b"completed" => RecordState::Completed {
            status: http::StatusCode::from_u16(u16::try_from(int(8)?).unwrap_or(0))
                .map_err(|err| StoreError::corrupt(err.to_string()))?,
        },
        _ => return Err(StoreError::corrupt("unknown record state")),
    };
    let view = RecordView::new(
        state,
        parse_fingerprint(text(2)?)?,
        u32::try_from(int(3)?).unwrap_or(u32::MAX),
        generation,
        ms(4)?,
        ms(6)?,
    );
    // The scope and the last change: every view the scripts answer has them (a record
    // written before they were kept reads as scope 0, last touched when claimed).
    Ok(Some(
        view.with_scope(parse_hex_u64(text(11)?, "scope")?)
            .with_touched(ms(12)?)
            .with_origin(decode_origin(reply.get(13..).unwrap_or_default())?),
    ))
}

/// The origin a view's last four items show: its face (empty for none, as for a record
/// written before origins were kept), target, and task and step ids (nil for none).
fn decode_origin(items: &[Value]) -> Result<Option<Origin>, StoreError> {
    let text = |i: usize| match items.get(i) {
        Some(Value::BulkString(bytes)) => std::str::from_utf8(bytes)
            .map(Some)
            .map_err(|_| StoreError::corrupt("a record's origin is not UTF-8")),
        Some(Value::Nil) | None => Ok(None),
        Some(_) => Err(unexpected(items)),
    };
    let face = match text(0)? {
        None | Some("") => return Ok(None),
        Some(name) => OriginFace::parse(name)
            .ok_or_else(|| StoreError::corrupt(format!("unknown origin face {name:?}")))?,
    };
    let origin = Origin::new(face, text(1)?.unwrap_or_default());
    Ok(Some(match (text(2)?, text(3)?) {
        (Some(task), Some(step)) => origin.with_operation(&crate::OperationId::new(task, step)),
        _ => origin,
    }))
}

/// The frozen request `inspect`'s reply ends with, after the view (see inspect.lua): `None`
/// for an absent, completed or server-side record. Read from the end, so the view may grow.
pub(super) fn decode_inspected_request(
    reply: &[Value],
) -> Result<Option<FrozenRequest>, StoreError> {
    if tag(reply)? != b"record" {
        return Ok(None);
    }
    optional_frozen(reply.last())
}

/// Turn `list`'s reply into a page: `{'page', next, records}` (see list.lua).
pub(super) fn decode_list(reply: &[Value]) -> Result<ListPage, StoreError> {
    if tag(reply)? != b"page" {
        return Err(unexpected(reply));
    }
    let (Some(Value::Array(next)), Some(Value::Array(records))) = (reply.get(1), reply.get(2))
    else {
        return Err(unexpected(reply));
    };
    let next = match next.as_slice() {
        [] => None,
        [Value::Int(position), Value::BulkString(member)] => Some(ListCursor::new(
            u64::try_from(*position).unwrap_or(0),
            parse_key(member)?,
        )),
        _ => return Err(unexpected(reply)),
    };
    let records = records
        .iter()
        .map(|record| match record {
            Value::Array(parts) => match parts.as_slice() {
                [Value::BulkString(member), Value::Array(view)] => decode_listed(member, view),
                _ => Err(unexpected(parts)),
            },
            other => Err(unexpected(std::slice::from_ref(other))),
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(ListPage::new(records, next))
}

/// One listed record: its member (the key's hex) and its view, as `inspect` answers it.
fn decode_listed(member: &[u8], view: &[Value]) -> Result<ListedRecord, StoreError> {
    let position = match view.get(10) {
        Some(Value::Int(ms)) => u64::try_from(*ms).unwrap_or(0),
        _ => return Err(unexpected(view)),
    };
    let view = decode_inspect(view)?.ok_or_else(|| unexpected(view))?;
    Ok(ListedRecord::new(parse_key(member)?, view, position))
}

/// A ledger key from its 64 hex digits, as the indexes hold it.
fn parse_key(hex: &[u8]) -> Result<LedgerKey, StoreError> {
    let mut bytes = [0u8; 32];
    if hex.len() != 64 {
        return Err(StoreError::corrupt("index member is not 64 hex digits"));
    }
    for (byte, pair) in bytes.iter_mut().zip(hex.chunks_exact(2)) {
        *byte = (hex_digit(pair[0])? << 4) | hex_digit(pair[1])?;
    }
    Ok(LedgerKey::from_bytes(bytes))
}

/// 16 hex digits as a u64 (a scope's digest): compared as plain strings in Lua.
pub(super) fn u64_hex(value: u64) -> String {
    format!("{value:016x}")
}

fn parse_hex_u64(hex: &[u8], what: &str) -> Result<u64, StoreError> {
    std::str::from_utf8(hex)
        .ok()
        .filter(|hex| hex.len() == 16)
        .and_then(|hex| u64::from_str_radix(hex, 16).ok())
        .ok_or_else(|| StoreError::corrupt(format!("stored {what} is not 16 hex digits")))
}

/// The generation of a record an earlier release wrote, which has no `gen` field: its
/// `created_ms`, the one value that was already its own for its whole life (forget.lua
/// derives it the same way). Two such lives of one key share it only if created in the same
/// millisecond, which only processes of that earlier release can still do; a record this
/// release creates always has a random `gen`.
fn legacy_generation(created_ms: u64) -> Generation {
    Generation::from_u64(created_ms)
}

/// Generations travel as 16 hex digits: compared as plain strings in Lua, whose numbers
/// are doubles and would round a 64-bit value.
pub(super) fn generation_hex(generation: Generation) -> String {
    format!("{:016x}", generation.as_u64())
}

fn parse_generation(hex: &[u8]) -> Result<Generation, StoreError> {
    parse_hex_u64(hex, "generation").map(Generation::from_u64)
}

/// The reply's tag, with `corrupt` replies already turned into errors.
pub(super) fn tag(reply: &[Value]) -> Result<&[u8], StoreError> {
    match reply.first() {
        Some(Value::BulkString(tag)) if tag == b"corrupt" => {
            let detail = match reply.get(1) {
                Some(Value::BulkString(detail)) => String::from_utf8_lossy(detail).into_owned(),
                _ => "unreadable record".to_owned(),
            };
            Err(StoreError::corrupt(detail))
        }
        Some(Value::BulkString(tag)) => Ok(tag),
        _ => Err(unexpected(reply)),
    }
}

pub(super) fn unexpected(reply: &[Value]) -> StoreError {
    StoreError::corrupt(format!("unexpected reply from a ledger script: {reply:?}"))
}

pub(super) fn optional_frozen(value: Option<&Value>) -> Result<Option<FrozenRequest>, StoreError> {
    match value {
        None | Some(Value::Nil) => Ok(None),
        Some(Value::BulkString(bytes)) => FrozenRequest::decode(bytes).map(Some),
        Some(other) => Err(StoreError::corrupt(format!(
            "frozen request stored as {other:?}"
        ))),
    }
}

pub(super) fn parse_fingerprint(hex: &[u8]) -> Result<Fingerprint, StoreError> {
    let mut bytes = [0u8; 32];
    if hex.len() != 64 {
        return Err(StoreError::corrupt(
            "stored fingerprint is not 64 hex digits",
        ));
    }
    for (byte, pair) in bytes.iter_mut().zip(hex.chunks_exact(2)) {
        *byte = (hex_digit(pair[0])? << 4) | hex_digit(pair[1])?;
    }
    Ok(Fingerprint::from_bytes(bytes))
}

pub(super) fn hex_digit(digit: u8) -> Result<u8, StoreError> {
    match digit {
        b'0'..=b'9' => Ok(digit - b'0'),
        b'a'..=b'f' => Ok(digit - b'a' + 10),
        _ => Err(StoreError::corrupt(
            "stored fingerprint is not lowercase hex",
        )),
    }
}

/// Tokens travel as 32 hex digits: readable in `HGETALL`, compared as plain strings in Lua.
pub(super) fn token_hex(token: LeaseToken) -> String {
    format!("{:032x}", token.as_u128())
}

/// A duration in whole milliseconds, clamped to `[min, MAX_TTL_MS]`. Retentions use a
/// minimum of 1 because `PEXPIRE key 0` deletes the key on the spot.
pub(super) fn millis(duration: Duration, min: u128) -> u64 {
    // The clamp keeps the value below 2^42, so the cast is lossless.
    duration.as_millis().clamp(min, MAX_TTL_MS) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fingerprints_round_trip_through_hex() {
        let fp = Fingerprint::of(&http::Method::POST, "/x", b"{}");
        assert_eq!(parse_fingerprint(fp.to_hex().as_bytes()).unwrap(), fp);
        assert!(parse_fingerprint(b"zz").unwrap_err().is_corrupt());
        assert!(parse_fingerprint(&[b'G'; 64]).unwrap_err().is_corrupt());
    }

    #[test]
    fn durations_are_clamped_for_lua_and_pexpire() {
        assert_eq!(millis(Duration::ZERO, 1), 1);
        assert_eq!(millis(Duration::ZERO, 0), 0);
        assert_eq!(millis(Duration::from_micros(1500), 1), 1);
        assert_eq!(millis(Duration::MAX, 1), 1 << 42);
    }

    #[test]
    fn generations_round_trip_through_hex() {
        let generation = Generation::from_u64(u64::MAX - 5);
        assert_eq!(
            parse_generation(generation_hex(generation).as_bytes()).unwrap(),
            generation
        );
        assert_eq!(generation_hex(Generation::from_u64(1)), "0000000000000001");
        assert!(parse_generation(b"12").unwrap_err().is_corrupt());
    }

    #[test]
    fn tokens_are_32_hex_digits() {
        assert_eq!(token_hex(LeaseToken::from_u128(0xab)).len(), 32);
        assert_eq!(token_hex(LeaseToken::from_u128(u128::MAX)), "f".repeat(32));
    }

    #[test]
    fn corrupt_replies_become_corrupt_errors() {
        let reply = [
            Value::BulkString(b"corrupt".to_vec()),
            Value::BulkString(b"record format version 2".to_vec()),
        ];
        assert!(decode_begin(&reply, LeaseToken::generate())
            .unwrap_err()
            .is_corrupt());
        let garbage = [Value::Int(3)];
        assert!(decode_begin(&garbage, LeaseToken::generate())
            .unwrap_err()
            .is_corrupt());
    }
}
