"""Shared fixtures: a real PostgreSQL, never a mock.

The server is ``CONVEYOR_TEST_DATABASE_URL`` when set (CI points it at the
machine's server); otherwise a private embedded PostgreSQL started for the
session in a temporary directory. Two tiers:

* ``conn``: a connection to a shared migrated database inside a transaction
  that is rolled back after the test (fast; most tests).
* ``fresh_db``: the URL of a brand-new database cloned from a migrated
  template, dropped afterwards (commits, LISTEN/NOTIFY, multi-process races).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from conveyor.schema.migrator import Migrator

SCHEMA = "conveyor"


def _admin_exec(url: str, statement: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(statement.encode())


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


@pytest.fixture(scope="session")
def template_db(server_url: str) -> Iterator[str]:
    """A migrated database used as the template of every fresh database."""
    name = f"conveyor_tpl_{uuid.uuid4().hex[:10]}"
    _admin_exec(server_url, f'CREATE DATABASE "{name}"')
    url = database_url(server_url, name)
    with psycopg.connect(url, autocommit=True) as conn:
        Migrator(SCHEMA).apply(conn)
    yield name
    _admin_exec(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def shared_db_url(server_url: str, template_db: str) -> Iterator[str]:
    """One migrated database shared by the rolled-back tests."""
    name = f"conveyor_shared_{uuid.uuid4().hex[:10]}"
    _admin_exec(server_url, f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    yield database_url(server_url, name)
    _admin_exec(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


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
def fresh_db(server_url: str, template_db: str) -> Iterator[str]:
    """URL of a new migrated database of this test's own, dropped afterwards."""
    name = f"conveyor_t_{uuid.uuid4().hex[:12]}"
    _admin_exec(server_url, f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    yield database_url(server_url, name)
    _admin_exec(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def empty_db(server_url: str) -> Iterator[str]:
    """URL of a new database with no Conveyor schema at all."""
    name = f"conveyor_e_{uuid.uuid4().hex[:12]}"
    _admin_exec(server_url, f'CREATE DATABASE "{name}"')
    yield database_url(server_url, name)
    _admin_exec(server_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
