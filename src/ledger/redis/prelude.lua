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
-- To every script but begin and abandon it is no record at all.

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

