-- Version 4, part 2: listing records (scope, touched_at, indexes, list_op)
--
-- An operator lists records by state, status, age and scope, newest or oldest first, a page
-- at a time (`IdempotencyStore::list`). Each record now keeps the digest of its claim's
-- scope (`scope`, `ledger::scope_id`'s 64 bits as a bigint; 0 for none) and when it last
-- changed state (`touched_at`), and two indexes let a page walk the records of one state
-- (of one scope) in the order of their claims, `(created_at, key)`, from a cursor: a page
-- reads about as many index entries as it lists, however many records the table holds.
--
-- Both columns are kept by a trigger rather than by each transition: every function that
-- changes a record's state (this release's, the transactional mode's, and a previous
-- release's during a rolling upgrade) keeps them without being written again. A record's
-- scope is its claim's: `scoped_begin_op` and `scoped_claim_op` name it in a setting local
-- to the claim's transaction, which the trigger reads when a new life of the key starts
-- (a claim with no setting, a previous release's, is of no scope).
--
-- The list itself is one statement the store writes for each shape of query (with or
-- without a scope, a cursor; newest or oldest first), so each is planned on the index it
-- walks (see list.rs); it reads the record as `inspect_op` does.
--
-- Rows an earlier version wrote get scope 0 and no `touched_at` (a constant default and a
-- nullable column: no rewrite of the table); their last change reads as their claim.

ALTER TABLE {schema}.records ADD COLUMN scope bigint NOT NULL DEFAULT 0;
ALTER TABLE {schema}.records ADD COLUMN touched_at timestamptz;

-- A new life of a key (a claim inserting it, or taking the place of a marker or an expired
-- record) starts touched at its claim and in the claim's scope; any other change of state
-- (resumed, marked in doubt, completed, released) touches it now.
CREATE FUNCTION {schema}.touch_record()
RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' OR NEW.generation IS DISTINCT FROM OLD.generation
       OR NEW.created_at IS DISTINCT FROM OLD.created_at THEN
        NEW.touched_at := NEW.created_at;
        NEW.scope := coalesce(nullif(current_setting('tower_idempotency.claim_scope', true), '')::bigint, 0);
    ELSE
        NEW.touched_at := clock_timestamp();
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER records_touched_on_insert BEFORE INSERT ON {schema}.records
    FOR EACH ROW EXECUTE FUNCTION {schema}.touch_record();
-- Only a change of state, of life or of attempts (a resume under an expired lease stays in
-- flight) touches a record: a renewal, the hottest update, does not run the trigger at all.
CREATE TRIGGER records_touched_on_change BEFORE UPDATE ON {schema}.records
    FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state
          OR OLD.attempts IS DISTINCT FROM NEW.attempts
          OR OLD.generation IS DISTINCT FROM NEW.generation
          OR OLD.created_at IS DISTINCT FROM NEW.created_at)
    EXECUTE FUNCTION {schema}.touch_record();

-- A page of one state's records, in claim order, from a cursor: one index range each.
CREATE INDEX records_by_state ON {schema}.records (state, created_at, key);
-- The same within one scope.
CREATE INDEX records_by_scope ON {schema}.records (scope, state, created_at, key);

-- begin_op in the scope p_scope: the record a claim creates is of that scope.
CREATE FUNCTION {schema}.scoped_begin_op(
    p_key bytea, p_fp bytea, p_token bytea, p_lease_ms bigint, p_retention_ms bigint,
    p_take_over boolean, p_frozen bytea, p_scope bigint,
    OUT r_answer text, OUT r_wait_ms bigint, OUT r_fp bytea, OUT r_frozen bytea,
    OUT r_outcome bytea)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('tower_idempotency.claim_scope', p_scope::text, true);
    SELECT b.r_answer, b.r_wait_ms, b.r_fp, b.r_frozen, b.r_outcome
      INTO r_answer, r_wait_ms, r_fp, r_frozen, r_outcome
      FROM {schema}.begin_op(p_key, p_fp, p_token, p_lease_ms, p_retention_ms, p_take_over,
                             p_frozen) b;
    -- The rest of a transactional-mode transaction is the handler's: no claim of its own.
    PERFORM set_config('tower_idempotency.claim_scope', '', true);
END
$$;

-- claim_op (the transactional mode's claim) in the scope p_scope.
CREATE FUNCTION {schema}.scoped_claim_op(
    p_key bytea, p_fp bytea, p_token bytea, p_lease_ms bigint, p_retention_ms bigint,
    p_take_over boolean, p_frozen bytea, p_lock bigint, p_scope bigint,
    OUT r_answer text, OUT r_wait_ms bigint, OUT r_fp bytea, OUT r_frozen bytea,
    OUT r_outcome bytea)
RETURNS SETOF record
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('tower_idempotency.claim_scope', p_scope::text, true);
    RETURN QUERY SELECT * FROM {schema}.claim_op(p_key, p_fp, p_token, p_lease_ms,
                                                  p_retention_ms, p_take_over, p_frozen,
                                                  p_lock);
    PERFORM set_config('tower_idempotency.claim_scope', '', true);
END
$$;

-- inspect_op, as in version 3, showing when the record was last touched and its scope. Its
-- columns change, so it is made anew (a previous release names the columns it reads).
DROP FUNCTION {schema}.inspect_op(bytea);
CREATE FUNCTION {schema}.inspect_op(
    p_key bytea,
    OUT r_state text, OUT r_fp bytea, OUT r_attempts integer, OUT r_age_ms bigint,
    OUT r_lease_left_ms bigint, OUT r_retention_left_ms bigint, OUT r_sent boolean,
    OUT r_status smallint, OUT r_generation bigint, OUT r_touched_ms bigint,
    OUT r_scope bigint)
RETURNS SETOF record
LANGUAGE sql AS $$
    SELECT t.state, t.fingerprint, t.attempts,
           greatest(0, floor(extract(epoch FROM c.now - t.created_at) * 1000))::bigint,
           greatest(0, floor(extract(epoch FROM coalesce(t.lease_until, c.now) - c.now) * 1000))::bigint,
           greatest(0, floor(extract(epoch FROM t.retain_until - c.now) * 1000))::bigint,
           t.sent, t.status, {schema}.generation_of(t.generation, t.created_at),
           greatest(0, floor(extract(epoch FROM c.now - coalesce(t.touched_at, t.created_at)) * 1000))::bigint,
           t.scope
      FROM {schema}.records t, (SELECT clock_timestamp() AS now) c
     WHERE t.key = p_key AND t.retain_until > c.now AND t.state <> 'released'
$$;
