"""Helpers for tests of one migration on a populated table of the version before it."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from conveyor.schema import migrator_core as migrator_module
from conveyor.schema.migrator import Migrator, load_migrations


def storage(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """relfilenode of the events table and each of its indexes: new ones mean a rewrite."""
    return dict(conn.execute(
        "SELECT c.relname, c.relfilenode FROM pg_class c"
        " WHERE c.oid = 'conveyor.events'::regclass"
        "    OR c.oid IN (SELECT indexrelid FROM pg_index"
        "                 WHERE indrelid = 'conveyor.events'::regclass)").fetchall())


def migrate_to(url: str, version: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Apply the migrations up to ``version`` only, as an older Conveyor would have."""
    with monkeypatch.context() as patch:
        patch.setattr(migrator_module, "load_migrations", lambda: load_migrations()[:version])
        with psycopg.connect(url, autocommit=True) as conn:
            assert [m.version for m in Migrator().apply(conn)][-1] == version
