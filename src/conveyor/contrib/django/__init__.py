"""Conveyor in a Django project (extra ``conveyor[django]``): the outbox on Django's connection.

``enqueue()`` writes the event on the Django connection of a database alias,
so it commits or rolls back with ``transaction.atomic()`` and the business
rows written in it::

    from django.db import transaction
    from conveyor.contrib.django import enqueue

    with transaction.atomic():
        order = Order.objects.create(customer="acme", amount=120)
        enqueue("order.created", {"order_id": order.pk})

Add ``"conveyor.contrib.django"`` to ``INSTALLED_APPS`` for the schema's
migrations (``manage.py migrate``), the commands (``manage.py
conveyor_worker``, ``manage.py conveyor status``) and the read-only admin
pages of the events. Settings, all optional, in ``CONVEYOR``::

    CONVEYOR = {
        "DATABASE": "default",        # the alias whose connection events are written on
        "SCHEMA": "conveyor",         # the schema holding Conveyor's tables
        "ROUTER": "myapp.jobs:router",  # the router manage.py conveyor_worker runs,
                                        # besides the Django tasks' own
        "TASK_MODULES": ["myapp.jobs.tasks"],  # modules of tasks outside an app's tasks.py
    }

A backend for Django's Tasks framework is :class:`conveyor.contrib.django.backend.ConveyorBackend`
(``TASKS = {"default": {"BACKEND": "conveyor.contrib.django.backend.ConveyorBackend"}}``).
See docs/django.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

import psycopg

from conveyor.errors import ConfigError, MissingExtraError

try:
    from asgiref.sync import sync_to_async
    from django.conf import settings
    from django.db import connections
except ImportError as exc:
    raise MissingExtraError("conveyor.contrib.django", "django", module=exc.name) from exc

from conveyor.config import ProducerConfig
from conveyor.producer import Producer
from conveyor.producer_core import EventLike

__all__ = ["aenqueue", "conninfo", "enqueue", "enqueue_many", "psycopg_connection", "setting"]

DEFAULTS: dict[str, Any] = {"DATABASE": "default", "SCHEMA": "conveyor", "ROUTER": None,
                             "TASK_MODULES": ()}

_producers: dict[str, Producer] = {}


def setting(name: str) -> Any:
    """One of the ``CONVEYOR`` settings, or its default."""
    values = getattr(settings, "CONVEYOR", None) or {}
    if not isinstance(values, dict):
        raise ConfigError(f"expected settings.CONVEYOR to be a dict, got {values!r:.60}")
    unknown = sorted(set(values) - set(DEFAULTS))
    if unknown:
        raise ConfigError(f"unknown CONVEYOR setting {unknown[0]!r} (known: "
                          f"{', '.join(sorted(DEFAULTS))})")
    return values.get(name, DEFAULTS[name])


def _producer(schema: str) -> Producer:
    producer = _producers.get(schema)
    if producer is None:
        producer = _producers[schema] = Producer(ProducerConfig(schema=schema))
    return producer


def psycopg_connection(using: str | None = None) -> psycopg.Connection[Any]:
    """The psycopg 3 connection under Django's connection ``using`` (default: CONVEYOR's DATABASE).

    Inside ``transaction.atomic()`` it is in Django's transaction; outside,
    in Django's autocommit mode, each statement commits at once.
    """
    alias = using or setting("DATABASE")
    try:
        wrapper = connections[alias]
    except Exception as exc:  # django.utils.connection.ConnectionDoesNotExist
        raise ConfigError(f"no Django database {alias!r} (settings.DATABASES)") from exc
    if wrapper.vendor != "postgresql":
        raise ConfigError(f"conveyor needs a PostgreSQL database, and Django database {alias!r} "
                          f"is {wrapper.vendor}")
    wrapper.ensure_connection()
    raw = wrapper.connection
    if not isinstance(raw, psycopg.Connection):
        raise ConfigError(f"conveyor needs Django's PostgreSQL backend on psycopg 3, and "
                          f"database {alias!r} runs on {type(raw).__module__}")
    return raw


def conninfo(using: str | None = None) -> str:
    """A libpq connection string for Django's database ``using``: what the worker connects with."""
    alias = using or setting("DATABASE")
    params = connections[alias].get_connection_params()
    keep = {k: v for k, v in params.items()
            if k in ("dbname", "user", "password", "host", "port", "sslmode", "options",
                     "sslrootcert", "sslcert", "sslkey", "connect_timeout", "service")
            and v not in (None, "")}
    return psycopg.conninfo.make_conninfo(**{k: str(v) for k, v in keep.items()})


def enqueue(topic: str, payload: Any = None, *, using: str | None = None,
            tenant: str | None = None, idempotency_key: str | None = None, delay: float = 0.0,
            priority: int = 0, max_attempts: int | None = None,
            run_at: datetime | None = None) -> int:
    """Write one event on Django's connection ``using``, in its current transaction; returns its id.

    Same options as :meth:`conveyor.Producer.enqueue`.
    """
    return _producer(setting("SCHEMA")).enqueue(
        psycopg_connection(using), topic, payload, tenant=tenant,
        idempotency_key=idempotency_key, delay=delay, priority=priority,
        max_attempts=max_attempts, run_at=run_at)


def enqueue_many(events: Iterable[EventLike], *, using: str | None = None) -> list[int]:
    """Write many events in one statement on Django's connection ``using``; returns their ids."""
    return _producer(setting("SCHEMA")).enqueue_many(psycopg_connection(using), events)


async def aenqueue(topic: str, payload: Any = None, **options: Any) -> int:
    """:func:`enqueue` from async code: Django's connections are per thread, so it runs in
    Django's own sync thread (``sync_to_async``), inside the transaction open there."""
    return int(await sync_to_async(enqueue, thread_sensitive=True)(topic, payload, **options))
