-- Named queries on the pauses table (0005): persisted pauses of topic
-- patterns, per tenant or for all. `{schema}` is replaced by the quoted
-- schema identifier; parameters are always bound, never formatted in.

-- name: pause_upsert
-- Pausing what is already paused keeps its paused_at (the pause did not
-- start again) and replaces the reason only when a new one is given.
-- The columns are unpacked by admin_core.pause_from_row (PAUSE_COLUMNS).
-- The audit row (0023, controls.sql) is written by the same statement.
WITH before AS (
    SELECT jsonb_build_object('tenant', tenant, 'reason', reason, 'paused_at', paused_at) AS old
    FROM {schema}.pauses
    WHERE pattern = %(pattern)s AND tenant IS NOT DISTINCT FROM %(tenant)s::text
), changed AS (
    INSERT INTO {schema}.pauses AS p (pattern, tenant, reason)
    VALUES (%(pattern)s, %(tenant)s, %(reason)s)
    ON CONFLICT ON CONSTRAINT pauses_pattern_tenant_key
    DO UPDATE SET reason = COALESCE(EXCLUDED.reason, p.reason)
    RETURNING pattern, tenant, reason, paused_at
), audited AS (
    INSERT INTO {schema}.control_audit (actor, kind, target, reason, old, new)
    SELECT COALESCE(%(actor)s::text, session_user::text), 'pause.set', changed.pattern,
           %(reason)s::text, (SELECT old FROM before),
           jsonb_build_object('tenant', changed.tenant, 'reason', changed.reason,
                              'paused_at', changed.paused_at)
    FROM changed
)
SELECT pattern, tenant, reason, paused_at FROM changed

-- name: pause_delete
-- Exactly the pause named: resuming "email.*" leaves "email.send" and the
-- per-tenant pauses of "email.*" in place. Audited as pause_upsert is.
WITH removed AS (
    DELETE FROM {schema}.pauses
    WHERE pattern = %(pattern)s AND tenant IS NOT DISTINCT FROM %(tenant)s::text
    RETURNING pattern, tenant, reason, paused_at
), audited AS (
    INSERT INTO {schema}.control_audit (actor, kind, target, reason, old, new)
    SELECT COALESCE(%(actor)s::text, session_user::text), 'pause.resume', removed.pattern,
           %(reason)s::text,
           jsonb_build_object('tenant', removed.tenant, 'reason', removed.reason,
                              'paused_at', removed.paused_at),
           NULL
    FROM removed
)
SELECT pattern FROM removed

-- name: pause_list
-- Also the worker's re-check (twice a second): which pauses are in force.
SELECT pattern, tenant, reason, paused_at
FROM {schema}.pauses
ORDER BY pattern, tenant NULLS FIRST
