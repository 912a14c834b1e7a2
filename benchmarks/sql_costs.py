"""What Conveyor's claim and acknowledge statements cost in the database, per batch.

Runs the worker's own named queries (``event_claim``, ``event_succeed_many``)
from one sync psycopg connection, batch after batch over pre-filled events,
next to the raw baseline's claim/finish, alternating so load drift falls on
both. Then repeats Conveyor's pair on schema variants (each in a fresh
scratch schema) to price each index, the acknowledge-by-DELETE option and
the claim through the partitioned parent instead of the live partition:

    .venv/bin/python benchmarks/sql_costs.py --url postgresql://... [--batch 100]

Reports the median client-observed time per statement (prepared, autocommit,
loopback), so it is database work plus one round trip.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

from conveyor.db.named_queries import queries_for
from conveyor.worker.claims import claim_filter
from conveyor.worker.pruner import HISTORY_AHEAD
from conveyor_tools.bench import scratch
from conveyor_tools.bench.app import NOOP_TOPIC, router
from conveyor_tools.bench.baseline import claim_sql, finish_sql, render

DELETE_ACK = """
DELETE FROM {schema}.events AS e
USING unnest(%(ids)s::bigint[], %(attempts)s::int[]) AS d(id, attempt)
WHERE e.id = d.id AND e.lease_owner = %(owner)s AND e.attempts = d.attempt
RETURNING e.id
"""

Timings = dict[str, list[float]]


def _timed(timings: Timings, key: str, fn: Callable[[], Any]) -> Any:
    t0 = time.perf_counter()
    result = fn()
    timings.setdefault(key, []).append((time.perf_counter() - t0) * 1000)
    return result


def conveyor_pair(conn: psycopg.Connection[Any], schema: str, batch: int, timings: Timings,
                  prefix: str, ack_sql: str | None = None, claim_sql: str | None = None) -> int:
    q = queries_for(schema)
    owner = str(uuid.uuid4())
    # The worker's own claim filter, so the parameters follow the worker's code.
    params = {**claim_filter(router, None), "limit": batch, "owner": owner, "lease_ttl": 15.0}
    ack = ack_sql or q["event_succeed_many"]
    rows = _timed(timings, f"{prefix}: conveyor claim", lambda: conn.execute(
        claim_sql or q["event_claim"], params).fetchall())
    if not rows:
        return 0
    ids, attempts = [r[0] for r in rows], [r[4] for r in rows]
    done = _timed(timings, f"{prefix}: conveyor ack", lambda: conn.execute(
        ack, {"owner": owner, "ids": ids, "attempts": attempts}).fetchall())
    assert len(done) == len(rows)
    return len(rows)


def raw_pair(conn: psycopg.Connection[Any], schema: str, batch: int, timings: Timings,
             prefix: str) -> int:
    claim, finish = claim_sql(schema), finish_sql(schema)
    rows = _timed(timings, f"{prefix}: raw claim",
                  lambda: conn.execute(claim, (batch,)).fetchall())
    if not rows:
        return 0
    _timed(timings, f"{prefix}: raw finish",
           lambda: conn.execute(finish, ([r[0] for r in rows],)))
    return len(rows)


CHECKS = ["events_state_check", "events_attempts_check", "events_topic_check",
          "events_lease_check"]


def variant(admin: psycopg.Connection[Any], url: str, schemas: scratch.Schemas,
            drops: list[str]) -> None:
    """Empty Conveyor's table and drop the named indexes and check constraints from it."""
    scratch.reset(admin, schemas.conveyor)
    for name in drops:
        if name in CHECKS:
            admin.execute(sql.SQL("ALTER TABLE {} DROP CONSTRAINT IF EXISTS {}").format(
                sql.Identifier(schemas.conveyor, "events"), sql.Identifier(name)))
        else:
            admin.execute(sql.SQL("DROP INDEX IF EXISTS {}").format(
                sql.Identifier(schemas.conveyor, name)))


def through_parent(claim: str, schema: str) -> str:
    """``event_claim`` reading and writing the partitioned parent, as it did before
    it named the live partition (every pending row is live, 0025)."""
    quoted = sql.Identifier(schema).as_string()
    live, parent = f"{quoted}.events_live", f"{quoted}.events"
    through = claim.replace(f"FROM {live} AS events", f"FROM {parent}").replace(
        f"UPDATE {live} AS e", f"UPDATE {parent} AS e")
    if through.count(live) or through == claim:
        raise SystemExit("event_claim no longer names the live partition as expected")
    return through


def _phase(admin: psycopg.Connection[Any], conn: psycopg.Connection[Any], url: str,
           schemas: scratch.Schemas, args: argparse.Namespace, timings: Timings, label: str,
           drops: list[str], ack: str | None, prepare: bool = True,
           claim: str | None = None) -> None:
    """One variant of Conveyor's table, interleaved batch by batch with the raw baseline."""
    variant(admin, url, schemas, drops)
    # The history's partitions, as a worker makes them when it starts: without
    # them the acknowledgement leaves every row in the live partition (0025),
    # which is not what a worker's does.
    admin.execute(queries_for(schemas.conveyor)["history_make"], {"ahead": HISTORY_AHEAD})
    scratch.reset(admin, schemas.raw)
    scratch.fill_conveyor(url, schemas.conveyor, NOOP_TOPIC, args.events)
    scratch.fill_raw(url, schemas.raw, NOOP_TOPIC, args.events)
    for s in schemas.all:
        scratch.settle(admin, s)
    conveyor_conn = conn if prepare else psycopg.connect(url, autocommit=True,
                                                          prepare_threshold=None)
    try:
        while True:
            a = conveyor_pair(conveyor_conn, schemas.conveyor, args.batch, timings, label, ack,
                              claim)
            b = raw_pair(conn, schemas.raw, args.batch, timings, label)
            if not a and not b:
                break
    finally:
        if conveyor_conn is not conn:
            conveyor_conn.close()
    moved = admin.execute(sql.SQL("SELECT count(*) FROM {}").format(
        sql.Identifier(schemas.conveyor, "events_done"))).fetchone()
    if ack is None and not (moved and moved[0] == args.events):
        raise SystemExit(f"{label}: {moved} of {args.events} acknowledged events in the history")


def run(args: argparse.Namespace) -> dict[str, Any]:
    schemas = scratch.schemas_for("conveyor_sqlcost")
    out: dict[str, Any] = {}
    with psycopg.connect(args.url, autocommit=True) as admin:
        scratch.lock(admin, schemas)
        scratch.create(admin, schemas)
        try:
            with psycopg.connect(args.url, autocommit=True) as conn:
                timings: Timings = {}
                # Dropped indexes stay dropped: keep those phases last.
                parent = through_parent(queries_for(schemas.conveyor)["event_claim"],
                                        schemas.conveyor)
                phases: list[tuple[str, list[str], str | None, bool, str | None]] = [
                    ("as shipped", [], None, True, None),
                    ("claim on events", [], None, True, parent),
                    ("never prepared (custom plans)", [], None, False, None),
                    ("ack by DELETE", [], render(DELETE_ACK, schemas.conveyor), True, None),
                    ("no prunable+lease idx", ["events_prunable_idx", "events_lease_idx"],
                     None, True, None),
                    # Last: the constraints stay dropped too (and so do the indexes).
                    ("no checks either", ["events_prunable_idx", "events_lease_idx",
                                          *CHECKS], None, True, None),
                ]
                for label, drops, ack, prepare, claim in phases:
                    _phase(admin, conn, args.url, schemas, args, timings, label, drops, ack,
                           prepare, claim)
            for key, values in timings.items():
                out[key] = {"median_ms": statistics.median(values[1:] or values),
                            "batches": len(values)}
        finally:
            scratch.drop(admin, schemas)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("CONVEYOR_DATABASE_URL"))
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if not args.url:
        parser.error("--url (or CONVEYOR_DATABASE_URL) is required")
    result = run(args)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"batch {args.batch}: median ms per statement (per event in us)")
    for key, value in result.items():
        ms = value["median_ms"]
        print(f"  {key:<50} {ms:7.3f} ms  {ms * 1000 / args.batch:6.1f} us/event"
              f"  ({value['batches']} batches)")
    print("pair totals (claim + ack) vs raw (claim + finish) in the same phase:")
    for label in dict.fromkeys(k.split(":")[0] for k in result):
        mine = sum(result[f"{label}: conveyor {x}"]["median_ms"] for x in ("claim", "ack"))
        raw = sum(result[f"{label}: raw {x}"]["median_ms"] for x in ("claim", "finish"))
        print(f"  {label:<30} conveyor {mine:6.3f} ms  raw {raw:6.3f} ms  ratio {mine / raw:4.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
