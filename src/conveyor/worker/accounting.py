"""What follows a written outcome: the slot freed, the counts, the log line, the retry's timer.

The :class:`~conveyor.worker.completer.Completer` hands every flushed batch
here with the ids the database accepted. Only a written outcome is counted,
logged or timed: an outcome the fence refused (a lost lease) frees its slot
and nothing more, so the log never tells of a result the database refused.
A :class:`SettledObserver` (the metrics) is handed each batch's written
outcomes here too, instead of a hook call per event.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence

from conveyor.types import Event, EventState
from conveyor.worker.classify import Outcome
from conveyor.worker.failure_log import FailureLogLimiter
from conveyor.worker.running import RunningSet
from conveyor.worker.stats import CANCELLED, FAILED, RETRIED, SUCCEEDED, OutcomeTally, WorkerStats

log = logging.getLogger(__name__)

# Which count of the outcome tally each written state adds to (PENDING: a retry).
_TALLIED = {EventState.SUCCEEDED: SUCCEEDED, EventState.PENDING: RETRIED,
            EventState.FAILED: FAILED, EventState.CANCELLED: CANCELLED}
_OUTCOME_ACTIONS = {EventState.PENDING: "retry_scheduled", EventState.FAILED: "event_parked",
                    EventState.CANCELLED: "event_cancelled"}


def log_outcome(event: Event, outcome: Outcome, limiter: FailureLogLimiter | None = None) -> None:
    """One line per failed attempt, scheduled retry, parked or handler-cancelled event.

    Written once the outcome is stored, so the log never tells of a result the
    database refused (a lost lease); the traceback follows at debug level.
    ``limiter`` thins a storm of them to a few lines and a count per topic.
    """
    action = _OUTCOME_ACTIONS.get(outcome.state)
    if action is None or (limiter is not None and not limiter.admit(event.topic, action)):
        return
    fields = {"event_id": event.id, "topic": event.topic, "tenant": event.tenant,
              "attempt": event.attempt, "error": outcome.error}
    if outcome.state is EventState.PENDING:
        log.warning("event %d (%s) attempt %d/%d failed: %s; retrying in %.1fs", event.id,
                    event.topic, event.attempt, event.max_attempts, outcome.error, outcome.delay,
                    extra={"action": action, "retry_in_s": outcome.delay, **fields})
    elif outcome.state is EventState.FAILED:
        log.error("event %d (%s) parked failed after attempt %d/%d: %s", event.id, event.topic,
                  event.attempt, event.max_attempts, outcome.error,
                  extra={"action": action, **fields})
    else:
        log.info("event %d (%s) %s", event.id, event.topic, outcome.error,
                 extra={"action": action, **fields})
    if outcome.traceback and log.isEnabledFor(logging.DEBUG):
        log.debug("event %d attempt %d traceback:\n%s", event.id, event.attempt,
                  outcome.traceback, extra={"action": "attempt_traceback", **fields})


class SettledObserver:
    """Sees the written outcomes of handler calls, a batch at a time, after their
    acknowledgement: what a middleware that only counts needs, for a call per
    batch where its ``after`` hook was a call per event, with the executor's
    hook path around it (hot path, measured: docs/benchmarks.md).

    A worker given a middleware that is also a SettledObserver
    (:class:`~conveyor.metrics.MetricsMiddleware`) runs none of its hooks and
    times every handler call instead; elsewhere (``conveyor.testing``) its
    hooks run as any middleware's.
    """

    def observe_settled(self, settled: Sequence[tuple[Event, Outcome]]) -> None:
        """Each written outcome a handler call decided, with its event; ``started``
        and ``duration`` are set. Runs on the worker's loop: it must not block."""
        raise NotImplementedError


class OutcomeAccounting:
    """Settles acknowledged batches for one worker.

    Args:
        running: the claimed events, whose slots the written outcomes free.
        stats: the worker's counters.
        tally: outcomes by minute and topic, for event_counts (0008).
        failure_log: thins a storm of failure lines.
        clock_offset: the database clock minus this machine's (the charts'
            minutes are the database's).
        wake_at: arms a claim for when a retry is due (time.time()).
        room_freed: slots came free, of these topics (a flow limit may have room).
        observers: see each batch's written outcomes (:class:`SettledObserver`).
    """

    def __init__(self, running: RunningSet, stats: WorkerStats, tally: OutcomeTally,
                 failure_log: FailureLogLimiter, *, clock_offset: Callable[[], float],
                 wake_at: Callable[[float], None],
                 room_freed: Callable[[Collection[str]], None],
                 observers: Sequence[SettledObserver] = ()) -> None:
        self.running = running
        self.stats = stats
        self.tally = tally
        self.failure_log = failure_log
        self._clock_offset = clock_offset
        self._wake_at = wake_at
        self._room_freed = room_freed
        self._observers = tuple(observers)

    def settled(self, batch: list[Outcome], done: set[int]) -> None:
        """Free the slots of written outcomes; count them, log failures, time retries."""
        if self._observers:
            self._observe(batch, done)
        s = self.stats
        release = self.running.release
        succeeded = EventState.SUCCEEDED
        tally = self.tally
        # The minute on the database's clock the dashboard's charts count these in.
        minute = int((time.time() + self._clock_offset()) // 60 * 60)
        if len(done) == len(batch) and all(o.state is succeeded for o in batch):
            # The common flush: plain successes, every one written.
            topics: dict[str, int] = {}
            for outcome in batch:
                entry = release((outcome.event_id, outcome.attempt))
                if entry is not None:
                    topic = entry.event.topic
                    topics[topic] = topics.get(topic, 0) + 1
            for topic, n in topics.items():
                tally.add(minute, topic, SUCCEEDED, n)
            s.succeeded += len(batch)
            self.running.freed.set()
            self._room_freed(topics)     # a limit may have room: the flow loop looks again
            return
        now = time.time()
        freed: set[str] = set()
        for outcome in batch:
            entry = release((outcome.event_id, outcome.attempt))
            if entry is not None:
                freed.add(entry.event.topic)
            if outcome.event_id not in done:
                continue
            kind = _TALLIED.get(outcome.state)
            if kind is not None and not outcome.refund and entry is not None:
                tally.add(minute, entry.event.topic, kind)
            if outcome.state is EventState.PENDING and outcome.delay is not None:
                # Armed after the write, so the timer can never fire before run_at.
                self._wake_at(now + outcome.delay)
            if outcome.refund:
                continue  # snoozes and hand-backs spend no attempt and count as neither
            if outcome.error is not None and entry is not None:
                log_outcome(entry.event, outcome, self.failure_log)
            if outcome.state is EventState.SUCCEEDED:
                s.succeeded += 1
            elif outcome.state is EventState.PENDING:
                s.retried += 1
            elif outcome.state is EventState.FAILED:
                s.failed += 1
            elif outcome.state is EventState.CANCELLED:
                s.cancelled += 1
        self.running.freed.set()
        self._room_freed(freed)

    def _observe(self, batch: list[Outcome], done: set[int]) -> None:
        """Hand the observers the written outcomes of handler calls (before the
        slots are freed: the running set still holds their events)."""
        entries = self.running.entries
        settled = []
        for outcome in batch:
            entry = entries.get((outcome.event_id, outcome.attempt))
            if entry is not None and hasattr(outcome, "started") and outcome.event_id in done:
                settled.append((entry.event, outcome))
        if not settled:
            return
        for observer in self._observers:
            try:
                observer.observe_settled(settled)
            except Exception:   # raised here, it would leave the batch's slots taken
                log.exception("%s failed to observe %d outcomes", type(observer).__name__,
                              len(settled), extra={"action": "middleware_failed"})
