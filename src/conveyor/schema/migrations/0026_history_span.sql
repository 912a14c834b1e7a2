-- Conveyor 0026: the history's partitions span any whole number of minutes
-- that divides a day, not only a day (docs/history-partitions.md,
-- "Partitions shorter than a day"). `{schema}` is replaced by the quoted
-- schema identifier; this file holds no other braces on purpose.
--
-- A queue that finishes 20 million events an hour keeps a day of history in
-- one table of 500 million rows, and keeps it up to a day past the
-- retention. Spans of an hour (or ten minutes) bound both. The span is a
-- property of the database, not of a worker: workers of one schema that
-- disagreed would make overlapping partitions.

ALTER TABLE {schema}.history ADD COLUMN span interval NOT NULL DEFAULT interval '1 day';
-- A whole number of minutes that divides a day, so the partitions of every
-- day start at midnight UTC whatever the span was before.
ALTER TABLE {schema}.history ADD CONSTRAINT history_span_check CHECK (
    span BETWEEN interval '1 minute' AND interval '1 day'
    AND extract(epoch FROM span) % 60 = 0
    AND 86400 % extract(epoch FROM span) = 0);

-- The history's partitions and their bounds, read from the catalog (the
-- truth, whoever made or dropped them). The bounds are rendered in the
-- function's own settings, so they read back the same in any session.
CREATE FUNCTION {schema}.history_parts()
RETURNS TABLE (name name, starts timestamptz, ends timestamptz)
LANGUAGE sql STABLE
SET datestyle = 'ISO, YMD' SET timezone = 'UTC'
AS $$
    SELECT c.relname, b[1]::timestamptz, b[2]::timestamptz
    FROM pg_inherits AS i
    JOIN pg_class AS c ON c.oid = i.inhrelid,
    LATERAL regexp_match(pg_get_expr(c.relpartbound, c.oid),
                         '^FOR VALUES FROM \(''([^'']+)''\) TO \(''([^'']+)''\)$') AS b
    WHERE i.inhparent = '{schema}.events_done'::regclass
$$;

-- Makes the history's partitions from the one holding now to the one holding
-- now + `ahead` (partitions shorter than a day: at most 24 ahead, four hours
-- of ten-minute ones, so a short span does not make hundreds of empty
-- tables for every read of the history to open), each `history.span` long, counted from midnight
-- UTC, after the last partition made; moves `history.until` to the end of
-- the last. Returns how many it made and the new `until`. Workers call it as
-- they start and with each prune; it needs the right to create tables in the
-- schema (the owner's).
CREATE FUNCTION {schema}.history_make(ahead interval, OUT made integer, OUT made_until timestamptz)
LANGUAGE plpgsql
SET datestyle = 'ISO, YMD' SET timezone = 'UTC'
AS $$
DECLARE
    span interval;
    starts timestamptz;
    ends timestamptz;
    horizon timestamptz;
    last_end timestamptz;
    name text;
BEGIN
    IF ahead IS NULL OR ahead < interval '0' THEN
        RAISE EXCEPTION 'expected ahead to be an interval >= 0, got %', ahead
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    made := 0;
    -- A new partition locks the history against the acknowledgements moving
    -- rows into it: wait for them half a second at most (then
    -- lock_not_available, and the next call tries again).
    PERFORM set_config('lock_timeout', '500ms', true);
    -- Workers starting together make the same partitions: one at a time (a
    -- lock keyed on the history's own oid, so one per schema).
    PERFORM pg_advisory_xact_lock('{schema}.events_done'::regclass::oid::bigint);
    -- The one row is there from 0025 on; a day if someone deleted it.
    span := coalesce((SELECT h.span FROM {schema}.history AS h), interval '1 day');
    starts := date_bin(span, now(), timestamptz '2000-01-01 00:00:00+00');
    horizon := now() + CASE WHEN span < interval '1 day' THEN least(ahead, span * 24)
                            ELSE ahead END;
    -- After a change of span, go on from the end of what exists: ranges
    -- never overlap, and a first shorter partition closes the gap to the
    -- new span's boundary.
    SELECT max(p.ends) INTO last_end FROM {schema}.history_parts() AS p;
    IF last_end > starts THEN
        starts := last_end;
    END IF;
    WHILE starts <= horizon LOOP
        ends := date_bin(span, starts, timestamptz '2000-01-01 00:00:00+00') + span;
        -- A day's partition keeps the name it had before 0026.
        name := 'events_done_' || to_char(starts, CASE
            WHEN ends - starts = interval '1 day' THEN 'YYYYMMDD'
            ELSE 'YYYYMMDD"_"HH24MI' END);
        EXECUTE format('CREATE TABLE {schema}.%I PARTITION OF {schema}.events_done '
                       'FOR VALUES FROM (%L) TO (%L)', name, starts, ends);
        made := made + 1;
        starts := ends;
    END LOOP;
    SELECT max(p.ends) INTO made_until FROM {schema}.history_parts() AS p;
    INSERT INTO {schema}.history AS h (until, span) VALUES (made_until, span)
    ON CONFLICT (one) DO UPDATE SET until = excluded.until
    WHERE h.until IS DISTINCT FROM excluded.until;
END
$$;

-- Retention: drops the history's partitions that ended `older_than` ago or
-- earlier, whole (no row deleted, nothing left for vacuum); returns how many
-- it dropped. Waits at most half a second for the lock a DROP takes (then
-- lock_not_available: the next prune tries again).
CREATE FUNCTION {schema}.history_drop(older_than interval) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    part record;
    dropped integer := 0;
BEGIN
    PERFORM set_config('lock_timeout', '500ms', true);
    FOR part IN
        SELECT p.name FROM {schema}.history_parts() AS p
        WHERE p.ends <= now() - older_than
        ORDER BY p.ends
    LOOP
        EXECUTE format('DROP TABLE {schema}.%I', part.name);
        dropped := dropped + 1;
    END LOOP;
    RETURN dropped;
END
$$;

-- The functions of 0025, kept for workers of an older release still
-- running: they now follow the span too.
CREATE OR REPLACE FUNCTION {schema}.history_make_days(ahead integer) RETURNS integer
LANGUAGE plpgsql AS $$
BEGIN
    IF ahead IS NULL OR ahead < 0 THEN
        RAISE EXCEPTION 'expected ahead to be a number of days >= 0, got %', ahead
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN (SELECT m.made FROM {schema}.history_make(ahead * interval '1 day') AS m);
END
$$;

CREATE OR REPLACE FUNCTION {schema}.history_drop_days(older_than double precision)
RETURNS integer
LANGUAGE sql AS $$
    SELECT {schema}.history_drop(older_than * interval '1 second')
$$;
