"""Progress of long commands on stderr, so stdout stays the result a script reads.

On a terminal a status line is rewritten in place and cleared at the end;
anywhere else (a log file, a pipe) long runs print an ordinary line now and
then, and short ones nothing.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

from conveyor.cli.output import escape

# Without a terminal, prune says how far it got once per this many batches
# (10 x 10,000 rows): a log gets a line about every 100,000 deleted rows.
PROGRESS_EVERY_BATCHES = 10

_CLEAR_LINE = "\r\x1b[K"


class StatusLine:
    """One line on a terminal, rewritten in place; a no-op when ``stream`` is no terminal."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty()
        self._shown = False

    def show(self, text: str) -> None:
        if self.live:
            self.stream.write(f"{_CLEAR_LINE}conveyor: {escape(text)}")
            self.stream.flush()
            self._shown = True

    def clear(self) -> None:
        if self._shown:
            self.stream.write(_CLEAR_LINE)
            self.stream.flush()
            self._shown = False


class BatchProgress:
    """A ``progress(total_so_far)`` callback for work done in batches of ``batch_size``.

    On a terminal every batch updates the status line; otherwise every
    ``PROGRESS_EVERY_BATCHES``-th batch prints a line, except the last batch
    (a short one), whose total the command prints as its result anyway.
    """

    def __init__(self, action: str, noun: str, batch_size: Callable[[], int],
                 stream: TextIO | None = None) -> None:
        self.action, self.noun = action, noun
        self._batch_size = batch_size
        self._line = StatusLine(stream)
        self._batches = 0
        self._last_total = 0

    def __call__(self, total: int) -> None:
        self._batches += 1
        last = total - self._last_total < self._batch_size()
        self._last_total = total
        text = f"{self.action}: {total} {self.noun} so far"
        if self._line.live:
            self._line.show(text)
        elif not last and self._batches % PROGRESS_EVERY_BATCHES == 0:
            print(f"conveyor: {text}", file=self._line.stream, flush=True)

    def finish(self) -> None:
        self._line.clear()


class Ticker:
    """While the block runs, a terminal shows ``what`` with a percentage and the time spent.

    ``fraction`` reports how far the work is (0 to 1), or None when unknown.
    Does nothing when stderr is not a terminal.
    """

    def __init__(self, what: str, fraction: Callable[[], float | None],
                 stream: TextIO | None = None, interval: float = 0.5) -> None:
        self.what, self.fraction, self.interval = what, fraction, interval
        self._line = StatusLine(stream)
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = time.monotonic()

    def __enter__(self) -> Ticker:
        if self._line.live:
            self._tick()
            self._thread = threading.Thread(target=self._run, name="conveyor-progress",
                                            daemon=True)
            self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        self._line.clear()

    def _run(self) -> None:
        while not self._done.wait(self.interval):
            self._tick()

    def _tick(self) -> None:
        try:
            fraction = self.fraction()
        except (OSError, ValueError):     # the file was closed under us: the work is ending
            fraction = None
        done = "" if fraction is None else f" {min(fraction, 1.0):.0%}"
        self._line.show(f"{self.what}{done} ({time.monotonic() - self._started:.0f}s)")
