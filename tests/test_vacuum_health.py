"""The worker and ``conveyor status`` say when autovacuum does not look after the events table.

Newcomer review M5: a server with ``autovacuum = off`` made the overview 12x
slower and nothing said why. The table-level case runs against the real
server (``ALTER TABLE ... SET (autovacuum_enabled = false)`` on a database of
the test's own); the server-wide switch is never changed here.
"""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import UTC, datetime

import psycopg
import pytest

from conveyor import Router, Worker
from conveyor.cli.main import main
from conveyor.vacuum_health import NEVER_ANALYZED_DEAD_ROWS, vacuum_warnings, verdict
from worker_support import fast_config, running

TABLE = "conveyor.events_live"   # the partition with storage (0025)
ANALYZED = datetime(2026, 12, 1, tzinfo=UTC)


def test_a_table_autovacuum_looks_after_gives_no_warning() -> None:
    assert verdict(("on", None, 50_000, ANALYZED), TABLE) == []
    assert verdict(("on", ["fillfactor=90"], 5, None), TABLE) == []
    assert verdict(None, TABLE) == []


def test_autovacuum_off_on_the_server_or_the_table_is_named() -> None:
    [server] = verdict(("off", None, 0, ANALYZED), TABLE)
    assert server.action == "autovacuum_off"
    assert server.message.startswith("autovacuum is off on this PostgreSQL server")
    for spelled in ("false", "off", "0", "FALSE"):
        [table] = verdict(("on", [f"autovacuum_enabled={spelled}"], 0, ANALYZED), TABLE)
        assert table.message.startswith(f"autovacuum is off for {TABLE} "
                                        f"(autovacuum_enabled={spelled})")
        assert table.message.endswith(f"ALTER TABLE {TABLE} RESET (autovacuum_enabled)")
    assert verdict(("on", ["autovacuum_enabled=true"], 0, ANALYZED), TABLE) == []


def test_a_never_analyzed_table_with_many_dead_rows_is_named() -> None:
    [never] = verdict(("on", None, 412_000, None), TABLE)
    assert never.action == "never_analyzed"
    assert never.message.startswith(f"{TABLE} was never analyzed and holds 412,000 dead rows")
    assert verdict(("on", None, NEVER_ANALYZED_DEAD_ROWS - 1, None), TABLE) == []


def _table_warning(found: list[str]) -> list[str]:
    return [m for m in found if m.startswith(f"autovacuum is off for {TABLE}")]


async def test_the_worker_logs_and_status_shows_a_table_without_autovacuum(
        fresh_db: str, caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.INFO, logger="conveyor.worker")
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        assert _table_warning([w.message for w in vacuum_warnings(conn, "conveyor")]) == []
        conn.execute(f"ALTER TABLE {TABLE} SET (autovacuum_enabled = false)")
        assert len(_table_warning([w.message for w in vacuum_warnings(conn, "conveyor")])) == 1
    router = Router()
    router.add("a.b", lambda event: None)
    async with running(Worker(fresh_db, router, fast_config())):
        pass
    logged = [r for r in caplog.records if getattr(r, "action", None) == "autovacuum_off"]
    assert len(_table_warning([r.getMessage() for r in logged])) == 1
    assert all(r.levelno == logging.WARNING for r in logged)
    capsys.readouterr()
    assert await asyncio.to_thread(main, ["--database-url", fresh_db, "status"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len([line for line in lines
                if line.startswith(f"warning: autovacuum is off for {TABLE}")]) == 1
    assert await asyncio.to_thread(main, ["--database-url", fresh_db, "status", "--json"]) == 0
    warnings = json.loads(capsys.readouterr().out)["warnings"]
    assert len(_table_warning([w["message"] for w in warnings])) == 1
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute(f"ALTER TABLE {TABLE} RESET (autovacuum_enabled)")
        assert _table_warning([w.message for w in vacuum_warnings(conn, "conveyor")]) == []
