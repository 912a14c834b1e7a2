-- Conveyor 0016: the ordered relay's read (conveyor/relay/ordered.py,
-- docs/relay.md). `{schema}` is replaced by the quoted schema identifier;
-- this file holds no other braces on purpose.
--
-- Every event remembers the transaction that wrote it. A reader that follows
-- event ids skips an event whose transaction commits after a later id's (two
-- producers: id 10 in a transaction still open while id 11 commits; a reader
-- that has passed 11 never goes back). The ordered relay reads only events
-- whose transaction is older than the oldest one still running (the snapshot's
-- xmin), in (xid, id) order: every event it has not read yet comes after every
-- event it has.
--
-- Added without a default first, then given one: existing rows keep NULL (no
-- table rewrite; the ordered relay reads them first, by id) and every row
-- written from now on gets its transaction's id.
ALTER TABLE {schema}.events ADD COLUMN xid xid8;
ALTER TABLE {schema}.events ALTER COLUMN xid SET DEFAULT pg_current_xact_id();

-- Pending events by topic in (xid, id) order: the ordered relay walks the
-- topics with pending events (one probe each) and reads each matching one's
-- oldest; NULL (events older than 0016) first.
CREATE INDEX events_relay_order_idx
    ON {schema}.events (topic, xid NULLS FIRST, id)
    WHERE state = 'pending';
