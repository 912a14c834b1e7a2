"""How many failure lines the worker writes: a few per topic and outcome a window, then a count.

A dependency that is down fails every event of its topics: 14,000 failing
events wrote 40,974 lines in five minutes (newcomer review M3), drowning
whatever else the log had to say. :class:`FailureLogLimiter` lets each
(topic, outcome) pair write ``limit`` lines per ``window`` seconds; the
lines past that are counted, and once the window has ended one line says how
many were left out::

    WARNING ... 412 more failed attempts of topic mail.send suppressed in the last 60s

The first failure of a topic in each window is always written. The count is
written when the window ends (a timer on the running event loop), when the
next failure of that pair comes after it, or at the worker's stop: every
failure is either a line or part of a count. Every attempt's error stays
stored with its event (``conveyor show``); only the log is thinned.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from conveyor.config import FAILURE_LOG_LIMIT_DEFAULT, FAILURE_LOG_WINDOW_DEFAULT

__all__ = ["FAILURE_LOG_LIMIT_DEFAULT", "FAILURE_LOG_WINDOW_DEFAULT", "FailureLogLimiter"]

log = logging.getLogger(__name__)

# What the summary line calls the lines it counts, by their action.
_WHAT = {"retry_scheduled": "failed attempts", "event_parked": "parked events",
         "event_cancelled": "cancelled events"}


@dataclass(slots=True)
class _Window:
    started: float
    logged: int = 0
    suppressed: int = 0


class FailureLogLimiter:
    """At most ``limit`` lines per (topic, action) in each ``window`` seconds; counts the rest.

    Args:
        limit: lines a (topic, action) pair may write per window; ``None``
            writes every one. Defaults to 10.
        window: seconds of one window. Defaults to 60.0.
        clock: monotonic seconds; tests pass a fake one. Defaults to
            :func:`time.monotonic`.
    """

    def __init__(self, limit: int | None = FAILURE_LOG_LIMIT_DEFAULT,
                 window: float = FAILURE_LOG_WINDOW_DEFAULT, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.window = window
        self._clock = clock
        self.windows: dict[tuple[str, str], _Window] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._swept = clock()

    def admit(self, topic: str, action: str) -> bool:
        """Whether this failure gets its line; if not, it is counted for the summary."""
        if self.limit is None:
            return True
        now = self._clock()
        if now - self._swept >= self.window:
            # Topics matched by a pattern are unbounded: quiet ones are dropped.
            self._swept = now
            self.flush()
        key = (topic, action)
        current = self.windows.get(key)
        if current is None or now - current.started >= self.window:
            if current is not None:
                self._summarise(key, current)
            current = self.windows[key] = _Window(now)
        if current.logged < self.limit:
            current.logged += 1
            return True
        current.suppressed += 1
        self._arm(current.started + self.window - now)
        return False

    def flush(self, *, everything: bool = False) -> None:
        """Write the counts of windows that ended (or of all: at stop), and forget them."""
        now = self._clock()
        for key, current in list(self.windows.items()):
            if everything or now - current.started >= self.window:
                del self.windows[key]
                self._summarise(key, current)
        if everything and self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _summarise(self, key: tuple[str, str], current: _Window) -> None:
        if not current.suppressed:
            return
        topic, action = key
        # A window cut short by the worker's stop says how long it really was.
        seconds = min(self.window, self._clock() - current.started)
        log.warning("%d more %s of topic %s suppressed in the last %.0fs", current.suppressed,
                    _WHAT.get(action, action), topic, max(seconds, 1.0),
                    extra={"action": "failures_suppressed", "topic": topic, "outcome": action,
                           "suppressed": current.suppressed})

    def _arm(self, delay: float) -> None:
        if self._timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return      # no loop (a test driving it by hand): flush() writes the counts
        self._timer = loop.call_later(max(0.0, delay) + 0.001, self._fired)

    def _fired(self) -> None:
        self._timer = None
        self.flush()
        pending = [w.started + self.window for w in self.windows.values() if w.suppressed]
        if pending:
            self._arm(min(pending) - self._clock())
