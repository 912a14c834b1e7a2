-- Flow control (migration 0012; conveyor/worker/flow.py, docs/flow-control.md).
-- The fragments included here (`_topic_in`, `_claim_*`, ...) are events.sql's.

-- name: flow_declare
-- A worker's limited routes, at its start: a new pattern starts with a full
-- bucket; a changed definition is updated, an unchanged one left alone.
INSERT INTO {schema}.flow_limits (pattern, max_running, rate, burst, fair_by, fifo_by, tokens)
SELECT d.pattern, d.max_running, d.rate, d.burst, d.fair_by, d.fifo_by, COALESCE(d.burst, 0)
FROM unnest(%(patterns)s::text[], %(max_runnings)s::int[], %(rates)s::float8[],
            %(bursts)s::float8[], %(fair_bys)s::text[], %(fifo_bys)s::text[])
     AS d(pattern, max_running, rate, burst, fair_by, fifo_by)
ON CONFLICT (pattern) DO UPDATE
SET max_running = EXCLUDED.max_running, rate = EXCLUDED.rate, burst = EXCLUDED.burst,
    fair_by = EXCLUDED.fair_by, fifo_by = EXCLUDED.fifo_by, updated_at = now()
WHERE (flow_limits.max_running, flow_limits.rate, flow_limits.burst, flow_limits.fair_by,
       flow_limits.fifo_by)
      IS DISTINCT FROM (EXCLUDED.max_running, EXCLUDED.rate, EXCLUDED.burst, EXCLUDED.fair_by,
                        EXCLUDED.fifo_by)

-- name: flow_list
-- The limits in force: an operator's override (0023) wins over the declared value.
SELECT pattern, COALESCE(override_max_running, max_running) AS max_running,
       COALESCE(override_rate, rate) AS rate, fair_by, fifo_by
FROM {schema}.flow_limits
ORDER BY pattern

-- name: flow_remove
DELETE FROM {schema}.flow_limits WHERE pattern = %(pattern)s RETURNING pattern

-- name: flow_lock
-- The pattern's row, for one claim: the next statements of this transaction
-- see every claim committed before (READ COMMITTED takes a new snapshot per
-- statement). A row another worker holds is skipped: it is claiming. An
-- operator's override (0023) wins over the declared value, read here at
-- each claim, so a changed limit holds from the next claim on.
SELECT COALESCE(override_max_running, max_running) AS max_running,
       COALESCE(override_rate, rate) AS rate, COALESCE(override_burst, burst) AS burst, tokens,
       GREATEST(0, extract(epoch FROM clock_timestamp() - refilled_at))::float8 AS idle_s
FROM {schema}.flow_limits
WHERE pattern = %(pattern)s
FOR UPDATE SKIP LOCKED

-- name: flow_running
-- Running events of the pattern, fleet-wide: read from events_lease_idx,
-- which holds only running rows.
SELECT count(*)
FROM {schema}.events
WHERE state = 'running'
  AND -- include: _topic_in(topic)

-- name: flow_take_tokens
UPDATE {schema}.flow_limits
SET tokens = %(tokens)s, refilled_at = clock_timestamp()
WHERE pattern = %(pattern)s

-- name: flow_claim
-- event_claim for one limited pattern, within the budget the caller
-- computed under the pattern's lock; pauses always apply here. The limit's
-- pattern (`limit_*`) and the worker's own topics both filter. It reads the
-- limited lane only (0013): flow_sort puts the pattern's events there.
WITH next AS (
    SELECT id
    FROM {schema}.events
    WHERE state = 'pending'
      AND limited
      AND run_at <= now()
      AND -- include: _topic_in(topic, limit_)
      -- include: _claim_filter
      -- include: _claim_unpaused
    -- include: _claim_order
)
-- include: _claim_update

-- name: flow_claim_fair
-- flow_claim taking the tenants in turn: each tenant's first `limit` due
-- events are numbered (its turns), and the claim takes every tenant's first
-- before anyone's second, so a tenant with a deep backlog cannot hold back
-- another's event. Within a turn the tenants come in name order, starting
-- after the last one the pattern's claims served (flow_limits.fair_cursor,
-- 0017; events without a tenant are one more tenant, after every name, whose
-- turn leaves the cursor NULL), and the claim records the last one it serves:
-- so claims of one event each (max_running=1, a rate limit's tokens one by
-- one) serve the tenants round-robin instead of the oldest backlog each time.
-- Priority orders a tenant's own events, not the turns. The tenants are
-- walked through events_fair_idx (0015: the limited lane by tenant; one probe
-- per tenant, a recursive skip scan), and each one's first events read from
-- it, so the cost follows the number of tenants, not the backlog. The caller
-- holds the pattern's row (flow_lock).
WITH RECURSIVE tenants AS (
    (SELECT tenant FROM {schema}.events
     WHERE state = 'pending' AND limited AND tenant IS NOT NULL
     ORDER BY tenant LIMIT 1)
    UNION ALL
    SELECT (SELECT e.tenant FROM {schema}.events AS e
            WHERE e.state = 'pending' AND e.limited AND e.tenant > t.tenant
            ORDER BY e.tenant LIMIT 1)
    FROM tenants AS t
    WHERE t.tenant IS NOT NULL
), firsts AS (
    SELECT f.*
    FROM tenants AS t
    CROSS JOIN LATERAL (
        SELECT id, t.tenant,
               row_number() OVER (ORDER BY priority DESC, run_at, id) AS turn
        FROM (SELECT id, priority, run_at
              FROM {schema}.events
              WHERE state = 'pending' AND limited AND tenant = t.tenant
                AND run_at <= now()
                AND -- include: _topic_in(topic, limit_)
                -- include: _claim_filter
              ORDER BY priority DESC, run_at, id
              LIMIT %(limit)s) AS own
    ) AS f
    WHERE t.tenant IS NOT NULL
    UNION ALL
    SELECT id, NULL::text,
           row_number() OVER (ORDER BY priority DESC, run_at, id) AS turn
    FROM (SELECT id, priority, run_at
          FROM {schema}.events
          WHERE state = 'pending' AND limited AND tenant IS NULL
            AND run_at <= now()
            AND -- include: _topic_in(topic, limit_)
            AND -- include: _topic_in(topic)
            AND %(all_tenants)s
          ORDER BY priority DESC, run_at, id
          LIMIT %(limit)s) AS untenanted
), placed AS (
    -- `later`: the tenants up to the cursor wait for the next round of this
    -- turn (after the cursor: not later; no cursor: nobody is).
    SELECT firsts.*, (firsts.tenant <= (SELECT fair_cursor FROM {schema}.flow_limits
                                        WHERE pattern = %(pattern)s)) IS TRUE AS later
    FROM firsts
), next AS (
    SELECT events.id, placed.tenant, placed.turn, placed.later
    FROM {schema}.events
    JOIN placed ON placed.id = events.id
    -- The candidates by id as well as by the join: the planner cannot tell how
    -- few they are, and from a few thousand rows to some tens of thousands it
    -- read the whole table to hash-join them (measured: docs/flow-control.md).
    WHERE -- include: _found_by_id(placed, events)
      AND events.state = 'pending'
      -- include: _claim_unpaused
    ORDER BY placed.turn, placed.later, placed.tenant NULLS LAST
    LIMIT %(limit)s
    FOR UPDATE OF events SKIP LOCKED
), claimed AS (
    -- include: _claim_update
), served AS (
    UPDATE {schema}.flow_limits
    SET fair_cursor = (SELECT tenant FROM next
                       ORDER BY turn DESC, later DESC, tenant DESC NULLS FIRST LIMIT 1)
    WHERE pattern = %(pattern)s
      AND EXISTS (SELECT 1 FROM next)
)
SELECT * FROM claimed

-- name: flow_claim_fifo
-- flow_claim for a pattern with fifo_by (0014): each key's head is claimed
-- only when it is pending and due, so the events of one key run one at a time
-- and in order. The head is the key's running event while it has one (a
-- pending event of the key, whatever its priority, waits for it), else its
-- first unfinished event by priority, then id (a retry's later due time keeps
-- its place). The key is the tenant (`fifo_tenant`) or the payload's value at
-- `fifo_path`; events without it share one key. Unfinished: running, or
-- pending in the limited lane (a flow claim leaves its events there, so a
-- retried or rescued event is back in it) and either due or attempted before.
-- A fresh event that is not due yet (enqueued with a delay) is left out: it
-- takes its place when it comes due, and does not hold its key meanwhile. An
-- event still in the open lane is not seen: only the sorts move it, the open
-- lane's front in claim order, one sort at a time and holding none back, so it is a
-- later arrival.
WITH unfinished AS (
    SELECT id, state, priority, run_at,
           CASE WHEN %(fifo_tenant)s THEN tenant ELSE payload #>> %(fifo_path)s::text[] END AS k
    FROM {schema}.events
    WHERE (state = 'running'
           OR (state = 'pending' AND limited AND (run_at <= now() OR attempted_at IS NOT NULL)))
      AND -- include: _topic_in(topic, limit_)
      -- include: _claim_filter
), heads AS (
    SELECT DISTINCT ON (k) id, state, priority, run_at
    FROM unfinished
    ORDER BY k, state = 'running' DESC, priority DESC, id
), next AS (
    SELECT events.id
    FROM {schema}.events
    JOIN heads ON heads.id = events.id
    WHERE heads.state = 'pending'
      AND heads.run_at <= now()
      AND events.state = 'pending'
      -- include: _claim_unpaused
    ORDER BY heads.priority DESC, heads.run_at, heads.id
    LIMIT %(limit)s
    FOR UPDATE OF events SKIP LOCKED
)
-- include: _claim_update

-- name: _claim_flow_moves
-- The rest of event_claim_flow and event_claim_flow_unpaused, after `seen`
-- (the candidates in claim order, `held`: of a limited pattern): the held
-- ones are moved to the limited lane, the others claimed. The claimed rows
-- come in CLAIM_COLUMNS order followed by `moved`, how many events this
-- claim moved (the same on every row); a claim that moved some and claimed
-- none returns one row with `moved` alone, its event columns NULL. Nothing
-- moved and nothing claimed: no row.
), moved AS (
    UPDATE {schema}.events AS e
    SET limited = true
    WHERE -- include: _found_by_id(seen WHERE held)
    RETURNING e.id
), next AS (
    SELECT id FROM seen WHERE NOT held
), claimed AS (
    -- include: _claim_update
)
SELECT claimed.*, tally.moved
FROM (SELECT count(*)::int AS moved FROM moved) AS tally
LEFT JOIN claimed ON true
WHERE claimed.id IS NOT NULL OR tally.moved > 0

-- name: event_claim_flow
-- The plain claim of a worker while flow limits exist: event_claim leaving
-- every limited pattern's events (`except_*`) to the flow claims. Most of
-- them are in the limited lane already (flow_sort); one still in the open
-- lane (written since the last sort) is moved there by the claim that meets
-- it, so no claim meets it twice. Its last column, `moved`, counts the
-- events it moved (_claim_flow_moves): the worker claims again at once after
-- a claim that moved some (conveyor/worker/claims.py).
-- A fifo_by pattern's events (`fifo_*`) are neither moved nor locked here:
-- only flow_sort moves them, one sort at a time, so they reach the limited
-- lane in claim order. A claim that moved a key's later event while another
-- statement held its earlier one (SKIP LOCKED) made the later one the key's
-- head until that statement committed: the per-key relay published out of
-- order under load (tests/worker/test_flow_turns.py).
WITH seen AS (
    SELECT id, -- include: _topic_in(topic, except_)
               AS held
    -- include: _claim_candidates
      AND NOT -- include: _topic_in(topic, fifo_)
    -- include: _claim_order
-- include: _claim_flow_moves

-- name: event_claim_flow_unpaused
-- event_claim_flow while a pause may be in force (event_claim_unpaused's
-- pause test). Equal to event_claim_flow but for that test.
WITH seen AS (
    SELECT id, -- include: _topic_in(topic, except_)
               AS held
    -- include: _claim_candidates
      AND NOT -- include: _topic_in(topic, fifo_)
      -- include: _claim_unpaused
    -- include: _claim_order
-- include: _claim_flow_moves

-- name: flow_sort_lock
-- Taken (or not: false at once) in the transaction of a flow_sort while a
-- fifo_by limit exists, so two sorts never split a key's events.
SELECT pg_try_advisory_xact_lock(hashtextextended(%(key)s, 0))

-- name: flow_sort
-- Moves the limited patterns' events (`limit_*`: every limit of the fleet)
-- from the front of the open lane of events_claim_idx into the limited lane
-- (0013), where only the flow claims read. The front is the next `window`
-- events in claim order (read from the index alone); an event further back is
-- moved when it gets there. Rows a claim holds are skipped: it is taking them.
-- While a fifo_by limit exists the sorts of the fleet take turns (flow_sort_lock):
-- no claim holds a fifo_by event (event_claim_flow), so none is skipped, and a
-- key's events reach the limited lane in claim order.
-- The live partition by name (0025): a ctid is a place in one table.
WITH front AS (
    SELECT ctid, topic
    FROM {schema}.events_live
    WHERE state = 'pending'
      AND NOT limited
    ORDER BY priority DESC, run_at, id
    LIMIT %(window)s
), picked AS (
    -- By their place in the table, not a join: lanes.sql's lane_set_aside says why.
    SELECT id
    FROM {schema}.events_live
    WHERE ctid = ANY (ARRAY(
              SELECT front.ctid FROM front
              WHERE -- include: _topic_in(front.topic, limit_)
          ))
      -- include: _still_open
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.events AS e
SET limited = true
WHERE -- include: _found_by_id(picked)

-- name: flow_unsort
-- Moves back to the open lane up to `batch` events of the limited lane that
-- no limit (`limit_*`: every limit of the fleet) covers any more: a row
-- deleted from flow_limits, a pattern narrowed. Without this they would wait
-- for a flow claim that no longer comes.
WITH stale AS (
    SELECT id
    FROM {schema}.events
    WHERE state = 'pending'
      AND limited
      AND NOT -- include: _topic_in(topic, limit_)
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.events AS e
SET limited = false
WHERE -- include: _found_by_id(stale)
