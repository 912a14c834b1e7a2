-- Conveyor 0006: the W3C trace context of the span that enqueued an event
-- (https://www.w3.org/TR/trace-context/), so the worker's span for it can be
-- linked to the producer's across the queue (docs/tracing.md).
-- `{schema}` is replaced by the quoted schema identifier; this file holds no
-- other braces on purpose (hence the regular expressions without counts).
--
-- NULL unless the event was enqueued inside a recording span with the otel
-- extra installed: a NULL costs a bit in the row's null bitmap, nothing else.
--
-- traceparent: version 00 only (the one OpenTelemetry writes), exactly 55
-- characters, `00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`,
-- lowercase as the specification requires; the length and the second dash at
-- character 36 pin the field widths. tracestate: at most 512 characters, the
-- length the specification lets a propagator cut a longer one to.
--
-- Adding nullable columns without a default changes only the catalog; the
-- two CHECKs read the table once under the migration's lock (every value is
-- NULL, so it is a scan, not a rewrite).
ALTER TABLE {schema}.events
    ADD COLUMN traceparent text,
    ADD COLUMN tracestate text,
    ADD CONSTRAINT events_traceparent_check
        CHECK (length(traceparent) = 55
               AND traceparent ~ '^00-[0-9a-f]+-[0-9a-f]+-[0-9a-f][0-9a-f]$'
               AND substr(traceparent, 36, 1) = '-'),
    ADD CONSTRAINT events_tracestate_check CHECK (length(tracestate) <= 512);
