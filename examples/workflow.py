"""A workflow written with its order: reserve, then count three warehouses side by side,
then one report from their counts (a chord), all in the order's transaction.

Run it against any PostgreSQL::

    python examples/workflow.py postgresql://app@localhost/app

(or with CONVEYOR_DATABASE_URL; with neither it starts the embedded
PostgreSQL). It creates Conveyor's schema and ``example_stock_orders`` if
missing, commits one order with its workflow, runs a worker in this process
until the report is written, and prints each step as ``conveyor workflow
show`` would find it.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import psycopg

from conveyor import (
    Admin,
    AsyncAdmin,
    Event,
    Migrator,
    Producer,
    Router,
    Worker,
    WorkerConfig,
    chain,
    group,
    step,
)

WAREHOUSES = {"north": 12, "south": 30, "east": 7}

router = Router()


@router.route("stock.reserve")
async def reserve(event: Event) -> None:
    print(f"  reserved order {event.payload['order']}")


@router.route("stock.count", store_result=True)
async def count(event: Event) -> int:
    # A step's return value is stored (store_result) for the steps after it.
    return WAREHOUSES[event.payload["warehouse"]]


@router.route("stock.report", store_result=True)
async def report(event: Event) -> dict[str, Any]:
    async with await psycopg.AsyncConnection.connect(os.environ["EXAMPLE_DATABASE_URL"]) as conn:
        counts = await AsyncAdmin().dependencies(conn, event.id)
    return {"order": event.payload["order"], "in_stock": sum(c.value for c in counts)}


def main(url: str) -> None:
    os.environ["EXAMPLE_DATABASE_URL"] = url
    with psycopg.connect(url) as conn:
        Migrator().apply(conn)  # once per deployment in real life: `conveyor migrate`
        conn.execute("CREATE TABLE IF NOT EXISTS example_stock_orders"
                     " (id serial PRIMARY KEY, item text NOT NULL)")
        with conn.transaction():
            (order,) = conn.execute("INSERT INTO example_stock_orders (item) VALUES ('bolts')"
                                    " RETURNING id").fetchone() or (None,)
            last = step("stock.report", {"order": order})
            ids = Producer().enqueue_workflow(conn, chain(
                step("stock.reserve", {"order": order}),
                group(*[step("stock.count", {"order": order, "warehouse": w})
                        for w in WAREHOUSES]),
                last))
        print(f"order {order} committed with a workflow of {len(ids)} steps")

    async def work() -> None:
        worker = Worker(url, router, WorkerConfig())
        running = asyncio.create_task(worker.run())
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            done = await AsyncAdmin().wait(conn, ids[last], timeout=60)
        worker.request_stop()
        await running
        print(f"report: {done.value}")

    asyncio.run(work())
    with psycopg.connect(url) as conn:
        for s in Admin().workflow(conn, ids[0]):
            after = f" after {', '.join(map(str, s.depends_on))}" if s.depends_on else ""
            print(f"  step {s.id}: {s.topic:<13} {s.state}{after}")


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
