"""Typed tasks: calls checked at enqueue, run by a worker with their arguments, and by mypy."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from conveyor import EventState, InvalidInputError, Producer, Router
from conveyor.testing import work_event, work_event_async

REPO = Path(__file__).resolve().parents[1]
calls: list[tuple[str, Any, ...]] = []
router = Router()


@router.task("mail.send")
async def send_mail(to: str, subject: str, *, urgent: bool = False) -> None:
    calls.append(("send_mail", to, subject, urgent))


@router.task("report.build", timeout=5)
def build_report(year: int, month: int) -> str:
    calls.append(("build_report", year, month))
    return f"{year}-{month:02d}"


@pytest.fixture(autouse=True)
def _fresh_calls() -> None:
    calls.clear()


def test_a_call_is_enqueued_as_its_arguments_and_run_with_them(conn: psycopg.Connection[Any]) -> None:
    event_id = send_mail.enqueue(conn, "ada@example.com", "Welcome", urgent=True)
    row = conn.execute("SELECT topic, payload FROM conveyor.events WHERE id = %s", (event_id,)).fetchone()
    assert row == ("mail.send", {"args": ["ada@example.com", "Welcome"], "kwargs": {"urgent": True}})
    worked = work_event(conn, router)
    assert worked is not None and worked.record.state is EventState.SUCCEEDED
    assert calls == [("send_mail", "ada@example.com", "Welcome", True)]


def test_a_plain_function_task_runs_too_and_calling_the_task_calls_the_function(
        conn: psycopg.Connection[Any]) -> None:
    assert build_report(2026, 11) == "2026-11"
    build_report.enqueue(conn, 2026, month=12)
    worked = work_event(conn, router)
    assert worked is not None and worked.record.state is EventState.SUCCEEDED
    assert calls == [("build_report", 2026, 11), ("build_report", 2026, 12)]


async def test_aenqueue_on_an_async_connection(aconn: psycopg.AsyncConnection[Any]) -> None:
    await send_mail.aenqueue(aconn, "bob@example.com", "Hi")
    worked = await work_event_async(aconn, router)
    assert worked is not None and worked.record.state is EventState.SUCCEEDED
    assert calls == [("send_mail", "bob@example.com", "Hi", False)]


def test_using_sets_the_enqueue_options(conn: psycopg.Connection[Any]) -> None:
    at = datetime.now(UTC) + timedelta(days=1)
    later = send_mail.using(run_at=at, tenant="acme", priority=3)
    event_id = later.enqueue(conn, "c@example.com", "Tomorrow")
    row = conn.execute("SELECT run_at, tenant, priority FROM conveyor.events WHERE id = %s",
                       (event_id,)).fetchone()
    assert row == (at, "acme", 3)
    assert send_mail.options == {}          # the original task is unchanged
    assert work_event(conn, router) is None  # not due yet


@pytest.mark.parametrize(("call", "message"), [
    (lambda c: send_mail.enqueue(c, "only-one-argument"),  # type: ignore[call-arg]
     "task 'mail.send' (send_mail): missing a required argument: 'subject'"),
    (lambda c: send_mail.enqueue(c, "a", "b", loud=True),  # type: ignore[call-arg]
     "got an unexpected keyword argument 'loud'"),
    (lambda c: build_report.enqueue(c, 2026, {1, 2}),  # type: ignore[arg-type]
     "not JSON"),
])
def test_a_wrong_call_is_refused_before_anything_is_written(
        conn: psycopg.Connection[Any], call: Any, message: str) -> None:
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        call(conn)
    assert conn.execute("SELECT count(*) FROM conveyor.events").fetchone() == (0,)


def test_an_event_that_holds_no_call_fails_for_good(conn: psycopg.Connection[Any]) -> None:
    Producer().enqueue(conn, "mail.send", {"to": "hand-written"})
    Producer().enqueue(conn, "report.build", {"args": [2026], "kwargs": {}})
    first, second = work_event(conn, router), work_event(conn, router)
    assert first is not None and first.record.state is EventState.FAILED
    assert first.record.last_error is not None and "does not hold a call" in first.record.last_error
    assert second is not None and second.record.state is EventState.FAILED
    assert second.record.last_error is not None
    assert "missing a required argument: 'month'" in second.record.last_error
    assert calls == []


def test_mypy_checks_every_call_against_the_function(tmp_path: Path) -> None:
    checked = tmp_path / "calls.py"
    checked.write_text(textwrap.dedent("""
        from typing import Any
        import psycopg
        from conveyor import Router

        router = Router()

        @router.task("mail.send")
        async def send_mail(to: str, subject: str, *, urgent: bool = False) -> None: ...

        def use(conn: psycopg.Connection[Any]) -> None:
            send_mail.enqueue(conn, "a@example.com", "ok", urgent=True)
            send_mail.enqueue(conn, "a@example.com")
            send_mail.enqueue(conn, 42, "subject")
            send_mail.using(delay=60).enqueue(conn, "a@example.com", "x", urgent="yes")
    """))
    done = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--no-incremental",
                           "--config-file", "/dev/null", str(checked)],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={"MYPYPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"})
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert [int(line.split(":")[1]) for line in errors] == [13, 14, 15], done.stdout
    assert 'Missing positional argument "subject"' in errors[0]
    assert 'Argument 2 to "enqueue" of "Task" has incompatible type "int"' in errors[1]
    assert 'Argument "urgent" to "enqueue" of "Task" has incompatible type "str"' in errors[2]
