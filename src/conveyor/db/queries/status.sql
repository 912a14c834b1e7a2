-- Named queries behind Admin.status / `conveyor status`. `{schema}` is replaced
-- by the quoted schema identifier; parameters are always bound.
--
-- None of them may read the whole events table (reliability plan R14): a queue
-- keeps millions of finished rows, and a count(*) over them costs seconds. The
-- states that stay small are counted exactly through their partial indexes;
-- succeeded and cancelled are counted exactly only while there are few finished
-- rows, and estimated from the planner's statistics beyond that.
--
-- The open states (waiting, pending, running, failed) are never in the
-- history (events_done's CHECK, 0025): their reads name the live partition,
-- so the planner does not open each day of the history to rule it out (7 ms
-- of planning for status_open_counts over 32 days).

-- name: status_open_counts
-- Exact counts of the open events: pending ones per topic and tenant (for the
-- unhandled-topics check), split into due now ('pending') and not yet due
-- ('scheduled', run_at in the future: not a state of its own); running,
-- waiting and failed ones per topic (_status_open_counts_but_failed holds all
-- but the failed). Each branch reads one partial index, so the cost follows
-- those states, never the succeeded rows; the failed branch reads every entry
-- of events_failed_idx (topic), an index-only scan.
-- include: _status_open_counts_but_failed
UNION ALL
SELECT topic, NULL, 'failed', count(*), NULL
FROM {schema}.events_live
WHERE state = 'failed'
GROUP BY topic

-- name: status_open_counts_but_failed
-- status_open_counts without its failed branch, for a status that bounds the
-- failed counts instead (status_failed_total_bounded, status_failed_bounded).
-- include: _status_open_counts_but_failed

-- name: _status_open_counts_but_failed
-- The pending, running and waiting branches of status_open_counts: the
-- pending ones through events_claim_idx, which holds run_at, topic and tenant
-- (0009), an index-only scan; the running ones through events_lease_idx and
-- the rows it points to (at most the workers' slots). `oldest_due_s`: on a
-- due row, seconds its oldest event has waited since it came due (a relay's
-- or a topic's lag), from the same read. Waiting events (0022) last.
SELECT topic, tenant,
       CASE WHEN run_at <= now() THEN 'pending' ELSE 'scheduled' END AS state,
       count(*) AS n,
       CASE WHEN min(run_at) <= now()
            THEN extract(epoch FROM now() - min(run_at))::float8 END AS oldest_due_s
FROM {schema}.events_live
WHERE state = 'pending'
GROUP BY topic, tenant, 3
UNION ALL
SELECT topic, NULL, 'running', count(*), NULL
FROM {schema}.events_live
WHERE state = 'running'
GROUP BY topic
UNION ALL
-- Waiting events (0022) through their open edges: no index of the events
-- table holds them, so an application without dependencies pays for none.
-- Each edge's event is looked up by id in a subquery, which the planner never
-- turns into a join: as a semi-join, with the edges' statistics unknown, it
-- scanned the whole live partition (35,000 failed events) to find none.
-- OFFSET 0 keeps `w` apart, so the lookup runs once an edge, not once more
-- for the WHERE.
SELECT w.topic, NULL, 'waiting', count(*), NULL
FROM (SELECT (SELECT e.topic FROM {schema}.events_live AS e
              WHERE e.id = o.event_id AND e.state = 'waiting') AS topic
      FROM (SELECT DISTINCT d.event_id FROM {schema}.event_dependencies AS d
            WHERE NOT d.satisfied) AS o
      OFFSET 0) AS w
WHERE w.topic IS NOT NULL
GROUP BY w.topic

-- name: status_failed_total_bounded
-- How many events are failed, counted up to `limit` + 1: at most that many
-- entries of events_failed_idx, however many failed events a queue keeps
-- (measured: docs/dashboard.md). `n` above `limit` means "more than `limit`".
SELECT count(*) AS n
FROM (SELECT FROM {schema}.events_live WHERE state = 'failed' LIMIT %(limit)s + 1) AS failed

-- name: status_failed_bounded
-- The failed events of each topic, counted up to `cap` + 1, in the rows of
-- status_open_counts (`n` above `cap` means "more than `cap`"). The topics
-- come from a skip scan of events_failed_idx (topic): one probe for the next
-- topic after the last one, so each topic costs a probe and at most `cap` + 1
-- entries, never the bulk of a topic with many failed events.
WITH RECURSIVE topics AS (
    (SELECT topic FROM {schema}.events_live WHERE state = 'failed' ORDER BY topic LIMIT 1)
    UNION ALL
    SELECT (SELECT e.topic FROM {schema}.events_live AS e
            WHERE e.state = 'failed' AND e.topic > t.topic
            ORDER BY e.topic LIMIT 1)
    FROM topics AS t
    WHERE t.topic IS NOT NULL
)
SELECT t.topic, NULL::text AS tenant, 'failed' AS state,
       (SELECT count(*)
        FROM (SELECT FROM {schema}.events_live AS e
              WHERE e.state = 'failed' AND e.topic = t.topic
              LIMIT %(cap)s + 1) AS capped) AS n,
       NULL::float8 AS oldest_due_s
FROM topics AS t
WHERE t.topic IS NOT NULL

-- name: status_finished_sample
-- At most `limit` succeeded and cancelled rows, oldest first, counted by state
-- and topic (failed rows are counted exactly by status_open_counts). The
-- literal states match events_prunable_idx's predicate (0003), and the ORDER
-- BY makes the planner walk that index and stop after `limit` entries instead
-- of scanning the table. When fewer than `limit` rows come back they are all
-- the succeeded and cancelled rows and the counts are exact; otherwise they
-- are lower bounds and Admin falls back to status_table_estimate.
-- The history's days (0025) hold only such rows, in no index by finish time:
-- any `limit` of them, read without ordering, tell the same (a scan that
-- stops at the limit instead of sorting a day).
SELECT state, topic, count(*) AS n
FROM ((SELECT state, topic
       FROM {schema}.events_live
       WHERE state IN ('succeeded', 'cancelled')
       ORDER BY finished_at
       LIMIT %(limit)s)
      UNION ALL
      (SELECT state, topic FROM {schema}.events_done LIMIT %(limit)s)) AS sample
GROUP BY state, topic

-- name: _rows_estimated(c)
-- The rows of the table `c` (a pg_class row) as the planner would scale them.
CASE WHEN {c}.reltuples >= 0 AND {c}.relpages > 0
     THEN {c}.reltuples / {c}.relpages
          * (pg_relation_size({c}.oid) / current_setting('block_size')::float8)
     ELSE pg_stat_get_live_tuples({c}.oid)
END::float8

-- name: status_table_estimate
-- The planner's own row estimate for the events table and how its rows split by
-- state, read from the catalog without touching the table: the live-row
-- density of the last ANALYZE/VACUUM (reltuples / relpages) times the table's
-- current size in pages, as the planner scales it; before any ANALYZE
-- (reltuples < 0) the cumulative statistics' n_live_tup. The state shares are
-- the most-common-values list of pg_stats (NULL before any ANALYZE). `table`
-- is the live partition (0025). The history's days, all of their rows
-- succeeded or cancelled, are estimated the same way each: their rows, and
-- how many of those are cancelled by each day's own share in pg_stats.
SELECT (-- include: _rows_estimated(c)
       ) AS live_rows,
       s.most_common_vals::text::text[] AS states,
       s.most_common_freqs AS shares,
       h.rows AS history_rows,
       h.cancelled AS history_cancelled
FROM pg_class AS c
CROSS JOIN (
    SELECT coalesce(sum(d.rows), 0)::float8 AS rows,
           coalesce(sum(d.rows * d.cancelled_share), 0)::float8 AS cancelled
    FROM (SELECT -- include: _rows_estimated(p)
                 AS rows,
                 coalesce((SELECT f.share
                           FROM pg_stats AS ps,
                                unnest(ps.most_common_vals::text::text[], ps.most_common_freqs)
                                    AS f(state, share)
                           WHERE ps.schemaname = %(schema)s AND ps.tablename = p.relname
                             AND ps.attname = 'state' AND NOT ps.inherited
                             AND f.state = 'cancelled'), 0) AS cancelled_share
          FROM pg_inherits AS i
          JOIN pg_class AS p ON p.oid = i.inhrelid
          WHERE i.inhparent = to_regclass(%(history)s)) AS d
) AS h
LEFT JOIN pg_stats AS s
       ON s.schemaname = %(schema)s AND s.tablename = 'events_live' AND s.attname = 'state'
      AND NOT s.inherited
WHERE c.oid = %(table)s::regclass

-- name: status_oldest_due_age
-- Seconds since the oldest due pending event became due. events_claim_idx is
-- ordered by lane and priority first, so min(run_at) over it would read every
-- due entry (35-44 ms at 200,000 pending); this walks the priorities in use in
-- each lane, the aside lane too (0018), instead (a recursive skip scan: one
-- index probe per distinct priority) and takes the first due entry of each,
-- which is that priority's oldest in that lane: 0.3 ms.
WITH RECURSIVE priorities AS (
    SELECT lane.limited,
           (SELECT e.priority FROM {schema}.events_live AS e
            WHERE e.state = 'pending' AND e.limited = lane.limited
            ORDER BY e.limited, e.priority DESC, e.run_at, e.id LIMIT 1) AS priority
    FROM (VALUES (false), (true)) AS lane(limited)
    UNION ALL
    SELECT p.limited,
           (SELECT e.priority FROM {schema}.events_live AS e
            WHERE e.state = 'pending' AND e.limited = p.limited AND e.priority < p.priority
            ORDER BY e.limited, e.priority DESC, e.run_at, e.id LIMIT 1)
    FROM priorities AS p
    WHERE p.priority IS NOT NULL
), aside AS (
    -- The aside lane (0018, `limited` NULL, which `=` cannot match): the same walk.
    SELECT (SELECT e.priority FROM {schema}.events_live AS e
            WHERE e.state = 'pending' AND e.limited IS NULL
            ORDER BY e.limited, e.priority DESC, e.run_at, e.id LIMIT 1) AS priority
    UNION ALL
    SELECT (SELECT e.priority FROM {schema}.events_live AS e
            WHERE e.state = 'pending' AND e.limited IS NULL AND e.priority < a.priority
            ORDER BY e.limited, e.priority DESC, e.run_at, e.id LIMIT 1)
    FROM aside AS a
    WHERE a.priority IS NOT NULL
)
SELECT extract(epoch FROM now() - min(oldest.run_at))::float8
FROM (
    SELECT o.run_at
    FROM priorities AS p
    CROSS JOIN LATERAL (
        SELECT e.run_at FROM {schema}.events_live AS e
        WHERE e.state = 'pending' AND e.limited = p.limited AND e.priority = p.priority
          AND e.run_at <= now()
        ORDER BY e.limited, e.priority DESC, e.run_at, e.id
        LIMIT 1
    ) AS o
    WHERE p.priority IS NOT NULL
    UNION ALL
    SELECT o.run_at
    FROM aside AS a
    CROSS JOIN LATERAL (
        SELECT e.run_at FROM {schema}.events_live AS e
        WHERE e.state = 'pending' AND e.limited IS NULL AND e.priority = a.priority
          AND e.run_at <= now()
        ORDER BY e.limited, e.priority DESC, e.run_at, e.id
        LIMIT 1
    ) AS o
    WHERE a.priority IS NOT NULL
) AS oldest
