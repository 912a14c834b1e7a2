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

-- name: horizon_oldest
-- Who holds back the vacuum horizon of this database the longest: a session
-- with an open snapshot or transaction id, or a prepared transaction. Rows
-- that died after its snapshot cannot be removed while it lasts. Ages are
-- taken at this statement, not at the start of the caller's transaction.
SELECT kind, who, seconds, xid_age
FROM (
    SELECT 'session' AS kind,
           format('pid %s (%s, %s)', pid,
                  COALESCE(NULLIF(application_name, ''), usename::text), state) AS who,
           extract(epoch FROM statement_timestamp() - xact_start)::float8 AS seconds,
           COALESCE(age(backend_xmin), age(backend_xid)) AS xid_age
    FROM pg_stat_activity
    WHERE datname = current_database()
      AND pid <> pg_backend_pid()
      AND xact_start IS NOT NULL
      AND (backend_xmin IS NOT NULL OR backend_xid IS NOT NULL)
    UNION ALL
    SELECT 'prepared transaction', gid,
           extract(epoch FROM statement_timestamp() - prepared)::float8, age(transaction)
    FROM pg_prepared_xacts
    WHERE database = current_database()
) AS holders
ORDER BY seconds DESC
LIMIT 1

-- name: events_dead_rows
SELECT n_dead_tup, n_live_tup FROM pg_stat_user_tables WHERE relid = to_regclass(%(table)s)
