//! How a Redis failure becomes a [`StoreError`].

use ::redis::RedisError;

use crate::ledger::StoreError;

/// Redis failures are `unavailable` (fail closed); a reply timeout is a timeout; a key of the
/// wrong type under our prefix is a record we cannot read.
pub(super) fn from_redis(err: RedisError) -> StoreError {
    if err.code() == Some("WRONGTYPE") {
        StoreError::corrupt(err)
    } else if err.code() == Some("OOM") {
        // `maxmemory` reached under `noeviction`: Redis refuses the write rather than
        // forget a record, which is exactly the full store of the protocol.
        StoreError::full()
    } else if err.is_timeout() {
        StoreError::timeout()
    } else {
        StoreError::unavailable(err)
    }
}
