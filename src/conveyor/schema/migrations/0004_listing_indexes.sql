-- Conveyor 0004: indexes for the operator's event listing (Admin.events,
-- `conveyor events`) by topic and by tenant, for the events an operator
-- hunts by topic: the failed and the cancelled ones.
-- `{schema}` is replaced by the quoted schema identifier; this file holds no
-- other braces on purpose.
--
-- A listing is newest first (ORDER BY id DESC, keyset on id). For a topic or a
-- tenant with a good share of the rows, walking the primary key backwards
-- finds a page within a few thousand rows; for a rare one among the failed
-- or cancelled events, these indexes make it a range scan of its own rows.
--
-- Partial on purpose. An event's state changes are not HOT updates (the
-- partial indexes name the state), so an index over every row takes an entry
-- at enqueue, claim and acknowledgement, like the primary key: one on topic
-- cut the drain and the bulk enqueue by 10-25 % against the raw-SQL baseline
-- (docs/benchmarks.md). Failed and cancelled rows are few and written once
-- into these states, so the hot path pays nothing for them. A rare topic among
-- pending, running or succeeded events is read newest first through the
-- primary key (docs/admin.md says what that costs and how to bound it).
--
-- `topic COLLATE "C"`: a prefix ("email.*") is then the range
-- ['email.', 'email/') in byte order whatever the database's collation (a
-- linguistic collation may sort punctuation elsewhere).
--
-- Not CONCURRENTLY: migrations run in one transaction (see 0003), so writes to
-- the table wait while the indexes build (failed and cancelled rows only:
-- quick). Where even that pause is too long, create both by hand first with
-- CREATE INDEX CONCURRENTLY, same names and definitions, and check they are
-- valid: this migration then skips them (IF NOT EXISTS).
CREATE INDEX IF NOT EXISTS events_stopped_topic_idx
    ON {schema}.events (topic COLLATE "C", id)
    WHERE state IN ('failed', 'cancelled');

CREATE INDEX IF NOT EXISTS events_stopped_tenant_idx
    ON {schema}.events (tenant, id)
    WHERE tenant IS NOT NULL AND state IN ('failed', 'cancelled');
