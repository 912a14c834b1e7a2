"""/healthz under chaos: scraped all along while the database dies and the worker is killed.

A `conveyor worker --metrics-port` against a private embedded PostgreSQL of
this test alone; a thread asks /healthz every 50 ms from start to end. The
probe must turn 503 within the documented bound once the database is gone
(no claim round trip for 2 x poll interval + query timeout), never say 200
again while it is down, come back once the server does, and, once the worker
is SIGKILLed, never answer again (no stale 200 from anything left behind).
"""

from __future__ import annotations

import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

import pytest

from waiting import wait_for

from .conftest import create_ledger
from .helpers import WorkerProcess, run_cli
from .test_server_restart import PrivateServer, private_server

__all__ = ["private_server"]     # the fixture, shared with the restart test

# light: /healthz must turn 503 within BOUND + 1.5 s of its private server dying;
# the three light tests beside it, mostly waiting, leave it CPU to spare.
pytestmark = [pytest.mark.slow, pytest.mark.light]

POLL = 0.5
QUERY_TIMEOUT = 2.0
BOUND = 2 * POLL + QUERY_TIMEOUT      # conveyor.metrics.health.claim_limit
MARGIN = 1.5                           # the probe's 50 ms, a claim in flight, scheduling


class Prober(threading.Thread):
    """Asks /healthz every 50 ms; keeps (monotonic time, status or 'refused')."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.url = f"http://127.0.0.1:{port}/healthz"
        self.answers: list[tuple[float, int | str]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=2) as response:
                    answer: int | str = response.status
            except urllib.error.HTTPError as exc:
                answer = exc.code
            except OSError:
                answer = "refused"
            self.answers.append((time.monotonic(), answer))
            time.sleep(0.05)

    def last(self) -> int | str | None:
        return self.answers[-1][1] if self.answers else None

    def since(self, moment: float) -> list[int | str]:
        return [a for t, a in self.answers if t >= moment]


def test_healthz_tells_the_truth_while_the_database_dies_and_the_worker_is_killed(
        private_server: PrivateServer, spawn: Callable[..., WorkerProcess]) -> None:
    url = private_server.url
    migrated = run_cli("--database-url", url, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    create_ledger(url)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    worker = spawn(url, "--metrics-port", str(port), "--poll-interval", str(POLL),
                   "--query-timeout", str(QUERY_TIMEOUT))
    prober = Prober(port)
    prober.start()
    try:
        wait_for(lambda: prober.last() == 200, 30, "/healthz to say 200", alive=[worker])

        private_server.stop_fast()
        down_at = time.monotonic()
        wait_for(lambda: prober.last() == 503, BOUND + MARGIN + 5, "/healthz to say 503",
                 interval=0.05, alive=[worker])
        turned = next(t for t, a in prober.answers if t >= down_at and a == 503) - down_at
        assert turned <= BOUND + MARGIN, f"503 only {turned:.1f}s after the server went down"
        time.sleep(2.0)
        stale = [a for a in prober.since(down_at + BOUND + MARGIN) if a == 200]
        assert not stale, "a 200 while the database was down"

        private_server.start()
        up_at = time.monotonic()
        wait_for(lambda: prober.last() == 200, 40, "/healthz to say 200 again", alive=[worker])
        assert worker.alive()

        worker.signal(signal.SIGKILL)
        worker.wait(10)
        killed_at = time.monotonic()
        time.sleep(1.0)
        after = prober.since(killed_at + 0.2)
        assert after and set(after) == {"refused"}, after
    finally:
        prober.done.set()
        prober.join(5)
    assert up_at > down_at
