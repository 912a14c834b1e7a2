"""The calls an executor has in flight: which one holds the loop, which leases to keep,
which are past their deadline.

Read from outside the loop's normal flow: the loop watchdog's thread asks
which event blocks the loop and which leases a stalled loop must keep
renewing, and the log context asks which event the current task handles.
:class:`InFlight` is the :class:`~conveyor.worker.executor.Executor`'s base
class, so its hot path sets these attributes directly, at no extra cost.
"""

from __future__ import annotations

import asyncio
import weakref

from conveyor.types import Event
from conveyor.worker.running import Running

SWEEP_INTERVAL = 0.05


class InFlight:
    """The state of an executor's calls that the watchdog and the log context read."""

    _entries: dict[tuple[int, int], Running]
    _loop: asyncio.AbstractEventLoop | None
    _inline_event: Event | None           # the inline handler running now, if any
    _starting_event: Event | None         # the handler of a task starting eagerly
    _task_events: weakref.WeakKeyDictionary[asyncio.Future[None], Event]
    _timeout: float | None
    _handler_timeout: float
    _inline_done: asyncio.Future[None] | None = None

    def _finished(self, loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
        """A completed future standing in for the task of an inline handler call."""
        done = self._inline_done
        if done is None or done.get_loop() is not loop:
            done = self._inline_done = loop.create_future()
            done.set_result(None)
        return done

    def blocking_event(self) -> Event | None:
        """The event whose handler holds the loop now; safe to call from another thread."""
        if self._inline_event is not None:
            return self._inline_event
        task = asyncio.current_task(self._loop) if self._loop is not None else None
        if task is None:
            return None
        for running in list(self._entries.values()):
            if running.task is task:
                return running.event
        return self._starting_event

    def held_during_stall(self, loop_now: float, stalled_for: float) -> list[int]:
        """Ids of the events whose leases to keep while the loop has been stuck for
        ``stalled_for`` seconds; ``loop_now`` is the loop's clock now. Safe from another thread.

        A call still running is held until its deadline: the handler blocking
        the loop may finish and succeed, but one that blocks for ever must not
        hold its event for ever. A call not started yet, or whose outcome waits
        for the loop to be written, is held for the handler timeout from the
        start of the stall.
        """
        default = self._timeout or self._handler_timeout
        stall_started = loop_now - stalled_for
        inline = self._inline_event
        held = []
        for running in list(self._entries.values()):
            task = running.task
            if task is None or (task.done() and running.event is not inline):
                limit = stall_started + default
            else:
                limit = running.deadline
            if loop_now < limit:
                held.append(running.event.id)
        return held

    def event_of_current_task(self) -> Event | None:
        """The event whose handler runs in the current task of this executor's loop, or None.

        For the log context (see :mod:`conveyor.log_context`): looked up when a
        record is logged, cached per task.
        """
        loop = self._loop
        if loop is None:
            return None
        try:
            if asyncio.get_running_loop() is not loop:
                return None
        except RuntimeError:   # not on an event loop's thread
            return None
        if self._inline_event is not None:
            return self._inline_event
        task = asyncio.current_task(loop)
        if task is None:
            return None
        event = self._task_events.get(task)
        if event is None:
            for running in list(self._entries.values()):
                if running.task is task:
                    event = running.event
                    break
            else:
                return self._starting_event
            self._task_events[task] = event
        return event

    async def _sweep_deadlines(self) -> None:
        """Cancel handlers past their deadline: one periodic pass instead of a timer per call."""
        loop = asyncio.get_running_loop()
        entries = self._entries
        while entries:
            await asyncio.sleep(SWEEP_INTERVAL)
            now = loop.time()
            cancelled: set[asyncio.Future[None]] = set()
            for running in list(entries.values()):
                task = running.task
                if now >= running.deadline and task is not None and not task.done() \
                        and not running.timed_out:
                    running.timed_out = True
                    if task not in cancelled:     # a batch's events share one task
                        cancelled.add(task)
                        task.cancel()
