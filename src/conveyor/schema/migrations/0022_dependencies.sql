-- Conveyor 0022: events that wait for other events (docs/workflows.md).
-- `{schema}` is replaced by the quoted schema identifier; this file holds no
-- other braces on purpose.
--
-- An event enqueued with dependencies starts in the state `waiting`, which
-- no claim, lane or index of the hot path reads: an application that never
-- declares a dependency writes, claims and acknowledges exactly as before
-- (tests/test_queries.py counts it). A worker's dependency service
-- (conveyor/worker/dependencies.py) reads the unsatisfied edges below, marks
-- those whose event finished, and makes a waiting event `pending` when none
-- is left, or parks, cancels or releases it when one failed or was cancelled
-- (each edge carries its own rule).
--
-- Widening the CHECK: the new one is added NOT VALID and validated at once,
-- which reads the table once (no row is written).
ALTER TABLE {schema}.events DROP CONSTRAINT events_state_check;
ALTER TABLE {schema}.events ADD CONSTRAINT events_state_check
    CHECK (state IN ('waiting', 'pending', 'running', 'succeeded', 'failed', 'cancelled'))
    NOT VALID;
ALTER TABLE {schema}.events VALIDATE CONSTRAINT events_state_check;

-- One row per edge: `event_id` waits for `depends_on`. Kept after it is
-- satisfied, so a workflow's graph and its steps' parents stay readable
-- (conveyor workflow show, canvas.parent_results) until the pruner removes
-- the waiting event, and its edges with it.
CREATE TABLE {schema}.event_dependencies (
    event_id    bigint  NOT NULL,
    depends_on  bigint  NOT NULL,
    -- What a failed or cancelled dependency does to the waiting event: park
    -- it as failed, cancel it, or count as satisfied.
    on_failure  text    NOT NULL DEFAULT 'park',
    satisfied   boolean NOT NULL DEFAULT false,
    CONSTRAINT event_dependencies_pkey PRIMARY KEY (event_id, depends_on),
    CONSTRAINT event_dependencies_on_failure_check
        CHECK (on_failure IN ('park', 'cancel', 'ignore')),
    CONSTRAINT event_dependencies_self_check CHECK (event_id <> depends_on)
);

-- The dependency service's pass reads only the edges still open: a finished
-- workflow's edges cost it nothing.
CREATE INDEX event_dependencies_open_idx
    ON {schema}.event_dependencies (depends_on)
    WHERE NOT satisfied;

-- A step's dependents, for the graph (both directions of an edge).
CREATE INDEX event_dependencies_depends_on_idx
    ON {schema}.event_dependencies (depends_on);
