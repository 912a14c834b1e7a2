"""Where the tests' databases live: the session's server, or a module's own.

The session's server is ``CONVEYOR_TEST_DATABASE_URL`` when set, else a
private embedded PostgreSQL (``conftest.server_url``). Every database comes
from :func:`databases_on`'s factory, so each one is dropped however its test
ends. :func:`own_server` gives a module a server of its own: for tests whose
figures any other transaction on the server would move (the cluster-wide
xmin, which holds back VACUUM and an ordered relay's reads), so they need not
run alone in the serial tier.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from conveyor.schema.migrator import Migrator

SCHEMA = "conveyor"

MakeDb = Callable[..., contextlib.AbstractContextManager[str]]


@contextlib.contextmanager
def private_postgres(prefix: str = "conveyor-test-") -> Iterator[str]:
    """An embedded PostgreSQL in a temporary directory, for as long as the block runs."""
    from conveyor.embedded import EmbeddedPostgres

    tmp = tempfile.mkdtemp(prefix=prefix)
    os.chmod(tmp, 0o755)
    server = EmbeddedPostgres(os.path.join(tmp, "pg18"))
    try:
        yield server.start()
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def admin_exec(url: str, statement: str | sql.Composable) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(statement.encode() if isinstance(statement, str) else statement)


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
    admin_exec(server_url, create)
    try:
        yield database_url(server_url, name)
    finally:
        if dropper is not None:
            dropper.drop(name)
        else:
            admin_exec(server_url, _drop_statement(name))


def databases_on(server_url: str) -> Iterator[MakeDb]:
    """The body of the ``make_db`` fixtures: ``with make(prefix=..., template=...) as url``.

    Creates a database named ``prefix`` plus a random suffix, cloned from
    ``template`` (a database name) or empty when it is None, yields its URL and
    drops it WITH (FORCE) on exit, also when the body raises.

    Under xdist (the parallel and light tiers) the drop is handed to a
    background thread and the fixture's end waits for all of them: in the
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


def migrated_template(make_db: MakeDb) -> Iterator[str]:
    """The body of the ``template_db`` fixtures: a migrated database's name."""
    with make_db(prefix="conveyor_tpl_") as url:
        with psycopg.connect(url, autocommit=True) as conn:
            Migrator(SCHEMA).apply(conn)
        yield conninfo_to_dict(url)["dbname"]


def own_server(prefix: str) -> tuple[Any, Any, Any, Any]:
    """``server_url``, ``make_db``, ``template_db`` and ``shared_db_url`` for one module,
    on a server of its own started for it (about 3 s)::

        server_url, make_db, template_db, shared_db_url = own_server("conveyor-status-")

    The module's tests, and every fixture they use (``fresh_db``, ``conn``...),
    then make their databases there.
    """
    @pytest.fixture(scope="module", name="server_url")
    def server_url() -> Iterator[str]:
        with private_postgres(prefix) as url:
            yield url

    @pytest.fixture(scope="module", name="make_db")
    def make_db(server_url: str) -> Iterator[MakeDb]:
        yield from databases_on(server_url)

    @pytest.fixture(scope="module", name="template_db")
    def template_db(make_db: MakeDb) -> Iterator[str]:
        yield from migrated_template(make_db)

    @pytest.fixture(scope="module", name="shared_db_url")
    def shared_db_url(make_db: MakeDb, template_db: str) -> Iterator[str]:
        with make_db(prefix="conveyor_shared_", template=template_db) as url:
            yield url

    return server_url, make_db, template_db, shared_db_url
