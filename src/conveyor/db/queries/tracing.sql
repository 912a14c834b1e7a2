-- Named queries for events enqueued inside a recording span: event_insert and
-- event_insert_many_ids with the W3C trace context of the producer's send span
-- (0006, docs/tracing.md). Separate statements so that an enqueue outside a
-- span binds nothing more than before; tests/test_tracing_producer.py holds
-- each equal to its twin but for the two trace columns. `_wake` and
-- `_notify_on` are events.sql's.

-- name: event_insert_traced
INSERT INTO {schema}.events_live
    (tenant, topic, payload, priority, max_attempts, idempotency_key, run_at,
     traceparent, tracestate)
VALUES
    (%(tenant)s, %(topic)s::text, %(payload)s::jsonb, %(priority)s, %(max_attempts)s::int,
     %(idempotency_key)s,
     COALESCE(%(run_at)s::timestamptz, now() + %(delay)s * interval '1 second'),
     %(traceparent)s::text, %(tracestate)s::text)
ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
RETURNING id,
    CASE WHEN -- include: _notify_on(run_at)
    THEN -- include: _wake(topic, run_at)
    END

-- name: event_insert_many_ids_traced
-- One send span covers the batch, so every row carries the same context.
WITH new AS (
    INSERT INTO {schema}.events_live
        (id, tenant, topic, payload, priority, max_attempts, idempotency_key, run_at,
         traceparent, tracestate)
    SELECT t.id, t.tenant, t.topic, t.payload::jsonb, t.priority, t.max_attempts,
           t.idempotency_key, COALESCE(t.run_at, now() + t.delay * interval '1 second'),
           %(traceparent)s::text, %(tracestate)s::text
    FROM unnest(%(ids)s::bigint[], %(tenants)s::text[], %(topics)s::text[], %(payloads)s::text[],
                %(priorities)s::smallint[], %(max_attempts)s::int[], %(keys)s::text[],
                %(delays)s::float8[], %(run_ats)s::timestamptz[])
         AS t(id, tenant, topic, payload, priority, max_attempts, idempotency_key, delay, run_at)
    ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, topic, run_at
), woken AS (
    SELECT count(
        -- include: _wake(due.topic, due.run_at)
    )
    FROM (SELECT topic, min(run_at) AS run_at FROM new GROUP BY topic) AS due
    WHERE -- include: _notify_on(due.run_at)
)
SELECT new.id FROM new, woken
