-- forget: an operator removes a record, only if it is still as they saw it (see the
-- `ledger::forget` docs). Judged and deleted in one script: nothing can move the record
-- in between.
--
-- KEYS[1]  the record
-- ARGV[1]  the expected state: 'in_flight', 'in_doubt' or 'completed'
-- ARGV[2]  the expected fingerprint (64 hex)
-- ARGV[3]  the expected attempts
-- ARGV[4]  '1' to remove an operation in flight even while its lease runs, else '0'
-- ARGV[5]  the expected generation (16 hex)
-- ARGV[6]  the same, in decimal: for a record an earlier release wrote, without `gen`, whose
--          generation is its `created_ms` (see codec.rs)
-- KEYS[2..5] the listing indexes, on a single Redis (see prelude.lua)
local key = KEYS[1]

local r = redis.call('HMGET', key, 'v', 'state', 'fp', 'attempts', 'lease_until_ms', 'gen',
                     'created_ms')
local bad = unreadable(key, r[1])
if bad then return bad end
if r[1] == false or is_marker(r[2]) then
  return {'absent'}
end
-- Another life of the key (created again since the look) is another record, however alike.
-- Compared as strings: a 64-bit generation does not survive Lua's doubles.
local same_life
if r[6] then
  same_life = r[6] == ARGV[5]
else
  same_life = r[7] ~= false and r[7] == ARGV[6]
end
-- Every transition but a renewal changes the state or the attempts: a look taken before
-- one of them no longer matches.
if not same_life or r[2] ~= ARGV[1] or r[3] ~= ARGV[2] or tonumber(r[4] or 0) ~= tonumber(ARGV[3]) then
  return {'changed'}
end
-- A live owner's lease is only taken from it on purpose.
if r[2] == 'in_flight' and ARGV[4] ~= '1' then
  local left = tonumber(r[5] or 0) - now_ms()
  if left > 0 then
    return {'live', left}
  end
end
-- Tokens released while the record was there stay released (see prelude.lua).
keep_only_markers(key, now_ms())
-- The record is gone: listed no more.
reindex(key, nil, nil, r[2])
return {'forgotten'}
