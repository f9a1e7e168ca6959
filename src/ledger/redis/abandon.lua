-- abandon: release an operation after a failure proven to happen before anything was sent.
--
-- A release of a claim, or an abandon that finds no record, leaves the key released under
-- the token (see prelude.lua): a `begin` of that token still on its way must not claim
-- the key when it arrives.
--
-- KEYS[1]  the record
-- ARGV[1]  the owner's token (32 hex)
-- ARGV[2]  how long the key stays released under it, in ms
-- KEYS[2..5] [list index] the listing indexes, on a single Redis (see prelude.lua)
local key, token, released_ms = KEYS[1], ARGV[1], ARGV[2]

-- Mark the key (which has no record now) released under `token`, with the tokens it was
-- already released under, until `released_ms` from now.
local function release()
  redis.call('HSET', key, 'v', VERSION, 'state', 'released', 'released:' .. token, '1')
  redis.call('PEXPIRE', key, released_ms)
end

local r = redis.call('HMGET', key, 'v', 'state', 'token', 'sent')
local bad = unreadable(key, r[1])
if bad then return bad end
if r[1] == false or is_marker(r[2]) then
  -- Nothing to release: this token's `begin` may not have arrived yet.
  release()
  return {'fenced'}
end
-- Fencing: a stale owner, or a record already settled, is left as it is. No marker either:
-- the marker stands in only for a record that is not there, and this key has one.
if r[2] ~= 'in_flight' or r[3] ~= token then
  return {'fenced'}
end

if r[4] == '0' then
  -- No attempt of this operation can have left: forget it, the next caller starts afresh.
  -- A retried `begin` of this token may still be queued: it finds the key released.
  redis.call('DEL', key)
  -- [list index] gone: listed no more.
  reindex(key, nil, nil, 'in_flight')
  release()
  return {'ok'}
end
-- An earlier attempt may have been sent. Releasing would let the next caller send new
-- bytes; keep it in doubt (its TTL as it was) so the next caller resumes with the frozen
-- ones instead.
redis.call('HSET', key, 'state', 'in_doubt', 'sent', '1')
redis.call('HDEL', key, 'token', 'lease_until_ms')
-- [list index] in doubt now.
changed_state(key, 'in_doubt', now_ms(), 'in_flight')
return {'ok'}
