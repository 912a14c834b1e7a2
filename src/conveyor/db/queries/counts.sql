-- Named queries of the outcome counts (0008): written by the workers at each
-- heartbeat, read by the dashboard's charts. `{schema}` is replaced by the
-- quoted schema identifier; parameters are always bound.

-- name: event_counts_add
-- Adds one worker's tally. The rows come sorted by (minute, topic), so two
-- workers adding to the same rows lock them in the same order and never
-- deadlock. `minutes` are epoch seconds on the database's clock, whole minutes.
INSERT INTO {schema}.event_counts AS c (minute, topic, succeeded, retried, failed, cancelled)
SELECT to_timestamp(t.minute), t.topic, t.succeeded, t.retried, t.failed, t.cancelled
FROM unnest(%(minutes)s::float8[], %(topics)s::text[], %(succeeded)s::bigint[],
            %(retried)s::bigint[], %(failed)s::bigint[], %(cancelled)s::bigint[])
     AS t(minute, topic, succeeded, retried, failed, cancelled)
ON CONFLICT (minute, topic) DO UPDATE
SET succeeded = c.succeeded + excluded.succeeded,
    retried = c.retried + excluded.retried,
    failed = c.failed + excluded.failed,
    cancelled = c.cancelled + excluded.cancelled

-- name: event_counts_prune
-- Counts older than `keep` seconds go (the primary key leads with the minute).
DELETE FROM {schema}.event_counts
WHERE minute < now() - %(keep)s * interval '1 second'

-- name: event_counts_series
-- Outcomes of the last `span` seconds in buckets of `step` seconds, oldest
-- first, every topic together (or one topic, or one prefix's range). Reads
-- the primary key's range of the span: at most span/60 x topics rows.
SELECT extract(epoch FROM minute)::bigint / %(step)s * %(step)s AS bucket,
       sum(succeeded)::bigint AS succeeded, sum(retried)::bigint AS retried,
       sum(failed)::bigint AS failed, sum(cancelled)::bigint AS cancelled
FROM {schema}.event_counts
WHERE minute >= now() - %(span)s * interval '1 second'
GROUP BY 1
ORDER BY 1

-- name: event_counts_topic_series
-- event_counts_series for the topics of one pattern (an exact topic,
-- `prefix.*` or `*`): the dashboard's per-topic chart. The same range of the
-- primary key, its rows filtered by topic.
SELECT extract(epoch FROM minute)::bigint / %(step)s * %(step)s AS bucket,
       sum(succeeded)::bigint AS succeeded, sum(retried)::bigint AS retried,
       sum(failed)::bigint AS failed, sum(cancelled)::bigint AS cancelled
FROM {schema}.event_counts
WHERE minute >= now() - %(span)s * interval '1 second'
  AND -- include: _pattern_matches(%(pattern)s::text, topic)
GROUP BY 1
ORDER BY 1

-- name: event_counts_topics
-- Each topic's outcomes of the last `span` seconds, the busiest `limit`
-- topics: the overview lists the topics whose events are all finished (and
-- maybe pruned or deleted at success) from here, since the events table
-- alone no longer shows them.
SELECT topic, sum(succeeded)::bigint AS succeeded, sum(failed)::bigint AS failed
FROM {schema}.event_counts
WHERE minute >= now() - %(span)s * interval '1 second'
GROUP BY topic
ORDER BY sum(succeeded + retried + failed + cancelled) DESC, topic
LIMIT %(limit)s
