"""Worker processes of the benchmark: started, watched, measured, always stopped.

The Conveyor worker runs as the real ``conveyor worker`` command (through
``python -m conveyor.cli.main``), so its peak RSS is that of a production
worker process and nothing of the benchmark's own. Children get a clean
environment: every ``CONVEYOR_*`` variable of the caller is removed (a stray
``CONVEYOR_BATCH_SIZE`` would silently change "defaults"), and the database
URL travels in the environment, not on the command line where ``ps`` shows it.

Every process goes through a :class:`ProcessRegistry`, whose ``stop_all`` in
the benchmark's ``finally`` guarantees no worker outlives the run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import IO, Any

import psycopg
from psycopg import sql

from conveyor.bench.app import WAKE_FD_ENV
from conveyor.bench.baseline import URL_ENV
from conveyor.bench.scratch import BenchError

APP = "conveyor.bench.app:router"
STOP_TIMEOUT = 30.0
# Run as a script, not with -m: importing the conveyor package would inflate its RSS.
BASELINE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "baseline.py")


def peak_rss_mb(pid: int) -> float:
    """``VmHWM`` (peak resident set) of a live process, in MiB."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except FileNotFoundError:
        pass
    import psutil  # not Linux: the current RSS is the best available stand-in

    return float(psutil.Process(pid).memory_info().rss) / (1024 * 1024)


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env.update(extra)
    return env


class WorkerProcess:
    """One ``conveyor worker`` process serving :mod:`conveyor.bench.app`.

    ``batch_size``/``concurrency`` left as ``None`` keep the command's defaults
    (``WorkerConfig()``'s). ``launcher`` replaces ``-m conveyor.cli.main``,
    e.g. with ``-m cProfile -o out.prof -m conveyor.cli.main`` for profiling.
    """

    def __init__(self, url: str, schema: str, *, batch_size: int | None = None,
                 concurrency: int | None = None, wake_fd: int | None = None,
                 launcher: Sequence[str] = ("-m", "conveyor.cli.main")) -> None:
        self.url = url
        self.schema = schema
        self.batch_size = batch_size
        self.concurrency = concurrency
        self.wake_fd = wake_fd
        self.launcher = list(launcher)
        self.proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None

    def command(self) -> list[str]:
        cmd = [sys.executable, *self.launcher, "--schema", self.schema,
               "--log-level", "warning", "worker", "--app", APP]
        if self.batch_size is not None:
            cmd += ["--batch-size", str(self.batch_size)]
        if self.concurrency is not None:
            cmd += ["--concurrency", str(self.concurrency)]
        return cmd

    def start(self) -> None:
        extra = {"CONVEYOR_DATABASE_URL": self.url}
        fds: tuple[int, ...] = ()
        if self.wake_fd is not None:
            extra[WAKE_FD_ENV] = str(self.wake_fd)
            fds = (self.wake_fd,)
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the child
        self.proc = subprocess.Popen(self.command(), env=child_env(**extra), pass_fds=fds,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=self._stderr)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stderr_tail(self, lines: int = 15) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        text = self._stderr.read().decode("utf-8", "replace")
        return "\n".join(text.strip().splitlines()[-lines:])

    def check_alive(self) -> None:
        assert self.proc is not None
        code = self.proc.poll()
        if code is not None:
            raise BenchError(f"worker process exited early with code {code}:\n"
                             + self.stderr_tail())

    def peak_rss_mb(self) -> float:
        return peak_rss_mb(self.pid)

    def wait_registered(self, conn: psycopg.Connection[Any], timeout: float = 30.0) -> None:
        """Wait until the worker has written its row in the registry."""
        query = sql.SQL("SELECT 1 FROM {} WHERE pid = %s").format(
            sql.Identifier(self.schema, "workers"))
        deadline = time.monotonic() + timeout
        while conn.execute(query, (self.pid,)).fetchone() is None:
            self.check_alive()
            if time.monotonic() > deadline:
                raise BenchError(f"worker did not register within {timeout:.0f}s")
            time.sleep(0.02)

    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM (graceful), then SIGKILL after ``timeout``; returns the exit code."""
        proc = self.proc
        if proc is None:
            return 0
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._stderr is not None and proc.returncode != 0:
            sys.stderr.write(self.stderr_tail() + "\n")
        return proc.returncode

    def close(self) -> None:
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None


class ProcessRegistry:
    """Tracks every child so ``stop_all`` can end them, whatever went wrong."""

    def __init__(self) -> None:
        self._workers: list[WorkerProcess] = []

    def worker(self, *args: Any, **kwargs: Any) -> WorkerProcess:
        worker = WorkerProcess(*args, **kwargs)
        self._workers.append(worker)
        return worker

    def stop_all(self) -> None:
        for worker in self._workers:
            try:
                worker.stop(timeout=10.0)
            finally:
                worker.close()
        self._workers.clear()


def run_raw_drainer(url: str, schema: str, batch: int, timeout: float) -> dict[str, Any]:
    """Run the baseline drain loop in its own process; returns its JSON report."""
    try:
        done = subprocess.run(
            [sys.executable, BASELINE_SCRIPT, schema, str(batch)],
            env=child_env(**{URL_ENV: url}), stdin=subprocess.DEVNULL,
            capture_output=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise BenchError(f"raw drain (batch {batch}) did not finish within {timeout:.0f}s") \
            from None
    if done.returncode != 0:
        tail = done.stderr.decode("utf-8", "replace").strip().splitlines()[-10:]
        raise BenchError(f"raw drain (batch {batch}) failed:\n" + "\n".join(tail))
    report: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return report
