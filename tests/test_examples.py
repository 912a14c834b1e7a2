"""Every example runs: the quickstart router through a real worker, the producer script."""

from __future__ import annotations

import asyncio
import importlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import psycopg
import pytest

from conveyor import Admin, CommittingProducer, EventState, Worker, WorkerConfig
from server_support import own_server

ROOT = Path(__file__).resolve().parent.parent

# A server of its own: the relay example's ordered stream reads past no
# transaction still running on the server, and on the shared one the other
# tests' kept it waiting (61 s of the module's 65 in the CI run of 7578691).
server_url, make_db, template_db, shared_db_url = own_server("conveyor-examples-")


@pytest.fixture
def quickstart() -> Iterator[ModuleType]:
    sys.path.insert(0, str(ROOT))
    try:
        yield importlib.import_module("examples.quickstart")
    finally:
        sys.path.remove(str(ROOT))


def _states(url: str, ids: list[int]) -> dict[int, Any]:
    with psycopg.connect(url, autocommit=True) as conn:
        return {i: Admin().show(conn, i) for i in ids}


def test_quickstart_handlers_run_in_a_real_worker(fresh_db: str, quickstart: ModuleType) -> None:
    with CommittingProducer(fresh_db) as producer:
        mail = producer.enqueue("email.send", {"to": "ana@example.com"})
        no_address = producer.enqueue("email.send", {})
        charge = producer.enqueue("billing.charge", {"amount_cents": 990}, tenant="acme")

    async def work() -> None:
        worker = Worker(fresh_db, quickstart.router, WorkerConfig())
        try:
            assert await worker.run_once() == 3
        finally:
            await worker.close()

    asyncio.run(work())
    records = _states(fresh_db, [mail, no_address, charge])
    assert records[mail].state is EventState.SUCCEEDED
    assert records[charge].state is EventState.SUCCEEDED
    parked = records[no_address]
    assert parked.state is EventState.FAILED and parked.attempts == 1
    assert parked.last_error == "payload has no 'to' address"


def test_quickstart_serves_from_the_command_line(fresh_db: str) -> None:
    with CommittingProducer(fresh_db) as producer:
        ids = [producer.enqueue("email.send", {"to": f"user{i}@example.com"}) for i in range(5)]
        ids.append(producer.enqueue("billing.refund", {"amount_cents": 100}))
    env = dict(os.environ, CONVEYOR_DATABASE_URL=fresh_db)
    proc = subprocess.Popen(
        [sys.executable, "-m", "conveyor.cli.main", "worker",
         "--app", "examples.quickstart:router"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all(r.state is EventState.SUCCEEDED for r in _states(fresh_db, ids).values()):
                break
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
    assert all(r.state is EventState.SUCCEEDED for r in _states(fresh_db, ids).values()), output
    assert proc.returncode == 0, output


def test_producer_in_transaction_example_runs(fresh_db: str) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "producer_in_transaction.py"), fresh_db],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rolled back" in result.stdout
    with psycopg.connect(fresh_db) as conn:
        orders = conn.execute("SELECT customer FROM example_orders").fetchall()
        topics = conn.execute(
            "SELECT topic FROM conveyor.events ORDER BY id").fetchall()
    assert orders == [("ana",)]  # bob's order was rolled back
    assert [t for (t,) in topics] == [
        "order.created", "email.send", "billing.invoice", "billing.reminder"]


def test_relay_example_publishes_orders_and_the_ordered_ledger(fresh_db: str) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "relay_to_nats.py"), fresh_db],
        capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line.split(None, 1) for line in result.stdout.splitlines()]
    orders = [data for subject, data in lines if subject == "example.orders.order.created"]
    ledger = [data for subject, data in lines if subject == "example.ledger.ledger.posted"]
    assert sorted(orders) == [f'{{"order": {n}}}' for n in range(3)]
    # The ordered stream: in the order the transactions committed them.
    assert ledger == [f'{{"cents": {100 * (n + 1)}, "entry": {n}}}' for n in range(3)]


def test_workflow_example_runs_the_chord_and_reports_the_counts(fresh_db: str) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "workflow.py"), fresh_db],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "report: {'order': 1, 'in_stock': 49}" in result.stdout
    with psycopg.connect(fresh_db) as conn:
        states = conn.execute(
            "SELECT topic, state FROM conveyor.events ORDER BY id").fetchall()
    assert states == [("stock.reserve", "succeeded")] + [("stock.count", "succeeded")] * 3 \
        + [("stock.report", "succeeded")]
