-- Conveyor 0024: the record of open claim windows (docs/held-claims.md).
-- `{schema}` is replaced by the quoted schema identifier; this file holds no
-- other braces on purpose.
--
-- A worker with a claim window (WorkerConfig.fast_window) claims a batch by
-- locking its rows in a transaction and writes their outcomes in that same
-- transaction: nothing of the attempt is written until the window commits.
-- Before its handlers start, the worker commits a row here naming the batch;
-- the window's commit deletes it. A row that outlives its window is a window
-- that never committed (its worker died, or lost its connection, while the
-- handlers ran): the next claim of one of its events counts that attempt
-- (windows.sql, event_claim_crashed), so a poison event that kills its worker
-- still runs out of attempts. Unlogged: a row is written and deleted per batch
-- without WAL; a server crash empties the table, and rolls every open window
-- back with it (those attempts are not the events' fault).
CREATE UNLOGGED TABLE {schema}.claim_windows (
    worker    uuid        NOT NULL,
    window_no bigint      NOT NULL,    -- the worker's own count of its windows
    ids       bigint[]    NOT NULL,
    opened_at timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT claim_windows_pkey PRIMARY KEY (worker, window_no)
);
