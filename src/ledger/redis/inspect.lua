-- inspect: a read-only look at a record, for tests and operators. Writes nothing.
--
-- KEYS[1]  the record
local key = KEYS[1]

local r = redis.call('HMGET', key, 'v', 'state', 'fp', 'attempts', 'created_ms', 'lease_until_ms',
                     'sent', 'gen')
local bad = unreadable(key, r[1])
if bad then return bad end
if r[1] == false or is_marker(r[2]) then
  return {'absent'}
end
local status = 0
if r[2] == 'completed' then
  -- The outcome's status: its encoding starts with the version, the tag, then the status
  -- as a big-endian u16.
  local outcome = redis.call('HGET', key, 'outcome')
  if outcome and #outcome >= 4 then
    status = string.byte(outcome, 3) * 256 + string.byte(outcome, 4)
  end
end
-- The generation, and `created_ms` itself: a record an earlier release wrote has no `gen`,
-- and its generation is derived from when it was created (see codec.rs).
return {'record', r[2], r[3], tonumber(r[4] or 0), now_ms() - tonumber(r[5] or 0),
        math.max(0, tonumber(r[6] or 0) - now_ms()), redis.call('PTTL', key), r[7] or '0', status,
        r[8] or '', tonumber(r[5] or 0)}
