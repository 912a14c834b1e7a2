"""Enqueue in a SQLAlchemy session's transaction (extra ``conveyor[sqlalchemy]``).

The event is written on the session's own connection, so it commits or rolls
back with the session's business rows: the outbox promise, with no raw
connection to dig out. The engine must use psycopg 3
(``postgresql+psycopg://``); the session's pending ORM changes are flushed
first by default, so an event can name a row's fresh primary key and a
trigger or foreign key on the events sees the rows it refers to.

Example::

    from conveyor.contrib.sqlalchemy import enqueue

    with Session(engine) as session, session.begin():
        order = Order(customer="acme", amount=120)
        session.add(order)
        session.flush()
        enqueue(session, "order.created", {"order_id": order.id})

``aenqueue`` does the same for an ``AsyncSession`` on
``create_async_engine("postgresql+psycopg://...")``. Pass a producer to
choose the schema or the limits: ``enqueue(session, ..., producer=Producer(
ProducerConfig(schema="jobs")))``.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

import psycopg

from conveyor.errors import ConfigError, MissingExtraError

try:
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session
except ImportError as exc:
    raise MissingExtraError("conveyor.contrib.sqlalchemy", "sqlalchemy", module=exc.name) from exc

from conveyor.producer import Producer
from conveyor.producer_async import AsyncProducer
from conveyor.producer_core import EventLike

__all__ = ["aenqueue", "aenqueue_many", "enqueue", "enqueue_many", "psycopg_connection"]

_PRODUCER = Producer()
_ASYNC_PRODUCER = AsyncProducer()


def _refuse(driver: object, dialect: str) -> ConfigError:
    return ConfigError(f"conveyor needs the session's engine on psycopg 3 (postgresql+psycopg://), "
                       f"got the {dialect}+{driver} driver")


def psycopg_connection(session: Session) -> psycopg.Connection[Any]:
    """The psycopg connection under ``session``, in the session's transaction (begun if need be)."""
    connection = session.connection()
    raw = connection.connection.driver_connection
    if not isinstance(raw, psycopg.Connection):
        raise _refuse(connection.dialect.driver, connection.dialect.name)
    return raw


async def _async_psycopg_connection(session: AsyncSession) -> psycopg.AsyncConnection[Any]:
    connection = await session.connection()
    raw = (await connection.get_raw_connection()).driver_connection
    if not isinstance(raw, psycopg.AsyncConnection):
        raise _refuse(connection.dialect.driver, connection.dialect.name)
    return raw


def enqueue(session: Session, topic: str, payload: Any = None, *, producer: Producer | None = None,
            flush: bool = True, tenant: str | None = None, idempotency_key: str | None = None,
            delay: float = 0.0, priority: int = 0, max_attempts: int | None = None,
            run_at: datetime | None = None) -> int:
    """Write one event in ``session``'s transaction; returns its id (see ``Producer.enqueue``).

    ``flush``: flush the session's pending changes first. Defaults to True.
    ``producer``: the producer to write with. Defaults to ``Producer()`` (schema ``conveyor``).
    """
    if flush:
        session.flush()
    return (producer or _PRODUCER).enqueue(
        psycopg_connection(session), topic, payload, tenant=tenant,
        idempotency_key=idempotency_key, delay=delay, priority=priority,
        max_attempts=max_attempts, run_at=run_at)


def enqueue_many(session: Session, events: Iterable[EventLike], *,
                 producer: Producer | None = None, flush: bool = True) -> list[int]:
    """Write many events in ``session``'s transaction; their ids in input order."""
    if flush:
        session.flush()
    return (producer or _PRODUCER).enqueue_many(psycopg_connection(session), events)


async def aenqueue(session: AsyncSession, topic: str, payload: Any = None, *,
                   producer: AsyncProducer | None = None, flush: bool = True,
                   tenant: str | None = None, idempotency_key: str | None = None,
                   delay: float = 0.0, priority: int = 0, max_attempts: int | None = None,
                   run_at: datetime | None = None) -> int:
    """:func:`enqueue` for an ``AsyncSession``."""
    if flush:
        await session.flush()
    return await (producer or _ASYNC_PRODUCER).enqueue(
        await _async_psycopg_connection(session), topic, payload, tenant=tenant,
        idempotency_key=idempotency_key, delay=delay, priority=priority,
        max_attempts=max_attempts, run_at=run_at)


async def aenqueue_many(session: AsyncSession, events: Iterable[EventLike], *,
                        producer: AsyncProducer | None = None, flush: bool = True) -> list[int]:
    """:func:`enqueue_many` for an ``AsyncSession``."""
    if flush:
        await session.flush()
    return await (producer or _ASYNC_PRODUCER).enqueue_many(
        await _async_psycopg_connection(session), events)
