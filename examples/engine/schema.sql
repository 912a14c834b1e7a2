-- The example engine's own tables, in schema "engine".
CREATE SCHEMA IF NOT EXISTS engine;

CREATE TABLE IF NOT EXISTS engine.tenants (
    name text PRIMARY KEY
);

CREATE TABLE IF NOT EXISTS engine.filejobs (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant     text        NOT NULL REFERENCES engine.tenants (name),
    file       text        NOT NULL,
    status     text        NOT NULL DEFAULT 'pending'
               CHECK (status IN ('pending', 'done', 'failed')),
    result     jsonb,
    error      text,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE IF NOT EXISTS engine.tasks (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    tenant     text        NOT NULL REFERENCES engine.tenants (name),
    title      text        NOT NULL,
    status     text        NOT NULL DEFAULT 'pending'
               CHECK (status IN ('pending', 'done', 'failed')),
    result     jsonb,
    error      text,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- Replayed writes (same tenant and Idempotency-Key) get the first answer back.
CREATE TABLE IF NOT EXISTS engine.idempotency (
    tenant     text        NOT NULL,
    key        text        NOT NULL,
    status     integer     NOT NULL,
    response   jsonb       NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, key)
);
-- The request a key was first used for ("PATCH /api/filejobs/7"); NULL in rows
-- written before the column existed.
ALTER TABLE engine.idempotency ADD COLUMN IF NOT EXISTS request text;
