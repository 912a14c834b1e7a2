-- Named queries behind the operator's listing and bulk actions (Admin.events,
-- retry_matching, cancel_matching, prune's dry run). `{schema}` is replaced by
-- the quoted schema identifier; parameters are always bound. The retry, cancel
-- and prune fragments included here are events.sql's, so the operator's batch
-- actions change a row exactly as the single ones do.

-- name: event_list
-- One page of events, newest first, keyset-paginated on id (`after`: the
-- smallest id of the previous page). Every filter is optional: an unset one
-- (NULL, an empty array, false) folds away to `true` when the statement is
-- planned with its values, so Admin runs it unprepared (prepare=False) and
-- each call gets the plan of its own filters, never a generic plan that has
-- to serve all of them. Which index serves which filter (EXPLAIN-checked in
-- tests/test_admin_events.py, docs/admin.md):
--   no filter, after, newer_than, ids, common states/topics/tenants:
--     events_pkey walked backwards, stopping after `limit` matches;
--   failed or cancelled events of a rare topic, prefix or tenant:
--     events_stopped_topic_idx (topic COLLATE "C", id) and
--     events_stopped_tenant_idx (tenant, id), partial on those states; the
--     prefix is the range [prefix., prefix/) in byte order, whatever the
--     database's collation;
--   running / failed: events_lease_idx / events_failed_idx when few.
-- A rare topic or tenant in the other states has no index of its own (one over
-- every row would be written at every claim and acknowledgement): it is read
-- newest first through the primary key.
-- `error`, `payload` (a SQL/JSON path predicate) and `older_than` only
-- filter: they read rows the other conditions (or the primary key, newest
-- first) bring until `limit` of them match. `newest` bounds that read to the
-- newest `newest` ids: max(id) is one index probe, and `id >` it minus
-- `newest` is an index condition, so a search matching nothing stops there
-- instead of reading the whole table.
-- `span` bounds the read in the same way below `after` (or the highest id):
-- Admin.events asks for a page over the newest 10,000 ids first, then
-- 1,000,000, then all (admin_core._list_flow). Since 0025 every partition's
-- read starts with its first match, newest first: without a bound, a filter
-- that none of the live partition's rows match (a topic none of its parked
-- failures have) read all of them before the page could begin (82 ms for a
-- topic's page at 50 million rows, where the one table took 21).
-- Columns are read by name (admin._summary_from_row).
SELECT id, tenant, topic, state, attempts, max_attempts, priority, run_at,
       created_at, COALESCE(updated_at, created_at) AS updated_at, last_error
FROM {schema}.events
WHERE (%(after)s::bigint IS NULL OR id < %(after)s::bigint)
  AND (%(newest)s::bigint IS NULL
       OR id > (SELECT coalesce(max(id), 0) FROM {schema}.events) - %(newest)s::bigint)
  AND (%(span)s::bigint IS NULL
       OR id >= coalesce(%(after)s::bigint, (SELECT max(id) + 1 FROM {schema}.events))
               - %(span)s::bigint)
  AND (cardinality(%(ids)s::bigint[]) = 0 OR id = ANY(%(ids)s::bigint[]))
  AND (cardinality(%(states)s::text[]) = 0 OR state = ANY(%(states)s::text[]))
  AND (%(topic)s::text IS NULL OR topic COLLATE "C" = %(topic)s::text)
  AND (%(topic_from)s::text IS NULL
       OR (topic COLLATE "C" >= %(topic_from)s::text AND topic COLLATE "C" < %(topic_to)s::text))
  AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s::text)
  AND (%(older_than)s::float8 IS NULL
       OR created_at < now() - %(older_than)s::float8 * interval '1 second')
  AND (%(newer_than)s::float8 IS NULL
       OR created_at >= now() - %(newer_than)s::float8 * interval '1 second')
  AND (%(error)s::text IS NULL OR strpos(lower(last_error), lower(%(error)s::text)) > 0)
  AND (%(payload)s::jsonpath IS NULL OR payload @@ %(payload)s::jsonpath)
  -- retry_matching takes pending events only while they are scheduled (not yet due).
  AND (NOT %(scheduled_pending_only)s::boolean OR state <> 'pending' OR run_at > now())
ORDER BY id DESC
LIMIT %(limit)s

-- name: event_retry_ids
-- One batch of retry_matching: the ids come from event_list; each row's state
-- is checked again here (a worker or another operator may have moved it
-- since), with the same rule as event_retry, limited to the filter's states.
-- include: _reopen(now())
WHERE id = ANY(%(ids)s::bigint[])
  AND state = ANY(%(states)s::text[])
  AND (state IN ('failed', 'cancelled') OR (state = 'pending' AND run_at > now()))
RETURNING id

-- name: event_cancel_ids
-- One batch of cancel_matching, checked again like event_retry_ids, with the
-- same rule as event_cancel.
WITH was AS (
    SELECT id, state FROM {schema}.events
    WHERE id = ANY(%(ids)s::bigint[])
      AND state = ANY(%(states)s::text[])
      AND -- include: _cancellable
    FOR UPDATE
)
-- include: _cancel

-- name: event_prune_count
-- What event_prune would delete, counted without deleting, through the same
-- indexes: events_prunable_idx for succeeded and cancelled rows, and
-- events_failed_idx for failed ones only when they are asked for.
SELECT (SELECT count(*) FROM {schema}.events
        -- include: _prunable_done
       )
     + (SELECT count(*) FROM {schema}.events
        -- include: _prunable_failed
       ) AS n
