-- Conveyor 0027: the history's partitions can have a BRIN index on
-- finished_at, for a relay's replay (docs/relay.md, "Replay"). `{schema}` is
-- replaced by the quoted schema identifier; this file holds no other braces
-- on purpose.
--
-- A relay's replay reads the relayed events of a window of finish times in
-- (finished_at, id) order. Since 0025 the succeeded ones are in the
-- history, which no index held by finish time: every batch read each
-- partition from its place to the window's end and sorted it, so a replay
-- of a window read it many times over. Rows are appended to a partition in
-- about the order they finish, so a BRIN index (a few pages per gigabyte)
-- finds a short slice of finish times in a few block ranges, and the replay
-- reads a window slice by slice. A btree would do the same at the price of
-- an entry, and its WAL, for every acknowledged event.
--
-- The BRIN index is not free either: each row moved into the history looks
-- its block range up (measured 2026-12-05: about 1 us of the server's CPU
-- per acknowledged event, 0.3 bytes of WAL). So only a queue that relays
-- pays it: `history.replayable`, set by `conveyor relay` as it starts (or
-- `conveyor history --replayable`), and from then on history_make gives
-- every partition it makes the index while it is still empty.

ALTER TABLE {schema}.history ADD COLUMN replayable boolean NOT NULL DEFAULT false;

CREATE OR REPLACE FUNCTION {schema}.history_make(ahead interval, OUT made integer, OUT made_until timestamptz)
LANGUAGE plpgsql
SET datestyle = 'ISO, YMD' SET timezone = 'UTC'
AS $$
DECLARE
    span interval;
    replayable boolean;
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
    replayable := coalesce((SELECT h.replayable FROM {schema}.history AS h), false);
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
        IF replayable THEN
            -- Made while empty, so building it costs nothing (0027).
            EXECUTE format('CREATE INDEX %I ON {schema}.%I USING brin (finished_at) '
                           'WITH (autosummarize = on)', name || '_finished_idx', name);
        END IF;
        made := made + 1;
        starts := ends;
    END LOOP;
    SELECT max(p.ends) INTO made_until FROM {schema}.history_parts() AS p;
    INSERT INTO {schema}.history AS h (until, span) VALUES (made_until, span)
    ON CONFLICT (one) DO UPDATE SET until = excluded.until
    WHERE h.until IS DISTINCT FROM excluded.until;
END
$$;

-- Makes the history replayable (above): the partitions made from now on get
-- the index, and so does each made already that holds no row yet (those
-- made ahead); one that holds rows stays without (building its index would
-- hold back the acknowledgements moving rows into it), and a replay reads
-- it whole until retention drops it. Returns how many indexes it made.
CREATE FUNCTION {schema}.history_replayable() RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    part record;
    empty boolean;
    made integer := 0;
BEGIN
    PERFORM set_config('lock_timeout', '500ms', true);
    PERFORM pg_advisory_xact_lock('{schema}.events_done'::regclass::oid::bigint);
    INSERT INTO {schema}.history AS h (replayable) VALUES (true)
    ON CONFLICT (one) DO UPDATE SET replayable = true WHERE NOT h.replayable;
    FOR part IN
        SELECT p.name FROM {schema}.history_parts() AS p
        WHERE to_regclass(format('{schema}.%I', p.name || '_finished_idx')) IS NULL
    LOOP
        EXECUTE format('SELECT NOT EXISTS (SELECT FROM {schema}.%I)', part.name) INTO empty;
        IF empty THEN
            EXECUTE format('CREATE INDEX %I ON {schema}.%I USING brin (finished_at) '
                           'WITH (autosummarize = on)', part.name || '_finished_idx', part.name);
            made := made + 1;
        END IF;
    END LOOP;
    RETURN made;
END
$$;
