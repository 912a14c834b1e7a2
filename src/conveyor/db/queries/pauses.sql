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
SELECT pattern, tenant, reason, paused_at
FROM {schema}.pauses
ORDER BY pattern, tenant NULLS FIRST

-- name: pause_any
-- Whether the worker must claim with event_claim_unpaused; one row at most.
SELECT EXISTS (SELECT 1 FROM {schema}.pauses)

-- name: pause_print
-- Every pause as one text, read while some pause exists: a worker that sees
-- it change brings back the events a lifted pause had set aside (0018), even
-- without the !pause notification (a poll-only worker, a pause deleted in SQL).
SELECT string_agg(format('%s %s', pattern, tenant), ',' ORDER BY pattern, tenant)
FROM {schema}.pauses
