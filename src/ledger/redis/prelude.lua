-- Shared by every ledger script (prepended at compile time; see mod.rs for the record layout).
--
-- Every script touches exactly one key, KEYS[1], and declares it, so the scripts stay valid
-- under any key-slot sharding (Redis Cluster).
--
-- Replies are arrays whose first element is a tag ('acquired', 'busy', 'resume', 'in_doubt',
-- 'replay', 'drift', 'released', 'ok', 'fenced', 'corrupt'), never Lua errors, so the Rust
-- side can tell a refused write from a broken server.
--
-- A key without a record may hold a *released* marker instead: a hash with `v`, `state` =
-- 'released' and one field `released:<token>` per token the key was released under (see
-- abandon.lua), expiring a minute after the last release. It lives in the record's own key,
-- so every script still touches one key (one slot) and sees marker and record atomically.
-- To every script but begin, abandon and forget it is no record at all.
--
-- A token released while a record holds the key (another caller's, or one put in doubt)
-- is kept the same way beside that record: its `released:<token>` field, with
-- `released_until_ms` (Redis time) saying till when every such field of the key holds. When
-- the record leaves by a release or a forget, the fields still live stay as the key's
-- marker. (A record past its retention goes with its key's TTL, fields and all: retentions
-- are hours, the fields a minute.)

-- The record format this release writes and reads.
local VERSION = '1'

-- Redis's own clock in milliseconds. Leases are judged by this one clock, so clock skew
-- between application hosts can never make a live lease look expired. Redis 5+ replicates
-- a script's effects rather than the script, so reading the clock before writing is safe.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Whether a record read with HMGET (its `state` field as `state`) is a released marker.
local function is_marker(state)
  return state == 'released'
end

-- nil when the record can be read (or does not exist); a 'corrupt' reply otherwise.
-- `v` is the record's version field as HMGET returned it (false when missing).
local function unreadable(key, v)
  if v == false then
    -- A hash without a version was not written by us: refuse it rather than guess.
    if redis.call('EXISTS', key) == 1 then
      return {'corrupt', 'record has no format version'}
    end
    return nil
  end
  if v ~= VERSION then
    return {'corrupt', 'record format version ' .. v .. ' is not one this release understands'}
  end
  return nil
end

-- Whether a `begin` under a token is refused at `now`: `mark` is the key's
-- `released:<token>` field, `until_ms` its `released_until_ms` (absent in a marker an
-- earlier release wrote, which its TTL bounds instead), as HMGET returned them.
local function is_released(mark, until_ms, now)
  return mark ~= false and (until_ms == false or tonumber(until_ms) > now)
end

-- Turn what `key` holds into a marker of the tokens it is still released under at `now`
-- (every field but those goes), or delete it if none is. Answers whether a marker stayed.
local function keep_only_markers(key, now)
  local until_ms = tonumber(redis.call('HGET', key, 'released_until_ms') or 0)
  if until_ms <= now then
    redis.call('DEL', key)
    return false
  end
  for _, field in ipairs(redis.call('HKEYS', key)) do
    if field ~= 'released_until_ms' and string.sub(field, 1, 9) ~= 'released:' then
      redis.call('HDEL', key, field)
    end
  end
  redis.call('HSET', key, 'v', VERSION, 'state', 'released')
  redis.call('PEXPIRE', key, until_ms - now)
  return true
end
