-- Named queries on the pauses table (0005): persisted pauses of topic
-- patterns, per tenant or for all. `{schema}` is replaced by the quoted
-- schema identifier; parameters are always bound, never formatted in.

-- name: pause_upsert
-- Pausing what is already paused keeps its paused_at (the pause did not
-- start again) and replaces the reason only when a new one is given.
-- The columns are unpacked by admin_core.pause_from_row (PAUSE_COLUMNS).
INSERT INTO {schema}.pauses AS p (pattern, tenant, reason)
VALUES (%(pattern)s, %(tenant)s, %(reason)s)
ON CONFLICT ON CONSTRAINT pauses_pattern_tenant_key
DO UPDATE SET reason = COALESCE(EXCLUDED.reason, p.reason)
RETURNING pattern, tenant, reason, paused_at

-- name: pause_delete
-- Exactly the pause named: resuming "email.*" leaves "email.send" and the
-- per-tenant pauses of "email.*" in place.
DELETE FROM {schema}.pauses
WHERE pattern = %(pattern)s AND tenant IS NOT DISTINCT FROM %(tenant)s
RETURNING pattern

-- name: pause_list
-- Also the worker's re-check (twice a second): which pauses are in force.
SELECT pattern, tenant, reason, paused_at
FROM {schema}.pauses
ORDER BY pattern, tenant NULLS FIRST
