"""A migrated database per module, emptied per test (as tests/worker does)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import psycopg
import pytest


@pytest.fixture(scope="module")
def module_db(make_db: Callable[..., contextlib.AbstractContextManager[str]],
              template_db: str) -> Iterator[str]:
    with make_db(prefix="conveyor_m_", template=template_db) as url:
        yield url


@pytest.fixture
def db(module_db: str) -> Iterator[str]:
    with psycopg.connect(module_db, autocommit=True) as conn:
        conn.execute("SET lock_timeout = '5s'")
        conn.execute("TRUNCATE conveyor.events, conveyor.workers RESTART IDENTITY")
    yield module_db
