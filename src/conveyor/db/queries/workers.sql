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
SELECT id::text, name, host, pid, topics, started_at, heartbeat_at, tenants, concurrency
FROM {schema}.workers
WHERE heartbeat_at > now() - %(within)s * interval '1 second'
ORDER BY started_at

-- name: clock_now
-- The database's clock, for workers to line their local timers up with run_at.
SELECT extract(epoch FROM clock_timestamp())::float8

-- name: horizon_holders
-- Who may be holding back the vacuum horizon of this database, oldest first:
-- sessions here with an open snapshot or transaction id, sessions anywhere in
-- the cluster holding a transaction id (every snapshot taken here counts it as
-- running, so it pins this database too), a standby's feedback, replication
-- slots holding an xmin, and prepared transactions. Vacuum's
-- own snapshots hold nothing back. `seconds` is NULL where this role may not
-- read the start time (another role's session without pg_read_all_stats);
-- `key` then lets the worker time the holder from when it first saw it. Ages
-- are taken at this statement, not at the start of the caller's transaction.
-- A session that is `idle` (between two commands of its client) is left out:
-- it holds no transaction of its client's, only, for a moment, one the server
-- runs itself to read notifications (or invalidations) for it, whose snapshot
-- shows as its backend_xmin and whose xact_start is its last command's start,
-- long past: a worker's idle LISTEN session was named as an old pin that way
-- (R13b, CI). `idle in transaction` and `active` sessions are listed, and a
-- walsender, whatever its state (a standby's feedback).
SELECT kind, who, seconds, xid_age, key
FROM (
    -- A walsender's xmin is a standby's feedback: it is named as the standby
    -- (its application_name and address), which is what an operator must find.
    SELECT CASE WHEN backend_type = 'walsender' THEN 'standby' ELSE 'session' END AS kind,
           CASE WHEN backend_type = 'walsender'
                THEN format('%s at %s (walsender pid %s)',
                            COALESCE(NULLIF(application_name, ''), 'unnamed standby'),
                            COALESCE(host(client_addr), 'local socket'), pid)
                ELSE format('pid %s (%s%s%s)', pid,
                            COALESCE(NULLIF(application_name, ''), usename::text, 'unknown'),
                            COALESCE(', ' || state, ''),
                            CASE WHEN datname IS DISTINCT FROM current_database()
                                 THEN ', database ' || datname ELSE '' END)
           END AS who,
           extract(epoch FROM statement_timestamp() - xact_start)::float8 AS seconds,
           GREATEST(age(backend_xid), age(backend_xmin)) AS xid_age,
           format('%s:%s', pid, COALESCE(backend_xid, backend_xmin)) AS key
    FROM pg_stat_activity
    WHERE pid <> pg_backend_pid()
      AND backend_type IS DISTINCT FROM 'autovacuum worker'
      AND (state IS DISTINCT FROM 'idle' OR backend_type = 'walsender')
      AND (backend_xid IS NOT NULL
           OR (backend_xmin IS NOT NULL AND datname = current_database())
           -- a standby's hot_standby_feedback arrives as its walsender's xmin
           OR (backend_xmin IS NOT NULL AND backend_type = 'walsender'))
    UNION ALL
    SELECT 'replication slot', format('%s (%s)', slot_name, slot_type), NULL::float8,
           age(xmin), format('slot:%s:%s', slot_name, xmin)
    FROM pg_replication_slots
    WHERE xmin IS NOT NULL
    UNION ALL
    SELECT 'prepared transaction', format('%s (database %s)', gid, database),
           extract(epoch FROM statement_timestamp() - prepared)::float8, age(transaction),
           'prepared:' || gid
    FROM pg_prepared_xacts
) AS holders
ORDER BY seconds DESC NULLS FIRST, xid_age DESC
LIMIT 20

-- name: events_dead_rows
SELECT n_dead_tup, n_live_tup FROM pg_stat_user_tables WHERE relid = to_regclass(%(table)s)

-- name: vacuum_health
-- Whether autovacuum looks after the events table (vacuum_health.py reads it
-- by these names): the server's switch, the table's own options, and its dead
-- rows and last analysis. A catalog read; the table itself is not touched.
SELECT current_setting('autovacuum') AS autovacuum,
       c.reloptions AS reloptions,
       s.n_dead_tup AS dead_rows,
       greatest(s.last_analyze, s.last_autoanalyze) AS last_analyzed
FROM pg_class AS c
LEFT JOIN pg_stat_all_tables AS s ON s.relid = c.oid
WHERE c.oid = to_regclass(%(table)s)
