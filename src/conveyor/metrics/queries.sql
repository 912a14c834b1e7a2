-- Named queries of the database gauges. `{schema}` is the quoted schema
-- identifier; the fragments of conveyor/db/queries may be included.

-- name: metrics_try_lock
-- One refresher per schema: a session advisory lock, kept while the
-- connection lives, so it is released when the worker exits or dies. The
-- first key is fixed (ASCII 'cvmt'), the second the schema's hash.
SELECT pg_try_advisory_lock(1668709748, hashtext(%(schema)s))

-- name: metrics_cron
-- Every cron schedule (declared by code, so few): slots skipped since it was
-- declared, how long its next slot is overdue (grows while no worker fires
-- it), and seconds since it last fired (NULL before its first slot).
SELECT name, missed,
       CASE WHEN enabled
            THEN COALESCE(GREATEST(0, extract(epoch FROM now() - next_fire_at)), 0)
            ELSE 0 END::float8 AS overdue_s,
       extract(epoch FROM now() - last_fired_at)::float8 AS last_fire_age_s
FROM {schema}.cron_schedules
ORDER BY name

-- name: metrics_pauses
-- Pauses in force and the age of the oldest: one row, whatever their number.
SELECT count(*) AS n, extract(epoch FROM now() - min(paused_at))::float8 AS oldest_s
FROM {schema}.pauses

-- name: metrics_flow
-- Every flow-limited pattern (declared by code or set by an operator, so
-- few): its running events
-- fleet-wide, matched as a pause's pattern is (exact, `prefix.*`, `*`),
-- each count read from events_lease_idx (running rows only: at most
-- the workers' slots); its max_running in force (an override wins, 0023);
-- and the tokens its bucket holds now,
-- refilled as flow_lock's reader refills them (rate-limited patterns only).
SELECT f.pattern, COALESCE(f.override_max_running, f.max_running) AS max_running,
       (SELECT count(*) FROM {schema}.events AS e
        WHERE e.state = 'running'
          AND -- include: _pattern_matches(f.pattern, e.topic)
       ) AS running,
       CASE WHEN COALESCE(f.override_rate, f.rate) IS NOT NULL
            THEN LEAST(COALESCE(f.override_burst, f.burst),
                       f.tokens + COALESCE(f.override_rate, f.rate) * GREATEST(
                           0, extract(epoch FROM clock_timestamp() - f.refilled_at)))::float8
       END AS tokens
FROM {schema}.flow_limits AS f
ORDER BY f.pattern
