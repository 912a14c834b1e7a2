"""Enqueue in a SQLAlchemy session: the event commits and rolls back with the business rows."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy import ForeignKey, String, create_engine, text
from sqlalchemy.engine import URL, Engine
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from conveyor import NewEvent, Producer, ProducerConfig
from conveyor.contrib.sqlalchemy import aenqueue, aenqueue_many, enqueue, enqueue_many
from conveyor.errors import ConfigError
from conveyor.schema.migrator import Migrator


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(String(50))


class Line(Base):
    __tablename__ = "order_lines"
    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[int] = mapped_column(ForeignKey("orders.id"))


def _engine_args(conninfo: str) -> tuple[URL, dict[str, Any]]:
    """The test database as an engine URL on psycopg 3 (a socket directory goes in the query)."""
    d = conninfo_to_dict(conninfo)
    host = str(d.get("host") or "") or None
    socket = host is not None and host.startswith("/")
    url = URL.create("postgresql+psycopg", username=d.get("user"), password=d.get("password"),
                     host=None if socket else host, port=int(d["port"]) if d.get("port") else None,
                     database=d.get("dbname"), query={"host": host} if socket and host else {})
    return url, {}


@pytest.fixture
def engine(fresh_db: str) -> Iterator[Engine]:
    url, options = _engine_args(fresh_db)
    engine = create_engine(url, **options)
    Base.metadata.create_all(engine)
    yield engine
    engine.dispose()


def _events(url: str) -> list[tuple[str, Any]]:
    with psycopg.connect(url) as conn:
        return [tuple(r) for r in conn.execute(
            "SELECT topic, payload FROM conveyor.events ORDER BY id").fetchall()]


def _orders(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM orders").fetchone()
    assert row is not None
    return int(row[0])


def test_a_rolled_back_session_leaves_neither_the_order_nor_the_event(
        engine: Engine, fresh_db: str) -> None:
    with Session(engine) as session:
        session.add(Order(customer="acme"))
        event_id = enqueue(session, "order.created", {"customer": "acme"})
        assert event_id > 0
        session.rollback()
    assert _events(fresh_db) == [] and _orders(fresh_db) == 0


def test_a_committed_session_keeps_both_and_the_event_sees_the_flushed_id(
        engine: Engine, fresh_db: str) -> None:
    with Session(engine) as session, session.begin():
        order = Order(customer="acme")
        session.add(order)
        assert order.id is None
        # flush=True (the default) writes the order, and gives it its id, before the event.
        enqueue(session, "order.created", {"customer": "acme"})
        order_id = order.id
        assert order_id is not None
        session.add(Line(order_id=order_id))
        enqueue_many(session, [NewEvent(topic="order.line", payload={"order": order_id}),
                               ("order.audit", {"order": order_id})])
    assert _orders(fresh_db) == 1
    assert _events(fresh_db) == [("order.created", {"customer": "acme"}),
                                 ("order.line", {"order": order_id}),
                                 ("order.audit", {"order": order_id})]


def test_a_producer_chooses_the_schema(engine: Engine, fresh_db: str) -> None:
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        Migrator("jobs").apply(conn)
    with Session(engine) as session, session.begin():
        enqueue(session, "x.y", producer=Producer(ProducerConfig(schema="jobs")), delay=60)
    with psycopg.connect(fresh_db) as conn:
        row = conn.execute("SELECT topic, run_at > now() FROM jobs.events").fetchone()
    assert row == ("x.y", True)


def test_another_driver_is_refused_naming_it() -> None:
    engine = create_engine("sqlite://")
    with Session(engine) as session, pytest.raises(
            ConfigError, match=r"psycopg 3 \(postgresql\+psycopg://\), got the sqlite\+pysqlite"):
        enqueue(session, "x.y")


async def test_an_async_session_commits_and_rolls_back_with_the_event(fresh_db: str) -> None:
    url, options = _engine_args(fresh_db)
    engine = create_async_engine(url, **options)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
        async with AsyncSession(engine) as session:
            session.add(Order(customer="rolled"))
            await aenqueue(session, "order.created", {"customer": "rolled"})
            await session.rollback()
        async with AsyncSession(engine) as session, session.begin():
            order = Order(customer="kept")
            session.add(order)
            await aenqueue(session, "order.created", {"customer": "kept"})
            await aenqueue_many(session, [("order.audit", {"customer": "kept"})])
            await session.execute(text("SELECT 1"))
    finally:
        await engine.dispose()
    assert _orders(fresh_db) == 1
    assert _events(fresh_db) == [("order.created", {"customer": "kept"}),
                                 ("order.audit", {"customer": "kept"})]
