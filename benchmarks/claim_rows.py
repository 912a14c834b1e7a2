"""Instructions per claimed event that the fetch loop spends turning a claim's rows into
events, counted under valgrind's callgrind (timings move by half on a shared machine;
instruction counts do not).

Each way runs in a process of its own: it fills a scratch table with ``BATCH`` rows of
the claim's eleven columns, then reads them ``N`` times with the worker's query shape
(binary results, prepared) and builds an :class:`~conveyor.types.Event` of each row,
once with ``N`` = 100 and once with 300; the difference over the extra rows is the
count per event, start-up and imports cancelled out.

* ``worker``: the plain claim's cursor as the worker sets it up
  (:func:`conveyor.db.rows.claim_cursor`: ``created_at`` read as its microseconds);
* ``datetime``: psycopg's own loaders, a datetime in the session's time zone per row.

    .venv/bin/python benchmarks/claim_rows.py --url postgresql://... [--time-zone Etc/UTC]

Needs valgrind on the PATH. The scratch table is a temporary one.
"""

from __future__ import annotations

import argparse
import os
import sys

import psycopg

from conveyor.types import CLAIM_COLUMNS
from conveyor_tools.bench.callgrind import instructions

BATCH = 100
SIZES = (100, 300)
WAYS = ("datetime", "worker")
# The claim's columns with a claimed event's typical values: no tenant, key or trace.
FILL = """
CREATE TEMPORARY TABLE claimed AS
SELECT g::bigint AS id, NULL::text AS tenant, 'bench.noop'::text AS topic,
       '{"i": 1}'::jsonb AS payload, 1 AS attempts, 5 AS max_attempts, 0::smallint AS priority,
       NULL::text AS idempotency_key, now() - g * interval '1 ms' AS created_at,
       NULL::text AS traceparent, NULL::text AS tracestate
FROM generate_series(1, %s) AS g
"""


def _read(url: str, way: str, count: int) -> None:
    from conveyor.db.rows import claim_cursor
    from conveyor.types import Event

    columns = ", ".join("payload::text" if c == "payload" else c for c in CLAIM_COLUMNS)
    query = f"SELECT {columns} FROM claimed"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(FILL, (BATCH,))
        cur = conn.cursor(binary=True)
        if way == "worker":
            claim_cursor(cur)
        for _ in range(count):
            cur.execute(query, prepare=True)
            events = [Event._from_claim_row(row) for row in cur.fetchall()]
    assert len(events) == BATCH


def _instructions(url: str, way: str, count: int, time_zone: str | None) -> int:
    env = dict(os.environ)
    if time_zone:
        env["PGTZ"] = time_zone
    return instructions([__file__, "--run", url, way, str(count)], env)


def main() -> int:
    if sys.argv[1:2] == ["--run"]:
        _read(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("CONVEYOR_DATABASE_URL"))
    parser.add_argument("--time-zone", help="the session's TimeZone (PGTZ); default the server's")
    args = parser.parse_args()
    if not args.url:
        parser.error("--url (or CONVEYOR_DATABASE_URL) is required")
    rows = (SIZES[1] - SIZES[0]) * BATCH
    for way in WAYS:
        low, high = (_instructions(args.url, way, n, args.time_zone) for n in SIZES)
        print(f"{way:9} {(high - low) / rows:8,.0f} instructions per claimed event", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
