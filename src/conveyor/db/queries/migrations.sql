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
