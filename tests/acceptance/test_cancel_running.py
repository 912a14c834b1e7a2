"""Cancelling running events in a real worker process, from the real CLI.

The worker's leases outlast the test (heartbeat every 40 s): only the
notification the cancel commits can stop the handlers this soon. An async
handler's task is cancelled; a plain one in a thread sees ``event.cancelled``
and returns. Both events stay ``cancelled``: never retried, nothing handed
back when the worker stops afterwards.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable

import psycopg
import pytest

from conveyor import NewEvent, Producer
from waiting import wait_for

from .cancel_apps import CANCEL_LEDGER_DDL
from .helpers import WorkerProcess, query, run_cli

pytestmark = pytest.mark.slow

APP = "tests.acceptance.cancel_apps:router"
PROMPT = 15.0


def _ledger(url: str) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for event_id, what in query(url, "SELECT event_id, what FROM public.cancel_ledger "
                                     "ORDER BY at"):
        found.setdefault(event_id, []).append(what)
    return found


def test_cancel_stops_a_running_async_and_a_running_plain_handler(
        acc_db: str, spawn: Callable[..., WorkerProcess]) -> None:
    with psycopg.connect(acc_db) as conn:
        conn.execute(CANCEL_LEDGER_DDL)
        ids = Producer().enqueue_many(conn, [NewEvent(topic="cancel.async"),
                                             NewEvent(topic="cancel.sync")])
        conn.commit()
    worker = spawn(acc_db, "--lease-ttl", "120", app=APP)
    wait_for(lambda: _ledger(acc_db) == {i: ["started"] for i in ids}, PROMPT,
             "both handlers to start", alive=[worker])

    cancelled_at = time.monotonic()
    for event_id in ids:
        done = run_cli("--database-url", acc_db, "cancel", str(event_id))
        assert done.returncode == 0, done.stderr
    wait_for(lambda: _ledger(acc_db) == {ids[0]: ["started", "task cancelled"],
                                         ids[1]: ["started", "saw cancelled"]},
             PROMPT, "both handlers to stop", alive=[worker])
    print(f"\nboth handlers stopped {time.monotonic() - cancelled_at:.2f}s after the first "
          "cancel was sent (CLI start included)")

    worker.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0, worker.log()[-3000:]
    rows = query(acc_db, "SELECT id, state, attempts, lease_owner FROM conveyor.events "
                         "ORDER BY id")
    assert rows == [(ids[0], "cancelled", 1, None), (ids[1], "cancelled", 1, None)]
    assert _ledger(acc_db) == {ids[0]: ["started", "task cancelled"],
                               ids[1]: ["started", "saw cancelled"]}
    log = worker.log()
    assert log.count("was cancelled while it ran") == 2, log[-3000:]
    assert "lost the lease" not in log, log[-3000:]
