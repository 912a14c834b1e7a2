-- Conveyor schema snapshot: the shape migrations 0001..0029 produce,
-- rendered for the schema "conveyor". Read it to see the current tables at a
-- glance; do not apply it to a live database (use `conveyor migrate`, or
-- `conveyor migrate --sql` for your own migration tool). The version table
-- (conveyor.migrations) belongs to the migrator and is not part of the snapshot.
--
-- tests/test_migrations.py proves that applying this file yields exactly the
-- catalog (columns, indexes, constraints, triggers, functions) the migrations
-- produce; regenerate it whenever a migration is added.

CREATE SCHEMA conveyor;

-- The rules of columns no index reads live in domains, not table CHECKs (0007): PostgreSQL
-- rebuilds a table's CHECK expressions at the start of every statement that
-- writes it, a domain's once per session. NOT VALID because 0007 adds them to
-- columns already in use without reading the table (the CHECKs they replaced
-- held the same rules); every value written is checked.
CREATE DOMAIN conveyor.attempt_count AS integer;
ALTER DOMAIN conveyor.attempt_count
    ADD CONSTRAINT attempt_count_check CHECK (VALUE >= 0) NOT VALID;
CREATE DOMAIN conveyor.attempt_limit AS integer;
ALTER DOMAIN conveyor.attempt_limit
    ADD CONSTRAINT attempt_limit_check CHECK (VALUE >= 1) NOT VALID;
-- W3C trace context (0006): version 00, exactly 55 characters, lowercase hex,
-- `00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`; tracestate at most 512.
CREATE DOMAIN conveyor.traceparent AS text;
ALTER DOMAIN conveyor.traceparent
    ADD CONSTRAINT traceparent_check
    CHECK (length(VALUE) = 55
           AND VALUE ~ '^00-[0-9a-f]+-[0-9a-f]+-[0-9a-f][0-9a-f]$'
           AND substr(VALUE, 36, 1) = '-') NOT VALID;
CREATE DOMAIN conveyor.tracestate AS text;
ALTER DOMAIN conveyor.tracestate
    ADD CONSTRAINT tracestate_check CHECK (length(VALUE) <= 512) NOT VALID;

-- The rules on state and topic (0029), which the events table's CHECKs cast
-- to: a domain's rule is planned once per session, a table CHECK's at the
-- start of every statement. Those columns stay text: partial indexes read them.
CREATE DOMAIN conveyor.event_state AS text
    CONSTRAINT events_state_check
    CHECK (VALUE IN ('waiting', 'pending', 'running', 'succeeded', 'failed', 'cancelled'));
CREATE DOMAIN conveyor.event_topic AS text
    CONSTRAINT events_topic_check CHECK (length(VALUE) BETWEEN 1 AND 100);

-- At most 1 MiB of JSON text; a route's own limit is usually lower (0010).
CREATE DOMAIN conveyor.event_result AS jsonb
    CONSTRAINT event_result_check CHECK (octet_length(VALUE::text) <= 1048576);

-- The events' ids: the default of `events` and of its live partition (0025;
-- an identity until then). Owned by events.id, so pg_get_serial_sequence
-- finds it.
CREATE SEQUENCE conveyor.events_id_seq AS bigint;

-- `events` is partitioned by `done` (0025; docs/history-partitions.md): this
-- partition holds every event not finished for good (`done` NULL): pending,
-- running, failed, and finished ones an idempotency key keeps here. Written
-- by name (new events, claims); read through `events`.
CREATE TABLE conveyor.events_live (
    id               bigint      NOT NULL DEFAULT nextval('conveyor.events_id_seq'),
    tenant           text,
    topic            text        NOT NULL,
    payload          jsonb       NOT NULL,
    state            text        NOT NULL DEFAULT 'pending',
    attempts         conveyor.attempt_count NOT NULL DEFAULT 0,
    max_attempts     conveyor.attempt_limit NOT NULL DEFAULT 5,
    priority         smallint    NOT NULL DEFAULT 0,
    run_at           timestamptz NOT NULL DEFAULT now(),
    lease_owner      uuid,
    lease_expires_at timestamptz,
    last_error       text,
    -- The history of failed attempts, NULL until the first (0020).
    errors           jsonb,
    idempotency_key  text,
    created_at       timestamptz NOT NULL DEFAULT now(),
    -- NULL until the event's first change (0020): read as created_at.
    updated_at       timestamptz,
    attempted_at     timestamptz,
    finished_at      timestamptz,
    -- The W3C trace context of the enqueuing span (0006; docs/tracing.md).
    traceparent      conveyor.traceparent,
    tracestate       conveyor.tracestate,
    -- A handler's return value, for routes that store it (0010; docs/results.md).
    result           conveyor.event_result,
    -- The pending event's lane in events_claim_idx: false the open lane, true
    -- the flow claims' lane of a flow-limited pattern (0013;
    -- conveyor/worker/flow.py), NULL the aside lane of events no live worker
    -- handles or a pause holds, which no claim reads (0018;
    -- conveyor/worker/lanes.py).
    limited          boolean     DEFAULT false,
    -- The transaction that wrote the event, for the topics of an ordered
    -- relay route only (0016, 0019: written by the route's trigger, see
    -- order_topics below; NULL for every other event): the ordered relay
    -- reads in (xid, id) order, past no running one.
    xid              xid8,
    -- The partition key (0025): NULL here, true in events_done.
    done             boolean,
    -- The rules on state and topic: CHECKs added to events below (0029).
    -- A running event always has an owner and a lease; nothing else does.
    CONSTRAINT events_lease_check
        CHECK ((state = 'running') = (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)),
    -- What makes this table the partition of `done` NULL without a scan.
    CONSTRAINT events_live_done_check CHECK (done IS NULL),
    -- Its name from before 0025: the parent can have no primary key (its
    -- partition key, `done`, would have to be part of it). Its pages, like
    -- the claim index's, are filled to the brim by appends (0028).
    CONSTRAINT events_pkey PRIMARY KEY (id) WITH (fillfactor = 100)
)
-- Room on each page for a claimed row's next version (0021).
WITH (fillfactor = 85);

-- The parent: the same columns, defaults and rules (but the live one).
CREATE TABLE conveyor.events (
    LIKE conveyor.events_live INCLUDING DEFAULTS INCLUDING CONSTRAINTS
) PARTITION BY LIST (done);
ALTER TABLE conveyor.events DROP CONSTRAINT events_live_done_check;
ALTER SEQUENCE conveyor.events_id_seq OWNED BY conveyor.events.id;
ALTER TABLE conveyor.events ATTACH PARTITION conveyor.events_live FOR VALUES IN (NULL);

-- The history (0025): finished events no key keeps live, one partition per
-- day of finished_at, made ahead and dropped past the retention by the
-- pruner. Its CHECK lets reads of the live states skip it.
CREATE TABLE conveyor.events_done PARTITION OF conveyor.events
    (CONSTRAINT events_done_state_check CHECK (state IN ('succeeded', 'cancelled')),
     CONSTRAINT events_done_finished_check CHECK (finished_at IS NOT NULL))
    FOR VALUES IN (true) PARTITION BY RANGE (finished_at);
CREATE INDEX events_done_id_idx ON conveyor.events_done (id);
CREATE INDEX events_done_cancelled_topic_idx ON conveyor.events_done (topic COLLATE "C", id)
    WHERE state = 'cancelled';
CREATE INDEX events_done_cancelled_tenant_idx ON conveyor.events_done (tenant, id)
    WHERE tenant IS NOT NULL AND state = 'cancelled';

-- The rules on state and topic, for every partition: casts to the domains
-- above, NOT VALID as 0029 adds them to a table in use without reading it.
ALTER TABLE conveyor.events
    ADD CONSTRAINT events_state_check CHECK (state::conveyor.event_state IS NOT NULL) NOT VALID,
    ADD CONSTRAINT events_topic_check CHECK (topic::conveyor.event_topic IS NOT NULL) NOT VALID;

-- The claim query walks this index in order; only pending rows are in it, so
-- millions of finished rows cost the claim nothing. Topic and tenant ride
-- along (0009): status counts the backlog from the index alone. `limited`
-- leads (0013): the plain claims read one lane and the flow claims the other,
-- so a limited pattern's backlog is never in an unlimited event's way.
CREATE INDEX events_claim_idx
    ON conveyor.events_live (limited, priority DESC, run_at, id) INCLUDE (topic, tenant)
    WITH (fillfactor = 100) WHERE state = 'pending';

-- The fair claim (fair_by="tenant") walks the tenants of the limited lane
-- and reads each one's first events (0015); only limited events are in it.
CREATE INDEX events_fair_idx
    ON conveyor.events_live (tenant, priority DESC, run_at, id) INCLUDE (topic)
    WHERE state = 'pending' AND limited;

-- The ordered relay (0016, 0019) walks the topics with pending events that
-- have an xid and reads each matching one's oldest in (xid, id) order. Only
-- the topics of ordered routes have one: other events cost this index nothing.
CREATE INDEX events_relay_order_idx
    ON conveyor.events_live (topic, xid, id)
    WHERE state = 'pending' AND xid IS NOT NULL;

-- The rescuer looks for running events whose lease has expired.
CREATE INDEX events_lease_idx
    ON conveyor.events_live (lease_expires_at)
    WHERE state = 'running';

-- Retention pruning (event_prune) and status's sample of finished rows: only
-- the rows pruning deletes by default, so the failed rows a queue keeps cost a
-- prune pass nothing (0003; it replaced events_finished_idx, which held every
-- finished row).
CREATE INDEX events_prunable_idx
    ON conveyor.events_live (finished_at)
    WHERE state IN ('succeeded', 'cancelled');

-- Exact failed counts per topic (status) and retry-failed, without reading
-- finished rows; only failed rows are in it (0002).
CREATE INDEX events_failed_idx
    ON conveyor.events_live (topic)
    WHERE state = 'failed';

-- The operator's listing of failed and cancelled events by topic, prefix or
-- tenant, newest first (0004): partial, so the hot path never writes them;
-- byte order, so a prefix is one range whatever the database's collation.
CREATE INDEX events_stopped_topic_idx
    ON conveyor.events_live (topic COLLATE "C", id)
    WHERE state IN ('failed', 'cancelled');

CREATE INDEX events_stopped_tenant_idx
    ON conveyor.events_live (tenant, id)
    WHERE tenant IS NOT NULL AND state IN ('failed', 'cancelled');

-- One event per (tenant, key); a NULL tenant counts as one tenant.
CREATE UNIQUE INDEX events_idempotency_idx
    ON conveyor.events_live (tenant, idempotency_key) NULLS NOT DISTINCT
    WHERE idempotency_key IS NOT NULL;

-- Events that wait for others (0022; docs/workflows.md): one row per edge,
-- `event_id` waits for `depends_on`; kept once satisfied, for the graph.
CREATE TABLE conveyor.event_dependencies (
    event_id    bigint  NOT NULL,
    depends_on  bigint  NOT NULL,
    on_failure  text    NOT NULL DEFAULT 'park',
    satisfied   boolean NOT NULL DEFAULT false,
    CONSTRAINT event_dependencies_pkey PRIMARY KEY (event_id, depends_on),
    CONSTRAINT event_dependencies_on_failure_check
        CHECK (on_failure IN ('park', 'cancel', 'ignore')),
    CONSTRAINT event_dependencies_self_check CHECK (event_id <> depends_on)
);

-- The dependency service's passes read only the open edges.
CREATE INDEX event_dependencies_open_idx
    ON conveyor.event_dependencies (depends_on)
    WHERE NOT satisfied;

CREATE INDEX event_dependencies_depends_on_idx
    ON conveyor.event_dependencies (depends_on);

CREATE TABLE conveyor.workers (
    id           uuid        PRIMARY KEY,
    name         text        NOT NULL,
    host         text        NOT NULL,
    pid          integer     NOT NULL,
    topics       text[]      NOT NULL,
    tenants      text[],                 -- NULL: the worker claims every tenant's events
    concurrency  integer     NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    heartbeat_at timestamptz NOT NULL DEFAULT now()
);

-- Paused topic patterns, per tenant or (tenant NULL) for all (0005). The
-- workers' claim skips matching pending events while any row exists; running
-- events finish. Persisted, so a pause survives worker restarts.
CREATE TABLE conveyor.pauses (
    pattern   text        NOT NULL,
    tenant    text,                    -- NULL: every tenant's events
    reason    text,                    -- who paused and why, free text for people
    paused_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT pauses_pattern_check CHECK (length(pattern) BETWEEN 1 AND 102),
    CONSTRAINT pauses_reason_check CHECK (length(reason) <= 500),
    CONSTRAINT pauses_pattern_tenant_key UNIQUE NULLS NOT DISTINCT (pattern, tenant)
);

-- Outcomes per minute and topic, added by the workers at each heartbeat (0008):
-- the dashboard's throughput and failure charts. Pruned after eight days.
CREATE TABLE conveyor.event_counts (
    minute    timestamptz NOT NULL,
    topic     text        NOT NULL,
    succeeded bigint      NOT NULL DEFAULT 0,
    retried   bigint      NOT NULL DEFAULT 0,
    failed    bigint      NOT NULL DEFAULT 0,
    cancelled bigint      NOT NULL DEFAULT 0,
    CONSTRAINT event_counts_pkey PRIMARY KEY (minute, topic)
) WITH (fillfactor = 70);

-- Cron schedules (0011; docs/cron.md): declared by the workers whose router
-- has them, fired by any of them. `fired_through` settles every slot up to
-- it; each fired slot's key is a cron_slots row, inserted with its event.
CREATE TABLE conveyor.cron_schedules (
    name           text        PRIMARY KEY,
    expression     text        NOT NULL,
    timezone       text        NOT NULL,
    topic          text        NOT NULL,
    catch_up       float8      NOT NULL,
    fired_through  timestamptz NOT NULL DEFAULT now(),
    next_fire_at   timestamptz,
    last_fired_at  timestamptz,
    missed         bigint      NOT NULL DEFAULT 0,
    last_missed_at timestamptz,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    -- The operator's expression (NULL: the declared one) and whether the
    -- schedule fires (0022; docs/cron.md#changing-a-schedule-at-run-time).
    expression_override text,
    enabled        boolean     NOT NULL DEFAULT true
);

CREATE TABLE conveyor.cron_slots (
    schedule text        NOT NULL,
    fire_at  timestamptz NOT NULL,
    event_id bigint,
    CONSTRAINT cron_slots_pkey PRIMARY KEY (schedule, fire_at)
);

-- Flow control of routes (0012; docs/flow-control.md): a limited pattern's
-- events are claimed only under its row's lock, within max_running and the
-- token bucket (tokens refill at `rate` per second up to `burst`); with
-- fifo_by (0014), one event per key at a time, in order.
CREATE TABLE conveyor.flow_limits (
    pattern     text        PRIMARY KEY,
    max_running integer,
    rate        float8,
    burst       float8,
    fair_by     text,
    tokens      float8      NOT NULL DEFAULT 0,
    refilled_at timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    fifo_by     text,
    -- The last tenant a fair claim served (0017; NULL: the events without a
    -- tenant, or none yet): the next claim starts with the tenant after it.
    fair_cursor text,
    -- The operator's overrides (0022; NULL: none): the claims use
    -- COALESCE(override, declared); the workers' declarations write only the
    -- declared columns above.
    override_max_running integer,
    override_rate        float8,
    override_burst       float8
);

-- Every control change, written by the change's own statement (0022).
CREATE TABLE conveyor.control_audit (
    id     bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at     timestamptz NOT NULL DEFAULT now(),
    actor  text        NOT NULL,
    kind   text        NOT NULL,
    target text        NOT NULL,
    reason text,
    old    jsonb,
    new    jsonb,
    CONSTRAINT control_audit_actor_check CHECK (length(actor) BETWEEN 1 AND 200),
    CONSTRAINT control_audit_reason_check CHECK (length(reason) <= 500)
);
CREATE INDEX control_audit_target_idx ON conveyor.control_audit (target, id);

-- Open claim windows, a row per batch held in a worker's transaction (0024):
-- a row left behind is a window that never committed, whose attempt the next
-- claim of its events counts. Unlogged: no WAL for a row per batch.
CREATE UNLOGGED TABLE conveyor.claim_windows (
    worker    uuid        NOT NULL,
    window_no bigint      NOT NULL,
    ids       bigint[]    NOT NULL,
    opened_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT claim_windows_pkey PRIMARY KEY (worker, window_no)
);

-- Wake-ups: no trigger (0007). The producer's INSERT statements call
-- pg_notify('conveyor.events', <topic>[|<due epoch>]) themselves, delivered
-- at COMMIT (conveyor/db/queries/events.sql, docs/producing.md).

-- The ordered relay routes' triggers (0019): each route's pattern gets one
-- that writes its events' xid; order_topics creates it.
CREATE FUNCTION "conveyor".stamp_xid() RETURNS trigger
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
CREATE FUNCTION "conveyor".order_topics(pattern text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    name text := 'events_order_' || left(md5(pattern), 16);
    condition text;
    oldest bigint;
    stamped bigint;
BEGIN
    IF EXISTS (SELECT 1 FROM pg_trigger
               WHERE tgrelid = '"conveyor".events_live'::regclass AND tgname = name) THEN
        RETURN NULL;
    END IF;
    SELECT min(id) INTO oldest
    FROM "conveyor".events_live
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
    EXECUTE format('CREATE OR REPLACE TRIGGER %I BEFORE INSERT ON "conveyor".events_live '
                   'FOR EACH ROW WHEN (%s) EXECUTE FUNCTION "conveyor".stamp_xid()',
                   name, condition);
    EXECUTE format('COMMENT ON TRIGGER %I ON "conveyor".events_live IS %L', name,
                   'conveyor: the ordered relay route ' || pattern);
    UPDATE "conveyor".events_live
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
-- partition made ahead (history_make), none until the first is made. A
-- finished event moves only while its finish time is before it, so an
-- acknowledgement never meets a time without its partition: the event stays
-- live instead, and retention deletes it there. `span`: how long each
-- partition is (0026), a whole number of minutes that divides a day, so the
-- partitions of every day start at midnight UTC whatever the span was before.
-- `replayable`: whether the partitions made get a BRIN index on finished_at
-- for a relay's replay (0027: only a queue that relays pays for it).
CREATE TABLE "conveyor".history (
    one   boolean     PRIMARY KEY DEFAULT true CHECK (one),
    until timestamptz,
    span  interval    NOT NULL DEFAULT interval '1 day',
    replayable boolean NOT NULL DEFAULT false,
    CONSTRAINT history_span_check CHECK (
        span BETWEEN interval '1 minute' AND interval '1 day'
        AND extract(epoch FROM span) % 60 = 0
        AND 86400 % extract(epoch FROM span) = 0)
);
INSERT INTO "conveyor".history DEFAULT VALUES;

-- The history's partitions and their bounds, read from the catalog (the
-- truth, whoever made or dropped them). The bounds are rendered in the
-- function's own settings, so they read back the same in any session.
CREATE FUNCTION "conveyor".history_parts()
RETURNS TABLE (name name, starts timestamptz, ends timestamptz)
LANGUAGE sql STABLE
SET datestyle = 'ISO, YMD' SET timezone = 'UTC'
AS $$
    SELECT c.relname, b[1]::timestamptz, b[2]::timestamptz
    FROM pg_inherits AS i
    JOIN pg_class AS c ON c.oid = i.inhrelid,
    LATERAL regexp_match(pg_get_expr(c.relpartbound, c.oid),
                         '^FOR VALUES FROM \(''([^'']+)''\) TO \(''([^'']+)''\)$') AS b
    WHERE i.inhparent = '"conveyor".events_done'::regclass
$$;

-- Makes the history's partitions from the one holding now to the one holding
-- now + `ahead` (partitions shorter than a day: at most 24 ahead, four hours
-- of ten-minute ones, so a short span does not make hundreds of empty
-- tables for every read of the history to open), each `history.span` long, counted from midnight
-- UTC, after the last partition made (each with a BRIN index on
-- finished_at for a relay's replay once the history is replayable, 0027);
-- moves `history.until` to the end of the last. Returns how many it made and the new `until`. Workers call it as
-- they start and with each prune; it needs the right to create tables in the
-- schema (the owner's).
CREATE FUNCTION "conveyor".history_make(ahead interval, OUT made integer, OUT made_until timestamptz)
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
    PERFORM pg_advisory_xact_lock('"conveyor".events_done'::regclass::oid::bigint);
    -- The one row is there from 0025 on; a day if someone deleted it.
    span := coalesce((SELECT h.span FROM "conveyor".history AS h), interval '1 day');
    replayable := coalesce((SELECT h.replayable FROM "conveyor".history AS h), false);
    starts := date_bin(span, now(), timestamptz '2000-01-01 00:00:00+00');
    horizon := now() + CASE WHEN span < interval '1 day' THEN least(ahead, span * 24)
                            ELSE ahead END;
    -- After a change of span, go on from the end of what exists: ranges
    -- never overlap, and a first shorter partition closes the gap to the
    -- new span's boundary.
    SELECT max(p.ends) INTO last_end FROM "conveyor".history_parts() AS p;
    IF last_end > starts THEN
        starts := last_end;
    END IF;
    WHILE starts <= horizon LOOP
        ends := date_bin(span, starts, timestamptz '2000-01-01 00:00:00+00') + span;
        -- A day's partition keeps the name it had before 0026.
        name := 'events_done_' || to_char(starts, CASE
            WHEN ends - starts = interval '1 day' THEN 'YYYYMMDD'
            ELSE 'YYYYMMDD"_"HH24MI' END);
        EXECUTE format('CREATE TABLE "conveyor".%I PARTITION OF "conveyor".events_done '
                       'FOR VALUES FROM (%L) TO (%L)', name, starts, ends);
        IF replayable THEN
            -- Made while empty, so building it costs nothing (0027).
            EXECUTE format('CREATE INDEX %I ON "conveyor".%I USING brin (finished_at) '
                           'WITH (autosummarize = on)', name || '_finished_idx', name);
        END IF;
        made := made + 1;
        starts := ends;
    END LOOP;
    SELECT max(p.ends) INTO made_until FROM "conveyor".history_parts() AS p;
    INSERT INTO "conveyor".history AS h (until, span) VALUES (made_until, span)
    ON CONFLICT (one) DO UPDATE SET until = excluded.until
    WHERE h.until IS DISTINCT FROM excluded.until;
END
$$;

-- Retention: drops the history's partitions that ended `older_than` ago or
-- earlier, whole (no row deleted, nothing left for vacuum); returns how many
-- it dropped. Waits at most half a second for the lock a DROP takes (then
-- lock_not_available: the next prune tries again).
CREATE FUNCTION "conveyor".history_drop(older_than interval) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    part record;
    dropped integer := 0;
BEGIN
    PERFORM set_config('lock_timeout', '500ms', true);
    FOR part IN
        SELECT p.name FROM "conveyor".history_parts() AS p
        WHERE p.ends <= now() - older_than
        ORDER BY p.ends
    LOOP
        EXECUTE format('DROP TABLE "conveyor".%I', part.name);
        dropped := dropped + 1;
    END LOOP;
    RETURN dropped;
END
$$;

-- Makes the history replayable (above): the partitions made from now on get
-- the index, and so does each made already that holds no row yet (those
-- made ahead); one that holds rows stays without (building its index would
-- hold back the acknowledgements moving rows into it), and a replay reads
-- it whole until retention drops it. Returns how many indexes it made.
CREATE FUNCTION "conveyor".history_replayable() RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    part record;
    empty boolean;
    made integer := 0;
BEGIN
    PERFORM set_config('lock_timeout', '500ms', true);
    PERFORM pg_advisory_xact_lock('"conveyor".events_done'::regclass::oid::bigint);
    INSERT INTO "conveyor".history AS h (replayable) VALUES (true)
    ON CONFLICT (one) DO UPDATE SET replayable = true WHERE NOT h.replayable;
    FOR part IN
        SELECT p.name FROM "conveyor".history_parts() AS p
        WHERE to_regclass(format('"conveyor".%I', p.name || '_finished_idx')) IS NULL
    LOOP
        EXECUTE format('SELECT NOT EXISTS (SELECT FROM "conveyor".%I)', part.name) INTO empty;
        IF empty THEN
            EXECUTE format('CREATE INDEX %I ON "conveyor".%I USING brin (finished_at) '
                           'WITH (autosummarize = on)', part.name || '_finished_idx', part.name);
            made := made + 1;
        END IF;
    END LOOP;
    RETURN made;
END
$$;

-- 0025's functions, kept for workers of an older release: they follow the
-- span too.
CREATE FUNCTION "conveyor".history_make_days(ahead integer) RETURNS integer
LANGUAGE plpgsql AS $$
BEGIN
    IF ahead IS NULL OR ahead < 0 THEN
        RAISE EXCEPTION 'expected ahead to be a number of days >= 0, got %', ahead
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN (SELECT m.made FROM "conveyor".history_make(ahead * interval '1 day') AS m);
END
$$;

CREATE FUNCTION "conveyor".history_drop_days(older_than double precision)
RETURNS integer
LANGUAGE sql AS $$
    SELECT "conveyor".history_drop(older_than * interval '1 second')
$$;
