-- Named queries of the migrator.

-- name: migration_lock
-- Serialises concurrent migrators (20 processes starting at once) on one key
-- per schema; released at commit.
SELECT pg_advisory_xact_lock(hashtext('conveyor.migrate:' || %(schema)s))

-- name: migration_create_schema
CREATE SCHEMA IF NOT EXISTS {schema}

-- name: migration_create_table
CREATE TABLE IF NOT EXISTS {schema}.migrations (
    version    integer     PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)

-- name: migration_applied
SELECT version FROM {schema}.migrations ORDER BY version

-- name: migration_record
INSERT INTO {schema}.migrations (version, name) VALUES (%(version)s, %(name)s)

-- name: migration_table_exists
SELECT to_regclass(%(table)s) IS NOT NULL

-- name: migration_steps_try_lock
-- Held by the session across the steps of a stepped migration, each committed
-- on its own, so one migrator runs them. A key of its own, not
-- migration_lock's, and tried rather than waited for: a migrator waiting in a
-- statement holds a snapshot, and a CREATE INDEX CONCURRENTLY in the holder's
-- step waits for every older snapshot, so each would wait for the other.
-- Through a pooler in transaction mode a session is not one server
-- connection: the migrator refuses to run steps there (migration_backend_pid).
SELECT pg_try_advisory_lock(hashtext('conveyor.migrate-steps:' || %(schema)s))

-- name: migration_steps_unlock
SELECT pg_advisory_unlock(hashtext('conveyor.migrate-steps:' || %(schema)s))

-- name: migration_steps_wait
-- The pause between two tries of migration_steps_try_lock, on the server so
-- the sync and async migrators share it; its own short transaction.
SELECT pg_sleep(%(seconds)s)

-- name: migration_backend_pid
-- The server's own backend pid: a pooler announces another one to its clients.
SELECT pg_backend_pid()

-- name: migration_create_steps_table
-- The steps of a stepped migration committed so far, created with the first
-- stepped migration. The version row in migrations is written with the last
-- step, so everything reading migrations alone sees a migration complete or
-- not at all.
CREATE TABLE IF NOT EXISTS {schema}.migration_steps (
    version    integer     NOT NULL,
    step       integer     NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (version, step)
)

-- name: migration_steps_done
-- The steps recorded of migrations not complete: where each resumes.
SELECT s.version, s.step FROM {schema}.migration_steps s
WHERE NOT EXISTS (SELECT 1 FROM {schema}.migrations m WHERE m.version = s.version)
ORDER BY s.version, s.step

-- name: migration_step_recorded
-- Whether another migrator ran this step while this one waited for the lock.
SELECT EXISTS (SELECT 1 FROM {schema}.migration_steps
               WHERE version = %(version)s AND step = %(step)s)

-- name: migration_step_record
INSERT INTO {schema}.migration_steps (version, step) VALUES (%(version)s, %(step)s)
