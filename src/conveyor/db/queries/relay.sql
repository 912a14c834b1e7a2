-- The relay (conveyor/relay, docs/relay.md).
-- The fragments included here (`_topic_in`, `_paused`, ...) are events.sql's.

-- name: relay_replay
-- Relayed events of the relay's topics that finished from `after_at`, in
-- (finished_at, id) order after (`after_at`, `after_id`), before `before`:
-- a slice of what `conveyor relay --replay --since` publishes again. Read
-- through events_prunable_idx (finished_at) in the live partition and each
-- history partition's BRIN index (0027), so a short slice reads a few block
-- ranges, not the window to its end.
SELECT id, tenant, topic, payload::text, attempts, traceparent, tracestate, finished_at
FROM {schema}.events
WHERE state = 'succeeded'
  AND finished_at >= %(after_at)s
  AND (finished_at, id) > (%(after_at)s, %(after_id)s)
  AND finished_at < %(before)s
  AND -- include: _topic_in(topic)
ORDER BY finished_at, id
LIMIT %(limit)s

-- name: relay_ordered_lock
-- The ordered stream's lease: a session advisory lock on the reading
-- connection, so one relay at a time reads a stream and a relay whose
-- connection dies loses it at once. The key names the schema and the route.
SELECT pg_try_advisory_lock(hashtextextended(%(key)s, 0))

-- name: relay_order_topics
-- Before a stream first leads: its pattern's trigger, which gives each new
-- event of its topics its transaction's id (0019; NULL: it had one already).
SELECT {schema}.order_topics(%(pattern)s)

-- name: relay_ordered_next
-- The ordered stream's next events: pending events of the route's topics
-- whose transaction is older than the oldest still running (the statement
-- snapshot's xmin), in (xid, id) order. Any event written later has a larger
-- xid than every one returned here, so reading in batches never skips one
-- (0016). Only the topics of ordered routes have an xid (0019: their
-- triggers write it), so the topics with pending events that have one are
-- walked through events_relay_order_idx (one probe each), and each matching
-- one's oldest read from it. `later` and `paused` tell the relay to stop at
-- that event: the stream does not pass an event that is not due yet or that
-- a pause holds.
WITH RECURSIVE topics AS (
    (SELECT topic FROM {schema}.events
     WHERE state = 'pending' AND xid IS NOT NULL
     ORDER BY topic LIMIT 1)
    UNION ALL
    SELECT (SELECT e.topic FROM {schema}.events AS e
            WHERE e.state = 'pending' AND e.xid IS NOT NULL AND e.topic > t.topic
            ORDER BY e.topic LIMIT 1)
    FROM topics AS t
    WHERE t.topic IS NOT NULL
), horizon AS (
    SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin
)
SELECT n.id, n.tenant, n.topic, n.payload::text, n.attempts, n.traceparent, n.tracestate,
       n.run_at > now() AS later,
       -- include: _paused(n.topic, n.tenant)
           AS paused
FROM topics AS t, horizon AS h, LATERAL (
    SELECT e.id, e.tenant, e.topic, e.payload, e.attempts, e.traceparent, e.tracestate,
           e.run_at, e.xid
    FROM {schema}.events AS e
    WHERE e.state = 'pending'
      AND e.topic = t.topic
      AND e.xid < h.xmin
    ORDER BY e.xid, e.id
    LIMIT %(limit)s
) AS n
WHERE t.topic IS NOT NULL
  AND -- include: _topic_in(t.topic)
ORDER BY n.xid, n.id
LIMIT %(limit)s

-- name: relay_ordered_held
-- Whether pending events of the route wait behind the horizon (a transaction
-- older than theirs still running), and the age of the oldest: what the
-- stream reports while a long transaction stalls it.
SELECT count(*), extract(epoch FROM now() - min(e.created_at))::float8
FROM {schema}.events AS e
WHERE e.state = 'pending'
  AND e.xid >= pg_snapshot_xmin(pg_current_snapshot())
  AND -- include: _topic_in(e.topic)

-- name: relay_ordered_done
-- Events the broker confirmed, in the stream's order: relayed. Only pending
-- ones (an operator may have cancelled one meanwhile); the attempt is counted
-- here, as a claim counts it. They are added to this minute's outcome counts
-- (the dashboard's rates, as a worker's tally adds its own), topics in order
-- so two writers lock the rows in the same order. A relayed event goes into
-- the history, as a worker's success does (0025).
WITH done AS (
    UPDATE {schema}.events AS e
    SET state = 'succeeded',
        attempts = attempts + 1,
        attempted_at = now(),
        finished_at = now(),
        updated_at = now(),
        done = CASE WHEN -- include: _into_history
               THEN true END
    WHERE id = ANY(%(ids)s::bigint[])
      AND state = 'pending'
      AND e.done IS NULL
    RETURNING topic
)
INSERT INTO {schema}.event_counts AS c (minute, topic, succeeded)
SELECT date_trunc('minute', now()), topic, count(*)
FROM done
GROUP BY topic
ORDER BY topic
ON CONFLICT (minute, topic) DO UPDATE SET succeeded = c.succeeded + excluded.succeeded

-- name: relay_ordered_failed
-- A publish the broker refused: the attempt and its error are recorded and
-- the event stays pending at the head of its stream (an ordered stream never
-- parks an event and moves on; cancelling it lets the stream pass). Counted
-- as a retry in this minute's outcome counts.
WITH refused AS (
    UPDATE {schema}.events AS e
    SET attempts = e.attempts + 1,
        attempted_at = now(),
        last_error = %(error)s::text,
        errors = (-- include: _errors_appended(e.attempts + 1, %(error)s::text, NULL, %(relay)s::text)
        ),
        updated_at = now()
    WHERE e.id = %(id)s
      AND e.state = 'pending'
    RETURNING e.topic
)
INSERT INTO {schema}.event_counts AS c (minute, topic, retried)
SELECT date_trunc('minute', now()), topic, 1
FROM refused
ON CONFLICT (minute, topic) DO UPDATE SET retried = c.retried + excluded.retried
