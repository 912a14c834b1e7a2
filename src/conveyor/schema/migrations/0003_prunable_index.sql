-- Conveyor 0003: the retention index holds only the rows pruning deletes.
-- `{schema}` is replaced by the quoted schema identifier; this file holds no
-- other braces on purpose.
--
-- events_finished_idx (0001) held every finished row, failed ones included.
-- The worker's prune deletes only succeeded and cancelled rows, and nothing
-- prunes failed rows by default, so every prune pass walked all the old failed
-- rows through that index and threw them away again: about 36 ms per 100,000
-- kept failed rows, per worker, every 10 minutes. events_prunable_idx holds
-- succeeded and cancelled rows only, so a pass reads what it deletes and no
-- more. Failed rows keep their own index (events_failed_idx, 0002); status
-- reads its sample of finished rows through this one (status_finished_sample),
-- and an operator's prune of failed rows reads events_failed_idx
-- (event_prune). Both queries name the states literally, so the planner can
-- prove the predicate even for a generic plan.
--
-- Not CONCURRENTLY: migrations run in one transaction (the migrator's, or the
-- host tool's for `conveyor migrate --sql`), where CREATE INDEX CONCURRENTLY
-- is refused; 0002 does the same. The new index is built first, under a SHARE
-- lock: reads go on, writes to the table (enqueue, claim, acknowledgement)
-- wait for the build, which reads the whole table: about 1 s per 10 M rows
-- (docs/reliability.md), more on a cold cache. The old index is dropped last:
-- DROP INDEX takes an ACCESS EXCLUSIVE lock that is held until the commit, so
-- dropping first would also block every read for the whole build; last, it is
-- held for a moment. That lock waits for any open transaction that has read
-- the table, and queries queue behind it meanwhile: migrate when no long
-- transaction is open on it. On a table too big to wait, build the index by
-- hand first with CREATE INDEX CONCURRENTLY under the same name and
-- definition, and drop events_finished_idx CONCURRENTLY: this migration then
-- skips the build (IF NOT EXISTS) and the drop (IF EXISTS).
CREATE INDEX IF NOT EXISTS events_prunable_idx
    ON {schema}.events (finished_at)
    WHERE state IN ('succeeded', 'cancelled');

DROP INDEX IF EXISTS {schema}.events_finished_idx;
