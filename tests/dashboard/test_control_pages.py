"""The dashboard's run-time control: limits, cron and audit pages, topic charts, live refresh.

Each test serves the real Starlette app over httpx's ASGI transport against a
fresh database; what an action did is read back from the database.
"""

from __future__ import annotations

import base64
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import psycopg
from starlette.applications import Starlette

from conveyor import Admin, Producer
from conveyor.dashboard import DashboardConfig, allow_all, basic_auth, dashboard_app
from conveyor.db.named_queries import queries_for

Q = queries_for("conveyor")
TOKEN = re.compile(r'name="csrf_token" value="([^"]+)"')
ORIGIN = {"origin": "http://dash.test"}


@asynccontextmanager
async def _client(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://dash.test") as client:
            yield client
    finally:
        await app.state.conveyor_dashboard.close()


async def _token(client: httpx.AsyncClient, path: str, **kwargs: Any) -> str:
    page = await client.get(path, **kwargs)
    assert page.status_code == 200, page.text
    found = TOKEN.search(page.text)
    assert found is not None, "the page has no form with a CSRF token"
    client.cookies.set("conveyor_csrf", found.group(1))
    return found.group(1)


def _declare(url: str) -> None:
    """A route's limit and a router's schedule, as a worker's start writes them."""
    with psycopg.connect(url) as conn:
        conn.execute(Q["flow_declare"], {
            "patterns": ["report.render"], "max_runnings": [2], "rates": [5.0],
            "bursts": [5.0], "fair_bys": [None], "fifo_bys": [None]})
        conn.execute(Q["cron_declare"], {
            "names": ["nightly"], "expressions": ["0 3 * * *"], "timezones": ["UTC"],
            "topics": ["report.build"], "catch_ups": [300.0], "now": None})


def _audit(url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return [tuple(r) for r in conn.execute(
            "SELECT actor, kind, target, reason FROM conveyor.control_audit ORDER BY id")]


def _cells(html: str, pattern: str) -> list[str]:
    """The text of each cell of the table row that starts with ``pattern``'s link."""
    row = re.search(r"<tr>\s*<td><a[^>]*>" + re.escape(pattern) + r"</a>(.*?)</tr>", html, re.S)
    assert row is not None, f"no row for {pattern}"
    return [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>",
                                                                    row.group(1), re.S)]


async def test_the_limits_page_shows_declared_override_in_force_and_running(
        fresh_db: str) -> None:
    _declare(fresh_db)
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        Admin().set_limit(conn, "report.render", max_running=6)
        conn.execute("INSERT INTO conveyor.events (topic, payload, state, lease_owner, "
                     "lease_expires_at) VALUES ('report.render', '{}', 'running', "
                     "gen_random_uuid(), now() + interval '1 minute')")
    async with _client(dashboard_app(fresh_db)) as client:
        page = await client.get("/limits")
    assert page.status_code == 200
    # declared, override, in force, running; rate declared, override, in force; order
    assert _cells(page.text, "report.render")[:8] == ["2", "6", "6", "1", "5/s", "-", "5/s", "-"]
    assert "<form" not in page.text          # read-only: no action offered


async def test_setting_and_clearing_an_override_on_the_limits_page_is_audited(
        fresh_db: str) -> None:
    _declare(fresh_db)
    async with _client(dashboard_app(fresh_db, authorize=allow_all)) as client:
        token = await _token(client, "/limits")
        done = await client.post("/limits/set", headers=ORIGIN, data={
            "csrf_token": token, "pattern": "report.render", "max_running": "9",
            "rate": "120/m", "reason": "month end"})
        assert done.status_code == 303 and done.headers["location"] == "/limits?done=limit_set"
        shown = await client.get(done.headers["location"])
        assert "Limit set: the workers hold it from their next claim." in shown.text
        assert _cells(shown.text, "report.render")[:7] == ["2", "9", "9", "0", "5/s",
                                                           "2/s burst 2", "2/s"]
        cleared = await client.post("/limits/clear", headers=ORIGIN,
                                    data={"csrf_token": token, "pattern": "report.render"})
        assert cleared.headers["location"] == "/limits?done=limit_cleared"
    with psycopg.connect(fresh_db) as conn:
        assert conn.execute(Q["flow_lock"], {"pattern": "report.render"}).fetchone()[:3] == (
            2, 5.0, 5.0)
    assert _audit(fresh_db) == [("dashboard", "limit.set", "report.render", "month end"),
                                ("dashboard", "limit.clear", "report.render", None)]


async def test_the_dashboard_names_its_basic_auth_user_in_the_audit_log(fresh_db: str) -> None:
    good = {"authorization": "Basic " + base64.b64encode(b"ana:s3cret").decode()}
    async with _client(dashboard_app(fresh_db, authorize=basic_auth("ana:s3cret"))) as client:
        token = await _token(client, "/limits", headers=good)
        done = await client.post("/limits/set", headers={**ORIGIN, **good}, data={
            "csrf_token": token, "pattern": "bulk.*", "max_running": "1"})
        assert done.status_code == 303
    assert _audit(fresh_db) == [("dashboard:ana", "limit.set", "bulk.*", None)]


async def test_a_limit_form_needs_its_token_and_refuses_bad_values_naming_them(
        fresh_db: str) -> None:
    _declare(fresh_db)
    async with _client(dashboard_app(fresh_db, authorize=allow_all)) as client:
        token = await _token(client, "/limits")
        forged = await client.post("/limits/set", headers=ORIGIN, data={
            "csrf_token": "x" * 43, "pattern": "report.render", "max_running": "9"})
        assert forged.status_code == 403
        for fields, message in [({"max_running": "-3"}, "got -3"),
                                ({"max_running": "many"}, "invalid max running &#39;many&#39;"),
                                ({"rate": "0"}, "got 0.0"),
                                ({"rate": "nan"}, "got nan"),
                                ({}, "got none")]:
            refused = await client.post("/limits/set", headers=ORIGIN, data={
                "csrf_token": token, "pattern": "report.render", **fields})
            assert refused.status_code == 400 and message in refused.text, refused.text
    assert _audit(fresh_db) == []


async def test_the_cron_page_changes_disables_and_enables_a_schedule(fresh_db: str) -> None:
    _declare(fresh_db)
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute("UPDATE conveyor.cron_schedules SET last_fired_at = now() - interval "
                     "'2 hours', next_fire_at = now() + interval '3 hours'")
    async with _client(dashboard_app(fresh_db, authorize=allow_all)) as client:
        page = await client.get("/cron")
        assert page.status_code == 200
        assert "<code>0 3 * * *</code>" in page.text
        assert "in 3.0 h" in page.text and "2.0 h ago" in page.text    # next and last run
        token = TOKEN.search(page.text)
        assert token is not None
        client.cookies.set("conveyor_csrf", token.group(1))
        form = {"csrf_token": token.group(1), "name": "nightly"}
        changed = await client.post("/cron/set", headers=ORIGIN,
                                    data={**form, "expression": "30 2 * * *", "reason": "backup"})
        assert changed.headers["location"] == "/cron?done=schedule_set"
        page = await client.get("/cron")
        assert "<code>30 2 * * *</code>" in page.text and "set at run time" in page.text
        assert (await client.post("/cron/disable", headers=ORIGIN, data=form)).status_code == 303
        assert "disabled</span>" in (await client.get("/cron")).text
        assert (await client.post("/cron/enable", headers=ORIGIN, data=form)).status_code == 303
        assert (await client.post("/cron/clear", headers=ORIGIN, data=form)).status_code == 303
        bad = await client.post("/cron/set", headers=ORIGIN,
                                data={**form, "expression": "every day"})
        assert bad.status_code == 400 and "invalid cron expression &#39;every day&#39;" in bad.text
        unknown = await client.post("/cron/disable", headers=ORIGIN,
                                    data={**form, "name": "weekly"})
        assert unknown.status_code == 404 and "unknown cron schedule" in unknown.text
        action = await client.post("/cron/delete", headers=ORIGIN, data=form)
        assert action.status_code == 400
    assert [(r[1], r[3]) for r in _audit(fresh_db)] == [
        ("schedule.set", "backup"), ("schedule.disable", None), ("schedule.enable", None),
        ("schedule.clear", None)]


async def test_the_audit_page_lists_the_changes_newest_first_and_filters(fresh_db: str) -> None:
    _declare(fresh_db)
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        admin = Admin()
        admin.pause(conn, "email.*", reason="smtp <down>", actor="ana")
        admin.set_limit(conn, "report.render", max_running=3, actor="bo")
    async with _client(dashboard_app(fresh_db)) as client:
        page = await client.get("/audit")
        limits = await client.get("/audit?kind=limit")
        bad = await client.get("/audit?kind=nope")
    rows = re.findall(r"<td>(ana|bo)</td>\s*<td><code>([a-z.]+)</code></td>", page.text)
    assert rows == [("bo", "limit.set"), ("ana", "pause.set")]
    assert "smtp &lt;down&gt;" in page.text              # escaped, never markup
    assert "max_running: 3" in page.text
    assert "pause.set</code>" not in limits.text and "limit.set</code>" in limits.text
    assert bad.status_code == 400 and "invalid audit kind" in bad.text


async def test_the_overview_lists_a_topic_whose_events_all_succeeded_and_were_deleted(
        fresh_db: str) -> None:
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        Producer().enqueue(conn, "email.send", {})
        # A worker with retention=0 deletes a succeeded event: only its count is left.
        conn.execute("INSERT INTO conveyor.event_counts (minute, topic, succeeded) VALUES "
                     "(date_trunc('minute', now()) - interval '2 hours', 'audit.archive', 40)")
    async with _client(dashboard_app(fresh_db)) as client:
        page = await client.get("/")
    assert page.status_code == 200
    assert _cells(page.text, "audit.archive") == ["0", "0", "0", "0", "0", "40"]
    assert _cells(page.text, "email.send")[0] == "1"


async def test_a_topics_events_page_charts_that_topics_outcomes(fresh_db: str) -> None:
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute("INSERT INTO conveyor.event_counts (minute, topic, succeeded, failed) VALUES"
                     " (date_trunc('minute', now()) - interval '5 minutes', 'email.send', 12, 3),"
                     " (date_trunc('minute', now()) - interval '5 minutes', 'sms.send', 100, 0)")
    async with _client(dashboard_app(fresh_db)) as client:
        one = await client.get("/events?topic=email.send")
        prefix = await client.get("/events?topic=email.*&span=24h")
        unfiltered = await client.get("/events")
    assert 'aria-label="Outcomes per minute: 12 succeeded, 0 retried, 3 failed"' in one.text
    assert "20.0 % failed" in one.text
    assert 'aria-label="Outcomes per 15 min: 12 succeeded, 0 retried, 3 failed"' in prefix.text
    assert "<svg" not in unfiltered.text


async def test_live_pages_ask_for_refresh_and_work_without_the_script(fresh_db: str) -> None:
    async with _client(dashboard_app(fresh_db)) as client:
        overview = await client.get("/")
        events = await client.get("/events")
        script = await client.get("/static/live.js")
    async with _client(dashboard_app(fresh_db, DashboardConfig(live_refresh=0))) as client:
        off = await client.get("/limits")
    assert '<main data-live="10.0">' in overview.text
    assert "<main>" in events.text and "<main>" in off.text      # a list one pages through
    assert script.status_code == 200 and "data-live" in script.text
    # The script is the page's own (the CSP allows no inline script); the page is whole
    # without it: every figure is in the HTML.
    assert "script-src 'self'" in overview.headers["content-security-policy"]
    assert "<script>" not in overview.text
