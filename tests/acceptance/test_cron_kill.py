"""Cron without a leader, under SIGKILL: four worker processes share a one-second schedule
while a random one is killed every second or so; every slot is enqueued exactly once.

CONVEYOR_CRON_SOAK_SECONDS sets how long the killing goes on (default 40; the
figure in docs/cron.md comes from a 300-second run).
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest

from waiting import wait_for

from .helpers import WorkerProcess, query

APP = "tests.acceptance.cron_apps:router"
SOAK_SECONDS = float(os.environ.get("CONVEYOR_CRON_SOAK_SECONDS", "40"))

pytestmark = pytest.mark.timeout(SOAK_SECONDS + 120)


def test_four_killed_and_restarted_workers_fire_every_second_exactly_once(
        acc_db: str, spawn: Callable[..., WorkerProcess]) -> None:
    def start() -> WorkerProcess:
        return spawn(acc_db, "--concurrency", "10", app=APP)

    procs = [start() for _ in range(4)]
    # The soak's clock starts with the first slot: four interpreters starting on a
    # loaded machine once took 9 s of it, and the slots counted fell short.
    wait_for(lambda: query(acc_db, "SELECT count(*) FROM conveyor.cron_slots")[0][0] > 0, 60,
             "the first slot to fire", alive=procs)
    rng = random.Random(20261201)
    kills = 0
    started = time.monotonic()
    while time.monotonic() - started < SOAK_SECONDS:
        time.sleep(rng.uniform(0.3, 1.5))
        victim = rng.randrange(len(procs))
        procs[victim].signal(signal.SIGKILL)
        procs[victim].wait(timeout=10)
        kills += 1
        if rng.random() < 0.3:
            time.sleep(rng.uniform(0.5, 2.0))   # sometimes the fleet runs one short a while
        procs[victim] = start()
    # Quiet for a few seconds, then a clean stop: the last slots fire and settle.
    time.sleep(4)
    stopped_at = datetime.now(UTC)
    for proc in procs:
        proc.signal(signal.SIGTERM)
    for proc in procs:
        assert proc.wait(timeout=30) == 0, proc.log()[-2000:]

    keys = [r[0] for r in query(acc_db, "SELECT idempotency_key FROM conveyor.events"
                                        " WHERE idempotency_key LIKE 'cron:every second@%%'")]
    slots = sorted(datetime.strptime(k.split("@", 1)[1], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
                   for k in keys)
    assert len(slots) == len(set(slots)), "a slot was enqueued twice"
    # Every second from the first slot on, none missed, up to shortly before the stop.
    expected = [slots[0] + timedelta(seconds=n)
                for n in range(int((stopped_at - slots[0]).total_seconds()) - 1)]
    missing = sorted(set(expected) - set(slots))
    assert missing == [], f"{len(missing)} slots never fired: {missing[:10]}"
    assert len(slots) >= SOAK_SECONDS
    # The slots' keys and the events agree one to one.
    [(slot_rows, linked)] = query(acc_db, "SELECT count(*), count(e.id) FROM conveyor.cron_slots s"
                                          " LEFT JOIN conveyor.events e ON e.id = s.event_id")
    assert slot_rows == linked == len(slots)
    [(missed,)] = query(acc_db, "SELECT missed FROM conveyor.cron_schedules")
    assert missed == 0
    print(f"\n{kills} SIGKILLs over {SOAK_SECONDS:.0f}s; {len(slots)} slots, each enqueued once, "
          f"none missed")
