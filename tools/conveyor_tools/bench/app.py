"""The router the benchmark's worker processes serve (``--app conveyor_tools.bench.app:router``).

``bench.noop`` does nothing, so a drain measures the queue and not a handler.
``bench.wake`` records the moment it starts (``time.time()``, the same clock
the producer reads after its commit returns) by writing ``"<id> <epoch>\\n"``
to the file descriptor named by ``CONVEYOR_BENCH_WAKE_FD``: a pipe the
benchmark opened for this process. The write comes after the timestamp, so
it is not part of the latency it reports.
"""

from __future__ import annotations

import os
import time

from conveyor.router import Router
from conveyor.types import Event

NOOP_TOPIC = "bench.noop"
WAKE_TOPIC = "bench.wake"
WAKE_FD_ENV = "CONVEYOR_BENCH_WAKE_FD"

_wake_fd = int(os.environ.get(WAKE_FD_ENV, "-1"))

router = Router()


@router.route(NOOP_TOPIC)
async def noop(event: Event) -> None:
    """Does nothing: the drain measures claiming and acknowledging alone."""


@router.route(WAKE_TOPIC)
async def wake(event: Event) -> None:
    """Reports when it started, for the wake-up latency."""
    started = time.time()
    if _wake_fd >= 0:
        os.write(_wake_fd, f"{event.id} {started:.6f}\n".encode())
