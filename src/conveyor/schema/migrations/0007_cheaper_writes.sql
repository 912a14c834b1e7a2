-- Conveyor 0007: cheaper writes of single events, with every rule kept.
-- `{schema}` is replaced by the quoted schema identifier; this file holds no
-- other braces on purpose (hence the regular expression without counts).
--
-- 1. The wake-up NOTIFY moves from the statement-level insert trigger into
--    the producer's own statements (conveyor/db/queries/events.sql). The
--    trigger, its transition table and its GROUP BY query cost a single-row
--    INSERT about a fifth of its database time; a pg_notify() call in the
--    INSERT's own statement costs nearly nothing. Rows written with plain SQL
--    are still found by the workers' poll (5 s by default), or at once when
--    the writer sends the NOTIFY itself (docs/producing.md, "Wake-ups").
--
-- 2. The CHECKs on columns that no index reads become domains. PostgreSQL
--    rebuilds a table's CHECK expressions from their stored text at the start
--    of every statement that writes the table, which for a one-row INSERT
--    cost about as much as the insert itself; a domain's rule is read once
--    per session and kept. The rules are the same: attempts >= 0,
--    max_attempts >= 1, and the traceparent and tracestate of 0006.
--    state and topic keep their table CHECKs (as does the lease rule, which
--    spans columns): partial indexes read those two columns, and PostgreSQL
--    rebuilds such indexes when a column they read changes type, which would
--    hold this migration's lock (and every enqueue) for seconds per million
--    rows. docs/benchmarks.md says what the three remaining CHECKs cost.
--
-- Nothing is read or rewritten, so the migration takes a moment whatever the
-- table's size: a column changes to a domain of its own base type while the
-- domain has no rule yet (a catalog change), and the rules are added
-- afterwards NOT VALID, so the table is not scanned for them. Every existing
-- row already satisfies them: the CHECKs dropped here held the same rules.
-- PostgreSQL enforces a NOT VALID rule on every value written from now on.

DROP TRIGGER events_notify_insert ON {schema}.events;
DROP FUNCTION {schema}.events_notify();

CREATE DOMAIN {schema}.attempt_count AS integer;
CREATE DOMAIN {schema}.attempt_limit AS integer;
CREATE DOMAIN {schema}.traceparent AS text;
CREATE DOMAIN {schema}.tracestate AS text;

ALTER TABLE {schema}.events
    DROP CONSTRAINT events_attempts_check,
    DROP CONSTRAINT events_traceparent_check,
    DROP CONSTRAINT events_tracestate_check,
    ALTER COLUMN attempts TYPE {schema}.attempt_count,
    ALTER COLUMN max_attempts TYPE {schema}.attempt_limit,
    ALTER COLUMN traceparent TYPE {schema}.traceparent,
    ALTER COLUMN tracestate TYPE {schema}.tracestate;

ALTER DOMAIN {schema}.attempt_count
    ADD CONSTRAINT attempt_count_check CHECK (VALUE >= 0) NOT VALID;
ALTER DOMAIN {schema}.attempt_limit
    ADD CONSTRAINT attempt_limit_check CHECK (VALUE >= 1) NOT VALID;
-- Version 00, exactly 55 characters, lowercase hex; the length and the second
-- dash at character 36 pin the field widths (as 0006's CHECK did).
ALTER DOMAIN {schema}.traceparent
    ADD CONSTRAINT traceparent_check
    CHECK (length(VALUE) = 55
           AND VALUE ~ '^00-[0-9a-f]+-[0-9a-f]+-[0-9a-f][0-9a-f]$'
           AND substr(VALUE, 36, 1) = '-') NOT VALID;
ALTER DOMAIN {schema}.tracestate
    ADD CONSTRAINT tracestate_check CHECK (length(VALUE) <= 512) NOT VALID;
