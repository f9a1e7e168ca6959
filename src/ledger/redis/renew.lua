-- renew: the owner is alive and still working; extend its lease.
--
-- KEYS[1]  the record
-- ARGV[1]  the owner's token (32 hex)
-- ARGV[2]  the lease in ms, from now
local key, token, lease_ms = KEYS[1], ARGV[1], tonumber(ARGV[2])

local r = redis.call('HMGET', key, 'v', 'state', 'token')
local bad = unreadable(key, r[1])
if bad then return bad end
-- Fencing: a lease that ran out may still be renewed by its owner, unless another caller
-- took the operation over (the token changed) or it was settled.
if r[2] ~= 'in_flight' or r[3] ~= token then
  return {'fenced'}
end

-- The lease only: the key's TTL (the retention) is left alone, so an owner renewing for as
-- long as it runs never stretches how long the record is kept.
redis.call('HSET', key, 'lease_until_ms', now_ms() + lease_ms)
return {'ok'}
