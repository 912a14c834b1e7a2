"""Stepped migrations: each step its own transaction (or none), recorded, resumable.

The package holds no stepped migration yet, so these tests give the migrator
migrations of their own (``Migrator(migrations=...)``), in a schema of their
own on an empty database.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from conveyor import MigrationError, Migrator
from conveyor.schema.migrator import (
    Migration,
    Step,
    load_migrations,
    migration_script,
    migration_script_parts,
)
from conveyor.schema.migrator_script import COMMIT_MARKER, NO_TRANSACTION_MARKER
from test_migrations import catalog
from together import run_together

SCHEMA = "steps_q"

BASE = Migration(1, "base", """
CREATE TABLE {schema}.items (id int PRIMARY KEY, n int NOT NULL);
INSERT INTO {schema}.items SELECT i, i FROM generate_series(1, 1000) i;
-- Which transaction ran each step: the proof that each had its own.
CREATE TABLE {schema}.step_log (step int NOT NULL, xid xid8 NOT NULL DEFAULT pg_current_xact_id());
""")

# Add a CHECK without reading the table, build an index without blocking
# writes, then validate the CHECK: the shape of a migration on a big table.
CONSTRAINED = Migration(2, "constrained", """-- A stepped migration for the tests.
-- conveyor:step
ALTER TABLE {schema}.items ADD CONSTRAINT items_n_check CHECK (n > 0) NOT VALID;
INSERT INTO {schema}.step_log (step) VALUES (1);
-- conveyor:step no-transaction
CREATE INDEX CONCURRENTLY IF NOT EXISTS items_n_idx ON {schema}.items (n);
-- conveyor:step
ALTER TABLE {schema}.items VALIDATE CONSTRAINT items_n_check;
INSERT INTO {schema}.step_log (step) VALUES (3);
""")

AFTER = Migration(3, "after", "ALTER TABLE {schema}.items ADD COLUMN note text;\n")


def _migrator(*migrations: Migration) -> Migrator:
    return Migrator(SCHEMA, migrations=migrations or (BASE, CONSTRAINED, AFTER))


def _rows(url: str, query: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return [tuple(r) for r in conn.execute(query.replace("SCHEMA", SCHEMA))]


# ---------------------------------------------------------------- the markers

def test_a_file_without_markers_is_one_step_of_exactly_its_text() -> None:
    for m in load_migrations():
        if m.version != 25:   # 0025 has markers (below)
            assert not m.stepped and m.steps == (Step(m.body),)


def test_0025_runs_in_three_steps_each_in_a_transaction() -> None:
    [m] = [m for m in load_migrations() if m.version == 25]
    assert m.stepped and [s.transaction for s in m.steps] == [True, True, True]
    assert [s.body.strip().split("\n")[-1] for s in m.steps][:2] == [
        "ALTER TABLE {schema}.events ADD CONSTRAINT events_live_done_check CHECK (done IS NULL)"
        " NOT VALID;",
        "ALTER TABLE {schema}.events VALIDATE CONSTRAINT events_live_done_check;"]


def test_markers_cut_a_file_into_steps_and_a_header_of_comments_is_none() -> None:
    assert [(s.transaction, s.body.split("\n")[0]) for s in CONSTRAINED.steps] == [
        (True, "ALTER TABLE {schema}.items ADD CONSTRAINT items_n_check CHECK (n > 0) NOT VALID;"),
        (False, "CREATE INDEX CONCURRENTLY IF NOT EXISTS items_n_idx ON {schema}.items (n);"),
        (True, "ALTER TABLE {schema}.items VALIDATE CONSTRAINT items_n_check;")]
    implicit = Migration(4, "x", "SELECT 1;\n-- conveyor:step\nSELECT 2;\n")
    assert [s.body for s in implicit.steps] == ["SELECT 1;\n", "SELECT 2;\n"]


@pytest.mark.parametrize(("body", "message"), [
    ("SELECT 1;\n-- conveyor:step notransaction\nSELECT 2;\n",
     "migration 7 has an unknown directive '-- conveyor:step notransaction'"),
    ("-- conveyor:steps\nSELECT 1;\n", "unknown directive '-- conveyor:steps'"),
    ("SELECT 1;\n-- conveyor:step\n-- nothing here\n", "migration 7 step 2 holds no SQL"),
    ("-- conveyor:step no-transaction\nCREATE INDEX CONCURRENTLY i ON t (x)\n",
     "migration 7 step 1 (no-transaction) must end its statement with ';'"),
])
def test_a_malformed_marker_is_refused_naming_the_migration(body: str, message: str) -> None:
    with pytest.raises(MigrationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Migration(7, "bad", body)


# ---------------------------------------------------------------- applying

def test_each_step_runs_in_a_transaction_of_its_own_or_none(empty_db: str) -> None:
    with psycopg.connect(empty_db) as conn:            # not autocommit: apply commits each step
        applied = _migrator().apply(conn)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert conn.autocommit is False
    assert [m.version for m in applied] == [1, 2, 3]
    # CREATE INDEX CONCURRENTLY fails inside a transaction block: it ran outside one.
    assert _rows(empty_db, "SELECT indisvalid FROM pg_index"
                           " WHERE indexrelid = 'SCHEMA.items_n_idx'::regclass") == [(True,)]
    assert _rows(empty_db, "SELECT convalidated FROM pg_constraint"
                           " WHERE conname = 'items_n_check'") == [(True,)]
    # Step 3's VALIDATE ran in a later transaction than step 1's ADD, which had
    # committed: the xids differ and grow.
    (one, three) = [r[0] for r in _rows(empty_db, "SELECT xid FROM SCHEMA.step_log ORDER BY step")]
    assert int(str(one)) < int(str(three))
    assert _rows(empty_db, "SELECT version, step FROM SCHEMA.migration_steps"
                           " ORDER BY 1, 2") == [(2, 1), (2, 2), (2, 3)]
    assert _rows(empty_db, "SELECT version FROM SCHEMA.migrations ORDER BY 1") == [(1,), (2,), (3,)]


def test_the_same_migrations_in_one_transaction_would_fail(empty_db: str) -> None:
    """The control of the test above: without steps, the index cannot be built."""
    unstepped = Migration(2, "constrained", CONSTRAINED.body.replace("-- conveyor:step", "--"))
    assert not unstepped.stepped
    with psycopg.connect(empty_db, autocommit=True) as conn, \
            pytest.raises(MigrationError, match="CREATE INDEX CONCURRENTLY cannot run inside"):
        _migrator(BASE, unstepped).apply(conn)


async def test_the_async_migrator_runs_the_steps_too(empty_db: str) -> None:
    from conveyor import AsyncMigrator

    migrator = AsyncMigrator(SCHEMA, migrations=(BASE, CONSTRAINED, AFTER))
    async with await psycopg.AsyncConnection.connect(empty_db) as conn:
        assert [m.version for m in await migrator.apply(conn)] == [1, 2, 3]
        assert await migrator.apply(conn) == []
        await migrator.require_current(conn)


# One step that cannot run twice, then one that fails until a row exists.
FRAGILE = Migration(2, "fragile", """-- conveyor:step
CREATE TABLE {schema}.once (x int);
-- conveyor:step
SELECT 1 / (SELECT count(*)::int FROM {schema}.once);
INSERT INTO {schema}.step_log (step) VALUES (2);
""")


def _advisory_locks_held(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                       " AND pid = pg_backend_pid()").fetchone()
    return int(row[0]) if row else -1


def test_a_failed_step_keeps_the_ones_before_and_apply_resumes_after_them(
        empty_db: str) -> None:
    migrator = _migrator(BASE, FRAGILE, AFTER)
    with psycopg.connect(empty_db, autocommit=True) as conn:
        with pytest.raises(MigrationError, match=r"migrating schema 'steps_q' failed at step 2 "
                                                 r"of 2 of migration 0002_fragile: division by"):
            migrator.apply(conn)
        assert _advisory_locks_held(conn) == 0          # the steps lock went with the error
        assert migrator.applied_versions(conn) == [1]
        assert [m.version for m in migrator.pending(conn)] == [2, 3]
        assert conn.execute(f"SELECT step FROM {SCHEMA}.migration_steps").fetchall() == [(1,)]
        conn.execute(f"INSERT INTO {SCHEMA}.once VALUES (1)")
        # Step 1 again would fail: "relation once already exists".
        assert [m.version for m in migrator.apply(conn)] == [2, 3]
        assert migrator.applied_versions(conn) == [1, 2, 3]


def test_require_current_refuses_a_schema_partly_through_a_stepped_migration(
        empty_db: str) -> None:
    migrator = _migrator(BASE, FRAGILE)
    with psycopg.connect(empty_db, autocommit=True) as conn:
        with pytest.raises(MigrationError):
            migrator.apply(conn)
        with pytest.raises(MigrationError, match=r"^schema 'steps_q' is partly through migration "
                                                 r"2 \(1 of 2 steps applied\); run 'conveyor "
                                                 r"migrate' to finish it$"):
            migrator.require_current(conn)
        conn.execute(f"INSERT INTO {SCHEMA}.once VALUES (1)")
        migrator.apply(conn)
        migrator.require_current(conn)


def test_a_stepped_migration_is_refused_inside_the_callers_transaction(empty_db: str) -> None:
    with psycopg.connect(empty_db) as conn:
        conn.execute("SELECT 1")                     # the caller's transaction is open
        with pytest.raises(MigrationError, match="migration 2 runs in steps, each committed on "
                                                 "its own; apply it on a connection with no "
                                                 "transaction open"):
            _migrator().apply(conn)
        conn.rollback()
        assert _migrator().applied_versions(conn) == []   # migration 1 was not applied either


# ---------------------------------------------------------------- crashes and races

# Run by a child process: migrate, and stop dead after step 1 is committed.
_CHILD = """
import json, logging, sys, time
from psycopg import connect
from conveyor.schema.migrator import Migration, Migrator

class StopAfterStepOne(logging.Handler):
    def emit(self, record):
        if getattr(record, "action", None) == "migration_step_applied" and record.step == 1:
            print("step 1 committed", flush=True)
            time.sleep(120)          # the parent kills us here, between two steps

logging.getLogger("conveyor.schema.migrator").addHandler(StopAfterStepOne())
logging.getLogger("conveyor.schema.migrator").setLevel(logging.INFO)
migrations = [Migration(*m) for m in json.loads(sys.argv[2])]
with connect(sys.argv[1], autocommit=True) as conn:
    Migrator(sys.argv[3], migrations=migrations).apply(conn)
"""


def test_a_migrator_killed_between_steps_is_resumed_at_the_next_step(empty_db: str) -> None:
    migrations = (BASE, FRAGILE, AFTER)
    with psycopg.connect(empty_db, autocommit=True) as conn:
        _migrator(BASE).apply(conn)
        # Step 2 succeeds now; a second run of step 1 would fail.
        conn.execute(f"CREATE TABLE {SCHEMA}.witness (x int)")
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, empty_db,
         json.dumps([[m.version, m.name, m.body] for m in migrations]), SCHEMA],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line == "step 1 committed\n", child.stderr.read() if child.stderr else ""
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert _rows(empty_db, "SELECT version, step FROM SCHEMA.migration_steps") == [(2, 1)]
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute(f"INSERT INTO {SCHEMA}.once VALUES (1)")
        conn.execute("SET lock_timeout = '20s'")
        # The dead session's steps lock is gone with it: this apply takes it.
        assert [m.version for m in _migrator(*migrations).apply(conn)] == [2, 3]
    assert _rows(empty_db, "SELECT step FROM SCHEMA.step_log") == [(2,)]


# Every step sleeps a little with the steps lock held, so the racers overlap.
RACED = Migration(2, "raced", """-- conveyor:step
INSERT INTO {schema}.step_log (step) SELECT 1 FROM pg_sleep(0.3);
-- conveyor:step no-transaction
CREATE INDEX CONCURRENTLY IF NOT EXISTS items_n_idx ON {schema}.items (n);
-- conveyor:step
INSERT INTO {schema}.step_log (step) SELECT 3 FROM pg_sleep(0.3);
""")


def test_migrators_started_at_once_run_each_step_exactly_once(empty_db: str) -> None:
    migrations = (BASE, RACED, AFTER)

    def migrate(go: Callable[[], None]) -> list[int]:
        with psycopg.connect(empty_db, autocommit=True) as conn:
            go()
            return [m.version for m in _migrator(*migrations).apply(conn)]

    started = time.monotonic()
    applied = run_together(4, migrate)
    assert sorted(v for versions in applied for v in versions) == [1, 2, 3]
    assert _rows(empty_db, "SELECT step FROM SCHEMA.step_log ORDER BY step") == [(1,), (3,)]
    assert _rows(empty_db, "SELECT version, step FROM SCHEMA.migration_steps"
                           " ORDER BY 1, 2") == [(2, 1), (2, 2), (2, 3)]
    assert time.monotonic() - started < 30        # no deadlock ran out a timeout


# ---------------------------------------------------------------- the script

def _run_parts(url: str, script: str) -> None:
    """Run a script as its header asks: each part in a transaction of its own, or none."""
    with psycopg.connect(url, autocommit=True) as conn:
        for part in script.split(f"\n{COMMIT_MARKER}\n"):
            if part.startswith(NO_TRANSACTION_MARKER):
                conn.execute(part.encode())
            else:
                with conn.transaction():
                    conn.execute(part.encode())


def test_the_script_of_a_stepped_migration_says_where_transactions_end() -> None:
    script = migration_script(SCHEMA, migrations=(BASE, CONSTRAINED, AFTER))
    header = script[:script.index("SELECT pg_advisory_xact_lock")]
    assert "Migration 0002 runs in steps" in header
    assert "psql --single-transaction, or a tool that runs the whole script in\n-- one " \
           "transaction, CANNOT apply this script" in header
    parts = migration_script_parts(SCHEMA, migrations=(BASE, CONSTRAINED, AFTER))
    assert [p.transaction for p in parts] == [True, True, False, True, True, True]
    assert script.count(f"\n{COMMIT_MARKER}\n") == len(parts) - 1
    assert parts[2].sql.startswith(NO_TRANSACTION_MARKER)
    assert "CREATE INDEX CONCURRENTLY" in parts[2].sql
    # Without a no-transaction step, the header says nothing of it.
    plain_steps = Migration(2, "two", "SELECT 1;\n-- conveyor:step\nSELECT 2;\n")
    assert "CANNOT" not in migration_script(SCHEMA, migrations=(BASE, plain_steps))


def test_the_script_run_part_by_part_yields_what_apply_yields(
        empty_db: str, make_db: Any) -> None:
    migrations = (BASE, CONSTRAINED, AFTER)
    script = migration_script(SCHEMA, migrations=migrations)
    _run_parts(empty_db, script)
    with make_db(prefix="conveyor_e_") as reference, \
            psycopg.connect(reference, autocommit=True) as conn:
        _migrator(*migrations).apply(conn)
        assert catalog(empty_db, SCHEMA) == catalog(reference, SCHEMA)
    assert _rows(empty_db, "SELECT version, step FROM SCHEMA.migration_steps"
                           " ORDER BY 1, 2") == [(2, 1), (2, 2), (2, 3)]
    with psycopg.connect(empty_db, autocommit=True) as conn:
        assert _migrator(*migrations).apply(conn) == []
        _migrator(*migrations).require_current(conn)
    _run_parts(empty_db, script)                      # again: every guarded part is skipped
    assert _rows(empty_db, "SELECT step FROM SCHEMA.step_log ORDER BY step") == [(1,), (3,)]


def test_the_script_resumes_a_migration_the_migrator_left_halfway(empty_db: str) -> None:
    migrations = (BASE, FRAGILE)
    with psycopg.connect(empty_db, autocommit=True) as conn:
        with pytest.raises(MigrationError):
            _migrator(*migrations).apply(conn)
        conn.execute(f"INSERT INTO {SCHEMA}.once VALUES (1)")
    _run_parts(empty_db, migration_script(SCHEMA, migrations=migrations))
    assert _rows(empty_db, "SELECT version FROM SCHEMA.migrations ORDER BY 1") == [(1,), (2,)]
    assert _rows(empty_db, "SELECT step FROM SCHEMA.step_log") == [(2,)]
