-- Conveyor 0023: run-time control of flow limits and cron schedules, and the
-- audit log of every operator change (docs/admin.md#run-time-control).
-- `{schema}` is replaced by the quoted schema identifier; this file holds no
-- other braces on purpose.
--
-- An override is the operator's value; the declared one is what the routes'
-- code wrote (flow_declare and cron_declare write only the declared columns,
-- so a worker that starts again never undoes an override). The effective
-- value is the override when there is one: flow_lock and flow_list read
-- COALESCE(override, declared). NULL: no override. A limit no route declares
-- may exist by its override alone (its declared columns all NULL); clearing
-- that override deletes the row.
ALTER TABLE {schema}.flow_limits
    ADD COLUMN override_max_running integer,
    ADD COLUMN override_rate        float8,
    ADD COLUMN override_burst       float8;

-- A schedule's expression as the operator set it (NULL: the declared one),
-- and whether it fires at all: a disabled schedule's slots are settled
-- without firing, and enabling it starts from that moment.
ALTER TABLE {schema}.cron_schedules
    ADD COLUMN expression_override text,
    ADD COLUMN enabled             boolean NOT NULL DEFAULT true;

-- One row per control change (pause, resume, limit set or cleared, schedule
-- changed, disabled, enabled or removed), written by the statement that makes
-- the change, so in its transaction: a rolled-back change leaves none. `at`
-- is the transaction's time; `actor` who asked (the CLI's OS user, the
-- dashboard's user, or the caller's choice; by default the database role);
-- `old` and `new` the control's row before and after (NULL: none).
CREATE TABLE {schema}.control_audit (
    id     bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at     timestamptz NOT NULL DEFAULT now(),
    actor  text        NOT NULL,
    kind   text        NOT NULL,
    target text        NOT NULL,
    reason text,
    old    jsonb,
    new    jsonb,
    CONSTRAINT control_audit_actor_check CHECK (length(actor) BETWEEN 1 AND 200),
    CONSTRAINT control_audit_reason_check CHECK (length(reason) <= 500)
);
CREATE INDEX control_audit_target_idx ON {schema}.control_audit (target, id);
