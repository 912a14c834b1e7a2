"""Notices an event loop that a handler blocks, and names the handler.

An async handler that calls blocking code (``time.sleep``, a synchronous
driver, heavy CPU work) stops the whole worker: no other handler runs, no
heartbeat renews the leases, no deadline is enforced. Past ``lease_ttl`` the
rescuer of another worker takes the events back and runs them again, so a
handler that always succeeds can still end ``failed``. Nothing on the blocked
loop can see this happen, so a thread watches a tick the loop posts.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import Callable

from conveyor.types import Event

log = logging.getLogger(__name__)

TICK_INTERVAL = 0.1


def _where(thread_id: int) -> str:
    """The innermost frame the given thread is executing, as ``file:line in function``."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return "an unknown place"
    code = frame.f_code
    return f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"


class LoopWatchdog:
    """Warns when the loop has not run for ``warn_after`` seconds; again past the lease.

    Args:
        identify: called from the watchdog's thread while the loop is stuck;
            returns the event whose handler holds it, if it can tell.
        warn_after: seconds without a loop tick before the first warning.
        lease_ttl: seconds after which the worker's leases may expire.
        on_stall: told the length of every stall once it ends (for statistics).
    """

    def __init__(self, *, identify: Callable[[], Event | None], warn_after: float,
                 lease_ttl: float, on_stall: Callable[[float], None] | None = None) -> None:
        self._identify = identify
        self._warn_after = warn_after
        self._lease_ttl = lease_ttl
        self._on_stall = on_stall
        self._beat = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tick_handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0

    @property
    def watching(self) -> bool:
        """Whether the watchdog runs, which it does exactly while the worker's loops do."""
        return self._thread is not None

    def lag(self) -> float:
        """Seconds since the loop last ran its tick (0 to 0.1 while it runs freely)."""
        return max(0.0, time.monotonic() - self._beat)

    def start(self) -> None:
        """Start watching the running loop (call from inside it)."""
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._beat = time.monotonic()
        self._tick_handle = self._loop.call_later(TICK_INTERVAL, self._tick)
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="conveyor-loop-watchdog",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._tick_handle is not None:
            self._tick_handle.cancel()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None

    def _tick(self) -> None:
        self._beat = time.monotonic()
        assert self._loop is not None
        self._tick_handle = self._loop.call_later(TICK_INTERVAL, self._tick)

    def _watch(self) -> None:
        stalled_since: float | None = None   # the beat the current stall started from
        past_lease = False
        while not self._stop.wait(TICK_INTERVAL):
            beat = self._beat
            lag = time.monotonic() - beat
            if stalled_since is not None and beat != stalled_since:
                self._resumed(beat - stalled_since)
                stalled_since, past_lease = None, False
            if lag < self._warn_after + TICK_INTERVAL:
                continue
            if stalled_since is None:
                stalled_since = beat
                self._report(lag, logging.WARNING, "loop_blocked",
                             "async handlers must not block: route blocking code with "
                             "blocking=True or use asyncio.to_thread")
            elif not past_lease and lag >= self._lease_ttl:
                past_lease = True
                self._report(lag, logging.ERROR, "loop_blocked_past_lease",
                             f"past the lease ({self._lease_ttl:g}s): no heartbeat ran, so "
                             "this worker's events may be rescued and run again elsewhere")

    def _report(self, lag: float, level: int, action: str, advice: str) -> None:
        try:
            event = self._identify()
        except Exception:  # noqa: BLE001 - naming the culprit is best effort
            event = None
        where = _where(self._loop_thread)
        if event is None:
            culprit, fields = "", {}
        else:
            culprit = (f" by the handler of event {event.id} ({event.topic}, "
                       f"attempt {event.attempt})")
            fields = {"event_id": event.id, "topic": event.topic, "tenant": event.tenant,
                      "attempt": event.attempt}
        log.log(level, "event loop blocked for %.1fs%s, now at %s; %s", lag, culprit, where,
                advice, extra={"action": action, "blocked_s": round(lag, 3), "where": where,
                               **fields})

    def _resumed(self, stalled: float) -> None:
        log.info("event loop ran again after %.1fs", stalled,
                 extra={"action": "loop_resumed", "blocked_s": round(stalled, 3)})
        if self._on_stall is not None:
            self._on_stall(stalled)
