"""``conveyor demo`` end to end: a real worker process on a fresh database."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psutil
import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from conveyor_tools.demo import chain
from conveyor_tools.demo.progress import Progress, Snapshot
from conveyor_tools.demo.shop import SCHEMA

pytestmark = pytest.mark.slow


def _env(url: str, chain_db: str | None = None) -> dict[str, str]:
    """The demo's environment: part two (the chain) only when ``chain_db`` names its database."""
    env = dict(os.environ, CONVEYOR_DATABASE_URL=url)
    if chain_db:
        env.update(CONVEYOR_DEMO_CHAIN="1", CONVEYOR_DEMO_CHAIN_DATABASE=chain_db)
    else:
        env["CONVEYOR_DEMO_CHAIN"] = "0"
    return env


def _run_demo(url: str, *args: str, chain_db: str | None = None) -> subprocess.CompletedProcess[str]:
    env = _env(url, chain_db)
    return subprocess.run(
        [sys.executable, "-m", "conveyor.cli.main", "demo", *args],
        env=env, capture_output=True, text=True, timeout=120)


def _events(url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(
            f"SELECT id, topic, state, attempts, max_attempts,"
            f" COALESCE(jsonb_array_length(errors), 0), "
            f"payload FROM {SCHEMA}.events ORDER BY id").fetchall()


def test_demo_parks_the_poison_event_and_finishes_the_rest(fresh_db: str) -> None:
    result = _run_demo(fresh_db, "--events", "40")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = _events(fresh_db)
    assert len(rows) == 40
    by_state: dict[str, list[tuple[Any, ...]]] = {}
    for row in rows:
        by_state.setdefault(row[2], []).append(row)
    (poison,) = by_state["failed"]
    assert poison[1] == "invoice.render"
    assert poison[3] == poison[4] == 5 and poison[5] == 5
    (delayed,) = by_state["pending"]
    assert delayed[1] == "order.review_request" and delayed[3] == 0
    assert len(by_state["succeeded"]) == 38
    assert set(by_state) == {"succeeded", "failed", "pending"}
    retried = [r for r in by_state["succeeded"] if r[3] > 1]
    assert {r[1] for r in retried} >= {"email.send", "invoice.render", "webhook.deliver"}
    assert all(r[5] == r[3] - 1 for r in retried)  # one error kept per failed attempt

    out = result.stdout
    assert "\x1b[" not in out  # not a terminal: plain lines only
    # The delayed review request is scheduled (not yet due), not pending.
    assert ("events: pending 0  scheduled 1  running 0  succeeded 38  failed 1  cancelled 0"
            in out)
    assert out.count("KeyError: 'currency'") >= 5
    assert "exit code 0" in out


def test_demo_reruns_start_clean(fresh_db: str) -> None:
    assert _run_demo(fresh_db, "--events", "20").returncode == 0
    second = _run_demo(fresh_db, "--events", "20")
    assert second.returncode == 0, second.stdout + second.stderr
    assert len(_events(fresh_db)) == 20


def test_demo_refuses_too_few_events(fresh_db: str) -> None:
    result = _run_demo(fresh_db, "--events", "3")
    assert result.returncode == 1
    assert "at least 20 events" in result.stderr
    assert "Traceback" not in result.stderr


def _snapshot() -> Snapshot:
    return Snapshot(by_topic={"email.send": {"pending": 2, "succeeded": 3},
                              "order.created": {"running": 1}}, failed_attempts=4)


def test_progress_prints_plain_lines_when_not_a_terminal() -> None:
    out = io.StringIO()
    progress = Progress(out, expected=6)
    assert not progress.live
    progress.update(_snapshot(), 0.0)
    progress.update(_snapshot(), 0.5)  # under a second later: skipped
    progress.update(_snapshot(), 1.2)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert "pending 2  running 1  succeeded 3  failed 0" in lines[0]
    assert "\x1b" not in out.getvalue()


def test_progress_redraws_in_place_on_a_terminal() -> None:
    out = io.StringIO()
    progress = Progress(out, expected=6, live=True)
    progress.update(_snapshot(), 0.0)
    first = out.getvalue()
    progress.update(_snapshot(), 0.2)
    progress.close()
    redraw = out.getvalue()[len(first):]
    assert redraw.startswith("\x1b[?25l\x1b[")  # cursor hidden, moved back up
    assert f"\x1b[{first.count(chr(10))}F" in redraw
    assert "3/6 finished" in redraw
    assert out.getvalue().endswith("\x1b[?25h")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_demo_stops_its_worker(fresh_db: str, signum: int) -> None:
    env = _env(fresh_db)
    # Started as from a script's background job, with SIGINT ignored (the shell's
    # `trap "" INT` survives the exec): the demo must still stop on it.
    proc = subprocess.Popen(
        ["bash", "-c", 'trap "" INT; exec "$@"', "demo",
         sys.executable, "-m", "conveyor.cli.main", "demo", "--events", "40"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    worker_pid = 0
    for line in proc.stdout:
        match = re.search(r"worker pid (\d+) started", line)
        if match:
            worker_pid = int(match[1])
            break
    assert worker_pid
    proc.send_signal(signum)
    proc.communicate(timeout=30)
    assert proc.returncode == 130

    def worker_gone() -> bool:
        try:
            return psutil.Process(worker_pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    # The worker may still be finishing its graceful stop when the demo exits.
    deadline = time.monotonic() + 15
    while not worker_gone() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert worker_gone()


# ------------------------------------------------------------------ part two: the chain


@pytest.fixture
def chain_db(server_url: str) -> Iterator[str]:
    """A name for the chain's database (the demo creates it); dropped afterwards."""
    name = f"conveyor_demo_chain_{uuid.uuid4().hex[:10]}"
    yield name
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'.encode())


def test_demo_chain_runs_the_example_engine_end_to_end(fresh_db: str, chain_db: str) -> None:
    # Twice: the second run starts from a recreated database.
    first = _run_demo(fresh_db, "--events", "20", chain_db=chain_db)
    assert first.returncode == 0, first.stdout + first.stderr
    result = _run_demo(fresh_db, "--events", "20", chain_db=chain_db)
    assert result.returncode == 0, result.stdout + result.stderr

    url = make_conninfo(fresh_db, dbname=chain_db)
    with psycopg.connect(url) as conn:
        jobs = conn.execute("SELECT file, status, result, error FROM engine.filejobs "
                            "ORDER BY id").fetchall()
        tasks = conn.execute("SELECT status FROM engine.tasks").fetchall()
        events = conn.execute("SELECT topic, state, attempts FROM conveyor.events "
                              "ORDER BY id").fetchall()
    assert [(j[0], j[1]) for j in jobs] == [
        ("sales-january.xlsx", "done"), ("sales-february.xlsx", "done"),
        ("no-amount.xlsx", "failed"), ("truncated.xlsx", "failed")]
    assert jobs[0][2]["rows"] == 60 and jobs[1][2]["rows"] == 45
    assert set(jobs[0][2]["by_type"]) == {"tienda", "online", "mayorista"}
    assert "monto" in jobs[2][3] and "zip" in jobs[3][3]
    assert tasks == [("done",)]
    assert len(events) == 8  # 4 file jobs, 1 task, 3 mails: nothing left from the first run
    assert [e[1] for e in events if e[1] != "succeeded"] == ["failed"]
    (refused,) = [e for e in events if e[1] == "failed"]
    assert refused[0] == "email.send" and refused[2] == 1  # bad input: no retries

    out = result.stdout
    assert "Part 2: the whole chain" in out
    assert out.count("(matches what was written)") == 2
    assert "header row 1 lacks required column(s): monto" in out
    assert "task 1 'Call the supplier about March': done" in out
    assert "mails received by the SMTP sink (2):" in out
    assert "Subject: Welcome to Acme, Ana" in out
    assert "Subject: Confirm your email address" in out
    assert len(re.findall(r"Message-ID: <conveyor\.acme\.\d+@acme\.app\.test>", out)) == 2
    assert "| Sign in here: https://acme.app.test/login" in out
    assert "recipient contains control characters (CR/LF)" in out
    assert "exited gracefully (exit code 0)" in out
    assert "\x1b[" not in out
    assert re.search(r"finished in \d+\.\ds", out)


def test_interrupted_chain_stops_engine_and_worker(fresh_db: str, chain_db: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "conveyor.cli.main", "demo", "--events", "20"],
        env=_env(fresh_db, chain_db), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    pids: list[int] = []
    for line in proc.stdout:
        match = re.search(r"(?:engine|worker) pid (\d+)", line)
        if match:
            pids.append(int(match[1]))
        if line.startswith("  engine pid"):
            break
    assert len(pids) == 2  # the shop's worker (already stopped) and the engine
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=30)
    assert proc.returncode == 130, output
    for pid in pids:
        try:
            assert psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            pass


def test_chain_is_skipped_with_a_note_without_its_packages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chain, "NEEDED_MODULES", ("conveyor_no_such_module",))
    out = io.StringIO()
    assert chain.run_chain("postgresql://nowhere.invalid/x", out) == 0
    assert out.getvalue().strip() == (
        "Part 2 (the example engine chain) skipped: conveyor_no_such_module not installed; "
        "install the demo extra (pip install -e '.[demo]', as scripts/demo.sh does).")
