-- Conveyor 0010: a handler's return value, kept with its event.
-- `{schema}` is replaced by the quoted schema identifier; this file holds no
-- other braces on purpose.
--
-- Routes added with `store_result=True` write the JSON their handler returns
-- into `result` as they acknowledge the success (docs/results.md). The row's
-- retention prunes it with the event. Adding a nullable column without a
-- default rewrites nothing: instant at any table size.
--
-- The size rule is a domain, not a table CHECK, so it costs nothing on the
-- writes that leave `result` NULL (every enqueue, every claim); the worker
-- refuses a larger value before it is sent, with the route's own limit.
CREATE DOMAIN {schema}.event_result AS jsonb
    CONSTRAINT event_result_check CHECK (octet_length(VALUE::text) <= 1048576);
ALTER TABLE {schema}.events ADD COLUMN result {schema}.event_result;
