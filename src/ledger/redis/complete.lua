-- complete: record the outcome, if the caller still owns the operation.
--
-- KEYS[1]  the record
-- ARGV[1]  the owner's token (32 hex)
-- ARGV[2]  the encoded outcome
-- ARGV[3]  the retention in ms
-- KEYS[2..5] the listing indexes, on a single Redis (see prelude.lua)
local key, token, outcome, retention_ms = KEYS[1], ARGV[1], ARGV[2], ARGV[3]

local r = redis.call('HMGET', key, 'v', 'state', 'token', 'created_ms')
local bad = unreadable(key, r[1])
if bad then return bad end
-- Fencing: only the current owner of an in-flight record may write. A stale owner (its
-- lease was taken over), a stranger, or a write to a missing record changes nothing.
if r[2] ~= 'in_flight' or r[3] ~= token then
  return {'fenced'}
end

-- The fingerprint and frozen request stay: a later caller with another payload must still
-- be told it drifted, and shown what was sent.
redis.call('HSET', key, 'state', 'completed', 'outcome', outcome, 'retention_ms', retention_ms,
           'touched_ms', now_ms(), 'status', outcome_status(outcome))
-- A completed record has no owner: with the token gone, no owner's late write can match it.
redis.call('HDEL', key, 'token', 'lease_until_ms')
-- The retention starts again from the completion: the outcome stays replayable a whole
-- retention after it was recorded, however long the operation was open before.
redis.call('PEXPIRE', key, retention_ms)
-- Listed completed from now on (see prelude.lua), at its claim.
reindex(key, 'completed', r[4], 'in_flight')
return {'ok'}
