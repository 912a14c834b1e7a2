"""The dashboard over HTTP (no browser): access, CSRF, bad input, timeouts, mounting.

Each test serves the real Starlette app over httpx's ASGI transport against a
fresh database; what an action did is read back from the database.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import psycopg
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from conveyor import Producer
from conveyor.cli.dashboard_command import access
from conveyor.dashboard import (
    Action,
    DashboardConfig,
    Unauthenticated,
    allow_all,
    basic_auth,
    dashboard_app,
    read_only,
)
from conveyor.errors import ConfigError

TOKEN = re.compile(r'name="csrf_token" value="([^"]+)"')


def _seed(url: str) -> dict[str, int]:
    with psycopg.connect(url, autocommit=True) as conn:
        producer = Producer()
        ok = producer.enqueue(conn, "email.send", {"to": "a@example.com", "secret": "hunter2"})
        bad = producer.enqueue(conn, "email.send", {"to": "b@example.com"})
        conn.execute(
            "UPDATE conveyor.events SET state = 'failed', attempts = max_attempts, finished_at = now(),"
            " last_error = 'SMTP 451 <b>bold</b>' WHERE id = %s", (bad,))
    return {"pending": ok, "failed": bad}


def _state(url: str, event_id: int) -> str:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT state FROM conveyor.events WHERE id = %s", (event_id,)).fetchone()
    assert row is not None
    return str(row[0])


@asynccontextmanager
async def _client(app: Starlette, **kwargs: Any) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://dash.test",
                                     **kwargs) as client:
            yield client
    finally:
        await app.state.conveyor_dashboard.close()


async def _token(client: httpx.AsyncClient, path: str = "/") -> str:
    page = await client.get(path)
    assert page.status_code == 200, page.text
    found = TOKEN.search(page.text)
    assert found is not None, "the page has no form with a CSRF token"
    assert client.cookies.get("conveyor_csrf") == found.group(1)
    return found.group(1)


def _app(url: str, **kwargs: Any) -> Starlette:
    return dashboard_app(url, kwargs.pop("config", DashboardConfig()), **kwargs)


async def test_read_only_by_default_shows_no_action_and_refuses_one(fresh_db: str) -> None:
    ids = _seed(fresh_db)
    async with _client(_app(fresh_db)) as client:
        page = await client.get(f"/events/{ids['failed']}")
        assert page.status_code == 200
        assert "SMTP 451 &lt;b&gt;bold&lt;/b&gt;" in page.text      # escaped, never markup
        assert "<form" not in page.text
        cookie = page.cookies.get("conveyor_csrf")
        assert cookie
        refused = await client.post(f"/events/{ids['failed']}/retry", data={"csrf_token": cookie})
        assert refused.status_code == 403
        assert "does not allow retry" in refused.text
    assert _state(fresh_db, ids["failed"]) == "failed"


async def test_an_action_needs_the_token_of_its_cookie(fresh_db: str) -> None:
    ids = _seed(fresh_db)
    async with _client(_app(fresh_db, authorize=allow_all)) as client:
        token = await _token(client)
        missing = await client.post(f"/events/{ids['failed']}/retry")
        wrong = await client.post(f"/events/{ids['failed']}/retry", data={"csrf_token": "x" * 43})
        foreign = await client.post(f"/events/{ids['failed']}/retry", data={"csrf_token": token},
                                    headers={"origin": "http://evil.example"})
        assert [r.status_code for r in (missing, wrong, foreign)] == [403, 403, 403]
        assert _state(fresh_db, ids["failed"]) == "failed"
        done = await client.post(f"/events/{ids['failed']}/retry", data={"csrf_token": token},
                                 headers={"origin": "http://dash.test"})
        assert done.status_code == 303
        assert done.headers["location"].endswith(f"/events/{ids['failed']}?done=retried&n={ids['failed']}")
        shown = await client.get(done.headers["location"])
        assert f"Event {ids['failed']} will run again now." in shown.text
    assert _state(fresh_db, ids["failed"]) == "pending"


async def test_basic_auth_asks_for_credentials_and_read_only_keeps_actions_out(fresh_db: str) -> None:
    ids = _seed(fresh_db)
    good = {"authorization": "Basic " + base64.b64encode(b"ops:s3cret").decode()}
    bad = {"authorization": "Basic " + base64.b64encode(b"ops:wrong").decode()}
    async with _client(_app(fresh_db, authorize=basic_auth("ops:s3cret"))) as client:
        anonymous = await client.get("/")
        assert anonymous.status_code == 401
        assert anonymous.headers["www-authenticate"].startswith("Basic")
        assert (await client.get("/", headers=bad)).status_code == 401
        page = await client.get("/", headers=good)
        assert page.status_code == 200
        token = TOKEN.search(page.text)
        assert token is not None
        client.cookies.set("conveyor_csrf", token.group(1))
        retried = await client.post(f"/events/{ids['failed']}/cancel", headers=good,
                                    data={"csrf_token": token.group(1)})
        assert retried.status_code == 303
    assert _state(fresh_db, ids["failed"]) == "cancelled"
    viewer = basic_auth("ops:s3cret", actions=False)
    async with _client(_app(fresh_db, authorize=viewer)) as client:
        page = await client.get("/", headers=good)
        assert page.status_code == 200 and "<form" not in page.text


async def test_an_async_authorize_decides_each_action(fresh_db: str) -> None:
    ids = _seed(fresh_db)
    asked: list[Action] = []

    async def authorize(request: Any, action: Action) -> bool:
        await asyncio.sleep(0)
        asked.append(action)
        if request.headers.get("x-user") is None:
            raise Unauthenticated()
        return action in (Action.VIEW, Action.CANCEL)

    async with _client(_app(fresh_db, authorize=authorize)) as client:
        assert (await client.get("/")).status_code == 401
        client.headers["x-user"] = "alice"
        token = await _token(client, f"/events/{ids['pending']}")
        page = await client.get(f"/events/{ids['failed']}")
        assert ">Cancel</button>" in page.text and ">Retry</button>" not in page.text
        refused = await client.post(f"/events/{ids['failed']}/retry", data={"csrf_token": token})
        assert refused.status_code == 403
        done = await client.post(f"/events/{ids['pending']}/cancel", data={"csrf_token": token})
        assert done.status_code == 303
    assert Action.RETRY in asked and Action.CANCEL in asked
    assert _state(fresh_db, ids["failed"]) == "failed"
    assert _state(fresh_db, ids["pending"]) == "cancelled"


@pytest.mark.parametrize(("query", "message"), [
    ("topic=bad%20topic!", "malformed topic pattern 'bad topic!'"),
    ("tenant=Not_A_Label", "invalid tenant 'Not_A_Label'"),
    ("state=sleeping", "unknown state 'sleeping' in states"),
    ("within=3y", "invalid created-within choice '3y'"),
    ("before=2w", "invalid created-before choice '2w'"),
    ("payload=%24.a%20%3D%3D", "invalid payload path '$.a =='"),
])
async def test_a_bad_filter_answers_400_naming_the_value(fresh_db: str, query: str, message: str) -> None:
    async with _client(_app(fresh_db)) as client:
        page = await client.get(f"/events?{query}")
    assert page.status_code == 400
    assert message in page.text.replace("&#39;", "'"), page.text


async def test_unknown_event_is_404_and_payloads_can_be_hidden(fresh_db: str) -> None:
    ids = _seed(fresh_db)
    async with _client(_app(fresh_db, config=DashboardConfig(hide_payloads=True))) as client:
        assert (await client.get("/events/999999")).status_code == 404
        page = await client.get(f"/events/{ids['pending']}")
    assert page.status_code == 200
    assert "hunter2" not in page.text and "Hidden by the dashboard" in page.text
    async with _client(_app(fresh_db)) as client:
        assert "hunter2" in (await client.get(f"/events/{ids['pending']}")).text


async def test_a_query_cut_by_the_statement_timeout_is_said_so(fresh_db: str) -> None:
    _seed(fresh_db)
    config = DashboardConfig(statement_timeout=0.2)
    with psycopg.connect(fresh_db) as locker:
        # A lock the listing must wait for: the wait is what the timeout cuts.
        locker.execute("LOCK TABLE conveyor.events IN ACCESS EXCLUSIVE MODE")
        async with _client(_app(fresh_db, config=config)) as client:
            page = await client.get("/events")
        locker.rollback()
    assert page.status_code == 503
    assert "statement timeout" in page.text and "0.2 s" in page.text


async def test_mounted_under_a_prefix_every_link_and_the_cookie_keep_it(fresh_db: str) -> None:
    ids = _seed(fresh_db)
    host = Starlette(routes=[Mount("/ops/queue", app=_app(fresh_db, authorize=allow_all))])
    host.state.conveyor_dashboard = host.routes[0].app.state.conveyor_dashboard  # type: ignore[attr-defined]
    async with _client(host) as client:
        page = await client.get("/ops/queue/")
        assert page.status_code == 200
        links = re.findall(r'(?:href|action)="([^"]+)"', page.text)
        # Paths, never built from Host (a proxy may not pass it on).
        assert links and all(link.startswith("/ops/queue/") for link in links), links
        assert "Path=/ops/queue" in page.headers["set-cookie"]
        css = await client.get("/ops/queue/static/dashboard.css")
        assert css.status_code == 200 and "--bad" in css.text
        token = TOKEN.search(page.text)
        assert token is not None
        done = await client.post("/ops/queue/pauses", data={"csrf_token": token.group(1),
                                                             "pattern": "email.*", "reason": "relay down"})
        assert done.status_code == 303 and done.headers["location"].startswith("/ops/queue/")
    with psycopg.connect(fresh_db) as conn:
        assert conn.execute("SELECT pattern, reason FROM conveyor.pauses").fetchall() == [
            ("email.*", "relay down")]
    assert _state(fresh_db, ids["failed"]) == "failed"


@pytest.mark.parametrize(("fields", "message"), [
    ({"statement_timeout": 0}, "expected statement_timeout to be 0.01-3600 seconds, got 0"),
    ({"statement_timeout": float("nan")}, "got nan"),
    ({"page_size": 0}, "expected page_size to be an integer 1-500, got 0"),
    ({"pool_size": True}, "expected pool_size to be an integer 1-100, got True"),
    ({"schema": "bad schema"}, "bad schema"),
])
def test_config_refuses_bad_values_naming_them(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        DashboardConfig(**fields)


def _args(**kwargs: Any) -> argparse.Namespace:
    base = {"insecure_local": False, "basic_auth": None, "read_only": False, "host": "127.0.0.1"}
    return argparse.Namespace(**{**base, **kwargs})


def test_the_command_refuses_to_serve_actions_to_anyone() -> None:
    with pytest.raises(ConfigError, match="needs --basic-auth USER:PASSWORD, --read-only, or"):
        access(_args())
    with pytest.raises(ConfigError, match=re.escape("refused on --host '0.0.0.0'")):
        access(_args(insecure_local=True, host="0.0.0.0"))
    with pytest.raises(ConfigError, match="cannot be combined"):
        access(_args(insecure_local=True, read_only=True))
    with pytest.raises(ConfigError, match="USER:PASSWORD"):
        access(_args(basic_auth="nopassword"))
    assert access(_args(insecure_local=True, host="::1")) is allow_all
    assert access(_args(insecure_local=True, host="localhost")) is allow_all
    assert access(_args(read_only=True, host="0.0.0.0")) is read_only


async def test_the_overview_charts_the_counts_the_workers_wrote(fresh_db: str) -> None:
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute("INSERT INTO conveyor.event_counts (minute, topic, succeeded, retried, failed)"
                     " VALUES (date_trunc('minute', now()) - interval '5 minutes', 'email.send',"
                     " 1200, 7, 30),"
                     " (date_trunc('minute', now()) - interval '3 hours', 'email.send', 500, 0, 0)")
    async with _client(_app(fresh_db)) as client:
        hour = await client.get("/")
        day = await client.get("/?span=24h")
        bad = await client.get("/?span=1y")
    assert hour.status_code == 200 and day.status_code == 200
    assert "1\u2009200 succeeded, 7 retried, 30 failed" in hour.text          # the bar's title
    assert "2.4 % failed" in hour.text                                        # 30 of 1,230
    assert 'aria-label="Outcomes per minute: 1200 succeeded, 7 retried, 30 failed"' in hour.text
    assert 'aria-label="Outcomes per 15 min: 1700 succeeded, 7 retried, 30 failed"' in day.text
    assert bad.status_code == 400 and "invalid chart span &#39;1y&#39;" in bad.text


async def test_the_payload_filter_lists_matches_and_is_off_when_payloads_are_hidden(fresh_db: str) -> None:
    ids = _seed(fresh_db)
    query = "/events?payload=" + "%24.to%20%3D%3D%20%22b%40example.com%22"     # $.to == "b@example.com"
    async with _client(_app(fresh_db)) as client:
        page = await client.get(query)
    assert page.status_code == 200
    assert f'href="/events/{ids["failed"]}"' in page.text
    assert f'href="/events/{ids["pending"]}"' not in page.text
    async with _client(_app(fresh_db, config=DashboardConfig(hide_payloads=True))) as client:
        hidden = await client.get(query)
        form = await client.get("/events")
    assert hidden.status_code == 400 and "the payload filter is off" in hidden.text
    assert 'name="payload"' not in form.text


async def test_created_before_and_within_make_a_time_range(fresh_db: str) -> None:
    ids = _seed(fresh_db)
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute("UPDATE conveyor.events SET created_at = now() - interval '3 days' WHERE id = %s",
                     (ids["failed"],))
    async with _client(_app(fresh_db)) as client:
        old = await client.get("/events?before=24h&within=7d")
        new = await client.get("/events?within=24h")
    assert f"/events/{ids['failed']}\"" in old.text and f"/events/{ids['pending']}\"" not in old.text
    assert f"/events/{ids['pending']}\"" in new.text and f"/events/{ids['failed']}\"" not in new.text


async def test_the_scheduled_chip_lists_the_pending_events_not_due_yet(fresh_db: str) -> None:
    ids = _seed(fresh_db)
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        later = Producer().enqueue(conn, "email.send", {"to": "c@example.com"}, delay=3600)
    async with _client(_app(fresh_db)) as client:
        page = await client.get("/events?state=scheduled")
    assert page.status_code == 200
    assert f'href="/events/{later}"' in page.text
    assert f'href="/events/{ids["pending"]}"' not in page.text     # due: pending, not scheduled
    assert 'value="scheduled" checked' in page.text


async def test_the_bulk_confirmation_counts_in_one_statement(fresh_db: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute("INSERT INTO conveyor.events (topic, payload, state, attempts, max_attempts,"
                     " finished_at) SELECT 'mass.fail', '{}', 'failed', 1, 1, now()"
                     " FROM generate_series(1, 2500)")
    statements: list[str] = []
    original = psycopg.AsyncCursor.execute

    async def recording(self: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        statements.append(str(query))
        return await original(self, query, params, **kwargs)

    monkeypatch.setattr(psycopg.AsyncCursor, "execute", recording)
    async with _client(_app(fresh_db, authorize=allow_all)) as client:
        page = await client.get("/bulk/retry?state=failed&topic=mass.*")
    assert page.status_code == 200 and "2\u2009500 events can run again" in page.text
    # Admin.count_matching: one count, not the action's batches of 1,000 as a dry run.
    on_events = [s for s in statements if "conveyor\".events" in s or "conveyor.events" in s]
    assert len(on_events) == 1 and "count(*)" in on_events[0], on_events


async def test_the_timeline_puts_an_attempts_start_before_its_failure(fresh_db: str) -> None:
    ids = _seed(fresh_db)
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute("UPDATE conveyor.events SET attempted_at = now(), finished_at = now(),"
                     " errors = jsonb_build_array("
                     "jsonb_build_object('attempt', attempts, 'at', now()::text, 'error', 'x'))"
                     " WHERE id = %s", (ids["failed"],))
    async with _client(_app(fresh_db)) as client:
        page = (await client.get(f"/events/{ids['failed']}")).text
    assert page.index("attempt 5 started") < page.index("attempt 5 failed") < page.index("> failed</li>")


async def test_an_event_page_draws_its_workflow_by_level_and_sums_up_large_groups(
        fresh_db: str) -> None:
    from conveyor import chain, group, step
    first, last = step("wf.first"), step("wf.last")
    members = [step("wf.member", {"i": i}) for i in range(8)]
    with psycopg.connect(fresh_db) as conn:
        ids = Producer().enqueue_workflow(conn, chain(first, group(*members), last))
        conn.execute("UPDATE conveyor.events SET state = 'succeeded', finished_at = now()"
                     " WHERE id = %s", (ids[first],))
        conn.commit()
    async with _client(_app(fresh_db)) as client:
        page = (await client.get(f"/events/{ids[last]}")).text
        plain = (await client.get(f"/events/{_seed(fresh_db)['pending']}")).text
    drawing = page[page.index('<div class="workflow">'):]
    levels = drawing.split('<ol class="level"')[1:]
    assert len(levels) == 3
    assert f'href="/events/{ids[first]}"' in levels[0] and "state-succeeded" in levels[0]
    assert "8 &times; wf.member" in levels[1] and "8 waiting" in levels[1]
    assert f'class="step this"><a href="/events/{ids[last]}"' in levels[2]
    assert "10 steps" in page
    assert '<div class="workflow">' not in plain        # an event of no workflow draws none
