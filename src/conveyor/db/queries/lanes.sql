-- The aside lane (migration 0018; conveyor/worker/lanes.py, docs/workers.md).
-- `limited IS NULL` is the aside lane of events_claim_idx: no claim reads it.

-- name: lane_lock
-- Orders setting aside against bringing back (docs/workers.md#the-aside-lane):
-- both take this transaction-scoped lock first, so their next statement sees
-- every registration, resume and bring-back committed before it. A worker
-- bringing events back waits for it; one setting aside tries (lane_try_lock).
SELECT pg_advisory_xact_lock(hashtextextended(%(key)s, 0))

-- name: lane_try_lock
-- lane_lock for setting aside: false at once when another worker holds it.
SELECT pg_try_advisory_xact_lock(hashtextextended(%(key)s, 0))

-- name: lane_set_aside
-- Moves to the aside lane the events at the front of the open lane (the next
-- `window` in claim order, read from events_claim_idx alone) that a pause
-- holds back, or that neither this worker (`all_topics`... `tenants`: its own
-- claim filter) nor any worker that beat within `alive_within` seconds may
-- claim (the registry's topic patterns and tenants). Each (topic, tenant) of
-- the window is judged once. Rows a claim holds are skipped: it is taking them.
WITH front AS (
    SELECT id, topic, tenant
    FROM {schema}.events
    WHERE state = 'pending'
      AND NOT limited
    ORDER BY priority DESC, run_at, id
    LIMIT %(window)s
), pairs AS (
    SELECT DISTINCT topic, tenant FROM front
), unclaimed AS (
    SELECT pairs.topic, pairs.tenant
    FROM pairs
    WHERE EXISTS (
              SELECT 1 FROM {schema}.pauses AS p
              WHERE (p.pattern = '*' OR p.pattern = pairs.topic
                     OR (right(p.pattern, 2) = '.*'
                         AND starts_with(pairs.topic, left(p.pattern, -1))))
                AND (p.tenant IS NULL OR p.tenant = pairs.tenant))
       OR (NOT ((%(all_topics)s OR pairs.topic = ANY(%(topics)s::text[])
                 OR pairs.topic LIKE ANY(%(prefixes)s::text[]))
                AND (%(all_tenants)s OR pairs.tenant = ANY(%(tenants)s::text[])))
           AND NOT EXISTS (
              SELECT 1
              FROM {schema}.workers AS w
              CROSS JOIN LATERAL unnest(w.topics) AS wp(pattern)
              WHERE w.heartbeat_at > now() - %(alive_within)s * interval '1 second'
                AND (wp.pattern = '*' OR wp.pattern = pairs.topic
                     OR (right(wp.pattern, 2) = '.*'
                         AND starts_with(pairs.topic, left(wp.pattern, -1))))
                AND (w.tenants IS NULL OR pairs.tenant = ANY(w.tenants))))
), picked AS (
    -- The ids as an array, so each row is found through the primary key: as
    -- a join, a table not analyzed since a bulk insert (its pending rows
    -- estimated at a handful) got a nested loop that scanned every pending
    -- row once per row of the window (3,000 x 3,000: 30 s).
    SELECT id
    FROM {schema}.events
    WHERE id = ANY (ARRAY(
              SELECT front.id
              FROM front
              JOIN unclaimed ON unclaimed.topic = front.topic
                            AND unclaimed.tenant IS NOT DISTINCT FROM front.tenant))
      AND state = 'pending'
      AND NOT limited
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.events AS e
SET limited = NULL
FROM picked
WHERE e.id = picked.id

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
      AND (%(all_topics)s OR topic = ANY(%(topics)s::text[]) OR topic LIKE ANY(%(prefixes)s::text[]))
      AND (%(all_tenants)s OR tenant = ANY(%(tenants)s::text[]))
      -- include: _claim_unpaused
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.events AS e
SET limited = false
FROM aside
WHERE e.id = aside.id
