-- resolve: an operator completes an open record with the outcome they supply (its effect
-- was seen to happen), only if it is still as they saw it (see the `ledger::resolve` docs).
-- Judged and written in one script: nothing can move the record in between.
--
-- KEYS[1]  the record
-- ARGV[1]  the expected state: 'in_flight', 'in_doubt' or 'completed'
-- ARGV[2]  the expected fingerprint (64 hex)
-- ARGV[3]  the expected attempts
-- ARGV[4]  '1' to complete an operation in flight even while its lease runs, else '0'
-- ARGV[5]  the expected generation (16 hex)
-- ARGV[6]  the same, in decimal: for a record an earlier release wrote, without `gen`, whose
--          generation is its `created_ms` (see codec.rs)
-- ARGV[7]  the encoded outcome
-- ARGV[8]  the retention in ms
-- KEYS[2..5] the listing indexes, on a single Redis (see prelude.lua)
local key = KEYS[1]
local outcome, retention_ms = ARGV[7], ARGV[8]

local r = redis.call('HMGET', key, 'v', 'state', 'fp', 'attempts', 'lease_until_ms', 'gen',
                     'created_ms')
local bad = unreadable(key, r[1])
if bad then return bad end
if r[1] == false or is_marker(r[2]) then
  return {'absent'}
end
-- The same record as seen, judged as forget.lua judges it: the same life (compared as
-- strings), state, fingerprint and attempts.
local same_life
if r[6] then
  same_life = r[6] == ARGV[5]
else
  same_life = r[7] ~= false and r[7] == ARGV[6]
end
if not same_life or r[2] ~= ARGV[1] or r[3] ~= ARGV[2] or tonumber(r[4] or 0) ~= tonumber(ARGV[3]) then
  return {'changed'}
end
-- A completed record keeps its own outcome.
if r[2] == 'completed' then
  return {'not_in_doubt'}
end
-- A live owner's lease is only taken from it on purpose.
local now = now_ms()
if r[2] == 'in_flight' and ARGV[4] ~= '1' then
  local left = tonumber(r[5] or 0) - now
  if left > 0 then
    return {'live', left}
  end
end

-- Completed as complete.lua completes it: the fingerprint and frozen request stay (the next
-- caller with the same payload replays, one with another drifts), the owner's token goes
-- (its late writes are fenced), and the retention starts again from now.
redis.call('HSET', key, 'state', 'completed', 'outcome', outcome, 'retention_ms', retention_ms,
           'touched_ms', now, 'status', outcome_status(outcome))
redis.call('HDEL', key, 'token', 'lease_until_ms')
redis.call('PEXPIRE', key, retention_ms)
-- Listed completed from now on, out of the index of the state it was seen in.
reindex(key, 'completed', r[7], r[2])
return {'resolved'}
