-- Version 2 of the ledger schema: a release outlasts a late claim.
--
-- A `begin` whose answer was lost can still be on its way (queued on a connection, held up
-- by a frozen server) when its caller releases the claim it may have made. So `abandon_op`
-- leaves a key it releases, or finds without a record, *released* under the caller's token
-- for a while, and `begin_op` refuses a released token ('released') instead of claiming.
--
-- The marker is a row of `records` (state 'released', the tokens in `released`, kept until
-- `retain_until`): a marker and a claim of one key meet on the primary key as two claims
-- do, so a `begin` and an `abandon` racing on a key are serialized (the second waits for the
-- first to commit, then sees it) and never both miss each other. Every other call reads a
-- marker as no record: transitions are fenced (they need 'in_flight'), `inspect_op` shows
-- nothing, the sweep deletes it once past `retain_until`.

-- A wider check: every row the old one accepted passes it, so no scan is needed (NOT VALID
-- skips it; new and updated rows are checked).
ALTER TABLE {schema}.records DROP CONSTRAINT IF EXISTS records_state_check;
ALTER TABLE {schema}.records ADD CONSTRAINT records_state_check
    CHECK (state IN ('in_flight', 'in_doubt', 'completed', 'released')) NOT VALID;
-- The tokens a marker row's key was released under (NULL on every record).
ALTER TABLE {schema}.records ADD COLUMN released bytea[];

-- begin_op, as in version 1, with r_answer 'released' for a token the key was released
-- under.
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
                   attempts = 1, frozen = p_frozen, outcome = NULL, status = NULL, released = NULL
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
                   attempts = 1, frozen = p_frozen, outcome = NULL, status = NULL, released = NULL
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
        -- "What we read" is pinned by `created_at` (a record replaced after its retention,
        -- or forgotten and claimed again, has another) and by the token (another caller's
        -- resume in between changed it): either way this caller must not take it over.
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
    -- Eight reads each overtaken by another writer: a storm on one key. Raised rather than
    -- answered, so the caller gets an error (and fails closed), never a guessed answer.
    RAISE EXCEPTION 'the ledger record kept changing while it was claimed'
        USING ERRCODE = 'serialization_failure';
END
$$;

-- abandon_op with the marker's lifetime: as in version 1, and a key it releases, or finds
-- without a record (none, or one past its retention), is left released under p_token for
-- p_released_ms (every token it was released under, until then). Answers whether it
-- released or put in doubt a claim of p_token's. Version 1's two-argument abandon_op stays
-- for the previous release's processes during a rolling upgrade (they leave no marker).
CREATE FUNCTION {schema}.abandon_op(p_key bytea, p_token bytea, p_released_ms bigint)
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
            (key, fingerprint, state, created_at, retain_until, attempts, released)
        VALUES (p_key, '\x'::bytea, 'released', now_, until_, 0, ARRAY[p_token])
        ON CONFLICT (key) DO NOTHING;
        IF FOUND THEN
            RETURN false;
        END IF;

        -- Our own claim, nothing sent: released, and a retried `begin` of it still queued
        -- finds the key released.
        UPDATE {schema}.records t
           SET fingerprint = '\x'::bytea, state = 'released', token = NULL, lease_until = NULL,
               sent = false, created_at = now_, retain_until = until_, attempts = 0,
               frozen = NULL, outcome = NULL, status = NULL, released = ARRAY[p_token]
         WHERE t.key = p_key AND t.state = 'in_flight' AND t.token = p_token
           AND t.retain_until > now_ AND NOT t.sent;
        IF FOUND THEN
            RETURN true;
        END IF;

        -- Our own claim, an earlier attempt of which may have been sent: in doubt.
        UPDATE {schema}.records t
           SET state = 'in_doubt', token = NULL, lease_until = NULL, sent = true
         WHERE t.key = p_key AND t.state = 'in_flight' AND t.token = p_token
           AND t.retain_until > now_;
        IF FOUND THEN
            RETURN true;
        END IF;

        -- A marker (add this token, all of them kept a while longer), or a record past its
        -- retention (no record: a marker takes its place).
        UPDATE {schema}.records t
           SET fingerprint = '\x'::bytea, state = 'released', token = NULL, lease_until = NULL,
               sent = false, created_at = now_, retain_until = until_, attempts = 0,
               frozen = NULL, outcome = NULL, status = NULL,
               released = CASE WHEN t.state = 'released' AND t.retain_until > now_
                               THEN array_append(array_remove(t.released, p_token), p_token)
                               ELSE ARRAY[p_token] END
         WHERE t.key = p_key AND (t.state = 'released' OR t.retain_until <= now_);
        IF FOUND THEN
            RETURN false;
        END IF;

        -- Another caller's record holds the key: nothing to release, and no marker needed
        -- (a late `begin` of this token meets that record).
        PERFORM 1 FROM {schema}.records t WHERE t.key = p_key;
        IF FOUND THEN
            RETURN false;
        END IF;
        -- Deleted in between (swept, forgotten): look again.
    END LOOP;
    RETURN false;
END
$$;

-- inspect_op, as in version 1, showing no marker.
CREATE OR REPLACE FUNCTION {schema}.inspect_op(
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
     WHERE t.key = p_key AND t.retain_until > c.now AND t.state <> 'released'
$$;
