"""The Grafana dashboard and the documented alert rules query series a real worker exports.

A worker with the metrics middleware, its collector and the database gauges
runs real events; its registry's exposition is the list of series and labels
that exist. Every metric and label the dashboard's queries and the alert rules
in docs/observability.md name must be among them, so a renamed metric breaks
this test instead of an operator's dashboard.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import psycopg
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from conveyor.metrics import DatabaseGauges
from conveyor.metrics.collectors import register_process_collectors
from waiting import wait_until
from worker_support import enqueue, running

from .test_metrics import build

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docs" / "grafana" / "conveyor-dashboard.json"
OBSERVABILITY = ROOT / "docs" / "observability.md"
METRIC = re.compile(r"\b(?:conveyor|process|python)_[a-z_]+")
# Label names inside selectors ({name="..."}, {name=~"..."}) and by/without clauses.
SELECTOR_LABEL = re.compile(r"[{,]\s*([a-z_]+)\s*(?:=~|!=|!~|=)")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
# Added by Prometheus at scrape time or by the query language, not by the exporter.
SCRAPE_LABELS = {"instance", "job", "le"}


def _dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queries += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    return queries


def _alert_queries() -> list[str]:
    text = OBSERVABILITY.read_text()
    rules = text[text.index("Alert rules:"):]
    block = rules[rules.index("```yaml") + 7:rules.index("```", rules.index("```yaml") + 7)]
    # An expr is one line, or a folded block of more indented lines after "expr: |".
    queries, lines = [], block.splitlines()
    for i, line in enumerate(lines):
        stripped = line.strip()
        if not stripped.startswith("expr:"):
            continue
        value = stripped[len("expr:"):].strip()
        if value == "|":
            indent = len(line) - len(line.lstrip())
            body = []
            for follow in lines[i + 1:]:
                if follow.strip() and len(follow) - len(follow.lstrip()) <= indent:
                    break
                body.append(follow.strip())
            value = " ".join(body)
        queries.append(value)
    return queries


def _labels(query: str) -> set[str]:
    names = set(SELECTOR_LABEL.findall(query))
    for group in GROUPING.findall(query):
        names.update(n.strip() for n in group.split(",") if n.strip())
    return names


# A schedule, a pause and a limited pattern, so the gauges of each have a series.
CONTROLS = (
    "INSERT INTO conveyor.cron_schedules (name, expression, timezone, topic, catch_up, "
    "next_fire_at, last_fired_at) VALUES ('tick', '* * * * *', 'UTC', 'mail.ok', 300, "
    "now(), now())",
    "INSERT INTO conveyor.pauses (pattern) VALUES ('paused.*')",
    "INSERT INTO conveyor.flow_limits (pattern, max_running, rate, burst) "
    "VALUES ('limited.*', 2, 1, 5)",
)


async def test_every_series_the_dashboard_and_alerts_query_is_exported(db: str) -> None:
    worker, registry = build(db)
    register_process_collectors(registry)
    gauges = DatabaseGauges(db)
    registry.register(gauges)
    with psycopg.connect(db, autocommit=True) as conn:
        for statement in CONTROLS:
            conn.execute(statement)
    try:
        async with running(worker):
            await enqueue(db, "mail.ok")
            await enqueue(db, "mail.boom", max_attempts=1)

            async def handled() -> bool:
                return worker.stats.succeeded + worker.stats.failed == 2
            await wait_until(handled, timeout=10, what="both outcomes acknowledged")
            # One due event no route takes, so the backlog gauges have something to show.
            await enqueue(db, "unrouted.x")
            assert await gauges.refresh_once()
            exposition = generate_latest(registry).decode()
    finally:
        await gauges.close()
    exported: set[str] = set()
    labels: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            exported.add(sample.name)
            labels.update(sample.labels)
    assert "conveyor_events_handled_total" in exported  # the exposition is not empty

    queries = {"dashboard": _dashboard_queries(), "alerts": _alert_queries()}
    assert len(queries["dashboard"]) >= 15 and len(queries["alerts"]) == 6, queries
    for where, texts in queries.items():
        for query in texts:
            missing = set(METRIC.findall(query)) - exported
            assert not missing, f"{where}: {query!r} names {sorted(missing)}, not exported"
            unknown = _labels(query) - labels - SCRAPE_LABELS
            assert not unknown, f"{where}: {query!r} uses labels {sorted(unknown)}"


def test_the_dashboard_is_a_grafana_dashboard_with_a_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "conveyor-overview" and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
