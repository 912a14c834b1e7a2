-- Conveyor 0002: an index over failed events only.
-- `{schema}` is replaced by the quoted schema identifier; this file holds no
-- other braces on purpose.
--
-- Failed events are the ones an operator acts on, and nothing prunes them by
-- default, so they are worth counting exactly; without this index every count
-- of them (`conveyor status`) and every `retry-failed` read the whole table,
-- finished rows included. Only failed rows are in it, so it stays as small as
-- the dead-letter set. Built without CONCURRENTLY (migrations run in one
-- transaction), so writes to the table wait while it builds: 0.5 s on a table
-- of 10 M rows in the R14 run (docs/reliability.md), more on a cold cache.
CREATE INDEX events_failed_idx
    ON {schema}.events (topic)
    WHERE state = 'failed';
