-- begin: claim, resume, replay or refuse an operation, atomically.
--
-- KEYS[1]  the record
-- ARGV[1]  the caller's fingerprint (64 hex)
-- ARGV[2]  a fresh owner token (32 hex), made by the client: used only if ownership is handed out
-- ARGV[3]  the lease in ms
-- ARGV[4]  the retention in ms (the key's PX TTL)
-- ARGV[5]  '1' to take an in-doubt operation over (resume), '0' for a probe that changes nothing
-- ARGV[6]  a fresh generation (16 hex), made by the client: used only if the record is created
-- ARGV[7]  the encoded frozen request ('' or absent on the server side)
-- ARGV[8]  [list index] the scope's digest (16 hex), kept by the record for listing
-- ARGV[9]  '1' to answer only from a record already there, never to make one: the ask at
--          the key an earlier release kept the record at, on a cluster (see cluster.rs)
-- ARGV[10] the origin's face ('client', 'server' or 'tool'; '' for none)...
-- ARGV[11] ...its target...
-- ARGV[12] ...and, when an operation id named it, its task id...
-- ARGV[13] ...and step id (both absent otherwise)
-- KEYS[2..5] [list index] the listing indexes, on a single Redis (see prelude.lua)
local key = KEYS[1]
local fp, token = ARGV[1], ARGV[2]
local lease_ms, retention_ms = tonumber(ARGV[3]), ARGV[4]
local take_over = ARGV[5] == '1'
local generation = ARGV[6]
local frozen = ARGV[7]
-- [list index] an empty frozen request is none: the scope comes after it.
if frozen == '' then frozen = nil end
local scope = ARGV[8] or NO_SCOPE
local origin = ARGV[10] or ''

-- The frozen request and the outcome can be large: read them only when the answer needs them.
local r = redis.call('HMGET', key, 'v', 'fp', 'state', 'lease_until_ms', 'token', 'sent',
                     'released:' .. token, 'released_until_ms')
local bad = unreadable(key, r[1])
if bad then return bad end
local now = now_ms()

-- This caller released its token already: its `begin` arrived after its own release (it
-- was queued, or held up), and must not make a claim nobody would ever use, nor take over
-- the record that is there now.
if is_released(r[7], r[8], now) then
  return {'released'}
end
-- Not a record here (nothing, or only a released marker): the caller claims where this
-- release keeps records. The marker stays, for the tokens it names.
if ARGV[9] == '1' and (r[1] == false or is_marker(r[3])) then
  return {'elsewhere'}
end
if is_marker(r[3]) then
  -- No record, only the tokens the key was released under: anyone else finds the key
  -- absent, and the claim takes the marker's place and ends it.
  redis.call('DEL', key)
  r[1] = false
end

if r[1] == false then
  -- Absent (never seen, released, or past its retention). The lease is a field, not the
  -- key's TTL: when it runs out the record must still be there, in doubt, never absent.
  -- A new life of the key: its generation is kept, unchanged, until the record leaves.
  local fields = {'v', VERSION, 'fp', fp, 'state', 'in_flight', 'token', token,
                  'lease_until_ms', now + lease_ms, 'sent', '0', 'retention_ms', retention_ms,
                  'created_ms', now, 'attempts', 1, 'gen', generation}
  if frozen then
    fields[#fields + 1] = 'frozen'
    fields[#fields + 1] = frozen
  end
  -- [list index] the scope and the last change of state, for listing.
  fields[#fields + 1] = 'scope'
  fields[#fields + 1] = scope
  fields[#fields + 1] = 'touched_ms'
  fields[#fields + 1] = now
  -- What the record is of, for operators: kept by the claim that creates it only.
  if origin ~= '' then
    local kept = {'origin', origin, 'target', ARGV[11]}
    if ARGV[13] then
      kept[5], kept[6], kept[7], kept[8] = 'task', ARGV[12], 'step', ARGV[13]
    end
    for _, value in ipairs(kept) do fields[#fields + 1] = value end
  end
  -- The TTL is set in the same step as the record: no record ever exists without its
  -- retention, even if the caller dies the moment this script returns.
  redis.call('HSET', key, unpack(fields))
  redis.call('PEXPIRE', key, retention_ms)
  -- [list index] a new life of the key: listed in flight, from its claim.
  reindex(key, 'in_flight', now)
  sweep_indexes()
  return {'acquired'}
end

-- Same key, different payload: whatever the state, the caller regenerated its request.
-- Checked before the owner's token, so not even a retried `begin` of the owner can rebind
-- the key to other bytes.
if r[2] ~= fp then
  return {'drift', r[2], redis.call('HGET', key, 'frozen')}
end

local state = r[3]
if state == 'completed' then
  return {'replay', redis.call('HGET', key, 'outcome')}
elseif state == 'in_flight' and r[5] == token then
  -- Our own claim, asked for again because the reply to the first ask was lost: the same
  -- answer, so no claim is ever left that nobody holds.
  if r[6] == '1' then
    return {'resume', redis.call('HGET', key, 'frozen')}
  end
  return {'acquired'}
elseif state == 'in_flight' then
  local lease_until = tonumber(r[4])
  if lease_until == nil then
    return {'corrupt', 'in-flight record without a lease'}
  end
  -- The lease left is the longest anyone need wait: by then the owner has settled the
  -- record or renewed its lease, or the record reads as in doubt.
  if lease_until > now then
    return {'busy', lease_until - now}
  end
  -- The lease ran out: the owner may have sent and died. Fall through to resume.
elseif state ~= 'in_doubt' then
  return {'corrupt', 'unknown record state'}
end

-- In doubt (or an expired lease). A probe is told so, and nothing changes.
if not take_over then
  return {'in_doubt'}
end
-- Hand the operation over under the new token, with the bytes first frozen. Once resumed,
-- an earlier attempt may have been sent, so the record can never be released again
-- ('sent' = 1), only completed or put back in doubt. The key's TTL is left as it is: only
-- a completion or a failed attempt starts a record's retention again.
redis.call('HSET', key, 'state', 'in_flight', 'token', token, 'lease_until_ms', now + lease_ms,
           'sent', '1')
redis.call('HINCRBY', key, 'attempts', 1)
-- [list index] in flight again.
changed_state(key, 'in_flight', now, state)
return {'resume', redis.call('HGET', key, 'frozen')}
