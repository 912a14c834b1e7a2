"""The demo's producer side: orders written together with their events.

Every order is one transaction: the ``orders`` row and its events commit
together or not at all. That is the outbox promise the rest of the demo
relies on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from conveyor.config import ProducerConfig
from conveyor.errors import InvalidInputError
from conveyor.producer import NewEvent, Producer
from conveyor.schema.migrator import Migration, Migrator

SCHEMA = "conveyor_demo"
MIN_EVENTS = 20
TENANTS = ("acme", "globex", "initech")
REVIEW_DELAY = 24 * 3600.0
EMAIL_PRIORITY = 10  # customers wait on these; claimed before equal-age work

Say = Callable[[str], None]


@dataclass(slots=True)
class Mix:
    """What was enqueued, so the demo can check and explain the outcome."""

    total: int = 0
    orders: int = 0
    poison_id: int = 0
    delayed_id: int = 0
    misbehaving: dict[int, str] = field(default_factory=dict)


class CardDeclined(Exception):
    """Raised inside an order's transaction to show that a rollback drops its events."""


def reset_schema(conn: psycopg.Connection[Any], schema: str = SCHEMA) -> list[Migration]:
    """Drop the demo schema, migrate it afresh and add the shop's ``orders`` table."""
    ident = sql.Identifier(schema)
    with conn.transaction():
        # An old worker still attached to the schema would block the drop forever.
        conn.execute("SET LOCAL lock_timeout = '5s'")
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(ident))
    applied = Migrator(schema).apply(conn)
    conn.execute(sql.SQL(
        "CREATE TABLE {}.orders (id serial PRIMARY KEY, tenant text NOT NULL, "
        "customer text NOT NULL, total_cents integer NOT NULL, "
        "created_at timestamptz NOT NULL DEFAULT now())").format(ident))
    return applied


def _lines(number: int) -> list[dict[str, Any]]:
    return [{"sku": f"SKU-{(number * 7 + i) % 90 + 10}", "qty": 1 + (number + i) % 3,
             "unit_cents": 499 + 250 * ((number + i) % 5)} for i in range(1 + number % 3)]


def _order_events(number: int, order_id: int, tenant: str, customer: str,
                  lines: list[dict[str, Any]]) -> list[tuple[NewEvent, str | None]]:
    """The events of order ``number`` (1-based), each with what it is set to show."""
    email: dict[str, Any] = {"order_id": order_id, "to": f"{customer}@example.com",
                             "template": "order_confirmation"}
    invoice: dict[str, Any] = {"order_id": order_id, "lines": lines, "currency": "EUR"}
    webhook: dict[str, Any] = {"order_id": order_id,
                               "url": f"https://partner.example.com/{tenant}/orders"}
    shows: dict[str, str | None] = {"email": None, "invoice": None, "webhook": None}
    if number == 5:
        email["simulate"] = {"fail_attempts": 2}
        shows["email"] = "fails twice (SMTP 421), then succeeds"
    elif number % 10 == 2:
        email["simulate"] = {"fail_attempts": 1}
        shows["email"] = "fails once (SMTP 421), then succeeds"
    if number == 4:
        del invoice["currency"]
        shows["invoice"] = "poison: KeyError on every attempt, parks failed"
    elif number % 10 == 3:
        invoice["simulate"] = {"busy_attempts": 1}
        shows["invoice"] = "asks to be retried after 1s (RetryAfter), then succeeds"
    if number == 1:
        webhook["simulate"] = {"hang_attempts": 1}
        shows["webhook"] = "hangs past its 1s timeout once, then succeeds"
    key = f"order-{order_id}"
    events = [
        (NewEvent(topic="order.created", tenant=tenant, idempotency_key=f"{key}-created",
                  payload={"order_id": order_id, "customer": customer}), None),
        (NewEvent(topic="email.send", tenant=tenant, idempotency_key=f"{key}-confirmation",
                  payload=email, priority=EMAIL_PRIORITY), shows["email"]),
        (NewEvent(topic="invoice.render", tenant=tenant, payload=invoice), shows["invoice"]),
    ]
    if number % 5 == 1:
        events.append((NewEvent(topic="webhook.deliver", tenant=tenant, payload=webhook),
                       shows["webhook"]))
    return events


def events_per_order(number: int) -> int:
    return 4 if number % 5 == 1 else 3


def place_order(conn: psycopg.Connection[Any], producer: Producer, number: int,
                mix: Mix, *, decline: bool = False) -> int:
    """One order and its events in one transaction; returns the order id."""
    tenant = TENANTS[number % len(TENANTS)]
    customer = f"customer{number:03d}"
    lines = _lines(number)
    total = sum(line["qty"] * line["unit_cents"] for line in lines)
    orders = sql.Identifier(producer.config.schema, "orders")
    with conn.transaction():
        row = conn.execute(sql.SQL(
            "INSERT INTO {} (tenant, customer, total_cents) VALUES (%s, %s, %s) RETURNING id"
        ).format(orders), (tenant, customer, total)).fetchone()
        assert row is not None
        order_id = int(row[0])
        for new, shows in _order_events(number, order_id, tenant, customer, lines):
            event_id = producer.enqueue(
                conn, new.topic, new.payload, tenant=new.tenant,
                idempotency_key=new.idempotency_key, priority=new.priority)
            if shows:
                mix.misbehaving[event_id] = f"{new.topic}: {shows}"
                if shows.startswith("poison"):
                    mix.poison_id = event_id
            mix.total += 1
        if decline:
            raise CardDeclined(f"card declined for order {order_id}")
    mix.orders += 1
    return order_id


def count_events(conn: psycopg.Connection[Any], schema: str = SCHEMA) -> int:
    row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(
        sql.Identifier(schema, "events"))).fetchone()
    return int(row[0]) if row else 0


def enqueue_mix(conn: psycopg.Connection[Any], events: int, say: Say,
                schema: str = SCHEMA) -> Mix:
    """Enqueue about ``events`` events the way a shop would; returns what was written."""
    if events < MIN_EVENTS:
        raise InvalidInputError(
            f"the demo needs at least {MIN_EVENTS} events for its mix, got {events}")
    producer = Producer(ProducerConfig(schema=schema))
    mix = Mix()
    batch = events // 5
    budget = events - batch - 1  # one delayed review request
    number = 1
    while budget >= events_per_order(number):
        budget -= events_per_order(number)
        place_order(conn, producer, number, mix)
        number += 1
    batch += budget
    say(f"  placed {mix.orders} orders, each in one transaction with its events "
        f"(order.created, email.send, invoice.render, some webhook.deliver)")

    _show_rollback(conn, producer, number, say, schema)
    _show_idempotency(conn, producer, mix, say)

    with conn.transaction():
        ids = producer.enqueue_many(conn, [
            NewEvent(topic="analytics.track", tenant=TENANTS[i % len(TENANTS)],
                     payload={"event": "page_view", "page": f"/products/{i % 40}"})
            for i in range(batch)])
    mix.total += len(ids)
    say(f"  enqueued {len(ids)} analytics.track events with one enqueue_many call")

    with conn.transaction():
        mix.delayed_id = producer.enqueue(
            conn, "order.review_request", {"order_id": 1}, tenant=TENANTS[1],
            delay=REVIEW_DELAY)
    mix.total += 1
    say(f"  scheduled event {mix.delayed_id} (order.review_request) to run in 24 h")
    return mix


def _show_rollback(conn: psycopg.Connection[Any], producer: Producer, number: int,
                   say: Say, schema: str) -> None:
    """An order whose payment fails after its events were written: all of it rolls back."""
    before = count_events(conn, schema)
    shadow = Mix()
    try:
        place_order(conn, producer, number, shadow, decline=True)
    except CardDeclined as exc:
        after = count_events(conn, schema)
        say(f"  one more order wrote {shadow.total} events, then failed ({exc}): "
            f"rolled back, events table {before} -> {after} rows")


def _show_idempotency(conn: psycopg.Connection[Any], producer: Producer, mix: Mix,
                      say: Say) -> None:
    # A client that resubmits order 1 must not send a second confirmation email.
    orders = sql.Identifier(producer.config.schema, "orders")
    row = conn.execute(sql.SQL("SELECT id, tenant FROM {} ORDER BY id LIMIT 1")
                       .format(orders)).fetchone()
    assert row is not None
    order_id, tenant = row
    with conn.transaction():
        again = producer.enqueue(conn, "email.send", {"order_id": order_id},
                                 tenant=tenant, idempotency_key=f"order-{order_id}-confirmation")
    say(f"  resubmitted order {order_id}'s confirmation email with the same idempotency key: "
        f"got the first event's id {again} back, no second row")
