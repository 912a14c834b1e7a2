-- Conveyor 0011: cron schedules, fired by every worker and exactly once per slot.
-- `{schema}` is replaced by the quoted schema identifier; this file holds no
-- other braces on purpose.
--
-- No leader: each worker whose router declares a schedule may fire it
-- (docs/cron.md). A slot fires in one transaction that locks the schedule's
-- row (FOR UPDATE SKIP LOCKED: a worker finding it locked leaves it to the
-- one holding it), inserts the slot's (schedule, fire_at) key and its event,
-- and moves `fired_through` past it. The key is what makes a slot fire once
-- even if two transactions were ever to reach it: the second one's insert
-- finds the key and enqueues nothing.
--
-- `fired_through`: every slot up to this instant is settled, fired or
-- skipped; a new schedule starts at its first registration, so it does not
-- fire for the past. `next_fire_at` is the next slot as the last worker to
-- fire computed it: `conveyor status` reports a schedule whose next slot is
-- long past as overdue, the sign that no worker's scheduler is running it.
-- `missed` counts slots skipped because they were older than the catch-up
-- window when a worker got to them (after downtime).
CREATE TABLE {schema}.cron_schedules (
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
    updated_at     timestamptz NOT NULL DEFAULT now()
);

-- One row per fired slot, kept a day (the workers' pruning pass), with the
-- event it enqueued.
CREATE TABLE {schema}.cron_slots (
    schedule text        NOT NULL,
    fire_at  timestamptz NOT NULL,
    event_id bigint,
    CONSTRAINT cron_slots_pkey PRIMARY KEY (schedule, fire_at)
);
