"""The dashboard's pages and actions: what each one reads or changes, and shows.

Each handler reads its inputs (:mod:`~conveyor.dashboard.inputs`), calls the
operator API on a connection of the pool, and renders a template, or, for
an action, answers with a redirect so a reload never repeats it. What runs
around them (authorization, CSRF, error pages) is the guard's, and the
headers of every response the renderer's.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any
from urllib.parse import urlencode

import psycopg
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

import conveyor.dashboard.charts as charts
from conveyor.admin_async import FAILED_EXACT_LIMIT, FAILED_TOPIC_EXACT_LIMIT, AsyncAdmin
from conveyor.admin_controls_core import AUDIT_KINDS
from conveyor.canvas import levels
from conveyor.dashboard.config import DashboardConfig
from conveyor.dashboard.data import (
    TOPICS_SHOWN,
    Database,
    outcome_chart,
    recent_outcomes,
    topic_chart,
    topic_table,
)
from conveyor.dashboard.guard import Handler
from conveyor.dashboard.inputs import (
    audit_filter,
    bulk_kind,
    chart_span,
    event_id,
    filter_from,
    limit_form,
    query,
    schedule_action,
    text_field,
)
from conveyor.dashboard.render import Renderer, timeline
from conveyor.dashboard.security import actor
from conveyor.db.named_queries import queries_for
from conveyor.filters import EventFilter
from conveyor.patterns import check_topic_pattern
from conveyor.records import WorkflowStep

# Topics the "no live worker claims" warning names; it counts the rest.
UNHANDLED_SHOWN = 20
# The audit page's kind filter: each family, then each kind.
AUDIT_FAMILIES = sorted({k.partition(".")[0] for k in AUDIT_KINDS}) + list(AUDIT_KINDS)
# Steps of an event's workflow the event page reads, and a level's steps of
# one topic it draws one by one (more are summed up by state).
WORKFLOW_STEPS_READ = 10_001
WORKFLOW_EACH = 5


class Pages:
    """The request handlers; one instance per app."""

    def __init__(self, config: DashboardConfig, db: Database, render: Renderer) -> None:
        self.config = config
        self.db = db
        self.render = render.render
        self.admin = AsyncAdmin(config.schema)
        self.queries = queries_for(config.schema)
        self._path = render.path

    async def overview(self, request: Request) -> Response:
        span = chart_span(request)
        async with self.db.connection() as conn:
            # Bounded: the failed counts stop at a bound instead of costing the
            # page more with every failed event a queue keeps (docs/dashboard.md).
            status = await self.admin.status(conn, bounded=True)
            pauses = await self.admin.paused(conn)
            chart = await outcome_chart(conn, self.queries, span)
            done = await recent_outcomes(conn, self.queries, TOPICS_SHOWN)
        topics, other = await asyncio.to_thread(topic_table, status.by_topic, TOPICS_SHOWN, done)
        unhandled = status.unhandled_topics
        return await self.render(request, "overview.html", status=status, pauses=pauses,
                                 topics=topics, other=other, chart=chart, spans=list(charts.SPANS),
                                 estimated=set(status.estimated_states),
                                 capped=set(status.capped_states),
                                 failed_limits=(FAILED_EXACT_LIMIT, FAILED_TOPIC_EXACT_LIMIT),
                                 unhandled=unhandled[:UNHANDLED_SHOWN],
                                 unhandled_more=max(0, len(unhandled) - UNHANDLED_SHOWN))

    async def events(self, request: Request) -> Response:
        filter, shown = filter_from(request.query_params, hide_payloads=self.config.hide_payloads)
        after_text = request.query_params.get("after") or None
        after = event_id(after_text, "after") if after_text else None
        span = chart_span(request)
        chart = None
        async with self.db.connection() as conn:
            page = await self.admin.events(conn, filter, after=after, limit=self.config.page_size,
                                           newest=self._newest(filter))
            if filter.topic is not None:
                chart = await topic_chart(conn, self.queries, filter.topic, span)
        return await self.render(
            request, "events.html", page=page, shown=shown, filtered=not filter.is_empty(),
            chart=chart, spans=list(charts.SPANS),
            next_query=query(shown, after=page.next_after) if page.next_after else None,
            first_query=query(shown) if after else None, filter_query=query(shown),
            searched=self._newest(filter))

    def _newest(self, filter: EventFilter) -> int | None:
        """How many of the newest events a search may read: bounded for the filters no
        index serves (error text, payload), so one that matches nothing stays cheap."""
        return self.config.search_rows if filter.error or filter.payload else None

    async def event(self, request: Request) -> Response:
        wanted = event_id(request.path_params["event_id"])
        async with self.db.connection() as conn:
            record = await self.admin.show(conn, wanted)
            steps = await self.admin.workflow(conn, wanted, limit=WORKFLOW_STEPS_READ)
        payload = json.dumps(record.payload, indent=2, ensure_ascii=False, sort_keys=True)
        return await self.render(request, "event.html", event=record, payload=payload,
                                 payload_bytes=len(payload.encode()), timeline=timeline(record),
                                 workflow=workflow_view(steps) if len(steps) > 1 else None,
                                 workflow_steps=len(steps),
                                 workflow_cut=len(steps) >= WORKFLOW_STEPS_READ)

    def _back(self, request: Request, name: str, query_string: str = "", **params: Any
              ) -> Response:
        # A path: the browser resolves it against the address it used.
        target = self._path(request, name, **params)
        return RedirectResponse(f"{target}?{query_string}" if query_string else target,
                                status_code=303)

    async def retry(self, request: Request) -> Response:
        wanted = event_id(request.path_params["event_id"])
        async with self.db.connection() as conn:
            await self.admin.retry(conn, wanted)
        return self._back(request, "event", urlencode({"done": "retried", "n": wanted}),
                          event_id=wanted)

    async def cancel(self, request: Request) -> Response:
        wanted = event_id(request.path_params["event_id"])
        async with self.db.connection() as conn:
            await self.admin.cancel(conn, wanted)
        return self._back(request, "event", urlencode({"done": "cancelled", "n": wanted}),
                          event_id=wanted)

    async def bulk_confirm(self, request: Request) -> Response:
        kind = bulk_kind(request)
        filter, shown = filter_from(request.query_params, hide_payloads=self.config.hide_payloads)
        async with self.db.connection() as conn:
            count = await self.admin.count_matching(conn, filter, action=kind)
        return await self.render(request, "confirm.html", kind=kind, count=count, shown=shown,
                                 filter_query=query(shown))

    def bulk_run(self, kind: str) -> Handler:
        async def run(request: Request) -> Response:
            form = await request.form()
            filter, shown = filter_from(form, hide_payloads=self.config.hide_payloads)
            async with self.db.connection() as conn:
                ids = await self._bulk(conn, kind, filter)
            return self._back(request, "events", query(shown, done=f"bulk_{kind}", n=len(ids)))
        return run

    async def _bulk(self, conn: psycopg.AsyncConnection[Any], kind: str, filter: EventFilter
                    ) -> list[int]:
        run = self.admin.retry_matching if kind == "retry" else self.admin.cancel_matching
        return await run(conn, filter)

    async def pause(self, request: Request) -> Response:
        form = await request.form()
        pattern = str(form.get("pattern") or "").strip()
        tenant = str(form.get("tenant") or "").strip() or None
        reason = str(form.get("reason") or "").strip() or None
        async with self.db.connection() as conn:
            await self.admin.pause(conn, pattern, tenant=tenant, reason=reason,
                                   actor=actor(request))
        return self._back(request, "overview", urlencode({"done": "paused"}))

    async def resume(self, request: Request) -> Response:
        form = await request.form()
        pattern = str(form.get("pattern") or "").strip()
        tenant = str(form.get("tenant") or "").strip() or None
        async with self.db.connection() as conn:
            existed = await self.admin.resume(conn, pattern, tenant=tenant, actor=actor(request))
        return self._back(request, "overview",
                          urlencode({"done": "resumed" if existed else "not_paused"}))

    async def limits(self, request: Request) -> Response:
        async with self.db.connection() as conn:
            limits = await self.admin.limits(conn)
        return await self.render(request, "limits.html", limits=limits, live=True)

    async def set_limit(self, request: Request) -> Response:
        form = await request.form()
        pattern, values = limit_form(form)
        async with self.db.connection() as conn:
            await self.admin.set_limit(conn, pattern, **values,
                                       reason=text_field(form, "reason"), actor=actor(request))
        return self._back(request, "limits", urlencode({"done": "limit_set"}))

    async def clear_limit(self, request: Request) -> Response:
        form = await request.form()
        pattern = check_topic_pattern(text_field(form, "pattern") or "")
        async with self.db.connection() as conn:
            cleared = await self.admin.clear_limit(conn, pattern,
                                                   reason=text_field(form, "reason"),
                                                   actor=actor(request))
        return self._back(request, "limits",
                          urlencode({"done": "limit_cleared" if cleared else "no_override"}))

    async def schedules(self, request: Request) -> Response:
        async with self.db.connection() as conn:
            schedules = await self.admin.schedules(conn)
        return await self.render(request, "cron.html", schedules=schedules, live=True)

    async def change_schedule(self, request: Request) -> Response:
        action = schedule_action(request)
        form = await request.form()
        name = text_field(form, "name") or ""
        who = {"reason": text_field(form, "reason"), "actor": actor(request)}
        async with self.db.connection() as conn:
            if action == "set":
                await self.admin.set_schedule(conn, name, text_field(form, "expression") or "",
                                              **who)
            else:
                await getattr(self.admin, f"{action}_schedule")(conn, name, **who)
        return self._back(request, "schedules", urlencode({"done": f"schedule_{action}"}))

    async def audit(self, request: Request) -> Response:
        target, kind, shown = audit_filter(request.query_params)
        async with self.db.connection() as conn:
            entries = await self.admin.audit_log(conn, target=target, kind=kind,
                                                 limit=self.config.page_size)
        return await self.render(request, "audit.html", entries=entries, shown=shown,
                                 kinds=AUDIT_FAMILIES, live=True)


def workflow_view(steps: list[WorkflowStep]) -> list[list[dict[str, Any]]]:
    """The event page's drawing of a workflow: per level, per topic, either the steps
    (``steps``) or, past ``WORKFLOW_EACH``, their count by state (``counts``)."""
    drawn: list[list[dict[str, Any]]] = []
    for on_level in levels(steps):
        by_topic: dict[str, list[WorkflowStep]] = {}
        for s in on_level:
            by_topic.setdefault(s.topic or "(pruned)", []).append(s)
        drawn.append([
            {"topic": topic, "steps": group if len(group) <= WORKFLOW_EACH else None,
             "count": len(group),
             "counts": sorted(Counter(s.state.value if s.state else "pruned"
                                      for s in group).items())}
            for topic, group in by_topic.items()])
    return drawn
