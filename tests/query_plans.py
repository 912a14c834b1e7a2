"""Reading EXPLAIN (FORMAT JSON) plans in tests: which nodes touch the events table."""

from __future__ import annotations

from typing import Any


def scans(plan: Any) -> list[dict[str, Any]]:
    """Every node of a JSON plan that reads the events table or one of its indexes."""
    if isinstance(plan, list):
        return [n for p in plan for n in scans(p)]
    if not isinstance(plan, dict):
        return []
    reads = plan.get("Node Type") != "ModifyTable" and (
        plan.get("Relation Name") == "events"
        or str(plan.get("Index Name", "")).startswith("events_"))
    return ([plan] if reads else []) + scans(plan.get("Plans", [])) + scans(
        plan.get("Plan", []))
