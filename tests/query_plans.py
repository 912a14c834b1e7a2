"""Reading EXPLAIN (FORMAT JSON) plans in tests: which nodes touch the events table."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg


@contextmanager
def plan_session(url: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection in a transaction rolled back afterwards, reading with one process.

    Parallel workers keep their own table statistics, out of the transaction's
    sight; one process keeps every read an EXPLAIN ANALYZE reports countable.
    """
    with psycopg.connect(url) as conn:
        conn.execute("SET LOCAL max_parallel_workers_per_gather = 0")
        yield conn
        conn.rollback()


def scans(plan: Any) -> list[dict[str, Any]]:
    """Every node of a JSON plan that reads the events table or one of its indexes."""
    if isinstance(plan, list):
        return [n for p in plan for n in scans(p)]
    if not isinstance(plan, dict):
        return []
    reads = plan.get("Node Type") != "ModifyTable" and (
        str(plan.get("Relation Name", "")) in ("events", "events_live")
        or str(plan.get("Relation Name", "")).startswith("events_done")
        or str(plan.get("Index Name", "")).startswith("events_"))
    return ([plan] if reads else []) + scans(plan.get("Plans", [])) + scans(
        plan.get("Plan", []))
