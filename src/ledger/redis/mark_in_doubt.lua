-- mark_in_doubt: the owner's attempt failed after its bytes may have left.
--
-- KEYS[1]  the record
-- ARGV[1]  the owner's token (32 hex)
-- ARGV[2]  the retention in ms
-- KEYS[2..5] the listing indexes, on a single Redis (see prelude.lua)
local key, token, retention_ms = KEYS[1], ARGV[1], ARGV[2]

local r = redis.call('HMGET', key, 'v', 'state', 'token', 'created_ms')
local bad = unreadable(key, r[1])
if bad then return bad end
if r[2] ~= 'in_flight' or r[3] ~= token then
  return {'fenced'}
end

-- 'sent' = 1 is what makes "may have been sent" sticky: from now on `abandon` keeps the
-- record in doubt instead of releasing it, whoever owns it next. The token goes with the
-- lease: the next owner gets a token of its own from `begin`, and this one's late writes
-- are fenced.
redis.call('HSET', key, 'state', 'in_doubt', 'sent', '1', 'retention_ms', retention_ms,
           'touched_ms', now_ms())
redis.call('HDEL', key, 'token', 'lease_until_ms')
-- A real attempt failed: keep the record at least the retention from now (never shorter
-- than it already had).
if redis.call('PTTL', key) < tonumber(retention_ms) then
  redis.call('PEXPIRE', key, retention_ms)
end
-- Listed in doubt from now on (see prelude.lua), at its claim.
reindex(key, 'in_doubt', r[4], 'in_flight')
return {'ok'}
