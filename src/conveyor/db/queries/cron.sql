-- Cron schedules (migration 0011; conveyor/worker/scheduler.py, docs/cron.md).

-- name: cron_declare
-- A worker's schedules, at its start: new ones begin at now(), the
-- database's clock or a test's (they do not fire for the past); a changed
-- definition is updated, an unchanged one is left alone (no row version, no
-- lock held against a firing worker).
INSERT INTO {schema}.cron_schedules (name, expression, timezone, topic, catch_up, fired_through)
SELECT d.*, COALESCE(%(now)s::timestamptz, now())
FROM unnest(%(names)s::text[], %(expressions)s::text[], %(timezones)s::text[],
            %(topics)s::text[], %(catch_ups)s::float8[]) AS d
ON CONFLICT (name) DO UPDATE
SET expression = EXCLUDED.expression, timezone = EXCLUDED.timezone, topic = EXCLUDED.topic,
    catch_up = EXCLUDED.catch_up, updated_at = now()
WHERE (cron_schedules.expression, cron_schedules.timezone, cron_schedules.topic,
       cron_schedules.catch_up)
      IS DISTINCT FROM (EXCLUDED.expression, EXCLUDED.timezone, EXCLUDED.topic, EXCLUDED.catch_up)

-- name: cron_lock
-- The schedule's row, locked for this firing, with the moment it fires up
-- to: the database's clock (or a test's, passed in), and the operator's
-- override of its expression and whether it fires (0023). A row another
-- worker holds is skipped: that worker is firing it.
SELECT fired_through, COALESCE(%(now)s::timestamptz, now()) AS now, expression_override, enabled
FROM {schema}.cron_schedules
WHERE name = %(name)s
FOR UPDATE SKIP LOCKED

-- name: cron_fire
-- Enqueue the slots' events: a slot whose key exists is skipped, so each
-- (schedule, fire_at) enqueues one event, ever. The event's id is taken
-- first so the slot can name it; its idempotency key names the slot
-- (`cron:<schedule>@<UTC instant>`, what conveyor.cron.fire_time() reads).
WITH slot AS (
    INSERT INTO {schema}.cron_slots (schedule, fire_at, event_id)
    SELECT %(name)s, fire_at,
           nextval(pg_get_serial_sequence(%(table)s, 'id'))
    FROM unnest(%(fire_ats)s::timestamptz[]) AS s(fire_at)
    ON CONFLICT DO NOTHING
    RETURNING fire_at, event_id
), fired AS (
    INSERT INTO {schema}.events_live (id, tenant, topic, payload, priority, max_attempts,
                                 idempotency_key)
    SELECT slot.event_id, %(tenant)s, %(topic)s::text, %(payload)s::jsonb, %(priority)s,
           %(max_attempts)s::int,
           'cron:' || %(name)s || '@'
               || to_char(slot.fire_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS"Z"')
    FROM slot
    ON CONFLICT DO NOTHING
    RETURNING id
)
SELECT count(*) AS fired FROM fired

-- name: cron_advance
-- Settle the slots up to `through`: fired or, older than the catch-up
-- window, skipped and counted.
UPDATE {schema}.cron_schedules
SET fired_through = GREATEST(fired_through, %(through)s),
    next_fire_at = %(next_fire_at)s,
    last_fired_at = CASE WHEN %(fired)s > 0 THEN %(last_fired_at)s ELSE last_fired_at END,
    missed = missed + %(missed)s,
    last_missed_at = CASE WHEN %(missed)s > 0 THEN %(through)s ELSE last_missed_at END
WHERE name = %(name)s

-- name: cron_list
-- The schedules for `conveyor status`, with how long the next slot is
-- overdue (a disabled schedule never is), and the operator's override.
SELECT name, expression, timezone, topic, catch_up, fired_through, next_fire_at,
       last_fired_at, missed, last_missed_at,
       CASE WHEN enabled THEN GREATEST(0, extract(epoch FROM now() - next_fire_at))
            ELSE 0 END::float8 AS overdue_s,
       expression_override, enabled
FROM {schema}.cron_schedules
ORDER BY name

-- name: cron_remove
-- Audited (0023) by the same statement.
WITH removed AS (
    DELETE FROM {schema}.cron_schedules WHERE name = %(name)s
    RETURNING name, expression, timezone, topic, expression_override, enabled
), audited AS (
    INSERT INTO {schema}.control_audit (actor, kind, target, reason, old, new)
    SELECT COALESCE(%(actor)s::text, session_user::text), 'schedule.remove', removed.name,
           %(reason)s::text, to_jsonb(removed) - 'name', NULL
    FROM removed
)
SELECT name FROM removed

-- name: cron_slots_prune
-- Fired slots older than `keep` seconds, a batch at a time: the schedules'
-- cursors, not these rows, decide what fires next.
DELETE FROM {schema}.cron_slots
WHERE (schedule, fire_at) IN (
    SELECT schedule, fire_at FROM {schema}.cron_slots
    WHERE fire_at < now() - %(keep)s * interval '1 second'
    LIMIT %(limit)s)
