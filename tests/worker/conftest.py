"""Fixtures for in-process worker tests: a migrated database per module, emptied per test.

The helpers they use live in ``tests/worker_support.py`` and ``tests/waiting.py``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import psycopg
import pytest

from schema_reset import reset_database
from worker_support import WORKER_BACKENDS


@pytest.fixture(scope="module")
def module_db(make_db: Callable[..., contextlib.AbstractContextManager[str]],
              template_db: str) -> Iterator[str]:
    """A migrated database for one test module (creating one per test costs ~1 s)."""
    with make_db(prefix="conveyor_w_", template=template_db) as url:
        yield url


@pytest.fixture
def db(module_db: str) -> Iterator[str]:
    """The module's database, every table emptied for this test; tests commit freely in it.

    Afterwards every worker of the test must have let go of its connections.
    """
    reset_database(module_db)
    yield module_db
    with psycopg.connect(module_db, autocommit=True) as conn:
        deadline = time.monotonic() + 3
        while True:
            row = conn.execute(WORKER_BACKENDS).fetchone()
            if row is None or row[0] == 0:
                break
            if time.monotonic() > deadline:
                rows = conn.execute("SELECT application_name, state, left(query, 80), backend_start "
                                    "FROM pg_stat_activity WHERE datname = current_database() "
                                    "AND application_name LIKE 'conveyor-%'").fetchall()
                pytest.fail(f"{row[0]} worker connections still open after the test: {rows}")
            time.sleep(0.02)
