-- Claim windows (migration 0024; conveyor/worker/window.py, docs/held-claims.md).
-- A window claims a batch by locking its rows in a transaction, not writing
-- them; the outcomes its handlers reach while it is open are written in that
-- transaction, and the events still running when it closes are leased there
-- as event_claim leases. A fast event is written once instead of twice. The
-- fragments included here (`_claim_*`, `_succeeded`, `_settled`) are
-- events.sql's.

-- name: event_claim_held
-- event_claim's candidates, locked in the window's transaction and not
-- written: the attempt each starts (attempts + 1) is written with its outcome
-- or by event_lease_held. FOR NO KEY UPDATE: the key never changes, and the
-- weaker lock lets a foreign key's check (event_dependencies) pass.
SELECT -- include: _claim_columns(attempts + 1 AS attempts)
    -- include: _claim_candidates
    -- include: _claim_order(NO KEY UPDATE)

-- name: event_claim_held_unpaused
-- event_claim_held while a pause may be in force (event_claim_unpaused's test).
SELECT -- include: _claim_columns(attempts + 1 AS attempts)
    -- include: _claim_candidates
    -- include: _claim_unpaused
    -- include: _claim_order(NO KEY UPDATE)

-- name: _held
-- The fence of an outcome `d` of a held attempt: the window's transaction
-- holds the row's lock, so nothing else can have changed it since the claim;
-- the state and the attempt are checked all the same. A window's statements
-- go out with their values in the text, so each is planned anew: on
-- statistics from before a burst, a plain state test had the batch joined to
-- a scan of every pending row (events_claim_idx), for every window, a third
-- of the leased drain at 100,000 pending (tests/worker/test_claim_plan.py).
-- So the rows are found by id as an array (_found_by_id) and the state is
-- one IS TRUE test, which no partial index matches (_still_open's reason).
  AND -- include: _found_by_id(unnest(%(ids)s::bigint[]) AS held(id))
  AND (e.state = 'pending') IS TRUE
  AND e.attempts = d.attempt - 1
  AND e.done IS NULL

-- name: event_succeed_held
-- event_succeed_many for a held attempt: the attempt is counted here.
UPDATE {schema}.events AS e
SET attempts = d.attempt,
    attempted_at = now(),
    -- include: _succeeded(statement_timestamp)
FROM unnest(%(ids)s::bigint[], %(attempts)s::int[]) AS d(id, attempt)
WHERE e.id = d.id
  -- include: _held
RETURNING e.id

-- name: event_delete_succeeded_held
-- event_delete_succeeded_many for a held attempt (retention 0): the row was
-- never written by the claim, and goes at once.
DELETE FROM {schema}.events AS e
USING unnest(%(ids)s::bigint[], %(attempts)s::int[]) AS d(id, attempt)
WHERE e.id = d.id
  -- include: _held
RETURNING e.id

-- name: event_settle_held
-- event_settle_many for held attempts; the attempt started (now(), the
-- window's start) unless it is given back.
UPDATE {schema}.events AS e
SET attempted_at = CASE WHEN d.refund = 0 THEN now() ELSE e.attempted_at END,
    -- include: _settled(statement_timestamp)
-- include: _settle_rows
WHERE e.id = d.id
  -- include: _held
RETURNING e.id

-- name: event_lease_held
-- The window's events still running when it closes: leased as event_claim
-- leases them, the attempt counted now; from here on they are leased events
-- (heartbeats, the rescuer, fenced acknowledgements). The lease runs from
-- now(), the window's start: the worker adds the window's length to
-- `lease_ttl`.
WITH next AS (
    SELECT unnest(%(ids)s::bigint[]) AS id
)
-- include: _claim_update

-- name: claim_window_open
-- Records a window's batch before its handlers start (on a connection of its
-- own, committed at once) and returns, for each of its events that a window
-- which never committed held before, how many such windows did: attempts
-- that ran and were never counted. A window that commits deletes its row in
-- its own transaction (claim_window_close), so a row holding an event this
-- window could lock is one whose window rolled back. A hash join of the ids,
-- not `= ANY` per element: every open window's ids are read.
WITH opened AS (
    INSERT INTO {schema}.claim_windows (worker, window_no, ids)
    VALUES (%(worker)s, %(window_no)s, %(ids)s::bigint[])
)
SELECT w.id, count(*)::int AS crashes
FROM (SELECT unnest(ids) AS id FROM {schema}.claim_windows) AS w
JOIN unnest(%(ids)s::bigint[]) AS mine(id) ON mine.id = w.id
GROUP BY w.id

-- name: claim_window_close
-- In the window's transaction: its record goes with its commit.
DELETE FROM {schema}.claim_windows
WHERE worker = %(worker)s AND window_no = %(window_no)s

-- name: event_claim_crashed
-- A window that met events of windows that never committed (claim_window_open)
-- leases its whole batch at once, in its transaction, before any handler
-- starts, as event_claim would, each event's lost attempts counted with the
-- one it starts: a poison event that kills its worker inside a window runs
-- its later attempts leased, counted before they run. An event whose lost
-- attempts spent its last is parked failed instead, unrun. The records of
-- the windows that lost them forget them.
WITH d AS (
    -- Each event's attempts that ran (`ran`), and whether one is left (`runs`).
    SELECT d.event_id, d.crashes, e.attempts + d.crashes AS ran,
           e.attempts + d.crashes < e.max_attempts AS runs
    FROM unnest(%(ids)s::bigint[], %(crashes)s::int[]) AS d(event_id, crashes)
    JOIN {schema}.events AS e ON e.id = d.event_id
), forgotten AS (
    UPDATE {schema}.claim_windows AS w
    SET ids = ARRAY(SELECT unnest(w.ids) EXCEPT SELECT event_id FROM d)
    WHERE w.ids && %(ids)s::bigint[]
      AND (w.worker, w.window_no) <> (%(owner)s::uuid, %(window_no)s)
)
UPDATE {schema}.events AS e
SET state = CASE WHEN d.runs THEN 'running' ELSE 'failed' END,
    attempts = d.ran + d.runs::int,
    lease_owner = CASE WHEN d.runs THEN %(owner)s END,
    lease_expires_at = CASE WHEN d.runs
                            THEN statement_timestamp() + %(lease_ttl)s * interval '1 second' END,
    attempted_at = now(),
    last_error = CASE WHEN d.crashes = 0 THEN e.last_error
                      ELSE 'attempt ' || d.ran || ' was lost: its claim window never'
                           || ' committed (its worker died or lost the database)' END,
    errors = CASE WHEN d.crashes = 0 THEN e.errors
                  ELSE -- include: _errors_appended(d.ran, 'this attempt was lost: its claim window never committed (its worker died or lost the database)', NULL, NULL::text, statement_timestamp)
             END,
    finished_at = CASE WHEN NOT d.runs THEN statement_timestamp() END,
    updated_at = statement_timestamp()
FROM d
WHERE e.id = d.event_id
  -- The batch found by id as an array, its state one IS TRUE test (_held
  -- says why: on statistics from before a burst, a plain state test read
  -- every pending row for these 100).
  AND -- include: _found_by_id(unnest(%(ids)s::bigint[]) AS batch(id))
  AND (e.state = 'pending') IS TRUE
RETURNING -- include: _claim_columns(e.attempts)
          , e.state

-- name: claim_window_prune
-- Records no claim will meet again: emptied by event_claim_crashed, or older
-- than any window (their events were finished, cancelled or claimed leased
-- meanwhile).
DELETE FROM {schema}.claim_windows
WHERE cardinality(ids) = 0 OR opened_at < now() - %(older_than)s * interval '1 second'
