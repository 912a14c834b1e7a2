"""What follows a written outcome (worker/accounting.py), settled without a database."""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import Any

from conveyor.types import Event, EventState
from conveyor.worker.accounting import OutcomeAccounting, SettledObserver
from conveyor.worker.executor import Outcome
from conveyor.worker.failure_log import FailureLogLimiter
from conveyor.worker.running import RunningSet
from conveyor.worker.stats import FAILED, RETRIED, SUCCEEDED, OutcomeTally, WorkerStats


class _Books:
    def __init__(self) -> None:
        self.running = RunningSet(10)
        self.stats = WorkerStats()
        self.tally = OutcomeTally()
        self.timers: list[float] = []
        self.room = 0
        self.freed: list[set[str]] = []
        self.accounting = OutcomeAccounting(
            self.running, self.stats, self.tally, FailureLogLimiter(100, 60.0),
            clock_offset=lambda: 0.0, wake_at=self.timers.append, room_freed=self._freed)

    def _freed(self, topics: Collection[str]) -> None:
        self.room += 1
        self.freed.append(set(topics))

    def claim(self, *ids: int) -> None:
        self.running.take(Event(id=i, topic=f"t{i % 2}", payload_text="null", max_attempts=3)
                          for i in ids)

    def counts(self) -> dict[str, list[int]]:
        return {topic: row for (_minute, topic), row in self.tally.take().items()}


def test_a_batch_of_written_successes_frees_its_slots_and_counts_by_topic() -> None:
    books = _Books()
    books.claim(1, 2, 3)
    books.accounting.settled([Outcome(i, 1, EventState.SUCCEEDED) for i in (1, 2, 3)], {1, 2, 3})
    assert len(books.running) == 0 and books.stats.succeeded == 3 and books.room == 1
    assert books.freed == [{"t0", "t1"}]     # the topics freed: a fifo_by key's next may run
    assert {t: row[SUCCEEDED] for t, row in books.counts().items()} == {"t0": 1, "t1": 2}


def test_a_refused_outcome_frees_its_slot_and_is_neither_counted_nor_timed() -> None:
    books = _Books()
    books.claim(1, 2)
    books.accounting.settled([Outcome(1, 1, EventState.PENDING, delay=5.0, error="boom"),
                              Outcome(2, 1, EventState.SUCCEEDED)], done={2})
    assert len(books.running) == 0
    assert (books.stats.retried, books.stats.succeeded) == (0, 1)
    assert books.timers == []
    assert books.freed == [{"t0", "t1"}]


def test_a_written_retry_arms_a_timer_for_its_due_time_and_a_failure_is_counted() -> None:
    books = _Books()
    books.claim(1, 2)
    before = time.time()
    books.accounting.settled([Outcome(1, 1, EventState.PENDING, delay=5.0, error="boom"),
                              Outcome(2, 1, EventState.FAILED, error="bad")], done={1, 2})
    assert (books.stats.retried, books.stats.failed) == (1, 1)
    assert len(books.timers) == 1 and before + 5.0 <= books.timers[0] <= time.time() + 5.0
    counts = books.counts()
    assert (counts["t1"][RETRIED], counts["t0"][FAILED]) == (1, 1)


def test_a_snooze_spends_no_attempt_and_counts_as_nothing() -> None:
    books = _Books()
    books.claim(1)
    books.accounting.settled([Outcome(1, 1, EventState.PENDING, delay=1.0, refund=1)], {1})
    assert (books.stats.retried, books.stats.succeeded) == (0, 0)
    assert books.counts() == {} and len(books.timers) == 1


def _timed(outcome: Outcome, started: float) -> Outcome:
    """``outcome`` as an executor that times its calls hands it on."""
    outcome.started, outcome.duration = started, 0.001
    return outcome


class _Seen(SettledObserver):
    def __init__(self, fail: bool = False) -> None:
        self.seen: list[tuple[int, EventState]] = []
        self.fail = fail

    def observe_settled(self, settled: Sequence[tuple[Event, Outcome]]) -> None:
        self.seen += [(event.id, outcome.state) for event, outcome in settled]
        if self.fail:
            raise RuntimeError("observer broke")


def test_observers_see_the_written_outcomes_of_handler_calls_only() -> None:
    books, seen = _Books(), _Seen()
    books.accounting = OutcomeAccounting(
        books.running, books.stats, books.tally, FailureLogLimiter(100, 60.0),
        clock_offset=lambda: 0.0, wake_at=books.timers.append, room_freed=books._freed,
        observers=[seen])
    books.claim(1, 2, 3, 4)
    now = time.monotonic()
    handed_back = Outcome.handed_back(Event(id=4, topic="t0", payload_text="null"))
    books.accounting.settled([_timed(Outcome(1, 1, EventState.SUCCEEDED), now),
                              _timed(Outcome(2, 1, EventState.PENDING, delay=1.0), now),
                              _timed(Outcome(3, 1, EventState.SUCCEEDED), now),
                              handed_back], done={1, 2, 4})
    # 3's acknowledgement was refused (a lost lease), 4 was handed back unrun.
    assert seen.seen == [(1, EventState.SUCCEEDED), (2, EventState.PENDING)]
    assert len(books.running) == 0


def test_an_observer_that_raises_frees_the_slots_all_the_same(caplog: Any) -> None:
    books = _Books()
    books.accounting = OutcomeAccounting(
        books.running, books.stats, books.tally, FailureLogLimiter(100, 60.0),
        clock_offset=lambda: 0.0, wake_at=books.timers.append, room_freed=books._freed,
        observers=[_Seen(fail=True)])
    books.claim(1, 2)
    now = time.monotonic()
    books.accounting.settled([_timed(Outcome(i, 1, EventState.SUCCEEDED), now) for i in (1, 2)],
                             {1, 2})
    assert len(books.running) == 0 and books.stats.succeeded == 2
    assert "_Seen failed to observe 2 outcomes" in caplog.text
