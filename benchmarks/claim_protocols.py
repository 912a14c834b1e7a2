"""What a claim protocol costs the database, with no framework: leases against held locks.

Conveyor's claim writes every claimed row (``state = 'running'``, the lease),
and the acknowledgement writes it again: two row versions, two index
entries and two WAL records per event. A protocol that keeps the claim's row
locks open while the handlers run (a transaction from the claim to the
acknowledgement) writes the row once; a crashed worker's transaction rolls
back and its events are free at once. Its costs are elsewhere: a
transaction open for as long as the batch's handlers run, and an attempt
that a crash rolls back with it. This measures the database side of each
shape on the baseline's lean table (``conveyor_tools.bench.baseline``), so
the choice starts from figures:

* ``lease``: the raw loop as ``conveyor bench`` runs it: a claim ``UPDATE``
  and a finish ``UPDATE`` (``mark``) or ``DELETE``, each committed alone;
* ``held``: ``BEGIN``, ``SELECT ... FOR UPDATE SKIP LOCKED``, the finish,
  ``COMMIT``: the row is written once, by the finish;
* ``take``: one ``DELETE ... RETURNING`` of the claimed rows: at most once,
  the floor of any protocol (a crash loses the batch).

With ``--table conveyor`` the same shapes run on Conveyor's own table (a
freshly migrated schema, every index and CHECK): ``lease`` is the worker's
own ``event_claim`` and ``event_succeed_many`` (or the delete of retention
0), ``held`` the same candidates locked ``FOR NO KEY UPDATE`` and the outcome
written with the attempt it counts, in one transaction.

    .venv/bin/python benchmarks/claim_protocols.py --url postgresql://... \\
        [--table raw|conveyor] [--events 50000] [--batch 100] [--rounds 3]

Each round fills the table (COPY), vacuums and analyzes it, then drains it
once per shape, in turns, from one connection with ``synchronous_commit =
off`` (as the worker's claim and acknowledgement connections) and ``jit =
off`` (on Conveyor's table ``enable_sort = off`` too, as the worker's claim
session). Reported per shape: the median events per second, WAL bytes per event
and the backend's CPU per event (read from ``/proc``; the server must run on
this machine). The scratch schema is dropped at the end.
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

from conveyor.config import WorkerConfig
from conveyor.db.named_queries import queries_for
from conveyor.schema.migrator import Migrator
from conveyor.worker import Worker
from conveyor_tools.bench.app import router
from conveyor_tools.bench.baseline import claim_sql, copy_rows, create_table, finish_sql, render

SCHEMA = "conveyor_claim_protocols"
TICK = os.sysconf("SC_CLK_TCK")

_PICK = """
SELECT id, topic, payload::text, attempts FROM {schema}.events
WHERE state = 'pending' AND run_at <= now()
ORDER BY priority DESC, run_at, id
LIMIT %s
FOR UPDATE SKIP LOCKED
"""

_HELD_MARK = """
UPDATE {schema}.events
SET state = 'succeeded', attempts = attempts + 1, attempted_at = now(), finished_at = now()
WHERE id = ANY(%s)
"""

_HELD_DELETE = "DELETE FROM {schema}.events WHERE id = ANY(%s)"

_TAKE = """
DELETE FROM {schema}.events
WHERE id IN (SELECT id FROM {schema}.events
             WHERE state = 'pending' AND run_at <= now()
             ORDER BY priority DESC, run_at, id
             LIMIT %s
             FOR UPDATE SKIP LOCKED)
RETURNING id, topic, payload::text, attempts
"""

# Conveyor's table: the claim's candidates, locked instead of leased, and the
# outcome written with the attempt it counts (today's claim counts it).
_CV_PICK = """
SELECT id, tenant, topic, payload::text, attempts + 1, max_attempts, priority,
       idempotency_key, created_at, traceparent, tracestate
FROM {schema}.events
WHERE state = 'pending' AND NOT limited AND run_at <= now()
ORDER BY priority DESC, run_at, id
LIMIT %s
FOR NO KEY UPDATE SKIP LOCKED
"""

_CV_HELD_MARK = """
UPDATE {schema}.events AS e
SET state = 'succeeded', attempts = d.attempt, attempted_at = now(), finished_at = now(),
    updated_at = now()
FROM unnest(%s::bigint[], %s::int[]) AS d(id, attempt)
WHERE e.id = d.id
"""

_CV_HELD_DELETE = "DELETE FROM {schema}.events WHERE id = ANY(%s)"

# sql_costs.py's acknowledgement by DELETE (retention 0), fenced like the worker's.
_CV_LEASE_DELETE = """
DELETE FROM {schema}.events AS e
USING unnest(%(ids)s::bigint[], %(attempts)s::int[]) AS d(id, attempt)
WHERE e.id = d.id AND e.lease_owner = %(owner)s AND e.attempts = d.attempt
RETURNING e.id
"""

Drain = Callable[[psycopg.Connection[Any], int], int]


def lease(finish: str) -> Drain:
    def drain(conn: psycopg.Connection[Any], batch: int) -> int:
        claim, done = claim_sql(SCHEMA), finish_sql(SCHEMA, finish)
        handled = 0
        while rows := conn.execute(claim, (batch,)).fetchall():
            conn.execute(done, ([r[0] for r in rows],))
            handled += len(rows)
        return handled
    return drain


def held(pick: str, finish: Callable[[psycopg.Connection[Any], list[Any]], object]) -> Drain:
    """Lock a batch with ``pick``, ``finish`` it, commit; until ``pick`` finds nothing."""
    def drain(conn: psycopg.Connection[Any], batch: int) -> int:
        statement = render(pick, SCHEMA)
        handled = 0
        while True:
            with conn.transaction():
                rows = conn.execute(statement, (batch,)).fetchall()
                if not rows:
                    return handled
                finish(conn, rows)
            handled += len(rows)
    return drain


def by_ids(template: str) -> Callable[[psycopg.Connection[Any], list[Any]], object]:
    """A finish that passes the batch's ids."""
    return lambda conn, rows: conn.execute(render(template, SCHEMA), ([r[0] for r in rows],))


def by_ids_and_attempts(template: str) -> Callable[[psycopg.Connection[Any], list[Any]], object]:
    """A finish that passes the batch's ids and the attempts it counts."""
    return lambda conn, rows: conn.execute(render(template, SCHEMA),
                                           ([r[0] for r in rows], [r[4] for r in rows]))


def take(conn: psycopg.Connection[Any], batch: int) -> int:
    statement = render(_TAKE, SCHEMA)
    handled = 0
    while rows := conn.execute(statement, (batch,)).fetchall():
        handled += len(rows)
    return handled


def conveyor_lease(finish: str) -> Drain:
    def drain(conn: psycopg.Connection[Any], batch: int) -> int:
        q = queries_for(SCHEMA)
        owner = "00000000-0000-0000-0000-0000000000aa"
        # The worker's own claim filter, so the parameters follow the worker's code.
        claim_filter = Worker("", router, WorkerConfig(schema=SCHEMA))._filter
        params = {**claim_filter, "limit": batch, "owner": owner, "lease_ttl": 30.0}
        ack = q["event_succeed_many"] if finish == "mark" else render(_CV_LEASE_DELETE, SCHEMA)
        handled = 0
        while rows := conn.execute(q["event_claim"], params).fetchall():
            done = conn.execute(ack, {"owner": owner, "ids": [r[0] for r in rows],
                                      "attempts": [r[4] for r in rows]}).fetchall()
            assert len(done) == len(rows)
            handled += len(rows)
        return handled
    return drain


SHAPES: dict[str, dict[str, Drain]] = {
    "raw": {"lease mark": lease("mark"), "held mark": held(_PICK, by_ids(_HELD_MARK)),
            "lease delete": lease("delete"), "held delete": held(_PICK, by_ids(_HELD_DELETE)),
            "take": take},
    "conveyor": {"lease mark": conveyor_lease("mark"),
                 "held mark": held(_CV_PICK, by_ids_and_attempts(_CV_HELD_MARK)),
                 "lease delete": conveyor_lease("delete"),
                 "held delete": held(_CV_PICK, by_ids(_CV_HELD_DELETE))},
}


def _backend_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def _lsn(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
    assert row is not None
    return int(row[0])


def _fill(admin: psycopg.Connection[Any], events: int) -> None:
    admin.execute(render("TRUNCATE {schema}.events", SCHEMA))
    with admin.transaction():
        copy_rows(admin, SCHEMA, (("bench.noop", json.dumps({"n": n})) for n in range(events)))
    admin.execute(render("VACUUM ANALYZE {schema}.events", SCHEMA))


def run(url: str, events: int, batch: int, rounds: int,
        table: str = "raw") -> dict[str, dict[str, float]]:
    shapes = SHAPES[table]
    figures: dict[str, dict[str, list[float]]] = {name: {} for name in shapes}
    with psycopg.connect(url, autocommit=True) as admin, \
            psycopg.connect(url, autocommit=True) as conn:
        admin.execute(render("DROP SCHEMA IF EXISTS {schema} CASCADE", SCHEMA))
        try:
            if table == "raw":
                admin.execute(render("CREATE SCHEMA {schema}", SCHEMA))
                create_table(admin, SCHEMA)
            else:
                Migrator(SCHEMA).apply(admin)
            conn.execute("SET synchronous_commit = off")
            conn.execute("SET jit = off")
            if table == "conveyor":
                conn.execute("SET enable_sort = off")     # as the worker's claim session
            pid = conn.info.backend_pid
            for _ in range(rounds):
                for name, drain in shapes.items():
                    _fill(admin, events)
                    wal, cpu, started = _lsn(admin), _backend_cpu(pid), time.perf_counter()
                    handled = drain(conn, batch)
                    elapsed = time.perf_counter() - started
                    assert handled == events, (name, handled)
                    got = figures[name]
                    got.setdefault("per_s", []).append(events / elapsed)
                    got.setdefault("wal_bytes_per_event", []).append(
                        (_lsn(admin) - wal) / events)
                    got.setdefault("backend_cpu_us_per_event", []).append(
                        (_backend_cpu(pid) - cpu) * 1e6 / events)
        finally:
            admin.execute(render("DROP SCHEMA IF EXISTS {schema} CASCADE", SCHEMA))
    return {name: {k: round(statistics.median(v), 1) for k, v in got.items()}
            for name, got in figures.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("CONVEYOR_DATABASE_URL"), required=False)
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--table", choices=sorted(SHAPES), default="raw")
    args = parser.parse_args(argv)
    if not args.url:
        parser.error("give --url or set CONVEYOR_DATABASE_URL")
    result = run(args.url, args.events, args.batch, args.rounds, args.table)
    json.dump({"table": args.table, "events": args.events, "batch": args.batch,
               "rounds": args.rounds, "shapes": result}, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
