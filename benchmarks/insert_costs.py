"""Where one event per transaction goes: INSERT + COMMIT shapes, alternating.

`conveyor bench` compares ``Producer.enqueue`` + COMMIT with a raw INSERT +
COMMIT into a ten-column table. This splits the difference: the same
loop (one statement, one COMMIT, prepared, loopback) over statement and
table shapes that differ by one thing each, in short alternating rounds so
load drift falls on all alike:

* raw: the baseline's INSERT; then with ``RETURNING id`` and ``pg_notify()``
  (what Conveyor's statement does for its returned id and its wake-up);
* Conveyor's table as shipped, a two-column INSERT; the same table with its
  state and topic rules as table CHECKs of their own, as before 0029; without
  its three table CHECKs; and without them and every index but the primary
  key and events_claim_idx;
* ``event_insert_plain`` (Conveyor's statement: RETURNING id, its wake-up
  passing the wake gate), and ``Producer.enqueue`` (validation, JSON, the
  named query), both with nobody waiting (no NOTIFY, as while every worker is
  busy); ``Producer.enqueue`` on the table as before 0029; and
  ``Producer.enqueue`` while a worker waits (a session holds the
  wake gate: every commit sends the NOTIFY).

    .venv/bin/python benchmarks/insert_costs.py --url postgresql://... [--events 500 --rounds 16]

Then the table shapes once more, each INSERT + COMMIT looped in a procedure
in the server (no client, synchronous_commit off): the backend's own work per
transaction, without the client's noise. Prints the median microseconds per
transaction of each shape and its ratio to the raw INSERT. Scratch schemas
``conveyor_inscost*`` are dropped at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from conveyor.config import ProducerConfig
from conveyor.db.named_queries import queries_for
from conveyor.producer import Producer
from conveyor_tools.bench import scratch
from conveyor_tools.bench.app import NOOP_TOPIC
from conveyor_tools.bench.baseline import insert_sql, render

CHECKS = ("events_state_check", "events_topic_check", "events_lease_check")
# Every index but the primary key and the claim index (migrations 0002-0015).
SECONDARY = ("events_fair_idx", "events_lease_idx", "events_prunable_idx", "events_failed_idx",
             "events_stopped_topic_idx", "events_stopped_tenant_idx", "events_idempotency_idx")
# The state and topic rules as table CHECKs of their own, as before 0029.
BEFORE_0029 = """
ALTER TABLE {schema}.events
    DROP CONSTRAINT events_state_check,
    DROP CONSTRAINT events_topic_check,
    ADD CONSTRAINT events_state_check CHECK
        (state IN ('waiting', 'pending', 'running', 'succeeded', 'failed', 'cancelled')),
    ADD CONSTRAINT events_topic_check CHECK (length(topic) BETWEEN 1 AND 100)
"""
INSERT_TWO = "INSERT INTO {schema}.events (topic, payload) VALUES (%s, %s::jsonb)"
RAW_RETURNING_NOTIFY = ("INSERT INTO {schema}.events (topic, payload) VALUES (%s, %s::jsonb) "
                        "RETURNING id, pg_notify('conveyor_inscost', topic)")

# The same INSERT and COMMIT looped in the server (PostgreSQL 11+ procedures
# commit in a loop): no client, no round trip, and no wait for the WAL flush
# (the caller's session sets synchronous_commit off), so what is left is the
# backend's own work per transaction, which differs by table shape alone.
# Conveyor's rows go to the live partition, as the producer writes them.
SERVER_LOOP = """
CREATE PROCEDURE {loop}(n int, INOUT us float8 DEFAULT 0)
LANGUAGE plpgsql AS $$
DECLARE started timestamptz := clock_timestamp();
BEGIN
    FOR i IN 1..n LOOP
        INSERT INTO {table} (topic, payload) VALUES ('bench.noop', '{{}}');
        COMMIT;
    END LOOP;
    us := extract(epoch FROM clock_timestamp() - started) * 1e6 / n;
END $$
"""

Loop = Callable[[int], None]


def _drop(admin: psycopg.Connection[Any], schema: str, checks: bool, indexes: bool) -> None:
    table = sql.Identifier(schema, "events")
    for name in CHECKS if checks else ():
        admin.execute(sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}").format(
            table, sql.Identifier(name)))
    for name in SECONDARY if indexes else ():
        admin.execute(sql.SQL("DROP INDEX {}").format(sql.Identifier(schema, name)))


def statement_loop(conn: psycopg.Connection[Any], query: str) -> Loop:
    def run(k: int) -> None:
        for i in range(k):
            conn.execute(query, (NOOP_TOPIC, json.dumps({"i": i})))
            conn.commit()
    return run


def named_loop(conn: psycopg.Connection[Any], query: str) -> Loop:
    def run(k: int) -> None:
        for i in range(k):
            conn.execute(query, {"tenant": None, "topic": NOOP_TOPIC,
                                 "payload": json.dumps({"i": i}), "priority": 0,
                                 "max_attempts": 5})
            conn.commit()
    return run


def producer_loop(conn: psycopg.Connection[Any], schema: str) -> Loop:
    producer = Producer(ProducerConfig(schema=schema))

    def run(k: int) -> None:
        for i in range(k):
            producer.enqueue(conn, NOOP_TOPIC, {"i": i})
            conn.commit()
    return run


def waited_loop(conn: psycopg.Connection[Any], waiter: psycopg.Connection[Any],
                schema: str) -> Loop:
    """``Producer.enqueue`` while a worker waits: ``waiter`` holds the wake gate
    (conveyor/db/queries/wakes.sql) for the round, so every commit sends the NOTIFY."""
    q = queries_for(schema)
    waiter.execute(sql.SQL("LISTEN {}").format(sql.Identifier(q.channel)))
    enqueue = producer_loop(conn, schema)

    def run(k: int) -> None:
        held = waiter.execute(q["wake_gate_hold"], {"held": 0}).fetchone()
        try:
            enqueue(k)
        finally:
            waiter.execute(q["wake_gate_release"], {"held": held[0] if held else 0})
            list(waiter.notifies(timeout=0))       # read what came, as a worker would
    return run


def server_loops(admin: psycopg.Connection[Any], raw: str, shapes: dict[str, str], events: int,
                 rounds: int) -> dict[str, float]:
    """Median microseconds per transaction of SERVER_LOOP into the raw baseline's
    table (schema ``raw``) and into the live partition of each schema of ``shapes``."""
    tables = {"raw INSERT": (raw, "events")} | {name: (schema, "events_live")
                                                for name, schema in shapes.items()}
    for schema, table in tables.values():
        admin.execute(sql.SQL(SERVER_LOOP).format(loop=sql.Identifier(schema, "insert_loop"),
                                                  table=sql.Identifier(schema, table)))
    admin.execute("SET synchronous_commit = off")
    spent: dict[str, list[float]] = {name: [] for name in tables}
    names = list(tables)
    for r in range(rounds):
        for j in range(len(names)):
            name = names[(j + r) % len(names)]
            call = sql.SQL("CALL {}(%s)").format(sql.Identifier(tables[name][0], "insert_loop"))
            row = admin.execute(call, (events,)).fetchone()
            spent[name].append(row[0] if row else 0.0)
    admin.execute("RESET synchronous_commit")
    return {f"server: {name}": statistics.median(values) for name, values in spent.items()}


def run(url: str, events: int, rounds: int) -> dict[str, float]:
    shipped, no_checks, lean, before = (scratch.schemas_for(f"conveyor_inscost{n}")
                                        for n in ("", "1", "2", "3"))
    every = (shipped, no_checks, lean, before)
    conns: list[psycopg.Connection[Any]] = []
    with psycopg.connect(url, autocommit=True) as admin:
        scratch.lock(admin, shipped)
        for schemas in every:
            scratch.create(admin, schemas)
        try:
            _drop(admin, no_checks.conveyor, checks=True, indexes=False)
            _drop(admin, lean.conveyor, checks=True, indexes=True)
            admin.execute(render(BEFORE_0029, before.conveyor).encode())

            def conn() -> psycopg.Connection[Any]:
                conns.append(psycopg.connect(url))
                return conns[-1]

            q = queries_for(shipped.conveyor)
            waiter = psycopg.connect(url, autocommit=True)
            conns.append(waiter)
            loops: dict[str, Loop] = {
                "raw INSERT": statement_loop(conn(), insert_sql(shipped.raw)),
                "raw INSERT + RETURNING id + pg_notify": statement_loop(
                    conn(), render(RAW_RETURNING_NOTIFY, shipped.raw)),
                "events table, as shipped": statement_loop(
                    conn(), render(INSERT_TWO, shipped.conveyor)),
                "events table, CHECKs as before 0029": statement_loop(
                    conn(), render(INSERT_TWO, before.conveyor)),
                "events table, no table CHECKs": statement_loop(
                    conn(), render(INSERT_TWO, no_checks.conveyor)),
                "events table, no CHECKs, 2 indexes": statement_loop(
                    conn(), render(INSERT_TWO, lean.conveyor)),
                "event_insert_plain": named_loop(conn(), q["event_insert_plain"]),
                "Producer.enqueue": producer_loop(conn(), shipped.conveyor),
                "Producer.enqueue, CHECKs as before 0029": producer_loop(conn(), before.conveyor),
                "Producer.enqueue, a worker waiting": waited_loop(
                    conn(), waiter, shipped.conveyor),
            }
            for loop in loops.values():
                loop(min(events, 300))
            spent: dict[str, list[float]] = {name: [] for name in loops}
            for _ in range(rounds):
                for name, loop in loops.items():
                    t0 = time.perf_counter()
                    loop(events)
                    spent[name].append((time.perf_counter() - t0) / events * 1e6)
            result = {name: statistics.median(values) for name, values in spent.items()}
            for schemas in every:
                scratch.reset(admin, schemas.conveyor)
            scratch.reset(admin, shipped.raw)
            return result | server_loops(admin, shipped.raw, {
                "events table, as shipped": shipped.conveyor,
                "events table, CHECKs as before 0029": before.conveyor,
                "events table, no table CHECKs": no_checks.conveyor,
                "events table, no CHECKs, 2 indexes": lean.conveyor}, 2 * events, rounds)
        finally:
            for c in conns:
                c.close()
            for schemas in every:
                scratch.drop(admin, schemas)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("CONVEYOR_DATABASE_URL"))
    parser.add_argument("--events", type=int, default=500, help="transactions per shape per round")
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not args.url:
        parser.error("--url (or CONVEYOR_DATABASE_URL) is required")
    result = run(args.url, args.events, args.rounds)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"one event + COMMIT, median of {args.rounds} rounds of {args.events}"
          f" (server: {2 * args.events} in a procedure, synchronous_commit off):")
    for name, us in result.items():
        raw = result["server: raw INSERT" if name.startswith("server:") else "raw INSERT"]
        print(f"  {name:<48} {us:7.1f} us   raw / this {raw / us:4.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
