"""What every command needs: the database URL (or the embedded server) and the schema."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from typing import TYPE_CHECKING, Any

import psycopg

from conveyor.cli.durations import parse_count, parse_duration
from conveyor.db.connect import connect
from conveyor.errors import InvalidInputError
from conveyor.schema.migrator import Migrator
from conveyor.validation import check_schema_name

if TYPE_CHECKING:
    from conveyor.embedded import EmbeddedPostgres


class Context:
    def __init__(self, *, database_url: str | None, schema: str, data_dir: str | None) -> None:
        self.schema = check_schema_name(schema)
        self._url = database_url or None
        self._data_dir = data_dir
        self._embedded: EmbeddedPostgres | None = None
        self._conns: list[psycopg.Connection[Any]] = []

    @property
    def embedded(self) -> bool:
        return self._url is None

    def url(self) -> str:
        """The database URL; starts (and migrates) the embedded server when none is set."""
        if self._url is not None:
            return self._url
        if self._embedded is None:
            # Only here: a command given a URL never touches the optional embedded server.
            from conveyor.embedded import EmbeddedPostgres

            self._embedded = EmbeddedPostgres(self._data_dir)
            dsn = self._embedded.start()
            print(f"conveyor: using the embedded PostgreSQL in {self._embedded.data_dir}",
                  file=sys.stderr)
            with connect(dsn, autocommit=True) as conn:
                Migrator(self.schema).apply(conn)
            self._embedded_dsn = dsn
        return self._embedded_dsn

    def connect(self, *, autocommit: bool = True, check_schema: bool = True) -> psycopg.Connection[Any]:
        conn = connect(self.url(), autocommit=autocommit)
        self._conns.append(conn)
        if check_schema:
            Migrator(self.schema).require_current(conn)
        return conn

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.close()
            except Exception:  # noqa: BLE001 - closing on exit is best effort
                pass
        self._conns.clear()
        if self._embedded is not None:
            self._embedded.stop()
            self._embedded = None


def positive_int(text: str) -> int:
    """argparse type: a positive integer up to PostgreSQL's ``integer``; the message names it."""
    try:
        return parse_count(text)
    except InvalidInputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def duration(text: str) -> float:
    """argparse type: a duration such as 90, 45s, 30m, 12h, 7d or 1h30m."""
    try:
        return parse_duration(text)
    except InvalidInputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def moment(text: str) -> datetime:
    """argparse type: an ISO 8601 date and time with its UTC offset (``2031-03-30T09:00+02:00``,
    ``...Z``); a time without an offset names no moment and is refused."""
    try:
        value = datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid time {text!r}: expected ISO 8601 with an offset, e.g. "
            "2031-03-30T09:00:00+02:00 or 2031-03-30T07:00:00Z") from None
    if value.tzinfo is None or value.utcoffset() is None:
        raise argparse.ArgumentTypeError(
            f"invalid time {text!r}: it has no UTC offset (add Z or +HH:MM)")
    return value
