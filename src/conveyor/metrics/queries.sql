-- Named queries of the database gauges. `{schema}` is the quoted schema identifier.

-- name: metrics_try_lock
-- One refresher per schema: a session advisory lock, kept while the
-- connection lives, so it is released when the worker exits or dies. The
-- first key is fixed (ASCII 'cvmt'), the second the schema's hash.
SELECT pg_try_advisory_lock(1668709748, hashtext(%(schema)s))
