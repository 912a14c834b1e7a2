-- Conveyor 0020: an event's error history and update time are written when
-- it has them. `{schema}` is replaced by the quoted schema identifier; this
-- file holds no other braces on purpose.
--
-- Every event was written with `errors = '[]'` and `updated_at = now()`,
-- the same instant as created_at: 16 bytes in every row and about 16 bytes
-- of WAL per event (of 295 for a bulk enqueue, 2026-12-03), for a history
-- most events never get and a time the row already holds. Now a new event's
-- errors is NULL until its first failed attempt appends to it (the
-- _errors_appended fragment starts from an empty list), and its updated_at
-- NULL until its first change (a claim, an outcome, an operator's action: the
-- statements that set it before; the lanes' moves did not and do not).
-- Conveyor's readers give an empty history and created_at for them, as
-- before (tests/test_migration_0020.py). A catalog change: no row is read or
-- rewritten, and the rows written before keep their values.
ALTER TABLE {schema}.events ALTER COLUMN errors DROP NOT NULL;
ALTER TABLE {schema}.events ALTER COLUMN errors DROP DEFAULT;
ALTER TABLE {schema}.events ALTER COLUMN updated_at DROP NOT NULL;
ALTER TABLE {schema}.events ALTER COLUMN updated_at DROP DEFAULT;
