"""A SIGTERM at any moment of a worker's life ends in exit 0 with nothing left running.

Before, a signal during start-up (importing the app, connecting) killed the
process by the signal: the loop's handlers were not installed yet.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from .helpers import REPO, cli_env

pytestmark = pytest.mark.slow


def _spawn(url: str, app: str, log: Path, extra_env: dict[str, str] | None = None
           ) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "conveyor.cli.main", "--database-url", url, "worker",
         "--app", app, "--shutdown-timeout", "5"],
        cwd=REPO, env=cli_env(extra_env), stdout=log.open("w"), stderr=subprocess.STDOUT)


def _catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM (its SigCgt mask in /proc)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    caught = int(next(line for line in status.splitlines()
                      if line.startswith("SigCgt:")).split()[1], 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def _wait_catching(proc: subprocess.Popen[bytes], timeout: float = 20) -> float:
    start = time.monotonic()
    while not _catches_sigterm(proc.pid):
        assert proc.poll() is None, "the worker exited before it caught SIGTERM"
        assert time.monotonic() - start < timeout, "the worker never installed a SIGTERM handler"
        time.sleep(0.005)
    return time.monotonic() - start


def _running_events(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM conveyor.events WHERE state = 'running'").fetchone()
        assert row is not None
        return int(row[0])


def test_sigterm_while_the_app_is_imported_exits_0(fresh_db: str, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    proc = _spawn(fresh_db, "tests.acceptance.startup_apps:slow_import_router",
                  tmp_path / "log", {"CONVEYOR_TEST_IMPORT_MARKER": str(marker)})
    deadline = time.monotonic() + 20
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=20)
    assert code == 0, (tmp_path / "log").read_text()
    assert "stopped before the worker started" in (tmp_path / "log").read_text()


def test_sigterm_while_the_database_is_unreachable_exits_0(tmp_path: Path) -> None:
    # Port 9 (discard) on loopback: nothing listens, the worker keeps reconnecting.
    proc = _spawn("postgresql://root@127.0.0.1:9/nothing?connect_timeout=2",
                  "tests.acceptance.startup_apps:router", tmp_path / "log")
    _wait_catching(proc)
    time.sleep(1.5)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0, (tmp_path / "log").read_text()


def test_sigterm_at_random_moments_of_start_up_and_work_always_exits_0(
        fresh_db: str, tmp_path: Path) -> None:
    rng = random.Random(20261201)
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute("INSERT INTO conveyor.events (topic, payload) "
                     "SELECT 'startup.' || g, '{}' FROM generate_series(1, 200) g")
    for round_no in range(8):
        log = tmp_path / f"log{round_no}"
        proc = _spawn(fresh_db, "tests.acceptance.startup_apps:router", log)
        _wait_catching(proc)
        # From the first moment it catches SIGTERM to well into its work.
        time.sleep(rng.uniform(0, 1.5) if round_no else 0)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=30)
        assert code == 0, f"round {round_no}: exit {code}\n{log.read_text()}"
        assert _running_events(fresh_db) == 0, f"round {round_no}: events left running"


def test_worker_multi_sigterm_while_the_app_is_imported_exits_0(
        fresh_db: str, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    log = tmp_path / "log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "conveyor.cli.main", "worker-multi", "--dsn", f"acme={fresh_db}",
         "--app", "tests.acceptance.startup_apps:slow_import_router"],
        cwd=REPO, env=cli_env({"CONVEYOR_TEST_IMPORT_MARKER": str(marker)}),
        stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 20
    while not marker.exists():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0, log.read_text()
