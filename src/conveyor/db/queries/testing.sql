-- Queries of conveyor.testing, the public helpers for users' own tests.

-- name: event_find
-- The events assert_enqueued and refute_enqueued compare, oldest first: those
-- of one topic, tenant and state (each filter folds away when not given), with
-- event_get's columns and due_in, the seconds from the transaction's now()
-- until run_at (negative once due). The other fields are matched in Python.
SELECT id, tenant, topic, payload, state, attempts, max_attempts, priority, run_at,
       lease_owner::text, lease_expires_at, last_error, errors, idempotency_key,
       created_at, COALESCE(updated_at, created_at) AS updated_at, attempted_at, finished_at, result,
       extract(epoch FROM run_at - now())::float8 AS due_in
FROM {schema}.events
WHERE (%(topic)s::text IS NULL OR topic = %(topic)s::text)
  AND (NOT %(by_tenant)s OR tenant IS NOT DISTINCT FROM %(tenant)s::text)
  AND (%(state)s::text IS NULL OR state = %(state)s::text)
ORDER BY id
