-- The relay (conveyor/relay, docs/relay.md).

-- name: relay_replay
-- Relayed events of the relay's topics that finished from `after_at`, in
-- (finished_at, id) order after (`after_at`, `after_id`), up to `until`:
-- what `conveyor relay --replay --since` publishes again. Read through
-- events_prunable_idx (finished_at), which holds the succeeded rows.
SELECT id, tenant, topic, payload::text, attempts, traceparent, tracestate, finished_at
FROM {schema}.events
WHERE state = 'succeeded'
  AND finished_at >= %(after_at)s
  AND (finished_at, id) > (%(after_at)s, %(after_id)s)
  AND (%(until)s::timestamptz IS NULL OR finished_at < %(until)s)
  AND (%(all_topics)s OR topic = ANY(%(topics)s::text[]) OR topic LIKE ANY(%(prefixes)s::text[]))
ORDER BY finished_at, id
LIMIT %(limit)s
