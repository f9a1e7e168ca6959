-- inspect: a read-only look at a record, for tests and operators. Writes nothing.
--
-- KEYS[1]  the record
--
-- The view (see view_of), and after it, last, the frozen request while the operation is open
-- (false, a nil reply, when completed or made without one): a completed record keeps its
-- request only to judge drift, and nothing will be resent.
local view = view_of(KEYS[1], now_ms())
if view[1] == 'record' then
  local frozen = false
  if view[2] ~= 'completed' then
    frozen = redis.call('HGET', KEYS[1], 'frozen')
  end
  view[#view + 1] = frozen
end
return view
