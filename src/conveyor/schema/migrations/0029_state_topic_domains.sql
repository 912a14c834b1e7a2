-- Conveyor 0029: the rules on `state` and `topic` are kept by domains, which
-- the table's CHECKs cast to. `{schema}` is replaced by the quoted schema
-- identifier; this file holds no other braces on purpose.
--
-- PostgreSQL rebuilds a table's CHECK expressions from their stored text at
-- the start of every statement that writes the table, and plans them again:
-- for a one-event transaction that was 14 us of the backend's CPU, of which
-- the list of states was half (2026-12-06, a server-side loop of one INSERT
-- and its COMMIT, 36 against 21 us without the CHECKs;
-- benchmarks/insert_costs.py prices it through a client). A domain's rule is
-- read and planned once per session and kept, so 0007 made domains of the
-- columns no index reads. `state` and `topic` could not change type that way:
-- their partial indexes would be rebuilt under this migration's lock. Their
-- CHECKs now cast the column to a domain instead: the expression rebuilt per
-- statement is a cast, and the rule runs from the session's cache. The rules
-- are the same, and so are the constraints' names: a bad value is refused
-- with `violates check constraint "events_state_check"` as before.
--
-- Nothing is read or rewritten: the new CHECKs are added NOT VALID (every
-- row already satisfies the rules the dropped ones held) and PostgreSQL
-- enforces them on every value written from now on. The lease rule spans
-- three columns and stays as it was.

CREATE DOMAIN {schema}.event_state AS text
    CONSTRAINT events_state_check
    CHECK (VALUE IN ('waiting', 'pending', 'running', 'succeeded', 'failed', 'cancelled'));
CREATE DOMAIN {schema}.event_topic AS text
    CONSTRAINT events_topic_check CHECK (length(VALUE) BETWEEN 1 AND 100);

ALTER TABLE {schema}.events
    DROP CONSTRAINT events_state_check,
    DROP CONSTRAINT events_topic_check,
    ADD CONSTRAINT events_state_check
        CHECK (state::{schema}.event_state IS NOT NULL) NOT VALID,
    ADD CONSTRAINT events_topic_check
        CHECK (topic::{schema}.event_topic IS NOT NULL) NOT VALID;
