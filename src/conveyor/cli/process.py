"""Process plumbing for long-running commands: stop signals from the first moment.

A worker's event loop installs its own SIGTERM/SIGINT handlers only once it
runs; before that (importing the application, building the config, creating
the loop) and after the loop is closed (which restores the default handlers),
a signal would kill the process by the signal. :class:`StopSignals` notes a
stop request in those windows instead, so a SIGTERM at any moment of a
worker's life ends in a clean exit 0.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from types import FrameType

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Notes SIGTERM/SIGINT outside the event loop; hands the request to it once it runs."""

    def __init__(self) -> None:
        self.requested = False
        self._forward: Callable[[], None] | None = None

    def install(self) -> StopSignals:
        """Catch the stop signals from now on (main thread only); returns self."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        return self

    def forward_to(self, request_stop: Callable[[], None]) -> None:
        """Call ``request_stop`` now if a stop already came, and on every later signal.

        Call it inside the loop, right after the loop's own handlers are
        installed: a signal between the two is seen by one or the other.
        """
        self._forward = request_stop
        if self.requested:
            request_stop()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        first = not self.requested
        self.requested = True
        if first:
            log.info("%s received: stopping", signal.Signals(signum).name,
                     extra={"action": "stop_signal"})
        if self._forward is not None:
            self._forward()
