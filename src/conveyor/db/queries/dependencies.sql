-- Named queries of events that wait for other events (0022; docs/workflows.md).
-- `{schema}` is replaced by the quoted schema identifier; parameters are
-- always bound, never formatted in.

-- name: step_parents_missing
-- The ids among `ids` that name no event: a dependency must exist when its
-- dependent is written (an event written earlier in the same transaction does).
SELECT coalesce(array_agg(x.id ORDER BY x.id), ARRAY[]::bigint[])
FROM unnest(%(ids)s::bigint[]) AS x(id)
WHERE NOT EXISTS (SELECT 1 FROM {schema}.events AS e WHERE e.id = x.id)

-- name: step_insert_many
-- A workflow's events with ids reserved up front (event_reserve_ids), each
-- `waiting` or, with no dependency, `pending`; one wake-up per topic of the
-- pending ones, as event_insert_many_ids sends. No idempotency keys: a step
-- skipped for its key would leave its edges pointing at nothing.
WITH new AS (
    INSERT INTO {schema}.events_live
        (id, tenant, topic, payload, priority, max_attempts, run_at, state)
    SELECT t.id, t.tenant, t.topic, t.payload::jsonb, t.priority, t.max_attempts,
           COALESCE(t.run_at, now() + t.delay * interval '1 second'), t.state
    FROM unnest(%(ids)s::bigint[], %(tenants)s::text[], %(topics)s::text[], %(payloads)s::text[],
                %(priorities)s::smallint[], %(max_attempts)s::int[], %(delays)s::float8[],
                %(run_ats)s::timestamptz[], %(states)s::text[])
         AS t(id, tenant, topic, payload, priority, max_attempts, delay, run_at, state)
    RETURNING id, topic, run_at, state
), woken AS (
    SELECT count(
        -- include: _wake(due.topic, due.run_at)
    )
    FROM (SELECT topic, min(run_at) AS run_at FROM new WHERE state = 'pending'
          GROUP BY topic) AS due
    WHERE -- include: _notify_on(due.run_at)
)
SELECT new.id FROM new, woken

-- name: step_edges_add
-- The edges of waiting events, and the dependency services' wake-up
-- ('!deps', conveyor/notify.py), delivered at COMMIT: the first pass after
-- it settles every edge whose dependency had already finished.
WITH edges AS (
    INSERT INTO {schema}.event_dependencies (event_id, depends_on, on_failure)
    SELECT * FROM unnest(%(event_ids)s::bigint[], %(depends_on)s::bigint[],
                         %(on_failure)s::text[])
    RETURNING 1
)
SELECT count(*), pg_notify({channel}, '!deps') FROM edges

-- name: deps_try_lock
-- One dependency pass at a time, fleet-wide: the others skip theirs (this
-- one settles what they would have).
SELECT pg_try_advisory_xact_lock(hashtext(%(key)s))

-- name: deps_release
-- One pass of the dependency service: the open edges whose dependency has
-- finished (or is gone: pruned, or deleted at its acknowledgement with
-- retention 0, which only a success is) become satisfied, and each waiting
-- event they held is decided: `pending` when no open edge is left; `failed`
-- (parked) or `cancelled` at once when a dependency failed or was cancelled
-- and its edge says so (`ignore` counts it as satisfied). The open count is
-- the snapshot's, which does not see this statement's own updates: the
-- edges it closes are subtracted. A decided event wakes its topic (pending)
-- or Admin.wait (failed, cancelled); one it failed or cancelled is a finished
-- dependency for the next pass.
WITH done AS (
    SELECT d.event_id, d.depends_on, d.on_failure,
           COALESCE(p.state, 'succeeded') AS parent_state
    FROM {schema}.event_dependencies AS d
    LEFT JOIN {schema}.events AS p ON p.id = d.depends_on
    WHERE NOT d.satisfied
      AND (p.id IS NULL OR p.state IN ('succeeded', 'failed', 'cancelled'))
    ORDER BY d.depends_on, d.event_id
    LIMIT %(limit)s
), closed AS (
    UPDATE {schema}.event_dependencies AS d
    SET satisfied = true
    FROM done
    WHERE d.event_id = done.event_id AND d.depends_on = done.depends_on
    RETURNING d.event_id
), fate AS (
    SELECT done.event_id,
           count(*) AS closed,
           min(done.depends_on) FILTER (WHERE done.parent_state <> 'succeeded'
                                          AND done.on_failure = 'cancel') AS cancelled_by,
           min(done.depends_on) FILTER (WHERE done.parent_state <> 'succeeded'
                                          AND done.on_failure = 'park') AS parked_by,
           (array_agg(done.parent_state ORDER BY done.depends_on)
                FILTER (WHERE done.parent_state <> 'succeeded'
                          AND done.on_failure <> 'ignore'))[1] AS broken_state
    FROM done
    GROUP BY done.event_id
), decided AS (
    SELECT f.*, CASE WHEN f.cancelled_by IS NOT NULL THEN 'cancelled'
                     WHEN f.parked_by IS NOT NULL THEN 'failed'
                     ELSE 'pending' END AS state
    FROM fate AS f
    WHERE f.cancelled_by IS NOT NULL OR f.parked_by IS NOT NULL
       OR f.closed = (SELECT count(*) FROM {schema}.event_dependencies AS o
                      WHERE o.event_id = f.event_id AND NOT o.satisfied)
), moved AS (
    UPDATE {schema}.events AS e
    SET state = d.state,
        run_at = CASE WHEN d.state = 'pending' THEN greatest(e.run_at, now()) ELSE e.run_at END,
        last_error = CASE WHEN d.state = 'pending' THEN e.last_error
                          ELSE format('dependency %%s %%s', coalesce(d.cancelled_by, d.parked_by),
                                      d.broken_state) END,
        finished_at = CASE WHEN d.state = 'pending' THEN NULL ELSE now() END,
        updated_at = now(),
        -- A cancelled one goes into the history, as any cancel does (0025).
        done = CASE WHEN d.state = 'cancelled' AND -- include: _into_history
                    THEN true END
    FROM decided AS d
    WHERE e.id = d.event_id
      AND e.state = 'waiting'
    RETURNING e.id, e.topic, e.state, e.run_at
), woken AS (
    SELECT count(
        -- include: _wake(due.topic, due.run_at)
    )
    FROM (SELECT topic, min(run_at) AS run_at FROM moved WHERE state = 'pending'
          GROUP BY topic) AS due
), told AS (
    SELECT count(pg_notify(%(results_channel)s, id::text)) FROM moved WHERE state <> 'pending'
)
SELECT (SELECT count(*) FROM closed) AS closed,
       (SELECT count(*) FROM moved WHERE state = 'pending') AS released,
       (SELECT count(*) FROM moved WHERE state <> 'pending') AS stopped,
       (SELECT * FROM woken) AS woken,
       (SELECT * FROM told) AS told

-- name: deps_forget
-- The edges of events retention has pruned (or deleted at their
-- acknowledgement), at most `limit`: the graph of a finished workflow goes
-- with its steps. Reads the whole edges table: run every few minutes.
DELETE FROM {schema}.event_dependencies AS d
WHERE (d.event_id, d.depends_on) IN (
    SELECT o.event_id, o.depends_on FROM {schema}.event_dependencies AS o
    WHERE NOT EXISTS (SELECT 1 FROM {schema}.events AS e WHERE e.id = o.event_id)
    LIMIT %(limit)s)

-- name: deps_open
-- Whether any edge is still open: the service polls while one is.
SELECT EXISTS (SELECT 1 FROM {schema}.event_dependencies WHERE NOT satisfied)

-- name: step_parent_results
-- The dependencies of one event with their states and stored results, in id
-- order (a pruned one with its id only). Columns: conveyor.records.Dependency's.
SELECT d.depends_on AS id, p.topic, p.state, p.result AS value
FROM {schema}.event_dependencies AS d
LEFT JOIN {schema}.events AS p ON p.id = d.depends_on
WHERE d.event_id = %(id)s
ORDER BY d.depends_on

-- name: workflow_graph
-- Every event connected to `id` by dependency edges, either way (at most
-- `limit`), with their edges: `conveyor workflow show`. Columns:
-- conveyor.records.WorkflowStep's.
WITH RECURSIVE linked(id) AS (
    SELECT %(id)s::bigint
    UNION
    SELECT CASE WHEN d.event_id = l.id THEN d.depends_on ELSE d.event_id END
    FROM linked AS l
    JOIN {schema}.event_dependencies AS d ON d.event_id = l.id OR d.depends_on = l.id
)
SELECT l.id, e.topic, e.state, e.attempts, e.last_error AS error, e.finished_at,
       coalesce((SELECT array_agg(d.depends_on ORDER BY d.depends_on)
                 FROM {schema}.event_dependencies AS d WHERE d.event_id = l.id), ARRAY[]::bigint[])
           AS depends_on
FROM (SELECT id FROM linked LIMIT %(limit)s) AS l
LEFT JOIN {schema}.events AS e ON e.id = l.id
ORDER BY l.id
