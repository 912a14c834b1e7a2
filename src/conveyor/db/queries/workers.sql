-- Named queries on the worker registry.

-- name: worker_register
INSERT INTO {schema}.workers (id, name, host, pid, topics, tenants, concurrency)
VALUES (%(id)s, %(name)s, %(host)s, %(pid)s, %(topics)s, %(tenants)s, %(concurrency)s)
ON CONFLICT (id) DO UPDATE SET heartbeat_at = now()

-- name: worker_heartbeat
INSERT INTO {schema}.workers (id, name, host, pid, topics, tenants, concurrency)
VALUES (%(id)s, %(name)s, %(host)s, %(pid)s, %(topics)s, %(tenants)s, %(concurrency)s)
ON CONFLICT (id) DO UPDATE SET heartbeat_at = now()

-- name: worker_unregister
DELETE FROM {schema}.workers WHERE id = %(id)s

-- name: worker_prune_dead
-- Registry rows of workers silent for a long time; their events are rescued
-- through lease expiry, not through this table.
DELETE FROM {schema}.workers
WHERE heartbeat_at < now() - %(older_than)s * interval '1 second'

-- name: worker_list_alive
SELECT id::text, name, host, pid, topics, started_at, heartbeat_at, tenants
FROM {schema}.workers
WHERE heartbeat_at > now() - %(within)s * interval '1 second'
ORDER BY started_at

-- name: clock_now
-- The database's clock, for workers to line their local timers up with run_at.
SELECT extract(epoch FROM clock_timestamp())::float8
