"""The wake gate from the worker's side (conveyor/worker/wake_hold.py).

A producer sends a wake-up only while a worker holds the gate; an idle worker
holds it, a busy one lets it go. With a minute's poll, only the gate's
retries or a NOTIFY can explain an event claimed within seconds.
"""

from __future__ import annotations

import threading

import psycopg

from conveyor import Event, NewEvent, Producer, Router, Worker
from waiting import wait_until
from worker_support import enqueue, enqueue_many, fast_config, query, running

SLOW_POLL = 60.0
WAKE_BOUND = SLOW_POLL / 4


async def _gate_locks(db: str) -> dict[str, int]:
    """Shared gate slots held, by the application name's role of the holding session."""
    rows = await query(db, """
        SELECT a.application_name AS who, count(*) AS n FROM pg_locks l
        JOIN pg_stat_activity a ON a.pid = l.pid
        WHERE l.locktype = 'advisory' AND l.mode = 'ShareLock' AND l.granted
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND l.classid::int = hashtext('conveyor.events')
        GROUP BY 1""")
    return {r["who"]: int(r["n"]) for r in rows}


def _router(seen: list[str], gate: threading.Event | None = None) -> Router:
    router = Router()

    def handle(event: Event) -> None:
        if gate is not None:
            gate.wait(30)
        seen.append(event.topic)

    router.add("gate.*", handle)
    return router


async def test_a_worker_idle_behind_a_producer_that_sent_no_wake_up_claims_after_its_commit(
        db: str) -> None:
    """The race the gate closes: a producer writes while nobody waits (so it sends no
    wake-up), a worker starts waiting before it commits; the worker cannot take the
    producer's slot, tries again, and claims once the producer has committed."""
    seen: list[str] = []
    with psycopg.connect(db) as producer:
        Producer().enqueue(producer, "gate.a")     # nobody waits yet: it takes its slot
        worker = Worker(db, _router(seen), fast_config(poll_interval=SLOW_POLL))
        async with running(worker):
            hold = worker.claims.hold

            async def waiting_without_the_slot() -> bool:
                return hold.on_fetch and hold.gate.held not in (0, 0xFF)
            await wait_until(waiting_without_the_slot, timeout=10, what="a hold short of a slot")
            assert seen == []
            producer.commit()
            took = await wait_until(lambda: _true(seen == ["gate.a"]), timeout=WAKE_BOUND,
                                    what="the event claimed after the producer's commit")
            assert took < WAKE_BOUND
            # The claim that found it comes before the hold that follows a short
            # claim (with eager tasks the handler has run by then): held again after.
            await wait_until(lambda: _true(hold.gate.whole), timeout=10,
                             what="the whole gate held again")


async def _true(value: bool) -> bool:
    return value


async def test_a_busy_worker_lets_the_gate_go_and_holds_it_again_when_idle(db: str) -> None:
    seen: list[str] = []
    release = threading.Event()
    config = fast_config(poll_interval=SLOW_POLL, concurrency=5, batch_size=5)
    worker = Worker(db, _router(seen, release), config)
    try:
        async with running(worker):
            async def holds(n: int) -> bool:
                return sum((await _gate_locks(db)).values()) == n
            # Idle: the fetch connection holds the eight slots, the LISTEN one none.
            await wait_until(lambda: holds(8), timeout=10, what="an idle worker's hold")
            assert worker.claims.hold.gate.whole and not worker.listener.gate.held
            # A backlog: full claims, so the gate is let go; producers wake nobody.
            await enqueue_many(db, [_event(i) for i in range(20)])
            await wait_until(lambda: holds(0), timeout=10, what="a busy worker's release")
            notified = worker.listener.notifications
            await enqueue(db, "gate.more")
            release.set()
            await wait_until(lambda: _true(len(seen) == 21), timeout=WAKE_BOUND,
                             what="the backlog drained")
            assert worker.listener.notifications == notified     # nobody was woken
            # Caught up: held again, and the next event wakes it at once.
            await wait_until(lambda: holds(8), timeout=10, what="the hold once idle")
            await enqueue(db, "gate.last")
            await wait_until(lambda: _true(len(seen) == 22), timeout=WAKE_BOUND,
                             what="a woken claim")
            assert worker.listener.notifications == notified + 1
    finally:
        release.set()


def _event(i: int) -> NewEvent:
    return NewEvent(topic="gate.backlog", payload={"i": i})


async def test_with_claim_windows_the_listen_connection_holds_the_gate(db: str) -> None:
    seen: list[str] = []
    worker = Worker(db, _router(seen), fast_config(poll_interval=SLOW_POLL, claim_window=0.05))
    async with running(worker):
        assert not worker.claims.hold.on_fetch
        await wait_until(lambda: _true(worker.listener.gate is not None
                                       and worker.listener.gate.whole),
                         timeout=10, what="the listener's hold")
        await enqueue(db, "gate.windowed")
        await wait_until(lambda: _true(seen == ["gate.windowed"]), timeout=WAKE_BOUND,
                         what="a woken windowed claim")
