-- Version 1 of the ledger schema: one table, and one function per ledger transition.
--
-- `{schema}` is replaced by the store's (validated) schema name before this runs. Every
-- transition is one function call, so each is one statement, one round trip and one atomic
-- step: there is no check-then-set between the client and the database. Times are the
-- database's own (`clock_timestamp()`), so clock skew between application hosts can never
-- make a live lease look expired.

CREATE TABLE {schema}.records (
    key          bytea       PRIMARY KEY CHECK (length(key) = 32),
    fingerprint  bytea       NOT NULL,
    state        text        NOT NULL CHECK (state IN ('in_flight', 'in_doubt', 'completed')),
    -- The owner's fencing token (16 bytes) and lease end, only while in flight.
    token        bytea,
    lease_until  timestamptz,
    -- Once an attempt may have been sent (a resume, an in-doubt mark) the record is never
    -- released again, only resumed or completed.
    sent         boolean     NOT NULL DEFAULT false,
    created_at   timestamptz NOT NULL,
    -- Past this the record is absent to every call, and the sweep deletes it.
    retain_until timestamptz NOT NULL,
    attempts     integer     NOT NULL DEFAULT 1,
    frozen       bytea,
    outcome      bytea,
    status       smallint
);

-- The sweep finds expired records through this index, oldest first.
CREATE INDEX records_retain_until ON {schema}.records (retain_until);

-- begin: claim, resume, replay or refuse an operation.
--
-- Answers one row: r_answer is 'acquired', 'resume', 'busy', 'in_doubt', 'replay' or
-- 'drift', with r_wait_ms (busy), r_fp (drift), r_frozen (resume, drift) and r_outcome
-- (replay). A record is only ever changed by a conditional write that re-checks what was
-- read, so two callers racing on a key never both acquire it; if the record changed under
-- us, it is read again.
CREATE FUNCTION {schema}.begin_op(
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
             attempts, frozen)
        VALUES (p_key, p_fp, 'in_flight', p_token, now_ + p_lease_ms * interval '1 millisecond',
                false, now_, now_ + p_retention_ms * interval '1 millisecond', 1, p_frozen)
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

        IF rec.retain_until <= now_ THEN
            -- Past its retention the record is absent: a new claim takes its place.
            UPDATE {schema}.records t
               SET fingerprint = p_fp, state = 'in_flight', token = p_token,
                   lease_until = now_ + p_lease_ms * interval '1 millisecond', sent = false,
                   created_at = now_, retain_until = now_ + p_retention_ms * interval '1 millisecond',
                   attempts = 1, frozen = p_frozen, outcome = NULL, status = NULL
             WHERE t.key = p_key AND t.retain_until <= now_;
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
        UPDATE {schema}.records t
           SET state = 'in_flight', token = p_token,
               lease_until = now_ + p_lease_ms * interval '1 millisecond', sent = true,
               attempts = t.attempts + 1
         WHERE t.key = p_key AND t.fingerprint = p_fp AND t.created_at = rec.created_at
           AND t.retain_until > now_
           AND (t.state = 'in_doubt' OR (t.state = 'in_flight' AND t.lease_until <= now_))
           AND t.token IS NOT DISTINCT FROM rec.token;
        IF FOUND THEN
            r_answer := 'resume';
            r_frozen := rec.frozen;
            RETURN;
        END IF;
    END LOOP;
    RAISE EXCEPTION 'the ledger record kept changing while it was claimed'
        USING ERRCODE = 'serialization_failure';
END
$$;

-- complete: record the outcome, if p_token still owns the operation. With p_strict a
-- refusal is an error, so a transaction carrying a handler's writes cannot commit without
-- its record.
CREATE FUNCTION {schema}.complete_op(
    p_key bytea, p_token bytea, p_outcome bytea, p_status smallint, p_retention_ms bigint,
    p_strict boolean)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    now_ timestamptz := clock_timestamp();
BEGIN
    -- The fingerprint and frozen request stay: a later caller with another payload must
    -- still be told it drifted.
    UPDATE {schema}.records t
       SET state = 'completed', outcome = p_outcome, status = p_status, token = NULL,
           lease_until = NULL, retain_until = now_ + p_retention_ms * interval '1 millisecond'
     WHERE t.key = p_key AND t.state = 'in_flight' AND t.token = p_token
       AND t.retain_until > now_;
    IF NOT FOUND AND p_strict THEN
        RAISE EXCEPTION 'the ledger refused the completion: the operation is not owned by this token'
            USING ERRCODE = 'serialization_failure';
    END IF;
    RETURN FOUND;
END
$$;

-- abandon: release an operation after a failure proven to happen before anything was
-- sent; an operation of which an attempt may have been sent goes in doubt instead.
CREATE FUNCTION {schema}.abandon_op(p_key bytea, p_token bytea)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    now_ timestamptz := clock_timestamp();
BEGIN
    DELETE FROM {schema}.records t
     WHERE t.key = p_key AND t.state = 'in_flight' AND t.token = p_token
       AND t.retain_until > now_ AND NOT t.sent;
    IF FOUND THEN
        RETURN true;
    END IF;
    UPDATE {schema}.records t
       SET state = 'in_doubt', token = NULL, lease_until = NULL, sent = true
     WHERE t.key = p_key AND t.state = 'in_flight' AND t.token = p_token
       AND t.retain_until > now_;
    RETURN FOUND;
END
$$;

-- mark_in_doubt: the owner's attempt failed after its bytes may have left. The record is
-- kept at least p_retention_ms from now, never shorter than it already was.
CREATE FUNCTION {schema}.mark_in_doubt_op(p_key bytea, p_token bytea, p_retention_ms bigint)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    now_ timestamptz := clock_timestamp();
BEGIN
    UPDATE {schema}.records t
       SET state = 'in_doubt', token = NULL, lease_until = NULL, sent = true,
           retain_until = greatest(t.retain_until, now_ + p_retention_ms * interval '1 millisecond')
     WHERE t.key = p_key AND t.state = 'in_flight' AND t.token = p_token
       AND t.retain_until > now_;
    RETURN FOUND;
END
$$;

-- renew: the owner is alive and still working. A lease that ran out may still be renewed
-- by its owner, unless another caller took the operation over.
CREATE FUNCTION {schema}.renew_op(p_key bytea, p_token bytea, p_lease_ms bigint)
RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    now_ timestamptz := clock_timestamp();
BEGIN
    UPDATE {schema}.records t
       SET lease_until = now_ + p_lease_ms * interval '1 millisecond'
     WHERE t.key = p_key AND t.state = 'in_flight' AND t.token = p_token
       AND t.retain_until > now_;
    RETURN FOUND;
END
$$;

-- inspect: a read-only look at a record inside its retention. Writes nothing.
CREATE FUNCTION {schema}.inspect_op(
    p_key bytea,
    OUT r_state text, OUT r_fp bytea, OUT r_attempts integer, OUT r_age_ms bigint,
    OUT r_lease_left_ms bigint, OUT r_retention_left_ms bigint, OUT r_sent boolean,
    OUT r_status smallint)
RETURNS SETOF record
LANGUAGE sql AS $$
    SELECT t.state, t.fingerprint, t.attempts,
           greatest(0, floor(extract(epoch FROM c.now - t.created_at) * 1000))::bigint,
           greatest(0, floor(extract(epoch FROM coalesce(t.lease_until, c.now) - c.now) * 1000))::bigint,
           greatest(0, floor(extract(epoch FROM t.retain_until - c.now) * 1000))::bigint,
           t.sent, t.status
      FROM {schema}.records t, (SELECT clock_timestamp() AS now) c
     WHERE t.key = p_key AND t.retain_until > c.now
$$;

-- sweep: delete up to p_limit records past their retention. Rows another transaction holds
-- are skipped (SKIP LOCKED), so the sweep never waits for, nor holds up, a live operation.
CREATE FUNCTION {schema}.sweep_op(p_limit integer)
RETURNS bigint
LANGUAGE sql AS $$
    WITH doomed AS (
        SELECT t.key FROM {schema}.records t
         WHERE t.retain_until <= clock_timestamp()
         ORDER BY t.retain_until
         LIMIT p_limit
           FOR UPDATE SKIP LOCKED
    ), deleted AS (
        DELETE FROM {schema}.records t USING doomed
         WHERE t.key = doomed.key AND t.retain_until <= clock_timestamp()
        RETURNING 1
    )
    SELECT count(*) FROM deleted
$$;
