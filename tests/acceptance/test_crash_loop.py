"""A poison event that kills its worker every time still ends up parked ``failed``.

Nothing in the dying process can record the failure, so it is the rescuer that
must count the lost attempts and park the event after the last one.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable

import pytest

from waiting import wait_for

from .helpers import WorkerProcess, query, run_cli

pytestmark = pytest.mark.slow

ARGS = ("--lease-ttl", "2", "--rescue-interval", "1", "--poll-interval", "30")
MAX_ATTEMPTS = 2


def test_event_that_kills_its_worker_is_parked_after_max_attempts(
        acc_db: str, spawn: Callable[..., WorkerProcess]) -> None:
    done = run_cli("--database-url", acc_db, "enqueue", "acc.killer", '{"crash": true}',
                   "--max-attempts", str(MAX_ATTEMPTS))
    event_id = int(done.stdout.strip())
    victims = []
    for attempt in range(1, MAX_ATTEMPTS + 1):
        victim = spawn(acc_db, *ARGS)
        victims.append(victim)
        assert victim.wait(timeout=30) == -signal.SIGKILL, victim.log()[-2000:]
        assert query(acc_db, "SELECT attempts, state FROM conveyor.events WHERE id = %s",
                     (event_id,)) == [(attempt, "running")]
    rescuer = spawn(acc_db, *ARGS)
    wait_for(lambda: query(acc_db, "SELECT state FROM conveyor.events WHERE id = %s",
                           (event_id,)) == [("failed",)],
             15, "the rescuer to park the event", alive=[rescuer])

    assert query(acc_db, "SELECT attempt, pid FROM public.ledger ORDER BY attempt") == \
        [(n, v.pid) for n, v in enumerate(victims, start=1)]
    shown = run_cli("--database-url", acc_db, "show", str(event_id), "--json")
    record = json.loads(shown.stdout)
    assert (record["state"], record["attempts"]) == ("failed", MAX_ATTEMPTS)
    assert [e["attempt"] for e in record["errors"]] == list(range(1, MAX_ATTEMPTS + 1))
    assert all("lease expired" in e["error"] for e in record["errors"])
    rescuer.signal(signal.SIGTERM)
    assert rescuer.wait(timeout=30) == 0
    assert query(acc_db, "SELECT count(*) FROM public.ledger") == [(MAX_ATTEMPTS,)], \
        "the rescuer never ran the parked event"


def _exit_code(worker: WorkerProcess) -> int:
    """The worker's exit code once it ends; its log if it does not within a minute."""
    try:
        return worker.wait(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker did not end within 60 s:\n{worker.log()[-4000:]}")


def test_event_that_kills_its_worker_inside_claim_windows_is_parked_too(
        acc_db: str, spawn: Callable[..., WorkerProcess]) -> None:
    """With claim windows the attempt that killed its worker is rolled back with the
    window; the window's record left behind makes the next claim count it."""
    args = (*ARGS, "--claim-window", "1")
    done = run_cli("--database-url", acc_db, "enqueue", "acc.killer", '{"crash": true}',
                   "--max-attempts", str(MAX_ATTEMPTS))
    event_id = int(done.stdout.strip())
    first = spawn(acc_db, *args)
    assert _exit_code(first) == -signal.SIGKILL, first.log()[-2000:]
    # Rolled back with the window: pending, nothing counted, the record left.
    assert query(acc_db, "SELECT attempts, state FROM conveyor.events WHERE id = %s",
                 (event_id,)) == [(0, "pending")]
    assert query(acc_db, "SELECT ids FROM conveyor.claim_windows") == [([event_id],)]
    second = spawn(acc_db, *args)
    assert _exit_code(second) == -signal.SIGKILL, second.log()[-2000:]
    # Its claim counted the lost attempt and leased the second before it ran.
    assert query(acc_db, "SELECT attempts, state FROM conveyor.events WHERE id = %s",
                 (event_id,)) == [(MAX_ATTEMPTS, "running")]
    rescuer = spawn(acc_db, *args)
    wait_for(lambda: query(acc_db, "SELECT state FROM conveyor.events WHERE id = %s",
                           (event_id,)) == [("failed",)],
             15, "the rescuer to park the event", alive=[rescuer])
    assert query(acc_db, "SELECT attempt, pid FROM public.ledger ORDER BY attempt") == \
        [(1, first.pid), (2, second.pid)]
    record = json.loads(run_cli("--database-url", acc_db, "show", str(event_id),
                                "--json").stdout)
    assert (record["state"], record["attempts"]) == ("failed", MAX_ATTEMPTS)
    errors = [(e["attempt"], e["error"]) for e in record["errors"]]
    assert [attempt for attempt, _ in errors] == [1, 2]
    assert "its claim window never committed" in errors[0][1]
    assert "lease expired" in errors[1][1]
    rescuer.signal(signal.SIGTERM)
    assert rescuer.wait(timeout=30) == 0
    assert query(acc_db, "SELECT count(*) FROM conveyor.claim_windows") == [(0,)]
