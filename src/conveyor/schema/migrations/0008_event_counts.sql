-- Conveyor 0008: outcome counts per minute and topic, for the dashboard's charts.
-- `{schema}` is replaced by the quoted schema identifier; this file holds no
-- other braces on purpose.
--
-- Each worker tallies the outcomes it has written (succeeded, retried,
-- parked failed, cancelled by its handler) by minute and topic, and adds its
-- tally to these rows with every heartbeat: one statement per heartbeat, not
-- one per event, and the counts survive retention 0 and pruning, which remove
-- the events themselves. Counting the events table instead would read every
-- finished row of the hour. A worker that dies loses at most its last
-- heartbeat interval of counts; the events are not affected.
--
-- fillfactor 70: the same rows are updated many times a minute, and room on
-- the page keeps those updates HOT (no new index entry). Rows older than
-- eight days are deleted by the workers' pruning pass.
CREATE TABLE IF NOT EXISTS {schema}.event_counts (
    minute    timestamptz NOT NULL,
    topic     text        NOT NULL,
    succeeded bigint      NOT NULL DEFAULT 0,
    retried   bigint      NOT NULL DEFAULT 0,
    failed    bigint      NOT NULL DEFAULT 0,
    cancelled bigint      NOT NULL DEFAULT 0,
    CONSTRAINT event_counts_pkey PRIMARY KEY (minute, topic)
) WITH (fillfactor = 70);
