-- Conveyor 0014: per-key order of a route (fifo_by). `{schema}` is replaced by
-- the quoted schema identifier; this file holds no other braces on purpose.
--
-- A route with fifo_by (docs/flow-control.md) runs the events of one key (the
-- tenant, or a field of the payload) one at a time, in claim order: its flow
-- claim takes only each key's first unfinished event, and only when it is
-- pending and due. A catalog change only.
ALTER TABLE {schema}.flow_limits ADD COLUMN fifo_by text;
