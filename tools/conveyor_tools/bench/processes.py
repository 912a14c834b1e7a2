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
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import IO, Any

import psycopg
from psycopg import sql

from conveyor_tools.bench.app import WAKE_FD_ENV
from conveyor_tools.bench.baseline import URL_ENV, RawVariant
from conveyor_tools.bench.scratch import BenchError

APP = "conveyor_tools.bench.app:router"
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
    """One ``conveyor worker`` process serving :mod:`conveyor_tools.bench.app`.

    ``batch_size``/``concurrency``/``retention`` left as ``None`` keep the command's defaults
    (``WorkerConfig()``'s). ``launcher`` replaces ``-m conveyor.cli.main``,
    e.g. with ``-m cProfile -o out.prof -m conveyor.cli.main`` for profiling.
    ``app`` and ``flags`` (e.g. ``--tracing``) change what the worker serves and how.
    """

    def __init__(self, url: str, schema: str, *, batch_size: int | None = None,
                 concurrency: int | None = None, retention: float | None = None,
                 wake_fd: int | None = None,
                 launcher: Sequence[str] = ("-m", "conveyor.cli.main"),
                 app: str = APP, flags: Sequence[str] = ()) -> None:
        self.url = url
        self.app = app
        self.flags = list(flags)
        self.schema = schema
        self.batch_size = batch_size
        self.concurrency = concurrency
        self.retention = retention
        self.wake_fd = wake_fd
        self.launcher = list(launcher)
        self.proc: subprocess.Popen[bytes] | None = None
        self._stderr: IO[bytes] | None = None

    def command(self) -> list[str]:
        cmd = [sys.executable, *self.launcher, "--schema", self.schema,
               "--log-level", "warning", "worker", "--app", self.app, *self.flags]
        if self.batch_size is not None:
            cmd += ["--batch-size", str(self.batch_size)]
        if self.concurrency is not None:
            cmd += ["--concurrency", str(self.concurrency)]
        if self.retention is not None:
            cmd += ["--retention", f"{self.retention:g}"]
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


class RawDrainer:
    """The baseline drain loop (``baseline.py``) in its own process, started on a signal.

    ``start`` and ``wait_ready`` leave it connected and idle; ``go`` starts the
    drain; ``result`` waits for its report; ``stop`` lets it disconnect (after
    the caller has read its backend's CPU time) or kills it.
    """

    def __init__(self, url: str, schema: str, variant: RawVariant) -> None:
        self.url = url
        self.schema = schema
        self.variant = variant
        self.proc: subprocess.Popen[str] | None = None
        self._stderr: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self) -> None:
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the child
        self.proc = subprocess.Popen(
            [sys.executable, BASELINE_SCRIPT, self.schema, *self.variant.argv()],
            env=child_env(**{URL_ENV: self.url}), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._stderr, text=True)

    def _line(self, timeout: float) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.stop(timeout=1.0)
            raise BenchError(f"raw drain ({self.variant.label}) gave no answer within "
                             f"{timeout:.0f}s:\n{self._tail()}")
        return line.strip()

    def _tail(self) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return "\n".join(self._stderr.read().decode("utf-8", "replace").splitlines()[-10:])

    def wait_ready(self, timeout: float = 30.0) -> None:
        if self._line(timeout) != "ready":
            raise BenchError(f"raw drain ({self.variant.label}) did not start")

    def go(self) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def result(self, timeout: float) -> dict[str, Any]:
        report: dict[str, Any] = json.loads(self._line(timeout))
        return report

    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        proc = self.proc
        if proc is None:
            return 0
        if proc.poll() is None:
            try:
                assert proc.stdin is not None
                proc.stdin.close()  # end of input: it disconnects and exits
                proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
        return proc.returncode

    def close(self) -> None:
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None


class RawWaker(RawDrainer):
    """The baseline's wake-up loop (``baseline.py wake``): LISTEN, claim, stamp to a pipe.

    It blocks on notifications, so ``stop`` ends it with a kill after a
    moment; it holds no work anyone waits for.
    """

    def __init__(self, url: str, schema: str, wake_fd: int) -> None:
        super().__init__(url, schema, RawVariant())
        self.wake_fd = wake_fd

    def start(self) -> None:
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - lives as long as the child
        self.proc = subprocess.Popen(
            [sys.executable, BASELINE_SCRIPT, "wake", self.schema, str(self.wake_fd)],
            env=child_env(**{URL_ENV: self.url}), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self._stderr, text=True, pass_fds=(self.wake_fd,))

    def stop(self, timeout: float = 0.5) -> int:
        return super().stop(timeout)


class ProcessRegistry:
    """Tracks every child so ``stop_all`` can end them, whatever went wrong."""

    def __init__(self) -> None:
        self._children: list[WorkerProcess | RawDrainer] = []  # RawWaker is a RawDrainer

    def worker(self, *args: Any, **kwargs: Any) -> WorkerProcess:
        worker = WorkerProcess(*args, **kwargs)
        self._children.append(worker)
        return worker

    def raw_drainer(self, url: str, schema: str, variant: RawVariant) -> RawDrainer:
        drainer = RawDrainer(url, schema, variant)
        self._children.append(drainer)
        return drainer

    def raw_waker(self, url: str, schema: str, wake_fd: int) -> RawWaker:
        waker = RawWaker(url, schema, wake_fd)
        self._children.append(waker)
        return waker

    def stop_all(self) -> None:
        for child in self._children:
            try:
                child.stop(timeout=10.0)
            finally:
                child.close()
        self._children.clear()


# ------------------------------------------------------------------- CPU time

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _ticks_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS


def thread_cpu(pid: int) -> dict[int, float] | None:
    """CPU seconds of each live thread of a local process, in nanoseconds' resolution.

    ``/proc/PID/stat`` counts in clock ticks (10 ms): over a drain of 20,000
    events that is 0.5 us per event, as much as a tenth of what the raw loop
    spends. ``schedstat``'s first field is the scheduler's own runtime in ns.
    Without schedstat, the whole process in ticks under the key ``pid``.
    """
    try:
        tids = os.listdir(f"/proc/{pid}/task")
        times: dict[int, float] = {}
        for tid in tids:
            with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as stat:
                times[int(tid)] = int(stat.read().split()[0]) / 1e9
        return times
    except (OSError, ValueError, IndexError):
        ticks = _ticks_seconds(pid)
        return None if ticks is None else {pid: ticks}


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a local process's live threads; ``None`` if unreadable."""
    times = thread_cpu(pid)
    return None if times is None else sum(times.values())


def cpu_since(start: dict[int, float] | None, pid: int) -> float | None:
    """CPU seconds since ``start`` (a :func:`thread_cpu` reading); a new thread counts from 0.

    A thread that ended in between takes its share with it: the worker's
    threads (the resolver's executor) live as long as it does.
    """
    end = thread_cpu(pid)
    if start is None or end is None:
        return None
    return sum(t - start.get(tid, 0.0) for tid, t in end.items())


def _local_backends(admin: psycopg.Connection[Any], pid: int) -> list[int]:
    """Server pids of the TCP connections process ``pid`` holds, when the server is local."""
    try:
        import psutil

        ports = {c.laddr.port for c in psutil.Process(pid).net_connections(kind="inet")
                 if c.laddr}
        rows = admin.execute(
            "SELECT pid, client_port FROM pg_stat_activity WHERE datname = current_database()"
            " AND client_addr IS NOT NULL AND (client_addr = inet_server_addr()"
            " OR host(client_addr) IN ('127.0.0.1', '::1'))").fetchall()
        found = [r[0] for r in rows if r[1] in ports]
        # Only trust pids that really are PostgreSQL processes on this machine.
        return [p for p in found if "postgres" in psutil.Process(p).name()]
    except Exception:  # noqa: BLE001 - no psutil, no permission, remote server: no figure
        return []


class CpuProbe:
    """CPU spent by one client process and its database backends between two readings.

    Backends are looked up again at the end (the worker opens its acknowledging
    connection on the first acknowledgement); one found only then counts from 0.
    Backend figures exist only when the server runs on this machine.
    """

    def __init__(self, admin: psycopg.Connection[Any], pid: int) -> None:
        self.pid = pid
        self._own = thread_cpu(pid)
        self._backends = {b: cpu_seconds(b) or 0.0 for b in _local_backends(admin, pid)}

    def spent(self, admin: psycopg.Connection[Any]) -> tuple[float | None, float | None]:
        """(client seconds, backend seconds) since construction."""
        own = cpu_since(self._own, self.pid)
        backends = _local_backends(admin, self.pid)
        if not backends:
            return own, None
        total = 0.0
        for b in backends:
            now = cpu_seconds(b)
            if now is not None:
                total += now - self._backends.get(b, 0.0)
        return own, total
