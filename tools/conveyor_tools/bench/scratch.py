"""The benchmark's scratch schemas: created at the start, dropped at the end.

Conveyor is measured in its own freshly migrated schema (``<schema>_bench``),
never in the user's: the drains count every row and truncate between runs.
The raw baseline gets a second one (``<schema>_bench_raw``). Each carries a
marker comment, so a run that was killed leaves schemas the next run can
recognise and drop, and a schema of the same name that is *not* ours is
refused instead of dropped. A session advisory lock keeps two benchmarks
from running on one database at once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from conveyor.config import ProducerConfig
from conveyor.errors import ConveyorError
from conveyor.producer import NewEvent, Producer
from conveyor.schema.migrator import Migrator
from conveyor_tools.bench.baseline import copy_rows, create_table

MARKER = "conveyor bench scratch schema: dropped when the benchmark ends"
FILL_BATCH = 1000


class BenchError(ConveyorError):
    """The benchmark could not run or a measurement went wrong."""


@dataclass(frozen=True, slots=True)
class Schemas:
    conveyor: str
    raw: str

    @property
    def all(self) -> tuple[str, str]:
        return (self.conveyor, self.raw)


def schemas_for(base: str) -> Schemas:
    stem = base[:30]  # schema names are at most 40 characters
    return Schemas(conveyor=f"{stem}_bench", raw=f"{stem}_bench_raw")


def _table(schema: str, name: str = "events") -> sql.Identifier:
    return sql.Identifier(schema, name)


def lock(conn: psycopg.Connection[Any], schemas: Schemas) -> None:
    """Hold a session lock for the run; refuse when another benchmark holds it."""
    row = conn.execute("SELECT pg_try_advisory_lock(hashtext(%s))",
                       (f"conveyor.bench:{schemas.conveyor}",)).fetchone()
    if not row or not row[0]:
        raise BenchError("another 'conveyor bench' is running on this database; try again later")


def _comment(conn: psycopg.Connection[Any], schema: str) -> str | bool | None:
    """The schema's comment; ``False`` when the schema does not exist."""
    row = conn.execute(
        "SELECT obj_description(oid, 'pg_namespace') FROM pg_namespace WHERE nspname = %s",
        (schema,)).fetchone()
    return False if row is None else row[0]


def create(conn: psycopg.Connection[Any], schemas: Schemas) -> None:
    """Create both schemas from scratch (dropping leftovers of an interrupted run)."""
    for schema in schemas.all:
        comment = _comment(conn, schema)
        if comment is not False and comment != MARKER:
            raise BenchError(f"schema {schema!r} exists and is not a conveyor bench scratch "
                             "schema; refusing to touch it")
    drop(conn, schemas)
    Migrator(schemas.conveyor).apply(conn)
    conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schemas.raw)))
    create_table(conn, schemas.raw)
    for schema in schemas.all:
        conn.execute(sql.SQL("COMMENT ON SCHEMA {} IS {}").format(
            sql.Identifier(schema), sql.Literal(MARKER)))


def drop(conn: psycopg.Connection[Any], schemas: Schemas) -> None:
    for schema in schemas.all:
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def reset(conn: psycopg.Connection[Any], schema: str) -> None:
    """Empty a scratch schema's events (and the worker registry and orders, where they exist).

    A table left full of dead rows would be vacuumed by autovacuum at a
    random moment, perhaps in the middle of another drain, whose time and
    WAL it would then add to.
    """
    conn.execute(sql.SQL("TRUNCATE {}").format(_table(schema)))
    for name in ("workers", "orders", "event_dependencies"):
        exists = conn.execute("SELECT to_regclass(%s) IS NOT NULL",
                              (sql.Identifier(schema, name).as_string(),)).fetchone()
        if exists and exists[0]:
            conn.execute(sql.SQL("TRUNCATE {}").format(_table(schema, name)))


def settle(conn: psycopg.Connection[Any], schema: str) -> None:
    """VACUUM ANALYZE and CHECKPOINT before a drain, the same for every system."""
    conn.execute(sql.SQL("VACUUM ANALYZE {}").format(_table(schema)))
    try:
        conn.execute("CHECKPOINT")
    except psycopg.errors.InsufficientPrivilege:
        pass  # not superuser nor pg_checkpoint: every system runs without it alike


def wal_lsn(conn: psycopg.Connection[Any]) -> str:
    """Where the server inserts its next WAL record (global: every session's writes move it)."""
    row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
    assert row is not None
    return str(row[0])


def wal_since(conn: psycopg.Connection[Any], lsn: str) -> int:
    """Bytes of WAL inserted since ``lsn``."""
    row = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), %s::pg_lsn)::bigint",
                       (lsn,)).fetchone()
    assert row is not None
    return int(row[0])


def fill_conveyor(url: str, schema: str, topic: str, count: int,
                  before_commit: Callable[[], None] | None = None, *,
                  head_sampled: float | None = None) -> str:
    """Enqueue ``count`` no-op events with Conveyor's own batch producer, one commit.

    Returns the WAL position read inside the fill's transaction just before
    its commit: the commit is what wakes a worker, so WAL from there on is the
    drain's, apart from the commit record itself (tens of bytes for the
    whole fill). ``before_commit`` runs right after that reading.

    ``head_sampled``: each event is enqueued on its own inside a request span
    of a ``ParentBased(TraceIdRatioBased(head_sampled))`` SDK provider (set
    as this process's global one), as a web application traced at the head
    writes them: that share of the rows carries a sampled context, the rest
    their request's unsampled one.
    """
    producer = Producer(ProducerConfig(schema=schema))
    if head_sampled is not None:
        return _fill_head_sampled(url, producer, topic, count, before_commit, head_sampled)
    with psycopg.connect(url) as conn:
        for start in range(0, count, FILL_BATCH):
            stop = min(count, start + FILL_BATCH)
            producer.enqueue_many(conn, [NewEvent(topic=topic, payload={"i": i})
                                         for i in range(start, stop)])
        return _commit_at(conn, before_commit)


def _fill_head_sampled(url: str, producer: Producer, topic: str, count: int,
                       before_commit: Callable[[], None] | None, ratio: float) -> str:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        trace.set_tracer_provider(TracerProvider(sampler=ParentBased(TraceIdRatioBased(ratio))))
    tracer = trace.get_tracer("conveyor_tools.bench")
    with psycopg.connect(url) as conn:
        for i in range(count):
            with tracer.start_as_current_span("request"):
                producer.enqueue(conn, topic, {"i": i})
        return _commit_at(conn, before_commit)


def fill_raw(url: str, schema: str, topic: str, count: int,
             before_commit: Callable[[], None] | None = None) -> str:
    """COPY ``count`` rows into the baseline table, one commit; the WAL position before it.

    As for Conveyor's fill, though here ``go`` starts the drain, not the commit.
    """
    with psycopg.connect(url) as conn:
        copy_rows(conn, schema, ((topic, json.dumps({"i": i})) for i in range(count)))
        return _commit_at(conn, before_commit)


def _commit_at(conn: psycopg.Connection[Any], before_commit: Callable[[], None] | None) -> str:
    lsn = wal_lsn(conn)
    if before_commit is not None:
        before_commit()
    conn.commit()
    return lsn


@dataclass(frozen=True, slots=True)
class DrainStats:
    total: int
    succeeded: int
    retried: int
    first_claim: float | None
    last_finish: float | None

    def check(self, expected: int, who: str) -> float:
        """Seconds from first claim to last finish, after checking every event ran once."""
        if self.total != expected or self.succeeded != expected:
            raise BenchError(f"{who}: expected {expected} succeeded events, found "
                             f"{self.succeeded} of {self.total}")
        if self.retried:
            raise BenchError(f"{who}: {self.retried} events ran more than once")
        if self.first_claim is None or self.last_finish is None \
                or self.last_finish <= self.first_claim:
            raise BenchError(f"{who}: no usable claim/finish timestamps")
        return self.last_finish - self.first_claim


def drain_stats(conn: psycopg.Connection[Any], schema: str) -> DrainStats:
    row = conn.execute(sql.SQL(
        "SELECT count(*), count(*) FILTER (WHERE state = 'succeeded'),"
        " count(*) FILTER (WHERE attempts <> 1),"
        " extract(epoch FROM min(attempted_at))::float8,"
        " extract(epoch FROM max(finished_at))::float8 FROM {}").format(_table(schema))).fetchone()
    assert row is not None
    return DrainStats(*row)


def unfinished(conn: psycopg.Connection[Any], schema: str) -> bool:
    """Whether any event is still pending or running (both through partial indexes)."""
    t = _table(schema)
    row = conn.execute(sql.SQL(
        "SELECT EXISTS (SELECT 1 FROM {} WHERE state = 'pending')"
        " OR EXISTS (SELECT 1 FROM {} WHERE state = 'running')").format(t, t)).fetchone()
    return bool(row and row[0])
