"""SIGTERM with events in flight: finish what fits in the grace period, hand back the rest."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import psycopg
import pytest

from conveyor import NewEvent, Producer
from waiting import wait_for

from .helpers import WorkerProcess, query, state_counts

pytestmark = pytest.mark.slow

SHORT = 10
LONG = 10
SHUTDOWN_TIMEOUT = 3.0
EXIT_MARGIN = 5.0


@pytest.mark.parametrize("kind,sig", [("acc", signal.SIGTERM), ("sync", signal.SIGTERM),
                                      ("acc", signal.SIGINT)],
                         ids=["async_handlers", "thread_handlers", "sigint"])
def test_sigterm_finishes_short_events_and_hands_back_the_rest(
        acc_db: str, spawn: Callable[..., WorkerProcess], kind: str, sig: int) -> None:
    with psycopg.connect(acc_db) as conn:
        short = Producer().enqueue_many(conn, [NewEvent(topic=f"{kind}.term", payload={"sleep": 1})
                                               for _ in range(SHORT)])
        long = Producer().enqueue_many(conn, [NewEvent(topic=f"{kind}.term", payload={"sleep": 60})
                                              for _ in range(LONG)])
        conn.commit()
    worker = spawn(acc_db, "--shutdown-timeout", f"{SHUTDOWN_TIMEOUT:g}", "--concurrency", "50")
    wait_for(lambda: state_counts(acc_db).get("running", 0) == SHORT + LONG, 20,
             "every event in flight", interval=0.05, alive=[worker])

    worker.signal(sig)
    sent = time.monotonic()
    code = worker.wait(timeout=SHUTDOWN_TIMEOUT + EXIT_MARGIN + 5)
    took = time.monotonic() - sent
    print(f"[{kind} {signal.Signals(sig).name}] exited {code} {took:.2f}s after the signal "
          f"(shutdown_timeout {SHUTDOWN_TIMEOUT:g}s)")
    assert code == 0, worker.log()[-3000:]
    assert took <= SHUTDOWN_TIMEOUT + EXIT_MARGIN

    assert state_counts(acc_db) == {"succeeded": SHORT, "pending": LONG}
    # An unwritten history (NULL since 0020) is no error recorded.
    rows = query(acc_db, "SELECT id, state, attempts, COALESCE(errors, '[]'), run_at <= now(),"
                         " lease_owner FROM conveyor.events WHERE id = ANY(%s)", (long,))
    for _id, state, attempts, errors, due, owner in rows:
        assert (state, attempts, errors, due, owner) == ("pending", 0, [], True, None), \
            "handed back due now, the attempt not spent, no error recorded"
    ran = {e for (e,) in query(acc_db, "SELECT event_id FROM public.ledger")}
    assert ran == set(short)
    assert "handed back" in worker.log()


STUCK_THREADS = 40


def test_sigterm_with_many_stuck_thread_handlers_exits_within_bound(
        acc_db: str, spawn: Callable[..., WorkerProcess]) -> None:
    """Regression: stuck handler threads were joined 0.2 s each, one after the other."""
    with psycopg.connect(acc_db) as conn:
        Producer().enqueue_many(conn, [NewEvent(topic="sync.stuck", payload={"sleep": 60})
                                       for _ in range(STUCK_THREADS)])
        conn.commit()
    worker = spawn(acc_db, "--shutdown-timeout", f"{SHUTDOWN_TIMEOUT:g}", "--concurrency", "50")
    wait_for(lambda: state_counts(acc_db).get("running", 0) == STUCK_THREADS, 20,
             "every event in flight", interval=0.05, alive=[worker])
    worker.signal(signal.SIGTERM)
    sent = time.monotonic()
    code = worker.wait(timeout=SHUTDOWN_TIMEOUT + 0.2 * STUCK_THREADS + 15)
    took = time.monotonic() - sent
    print(f"exited {code} {took:.2f}s after SIGTERM with {STUCK_THREADS} stuck threads")
    assert code == 0
    assert state_counts(acc_db) == {"pending": STUCK_THREADS}
    assert query(acc_db, "SELECT count(*) FROM conveyor.events WHERE attempts <> 0") == [(0,)]
    assert took <= SHUTDOWN_TIMEOUT + EXIT_MARGIN
