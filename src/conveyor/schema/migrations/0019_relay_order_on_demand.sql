-- Conveyor 0019: the ordered relay's transaction ids and index only for the
-- topics an ordered route reads. `{schema}` is replaced by the quoted schema
-- identifier; this file holds no other braces on purpose.
--
-- 0016 gave every event its transaction id and indexed every pending event by
-- (topic, xid, id): about 94 bytes of WAL per event (of 409 for a bulk
-- enqueue, 2026-12-03) paid by every user, with or without an ordered route.
-- Now an event's xid is written by a trigger that each ordered route adds for
-- its own pattern when its stream first leads (order_topics, below), and the
-- index holds only events that have one. A database without ordered routes
-- has no such trigger: its events carry no xid and add nothing to the index.
--
-- Pending events of a route written before its trigger existed have no xid.
-- order_topics gives those older than every pending event of the route that
-- has one (written before 0016) the xid 0, so they still come first, as 0016
-- promised, and the others (written since 0019) the id of the transaction
-- that creates the trigger, so they come after every event that had one; each
-- group in id order. Rows keep their place; the index is rebuilt over the
-- pending events that have an xid.
ALTER TABLE {schema}.events ALTER COLUMN xid DROP DEFAULT;

DROP INDEX {schema}.events_relay_order_idx;
CREATE INDEX events_relay_order_idx
    ON {schema}.events (topic, xid, id)
    WHERE state = 'pending' AND xid IS NOT NULL;

CREATE FUNCTION {schema}.stamp_xid() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.xid := pg_current_xact_id();
    RETURN NEW;
END
$$;

-- Makes the events of `pattern` (an exact topic, `prefix.*` or `*`) carry
-- their transaction's id from now on; returns how many pending events without
-- one it gave this transaction's, or NULL when the pattern had its trigger
-- already. Creating the trigger waits for the transactions writing events and
-- holds new ones back until this one commits, so no event of the pattern is
-- written without an xid after it; it waits at most half a second (then
-- lock_not_available: the stream tries again later), so a long transaction
-- that wrote events cannot hold every producer back behind it.
CREATE FUNCTION {schema}.order_topics(pattern text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    name text := 'events_order_' || left(md5(pattern), 16);
    condition text;
    oldest bigint;
    stamped bigint;
BEGIN
    IF EXISTS (SELECT 1 FROM pg_trigger
               WHERE tgrelid = '{schema}.events'::regclass AND tgname = name) THEN
        RETURN NULL;
    END IF;
    SELECT min(id) INTO oldest
    FROM {schema}.events
    WHERE state = 'pending'
      AND xid IS NOT NULL
      AND (pattern = '*' OR topic = pattern
           OR (right(pattern, 2) = '.*' AND starts_with(topic, left(pattern, -1))));
    IF pattern = '*' THEN
        condition := 'true';
    ELSIF right(pattern, 2) = '.*' THEN
        condition := format('starts_with(NEW.topic, %L)', left(pattern, -1));
    ELSE
        condition := format('NEW.topic = %L', pattern);
    END IF;
    PERFORM set_config('lock_timeout', '500ms', true);
    EXECUTE format('CREATE OR REPLACE TRIGGER %I BEFORE INSERT ON {schema}.events '
                   'FOR EACH ROW WHEN (%s) EXECUTE FUNCTION {schema}.stamp_xid()',
                   name, condition);
    EXECUTE format('COMMENT ON TRIGGER %I ON {schema}.events IS %L', name,
                   'conveyor: the ordered relay route ' || pattern);
    UPDATE {schema}.events
    SET xid = CASE WHEN id < oldest THEN '0'::xid8 ELSE pg_current_xact_id() END
    WHERE state = 'pending'
      AND xid IS NULL
      AND (pattern = '*' OR topic = pattern
           OR (right(pattern, 2) = '.*' AND starts_with(topic, left(pattern, -1))));
    GET DIAGNOSTICS stamped = ROW_COUNT;
    RETURN stamped;
END
$$;
