"""Running real ``conveyor`` processes and watching the database they work on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg

from waiting import wait_for

from .apps import LEDGER_ENV

REPO = Path(__file__).resolve().parents[2]
APP = "tests.acceptance.apps:router"


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a child: no stray CONVEYOR_* settings, the repo importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run_cli(*args: str, timeout: float = 60, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    """``python -m conveyor.cli.main ARGS`` to completion, output captured."""
    return subprocess.run([sys.executable, "-m", "conveyor.cli.main", *args], cwd=REPO,
                          env=env or cli_env(), capture_output=True, text=True, timeout=timeout)


class WorkerProcess:
    """One ``conveyor worker`` subprocess; its output goes to a log file."""

    def __init__(self, url: str, log_path: Path, *args: str, app: str = APP) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "conveyor.cli.main", "--database-url", url,
             "worker", "--app", app, *args],
            cwd=REPO, env=cli_env({LEDGER_ENV: url}), stdout=self._log,
            stderr=subprocess.STDOUT)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        """Kill the process if it still runs (teardown; never waits unbounded)."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL does not fail
            pass
        self._log.close()


def query(url: str, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True, application_name="acceptance-test") as conn:
        return conn.execute(sql.encode() if params is None else sql, params).fetchall()


def state_counts(url: str) -> dict[str, int]:
    return {s: n for s, n in query(url, "SELECT state, count(*) FROM conveyor.events GROUP BY 1")}


def ledger_counts(url: str) -> dict[int, int]:
    """Executions recorded per event id."""
    return {e: n for e, n in query(url, "SELECT event_id, count(*) FROM public.ledger GROUP BY 1")}


def drained(url: str, ids: list[int], alive: list[WorkerProcess], *,
            timeout: float = 60.0) -> dict[int, int]:
    """Wait until the events ``ids`` all succeeded, with nothing else in the table, and
    each ran; return the executions recorded per event id."""
    wait_for(lambda: state_counts(url).get("succeeded", 0) == len(ids), timeout,
             "every event to succeed", interval=0.25, alive=alive)
    assert state_counts(url) == {"succeeded": len(ids)}
    executions = ledger_counts(url)
    assert set(executions) == set(ids), "every event ran"
    return executions


def backends(url: str, application_name: str) -> list[tuple[int, str]]:
    """(pid, query) of the sessions of one application on this database."""
    return [(int(p), str(q)) for p, q in query(
        url, "SELECT pid, query FROM pg_stat_activity "
             "WHERE datname = current_database() AND application_name = %s",
        (application_name,))]


def listening(url: str, exclude: set[int] = frozenset()) -> int | None:  # type: ignore[assignment]
    """Pid of a worker's LISTEN session (one that has run LISTEN), if any: its last
    statement is the LISTEN, a ping, or the hold of the wake gate that follows
    the LISTEN when the worker holds it there (claim windows, a pooler)."""
    for pid, q in backends(url, "conveyor-listen"):
        if pid not in exclude and (q.upper().startswith(("LISTEN", "SELECT 1"))
                                   or "pg_try_advisory_lock_shared" in q):
            return pid
    return None
