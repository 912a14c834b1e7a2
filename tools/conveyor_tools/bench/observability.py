"""``conveyor bench --observability``: what metrics and tracing cost a draining worker.

Three workers at defaults drain the same no-op events, alternating, the first
mover rotated every repetition: a plain ``conveyor worker``; one with
``--metrics-port`` (the metrics middleware counting every outcome and
timing every call, the per-worker collector, the database gauges' refresher
and the HTTP server thread); one with ``--tracing`` serving an app that sets
up the OpenTelemetry SDK with no exporter (a recorded ``process`` span per
event, linked to its producer's context, sent nowhere). Rates are
timed from the table as in the main benchmark; CPU per event is the worker
process's own. Targets: metrics >= 0.95 and tracing >= 0.85 of the plain
drain.
"""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Callable
from typing import Any

import psycopg

from conveyor_tools.bench import measure, scratch
from conveyor_tools.bench.measure import DrainRun
from conveyor_tools.bench.processes import ProcessRegistry

TRACED_APP = "conveyor_tools.bench.traced_app:router"
TARGETS = {"drain_metrics_ratio": 0.95, "drain_tracing_ratio": 0.85}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _summary(runs: list[DrainRun]) -> dict[str, Any]:
    cpu = [r.client_us for r in runs if r.client_us is not None]
    return {"per_s": statistics.median(r.per_s for r in runs),
            "worker_cpu_us_per_event": statistics.median(cpu) if cpu else None,
            "runs_per_s": [round(r.per_s, 1) for r in runs]}


def run(url: str, base_schema: str, *, events: int, reps: int,
        say: Callable[[str], None]) -> dict[str, Any]:
    schemas = scratch.schemas_for(base_schema)
    registry = ProcessRegistry()
    kinds: dict[str, dict[str, Any]] = {
        "plain": {},
        "metrics": {"flags": ["--metrics-port", str(_free_port())]},
        "tracing": {"app": TRACED_APP, "flags": ["--tracing"]},
    }
    runs: dict[str, list[DrainRun]] = {kind: [] for kind in kinds}
    started = time.time()
    with psycopg.connect(url, autocommit=True) as admin:
        scratch.lock(admin, schemas)
        scratch.create(admin, schemas)
        try:
            order = list(kinds)
            for rep in range(reps):
                for kind in order[rep % len(order):] + order[:rep % len(order)]:
                    say(f"drain {events:,} no-op events at defaults, {kind} (repetition {rep + 1})")
                    runs[kind].append(measure.conveyor_drain(admin, url, schemas, events,
                                                             registry, **kinds[kind]))
        finally:
            registry.stop_all()
            scratch.drop(admin, schemas)
    result: dict[str, Any] = {f"drain_{kind}": _summary(r) for kind, r in runs.items()}
    plain = result["drain_plain"]
    for kind in ("metrics", "tracing"):
        mine = result[f"drain_{kind}"]
        result[f"drain_{kind}_ratio"] = mine["per_s"] / plain["per_s"]
        if mine["worker_cpu_us_per_event"] and plain["worker_cpu_us_per_event"]:
            result[f"{kind}_cpu_us_per_event_added"] = (
                mine["worker_cpu_us_per_event"] - plain["worker_cpu_us_per_event"])
    result["targets"] = {key: {"target": f">= {threshold:g}", "value": result[key],
                               "met": result[key] >= threshold}
                         for key, threshold in TARGETS.items()}
    result["plan"] = {"events": events, "reps": reps}
    result["elapsed_s"] = round(time.time() - started, 1)
    return result


def format_table(result: dict[str, Any]) -> str:
    lines = ["drain at defaults      events/s   worker CPU us/event   / plain"]
    for kind in ("plain", "metrics", "tracing"):
        row = result[f"drain_{kind}"]
        cpu = row["worker_cpu_us_per_event"]
        ratio = "" if kind == "plain" else f"{result[f'drain_{kind}_ratio']:.2f}"
        lines.append(f"{kind:<20} {row['per_s']:>10,.0f}   "
                     f"{'-' if cpu is None else f'{cpu:.1f}':>19}   {ratio:>6}")
    for key, target in result["targets"].items():
        verdict = "met" if target["met"] else "MISSED"
        lines.append(f"{key}: {target['value']:.2f} (target {target['target']}): {verdict}")
    return "\n".join(lines)
