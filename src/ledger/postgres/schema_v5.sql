-- Version 5: what a record is of (its origin)
--
-- An operator listing operations in doubt sees hashes only: which orchestrator step, which
-- endpoint a record is of, it cannot tell. Each record now keeps its claim's origin
-- (`ledger::Origin`): the face that made it (`origin_face`: 'client', 'server' or 'tool'),
-- what it acts on (`origin_target`: `METHOD scheme://host/path`, `METHOD /path` or a tool's
-- name) and, when an `OperationId` named the operation, its `origin_task` and
-- `origin_step`. All nullable: a row an earlier version wrote, or a claim made without an
-- origin (a previous release's during a rolling upgrade), has none, and no row is
-- rewritten.
--
-- Kept as version 4 keeps the scope: by the trigger that starts a new life of a key, from
-- settings local to the claim's transaction, which `origin_begin_op` and
-- `origin_claim_op` set (each value behind a leading '=', so an empty id is not "none").
-- A claim with no settings, a previous release's, is of no origin; any other change of
-- state keeps the life's origin as it is.
--
-- A list filters by origin as it walks a state's index (a target's prefix, a tool, a task):
-- within the walk's budget, as the status filter is, never a scan of its own.

ALTER TABLE {schema}.records ADD COLUMN origin_face text;
ALTER TABLE {schema}.records ADD COLUMN origin_target text;
ALTER TABLE {schema}.records ADD COLUMN origin_task text;
ALTER TABLE {schema}.records ADD COLUMN origin_step text;

-- A claim's setting `p_name`, as `origin_begin_op` writes it: NULL when unset or empty,
-- else the value after its leading '='.
CREATE FUNCTION {schema}.claim_setting(p_name text)
RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN left(current_setting(p_name, true), 1) = '='
                THEN substr(current_setting(p_name, true), 2) END
$$;

-- touch_record, as in version 4, also keeping the claim's origin when a new life starts.
CREATE OR REPLACE FUNCTION {schema}.touch_record()
RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' OR NEW.generation IS DISTINCT FROM OLD.generation
       OR NEW.created_at IS DISTINCT FROM OLD.created_at THEN
        NEW.touched_at := NEW.created_at;
        NEW.scope := coalesce(nullif(current_setting('tower_idempotency.claim_scope', true), '')::bigint, 0);
        NEW.origin_face := {schema}.claim_setting('tower_idempotency.claim_origin');
        NEW.origin_target := {schema}.claim_setting('tower_idempotency.claim_target');
        NEW.origin_task := {schema}.claim_setting('tower_idempotency.claim_task');
        NEW.origin_step := {schema}.claim_setting('tower_idempotency.claim_step');
    ELSE
        NEW.touched_at := clock_timestamp();
    END IF;
    RETURN NEW;
END
$$;

-- Name the origin of the claim this transaction is about to make (NULLs: none), or clear it.
CREATE FUNCTION {schema}.set_claim_origin(
    p_origin text, p_target text, p_task text, p_step text)
RETURNS void
LANGUAGE sql AS $$
    SELECT set_config('tower_idempotency.claim_origin', coalesce('=' || p_origin, ''), true),
           set_config('tower_idempotency.claim_target', coalesce('=' || p_target, ''), true),
           set_config('tower_idempotency.claim_task', coalesce('=' || p_task, ''), true),
           set_config('tower_idempotency.claim_step', coalesce('=' || p_step, ''), true)
$$;

-- scoped_begin_op, the record a claim creates being of the origin p_origin (NULL: none).
CREATE FUNCTION {schema}.origin_begin_op(
    p_key bytea, p_fp bytea, p_token bytea, p_lease_ms bigint, p_retention_ms bigint,
    p_take_over boolean, p_frozen bytea, p_scope bigint,
    p_origin text, p_target text, p_task text, p_step text,
    OUT r_answer text, OUT r_wait_ms bigint, OUT r_fp bytea, OUT r_frozen bytea,
    OUT r_outcome bytea)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM {schema}.set_claim_origin(p_origin, p_target, p_task, p_step);
    SELECT b.r_answer, b.r_wait_ms, b.r_fp, b.r_frozen, b.r_outcome
      INTO r_answer, r_wait_ms, r_fp, r_frozen, r_outcome
      FROM {schema}.scoped_begin_op(p_key, p_fp, p_token, p_lease_ms, p_retention_ms,
                                    p_take_over, p_frozen, p_scope) b;
    PERFORM {schema}.set_claim_origin(NULL, NULL, NULL, NULL);
END
$$;

-- scoped_claim_op (the transactional mode's claim) of the origin p_origin.
CREATE FUNCTION {schema}.origin_claim_op(
    p_key bytea, p_fp bytea, p_token bytea, p_lease_ms bigint, p_retention_ms bigint,
    p_take_over boolean, p_frozen bytea, p_lock bigint, p_scope bigint,
    p_origin text, p_target text, p_task text, p_step text,
    OUT r_answer text, OUT r_wait_ms bigint, OUT r_fp bytea, OUT r_frozen bytea,
    OUT r_outcome bytea)
RETURNS SETOF record
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM {schema}.set_claim_origin(p_origin, p_target, p_task, p_step);
    RETURN QUERY SELECT * FROM {schema}.scoped_claim_op(p_key, p_fp, p_token, p_lease_ms,
                                                         p_retention_ms, p_take_over, p_frozen,
                                                         p_lock, p_scope);
    PERFORM {schema}.set_claim_origin(NULL, NULL, NULL, NULL);
END
$$;

-- inspect_op, as in version 4, showing the record's origin. Its columns change, so it is
-- made anew (a previous release names the columns it reads).
DROP FUNCTION {schema}.inspect_op(bytea);
CREATE FUNCTION {schema}.inspect_op(
    p_key bytea,
    OUT r_state text, OUT r_fp bytea, OUT r_attempts integer, OUT r_age_ms bigint,
    OUT r_lease_left_ms bigint, OUT r_retention_left_ms bigint, OUT r_sent boolean,
    OUT r_status smallint, OUT r_generation bigint, OUT r_touched_ms bigint,
    OUT r_scope bigint, OUT r_origin text, OUT r_target text, OUT r_task text,
    OUT r_step text)
RETURNS SETOF record
LANGUAGE sql AS $$
    SELECT t.state, t.fingerprint, t.attempts,
           greatest(0, floor(extract(epoch FROM c.now - t.created_at) * 1000))::bigint,
           greatest(0, floor(extract(epoch FROM coalesce(t.lease_until, c.now) - c.now) * 1000))::bigint,
           greatest(0, floor(extract(epoch FROM t.retain_until - c.now) * 1000))::bigint,
           t.sent, t.status, {schema}.generation_of(t.generation, t.created_at),
           greatest(0, floor(extract(epoch FROM c.now - coalesce(t.touched_at, t.created_at)) * 1000))::bigint,
           t.scope, t.origin_face, t.origin_target, t.origin_task, t.origin_step
      FROM {schema}.records t, (SELECT clock_timestamp() AS now) c
     WHERE t.key = p_key AND t.retain_until > c.now AND t.state <> 'released'
$$;
