-- list: a page of records from the per-state indexes (see the index block of prelude.lua),
-- newest or oldest first, looking at a bounded number of index entries. Writes no record:
-- it only drops the index members of records that left by their TTL.
--
-- It reads the records its indexes name, keys it cannot declare before it has read the
-- indexes: on a cluster, one call per bucket, whose records and indexes share one slot.
--
-- KEYS[1..n]  the indexes of the states listed, each ending in ':<state>'
-- ARGV[1]   the records' key prefix
-- ARGV[2]   'newest' or 'oldest': which come first
-- ARGV[3]   the most records the page holds
-- ARGV[4]   the most index entries the page looks at
-- ARGV[5]   the cursor's position ('' without a cursor): the page starts after it...
-- ARGV[6]   ...and the cursor's member (64 hex), which orders ties in position
-- ARGV[7]   records first claimed at least this many ms ago only ('' for any)
-- ARGV[8]   records first claimed less than this many ms ago only ('' for any)
-- ARGV[9]   completed records of at least this status only ('' for any)...
-- ARGV[10]  ...and at most this one
-- ARGV[11]  records of this scope only (16 hex, '' for any)
-- ARGV[12]  records whose origin's target starts with what follows a leading '=' ('' for any)
-- ARGV[13]  records of calls of the tool named after a leading '=' ('' for any)
-- ARGV[14]  records of the task named after a leading '=' ('' for any)
--
-- Reply: {'page', next, records}: next is {} at the end of the list, else {position,
-- member} to go on after; each record is {member, view} with view as view_of shows it.
local prefix = ARGV[1]
local newest = ARGV[2] == 'newest'
local limit, budget = tonumber(ARGV[3]), tonumber(ARGV[4])
local cursor_position, cursor_member = tonumber(ARGV[5]), ARGV[6]
local older_ms, newer_ms = tonumber(ARGV[7]), tonumber(ARGV[8])
local status_low, status_high = tonumber(ARGV[9]), tonumber(ARGV[10])
local scope = ARGV[11]
-- The origin filters: nil for none.
local function filter(arg)
  if arg and string.sub(arg, 1, 1) == '=' then return string.sub(arg, 2) end
  return nil
end
local target_prefix, tool, task = filter(ARGV[12]), filter(ARGV[13]), filter(ARGV[14])
local by_origin = target_prefix or tool or task
local now = now_ms()

-- The age filters are ranges of claim times, so of index scores: applied by the range
-- queries, they cost nothing per record left out. Scores are whole milliseconds.
local lowest, highest = -math.huge, math.huge
if older_ms then highest = now - older_ms end
if newer_ms then lowest = now - newer_ms + 1 end

local function score_text(score)
  if score == math.huge then return '+inf' end
  if score == -math.huge then return '-inf' end
  return string.format('%.0f', score)
end

-- Whether the entry (a_position, a_member) comes before (b_position, b_member) in the list.
local function before(a_position, a_member, b_position, b_member)
  if a_position ~= b_position then
    if newest then return a_position > b_position end
    return a_position < b_position
  end
  if newest then return a_member > b_member end
  return a_member < b_member
end

-- Entries fetched from an index at a time.
local batch = math.min(budget + 1, math.max(limit + 1, 100))

-- One index walked in the list's order: a buffer of entries, refilled from after the last
-- entry taken (`from`, the cursor at first).
local streams = {}
for i, set in ipairs(KEYS) do
  streams[i] = {set = set, state = string.match(set, ':([%a_]+)$'), buffer = {}, at = 1,
                done = false, from = cursor_position and {cursor_position, cursor_member}}
end

local function refill(stream)
  local low, high, ties = lowest, highest, 0
  local from = stream.from
  if from then
    if newest then high = math.min(high, from[1]) else low = math.max(low, from[1]) end
    -- Entries sharing the last one's position come back again from an inclusive bound:
    -- ask for that many more, so each refill moves on. Only as many as were claimed in
    -- that millisecond.
    ties = redis.call('ZCOUNT', stream.set, score_text(from[1]), score_text(from[1]))
  end
  stream.buffer, stream.at = {}, 1
  if low > high then
    stream.done = true
    return
  end
  local want = batch + ties
  local reply
  if newest then
    reply = redis.call('ZREVRANGEBYSCORE', stream.set, score_text(high), score_text(low),
                       'WITHSCORES', 'LIMIT', 0, want)
  else
    reply = redis.call('ZRANGEBYSCORE', stream.set, score_text(low), score_text(high),
                       'WITHSCORES', 'LIMIT', 0, want)
  end
  stream.done = #reply / 2 < want
  for i = 1, #reply, 2 do
    local member, position = reply[i], tonumber(reply[i + 1])
    if not from or before(from[1], from[2], position, member) then
      stream.buffer[#stream.buffer + 1] = {position, member}
    end
  end
end

-- The stream's next entry, or nil when it has none left.
local function head(stream)
  while stream.at > #stream.buffer do
    if stream.done then return nil end
    refill(stream)
  end
  return stream.buffer[stream.at]
end

-- The stream whose next entry comes first, with that entry.
local function first()
  local best, entry
  for _, stream in ipairs(streams) do
    local e = head(stream)
    if e and (not entry or before(e[1], e[2], entry[1], entry[2])) then
      best, entry = stream, e
    end
  end
  return best, entry
end

-- Whether a record of this origin (face, target, task: nil or '' when it has none) passes
-- the origin filters.
local function origin_passes(face, target, of_task)
  if not by_origin then return true end
  if face == nil or face == false or face == '' then return false end
  if target_prefix and string.sub(target, 1, #target_prefix) ~= target_prefix then
    return false
  end
  if tool and (face ~= 'tool' or target ~= tool) then return false end
  if task and of_task ~= task then return false end
  return true
end

-- A first look at the record at `key`, listed in `state`'s index: 'gone' (it left, or is
-- in another state now), 'no' (it does not pass the scope, status or origin filter) or
-- 'maybe' (a whole view decides). Four short fields (and three more for a list by origin):
-- most entries a page passes over cost no more.
local function glance(key, state)
  local r = redis.call('HMGET', key, 'v', 'state', 'scope', 'status')
  if r[1] == false or r[2] ~= state then
    -- An unreadable record (no version, or another state name) is judged by the view.
    if redis.call('EXISTS', key) == 0 or r[1] == VERSION then return 'gone' end
    return 'maybe'
  end
  if scope ~= '' and (r[3] or NO_SCOPE) ~= scope then return 'no' end
  local status = tonumber(r[4])
  if status_low and status and (status < status_low or status > status_high) then
    return 'no'
  end
  if by_origin then
    -- Read only by a list that filters on them: a target is longer than the fields above.
    local o = redis.call('HMGET', key, 'origin', 'target', 'task')
    if not origin_passes(o[1], o[2] or '', o[3]) then return 'no' end
  end
  return 'maybe'
end

local function passes(view)
  if scope ~= '' and view[12] ~= scope then return false end
  if not origin_passes(view[14], view[15], view[16]) then return false end
  if status_low and view[2] == 'completed' then
    return view[9] >= status_low and view[9] <= status_high
  end
  return true
end

local records, looked, last = {}, 0, nil
while true do
  local stream, entry = first()
  if not stream then
    return {'page', {}, records}
  end
  -- More entries are left: a full page, or one that looked at all it may, goes on after
  -- its last record, or after the last entry it looked at.
  if #records >= limit then
    local kept = records[#records]
    return {'page', {kept[2][11], kept[1]}, records}
  end
  if looked >= budget then
    return {'page', {last[1], last[2]}, records}
  end
  stream.at = stream.at + 1
  stream.from = entry
  looked = looked + 1
  last = entry
  local member = entry[2]
  local key = prefix .. member
  local first_look = glance(key, stream.state)
  if first_look == 'gone' then
    -- Left by its TTL (or, for a record an earlier release moved, in another state now):
    -- its member goes, and the list goes on.
    redis.call('ZREM', stream.set, member)
  elseif first_look == 'maybe' then
    local view = view_of(key, now)
    if view[1] == 'corrupt' then
      view[2] = 'listing ' .. key .. ': ' .. view[2]
      return view
    end
    if view[1] == 'absent' or view[2] ~= stream.state then
      redis.call('ZREM', stream.set, member)
    elseif passes(view) then
      records[#records + 1] = {member, view}
    end
  end
end
