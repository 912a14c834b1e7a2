"""A migrated database per module, emptied per test (as tests/worker does)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest

from schema_reset import reset_database


@pytest.fixture(scope="module")
def module_db(make_db: Callable[..., contextlib.AbstractContextManager[str]],
              template_db: str) -> Iterator[str]:
    with make_db(prefix="conveyor_m_", template=template_db) as url:
        yield url


@pytest.fixture
def db(module_db: str) -> Iterator[str]:
    reset_database(module_db)
    yield module_db
