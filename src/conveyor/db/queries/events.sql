-- Named queries on the events table. `{schema}` is replaced by the quoted
-- schema identifier; parameters are always bound, never formatted in.

-- name: _notify_on(run_at)
-- A transaction that set conveyor.notify = 'off' wakes nobody (docs/producing.md).
-- Nor does one that writes events due now while nobody waits for wake-ups: it
-- holds its slot of the wake gate (wakes.sql) until it ends, and a worker
-- that starts waiting meanwhile claims after it. An event due later always
-- sends its due time, which a worker busy now could not learn otherwise.
current_setting('conveyor.notify', true) IS DISTINCT FROM 'off'
AND ({run_at} > now() OR NOT -- include: _wake_gate_passed
    )

-- name: _wake(topic, run_at)
-- The wake-up of `topic`'s workers: its payload is the topic, and for an
-- event not due yet also the due time in epoch seconds ("topic|1767225600.5"),
-- so an idle worker can set a timer (conveyor/worker/wakeups.py reads it).
pg_notify({channel}, CASE WHEN {run_at} <= now() THEN {topic}
                          ELSE {topic} || '|' || extract(epoch FROM {run_at})::text END)

-- name: event_insert
-- One event, and its wake-up in the same statement (0007 dropped the insert
-- trigger, whose per-statement cost exceeded the insert's). With an
-- idempotency key that already exists nothing is inserted, nobody is woken
-- and no row comes back; the caller then looks the first event up.
-- The NOTIFY (_wake) is delivered at COMMIT and dropped by a ROLLBACK.
-- `run_at`, an absolute due time, wins over `delay` (the producer sends one
-- or the other). Numbers are cast to the columns' base types: a parameter
-- typed as a domain would run the domain's input function on every execution.
INSERT INTO {schema}.events_live
    (tenant, topic, payload, priority, max_attempts, idempotency_key, run_at)
VALUES
    (%(tenant)s, %(topic)s::text, %(payload)s::jsonb, %(priority)s, %(max_attempts)s::int,
     %(idempotency_key)s,
     COALESCE(%(run_at)s::timestamptz, now() + %(delay)s * interval '1 second'))
ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
RETURNING id,
    CASE WHEN -- include: _notify_on(run_at)
    THEN -- include: _wake(topic, run_at)
    END

-- name: event_insert_plain
-- event_insert for the common event: no idempotency key, no delay. Fewer
-- parameters and no ON CONFLICT make it measurably cheaper on both sides,
-- and a due event's wake-up is its topic.
INSERT INTO {schema}.events_live (tenant, topic, payload, priority, max_attempts)
VALUES (%(tenant)s, %(topic)s::text, %(payload)s::jsonb, %(priority)s, %(max_attempts)s::int)
RETURNING id,
    CASE WHEN -- include: _notify_on(now())
    THEN pg_notify({channel}, topic)
    END

-- name: event_insert_many_ids
-- Many events with ids reserved up front, from parallel arrays. Rows whose key
-- already exists are skipped; the caller looks those keys up. One wake-up per
-- topic of the new rows, with the topic's earliest due time when that is
-- later (see event_insert). `woken` runs because the final SELECT joins it;
-- its count() makes it exactly one row, so the join keeps every id.
WITH new AS (
    INSERT INTO {schema}.events_live
        (id, tenant, topic, payload, priority, max_attempts, idempotency_key, run_at)
    SELECT t.id, t.tenant, t.topic, t.payload::jsonb, t.priority, t.max_attempts,
           t.idempotency_key, COALESCE(t.run_at, now() + t.delay * interval '1 second')
    FROM unnest(%(ids)s::bigint[], %(tenants)s::text[], %(topics)s::text[], %(payloads)s::text[],
                %(priorities)s::smallint[], %(max_attempts)s::int[], %(keys)s::text[],
                %(delays)s::float8[], %(run_ats)s::timestamptz[])
         AS t(id, tenant, topic, payload, priority, max_attempts, idempotency_key, delay, run_at)
    ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, topic, run_at
), woken AS (
    SELECT count(
        -- include: _wake(due.topic, due.run_at)
    )
    FROM (SELECT topic, min(run_at) AS run_at FROM new GROUP BY topic) AS due
    WHERE -- include: _notify_on(due.run_at)
)
SELECT new.id FROM new, woken

-- name: event_wake_topics
-- The wake-up after a COPY of due events, which returns nothing to hang a
-- pg_notify() on: one NOTIFY per topic, delivered at COMMIT like the others.
SELECT count(pg_notify({channel}, topic))
FROM unnest(%(topics)s::text[]) AS topic
WHERE -- include: _notify_on(now())

-- name: event_sequence
-- The identity sequence behind events.id; looked up once per producer.
SELECT pg_get_serial_sequence(%(table)s, 'id')

-- name: event_reserve_ids
-- Ids for a batch, taken from the identity sequence up front because COPY
-- returns nothing. The sequence comes in resolved: looking it up per row
-- would cost more than the nextval calls themselves.
-- One array, not a row per id: parsing 1000 rows costs more than the query.
SELECT array_agg(nextval(%(sequence)s::regclass)) FROM generate_series(1, %(count)s)

-- name: event_id_by_key
SELECT id FROM {schema}.events
WHERE tenant IS NOT DISTINCT FROM %(tenant)s AND idempotency_key = %(idempotency_key)s

-- name: _found_by_id(rows, e=e)
-- The rows of `e` (the events table being written) that a CTE locked first,
-- or whose ids a statement was given, found by id as an array: joined to the
-- CTE, a batch of 1000 on fresh statistics was planned as a hash join over
-- the whole table, every row of it read for every claim, and a statement
-- planned anew on statistics from before a burst joined its batch to a scan
-- of every pending row (tests/worker/test_claim_plan.py). `rows` names the
-- CTE, with a condition if need be (`seen WHERE held`), or any relation with
-- an `id` column. Such rows are live (0025): saying so keeps the plan off
-- the history's days, each of which it would otherwise probe for every id.
{e}.id = ANY (ARRAY(SELECT id FROM {rows})) AND {e}.done IS NULL

-- name: _claim_update
-- The claim's write, shared by every claim variant (event_claim,
-- event_claim_unpaused, flow.sql's): the rows `next` picked become running,
-- the attempt counted at claim time, leased to the worker. Each stays in its
-- lane (0013): a limited event that returns to pending (a retry, a rescued
-- lease) is back in the flow claims' lane at once (_found_by_id). The
-- RETURNING columns are unpacked in the order of conveyor.types.CLAIM_COLUMNS.
-- A pending row is live (0025): the claim writes the live partition itself,
-- which costs the statement 7-12 % less than the same write through the
-- partitioned parent (benchmarks/sql_costs.py, "claim on events").
UPDATE {schema}.events_live AS e
SET state = 'running',
    attempts = e.attempts + 1,
    lease_owner = %(owner)s,
    lease_expires_at = now() + %(lease_ttl)s * interval '1 second',
    attempted_at = now(),
    updated_at = now()
WHERE -- include: _found_by_id(next)
RETURNING -- include: _claim_columns(attempts)

-- name: _claim_columns(attempts)
-- A claimed event's columns for the worker, in the order of
-- conveyor.types.CLAIM_COLUMNS (tests/test_rows.py holds them to it);
-- `attempts` is the attempt the claim starts.
-- Unqualified: the claim's UPDATE reads no other table, the held claim's
-- SELECT one.
id, tenant, topic, payload::text, {attempts}, max_attempts, priority, idempotency_key,
created_at, traceparent, tracestate

-- name: _topic_in(topic, prefix=)
-- Whether `topic` matches the patterns patterns.sql_params(patterns,
-- prefix) binds: one query may test several sets side by side (the worker's
-- own, and a flow limit's `limit_`, `except_` or `fifo_`).
(%({prefix}all_topics)s OR {topic} = ANY(%({prefix}topics)s::text[])
     OR {topic} LIKE ANY(%({prefix}prefixes)s::text[]))

-- name: _pattern_matches(pattern, topic)
-- A stored pattern (a pause's, a flow limit's, a worker's in the registry:
-- '*', a topic, or 'prefix.*') against a topic; patterns.matches_any is
-- the same test in Python. starts_with, not LIKE: a stored pattern is not
-- escaped for LIKE, and a topic may hold '_' or '%'.
({pattern} = '*' OR {pattern} = {topic}
       OR (right({pattern}, 2) = '.*' AND starts_with({topic}, left({pattern}, -1))))

-- name: _paused(topic, tenant)
-- Whether a row of the pauses table (0005) holds back an event of this topic
-- and tenant: a pause names a tenant or all of them.
EXISTS (
    SELECT 1 FROM {schema}.pauses AS p
    WHERE -- include: _pattern_matches(p.pattern, {topic})
      AND (p.tenant IS NULL OR p.tenant = {tenant}))

-- name: _claim_unpaused
-- The claim's pause test: a candidate row a pause holds back is skipped.
-- Used by the variants a worker runs while it knows of a pause.
      AND NOT -- include: _paused(events.topic, events.tenant)

-- name: _claim_filter
-- The worker's own claim filter: its routes' topic patterns and its tenants.
      AND -- include: _topic_in(topic)
      AND (%(all_tenants)s OR tenant = ANY(%(tenants)s::text[]))

-- name: _still_open
-- The recheck of a pending row of the open lane found again by its place in
-- the table (a TID scan; lanes.sql's lane_set_aside says why), after its lock
-- followed it to its newest version. One IS TRUE test, so that no partial
-- index of the open lane matches it: planned on statistics from before a
-- burst, the statement otherwise walked the whole open lane of
-- events_claim_idx to find 100 places (tests/worker/test_claim_plan.py).
      AND (state = 'pending' AND NOT limited) IS TRUE

-- name: _claim_candidates
-- The open lane's due events the worker may claim: the candidates of
-- event_claim and event_claim_flow, with or without the pause test. Read
-- from the live partition, as _claim_update writes it.
    FROM {schema}.events_live AS events
    WHERE state = 'pending'
      AND NOT limited
      AND run_at <= now()
      -- include: _claim_filter

-- name: _claim_order(lock=UPDATE)
-- The claim order, events_claim_idx's (its lane and state lead it). SKIP
-- LOCKED lets concurrent workers take disjoint rows without waiting on each
-- other.
    ORDER BY priority DESC, run_at, id
    LIMIT %(limit)s
    FOR {lock} SKIP LOCKED

-- name: event_claim
-- Claims up to `limit` due events of the worker's topics. The attempt is
-- counted at claim time so a crash mid-run still spends it.
-- Which rows are claimed follows the ORDER BY; the order RETURNING hands them
-- back follows the UPDATE's join (after an ANALYZE of a small table, the
-- table's physical order), so the worker sorts a batch by priority itself: a
-- sort here cost a tenth of the statement. The RETURNING columns are unpacked
-- in the order of conveyor.types.CLAIM_COLUMNS; tests/test_rows.py holds them
-- to it, so a reordering fails there instead of shifting fields.
WITH next AS (
    SELECT id
    -- include: _claim_candidates
    -- include: _claim_order
)
-- include: _claim_update

-- name: event_claim_unpaused
-- event_claim, skipping the events a row of the pauses table holds back
-- (0005). The worker uses it only while it knows of a pause, so an empty
-- pauses table costs the claim nothing; the anti-join runs per candidate row
-- of events_claim_idx, against a table of a few rows. Equal to event_claim
-- but for the NOT EXISTS (tests/test_pause_queries.py).
WITH next AS (
    SELECT id
    -- include: _claim_candidates
    -- include: _claim_unpaused
    -- include: _claim_order
)
-- include: _claim_update

-- name: event_succeed_many
-- Fenced: applies only where this worker still owns the same attempt. The
-- owner test implies state = 'running' (events_lease_check), and leaving the
-- state out keeps a generic plan from walking events_lease_idx once per row.
UPDATE {schema}.events AS e
SET -- include: _succeeded
FROM unnest(%(ids)s::bigint[], %(attempts)s::int[]) AS d(id, attempt)
WHERE e.id = d.id
  -- include: _leased
RETURNING e.id

-- name: _leased
-- The fence of a leased attempt's outcome `d`: the row is still this worker's
-- lease on the same attempt. A leased row is live (0025): saying so lets the
-- plan read the live partition alone instead of probing every day of the
-- history for each id.
  AND e.lease_owner = %(owner)s
  AND e.attempts = d.attempt
  AND e.done IS NULL

-- name: _into_history(clock=now)
-- Whether a row `e` finishing now moves into the history (0025,
-- docs/history-partitions.md): not when an idempotency key keeps it live
-- (the key's unique index holds live rows only), nor when no partition
-- exists yet for the day (history.until, moved by the day-maker). One read
-- of a one-row table per statement.
e.idempotency_key IS NULL AND {clock}() < (SELECT h.until FROM {schema}.history AS h)

-- name: _succeeded(clock=now)
-- What a success writes, leased or held (windows.sql). A claim window
-- passes statement_timestamp as the clock: in its transaction now() is the
-- window's start.
    state = 'succeeded',
    lease_owner = NULL,
    lease_expires_at = NULL,
    finished_at = {clock}(),
    updated_at = {clock}(),
    done = CASE WHEN -- include: _into_history({clock})
           THEN true END

-- name: event_complete
-- A handler finishing its own event in its own transaction (conveyor.complete):
-- fenced like event_succeed_many, so a lease lost or a cancel meanwhile
-- changes nothing and returns no row (the caller raises, and its transaction,
-- business writes included, rolls back). Waits for the row's lock rather than
-- skipping it: a rescuer or a cancel holding it decides, then the fence does.
-- Admin.wait() hears of it at the caller's commit.
UPDATE {schema}.events AS e
SET state = 'succeeded',
    lease_owner = NULL,
    lease_expires_at = NULL,
    result = %(result)s,
    finished_at = now(),
    updated_at = now(),
    done = CASE WHEN -- include: _into_history
           THEN true END
WHERE e.id = %(id)s
  AND e.lease_owner = %(owner)s
  AND e.attempts = %(attempt)s
  AND e.done IS NULL
RETURNING e.id, pg_notify(%(results_channel)s, e.id::text)

-- name: event_delete_succeeded_many
-- The acknowledgement of a worker with retention 0: the succeeded row goes at
-- once. Fenced exactly like event_succeed_many.
DELETE FROM {schema}.events AS e
USING unnest(%(ids)s::bigint[], %(attempts)s::int[]) AS d(id, attempt)
WHERE e.id = d.id
  -- include: _leased
RETURNING e.id

-- name: _errors_appended(attempt, error, traceback, worker, clock=now)
-- The events row `e`'s error history with one more entry (NULL, a new
-- event's, is an empty one: 0020). It keeps the last
-- 10 attempts (with the caps on each entry in executor.py, at most about
-- 60 KB), however many attempts an event has; rows.py decodes the entries.
(CASE WHEN jsonb_array_length(e.errors) >= 10 THEN e.errors - 0
      ELSE COALESCE(e.errors, '[]') END)
|| jsonb_build_array(jsonb_build_object('attempt', {attempt}, 'at', {clock}(), 'error', {error},
                                        'traceback', {traceback}, 'worker', {worker}))

-- name: event_settle_many
-- Every other outcome, fenced like event_succeed_many. `refund` gives the
-- attempt back (snooze, hand-back on shutdown); `error` appends to the history;
-- `result` is a store_result route's return value (0010).
UPDATE {schema}.events AS e
SET -- include: _settled
-- include: _settle_rows
WHERE e.id = d.id
  -- include: _leased
RETURNING e.id

-- name: _settled(clock=now)
-- What any other outcome `d` writes, leased or held (windows.sql), with the
-- clock of _succeeded. The attempt is `d`'s, less a refund.
    state = d.state,
    result = COALESCE(d.result::jsonb, e.result),
    attempts = d.attempt - d.refund,
    run_at = CASE WHEN d.delay IS NULL THEN e.run_at
                  ELSE {clock}() + d.delay * interval '1 second' END,
    last_error = COALESCE(d.error, e.last_error),
    errors = CASE WHEN d.error IS NULL THEN e.errors
                  ELSE -- include: _errors_appended(d.attempt, d.error, d.traceback, %(owner)s::text, {clock})
             END,
    lease_owner = NULL,
    lease_expires_at = NULL,
    finished_at = CASE WHEN d.state IN ('succeeded', 'failed', 'cancelled')
                       THEN {clock}() END,
    updated_at = {clock}(),
    -- Failed events stay live: they wait for a person.
    done = CASE WHEN d.state IN ('succeeded', 'cancelled') AND -- include: _into_history({clock})
           THEN true END

-- name: _settle_rows
-- The outcomes event_settle_many and event_settle_held write, as rows `d`.
FROM unnest(%(ids)s::bigint[], %(attempts)s::int[], %(states)s::text[],
            %(delays)s::float8[], %(refunds)s::int[], %(errors)s::text[],
            %(tracebacks)s::text[], %(results)s::text[])
     AS d(id, attempt, state, delay, refund, error, traceback, result)

-- name: event_extend_leases
-- Heartbeat: renew the leases of the events this worker is still running.
-- Rows locked by someone else (an operator's open transaction) are skipped,
-- not waited for: the heartbeat must never stall; see event_owned.
UPDATE {schema}.events
SET lease_expires_at = now() + %(lease_ttl)s * interval '1 second'
WHERE id IN (SELECT id FROM {schema}.events
             WHERE id = ANY(%(ids)s::bigint[])
               AND state = 'running'
               AND lease_owner = %(owner)s
             FOR UPDATE SKIP LOCKED)
  AND state = 'running'
  AND lease_owner = %(owner)s
RETURNING id, attempts

-- name: event_owned
-- Which of these events this worker still owns, read without taking locks
-- (a row another transaction holds is still reported).
SELECT id, attempts
FROM {schema}.events
WHERE id = ANY(%(ids)s::bigint[])
  AND state = 'running'
  AND lease_owner = %(owner)s

-- name: event_cancelled_among
-- Which of the events a heartbeat found missing were cancelled by an
-- operator while they ran: their handlers are stopped, not lost.
SELECT id FROM {schema}.events
WHERE id = ANY(%(ids)s::bigint[]) AND state = 'cancelled'

-- name: event_lock_owned
-- The acknowledgement fallback after a lock timeout: lock the rows this worker
-- owns that nobody else holds, skipping the rest, inside a transaction.
SELECT id
FROM {schema}.events
WHERE id = ANY(%(ids)s::bigint[])
  AND state = 'running'
  AND lease_owner = %(owner)s
FOR UPDATE SKIP LOCKED

-- name: event_rescue_expired
-- Events whose worker stopped renewing its lease (killed, frozen, cut off) go
-- back to pending, or to failed when that was their last attempt, so a poison
-- event that kills its worker still ends up parked.
WITH expired AS (
    SELECT id
    FROM {schema}.events
    WHERE state = 'running' AND lease_expires_at < now()
    ORDER BY lease_expires_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.events AS e
SET state = CASE WHEN e.attempts >= e.max_attempts THEN 'failed' ELSE 'pending' END,
    -- Keep its place: an orphan goes back ahead of everything queued after it,
    -- not behind the whole backlog.
    run_at = LEAST(e.run_at, now()),
    last_error = 'lease expired: the worker running attempt ' || e.attempts || ' was lost',
    errors = (-- include: _errors_appended(e.attempts, 'lease expired: the worker running this attempt was lost', NULL, e.lease_owner::text)
    ),
    lease_owner = NULL,
    lease_expires_at = NULL,
    finished_at = CASE WHEN e.attempts >= e.max_attempts THEN now() END,
    updated_at = now()
WHERE -- include: _found_by_id(expired)
RETURNING e.id, e.state, e.topic

-- name: event_notify
SELECT pg_notify(%(channel)s, %(payload)s)

-- name: event_notify_finished
-- Tells Admin.wait() that these events reached a final state: one
-- notification per id on the results channel, sent once the row is written.
SELECT pg_notify(%(channel)s, finished.id::text)
FROM unnest(%(ids)s::bigint[]) AS finished(id)

-- name: event_get
SELECT id, tenant, topic, payload, state, attempts, max_attempts, priority, run_at,
       lease_owner::text, lease_expires_at, last_error, errors, idempotency_key,
       created_at, COALESCE(updated_at, created_at) AS updated_at, attempted_at, finished_at, result
FROM {schema}.events
WHERE id = %(id)s

-- name: event_result
-- Admin.result and Admin.wait: an event's state, stored result and last error.
SELECT id, state, result AS value, last_error AS error, finished_at
FROM {schema}.events
WHERE id = %(id)s

-- name: _reopen(run_at)
-- An operator's retry or reschedule: the event is pending again, due at
-- `run_at`, with one more attempt if all are spent.
UPDATE {schema}.events
SET state = 'pending',
    -- Out of the aside lane (0018): judged again, as a new event is.
    limited = COALESCE(limited, false),
    run_at = {run_at},
    max_attempts = GREATEST(max_attempts, attempts + 1),
    finished_at = NULL,
    updated_at = now(),
    -- Back from the history, if it was there (0025): the UPDATE moves it.
    done = NULL

-- name: _cancel
-- A cancelled event is finished, and no worker's lease holds it any more.
-- It follows a CTE `was` of the rows to cancel, locked, as they were. If one
-- was running, its worker is told to look at its leases now ('!leases',
-- conveyor/notify.py) and stops the handler (docs/workers.md): one
-- notification per transaction, however many rows (PostgreSQL folds equal
-- ones). `told` runs because the UPDATE joins it; its count() makes it one row.
-- Into the history, as an acknowledgement's cancel goes (0025).
, told AS (
    SELECT count(pg_notify({channel}, '!leases')) FROM was WHERE was.state = 'running'
)
UPDATE {schema}.events AS e
SET state = 'cancelled',
    lease_owner = NULL,
    lease_expires_at = NULL,
    finished_at = now(),
    updated_at = now(),
    done = CASE WHEN -- include: _into_history
           THEN true END
FROM was, told
WHERE e.id = was.id
RETURNING e.id

-- name: _cancellable
-- A running event may be cancelled too: its worker's late result is then
-- fenced out; a waiting one (0022) never runs. A finished one stays as it ended.
state IN ('waiting', 'pending', 'running', 'failed')

-- name: event_retry
-- Operator retry: run again now, granting one more attempt if all are spent.
-- include: _reopen(now())
WHERE id = %(id)s AND state IN ('pending', 'failed', 'cancelled')
RETURNING id

-- name: event_reschedule
-- Operator reschedule: due at `run_at` (or `delay` seconds from now) instead;
-- a failed or cancelled event becomes pending again, with one more attempt
-- if all are spent, as event_retry grants. The wake-up comes from the caller,
-- which knows the topic and due time from RETURNING.
-- include: _reopen(COALESCE(%(run_at)s::timestamptz, now() + %(delay)s * interval '1 second'))
WHERE id = %(id)s AND state IN ('pending', 'failed', 'cancelled')
RETURNING id, topic, run_at, extract(epoch FROM run_at)::float8 AS due_epoch,
          run_at <= now() AS due_now

-- name: event_retry_failed
-- include: _reopen(now())
WHERE state = 'failed' AND (%(topic)s::text IS NULL OR topic = %(topic)s::text)
RETURNING id

-- name: event_cancel
WITH was AS (
    SELECT id, state FROM {schema}.events
    WHERE id = %(id)s AND -- include: _cancellable
    FOR UPDATE
)
-- include: _cancel

-- name: event_state
SELECT state FROM {schema}.events WHERE id = %(id)s

-- name: _prunable_done
-- Succeeded and cancelled rows finished `older_than` seconds ago, read
-- through events_prunable_idx, which holds only them (0003). The states are
-- named literally, so the planner can prove the partial index's predicate
-- even in a generic plan; the states parameter then only filters.
         WHERE state IN ('succeeded', 'cancelled')
           AND state = ANY(%(states)s::text[])
           AND finished_at < now() - %(older_than)s * interval '1 second'

-- name: _prunable_failed
-- Failed rows finished `older_than` seconds ago, read through
-- events_failed_idx, and only when they are asked for (a one-time filter).
         WHERE state = 'failed'
           AND 'failed' = ANY(%(states)s::text[])
           AND finished_at < now() - %(older_than)s * interval '1 second'

-- name: _prune(lock=, table=events)
-- Deletes finished events in bounded batches so no single statement holds
-- locks on a huge number of rows. Each branch reads its own partial index,
-- even in the generic plan of the worker's prepared statement, so the old
-- failed rows a queue keeps are never read unless asked for (the worker
-- never asks).
-- The batch's ids are deleted through the primary key: a join to them let
-- the planner, which cannot see that old finished rows are mostly failed ones
-- and so expects a full batch, hash it and read the whole table. The outer
-- conditions are checked again on a row that changed meanwhile (an operator's
-- retry), so it is not deleted. `lock` may lock the candidates as they are
-- read (a locking clause is refused in a branch of a UNION, so each branch
-- reads from a subquery).
DELETE FROM {schema}.{table}
WHERE id = ANY(ARRAY(
        (SELECT id FROM (SELECT id FROM {schema}.{table}
                         -- include: _prunable_done
                         LIMIT %(limit)s {lock}) AS done)
        UNION ALL
        (SELECT id FROM (SELECT id FROM {schema}.{table}
                         -- include: _prunable_failed
                         LIMIT %(limit)s {lock}) AS failed)
        LIMIT %(limit)s))
  AND state = ANY(%(states)s::text[])
  AND finished_at < now() - %(older_than)s * interval '1 second'

-- name: event_prune
-- include: _prune

-- name: event_prune_skip_locked
-- event_prune past the rows other transactions hold (an operator's open
-- transaction on an old event), for the batch whose lock wait timed out: a
-- held row would otherwise be in every batch the pruner tries, and stop
-- retention for as long as it is held. Not the default: locking each
-- candidate writes a lock record per row, about 56 bytes of WAL on top of the
-- delete's 130 (measured 2026-12-03, 5,000-row batches).
-- include: _prune(FOR UPDATE SKIP LOCKED)

-- name: event_prune_live
-- The worker's event_prune: the live partition's finished rows only (0025).
-- Those in the history go a partition at a time (history_drop); deleting them
-- row by row would write what the drop spares.
-- include: _prune(, events_live)

-- name: event_prune_live_skip_locked
-- event_prune_skip_locked on the live partition.
-- include: _prune(FOR UPDATE SKIP LOCKED, events_live)

-- name: history_make
-- The history's partitions from now to `ahead` seconds on (0026): how many
-- were made, the end of the last, and when half the time to it is gone.
SELECT made, made_until, now() + (made_until - now()) / 2 AS due
FROM {schema}.history_make(%(ahead)s * interval '1 second')

-- name: history_drop
-- The history's partitions that ended `older_than` seconds ago or earlier,
-- dropped: how many.
SELECT {schema}.history_drop(%(older_than)s * interval '1 second')

-- name: history_make_days
-- 0025's function, kept for an older release's workers: today's partitions
-- and those of the next `ahead` days.
SELECT {schema}.history_make_days(%(ahead)s)

-- name: history_drop_days
-- 0025's function, kept for an older release's workers.
SELECT {schema}.history_drop_days(%(older_than)s)

-- name: history_settings
-- The history's partition span in seconds, the end of the last made, and
-- whether its partitions get the replay's index (0027); a day, none and no
-- without the settings row (0025 writes it).
SELECT coalesce(extract(epoch FROM h.span), 86400)::float8 AS span, h.until,
       coalesce(h.replayable, false) AS replayable
FROM (VALUES (true)) AS one (one)
LEFT JOIN {schema}.history AS h USING (one)

-- name: history_replayable
-- The history's partitions get a BRIN index on finished_at from now on, and
-- those made ahead now (0027): how many indexes it made.
SELECT {schema}.history_replayable()

-- name: history_set_span
-- Sets the history's partition span (checked by the caller, and by 0026's
-- CHECK); the partitions made from then on have it.
INSERT INTO {schema}.history AS h (span) VALUES (%(seconds)s * interval '1 second')
ON CONFLICT (one) DO UPDATE SET span = excluded.span

-- name: history_list
-- The history's partitions, oldest first, from the catalog: about how many
-- rows each holds (the server's statistics, no row read) and its size with
-- its indexes.
SELECT p.name::text AS name, p.starts, p.ends,
       coalesce(s.n_live_tup, 0) AS rows, pg_total_relation_size(c.oid) AS bytes
FROM {schema}.history_parts() AS p
JOIN pg_class AS c ON c.relname = p.name AND c.relnamespace = '{schema}'::regnamespace
LEFT JOIN pg_stat_all_tables AS s ON s.relid = c.oid
ORDER BY p.starts

-- name: prune_lock_timeout
-- The pruner's batches wait at most this long for a row lock, whatever the
-- session's setting: in the batch's own transaction only.
SELECT set_config('lock_timeout', %(timeout)s, true)
