-- abandon: release an operation after a failure proven to happen before anything was sent.
--
-- Whatever it finds (its token's claim, no record, another caller's record), it leaves the
-- key released under the token (see prelude.lua): a `begin` of that token still on its way
-- must not claim the key, nor take it over, when it arrives, even once the record another
-- caller holds now has left.
--
-- KEYS[1]  the record
-- ARGV[1]  the owner's token (32 hex)
-- ARGV[2]  how long the key stays released under it, in ms
-- KEYS[2..5] [list index] the listing indexes, on a single Redis (see prelude.lua)
local key, token, released_ms = KEYS[1], ARGV[1], tonumber(ARGV[2])

local r = redis.call('HMGET', key, 'v', 'state', 'token', 'sent', 'released_until_ms')
local bad = unreadable(key, r[1])
if bad then return bad end
local now = now_ms()
local until_ms = now + released_ms

-- Mark the key released under `token` until `released_ms` from now, with every token it is
-- still released under (the others' fields, past their time, go). On a marker (or no key)
-- the marker's TTL is that; beside a record, the record's TTL stays its retention.
local function release(beside_record)
  if r[5] ~= false and tonumber(r[5]) <= now then
    for _, field in ipairs(redis.call('HKEYS', key)) do
      if string.sub(field, 1, 9) == 'released:' then
        redis.call('HDEL', key, field)
      end
    end
  end
  redis.call('HSET', key, 'released:' .. token, '1', 'released_until_ms', until_ms)
  if not beside_record then
    redis.call('HSET', key, 'v', VERSION, 'state', 'released')
    redis.call('PEXPIRE', key, released_ms)
  end
end

if r[1] == false or is_marker(r[2]) then
  -- Nothing to release: this token's `begin` may not have arrived yet.
  release(false)
  return {'fenced'}
end
-- Fencing: a stale owner, or a record already settled, is left as it is; only the token
-- is remembered beside it, for when the record leaves.
if r[2] ~= 'in_flight' or r[3] ~= token then
  release(true)
  return {'fenced'}
end

if r[4] == '0' then
  -- No attempt of this operation can have left: forget it, the next caller starts afresh.
  -- A retried `begin` of this token may still be queued: it finds the key released, and
  -- so do the other tokens released while the record was there.
  keep_only_markers(key, now)
  -- [list index] gone: listed no more.
  reindex(key, nil, nil, 'in_flight')
  r[5] = redis.call('HGET', key, 'released_until_ms')
  release(false)
  return {'ok'}
end
-- An earlier attempt may have been sent. Releasing would let the next caller send new
-- bytes; keep it in doubt (its TTL as it was) so the next caller resumes with the frozen
-- ones instead.
redis.call('HSET', key, 'state', 'in_doubt', 'sent', '1')
redis.call('HDEL', key, 'token', 'lease_until_ms')
-- [list index] in doubt now.
changed_state(key, 'in_doubt', now, 'in_flight')
release(true)
return {'ok'}
