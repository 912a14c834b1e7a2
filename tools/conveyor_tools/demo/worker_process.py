"""Starting and stopping the demo's real worker process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

APP = "conveyor_tools.demo.app:router"
# Small delays so the retries of the demo happen within seconds: 0.5 s, 1 s, 2 s, 4 s.
WORKER_FLAGS = ["--concurrency", "10", "--backoff-base", "0.5", "--shutdown-timeout", "5"]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """On Linux, have the kernel send SIGTERM to the worker if the demo dies first."""
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class WorkerProcess:
    """``python -m conveyor.cli.main ... worker --app conveyor_tools.demo.app:router`` (or ``app``).

    The database URL goes through ``CONVEYOR_DATABASE_URL`` rather than the
    command line, so a password in it never shows in ``ps``.
    """

    def __init__(self, url: str, schema: str, log_path: Path, *, app: str = APP,
                 flags: list[str] | None = None, name: str = "demo-worker",
                 env: dict[str, str] | None = None) -> None:
        self.url = url
        self.schema = schema
        self.log_path = log_path
        self.app = app
        self.flags = WORKER_FLAGS if flags is None else flags
        self.name = name
        self.env = env or {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[Any] | None = None

    @property
    def argv(self) -> list[str]:
        return [sys.executable, "-m", "conveyor.cli.main", "--schema", self.schema,
                "worker", "--app", self.app, "--name", self.name, *self.flags]

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc else 0

    def start(self) -> None:
        env = dict(os.environ, **self.env, CONVEYOR_DATABASE_URL=self.url)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(
            self.argv, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)

    def exit_code(self) -> int | None:
        """``None`` while running."""
        return None if self._proc is None else self._proc.poll()

    def stop(self, timeout: float = 15.0) -> tuple[int, float]:
        """SIGTERM, wait for a graceful exit (SIGKILL after ``timeout``); (exit code, seconds)."""
        assert self._proc is not None
        started = time.monotonic()
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return self._proc.returncode, time.monotonic() - started

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])
