"""When to claim next, and how: notifications, due times of delayed events, pauses.

A notification for a due-now event wakes the fetch loop at once; one for a
delayed event (``topic|epoch``) and every retry this worker schedules put a
due time on a heap under one timer, so a delayed event starts when it falls
due rather than at the next poll. A ``!pause`` notification says the pauses
table changed: :class:`PauseState` then has the worker claim with the
statement that skips paused topics.

Any role may NOTIFY the worker's channel (it needs no grant): a payload is a
hint, and nothing in it may do more than wake the worker early.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import time
from collections.abc import Callable, Mapping

from conveyor.notify import SIGNAL_PREFIX, WAKE_ALL, parse_wake

log = logging.getLogger(__name__)

MAX_DUE_TIMES = 10_000
# A due time announced further ahead than this is not believed (and a timer
# that far out would be useless: the poll comes much sooner).
MAX_NOTIFIED_AHEAD = 366 * 24 * 3600.0
# "!pause" notifications wake the fetch loop at most once per this many seconds.
PAUSE_WAKE_INTERVAL = 0.1


def due_epoch(text: str) -> float | None:
    """The due time of a notification payload, or None when it is not a plausible epoch."""
    if len(text) > 32:
        return None
    try:
        epoch = float(text)
    except ValueError:
        return None
    if not math.isfinite(epoch) or epoch <= 0 or epoch > time.time() + MAX_NOTIFIED_AHEAD:
        return None
    return epoch


class DueTimes:
    """A heap of epochs when delayed events fall due, under one timer that wakes the fetch loop.

    Args:
        wake: asks the fetch loop to claim now.
        handles: whether this worker claims a topic.
        clock_offset: the database clock minus this machine's, so a due time
            announced by the database fires the local timer on time; its
            smallest bound (``Maintenance.wake_offset``), so never early.
        signals: what to call on each ``!`` notification (conveyor/notify.py:
            ``!pause``, ``!leases``,
            ``!control``, ``!deps``). Defaults to none (every such
            notification is then ignored).
    """

    def __init__(self, wake: Callable[[], None], handles: Callable[[str], bool],
                 clock_offset: Callable[[], float],
                 signals: Mapping[str, Callable[[], None]] | None = None) -> None:
        self._wake = wake
        self._signals = dict(signals or {})
        self._handles = handles
        self._clock_offset = clock_offset
        self.heap: list[float] = []
        self._set: set[float] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")

    def notified(self, payload: str) -> None:
        """React to one notification: wake now, set a timer, or ignore it."""
        if payload.startswith(SIGNAL_PREFIX):
            signal = self._signals.get(payload)
            if signal is not None:
                signal()
            return
        topic, due = parse_wake(payload)
        if topic != WAKE_ALL and not self._handles(topic):
            return
        if not due:
            self._wake()
            return
        epoch = due_epoch(due)
        if epoch is None:
            log.debug("ignored a notification with a bad due time: %r", payload[:100],
                      extra={"action": "notify_ignored"})
            return
        self.wake_at(epoch - self._clock_offset())

    def wake_at(self, epoch: float) -> None:
        """Wake the fetch loop at ``epoch``, in this machine's clock."""
        if not math.isfinite(epoch):
            return  # a NaN would sit at the heap's root for good, re-arming a 1 ms timer
        epoch = round(epoch, 3)
        if epoch in self._set:
            return
        heapq.heappush(self.heap, epoch)
        self._set.add(epoch)
        if len(self.heap) > MAX_DUE_TIMES:
            # Keep the earliest: a dropped later time only means that event waits
            # for a poll or for an earlier timer's claim.
            self.heap = heapq.nsmallest(MAX_DUE_TIMES // 2, self.heap)
            self._set = set(self.heap)
        self._arm()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = float("inf")

    def _arm(self) -> None:
        if not self.heap or self.heap[0] >= self._timer_at:
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = self.heap[0]
        # The extra millisecond lets the database clock pass the due time too.
        delay = max(0.0, self._timer_at - time.time()) + 0.001
        self._timer = asyncio.get_running_loop().call_later(delay, self._fired)

    def _fired(self) -> None:
        self._timer = None
        self._timer_at = float("inf")
        now = time.time()
        while self.heap and self.heap[0] <= now + 0.001:
            self._set.discard(heapq.heappop(self.heap))
        self._wake()
        self._arm()


def describe_pause(pattern: str, tenant: str | None) -> str:
    """``email.*`` or ``email.* (tenant acme)``, as log lines name a pause."""
    return pattern if tenant is None else f"{pattern} (tenant {tenant})"


class PauseState:
    """Whether this worker must claim with the statement that skips paused topics.

    ``any`` starts True (nothing known yet: skip what may be paused) and is
    set from the pauses table by :meth:`checked`, at start and on the
    maintenance re-check. A ``!pause`` notification sets it at once, before
    the table is read again: the paused claim reads the table itself, so it
    is right whatever the notification meant, and the next check turns the
    plain claim back on once the last pause is gone. With no pause, the
    worker's claim is exactly the statement it had before pauses existed.

    Any role may send ``!pause``: a flood of them is coalesced (adversary N11).
    The first wakes the fetch loop at once (a resume lets events wait no
    longer than that); the next ones within :data:`PAUSE_WAKE_INTERVAL` wake
    it once, at the interval's end, so a flood costs at most about ten claims
    a second, not one per notification.

    Args:
        wake: asks the fetch loop to claim now.
        clock: monotonic seconds; tests pass a fake one. Defaults to
            :func:`time.monotonic`.
    """

    def __init__(self, wake: Callable[[], None], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._wake = wake
        self._clock = clock
        self.any = True
        # Bumped by every notification, so a check that read the table before
        # one came in cannot turn the paused claim off after it.
        self.version = 0
        self._woken_at = -math.inf
        self.wake_pending = False
        self._timer: asyncio.TimerHandle | None = None
        # The pauses as last read, (pattern, tenant) -> reason; None before the first read.
        self.in_force: dict[tuple[str, str | None], str | None] | None = None

    def notified(self) -> None:
        self.any = True
        self.version += 1
        if self.wake_pending:
            return      # the trailing wake is due already
        now = self._clock()
        wait = self._woken_at + PAUSE_WAKE_INTERVAL - now
        if wait <= 0:
            self._woken_at = now
            self._wake()
            return
        self.wake_pending = True
        try:
            self._timer = asyncio.get_running_loop().call_later(wait, self.trailing_wake)
        except RuntimeError:
            pass        # no loop (a test driving it by hand): it calls trailing_wake

    def trailing_wake(self) -> None:
        """The one wake for the notifications that came within the interval."""
        self._timer = None
        if self.wake_pending:
            self.wake_pending = False
            self._woken_at = self._clock()
            self._wake()

    def read(self, pauses: list[tuple[str, str | None, str | None]], version: int) -> None:
        """The pauses table's rows (pattern, tenant, reason), read at ``version``.

        Each pause that appeared or went since the last read gets a line; the
        first read gets none (the worker's start line lists what it found).
        """
        now = {(pattern, tenant): reason for pattern, tenant, reason in pauses}
        if self.in_force is not None:
            for key, reason in now.items():
                if key not in self.in_force:
                    log.info("pause in force: %s: this worker claims none of its events until "
                             "it is resumed%s", describe_pause(*key),
                             f" ({reason})" if reason else "",
                             extra={"action": "pause_in_force", "pattern": key[0],
                                    "tenant": key[1]})
            for key in self.in_force.keys() - now.keys():
                log.info("pause lifted: %s: its events are claimed again", describe_pause(*key),
                         extra={"action": "pause_lifted", "pattern": key[0], "tenant": key[1]})
        self.in_force = now
        self.checked(bool(now), version)

    def checked(self, exists: bool, version: int) -> None:
        """The table held a pause (``exists``) when read at ``version``."""
        if version != self.version or exists == self.any:
            return
        self.any = exists
        log.debug("pauses %s: claiming with the %s statement", "in force" if exists else "lifted",
                 "pause-aware" if exists else "plain", extra={"action": "pauses_changed"})
        self._wake()
