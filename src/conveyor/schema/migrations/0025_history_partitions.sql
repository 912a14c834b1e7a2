-- Conveyor 0025: finished events in partitions of their own
-- (docs/history-partitions.md). `{schema}` is replaced by the quoted schema
-- identifier; this file holds no other braces on purpose.
--
-- `events` becomes a table partitioned by LIST (done): today's table, renamed
-- `events_live`, holds the rows with `done` NULL (every row it has); an empty
-- `events_done` holds those with `done` true, partitioned by RANGE
-- (finished_at), one partition per day, so that retention drops a day
-- instead of deleting its rows. Reads keep naming `events` and see both.
--
-- In three steps, each committed on its own, so that no step holds a lock
-- that stops producers and workers while it reads the whole table:
-- 1. add `done` (no default: no rewrite, and a live row stores nothing for
--    it) and a CHECK that it is NULL, not validated yet;
-- 2. validate the CHECK: a scan of the table under a lock that lets reads
--    and writes go on;
-- 3. the layout, under the table's own lock, without a scan: ATTACH finds
--    the partition constraint implied by the validated CHECK.

ALTER TABLE {schema}.events ADD COLUMN done boolean;
ALTER TABLE {schema}.events ADD CONSTRAINT events_live_done_check CHECK (done IS NULL) NOT VALID;

-- conveyor:step
ALTER TABLE {schema}.events VALIDATE CONSTRAINT events_live_done_check;

-- conveyor:step
-- Producers and workers wait here while the table is renamed; they hold the
-- lock for the length of their own transactions, so the step waits for the
-- longest open one that wrote events. Everything below is catalog work.
LOCK TABLE {schema}.events IN ACCESS EXCLUSIVE MODE;

-- The ids. A partitioned table cannot have an identity column before
-- PostgreSQL 17, and 18 refuses to attach a table that has one: the identity
-- becomes a plain sequence of the same name, continuing where it stood, the
-- `id` default of both the parent and the live partition. Producers find it
-- as before (pg_get_serial_sequence on `events`), as the parent owns it.
CREATE SEQUENCE {schema}.events_id_next AS bigint;
SELECT setval('{schema}.events_id_next', s.last_value, s.is_called)
FROM {schema}.events_id_seq s;
ALTER TABLE {schema}.events ALTER COLUMN id DROP IDENTITY;
ALTER SEQUENCE {schema}.events_id_next RENAME TO events_id_seq;
ALTER TABLE {schema}.events ALTER COLUMN id SET DEFAULT nextval('{schema}.events_id_seq');

ALTER TABLE {schema}.events RENAME TO events_live;
CREATE TABLE {schema}.events (
    LIKE {schema}.events_live INCLUDING DEFAULTS INCLUDING CONSTRAINTS
) PARTITION BY LIST (done);
-- The live partition's own rule, not the history's.
ALTER TABLE {schema}.events DROP CONSTRAINT events_live_done_check;
ALTER SEQUENCE {schema}.events_id_seq OWNED BY {schema}.events.id;
ALTER TABLE {schema}.events ATTACH PARTITION {schema}.events_live FOR VALUES IN (NULL);

-- Whoever may read or write `events` keeps doing so: the parent gets the
-- grants the table had (they stay on the partition too).
DO $grants$
DECLARE
    g record;
BEGIN
    FOR g IN
        SELECT a.privilege_type, a.is_grantable,
               CASE WHEN a.grantee = 0 THEN 'PUBLIC'
                    ELSE quote_ident(pg_get_userbyid(a.grantee)) END AS grantee
        FROM pg_class c, aclexplode(c.relacl) a
        WHERE c.oid = '{schema}.events_live'::regclass
          AND a.grantee <> c.relowner
    LOOP
        EXECUTE format('GRANT %s ON {schema}.events TO %s%s', g.privilege_type, g.grantee,
                       CASE WHEN g.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
    END LOOP;
END
$grants$;

-- The history: only finished events that no key keeps live. Its CHECK is a
-- safety net: a statement that reopened a row without moving it back fails
-- instead of leaving a pending event where no claim looks; and it lets every
-- read of the live states plan no scan of the history.
CREATE TABLE {schema}.events_done PARTITION OF {schema}.events
    (CONSTRAINT events_done_state_check CHECK (state IN ('succeeded', 'cancelled')),
     CONSTRAINT events_done_finished_check CHECK (finished_at IS NOT NULL))
    FOR VALUES IN (true) PARTITION BY RANGE (finished_at);
-- Admin.get, results and dependencies find a finished event by id.
CREATE INDEX events_done_id_idx ON {schema}.events_done (id);
-- The operator's listing of cancelled events by topic, prefix or tenant, as
-- events_stopped_topic_idx and events_stopped_tenant_idx do in the live rows.
CREATE INDEX events_done_cancelled_topic_idx ON {schema}.events_done (topic COLLATE "C", id)
    WHERE state = 'cancelled';
CREATE INDEX events_done_cancelled_tenant_idx ON {schema}.events_done (tenant, id)
    WHERE tenant IS NOT NULL AND state = 'cancelled';

-- The ordered relay's triggers (0019) stamp events as they are inserted, in
-- whichever partition they land: new events land in the live one, where the
-- triggers made so far stay; new ones are made there too.
CREATE OR REPLACE FUNCTION {schema}.order_topics(pattern text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    name text := 'events_order_' || left(md5(pattern), 16);
    condition text;
    oldest bigint;
    stamped bigint;
BEGIN
    IF EXISTS (SELECT 1 FROM pg_trigger
               WHERE tgrelid = '{schema}.events_live'::regclass AND tgname = name) THEN
        RETURN NULL;
    END IF;
    SELECT min(id) INTO oldest
    FROM {schema}.events_live
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
    EXECUTE format('CREATE OR REPLACE TRIGGER %I BEFORE INSERT ON {schema}.events_live '
                   'FOR EACH ROW WHEN (%s) EXECUTE FUNCTION {schema}.stamp_xid()',
                   name, condition);
    EXECUTE format('COMMENT ON TRIGGER %I ON {schema}.events_live IS %L', name,
                   'conveyor: the ordered relay route ' || pattern);
    UPDATE {schema}.events_live
    SET xid = CASE WHEN id < oldest THEN '0'::xid8 ELSE pg_current_xact_id() END
    WHERE state = 'pending'
      AND xid IS NULL
      AND (pattern = '*' OR topic = pattern
           OR (right(pattern, 2) = '.*' AND starts_with(topic, left(pattern, -1))));
    GET DIAGNOSTICS stamped = ROW_COUNT;
    RETURN stamped;
END
$$;

-- How long finished events may move into the history: the end of the last
-- day made ahead (history_make_days), none until the first is made. A finished
-- event moves only while its finish time is before it, so an
-- acknowledgement never meets a day without its partition: the event stays
-- live instead, and retention deletes it there.
CREATE TABLE {schema}.history (
    one   boolean     PRIMARY KEY DEFAULT true CHECK (one),
    until timestamptz
);
INSERT INTO {schema}.history DEFAULT VALUES;

-- Makes the history's partitions for today and the next `ahead` days (UTC)
-- that do not exist yet, and moves `history.until` to the end of the last;
-- returns how many it made. Workers call it as they start and with each
-- prune; it needs the right to create tables in the schema (the owner's).
CREATE FUNCTION {schema}.history_make_days(ahead integer) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    first date := (now() AT TIME ZONE 'UTC')::date;
    day date;
    made integer := 0;
    name text;
BEGIN
    IF ahead IS NULL OR ahead < 0 THEN
        RAISE EXCEPTION 'expected ahead to be a number of days >= 0, got %', ahead
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- A new partition locks the history against the acknowledgements moving
    -- rows into it: wait for them half a second at most (then
    -- lock_not_available, and the next call tries again).
    PERFORM set_config('lock_timeout', '500ms', true);
    -- Workers starting together make the same days: one at a time (a lock
    -- keyed on the history's own oid, so one per schema).
    PERFORM pg_advisory_xact_lock('{schema}.events_done'::regclass::oid::bigint);
    FOR day IN SELECT d::date FROM generate_series(first, first + ahead, interval '1 day') AS d
    LOOP
        name := 'events_done_' || to_char(day, 'YYYYMMDD');
        IF NOT EXISTS (SELECT 1 FROM pg_inherits AS i JOIN pg_class AS c ON c.oid = i.inhrelid
                       WHERE i.inhparent = '{schema}.events_done'::regclass
                         AND c.relname = name) THEN
            EXECUTE format('CREATE TABLE {schema}.%I PARTITION OF {schema}.events_done '
                           'FOR VALUES FROM (%L) TO (%L)', name,
                           day::timestamp AT TIME ZONE 'UTC',
                           (day + 1)::timestamp AT TIME ZONE 'UTC');
            made := made + 1;
        END IF;
    END LOOP;
    INSERT INTO {schema}.history AS h (until)
    VALUES ((first + ahead + 1)::timestamp AT TIME ZONE 'UTC')
    ON CONFLICT (one) DO UPDATE SET until = excluded.until
    WHERE h.until IS DISTINCT FROM excluded.until;
    RETURN made;
END
$$;

-- Retention: drops the history's days that ended more than `older_than`
-- seconds ago, a whole day at a time (no row deleted, nothing left for
-- vacuum); returns how many it dropped. Waits at most half a second for the
-- lock a DROP takes (then lock_not_available: the next prune tries again).
CREATE FUNCTION {schema}.history_drop_days(older_than double precision) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    part record;
    dropped integer := 0;
BEGIN
    PERFORM set_config('lock_timeout', '500ms', true);
    FOR part IN
        SELECT c.relname
        FROM pg_inherits AS i
        JOIN pg_class AS c ON c.oid = i.inhrelid
        WHERE i.inhparent = '{schema}.events_done'::regclass
          AND c.relname ~ '^events_done_[0-9]+$' AND length(c.relname) = 20
          AND (to_date(right(c.relname, 8), 'YYYYMMDD') + 1)::timestamp AT TIME ZONE 'UTC'
              <= now() - older_than * interval '1 second'
        ORDER BY c.relname
    LOOP
        EXECUTE format('DROP TABLE {schema}.%I', part.relname);
        dropped := dropped + 1;
    END LOOP;
    RETURN dropped;
END
$$;
