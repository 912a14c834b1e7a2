"""Fixtures of the acceptance tests: a migrated database with a ledger, worker processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from .apps import LEDGER_DDL
from .helpers import WorkerProcess


def create_ledger(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(LEDGER_DDL.encode())


@pytest.fixture
def acc_db(fresh_db: str) -> str:
    """A fresh migrated database with an empty ledger table."""
    create_ledger(fresh_db)
    return fresh_db


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start ``conveyor worker`` processes; every one is killed at teardown."""
    started: list[WorkerProcess] = []

    def start(url: str, *args: str, **kwargs: str) -> WorkerProcess:
        worker = WorkerProcess(url, tmp_path / f"worker-{len(started)}.log", *args, **kwargs)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop()
