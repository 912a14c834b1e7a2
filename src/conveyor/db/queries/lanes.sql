-- The aside lane (migration 0018; conveyor/worker/lanes.py, docs/workers.md).
-- `limited IS NULL` is the aside lane of events_claim_idx: no claim reads it.
-- The fragments included here (`_paused`, `_claim_filter`, ...) are events.sql's.

-- name: lane_lock
-- Orders bringing back after setting aside (docs/workers.md#the-aside-lane):
-- a worker bringing events back waits for this lock, one setting aside tries
-- it (lane_try_lock), each before its statement, so a bring-back sees every
-- set-aside committed before it and a set-aside every registration and
-- resume committed before it. Bring-backs take turns too: two side by side
-- could each return part of a key's events (SKIP LOCKED), the later part
-- first, and a fifo_by key would run its later event first.
SELECT pg_advisory_xact_lock(hashtextextended(%(key)s, 0))

-- name: lane_try_lock
-- lane_lock for setting aside: false at once when another worker holds it
-- (setting aside, or bringing back).
SELECT pg_try_advisory_xact_lock(hashtextextended(%(key)s, 0))

-- name: lane_set_aside
-- Moves to the aside lane the events at the front of the open lane (the next
-- `window` in claim order, read from events_claim_idx alone) that a pause
-- holds back, or that neither this worker (`all_topics`... `tenants`: its own
-- claim filter) nor any worker that beat within `alive_within` seconds may
-- claim (the registry's topic patterns and tenants). Each (topic, tenant) of
-- the window is judged once. Rows a claim holds are skipped: it is taking them.
-- The live partition by name (0025): a ctid is a place in one table.
WITH front AS (
    SELECT ctid, topic, tenant
    FROM {schema}.events_live
    WHERE state = 'pending'
      AND NOT limited
    ORDER BY priority DESC, run_at, id
    LIMIT %(window)s
), pairs AS (
    SELECT DISTINCT topic, tenant FROM front
), unclaimed AS (
    SELECT pairs.topic, pairs.tenant
    FROM pairs
    WHERE -- include: _paused(pairs.topic, pairs.tenant)
       OR (NOT (-- include: _topic_in(pairs.topic)
                AND (%(all_tenants)s OR pairs.tenant = ANY(%(tenants)s::text[])))
           AND NOT EXISTS (
              SELECT 1
              FROM {schema}.workers AS w
              CROSS JOIN LATERAL unnest(w.topics) AS wp(pattern)
              WHERE w.heartbeat_at > now() - %(alive_within)s * interval '1 second'
                AND -- include: _pattern_matches(wp.pattern, pairs.topic)
                AND (w.tenants IS NULL OR pairs.tenant = ANY(w.tenants))))
), picked AS (
    -- The rows found again by their place in the table (a TID scan): by id,
    -- as a join or an array, a table not analyzed since a bulk insert got a
    -- plan that walked the whole open lane once per row of the window
    -- (1,600 x 20,000 entries: 5 s). A row changed since is checked again
    -- (the lock follows it to its new version).
    SELECT id
    FROM {schema}.events_live
    WHERE ctid = ANY (ARRAY(
              SELECT front.ctid
              FROM front
              JOIN unclaimed ON unclaimed.topic = front.topic
                            AND unclaimed.tenant IS NOT DISTINCT FROM front.tenant))
      -- include: _still_open
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.events AS e
SET limited = NULL
WHERE -- include: _found_by_id(picked)

-- name: lane_bring_back
-- Moves back to the open lane up to `batch` events of the aside lane that
-- this worker may claim (its claim filter) and no pause holds: it started,
-- a pause was lifted, or it was taken for gone meanwhile. The next sort of a
-- flow limit puts a limited pattern's ones in their lane again.
WITH aside AS (
    SELECT id
    FROM {schema}.events
    WHERE state = 'pending'
      AND limited IS NULL
      -- include: _claim_filter
      -- include: _claim_unpaused
    -- The front first, so the claims can start on the first batch. `limited`
    -- leads the order, as it leads events_claim_idx: an IS NULL test does not
    -- tell the planner the column is constant, and without it the whole aside
    -- lane was read and sorted for every batch (tests/worker/test_claim_plan.py).
    ORDER BY limited, priority DESC, run_at, id
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.events AS e
SET limited = false
WHERE -- include: _found_by_id(aside)
