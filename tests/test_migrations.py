"""Migrator / AsyncMigrator, ``migration_script`` and the schema.sql snapshot."""

from __future__ import annotations

import multiprocessing
import re
import shutil
import subprocess
import sys
from importlib import resources
from typing import Any

import psycopg
import pytest

from conveyor import (
    AsyncMigrator,
    ConfigError,
    InvalidInputError,
    MigrationError,
    Migrator,
    Producer,
    ProducerConfig,
    WorkerConfig,
)
from conveyor.db.named_queries import queries_for
from conveyor.schema.migrator import latest_version, load_migrations, migration_script

MALICIOUS = ["x; drop table", 'Robert"', 'a"; DROP SCHEMA public CASCADE; --', "Conveyor",
             "public.events", "", "x" * 41]


def _applied(url: str, schema: str = "conveyor") -> list[tuple[int, str]]:
    with psycopg.connect(url) as conn:
        return [(r[0], r[1]) for r in conn.execute(
            f'SELECT version, name FROM "{schema}".migrations ORDER BY version')]


def catalog(url: str, schema: str, *, include_version_table: bool = True) -> dict[str, Any]:
    """The shape of ``schema``, with the schema name normalised to ``SCHEMA``."""
    skip = [] if include_version_table else ["migrations", "migration_steps"]
    with psycopg.connect(url) as conn:
        def rows(query: str) -> list[tuple[Any, ...]]:
            return [tuple(r) for r in conn.execute(query, {"schema": schema, "skip": skip})]

        found = {
            "relations": rows("""
                SELECT c.relname, c.relkind::text FROM pg_class c
                JOIN pg_namespace n ON n.oid = c.relnamespace
                WHERE n.nspname = %(schema)s AND c.relname <> ALL(%(skip)s)
                  AND NOT (c.relname IN ('migrations_pkey', 'migration_steps_pkey')
                           AND 'migrations' = ANY(%(skip)s))
                ORDER BY 1"""),
            "columns": rows("""
                SELECT c.relname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod),
                       a.attnotnull, a.attidentity::text,
                       pg_get_expr(d.adbin, d.adrelid)
                FROM pg_attribute a
                JOIN pg_class c ON c.oid = a.attrelid
                JOIN pg_namespace n ON n.oid = c.relnamespace
                LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
                WHERE n.nspname = %(schema)s AND c.relkind = 'r' AND a.attnum > 0
                  AND NOT a.attisdropped AND c.relname <> ALL(%(skip)s)
                ORDER BY 1, 2"""),
            "indexes": rows("""
                SELECT indexname, indexdef FROM pg_indexes
                WHERE schemaname = %(schema)s AND tablename <> ALL(%(skip)s) ORDER BY 1"""),
            "constraints": rows("""
                SELECT c.relname, k.conname, k.contype::text, pg_get_constraintdef(k.oid)
                FROM pg_constraint k
                JOIN pg_class c ON c.oid = k.conrelid
                JOIN pg_namespace n ON n.oid = c.relnamespace
                WHERE n.nspname = %(schema)s AND c.relname <> ALL(%(skip)s) ORDER BY 1, 2"""),
            "triggers": rows("""
                SELECT t.tgname, pg_get_triggerdef(t.oid), t.tgenabled::text
                FROM pg_trigger t
                JOIN pg_class c ON c.oid = t.tgrelid
                JOIN pg_namespace n ON n.oid = c.relnamespace
                WHERE n.nspname = %(schema)s AND NOT t.tgisinternal ORDER BY 1"""),
            "domains": rows("""
                SELECT t.typname, format_type(t.typbasetype, t.typtypmod), k.conname,
                       pg_get_constraintdef(k.oid), k.convalidated
                FROM pg_type t
                JOIN pg_namespace n ON n.oid = t.typnamespace
                LEFT JOIN pg_constraint k ON k.contypid = t.oid
                WHERE n.nspname = %(schema)s AND t.typtype = 'd' ORDER BY 1, 3"""),
            "functions": rows("""
                SELECT p.proname, pg_get_functiondef(p.oid) FROM pg_proc p
                JOIN pg_namespace n ON n.oid = p.pronamespace
                WHERE n.nspname = %(schema)s ORDER BY 1"""),
        }
    pattern = re.compile(rf'(?<![\w"])"?{re.escape(schema)}"?\.')
    return {key: [tuple(pattern.sub("SCHEMA.", v) if isinstance(v, str) else v for v in row)
                  for row in value] for key, value in found.items()}


def run_script(url: str, script: str) -> None:
    """Run a SQL script the way psql does (psql itself when installed)."""
    psql = shutil.which("psql")
    if psql:
        subprocess.run([psql, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", url, "-f", "-"],
                       input=script, text=True, check=True, capture_output=True)
        return
    # Simple query protocol: one string, many statements, like psql sends a file.
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(script.encode())


# ----------------------------------------------------------------- migrator

def test_migrate_applies_every_migration_once(empty_db: str) -> None:
    with psycopg.connect(empty_db, autocommit=True) as conn:
        applied = Migrator().apply(conn)
    assert [m.version for m in applied] == list(range(1, latest_version() + 1))
    assert _applied(empty_db) == [(m.version, m.name) for m in load_migrations()]


def test_second_migrate_applies_nothing(empty_db: str) -> None:
    with psycopg.connect(empty_db, autocommit=True) as conn:
        Migrator().apply(conn)
        assert Migrator().apply(conn) == []
    assert len(_applied(empty_db)) == latest_version()


def test_applied_versions_of_unmigrated_database_is_empty(empty_db: str) -> None:
    with psycopg.connect(empty_db, autocommit=True) as conn:
        assert Migrator().applied_versions(conn) == []
        assert [m.version for m in Migrator().pending(conn)] == [
            m.version for m in load_migrations()]


def test_pending_is_empty_after_migrate(fresh_db: str) -> None:
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        assert Migrator().pending(conn) == []
        assert Migrator().applied_versions(conn) == list(range(1, latest_version() + 1))


def test_migrate_with_no_transaction_open_commits_on_its_own(empty_db: str) -> None:
    with psycopg.connect(empty_db) as conn:  # not autocommit, but idle
        Migrator().apply(conn)
        conn.rollback()
    assert len(_applied(empty_db)) == latest_version()


def test_migrate_joining_open_transaction_is_undone_by_rollback(empty_db: str) -> None:
    plain = [m for m in load_migrations() if not m.stepped]
    assert len(plain) >= 24
    with psycopg.connect(empty_db) as conn:
        conn.execute("SELECT 1")  # the caller's transaction is open: apply() nests in it
        assert len(Migrator(migrations=plain[:24]).apply(conn)) == 24
        conn.rollback()
        assert Migrator().applied_versions(conn) == []
        # 0025 commits step by step: inside the caller's transaction it is
        # refused before anything is applied.
        conn.execute("SELECT 1")
        with pytest.raises(MigrationError, match="migration 25 runs in steps, each committed on "
                                                 "its own; apply it on a connection with no "
                                                 "transaction open"):
            Migrator().apply(conn)
        conn.rollback()
        assert Migrator().applied_versions(conn) == []


async def test_async_migrate_applies_once_then_nothing(empty_db: str) -> None:
    async with await psycopg.AsyncConnection.connect(empty_db, autocommit=True) as aconn:
        first = await AsyncMigrator().apply(aconn)
        second = await AsyncMigrator().apply(aconn)
        assert await AsyncMigrator().applied_versions(aconn) == [m.version for m in first]
        assert await AsyncMigrator().pending(aconn) == []
    assert len(first) == latest_version() and second == []


def _migrate_after_barrier(url: str, barrier: Any, results: Any) -> None:
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            barrier.wait(timeout=30)
            results.put(("ok", [m.version for m in Migrator().apply(conn)]))
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the parent
        results.put(("error", repr(exc)))


@pytest.mark.slow
def test_twenty_processes_migrating_at_once_apply_exactly_once(empty_db: str) -> None:
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(20)
    results = ctx.Queue()
    procs = [ctx.Process(target=_migrate_after_barrier, args=(empty_db, barrier, results))
             for _ in range(20)]
    for p in procs:
        p.start()
    outcomes = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert [o for o in outcomes if o[0] != "ok"] == []
    # Each migration applied by exactly one of them: the plain ones together
    # by the first, a stepped one (0025) by whichever ran its last step.
    applied = sorted(v for o in outcomes for v in o[1])
    assert applied == list(range(1, latest_version() + 1))
    assert sum(1 for o in outcomes if o[1]) <= 2
    assert _applied(empty_db) == [(m.version, m.name) for m in load_migrations()]


def test_database_with_newer_migration_raises_migration_error(fresh_db: str) -> None:
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute("INSERT INTO conveyor.migrations (version, name) VALUES (999, 'future')")
        with pytest.raises(MigrationError, match="migration 999, newer than"):
            Migrator().apply(conn)


def test_pending_with_newer_migration_raises_migration_error(fresh_db: str) -> None:
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute("INSERT INTO conveyor.migrations (version, name) VALUES (999, 'future')")
        with pytest.raises(MigrationError, match="999"):
            Migrator().pending(conn)


def test_require_current_passes_only_at_this_conveyors_migration(empty_db: str) -> None:
    with psycopg.connect(empty_db, autocommit=True) as conn:
        with pytest.raises(MigrationError, match="is not migrated; run 'conveyor migrate' first"):
            Migrator().require_current(conn)
        Migrator().apply(conn)
        Migrator().require_current(conn)
        conn.execute("DELETE FROM conveyor.migrations WHERE version = %s", (latest_version(),))
        conn.execute("DELETE FROM conveyor.migration_steps WHERE version = %s",
                     (latest_version(),))
        with pytest.raises(MigrationError, match=f"at migration {latest_version() - 1}, this "
                                                 f"Conveyor needs {latest_version()}; run"):
            Migrator().require_current(conn)
        conn.execute("INSERT INTO conveyor.migrations (version, name) VALUES (%s, 'x'), "
                     "(999, 'future')", (latest_version(),))
        with pytest.raises(MigrationError, match=r"at migration 999, newer than this Conveyor "
                                                 r"knows .*; upgrade Conveyor"):
            Migrator().require_current(conn)


async def test_async_require_current_says_the_same(empty_db: str) -> None:
    async with await psycopg.AsyncConnection.connect(empty_db, autocommit=True) as conn:
        with pytest.raises(MigrationError, match="is not migrated"):
            await AsyncMigrator().require_current(conn)
        await AsyncMigrator().apply(conn)
        await AsyncMigrator().require_current(conn)


def test_failing_migration_is_wrapped_and_rolled_back(empty_db: str) -> None:
    with psycopg.connect(empty_db, autocommit=True) as conn:
        # A table in the way makes CREATE TABLE events fail halfway through 0001.
        conn.execute("CREATE SCHEMA conveyor; CREATE TABLE conveyor.events (x int)")
        with pytest.raises(MigrationError, match="migrating schema 'conveyor' failed") as info:
            Migrator().apply(conn)
        assert isinstance(info.value.__cause__, psycopg.Error)
        assert Migrator().applied_versions(conn) == []


# ---------------------------------------------------------------- schemas

def test_custom_schema_holds_its_own_tables_and_works(empty_db: str) -> None:
    with psycopg.connect(empty_db) as conn:
        Migrator("app_queue").apply(conn)
        event_id = Producer(ProducerConfig(schema="app_queue")).enqueue(conn, "x")
        conn.commit()
        assert conn.execute("SELECT id FROM app_queue.events").fetchall() == [(event_id,)]
        assert conn.execute("SELECT to_regclass('conveyor.events')").fetchone() == (None,)


def test_two_schemas_in_one_database_are_migrated_independently(empty_db: str) -> None:
    with psycopg.connect(empty_db, autocommit=True) as conn:
        assert len(Migrator("one").apply(conn)) == latest_version()
        assert len(Migrator("two").apply(conn)) == latest_version()
    assert catalog(empty_db, "one") == catalog(empty_db, "two")


@pytest.mark.parametrize("schema", MALICIOUS)
def test_malicious_schema_name_is_refused_by_migrator(schema: str) -> None:
    with pytest.raises(InvalidInputError, match="invalid schema name"):
        Migrator(schema)


@pytest.mark.parametrize("schema", MALICIOUS)
def test_malicious_schema_name_is_refused_by_async_migrator(schema: str) -> None:
    with pytest.raises(InvalidInputError):
        AsyncMigrator(schema)


@pytest.mark.parametrize("schema", MALICIOUS)
def test_malicious_schema_name_is_refused_by_migration_script(schema: str) -> None:
    with pytest.raises(InvalidInputError):
        migration_script(schema)


@pytest.mark.parametrize("config", [ProducerConfig, WorkerConfig])
@pytest.mark.parametrize("schema", MALICIOUS)
def test_malicious_schema_name_is_refused_by_config(config: Any, schema: str) -> None:
    with pytest.raises(ConfigError, match="invalid schema name"):
        config(schema=schema)


def test_malicious_schema_name_is_refused_by_named_queries() -> None:
    with pytest.raises(InvalidInputError):
        queries_for('x"; DROP TABLE conveyor.events; --')


def test_refused_schema_name_runs_no_sql(empty_db: str) -> None:
    with psycopg.connect(empty_db) as conn:
        with pytest.raises(InvalidInputError):
            Migrator("x; drop table").apply(conn)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_cli_refuses_malicious_schema_with_one_line_error() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "conveyor.cli.main", "--schema", "x; drop table", "migrate",
         "--sql"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.startswith("conveyor: error: invalid schema name")
    assert len(done.stderr.strip().splitlines()) == 1


# ------------------------------------------------------ script and snapshot

def test_migration_script_yields_the_migrator_catalog(empty_db: str, fresh_db: str) -> None:
    run_script(empty_db, migration_script("conveyor"))
    assert catalog(empty_db, "conveyor") == catalog(fresh_db, "conveyor")


def test_migration_script_records_versions(empty_db: str) -> None:
    run_script(empty_db, migration_script("conveyor"))
    assert _applied(empty_db) == [(m.version, m.name) for m in load_migrations()]
    with psycopg.connect(empty_db, autocommit=True) as conn:
        assert Migrator().apply(conn) == []


def test_migration_script_for_custom_schema_matches_migrator(empty_db: str) -> None:
    run_script(empty_db, migration_script("billing_q"))
    with psycopg.connect(empty_db, autocommit=True) as conn:
        Migrator("ref_q").apply(conn)
    assert catalog(empty_db, "billing_q") == catalog(empty_db, "ref_q")


def test_cli_migrate_sql_prints_the_migration_script() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "conveyor.cli.main", "--schema", "app_q", "migrate", "--sql"],
        capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout == migration_script("app_q")


def test_cli_migrate_sql_output_applies_to_an_empty_database(
    empty_db: str, fresh_db: str,
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "conveyor.cli.main", "migrate", "--sql"],
        capture_output=True, text=True, timeout=60, check=True)
    run_script(empty_db, done.stdout)
    assert catalog(empty_db, "conveyor") == catalog(fresh_db, "conveyor")


def test_schema_snapshot_matches_migrations(empty_db: str, fresh_db: str) -> None:
    snapshot = (resources.files("conveyor.schema") / "schema.sql").read_text("utf-8")
    run_script(empty_db, snapshot)
    expected = catalog(fresh_db, "conveyor", include_version_table=False)
    assert catalog(empty_db, "conveyor") == expected
    # Guard against an empty comparison passing vacuously.
    assert {"events", "workers"} <= {r[0] for r in expected["relations"]}
    assert len(expected["indexes"]) >= 6 and len(expected["domains"]) >= 4


def test_reserved_pg_schema_name_is_refused_before_any_sql(empty_db: str) -> None:
    # PostgreSQL reserves pg_*; the name is refused by validation, so no
    # statement ever reaches the server.
    with pytest.raises(InvalidInputError, match="pg_queue"):
        Migrator("pg_queue")
    with psycopg.connect(empty_db, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = 'pg_queue'").fetchone()
        assert row == (0,)


def test_migration_script_on_migrated_database_is_a_no_op(fresh_db: str) -> None:
    run_script(fresh_db, migration_script("conveyor"))
    assert _applied(fresh_db) == [(m.version, m.name) for m in load_migrations()]


def test_migration_script_inside_a_host_transaction_is_undone_by_its_rollback(
    empty_db: str,
) -> None:
    with psycopg.connect(empty_db) as conn:
        conn.execute("SELECT 1")  # the host tool's transaction is open
        conn.execute(migration_script("conveyor").encode())
        conn.rollback()
    with psycopg.connect(empty_db) as conn:
        assert Migrator().applied_versions(conn) == []


def test_migrate_on_a_dict_row_connection_applies_nothing_twice(fresh_db: str) -> None:
    from psycopg.rows import dict_row

    with psycopg.connect(fresh_db, autocommit=True, row_factory=dict_row) as conn:
        assert Migrator().apply(conn) == []
        assert Migrator().applied_versions(conn) == [m.version for m in load_migrations()]


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "conveyor.cli.main", *args],
                          capture_output=True, text=True, timeout=60)


def test_sql_from_to_prints_one_release_at_a_time_and_adds_up_to_the_whole(
        empty_db: str, fresh_db: str) -> None:
    """The Alembic route: one revision per Conveyor release, each the migrations it brought."""
    latest = latest_version()
    first = _cli("migrate", "--sql", "--to", "7")
    rest = _cli("migrate", "--sql", "--from", "8", "--to", str(latest))
    assert first.returncode == 0 and rest.returncode == 0, (first.stderr, rest.stderr)
    assert "-- migration 0007_cheaper_writes" in first.stdout
    assert "-- migration 0008" not in first.stdout and "-- migration 0007" not in rest.stdout
    run_script(empty_db, first.stdout)
    check = _cli("--database-url", empty_db, "migrate", "--check")
    assert check.returncode == 1
    assert check.stderr.startswith("conveyor: schema 'conveyor' is behind: pending 0008_event_counts")
    run_script(empty_db, rest.stdout)
    assert catalog(empty_db, "conveyor") == catalog(fresh_db, "conveyor")
    current = _cli("--database-url", empty_db, "migrate", "--check", "--json")
    assert current.returncode == 0, current.stderr
    assert current.stdout == '{"schema": "conveyor", "current": true, "pending": []}\n'


@pytest.mark.parametrize(("args", "needle"), [
    (["migrate", "--sql", "--from", "9", "--to", "3"], "first migration (9) to be at most the last (3)"),
    (["migrate", "--sql", "--to", "999"], "expected last migration to be 1-"),
    (["migrate", "--from", "2"], "--from and --to choose what --sql prints; add --sql"),
    (["migrate", "--sql", "--check"], "--json and --check do not apply with --sql"),
])
def test_migrate_range_and_check_refuse_what_makes_no_sense(args: list[str], needle: str) -> None:
    done = _cli(*args)
    assert done.returncode in (1, 2) and needle in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and done.stdout == ""
