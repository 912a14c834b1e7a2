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

Under pytest-xdist (``scripts/test.sh`` runs the suite in two tiers) every
worker process has its own session: its own template, shared database and
clones, each named with the worker's id and a random suffix, so no two
workers ever create, clone or drop the same database. Tests that must have the
machine to themselves carry the ``serial`` marker, put on by hand or, for the
fixtures in ``SERIAL_FIXTURES``, by ``pytest_collection_modifyitems`` below;
those that may share it with one other light test of their kind, ``paired``.
"""

from __future__ import annotations

import contextlib
import os
import queue
import tempfile
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from conveyor.schema.migrator import Migrator

SCHEMA = "conveyor"


def _admin_exec(url: str, statement: str | sql.Composable) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(statement.encode() if isinstance(statement, str) else statement)


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    """URL of a server where tests may create and drop databases."""
    url = os.environ.get("CONVEYOR_TEST_DATABASE_URL")
    if url:
        yield url
        return
    from conveyor.embedded import EmbeddedPostgres

    tmp = tempfile.mkdtemp(prefix="conveyor-test-")
    os.chmod(tmp, 0o755)
    server = EmbeddedPostgres(os.path.join(tmp, "pg18"))
    yield server.start()
    server.stop()


def database_url(server_url: str, dbname: str) -> str:
    return make_conninfo(server_url, dbname=dbname)


def database_name(prefix: str) -> str:
    """``prefix``, the xdist worker's id when there is one (``gw0_``), and a random suffix.

    The random part alone keeps names apart; the worker's id says whose a
    database left behind by a killed run was.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return f"{prefix}{worker + '_' if worker else ''}{uuid.uuid4().hex[:12]}"


def _drop_statement(name: str) -> sql.Composed:
    return sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))


class _BackgroundDropper:
    """Drops databases on a thread of its own, in order, over one admin connection.

    Under xdist a test's teardown need not wait for its database to go: the
    next test starts while the server drops it (DROP DATABASE waits for its
    sessions to end and for the server to let go of the files). ``close``
    waits for every drop and raises the first that failed, so a database a
    test made is still dropped before the session ends, or the session fails.
    """

    def __init__(self, server_url: str) -> None:
        self._server_url = server_url
        self._names: queue.Queue[str | None] = queue.Queue()
        self._errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="drop-databases", daemon=True)
        self._thread.start()

    def drop(self, name: str) -> None:
        self._names.put(name)

    def _run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        while (name := self._names.get()) is not None:
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self._server_url, autocommit=True)
                conn.execute(_drop_statement(name))
            except psycopg.Error as exc:   # raised by close()
                self._errors.append(exc)
                if conn is not None:
                    conn.close()
        if conn is not None:
            conn.close()

    def close(self) -> None:
        self._names.put(None)
        self._thread.join()
        if self._errors:
            raise self._errors[0]


@contextlib.contextmanager
def _new_database(server_url: str, prefix: str, template: str | None,
                  dropper: _BackgroundDropper | None = None) -> Iterator[str]:
    name = database_name(prefix)
    create = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template is not None:
        create += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
    _admin_exec(server_url, create)
    try:
        yield database_url(server_url, name)
    finally:
        if dropper is not None:
            dropper.drop(name)
        else:
            _admin_exec(server_url, _drop_statement(name))


MakeDb = Callable[..., contextlib.AbstractContextManager[str]]


@pytest.fixture(scope="session")
def make_db(server_url: str) -> Iterator[MakeDb]:
    """Factory of throwaway databases: ``with make_db(prefix=..., template=...) as url``.

    Creates a database named ``prefix`` plus a random suffix, cloned from
    ``template`` (a database name) or empty when it is None, yields its URL and
    drops it WITH (FORCE) on exit, also when the body raises. Session-scoped so
    module- and session-scoped fixtures can use it, e.g. to fill a big table
    once per module.

    Under xdist (the parallel and paired tiers) the drop is handed to a
    background thread and the session's end waits for all of them: in the
    parallel tier (2026-12-03) creating and dropping took 368 s of its 2,021 s
    of test time, the drops 124 s. Run alone (the serial tier, plain pytest)
    a drop still finishes before the next test starts: those tests time
    themselves or need the server to themselves.
    """
    dropper = _BackgroundDropper(server_url) if os.environ.get("PYTEST_XDIST_WORKER") else None

    def make(*, prefix: str, template: str | None = None) -> contextlib.AbstractContextManager[str]:
        return _new_database(server_url, prefix, template, dropper)
    yield make
    if dropper is not None:
        dropper.close()


@pytest.fixture(scope="session")
def template_db(make_db: MakeDb) -> Iterator[str]:
    """A migrated database used as the template of every fresh database (its name)."""
    with make_db(prefix="conveyor_tpl_") as url:
        with psycopg.connect(url, autocommit=True) as conn:
            Migrator(SCHEMA).apply(conn)
        yield conninfo_to_dict(url)["dbname"]


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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(name in SERIAL_FIXTURES for name in getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.serial)
        # scripts/test.sh runs each tier with -m: a test in two tiers would run twice.
        if item.get_closest_marker("serial") and item.get_closest_marker("paired"):
            raise pytest.UsageError(f"{item.nodeid} is marked both serial and paired")
