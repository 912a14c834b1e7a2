-- Conveyor 0013: the limited patterns' pending events get a lane of their own
-- in the claim index. `{schema}` is replaced by the quoted schema identifier;
-- this file holds no other braces on purpose.
--
-- Since 0012 the plain claim leaves a limited pattern's events to the flow
-- claim, but it still stepped over them: events_claim_idx is ordered by
-- priority and due time, so an older backlog of a limited topic sat ahead of
-- every unlimited event, and each plain claim read it again (100,000 limited
-- events ahead cut an unlimited topic's drain to a quarter, 2026-12-02).
-- `limited` leads the index now: the plain claims read `NOT limited` and the
-- flow claims `limited`, each its own range in the same order as before. An
-- event is written with `limited = false`; a worker's flow loop moves the
-- limited patterns' events it finds at the front of the open lane into the
-- limited one (flow_sort), and every claim puts an event back in the open
-- lane, so an event that returns to pending (a retry, a rescued lease) is
-- sorted again under the limits of that moment. No new index, no new index
-- write per event.
--
-- Adding the column rewrites nothing (a constant default); rebuilding the
-- index reads the whole table under a lock that holds writes back, as 0009's
-- did (0.8 s at 5 million rows on a 2-core machine).
ALTER TABLE {schema}.events ADD COLUMN limited boolean NOT NULL DEFAULT false;
DROP INDEX {schema}.events_claim_idx;
CREATE INDEX events_claim_idx
    ON {schema}.events (limited, priority DESC, run_at, id) INCLUDE (topic, tenant)
    WHERE state = 'pending';
