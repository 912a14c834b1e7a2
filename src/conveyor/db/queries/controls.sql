-- Run-time control (migration 0023; conveyor/admin_controls_async.py,
-- docs/admin.md#run-time-control): operator overrides of flow limits and cron
-- schedules, and the audit log. Each change writes its audit row in the same
-- statement (a data-modifying WITH), so the row exists exactly when the
-- change commits, even on an autocommit connection. `actor` NULL: the
-- database role. `before` reads the row as the statement's snapshot saw it,
-- before the change.

-- name: flow_override_set
-- Sets the overrides given (NULL: keeps that field's override); a pattern no
-- route declared gets a row of its own, its bucket full.
WITH before AS (
    SELECT override_max_running, override_rate, override_burst
    FROM {schema}.flow_limits WHERE pattern = %(pattern)s
), changed AS (
    INSERT INTO {schema}.flow_limits AS f (pattern, override_max_running, override_rate,
                                           override_burst, tokens)
    VALUES (%(pattern)s, %(max_running)s::int, %(rate)s::float8, %(burst)s::float8,
            COALESCE(%(burst)s::float8, 0))
    ON CONFLICT (pattern) DO UPDATE
    SET override_max_running = COALESCE(EXCLUDED.override_max_running, f.override_max_running),
        override_rate = COALESCE(EXCLUDED.override_rate, f.override_rate),
        override_burst = COALESCE(EXCLUDED.override_burst, f.override_burst),
        updated_at = now()
    RETURNING pattern, override_max_running, override_rate, override_burst
), audited AS (
    INSERT INTO {schema}.control_audit (actor, kind, target, reason, old, new)
    SELECT COALESCE(%(actor)s::text, session_user::text), 'limit.set', changed.pattern,
           %(reason)s::text,
           (SELECT jsonb_build_object('max_running', override_max_running,
                                      'rate', override_rate, 'burst', override_burst)
            FROM before),
           jsonb_build_object('max_running', changed.override_max_running,
                              'rate', changed.override_rate, 'burst', changed.override_burst)
    FROM changed
)
SELECT pattern FROM changed

-- name: flow_override_clear
-- Back to the declared limit; a row that only the override made (no route
-- declares the pattern: every declared column NULL) is deleted. No row, or
-- no override: nothing changes and nothing is audited.
WITH before AS (
    SELECT pattern, override_max_running, override_rate, override_burst,
           (max_running, rate, fair_by, fifo_by) IS NULL AS undeclared
    FROM {schema}.flow_limits
    WHERE pattern = %(pattern)s
      AND (override_max_running, override_rate, override_burst) IS DISTINCT FROM (NULL, NULL, NULL)
), cleared AS (
    UPDATE {schema}.flow_limits AS f
    SET override_max_running = NULL, override_rate = NULL, override_burst = NULL,
        updated_at = now()
    FROM before
    WHERE f.pattern = before.pattern AND NOT before.undeclared
    RETURNING f.pattern
), dropped AS (
    DELETE FROM {schema}.flow_limits AS f
    USING before
    WHERE f.pattern = before.pattern AND before.undeclared
    RETURNING f.pattern
), audited AS (
    INSERT INTO {schema}.control_audit (actor, kind, target, reason, old, new)
    SELECT COALESCE(%(actor)s::text, session_user::text), 'limit.clear', before.pattern,
           %(reason)s::text,
           jsonb_build_object('max_running', override_max_running,
                              'rate', override_rate, 'burst', override_burst),
           NULL
    FROM before
)
SELECT pattern FROM cleared UNION ALL SELECT pattern FROM dropped

-- name: flow_limit_list
-- Every limit (or one pattern's) as declared and overridden, with its running
-- events fleet-wide (read from events_lease_idx, as flow_running).
-- The columns are unpacked by admin_controls_core.limit_from_row (LIMIT_COLUMNS).
SELECT f.pattern, f.max_running, f.rate, f.burst, f.fair_by, f.fifo_by,
       f.override_max_running, f.override_rate, f.override_burst,
       (SELECT count(*) FROM {schema}.events AS e
        WHERE e.state = 'running'
          AND -- include: _pattern_matches(f.pattern, e.topic)
       ) AS running,
       f.updated_at
FROM {schema}.flow_limits AS f
WHERE %(pattern)s::text IS NULL OR f.pattern = %(pattern)s
ORDER BY f.pattern

-- name: cron_control_get
-- The schedule's row, locked until the caller's change commits, with what
-- the change needs to check the expression (its zone) and compute the next slot.
SELECT name, expression, timezone, expression_override, enabled, now() AS now
FROM {schema}.cron_schedules
WHERE name = %(name)s
FOR UPDATE

-- name: cron_control
-- Sets the schedule's override and whether it fires. `restart`: slots up to
-- now are settled without firing (a changed expression, or an enabled
-- schedule, starts from the change, as a new schedule does).
WITH before AS (
    SELECT expression, expression_override, enabled
    FROM {schema}.cron_schedules WHERE name = %(name)s
), changed AS (
    UPDATE {schema}.cron_schedules
    SET expression_override = %(expression_override)s::text, enabled = %(enabled)s,
        fired_through = CASE WHEN %(restart)s THEN GREATEST(fired_through, now())
                             ELSE fired_through END,
        next_fire_at = %(next_fire_at)s::timestamptz, updated_at = now()
    WHERE name = %(name)s
    RETURNING name, expression, expression_override, enabled
), audited AS (
    INSERT INTO {schema}.control_audit (actor, kind, target, reason, old, new)
    SELECT COALESCE(%(actor)s::text, session_user::text), %(kind)s::text, changed.name,
           %(reason)s::text,
           (SELECT jsonb_build_object('expression', COALESCE(expression_override, expression),
                                      'override', expression_override, 'enabled', enabled)
            FROM before),
           jsonb_build_object('expression',
                              COALESCE(changed.expression_override, changed.expression),
                              'override', changed.expression_override,
                              'enabled', changed.enabled)
    FROM changed
)
SELECT name FROM changed

-- name: control_audit_list
-- Newest first; `kind` is a kind ('limit.set') or its family ('limit').
-- The columns are unpacked by admin_controls_core.audit_from_row (AUDIT_COLUMNS).
SELECT id, at, actor, kind, target, reason, old, new
FROM {schema}.control_audit
WHERE (%(target)s::text IS NULL OR target = %(target)s::text)
  AND (%(kind)s::text IS NULL OR kind = %(kind)s::text
       OR split_part(kind, '.', 1) = %(kind)s::text)
  AND (%(before)s::bigint IS NULL OR id < %(before)s::bigint)
ORDER BY id DESC
LIMIT %(limit)s
