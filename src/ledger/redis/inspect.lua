-- inspect: a read-only look at a record, for tests and operators. Writes nothing.
--
-- KEYS[1]  the record
return view_of(KEYS[1], now_ms())
