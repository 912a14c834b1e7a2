"""``drain``: run a real worker step by step until no event is due."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from conveyor.config import WorkerConfig
from conveyor.router import Router
from conveyor.worker import Worker

MAX_BATCHES_DEFAULT = 100


@dataclass(frozen=True, slots=True)
class DrainResult:
    """What one :func:`drain` did.

    Attributes:
        batches: claim batches that found work.
        claimed: events claimed (an event retried within the drain counts again).
        succeeded / retried / failed / cancelled: acknowledged outcomes.
        handed_back: events given back unfinished.
    """

    batches: int
    claimed: int
    succeeded: int
    retried: int
    failed: int
    cancelled: int
    handed_back: int


async def drain(
    conninfo: str,
    router: Router,
    config: WorkerConfig | None = None,
    *,
    max_batches: int = MAX_BATCHES_DEFAULT,
) -> DrainResult:
    """Run ``Worker.run_once()`` until it finds no due event; returns the counts.

    The worker opens its own connections, so it sees only *committed* events:
    use it with a database of the test's own, not inside a rolled-back test
    transaction (see :func:`~conveyor.testing.work_event` for that). A failed
    attempt whose retry is scheduled in the future is left pending; pass
    ``WorkerConfig(backoff=BackoffPolicy(base_delay=0, max_delay=0))`` to run
    retries within the drain. Raises :class:`AssertionError` when events are
    still due after ``max_batches`` batches (a handler that snoozes forever).

    Defaults: ``config`` ``WorkerConfig()``, ``max_batches`` 100.

    Example::

        async def test_welcome_mail_is_sent(database_url):
            with CommittingProducer(database_url) as producer:
                producer.enqueue("email.send", {"to": "ada@example.com"})
            result = await drain(database_url, router)
            assert result.succeeded == 1
    """
    if isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1:
        raise ValueError(f"expected max_batches to be an integer >= 1, got {max_batches!r}")
    worker = Worker(conninfo, router, config)
    batches = 0
    try:
        while await worker.run_once():
            batches += 1
            if batches >= max_batches:
                if await worker.run_once():
                    raise AssertionError(
                        f"drain: events still due after {max_batches} batches "
                        f"({worker.stats.claimed} claims); is a handler snoozing forever?")
                break
    finally:
        await worker.close()
    s = worker.stats
    return DrainResult(batches=batches, claimed=s.claimed, succeeded=s.succeeded,
                       retried=s.retried, failed=s.failed, cancelled=s.cancelled,
                       handed_back=s.handed_back)


def drain_sync(
    conninfo: str,
    router: Router,
    config: WorkerConfig | None = None,
    *,
    max_batches: int = MAX_BATCHES_DEFAULT,
) -> DrainResult:
    """:func:`drain` for synchronous tests (runs its own event loop).

    Example::

        def test_welcome_mail_is_sent(database_url):
            ...
            assert drain_sync(database_url, router).succeeded == 1
    """
    return asyncio.run(drain(conninfo, router, config, max_batches=max_batches))
