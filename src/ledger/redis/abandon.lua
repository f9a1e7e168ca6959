-- abandon: release an operation after a failure proven to happen before anything was sent.
--
-- KEYS[1]  the record
-- ARGV[1]  the owner's token (32 hex)
local key, token = KEYS[1], ARGV[1]

local r = redis.call('HMGET', key, 'v', 'state', 'token', 'sent')
local bad = unreadable(key, r[1])
if bad then return bad end
if r[2] ~= 'in_flight' or r[3] ~= token then
  return {'fenced'}
end

if r[4] == '0' then
  -- No attempt of this operation can have left: forget it, the next caller starts afresh.
  redis.call('DEL', key)
  return {'ok'}
end
-- An earlier attempt may have been sent. Releasing would let the next caller send new
-- bytes; keep it in doubt (its TTL as it was) so the next caller resumes with the frozen
-- ones instead.
redis.call('HSET', key, 'state', 'in_doubt', 'sent', '1')
redis.call('HDEL', key, 'token', 'lease_until_ms')
return {'ok'}
