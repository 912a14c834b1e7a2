"""``conveyor demo`` end to end: a real worker process on a fresh database."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

import psutil
import psycopg
import pytest

from conveyor.demo.progress import Progress, Snapshot
from conveyor.demo.shop import SCHEMA

pytestmark = pytest.mark.slow


def _run_demo(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CONVEYOR_DATABASE_URL=url)
    return subprocess.run(
        [sys.executable, "-m", "conveyor.cli.main", "demo", *args],
        env=env, capture_output=True, text=True, timeout=120)


def _events(url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(
            f"SELECT id, topic, state, attempts, max_attempts, jsonb_array_length(errors), "
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
    assert "events: pending 1  running 0  succeeded 38  failed 1  cancelled 0" in out
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
    env = dict(os.environ, CONVEYOR_DATABASE_URL=fresh_db)
    proc = subprocess.Popen(
        [sys.executable, "-m", "conveyor.cli.main", "demo", "--events", "40"],
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
