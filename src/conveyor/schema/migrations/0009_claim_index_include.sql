-- Conveyor 0009: the claim index carries each pending event's topic and tenant.
-- `{schema}` is replaced by the quoted schema identifier; this file holds no
-- other braces on purpose.
--
-- `conveyor status`, the metrics' database gauges and the dashboard's overview
-- count pending events by topic and tenant (status_open_counts). With the
-- index holding neither, every pending row was read from the table: at 5
-- million events with 200,000 pending, a parallel scan of the whole table,
-- 451 ms (benchmarks/results/20261201-dashboard-scale.json). As INCLUDE
-- columns they are read from the index itself, 55 ms: no new index, no new
-- index write per event, only wider entries in the index every enqueue and
-- claim already writes. The key (the claim's order) is unchanged, and so is
-- the name the claim's plan tests look for.
--
-- Rebuilding reads the whole table under a lock that holds writes back:
-- 0.8 s at 5 million rows on a 2-core machine (2026-12-01).
DROP INDEX {schema}.events_claim_idx;
CREATE INDEX events_claim_idx
    ON {schema}.events (priority DESC, run_at, id) INCLUDE (topic, tenant)
    WHERE state = 'pending';
