"""The one owner of a worker's claimed events: running, abandoned, lost, handed back.

A slot is taken when an event is claimed and freed only when its outcome is
acknowledged (or its lease is lost), so the table never shows more of this
worker's events ``running`` than its concurrency. The fetch loop, the
executor, the completer's acknowledgements and the heartbeat all go through
this set; nothing else holds claimed events.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from conveyor.holder import Holder
from conveyor.types import Event

log = logging.getLogger(__name__)

Key = tuple[int, int]   # (event id, attempt)


@dataclass(slots=True)
class Running:
    """One claimed event and the call that handles it."""

    event: Event
    # The handler's task; for an inline call (blocking=False), a finished future.
    task: asyncio.Task[None] | asyncio.Future[None] | None
    deadline: float = float("inf")    # loop time after which the sweeper cancels it
    timed_out: bool = False
    # Its outcome was handed on; a batch call whose task ended leaves none
    # unsettled (the executor's safety net).
    settled: bool = False


class RunningSet:
    """Claimed and not yet acknowledged events, by (event id, attempt).

    The same event can be here twice: an attempt whose lease was lost may
    still run while the event was claimed again.
    """

    def __init__(self, concurrency: int, holder: Holder | None = None) -> None:
        self.concurrency = concurrency
        # Handed to every event taken, for a handler that finishes it itself
        # (conveyor.complete); set while the set's loop runs anyway.
        self.holder = holder
        self.entries: dict[Key, Running] = {}
        self.abandoned_threads = 0   # timed-out plain handlers whose threads still run
        # Slots held for a claim in flight on another connection (the flow
        # claim, worker/flow.py): the fetch loop must not count them free.
        self.reserved = 0
        self.freed = asyncio.Event()  # set whenever a slot may have come free
        # Events of an open claim window (worker/window.py): pending and locked
        # in its transaction, no lease yet, so the heartbeat leaves them out.
        self.windowed: set[Key] = set()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: Key) -> bool:
        return key in self.entries

    def free_slots(self) -> int:
        # The pool has a spare thread per slot, so a timed-out plain handler whose
        # thread runs on delays nobody; only past that reserve do stuck threads
        # take slots (the work would otherwise queue behind them and time out).
        overflow = max(0, self.abandoned_threads - self.concurrency)
        return self.concurrency - len(self.entries) - overflow - self.reserved

    async def wait_for_slot(self) -> None:
        self.freed.clear()
        await self.freed.wait()

    def take(self, events: Iterable[Event], *, held: bool = False) -> None:
        """Take a slot for each claimed event; its call starts later.

        ``held``: the events of a claim window, not leased: the heartbeat leaves
        them out from this moment (:attr:`windowed`), in the same step, or one
        that ran before their window's record was written read them as lost.
        """
        entries = self.entries
        holder = self.holder
        for event in events:
            entries[(event.id, event.attempt)] = Running(event, None)
            event._holder = holder  # type: ignore[assignment]   # None outside a worker
        if held:
            self.windowed.update((event.id, event.attempt) for event in events)

    def keys(self) -> list[Key]:
        """The leased events: every one but those of an open claim window."""
        windowed = self.windowed
        if windowed:
            return [key for key in self.entries if key not in windowed]
        return list(self.entries)

    def tasks(self) -> list[asyncio.Task[None] | asyncio.Future[None]]:
        return [r.task for r in self.entries.values() if r.task is not None]

    def unfinished_tasks(self) -> list[asyncio.Task[None] | asyncio.Future[None]]:
        return [t for t in self.tasks() if not t.done()]

    def release(self, key: Key) -> Running | None:
        """Free the slot of an acknowledged outcome; returns what ran there."""
        return self.entries.pop(key, None)

    def lose(self, lost: Iterable[Key], keep: set[Key], *, cancelled: bool = False,
             quiet: bool = False) -> int:
        """Stop work on events whose lease this worker no longer holds; returns how many.

        ``keep`` are outcomes already decided: their acknowledgement will tell.
        ``cancelled``: an operator cancelled them while they ran (the lease went
        with the cancel), rather than the lease expiring. ``quiet``: the caller
        logs it once (a claim window rolled back).
        """
        count = 0
        for key in lost:
            running = self.entries.get(key)
            if running is None or key in keep:
                continue
            count += 1
            if quiet:
                pass
            elif cancelled:
                log.info("event %s was cancelled while it ran; stopping its handler", key[0],
                         extra={"action": "running_cancelled", "event_id": key[0],
                                "attempt": key[1]})
            else:
                log.warning("lost the lease of event %s; abandoning it", key[0],
                            extra={"action": "lease_lost", "event_id": key[0], "attempt": key[1]})
            del self.entries[key]
            running.event._stop()    # what a plain handler in a thread can look at
            task = running.task
            # A batch's events share one task: the others still need its outcomes.
            if task is not None and not task.done() \
                    and not any(r.task is task for r in self.entries.values()):
                task.cancel()
        if count:
            self.freed.set()
        return count

    def hand_back(self, keep: set[Key]) -> list[Event]:
        """Drop every event without a decided outcome, whatever its call's state.

        A handler whose clean-up outlasts the shutdown's wait is neither done nor
        cancelled and must not keep its event ``running`` until the lease
        expires. Dropped from the set, so a late outcome of that call is never
        queued after the hand-back.
        """
        events = []
        for key, running in list(self.entries.items()):
            if key not in keep:
                del self.entries[key]
                events.append(running.event)
        return events

    def thread_abandoned(self, future: Future[Any]) -> None:
        """A plain handler timed out but its thread runs on: count it until it returns."""
        self.abandoned_threads += 1
        loop = asyncio.get_running_loop()

        def returned(_: Future[Any]) -> None:
            loop.call_soon_threadsafe(self._thread_returned)

        future.add_done_callback(returned)

    def _thread_returned(self) -> None:
        self.abandoned_threads -= 1
        self.freed.set()
