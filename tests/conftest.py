"""Shared fixtures: a real PostgreSQL, never a mock.

The server is ``CONVEYOR_TEST_DATABASE_URL`` when set (CI points it at the
machine's server); otherwise a private embedded PostgreSQL started for the
session in a temporary directory. Two tiers:

* ``conn``: a connection to a shared migrated database inside a transaction
  that is rolled back after the test (fast; most tests).
* ``fresh_db``: the URL of a brand-new database cloned from a migrated
  template, dropped afterwards (commits, LISTEN/NOTIFY, multi-process races).

Every database a test creates comes from ``make_db``, so each one is dropped
(``WITH (FORCE)``) however its test or fixture ends.

Under pytest-xdist (``scripts/test.sh`` runs the suite in three tiers) every
worker process has its own session: its own template, shared database and
clones, each named with the worker's id and a random suffix, so no two
workers ever create, clone or drop the same database. Tests that must have the
machine to themselves carry the ``serial`` marker, put on by hand or, for the
fixtures in ``SERIAL_FIXTURES``, by ``pytest_collection_modifyitems`` below;
those that may share it with three other light tests of their kind, ``light``.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from server_support import MakeDb, databases_on, migrated_template, private_postgres


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    """URL of a server where tests may create and drop databases."""
    url = os.environ.get("CONVEYOR_TEST_DATABASE_URL")
    if url:
        yield url
        return
    with private_postgres() as url:
        yield url


@pytest.fixture(scope="session")
def make_db(server_url: str) -> Iterator[MakeDb]:
    """Factory of throwaway databases (:func:`server_support.databases_on`).

    Session-scoped so module- and session-scoped fixtures can use it, e.g. to
    fill a big table once per module.
    """
    yield from databases_on(server_url)


@pytest.fixture(scope="session")
def template_db(make_db: MakeDb) -> Iterator[str]:
    """A migrated database used as the template of every fresh database (its name)."""
    yield from migrated_template(make_db)


@pytest.fixture(scope="session")
def shared_db_url(make_db: MakeDb, template_db: str) -> Iterator[str]:
    """One migrated database shared by the rolled-back tests."""
    with make_db(prefix="conveyor_shared_", template=template_db) as url:
        yield url


@pytest.fixture
def conn(shared_db_url: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection inside a transaction rolled back after the test."""
    with psycopg.connect(shared_db_url) as connection:
        yield connection
        connection.rollback()


@pytest.fixture
async def aconn(shared_db_url: str) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """Async twin of ``conn``."""
    connection = await psycopg.AsyncConnection.connect(shared_db_url)
    try:
        yield connection
    finally:
        await connection.rollback()
        await connection.close()


@pytest.fixture
def fresh_db(make_db: MakeDb, template_db: str) -> Iterator[str]:
    """URL of a new migrated database of this test's own, dropped afterwards."""
    with make_db(prefix="conveyor_t_", template=template_db) as url:
        yield url


@pytest.fixture
def empty_db(make_db: MakeDb) -> Iterator[str]:
    """URL of a new database with no Conveyor schema at all."""
    with make_db(prefix="conveyor_e_") as url:
        yield url


# Fixtures whose tests must run in the serial tier, and why. A test that takes
# one is marked ``serial`` wherever it lives, so new tests need no list.
SERIAL_FIXTURES = {
    "browser": "drives chromium: heavy on two cores, and its actions time out after 10 s",
}


# Measured seconds of the parallel tier's longest test files (a file's tests
# summed, one run on the loaded 2-core machine, 2026-12-05), for the order below.
# Refresh it when a file grows long: a missing or stale figure costs minutes of
# wall time at worst, never a result.
TESTS = Path(__file__).parent
FILE_SECONDS: dict[str, float] = json.loads((TESTS / "file_seconds.json").read_text())
# A file not listed: this much per test (most take a fraction of a second).
SECONDS_PER_TEST = 0.1


def _longest_files_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` file by file, the longest files first, each file's own order kept.

    With --dist loadfile, xdist hands a process a whole file when it is free;
    scripts/test.sh turns off xdist's own order (most tests first), under which
    a one-test file of 47 s started when the others were nearly done and three
    processes sat idle while it ran (2026-12-05). Longest first, the last files
    handed out are short ones.
    """
    counts: dict[Path, int] = {}
    for item in items:
        counts[item.path] = counts.get(item.path, 0) + 1

    def seconds(item: pytest.Item) -> float:
        name = item.path.relative_to(TESTS).as_posix() if item.path.is_relative_to(TESTS) else ""
        return FILE_SECONDS.get(name, SECONDS_PER_TEST * counts[item.path])
    items.sort(key=lambda item: -seconds(item))   # stable: a file's tests stay in order


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Off in the parallel tier (scripts/test.sh); the xdist processes see
    # --dist as "no", so this asks for the option that goes with it.
    if config.getoption("loadscopereorder", default=True) is False:
        _longest_files_first(items)
    for item in items:
        if any(name in SERIAL_FIXTURES for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.serial)
        # scripts/test.sh runs each tier with -m: a test in two tiers would run twice.
        if item.get_closest_marker("serial") and item.get_closest_marker("light"):
            raise pytest.UsageError(f"{item.nodeid} is marked both serial and light")
