-- Shared by every ledger script (prepended at compile time; see mod.rs for the record layout).
--
-- Every transition touches one record, KEYS[1], and declares it, so the scripts stay valid
-- under any key-slot sharding (Redis Cluster). The store also declares the record's listing
-- indexes (KEYS[2..5], see the index block below), which each transition keeps in step with
-- the record in the same script: on a cluster those of the record's bucket, in the record's
-- slot (see layout.rs). A record an earlier release wrote on a cluster is declared alone,
-- and nothing is indexed.
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

-- [list index] ---------------------------------------------------------------------------
-- Listing (list.lua) reads per-state sorted sets: member = the record key's 64 hex digits,
-- score = the record's `created_ms` (its place in the list; ties are ordered by member,
-- which is the key's byte order). Declared by the store beside each record (on a cluster,
-- those of the record's bucket):
--   KEYS[2] in flight, KEYS[3] in doubt, KEYS[4] completed, KEYS[5] the sweep's cursors.
-- Every transition moves its record's member in the same script as it writes the record,
-- so the indexes never disagree with the records, except for a record that left by its TTL,
-- which no script sees: its member stays until a list or the sweep below meets it.
local INDEXES = {{'in_flight', 2}, {'in_doubt', 3}, {'completed', 4}}
local SWEEP_KEY = 5
-- One claim in SWEEP_EVERY sweeps, looking at SWEEP_STEP members of each index: two
-- members per claim, more than the one a claim can add, so the sweep goes round an index
-- faster than the index grows, at a quarter of the commands a sweep on every claim takes.
local SWEEP_EVERY = 4
local SWEEP_STEP = 8
-- The scope of a record that has none (written before scopes were kept, or unscoped).
local NO_SCOPE = '0000000000000000'

local function indexed()
  return #KEYS >= SWEEP_KEY
end

-- The member of the record at `key` in an index: its 64 hex digits, without the prefix.
local function index_member(key)
  return string.sub(key, -64)
end

-- Put the record at `key` in `state`'s index (nil: in none), at `position` (its
-- `created_ms`; read from the record when not given), out of the index of `from`, the state
-- it was listed in (nil: none, for a new life of a key). A member the key's earlier life
-- left in another index (it left by its TTL) is not looked for: a list that meets it sees
-- the record in another state and drops it, and the sweep drops it once the record is gone.
local function reindex(key, state, position, from)
  if not indexed() or from == state then return end
  local member = index_member(key)
  for _, index in ipairs(INDEXES) do
    if index[1] == state then
      position = position or redis.call('HGET', key, 'created_ms')
      if position then
        redis.call('ZADD', KEYS[index[2]], position, member)
      end
    elseif index[1] == from then
      redis.call('ZREM', KEYS[index[2]], member)
    end
  end
end

-- The record at `key` changed state from `from` to `state` (nil: it is gone) at `now`:
-- stamp the change, for listing, and move its member.
local function changed_state(key, state, now, from)
  if state then
    redis.call('HSET', key, 'touched_ms', now)
  end
  reindex(key, state, nil, from)
end

-- Records leave by their TTL, unseen. Every SWEEP_EVERY-th claim looks at the next
-- SWEEP_STEP members of every index (a cursor by rank, kept in KEYS[5] with the count of
-- claims, going round) and drops those whose record is gone: each index is gone round
-- faster than it grows, so it holds at most about twice its live records, without any scan
-- of the keyspace. A member whose record is there in another state (left by the key's
-- earlier life, or by a script of an earlier release) goes when a list meets it.
local function sweep_indexes()
  if not indexed() then return end
  if redis.call('HINCRBY', KEYS[SWEEP_KEY], 'claims', 1) % SWEEP_EVERY ~= 0 then return end
  local prefix = string.sub(KEYS[1], 1, #KEYS[1] - 64)
  local cursors = redis.call('HMGET', KEYS[SWEEP_KEY], 'in_flight', 'in_doubt', 'completed')
  local met, records = {}, {}
  for i, index in ipairs(INDEXES) do
    local rank = tonumber(cursors[i] or 0) or 0
    local members = redis.call('ZRANGE', KEYS[index[2]], rank, rank + SWEEP_STEP - 1)
    met[i] = {rank = rank, members = members}
    for _, member in ipairs(members) do
      records[#records + 1] = prefix .. member
    end
  end
  -- Usually every record met is there: one EXISTS tells, and only a miss is looked for.
  local all_there = #records == 0 or redis.call('EXISTS', unpack(records)) == #records
  local moved = {}
  for i, index in ipairs(INDEXES) do
    local rank, members = met[i].rank, met[i].members
    for _, member in ipairs(members) do
      if not all_there and redis.call('EXISTS', prefix .. member) == 0 then
        redis.call('ZREM', KEYS[index[2]], member)
      else
        rank = rank + 1
      end
    end
    -- The end of the index: start again from the oldest.
    if #members < SWEEP_STEP then
      rank = 0
    end
    moved[#moved + 1] = index[1]
    moved[#moved + 1] = rank
  end
  redis.call('HSET', KEYS[SWEEP_KEY], unpack(moved))
end

-- The status of an encoded outcome: its encoding starts with the version, the tag, then the
-- status as a big-endian u16. Kept in the record by `complete`, so a look at a completed
-- record never reads its outcome, which may be large.
local function outcome_status(outcome)
  if outcome and #outcome >= 4 then
    return string.byte(outcome, 3) * 256 + string.byte(outcome, 4)
  end
  return 0
end

-- What inspect and list show of the record at `key`: {'record', state, fp, attempts, age_ms,
-- lease_left_ms, ttl_ms, sent, status, gen, created_ms, scope, touched_ago_ms, origin,
-- target, task, step} (origin '' for none, task and step nil for none), {'absent'}
-- (no record, or only a released marker) or a 'corrupt' reply. An in-flight record whose
-- lease ran out shows in flight with no lease left.
local function view_of(key, now)
  local r = redis.call('HMGET', key, 'v', 'state', 'fp', 'attempts', 'created_ms',
                       'lease_until_ms', 'sent', 'gen', 'scope', 'touched_ms', 'status',
                       'origin', 'target', 'task', 'step')
  local bad = unreadable(key, r[1])
  if bad then return bad end
  if r[1] == false or is_marker(r[2]) then
    return {'absent'}
  end
  local status = 0
  if r[2] == 'completed' then
    -- A record completed by an earlier release keeps no status of its own.
    status = tonumber(r[11]) or outcome_status(redis.call('HGET', key, 'outcome'))
  end
  local created = tonumber(r[5] or 0)
  -- A record an earlier release wrote has no `touched_ms`: last touched when created.
  local touched = tonumber(r[10] or created)
  -- The generation, and `created_ms` itself: a record an earlier release wrote has no `gen`,
  -- and its generation is derived from when it was created (see codec.rs).
  return {'record', r[2], r[3], tonumber(r[4] or 0), now - created,
          math.max(0, tonumber(r[6] or 0) - now), redis.call('PTTL', key), r[7] or '0', status,
          r[8] or '', created, r[9] or NO_SCOPE, math.max(0, now - touched),
          r[12] or '', r[13] or '', r[14], r[15]}
end
-- [list index] end -------------------------------------------------------------------------
