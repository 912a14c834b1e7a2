"""Events written in the same transaction as the business change (the outbox).

Run it against any PostgreSQL::

    python examples/producer_in_transaction.py postgresql://app@localhost/app

The URL may also come from CONVEYOR_DATABASE_URL (an example script may read
the environment; the library itself never does). With neither, it starts the
embedded PostgreSQL, as the ``conveyor`` command does.

It creates Conveyor's schema and an ``example_orders`` table if missing, then:

1. commits an order together with its two events;
2. rolls back an order: neither the order nor its events exist afterwards;
3. resubmits an event with the same idempotency key: the first id comes back;
4. enqueues a batch in one statement, one of them delayed.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import psycopg

from conveyor import Admin, Migrator, NewEvent, Producer

ORDERS_DDL = """
CREATE TABLE IF NOT EXISTS example_orders (
    id          serial PRIMARY KEY,
    customer    text    NOT NULL,
    total_cents integer NOT NULL
)
"""


class PaymentDeclined(Exception):
    pass


def place_order(conn: psycopg.Connection[Any], producer: Producer, customer: str,
                total_cents: int, *, declined: bool = False) -> tuple[int, list[int]]:
    """Insert an order and its events in one transaction; returns (order id, event ids)."""
    with conn.transaction():
        row = conn.execute(
            "INSERT INTO example_orders (customer, total_cents) VALUES (%s, %s) RETURNING id",
            (customer, total_cents)).fetchone()
        assert row is not None
        order_id = int(row[0])
        event_ids = [
            producer.enqueue(conn, "order.created", {"order_id": order_id}, tenant="acme"),
            producer.enqueue(conn, "email.send",
                             {"to": f"{customer}@example.com", "order_id": order_id},
                             tenant="acme", idempotency_key=f"order-{order_id}-confirmation"),
        ]
        if declined:
            # Any exception inside the block rolls back the order and its events.
            raise PaymentDeclined(f"payment declined for order {order_id}")
    return order_id, event_ids


def main(url: str) -> None:
    producer = Producer()
    admin = Admin()
    with psycopg.connect(url, autocommit=True) as conn:
        Migrator().apply(conn)  # once per deployment in real life: `conveyor migrate`
        conn.execute(ORDERS_DDL)

        order_id, event_ids = place_order(conn, producer, "ana", 4990)
        print(f"committed order {order_id} with events {event_ids}")

        try:
            place_order(conn, producer, "bob", 1250, declined=True)
        except PaymentDeclined as exc:
            print(f"rolled back: {exc}; its order row and events do not exist")

        with conn.transaction():
            again = producer.enqueue(conn, "email.send", {"order_id": order_id}, tenant="acme",
                                     idempotency_key=f"order-{order_id}-confirmation")
        print(f"resubmitted the confirmation email: got event {again} back, no new row")

        with conn.transaction():
            batch = producer.enqueue_many(conn, [
                NewEvent(topic="billing.invoice", payload={"order_id": order_id}, tenant="acme"),
                NewEvent(topic="billing.reminder", payload={"order_id": order_id},
                         tenant="acme", delay=3 * 24 * 3600),
            ])
        print(f"enqueued a batch: {batch}")

        for event_id in [*event_ids, *batch]:
            record = admin.show(conn, event_id)
            print(f"  event {record.id}: {record.topic:<16} {record.state}  "
                  f"due {record.run_at:%Y-%m-%d %H:%M}")
    print("run a worker for them: conveyor worker --app examples.quickstart:router")


def database_url() -> tuple[str, Any]:
    """The URL from argv or CONVEYOR_DATABASE_URL, else the embedded server's."""
    if len(sys.argv) > 1:
        return sys.argv[1], None
    if os.environ.get("CONVEYOR_DATABASE_URL"):
        return os.environ["CONVEYOR_DATABASE_URL"], None
    from conveyor.embedded import EmbeddedPostgres

    server = EmbeddedPostgres()
    return server.start(), server


if __name__ == "__main__":
    url, embedded = database_url()
    try:
        main(url)
    finally:
        if embedded is not None:
            embedded.stop()
