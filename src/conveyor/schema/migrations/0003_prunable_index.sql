-- Conveyor 0003: the retention index holds only the rows pruning deletes.
-- `{schema}` is replaced by the quoted schema identifier; this file holds no
-- other braces on purpose.
--
-- events_finished_idx (0001) held every finished row, failed ones included.
-- The worker's prune deletes only succeeded and cancelled rows, and nothing
-- prunes failed rows by default, so every prune pass walked all the old failed
-- rows through that index and threw them away again: with 100,000 of them a
-- pass took 13 ms finding nothing to delete (134 ms with 1 M), per worker,
-- every 10 minutes. events_prunable_idx holds succeeded and cancelled rows
-- only, so a pass reads what it deletes and no more (under 0.5 ms). Failed
-- rows keep their own index (events_failed_idx, 0002). The queries that read
-- the old index name the states literally, so the planner can prove this
-- one's predicate even in a generic plan: event_prune, whose failed branch (an
-- operator's prune of failed rows) reads events_failed_idx, and
-- status_finished_sample.
--
-- Not CONCURRENTLY: migrations run in one transaction (the migrator's, or the
-- host tool's for `conveyor migrate --sql`), where CREATE INDEX CONCURRENTLY
-- is refused; 0002 does the same. The new index is built first, under a SHARE
-- lock: reads go on, but writes to the table (enqueue, claim, acknowledgement)
-- wait for the whole build, which reads and sorts the table: 0.55 s at 1.1 M
-- rows, 4.6-5.1 s at 11 M (docs/reliability.md, R14), warm cache. The old
-- index is dropped last: DROP INDEX takes an ACCESS EXCLUSIVE lock that is held
-- until the commit, so dropping first would block every read for the whole
-- build too; last, it is held for a moment. It waits for transactions already
-- open on the table, and queries queue behind it meanwhile; should one of
-- those transactions then try to write, PostgreSQL cancels one of the two as a
-- deadlock (if the migration, it rolls back whole and can be run again).
-- Migrate when no long transaction is open on the table. Where that pause is
-- too long, create the index by hand first with CREATE INDEX CONCURRENTLY,
-- same name and definition, check it is valid (a failed concurrent build
-- leaves an invalid index behind: drop it and build again), and DROP INDEX
-- CONCURRENTLY events_finished_idx: this migration then skips both steps
-- (IF NOT EXISTS, IF EXISTS).
CREATE INDEX IF NOT EXISTS events_prunable_idx
    ON {schema}.events (finished_at)
    WHERE state IN ('succeeded', 'cancelled');

DROP INDEX IF EXISTS {schema}.events_finished_idx;
