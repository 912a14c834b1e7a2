"""The dashboard in Debian's chromium: what an operator sees and does, checked against the database.

Each test serves ``dashboard_app`` on a fresh migrated database, drives it
through the browser, and reads the rows afterwards with psycopg: a page that
says "done" proves nothing on its own. Plain ``def`` tests only, as
browser_support explains.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import psycopg
from playwright.sync_api import Dialog, Page, expect
from starlette.types import ASGIApp, Receive, Scope, Send

from browser_support import browser, page, phone_page, screenshot, serve_asgi
from conveyor import Admin, Producer
from conveyor.dashboard import DashboardConfig, allow_all, dashboard_app, read_only
from conveyor.dashboard.security import Authorize

__all__ = ["browser", "page", "phone_page"]  # shared fixtures

Conn = psycopg.Connection[Any]
THIN_SPACE = "\u2009"
WORKER = "6f1c2a4e-3b5d-4c7e-9f80-1a2b3c4d5e6f"
# Error text and traceback as a handler could raise them: markup must come out as text.
HOSTILE_ERROR = "SMTPDataError: 554 <script>alert(1)</script> rejected"
HOSTILE_TRACEBACK = ('Traceback (most recent call last):\n  File "mail.py", line 12, in send\n'
                     "    raise SMTPDataError('<script>alert(1)</script>')\n"
                     "SMTPDataError: <script>alert(1)</script>")


# -- serving ---------------------------------------------------------------------


def _closing_pool(app: Any) -> ASGIApp:
    """``app`` with a lifespan that closes its pool at shutdown, inside the server's own loop."""
    async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await app.state.conveyor_dashboard.close()
                await send({"type": "lifespan.shutdown.complete"})
                return
    return asgi


@contextlib.contextmanager
def served(db_url: str, authorize: Authorize = allow_all,
           config: DashboardConfig | None = None) -> Iterator[str]:
    app = dashboard_app(db_url, config or DashboardConfig(schema="conveyor"), authorize=authorize)
    with serve_asgi(_closing_pool(app)) as base_url:
        yield base_url


# -- seeding and reading the database ----------------------------------------------


def _enqueue(db_url: str, topic: str, count: int, *, delay: float = 0.0) -> list[int]:
    with psycopg.connect(db_url) as conn:
        if delay:
            producer = Producer()
            return [producer.enqueue(conn, topic, {"n": n}, delay=delay) for n in range(count)]
        return Producer().enqueue_many(conn, [(topic, {"n": n}) for n in range(count)])


def _set_state(db_url: str, ids: list[int], state: str) -> None:
    """Moves events to a finished or running state as the worker would leave them."""
    with psycopg.connect(db_url) as conn:
        if state == "running":
            conn.execute("UPDATE conveyor.events SET state = 'running', attempts = 1, attempted_at = now(),"
                         " lease_owner = %s, lease_expires_at = now() + interval '5 minutes'"
                         " WHERE id = ANY(%s)", (WORKER, ids))
        else:
            conn.execute("UPDATE conveyor.events SET state = %s, attempts = 1, attempted_at = now(),"
                         " finished_at = now() WHERE id = ANY(%s)", (state, ids))


def _fail(db_url: str, ids: list[int], error: str = "SMTP 451: try again later",
          traceback: str | None = "Traceback (most recent call last):\n  ...\nTimeoutError") -> None:
    """Fails events for good: every attempt spent, one history entry per attempt (as events.sql)."""
    with psycopg.connect(db_url) as conn:
        conn.execute(
            """UPDATE conveyor.events
               SET state = 'failed', attempts = max_attempts, attempted_at = now(),
                   finished_at = now(), updated_at = now(), last_error = %(error)s,
                   created_at = now() - max_attempts * interval '1 minute',
                   errors = (SELECT jsonb_agg(jsonb_build_object(
                                 'attempt', a, 'at', now() - (max_attempts - a) * interval '1 minute',
                                 'error', %(error)s::text, 'traceback', %(traceback)s::text,
                                 'worker', %(worker)s::text) ORDER BY a)
                             FROM generate_series(1, max_attempts) AS a)
               WHERE id = ANY(%(ids)s)""",
            {"error": error, "traceback": traceback, "worker": WORKER, "ids": ids})


def _states(db_url: str, ids: list[int]) -> dict[int, str]:
    with psycopg.connect(db_url) as conn:
        rows = conn.execute("SELECT id, state FROM conveyor.events WHERE id = ANY(%s)", (ids,))
        return dict(rows.fetchall())


def _pauses(db_url: str) -> list[tuple[str, str | None, str | None]]:
    with psycopg.connect(db_url) as conn:
        return conn.execute("SELECT pattern, tenant, reason FROM conveyor.pauses ORDER BY pattern").fetchall()


def _csrf_cookie(page: Page) -> str:
    tokens = [c["value"] for c in page.context.cookies() if c["name"] == "conveyor_csrf"]
    assert len(tokens) == 1, page.context.cookies()
    return tokens[0]


def _digits(text: str) -> str:
    return re.sub(r"\D", "", text)


# -- the overview ----------------------------------------------------------------


def _seed_overview(db_url: str) -> dict[str, int]:
    """Events in every state over four topics; returns the count each card must show."""
    due = _enqueue(db_url, "email.send", 4) + _enqueue(db_url, "sms.send", 3)
    scheduled = _enqueue(db_url, "email.digest", 2, delay=3600)
    running = _enqueue(db_url, "webhook.deliver", 1)
    failed = _enqueue(db_url, "email.send", 3)
    succeeded = _enqueue(db_url, "webhook.deliver", 5)
    cancelled = _enqueue(db_url, "sms.send", 1)
    _set_state(db_url, running, "running")
    _fail(db_url, failed)
    _set_state(db_url, succeeded, "succeeded")
    _set_state(db_url, cancelled, "cancelled")
    return {"pending": len(due), "scheduled": len(scheduled), "running": len(running),
            "failed": len(failed), "succeeded": len(succeeded), "cancelled": len(cancelled)}


def test_overview_shows_the_counts_by_state_and_the_topics(page: Page, fresh_db: str) -> None:
    expected = _seed_overview(fresh_db)
    with served(fresh_db) as base_url:
        page.goto(base_url + "/")
        shown = {state: page.locator(f".cards .card.state-{state} .value").inner_text()
                 for state in expected}
        topics = page.locator("section:has(h2:text-is('Topics')) tbody tr td:first-child")
        topic_names = topics.all_inner_texts()
        screenshot(page, "dashboard-overview")
    assert shown == {state: str(count) for state, count in expected.items()}
    assert topic_names == ["email.digest", "email.send", "sms.send", "webhook.deliver"]
    with psycopg.connect(fresh_db) as conn:
        counted = conn.execute("SELECT state, count(*) FROM conveyor.events GROUP BY state")
        in_db: dict[str, int] = dict(counted.fetchall())
    assert in_db == {"pending": expected["pending"] + expected["scheduled"], "running": 1, "failed": 3,
                     "succeeded": 5, "cancelled": 1}


def test_overview_fits_a_phone_without_horizontal_scrolling(phone_page: Page, fresh_db: str) -> None:
    expected = _seed_overview(fresh_db)
    with served(fresh_db) as base_url:
        phone_page.goto(base_url + "/")
        failed_card = phone_page.locator(".cards .card.state-failed .value").inner_text()
        widths = phone_page.evaluate(
            "[document.documentElement.scrollWidth, window.innerWidth]")
        screenshot(phone_page, "dashboard-overview-phone")
    assert failed_card == str(expected["failed"])
    assert widths[0] <= widths[1], f"the page is {widths[0]} px wide in a {widths[1]} px window"


def test_a_phone_keeps_numbers_on_one_line_and_the_workers_table_whole(phone_page: Page,
                                                                       fresh_db: str) -> None:
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        # A long topic squeezes the number columns of its row.
        conn.execute("INSERT INTO conveyor.events (topic, payload, state, attempts, finished_at)"
                     " SELECT 'billing.invoice.reminder_second_notice', '{}',"
                     " (ARRAY['pending', 'failed'])[1 + i % 2], i % 2, CASE WHEN i % 2 = 1"
                     " THEN now() END FROM generate_series(1, 20000) AS i")
        conn.execute("INSERT INTO conveyor.workers (id, name, host, pid, topics, concurrency)"
                     " VALUES (%s, 'vm-worker-1:24850', 'vm', 24850,"
                     " ARRAY['email.*', 'sms.send', 'webhook.deliver'], 16)", (WORKER,))
    with served(fresh_db) as base_url:
        phone_page.goto(base_url + "/")
        # Lines each number takes: its text's height over its line height.
        lines = phone_page.evaluate("""() => [...document.querySelectorAll('.card .value, td.num')]
            .map(e => { const r = document.createRange(); r.selectNodeContents(e);
                        return [e.innerText, r.getBoundingClientRect().height
                                / parseFloat(getComputedStyle(e).lineHeight)]; })""")
        table = phone_page.locator("section:has(h2:has-text('Workers')) .table-wrap")
        widths = table.evaluate("w => [w.scrollWidth, w.clientWidth]")
        heartbeat = phone_page.locator("table.workers th", has_text="heartbeat").is_visible()
        screenshot(phone_page, "dashboard-overview-phone-10000")
    wrapped = [text for text, height in lines if height > 1.6 and text.strip()]
    assert not wrapped, f"numbers wrapped onto two lines: {wrapped}"
    assert "10\u2009000" in [text for text, _ in lines]                  # a card and a cell
    assert widths[0] <= widths[1], f"the Workers table is {widths[0]} px wide in {widths[1]} px"
    assert heartbeat


# -- the events list ---------------------------------------------------------------


def _rows(page: Page) -> list[tuple[int, str, str]]:
    cells = page.locator("table.events tbody tr").evaluate_all(
        "rows => rows.map(r => [r.cells[0].innerText, r.cells[1].innerText, r.cells[3].innerText])")
    return [(int(i), topic.strip(), state.strip()) for i, topic, state in cells]


def test_events_filter_by_state_and_topic_pattern_pages_without_repeats(page: Page, fresh_db: str) -> None:
    matching = _enqueue(fresh_db, "email.send", 45) + _enqueue(fresh_db, "email.digest", 20)
    other_topics = _enqueue(fresh_db, "sms.send", 10) + _enqueue(fresh_db, "emailer.send", 5)
    pending_email = _enqueue(fresh_db, "email.send", 10)
    _fail(fresh_db, matching + other_topics)
    with served(fresh_db) as base_url:
        page.goto(base_url + "/events")
        page.check("input[name=state][value=failed]")
        page.fill("input[name=topic]", "email.*")
        page.get_by_role("button", name="Filter").click()
        page.wait_for_url(re.compile(r"/events\?.*state=failed"))
        expect(page.locator("input[name=topic]")).to_have_value("email.*")
        screenshot(page, "dashboard-events-filtered")
        pages = [_rows(page)]
        while page.get_by_role("link", name="Older →").count():
            page.get_by_role("link", name="Older →").click()
            page.wait_for_load_state()
            pages.append(_rows(page))
            assert len(pages) < 10, "the pager does not end"
        screenshot(page, "dashboard-events-last-page")
    seen = [event_id for rows in pages for event_id, _, _ in rows]
    assert [len(rows) for rows in pages] == [50, 15]
    assert all(state == "failed" and re.fullmatch(r"email\.[a-z]+", topic)
               for rows in pages for _, topic, state in rows), pages
    assert len(seen) == len(set(seen)) and seen == sorted(seen, reverse=True)
    assert set(seen) == set(matching)
    states = _states(fresh_db, matching + other_topics + pending_email)
    assert {states[i] for i in matching + other_topics} == {"failed"}
    assert {states[i] for i in pending_email} == {"pending"}


def test_bulk_retry_of_1000_failed_events_retries_exactly_those(page: Page, fresh_db: str) -> None:
    targets = _enqueue(fresh_db, "email.send", 1000)
    bystanders = _enqueue(fresh_db, "sms.send", 30)
    _fail(fresh_db, targets + bystanders)
    with served(fresh_db) as base_url:
        page.goto(base_url + "/events")
        page.check("input[name=state][value=failed]")
        page.fill("input[name=topic]", "email.send")
        page.get_by_role("button", name="Filter").click()
        page.wait_for_url(re.compile(r"topic=email\.send"))
        page.get_by_role("link", name="Retry all matching…").click()
        page.wait_for_url(re.compile(r"/bulk/retry\?"))
        big = page.locator("p.big").inner_text()
        submit = page.locator("form.confirm button[type=submit]")
        label = submit.inner_text()
        screenshot(page, "dashboard-bulk-retry-confirm")
        submit.click()
        page.wait_for_url(re.compile(r"/events\?.*done=bulk_retry"))
        notice = page.locator("p.notice").inner_text()
        screenshot(page, "dashboard-bulk-retry-done")
    assert f"1{THIN_SPACE}000 events can run again now" in big and _digits(big) == "1000"
    assert label == f"Retry 1{THIN_SPACE}000 events"
    assert "events will run again now" in notice and _digits(notice) == "1000"
    with psycopg.connect(fresh_db) as conn:
        rows = conn.execute(
            "SELECT topic, state, run_at <= now() AS due, count(*) FROM conveyor.events"
            " GROUP BY 1, 2, 3 ORDER BY 1").fetchall()
        retried = {i for (i,) in conn.execute(
            "SELECT id FROM conveyor.events WHERE state = 'pending' AND run_at <= now()").fetchall()}
    assert rows == [("email.send", "pending", True, 1000), ("sms.send", "failed", True, 30)]
    assert retried == set(targets)


# -- one event -------------------------------------------------------------------


def test_event_detail_escapes_the_error_and_retry_makes_it_pending(page: Page, fresh_db: str) -> None:
    [event_id] = _enqueue(fresh_db, "email.send", 1)
    _fail(fresh_db, [event_id], error=HOSTILE_ERROR, traceback=HOSTILE_TRACEBACK)
    dialogs: list[str] = []

    def on_dialog(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        dialog.dismiss()

    page.on("dialog", on_dialog)
    with served(fresh_db) as base_url:
        page.goto(f"{base_url}/events/{event_id}")
        page.locator("article.attempt-error").first.locator("summary").click()
        text = page.locator("main").text_content() or ""
        source = page.content()
        scripts = page.locator("script").count()
        screenshot(page, "dashboard-event-failed")
        page.get_by_role("button", name="Retry", exact=True).click()
        page.wait_for_url(re.compile(rf"/events/{event_id}\?done=retried"))
        notice = page.locator("p.notice").inner_text()
        badge = page.locator("h1 .badge").inner_text()
        screenshot(page, "dashboard-event-retried")
    assert dialogs == []
    assert scripts == 0
    assert HOSTILE_ERROR in text and "SMTPDataError: <script>alert(1)</script>" in text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in source
    assert notice == f"Event {event_id} will run again now." and badge == "pending"
    with psycopg.connect(fresh_db) as conn:
        row = conn.execute("SELECT state, run_at <= now() FROM conveyor.events WHERE id = %s",
                           (event_id,)).fetchone()
    assert row == ("pending", True)


# -- pauses ------------------------------------------------------------------------


def test_pause_form_pauses_the_pattern_and_resume_removes_it(page: Page, fresh_db: str) -> None:
    reason = "SMTP relay down (ops, INC-42)"
    with served(fresh_db) as base_url:
        page.goto(base_url + "/")
        form = page.get_by_role("form", name="Pause a topic")
        form.locator("input[name=pattern]").fill("email.*")
        form.locator("input[name=reason]").fill(reason)
        form.get_by_role("button", name="Pause").click()
        page.wait_for_url(re.compile(r"/\?done=paused"))
        paused_rows = page.locator("h2:text-is('Paused') + .table-wrap table tbody tr").all_inner_texts()
        notice = page.locator("p.notice").inner_text()
        in_db_while_paused = _pauses(fresh_db)
        screenshot(page, "dashboard-paused")
        page.get_by_role("button", name="Resume").click()
        page.wait_for_url(re.compile(r"/\?done=resumed"))
        after_notice = page.locator("p.notice").inner_text()
        empty = page.locator("h2:text-is('Paused') + p.empty").inner_text()
    # The notice is a code's text, never the URL's (a crafted link could say anything).
    assert notice == "Paused: the pause is listed under Paused."
    assert len(paused_rows) == 1 and "email.*" in paused_rows[0] and reason in paused_rows[0]
    assert in_db_while_paused == [("email.*", None, reason)]
    assert after_notice == "Resumed: the pause is lifted." and empty == "Nothing is paused."
    assert _pauses(fresh_db) == []


def test_the_limits_form_sets_an_override_and_the_live_page_shows_the_next_change(
        page: Page, fresh_db: str) -> None:
    with psycopg.connect(fresh_db) as conn:
        conn.execute("INSERT INTO conveyor.flow_limits (pattern, max_running) "
                     "VALUES ('report.render', 2)")
    in_force = page.locator("table.limits tbody tr").first.locator("td").nth(3)
    with served(fresh_db, config=DashboardConfig(live_refresh=1)) as base_url:
        page.goto(base_url + "/limits")
        form = page.get_by_role("form", name="Set a limit override")
        form.locator("input[name=pattern]").fill("report.render")
        form.locator("input[name=max_running]").fill("6")
        form.locator("input[name=reason]").fill("month end")
        form.get_by_role("button", name="Set").click()
        page.wait_for_url(re.compile(r"/limits\?done=limit_set"))
        expect(in_force).to_have_text("6")
        screenshot(page, "dashboard-limits")
        with psycopg.connect(fresh_db, autocommit=True) as conn:
            Admin().set_limit(conn, "report.render", max_running=11, actor="cli-user")
        # No reload: the page's script reads it again within its second.
        expect(in_force).to_have_text("11", timeout=8000)
        expect(page.locator("p.notice")).to_have_count(0)   # said once, not at each refresh
    with psycopg.connect(fresh_db) as conn:
        audit = conn.execute("SELECT actor, reason FROM conveyor.control_audit ORDER BY id").fetchall()
    assert audit == [("dashboard", "month end"), ("cli-user", None)]


# -- who may act -------------------------------------------------------------------


def test_read_only_shows_no_action_and_refuses_action_posts(page: Page, fresh_db: str) -> None:
    [event_id] = _enqueue(fresh_db, "email.send", 1)
    _fail(fresh_db, [event_id])
    with served(fresh_db, authorize=read_only) as base_url:
        page.goto(base_url + "/")
        overview_forms = page.locator("form").count()
        page.goto(base_url + "/events?state=failed")
        bulk_links = page.locator("a[href*='/bulk/']").count()
        post_forms_on_list = page.locator("form[method=post]").count()
        page.goto(f"{base_url}/events/{event_id}")
        buttons = page.locator("main button").count()
        screenshot(page, "dashboard-event-read-only")
        token = _csrf_cookie(page)
        answers = {
            "retry": page.request.post(f"{base_url}/events/{event_id}/retry",
                                       form={"csrf_token": token}, max_redirects=0),
            "cancel": page.request.post(f"{base_url}/events/{event_id}/cancel",
                                        form={"csrf_token": token}, max_redirects=0),
            "bulk retry": page.request.post(f"{base_url}/bulk/retry/run", max_redirects=0,
                                            form={"csrf_token": token, "state": "failed"}),
            "pause": page.request.post(f"{base_url}/pauses", max_redirects=0,
                                       form={"csrf_token": token, "pattern": "email.*"}),
        }
        statuses = {name: answer.status for name, answer in answers.items()}
        refusals = {name: "Not allowed" in answer.text() for name, answer in answers.items()}
    assert (overview_forms, bulk_links, post_forms_on_list, buttons) == (0, 0, 0, 0)
    assert statuses == {"retry": 403, "cancel": 403, "bulk retry": 403, "pause": 403}
    assert all(refusals.values()), refusals     # refused as not allowed, not for the token
    assert _states(fresh_db, [event_id]) == {event_id: "failed"}
    assert _pauses(fresh_db) == []


def test_action_post_without_the_csrf_token_is_refused(page: Page, fresh_db: str) -> None:
    [event_id] = _enqueue(fresh_db, "email.send", 1)
    _fail(fresh_db, [event_id])
    with served(fresh_db) as base_url:
        page.goto(f"{base_url}/events/{event_id}")
        token = _csrf_cookie(page)
        url = f"{base_url}/events/{event_id}/retry"
        refused = {
            "no token": page.request.post(url, form={}, max_redirects=0),
            "wrong token": page.request.post(url, form={"csrf_token": "x" * 43}, max_redirects=0),
            "right token, foreign origin": page.request.post(
                url, form={"csrf_token": token}, headers={"Origin": "https://evil.example"},
                max_redirects=0),
        }
        statuses = {name: answer.status for name, answer in refused.items()}
        bodies = {name: answer.text() for name, answer in refused.items()}
        state_after_refusals = _states(fresh_db, [event_id])[event_id]
        # The same POST with the cookie's token goes through: the refusals were the token's doing.
        accepted = page.request.post(url, form={"csrf_token": token}, max_redirects=0).status
    assert statuses == {name: 403 for name in refused}
    assert all("Stale or foreign form" in body for body in bodies.values())
    assert state_after_refusals == "failed"
    assert accepted == 303 and _states(fresh_db, [event_id]) == {event_id: "pending"}


# -- the outcome chart and the payload filter ---------------------------------------


def test_the_chart_draws_the_counts_and_switches_to_a_day(page: Page, fresh_db: str) -> None:
    with psycopg.connect(fresh_db) as conn:
        conn.execute("INSERT INTO conveyor.event_counts (minute, topic, succeeded, retried, failed)"
                     " SELECT date_trunc('minute', now()) - m * interval '1 minute', 'email.send',"
                     " 100 + m, m % 3, CASE WHEN m = 7 THEN 40 ELSE 0 END"
                     " FROM generate_series(0, 29) AS m")
    with served(fresh_db) as base_url:
        page.goto(base_url + "/")
        heading = page.locator(".chart-box h2").inner_text()
        bars = page.locator("svg.chart g.bar").count()
        drawn = page.locator("svg.chart rect.ok").count()
        failed_bars = page.locator("svg.chart rect.fail").count()
        facts = page.locator(".chart-facts").inner_text()
        axis = page.locator("svg.chart text.unit").text_content()
        box = page.locator("svg.chart").bounding_box()
        screenshot(page, "dashboard-chart-hour")
        page.get_by_role("link", name="24h").click()
        page.wait_for_url(re.compile(r"span=24h"))
        day_heading = page.locator(".chart-box h2").inner_text()
        day_bars = page.locator("svg.chart g.bar").count()
        screenshot(page, "dashboard-chart-day")
    assert heading == "Outcomes, last hour" and day_heading == "Outcomes, last 24 hours"
    assert (bars, drawn, failed_bars, day_bars) == (60, 30, 1, 96)
    total = sum(100 + m for m in range(30))
    assert f"{total:,}".replace(",", THIN_SPACE) + " succeeded" in facts
    assert "40 failed" in facts and axis == "events per minute"
    assert box is not None and box["width"] > 1000 and box["height"] > 150


def test_the_payload_filter_finds_events_by_a_json_path(page: Page, fresh_db: str) -> None:
    with psycopg.connect(fresh_db) as conn:
        producer = Producer()
        acme = [producer.enqueue(conn, "bill.send", {"customer": "acme", "n": n}) for n in range(3)]
        other = [producer.enqueue(conn, "bill.send", {"customer": "globex", "n": n}) for n in range(4)]
    _fail(fresh_db, acme[:2] + other[:1])
    with served(fresh_db) as base_url:
        page.goto(base_url + "/events")
        page.locator("input[name=payload]").fill('$.customer == "acme"')
        page.get_by_role("button", name="Filter").click()
        page.wait_for_url(re.compile(r"payload="))
        listed = [int(t) for t in page.locator("table.events tbody td:first-child").all_inner_texts()]
        page.get_by_role("link", name="Retry all matching…").click()
        confirm = page.locator("p.big").inner_text()
        page.get_by_role("button", name=re.compile(r"^Retry 2 events$")).click()
        page.wait_for_url(re.compile(r"done=bulk_retry"))
    assert listed == sorted(acme, reverse=True)
    assert confirm.startswith("2 events")
    assert _states(fresh_db, acme + other) == {
        acme[0]: "pending", acme[1]: "pending", acme[2]: "pending",
        other[0]: "failed", other[1]: "pending", other[2]: "pending", other[3]: "pending"}


def test_an_event_page_draws_its_workflow_with_links_to_each_step(
        page: Page, fresh_db: str) -> None:
    from conveyor import chain, group, step
    first, last = step("order.reserve"), step("order.close")
    members = [step("mail.confirm"), step("invoice.create")]
    many = [step("report.collect", {"i": i}) for i in range(40)]
    with psycopg.connect(fresh_db) as conn:
        ids = Producer().enqueue_workflow(
            conn, chain(first, group(*members, *many), last))
        conn.execute("UPDATE conveyor.events SET state = 'succeeded', finished_at = now()"
                     " WHERE id = ANY(%s)", ([ids[first], ids[members[0]], *ids[1:30]],))
        conn.commit()
    with served(fresh_db) as base_url:
        page.goto(f"{base_url}/events/{ids[last]}")
        levels = page.locator(".workflow .level")
        expect(levels).to_have_count(3)
        expect(levels.nth(1)).to_contain_text("40 \u00d7 report.collect")
        screenshot(page, "dashboard-event-workflow")
        levels.nth(0).get_by_role("link", name=str(ids[first])).click()
        page.wait_for_url(re.compile(rf"/events/{ids[first]}$"))
        expect(page.locator("h1 .badge")).to_have_text("succeeded")
        expect(page.locator(".workflow .step.this")).to_contain_text("order.reserve")
