-- Conveyor 0005: persisted pauses (Admin.pause, `conveyor pause`).
-- `{schema}` is replaced by the quoted schema identifier; this file holds no
-- other braces on purpose.
--
-- A row stops every worker from claiming the pending events whose topic
-- matches `pattern` (an exact topic, "prefix.*" or "*"), of one tenant or,
-- with tenant NULL, of every tenant. It lives in the database rather than in
-- the workers' memory, so a restarted worker honours it (Oban OSS loses a
-- pause on restart, oban#318; River keeps it in a row). Events already
-- running finish normally.
--
-- The workers read this table only while it holds rows: with it empty the
-- claim is the statement it was before 0005 (events.sql, event_claim and
-- event_claim_unpaused).
CREATE TABLE IF NOT EXISTS {schema}.pauses (
    pattern   text        NOT NULL,
    tenant    text,                    -- NULL: every tenant's events
    reason    text,                    -- who paused and why, free text for people
    paused_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT pauses_pattern_check CHECK (length(pattern) BETWEEN 1 AND 102),
    CONSTRAINT pauses_reason_check CHECK (length(reason) <= 500),
    -- One row per (pattern, tenant); a NULL tenant counts as one tenant.
    CONSTRAINT pauses_pattern_tenant_key UNIQUE NULLS NOT DISTINCT (pattern, tenant)
);
