-- Conveyor 0004: indexes for the operator's event listing (Admin.events,
-- `conveyor events`) by topic and by tenant.
-- `{schema}` is replaced by the quoted schema identifier; this file holds no
-- other braces on purpose.
--
-- A listing is newest first (ORDER BY id DESC, keyset on id). For a topic or a
-- tenant with a good share of the rows, walking the primary key backwards
-- finds a page within a few thousand rows; for a rare one it read the whole
-- table (a sequential scan and a sort: 65-125 ms at 1 M rows, seconds at
-- 10 M). With these indexes a rare topic, prefix or tenant is a range scan
-- that reads its own rows only (under 0.1 ms at 1 M rows).
--
-- events_topic_idx is on `topic COLLATE "C"`: a prefix ("email.*") is then the
-- range ['email.', 'email/') in byte order whatever the database's collation
-- (a linguistic collation may sort punctuation elsewhere). It holds every row,
-- and an event's state changes are not HOT updates (the partial indexes name
-- the state), so it takes an entry at enqueue, claim and acknowledgement, like
-- the primary key. events_tenant_idx holds tenanted rows only: a queue without
-- tenants pays nothing for it.
--
-- Not CONCURRENTLY: migrations run in one transaction (see 0003), so writes to
-- the table wait while the indexes build (about 3 s for both at 1 M rows).
-- Where that pause is too long, create both by hand first with CREATE INDEX
-- CONCURRENTLY, same names and definitions, and check they are valid: this
-- migration then skips them (IF NOT EXISTS).
CREATE INDEX IF NOT EXISTS events_topic_idx
    ON {schema}.events (topic COLLATE "C", id);

CREATE INDEX IF NOT EXISTS events_tenant_idx
    ON {schema}.events (tenant, id)
    WHERE tenant IS NOT NULL;
