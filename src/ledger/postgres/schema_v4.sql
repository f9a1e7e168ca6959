-- Version 4, part 1: a released token is remembered while another caller holds the key
--
-- Version 2 left a key released under a token (a marker row) when `abandon_op` released the
-- token's claim or found no record, but not when it found another caller's record: a
-- `begin` of that token whose answer was lost, landing once that record had left (released,
-- forgotten, past its retention), then claimed the key under a token nobody uses, and the
-- key read busy, then in doubt. Now every `abandon_op` remembers its token, whatever it
-- finds: beside a record, in the record's own `released` column, with `released_until`
-- saying till when (a marker row keeps both too; one version 2 or 3 wrote has no
-- `released_until`, and its `retain_until` says the same). `begin_op` refuses a released
-- token whatever the row is, and the row carries the tokens past the record's leaving: a
-- release or a forget turns it into a marker row while they last, and the sweep keeps a
-- record past its retention while they last. Only a new claim of the key ends them.

ALTER TABLE {schema}.records ADD COLUMN released_until timestamptz;

-- Whether a row refuses a `begin` under p_token at p_now: released under it, till
-- `released_until` (or, for a marker row an earlier version wrote, its `retain_until`).
CREATE FUNCTION {schema}.is_released(
    p_released bytea[], p_released_until timestamptz, p_retain_until timestamptz,
    p_token bytea, p_now timestamptz)
RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
    SELECT coalesce(p_token = ANY (p_released)
                    AND coalesce(p_released_until, p_retain_until) > p_now, false)
$$;

-- The tokens a row is released under once p_token is added at p_now: the others only while
-- they last (every token of a key ends together, a minute after its last release).
CREATE FUNCTION {schema}.released_with(
    p_released bytea[], p_released_until timestamptz, p_retain_until timestamptz,
    p_token bytea, p_now timestamptz)
RETURNS bytea[]
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN coalesce(p_released_until, p_retain_until) > p_now
                THEN array_append(array_remove(p_released, p_token), p_token)
                ELSE ARRAY[p_token] END
$$;

-- begin_op, as in version 3, refusing a released token whatever the row holds.
CREATE OR REPLACE FUNCTION {schema}.begin_op(
    p_key bytea, p_fp bytea, p_token bytea, p_lease_ms bigint, p_retention_ms bigint,
    p_take_over boolean, p_frozen bytea,
    OUT r_answer text, OUT r_wait_ms bigint, OUT r_fp bytea, OUT r_frozen bytea,
    OUT r_outcome bytea)
LANGUAGE plpgsql AS $$
DECLARE
    now_ timestamptz;
    rec {schema}.records%ROWTYPE;
BEGIN
    FOR attempt IN 1..8 LOOP
        now_ := clock_timestamp();
        -- The fresh-operation path: one index probe and one insert. A concurrent insert of
        -- the same key makes this wait for that transaction, then do nothing.
        INSERT INTO {schema}.records AS t
            (key, fingerprint, state, token, lease_until, sent, created_at, retain_until,
             attempts, frozen, generation)
        VALUES (p_key, p_fp, 'in_flight', p_token, now_ + p_lease_ms * interval '1 millisecond',
                false, now_, now_ + p_retention_ms * interval '1 millisecond', 1, p_frozen,
                nextval('{schema}.record_generations'))
        ON CONFLICT (key) DO NOTHING;
        IF FOUND THEN
            r_answer := 'acquired';
            RETURN;
        END IF;

        -- A plain read: replays, busy and drift answers take no row lock and write nothing.
        SELECT * INTO rec FROM {schema}.records t WHERE t.key = p_key;
        IF NOT FOUND THEN
            CONTINUE; -- released or swept in between: claim again
        END IF;
        now_ := clock_timestamp();

        -- This caller released its token already: its `begin` arrived after its own release
        -- (queued, or held up), and must not make a claim nobody would ever use, nor take
        -- over the record that is there now (whatever it is, past its retention too).
        IF {schema}.is_released(rec.released, rec.released_until, rec.retain_until, p_token, now_)
        THEN
            r_answer := 'released';
            RETURN;
        END IF;

        IF rec.retain_until <= now_ THEN
            -- Past its retention the record is absent: a new claim takes its place.
            UPDATE {schema}.records t
               SET fingerprint = p_fp, state = 'in_flight', token = p_token,
                   lease_until = now_ + p_lease_ms * interval '1 millisecond', sent = false,
                   created_at = now_, retain_until = now_ + p_retention_ms * interval '1 millisecond',
                   attempts = 1, frozen = p_frozen, outcome = NULL, status = NULL, released = NULL,
                   released_until = NULL, generation = nextval('{schema}.record_generations')
             WHERE t.key = p_key AND t.retain_until <= now_
               AND NOT {schema}.is_released(t.released, t.released_until, t.retain_until,
                                            p_token, now_);
            IF FOUND THEN
                r_answer := 'acquired';
                RETURN;
            END IF;
            CONTINUE;
        END IF;

        IF rec.state = 'released' THEN
            -- No record, only the tokens the key was released under (not this caller's).
            -- Anyone else finds the key absent: the claim takes the marker's place, unless
            -- this token was released meanwhile (the re-checked condition then fails).
            UPDATE {schema}.records t
               SET fingerprint = p_fp, state = 'in_flight', token = p_token,
                   lease_until = now_ + p_lease_ms * interval '1 millisecond', sent = false,
                   created_at = now_, retain_until = now_ + p_retention_ms * interval '1 millisecond',
                   attempts = 1, frozen = p_frozen, outcome = NULL, status = NULL, released = NULL,
                   released_until = NULL, generation = nextval('{schema}.record_generations')
             WHERE t.key = p_key AND t.state = 'released' AND t.retain_until > now_
               AND NOT (p_token = ANY (t.released));
            IF FOUND THEN
                r_answer := 'acquired';
                RETURN;
            END IF;
            CONTINUE;
        END IF;

        -- Same key, another payload: whatever the state, the caller regenerated its request.
        IF rec.fingerprint <> p_fp THEN
            r_answer := 'drift';
            r_fp := rec.fingerprint;
            r_frozen := rec.frozen;
            RETURN;
        END IF;

        IF rec.state = 'completed' THEN
            r_answer := 'replay';
            r_outcome := rec.outcome;
            RETURN;
        END IF;

        IF rec.state = 'in_flight' AND rec.token = p_token THEN
            -- Our own claim, asked for again because the first reply was lost.
            IF rec.sent THEN
                r_answer := 'resume';
                r_frozen := rec.frozen;
            ELSE
                r_answer := 'acquired';
            END IF;
            RETURN;
        END IF;

        IF rec.state = 'in_flight' AND rec.lease_until > now_ THEN
            r_answer := 'busy';
            r_wait_ms := greatest(1, ceil(extract(epoch FROM rec.lease_until - now_) * 1000))::bigint;
            RETURN;
        END IF;

        -- In doubt, or in flight under an expired lease (the owner may have sent and died).
        -- A probe is told so and changes nothing.
        IF NOT p_take_over THEN
            r_answer := 'in_doubt';
            RETURN;
        END IF;

        -- Hand the operation over under the caller's token, if it is still what we read.
        -- The retention is left as it is: only a completion or a failed attempt renews it.
        -- "What we read" is pinned by the generation (a record replaced after its retention,
        -- or forgotten and claimed again, has another; `created_at` too, for a row an
        -- earlier version wrote) and by the token (another caller's resume in between
        -- changed it): either way this caller must not take it over.
        UPDATE {schema}.records t
           SET state = 'in_flight', token = p_token,
               lease_until = now_ + p_lease_ms * interval '1 millisecond', sent = true,
               attempts = t.attempts + 1
         WHERE t.key = p_key AND t.fingerprint = p_fp AND t.created_at = rec.created_at
           AND t.generation IS NOT DISTINCT FROM rec.generation
           AND t.retain_until > now_
           AND (t.state = 'in_doubt' OR (t.state = 'in_flight' AND t.lease_until <= now_))
           AND t.token IS NOT DISTINCT FROM rec.token
           AND NOT {schema}.is_released(t.released, t.released_until, t.retain_until,
                                        p_token, now_);
        IF FOUND THEN
            r_answer := 'resume';
            r_frozen := rec.frozen;
            RETURN;
        END IF;
    END LOOP;
    -- Eight reads each overtaken by another writer: a storm on one key. Raised rather than
    -- answered, so the caller gets an error (and fails closed), never a guessed answer.
    RAISE EXCEPTION 'the ledger record kept changing while it was claimed'
        USING ERRCODE = 'serialization_failure';
END
$$;

-- abandon_op, as in version 2, remembering the token whatever it finds: beside another
-- caller's record (answered false, nothing of this token's released) too, and beside its
-- own record put in doubt; a release keeps the tokens the record carried.
CREATE OR REPLACE FUNCTION {schema}.abandon_op(p_key bytea, p_token bytea, p_released_ms bigint)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    now_ timestamptz;
    until_ timestamptz;
BEGIN
    FOR attempt IN 1..8 LOOP
        now_ := clock_timestamp();
        until_ := now_ + p_released_ms * interval '1 millisecond';
        -- No row: this token's `begin` may not have arrived yet. Inserted as a claim is, so
        -- a `begin` inserting the key at the same moment and this wait for each other.
        INSERT INTO {schema}.records AS t
            (key, fingerprint, state, created_at, retain_until, attempts, released,
             released_until)
        VALUES (p_key, '\x'::bytea, 'released', now_, until_, 0, ARRAY[p_token], until_)
        ON CONFLICT (key) DO NOTHING;
        IF FOUND THEN
            RETURN false;
        END IF;

        -- Our own claim, nothing sent: released, and a retried `begin` of it still queued
        -- finds the key released, as do the tokens released while the record was there.
        UPDATE {schema}.records t
           SET fingerprint = '\x'::bytea, state = 'released', token = NULL, lease_until = NULL,
               sent = false, created_at = now_, retain_until = until_, attempts = 0,
               frozen = NULL, outcome = NULL, status = NULL,
               released = {schema}.released_with(t.released, t.released_until, t.retain_until,
                                                 p_token, now_),
               released_until = until_
         WHERE t.key = p_key AND t.state = 'in_flight' AND t.token = p_token
           AND t.retain_until > now_ AND NOT t.sent;
        IF FOUND THEN
            RETURN true;
        END IF;

        -- Our own claim, an earlier attempt of which may have been sent: in doubt, and the
        -- token remembered beside it (a retried `begin` of it must not take it over).
        UPDATE {schema}.records t
           SET state = 'in_doubt', token = NULL, lease_until = NULL, sent = true,
               released = {schema}.released_with(t.released, t.released_until, t.retain_until,
                                                 p_token, now_),
               released_until = until_
         WHERE t.key = p_key AND t.state = 'in_flight' AND t.token = p_token
           AND t.retain_until > now_;
        IF FOUND THEN
            RETURN true;
        END IF;

        -- A marker (add this token, all of them kept a while longer), or a record past its
        -- retention (no record: a marker takes its place, with the tokens it carried).
        UPDATE {schema}.records t
           SET fingerprint = '\x'::bytea, state = 'released', token = NULL, lease_until = NULL,
               sent = false, created_at = now_, retain_until = until_, attempts = 0,
               frozen = NULL, outcome = NULL, status = NULL,
               released = {schema}.released_with(t.released, t.released_until, t.retain_until,
                                                 p_token, now_),
               released_until = until_
         WHERE t.key = p_key AND (t.state = 'released' OR t.retain_until <= now_);
        IF FOUND THEN
            RETURN false;
        END IF;

        -- Another caller's record holds the key (or ours, settled): nothing to release, but
        -- a late `begin` of this token must still find it released once that record left.
        UPDATE {schema}.records t
           SET released = {schema}.released_with(t.released, t.released_until, t.retain_until,
                                                 p_token, now_),
               released_until = until_
         WHERE t.key = p_key AND t.state <> 'released' AND t.retain_until > now_;
        IF FOUND THEN
            RETURN false;
        END IF;
        -- Deleted or changed in between (swept, forgotten, past its retention): look again.
    END LOOP;
    RETURN false;
END
$$;

-- sweep_op, as in version 1, keeping a record past its retention while tokens released
-- beside it last (a `begin` of one of them is refused; any other claims the key).
CREATE OR REPLACE FUNCTION {schema}.sweep_op(p_limit integer)
RETURNS bigint
LANGUAGE sql AS $$
    WITH doomed AS (
        SELECT t.key FROM {schema}.records t
         WHERE t.retain_until <= clock_timestamp()
           AND (t.released_until IS NULL OR t.released_until <= clock_timestamp())
         ORDER BY t.retain_until
         LIMIT p_limit
           FOR UPDATE SKIP LOCKED
    ), deleted AS (
        DELETE FROM {schema}.records t USING doomed
         WHERE t.key = doomed.key AND t.retain_until <= clock_timestamp()
           AND (t.released_until IS NULL OR t.released_until <= clock_timestamp())
        RETURNING 1
    )
    SELECT count(*) FROM deleted
$$;

-- claim_op, as in version 3, whose replay without the key's lock is no answer for a
-- released token: begin_op, under the lock, refuses it.
CREATE OR REPLACE FUNCTION {schema}.claim_op(
    p_key bytea, p_fp bytea, p_token bytea, p_lease_ms bigint, p_retention_ms bigint,
    p_take_over boolean, p_frozen bytea, p_lock bigint,
    OUT r_answer text, OUT r_wait_ms bigint, OUT r_fp bytea, OUT r_frozen bytea,
    OUT r_outcome bytea)
RETURNS SETOF record
LANGUAGE plpgsql AS $$
DECLARE
    rec record;
BEGIN
    SELECT t.fingerprint, t.frozen, t.outcome INTO rec
      FROM {schema}.records t
     WHERE t.key = p_key AND t.state = 'completed' AND t.retain_until > clock_timestamp()
       AND NOT {schema}.is_released(t.released, t.released_until, t.retain_until, p_token,
                                    clock_timestamp());
    IF FOUND THEN
        IF rec.fingerprint = p_fp THEN
            r_answer := 'replay';
            r_outcome := rec.outcome;
        ELSE
            r_answer := 'drift';
            r_fp := rec.fingerprint;
            r_frozen := rec.frozen;
        END IF;
        RETURN NEXT;
        RETURN;
    END IF;
    IF NOT pg_try_advisory_xact_lock(p_lock) THEN
        RETURN;
    END IF;
    RETURN QUERY SELECT * FROM {schema}.begin_op(p_key, p_fp, p_token, p_lease_ms,
                                                  p_retention_ms, p_take_over, p_frozen);
END
$$;

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
