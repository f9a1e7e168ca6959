-- Version 3 of the ledger schema: each life of a key has its own generation, and the
-- transactional mode's claim replays a finished operation without the key's lock
-- (claim_op, at the end).
--
-- A key's record is created by a claim and leaves (forgotten, released, past its retention);
-- the next claim creates it again. The two lives can match in everything an operator's look
-- shows (the same request, one attempt, completed), so a `forget` made from a look at the
-- first would remove the second, and the operation would run again. `generation` tells them
-- apart: a claim that creates a record takes the next value of `record_generations`, a
-- counter in the database, so unique across every process sharing it and across restarts;
-- no transition changes it, and `forget` compares it.
--
-- Rows an earlier version wrote keep `generation` NULL, rather than the table being
-- rewritten under a lock: their generation is derived from `created_at` (microseconds since
-- the epoch), the one value that was already theirs for their whole life (`generation_of`).
-- A derived generation is above 10^15 and the counter starts at 1: they never meet.

-- Every `begin_op` draws one (its insert is tried first, replays too): each connection
-- takes 64 at a time, so a draw is mostly the connection's own, not a lock on the
-- sequence shared by every connection. Values are then unique but not in claim order,
-- which nothing needs.
CREATE SEQUENCE {schema}.record_generations CACHE 64;
ALTER TABLE {schema}.records ADD COLUMN generation bigint;

-- The generation of a record: its own, or the one derived for a row an earlier version wrote.
CREATE FUNCTION {schema}.generation_of(p_generation bigint, p_created_at timestamptz)
RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT coalesce(p_generation, floor(extract(epoch FROM p_created_at) * 1000000)::bigint)
$$;

-- begin_op, as in version 2, giving each record it creates the next generation, and taking
-- an in-doubt record over only in the life it read.
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

        IF rec.retain_until <= now_ THEN
            -- Past its retention the record is absent: a new claim takes its place.
            UPDATE {schema}.records t
               SET fingerprint = p_fp, state = 'in_flight', token = p_token,
                   lease_until = now_ + p_lease_ms * interval '1 millisecond', sent = false,
                   created_at = now_, retain_until = now_ + p_retention_ms * interval '1 millisecond',
                   attempts = 1, frozen = p_frozen, outcome = NULL, status = NULL, released = NULL,
                   generation = nextval('{schema}.record_generations')
             WHERE t.key = p_key AND t.retain_until <= now_;
            IF FOUND THEN
                r_answer := 'acquired';
                RETURN;
            END IF;
            CONTINUE;
        END IF;

        IF rec.state = 'released' THEN
            -- No record, only the tokens the key was released under. This caller released
            -- its token already: its `begin` arrived after its own release (queued, or held
            -- up), and must not make a claim nobody would ever use.
            IF p_token = ANY (rec.released) THEN
                r_answer := 'released';
                RETURN;
            END IF;
            -- Anyone else finds the key absent: the claim takes the marker's place, unless
            -- this token was released meanwhile (the re-checked condition then fails).
            UPDATE {schema}.records t
               SET fingerprint = p_fp, state = 'in_flight', token = p_token,
                   lease_until = now_ + p_lease_ms * interval '1 millisecond', sent = false,
                   created_at = now_, retain_until = now_ + p_retention_ms * interval '1 millisecond',
                   attempts = 1, frozen = p_frozen, outcome = NULL, status = NULL, released = NULL,
                   generation = nextval('{schema}.record_generations')
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
           AND t.token IS NOT DISTINCT FROM rec.token;
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

-- inspect_op, as in version 2, showing the generation too. Its columns change, so it is
-- made anew.
DROP FUNCTION {schema}.inspect_op(bytea);
CREATE FUNCTION {schema}.inspect_op(
    p_key bytea,
    OUT r_state text, OUT r_fp bytea, OUT r_attempts integer, OUT r_age_ms bigint,
    OUT r_lease_left_ms bigint, OUT r_retention_left_ms bigint, OUT r_sent boolean,
    OUT r_status smallint, OUT r_generation bigint)
RETURNS SETOF record
LANGUAGE sql AS $$
    SELECT t.state, t.fingerprint, t.attempts,
           greatest(0, floor(extract(epoch FROM c.now - t.created_at) * 1000))::bigint,
           greatest(0, floor(extract(epoch FROM coalesce(t.lease_until, c.now) - c.now) * 1000))::bigint,
           greatest(0, floor(extract(epoch FROM t.retain_until - c.now) * 1000))::bigint,
           t.sent, t.status, {schema}.generation_of(t.generation, t.created_at)
      FROM {schema}.records t, (SELECT clock_timestamp() AS now) c
     WHERE t.key = p_key AND t.retain_until > c.now AND t.state <> 'released'
$$;

-- claim_op: the transactional server mode's claim, the first statement of the request's
-- transaction (see transaction.rs). The transaction holds the key's advisory lock from its
-- claim to its end, and ends for a replay only when the layer's `ROLLBACK` reaches the
-- server, which may be after the next duplicate's claim. So a completed record is answered
-- from a plain read first, without the lock: a finished operation is replayed (or its
-- drift told) whoever holds the lock, and a replay's transaction holds no lock to keep the
-- next duplicate out. Only when the record is not completed is the lock taken, without
-- waiting: held by another transaction, no row (the caller answers busy); else begin_op,
-- under it.
--
-- The read answers only what it may: a completed record is committed, and no transition
-- ever takes it back to open (only a forget, a sweep or a new claim past its retention
-- replaces it), so the answer stays true however the lock is held.
CREATE FUNCTION {schema}.claim_op(
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
     WHERE t.key = p_key AND t.state = 'completed' AND t.retain_until > clock_timestamp();
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
