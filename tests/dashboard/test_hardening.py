"""The dashboard against hostile or unusual requests: a rebound Host, a reverse
proxy, crafted URLs, a search matching nothing, 100k topics, a page's title.

Each test serves the real Starlette app over httpx's ASGI transport against a
fresh database, as tests/dashboard/test_http.py does.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import psycopg
import pytest
from starlette.applications import Starlette

from conveyor import Producer
from conveyor.admin_async import FAILED_EXACT_LIMIT, FAILED_TOPIC_EXACT_LIMIT
from conveyor.cli.main import build_parser
from conveyor.dashboard import DashboardConfig, allow_all, dashboard_app
from conveyor.dashboard.app import TOPICS_SHOWN
from conveyor.errors import ConfigError
from query_plans import plan_session, scans

TOKEN = re.compile(r'name="csrf_token" value="([^"]+)"')
TITLE = re.compile(r"<title>(.*?)</title>", re.S)


@asynccontextmanager
async def _client(app: Starlette, base_url: str = "http://127.0.0.1:8080",
                  **kwargs: Any) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url=base_url, **kwargs) as client:
            yield client
    finally:
        await app.state.conveyor_dashboard.close()


def _cli_config(*flags: str) -> DashboardConfig:
    """The DashboardConfig ``conveyor dashboard`` builds from these flags."""
    from conveyor.cli.dashboard_command import dashboard_config

    args = build_parser().parse_args(["dashboard", *flags])
    config: DashboardConfig = dashboard_config(args, "conveyor")
    return config


def _pauses(url: str) -> list[tuple[str, str | None]]:
    with psycopg.connect(url) as conn:
        return [(str(r[0]), r[1]) for r in conn.execute("SELECT pattern, reason FROM conveyor.pauses")]


async def _token(client: httpx.AsyncClient, **headers: str) -> str:
    page = await client.get("/", headers=headers)
    assert page.status_code == 200, page.text
    found = TOKEN.search(page.text)
    assert found is not None
    return found.group(1)


# -- N7: DNS rebinding -------------------------------------------------------------------


async def test_a_rebound_host_can_neither_read_nor_act(fresh_db: str) -> None:
    """A page on evil.example rebound to 127.0.0.1 sends its own name as Host and Origin."""
    app = dashboard_app(fresh_db, _cli_config("--insecure-local"), authorize=allow_all)
    evil = {"host": "evil.example:8080", "origin": "http://evil.example:8080"}
    async with _client(app) as client:
        page = await client.get("/", headers={"host": "evil.example:8080"})
        assert page.status_code == 400
        assert page.text.strip() == ("Host 'evil.example:8080' is not an address of this "
                                     "dashboard: add it with --allowed-host "
                                     "(DashboardConfig.allowed_hosts)")
        token = await _token(client)                 # as if read some other way
        posted = await client.post("/pauses", headers=evil,
                                   data={"csrf_token": token, "pattern": "*", "reason": "evil"})
        assert posted.status_code == 400
    assert _pauses(fresh_db) == []


@pytest.mark.parametrize("host", ["127.0.0.1:8080", "localhost:8080", "[::1]:8080", "LOCALHOST",
                                  "10.1.2.3:8080", "ops.example.com", "ops.example.com:8443"])
async def test_the_bound_address_and_allowed_hosts_are_served(fresh_db: str, host: str) -> None:
    app = dashboard_app(fresh_db, _cli_config("--read-only", "--allowed-host", "other.example",
                                              "--allowed-host", "ops.example.com"))
    async with _client(app) as client:
        assert (await client.get("/events", headers={"host": host})).status_code == 200


def test_allowed_hosts_come_from_the_flags_and_a_named_bind_address() -> None:
    assert _cli_config("--read-only").allowed_hosts == ()
    assert _cli_config("--read-only", "--host", "box.lan", "--allowed-host", "a.example",
                       "--allowed-host", "b.example:81").allowed_hosts == (
        "a.example", "b.example:81", "box.lan")
    with pytest.raises(ConfigError, match=re.escape("got 'evil example'")):
        DashboardConfig(allowed_hosts=("evil example",))
    with pytest.raises(ConfigError, match="expected public_url to be an http"):
        _cli_config("--read-only", "--public-url", "ops.example.com")


async def test_a_mounted_dashboard_leaves_the_host_to_its_application(fresh_db: str) -> None:
    async with _client(dashboard_app(fresh_db)) as client:
        assert (await client.get("/events", headers={"host": "app.example"})).status_code == 200


# -- M1: behind a reverse proxy ------------------------------------------------------------


async def test_behind_a_proxy_the_public_origin_is_what_a_post_must_come_from(fresh_db: str) -> None:
    """nginx's default proxy_pass sends Host: 127.0.0.1:8080; the browser's Origin is public."""
    config = _cli_config("--insecure-local", "--public-url", "https://ops.example.com")
    async with _client(dashboard_app(fresh_db, config, authorize=allow_all)) as client:
        page = await client.get("/")
        assert "; secure" in page.headers["set-cookie"].lower()
        token = await _token(client)
        # The browser sends the Secure cookie over https, to the proxy.
        cookie = {"cookie": f"conveyor_csrf={token}"}
        foreign = await client.post("/pauses", headers={"origin": "https://x.example", **cookie},
                                    data={"csrf_token": token, "pattern": "zz.*"})
        assert foreign.status_code == 403
        assert ("Origin https://x.example does not match the dashboard&#39;s origin "
                "https://ops.example.com: behind a proxy, set --public-url") in foreign.text
        done = await client.post("/pauses", headers={"origin": "https://ops.example.com", **cookie},
                                 data={"csrf_token": token, "pattern": "zz.*"})
        assert done.status_code == 303, done.text
        assert done.headers["location"] == "/?done=paused"
    assert _pauses(fresh_db) == [("zz.*", None)]


async def test_without_a_public_url_a_proxied_origin_is_told_to_set_one(fresh_db: str) -> None:
    app = dashboard_app(fresh_db, _cli_config("--insecure-local"), authorize=allow_all)
    async with _client(app) as client:
        page = await client.get("/")
        assert "secure" not in page.headers["set-cookie"].lower()
        token = await _token(client)
        refused = await client.post("/pauses", headers={"origin": "https://ops.example.com"},
                                    data={"csrf_token": token, "pattern": "zz.*"})
    assert refused.status_code == 403
    assert ("Origin https://ops.example.com does not match the dashboard&#39;s origin "
            "http://127.0.0.1:8080: behind a proxy, set --public-url") in refused.text
    assert "reload the page" not in refused.text
    assert _pauses(fresh_db) == []


async def test_a_public_url_path_prefixes_every_link_and_the_cookie(fresh_db: str) -> None:
    config = DashboardConfig(public_url="https://ops.example.com/queue/")
    async with _client(dashboard_app(fresh_db, config)) as client:
        page = await client.get("/")
    links = re.findall(r'(?:href|action)="([^"]+)"', page.text)
    assert links and all(link.startswith("/queue/") for link in links), links
    assert "Path=/queue" in page.headers["set-cookie"]


# -- N10: crafted URLs ------------------------------------------------------------------


@pytest.mark.parametrize(("path", "message"), [
    ("/events?after=%C2%B2", "invalid after &#39;²&#39;"),
    ("/events?after=" + "9" * 5000, "invalid after &#39;999999999999999999999..."),
    ("/events?after=9223372036854775808", "invalid after"),
    ("/?done=retried&n=%C2%B2", "invalid n &#39;²&#39;"),
    ("/events/" + "9" * 5000, "invalid event id"),
    ("/events/99999999999999999999", "invalid event id"),
    ("/events/abc", "invalid event id &#39;abc&#39;"),
    ("/events?payload=" + "%24%20%3F%20(%40%20like_regex%20%22(%22)",     # $ ? (@ like_regex "(")
     "invalid regular expression"),
])
async def test_a_crafted_url_is_answered_400_naming_what_is_wrong(fresh_db: str, path: str,
                                                                 message: str) -> None:
    async with _client(dashboard_app(fresh_db)) as client:
        page = await client.get(path)
    assert page.status_code == 400, page.text[-500:]
    assert message in page.text


async def test_a_crafted_posted_id_is_400_too(fresh_db: str) -> None:
    async with _client(dashboard_app(fresh_db, authorize=allow_all)) as client:
        token = await _token(client)
        page = await client.post("/events/" + "9" * 5000 + "/retry", data={"csrf_token": token})
    assert page.status_code == 400 and "invalid event id" in page.text


async def test_the_notice_carries_no_text_from_the_url(fresh_db: str) -> None:
    spoof = "Your session expired: sign in again at https://evil.example/login. The queue"
    async with _client(dashboard_app(fresh_db)) as client:
        page = await client.get("/", params={"done": "not_paused", "what": spoof})
        paused = await client.get("/", params={"done": "paused", "what": "x", "n": "12"})
    assert page.status_code == 200
    assert "session expired" not in page.text and "evil.example" not in page.text
    assert "Nothing to resume: that was not paused." in page.text
    assert "Paused: the pause is listed under Paused." in paused.text


async def test_an_action_redirects_to_a_path_never_to_the_host(fresh_db: str) -> None:
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        event_id = Producer().enqueue(conn, "email.send", {})
    async with _client(dashboard_app(fresh_db, authorize=allow_all),
                       base_url="http://dash.test") as client:
        token = await _token(client)
        done = await client.post(f"/events/{event_id}/cancel", data={"csrf_token": token})
        resumed = await client.post("/pauses/resume", data={"csrf_token": token, "pattern": "a.*"})
    assert done.headers["location"] == f"/events/{event_id}?done=cancelled&n={event_id}"
    assert resumed.headers["location"] == "/?done=not_paused"


# -- the error-text search is bounded -----------------------------------------------------


async def test_an_error_search_matching_nothing_reads_a_bounded_number_of_rows(
        fresh_db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    rows, bound = 30_000, 2_000
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute("INSERT INTO conveyor.events (topic, payload, state, attempts, max_attempts,"
                     " finished_at, last_error) SELECT 'mass.fail', '{}', 'failed', 1, 1, now(),"
                     " 'SMTP 451 try later' FROM generate_series(1, %s)", (rows,))
        conn.execute("ANALYZE conveyor.events")
    statements = _recorded(monkeypatch)
    config = DashboardConfig(search_rows=bound)
    async with _client(dashboard_app(fresh_db, config)) as client:
        for query in ("error=no-such-text", "error=no-such-text&state=failed",
                      "payload=%24.nothing%20%3D%3D%201"):
            statements.clear()
            page = await client.get(f"/events?{query}")
            assert page.status_code == 200 and "No event matches." in page.text
            listing = [(q, p) for q, p in statements if "ORDER BY id DESC" in q]
            assert len(listing) == 1, statements
            with plan_session(fresh_db) as conn:
                text, params = listing[0]
                plan = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + text, params).fetchone()
            assert plan is not None
            read = sum(node.get("Actual Rows", 0) * node.get("Actual Loops", 1)
                       + node.get("Rows Removed by Filter", 0) for node in scans(plan[0]))
            assert read <= bound + 10, (query, read)
            assert "look at the newest 2\u2009000 events only" in page.text


# -- the overview ------------------------------------------------------------------------


async def test_the_overview_title_is_only_its_name(fresh_db: str) -> None:
    # More finished rows than are counted exactly: the counts are estimates, marked ~.
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute("INSERT INTO conveyor.events (topic, payload, state, attempts, finished_at)"
                     " SELECT 'done.ok', '{}', 'succeeded', 1, now() FROM generate_series(1, 10500)")
        conn.execute("ANALYZE conveyor.events")
    async with _client(dashboard_app(fresh_db)) as client:
        page = await client.get("/")
    assert "are estimates" in page.text
    titles = TITLE.findall(page.text)
    assert titles == ["Overview · Conveyor"], titles


def _fail(url: str, failed: dict[str, int]) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for topic, n in failed.items():
            conn.execute("INSERT INTO conveyor.events (topic, payload, state, attempts,"
                         " max_attempts, finished_at, last_error) SELECT %s, '{}', 'failed', 1,"
                         " 1, now(), 'boom' FROM generate_series(1, %s)", (topic, n))
        conn.execute("VACUUM ANALYZE conveyor.events")


def _failed_cells(page: str) -> dict[str, str]:
    """Each topic row's failed cell as the overview shows it."""
    return dict(re.findall(r'state=failed&amp;topic=([^"]+)">([^<]+)</a>', page))


async def test_the_overview_reads_a_bounded_number_of_failed_events(
        fresh_db: str, monkeypatch: pytest.MonkeyPatch) -> None:
    failed = {"mass.a": 30_000, "mass.b": 5_000, "mass.c": 20}
    _fail(fresh_db, failed)
    statements = _recorded(monkeypatch)
    async with _client(dashboard_app(fresh_db)) as client:
        page = await client.get("/")
    assert page.status_code == 200
    read = 0
    with plan_session(fresh_db) as conn:
        for text, params in statements:
            if text.lstrip().upper().startswith(("SELECT", "WITH", "-")):
                plan = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + text, params).fetchone()
                assert plan is not None
                read += sum(n.get("Actual Rows", 0) * n.get("Actual Loops", 1)
                            + n.get("Rows Removed by Filter", 0) for n in scans(plan[0]))
    # 35,020 failed events: the bounded total and each topic's cap (and one more
    # of each), the entries that find the three topics; never all of them.
    assert read <= (FAILED_EXACT_LIMIT + 1) + 3 * (FAILED_TOPIC_EXACT_LIMIT + 2), read


async def test_failed_counts_past_the_bound_read_as_lower_bounds(fresh_db: str) -> None:
    _fail(fresh_db, {"mass.a": 10_500, "mass.b": 1_200, "mass.c": 300})
    async with _client(dashboard_app(fresh_db)) as client:
        page = await client.get("/")
    assert "10\u2009000+</span>" in page.text                 # the failed card
    assert _failed_cells(page.text) == {"mass.a": "1\u2009000+", "mass.b": "1\u2009000+",
                                        "mass.c": "300"}
    assert "A count marked + is a lower bound" in page.text


async def test_failed_counts_within_the_bound_are_exact(fresh_db: str) -> None:
    _fail(fresh_db, {"mass.a": 9_000, "mass.b": 1_000})
    async with _client(dashboard_app(fresh_db)) as client:
        page = await client.get("/")
    assert "10\u2009000</span>" in page.text
    assert _failed_cells(page.text) == {"mass.a": "9\u2009000", "mass.b": "1\u2009000"}
    assert "+</" not in page.text and "marked +" not in page.text


async def test_a_hundred_thousand_topics_make_a_bounded_overview(fresh_db: str) -> None:
    topics = 100_000
    with psycopg.connect(fresh_db, autocommit=True) as conn:
        conn.execute("INSERT INTO conveyor.events (topic, payload) SELECT 'user.notify.u' || i, '{}'"
                     " FROM generate_series(1, %s) AS i", (topics,))
        # Three busy topics: they must be among the shown ones.
        conn.execute("INSERT INTO conveyor.events (topic, payload) SELECT 'busy.t' || (i % 3), '{}'"
                     " FROM generate_series(1, 30) AS i")
    async with _client(dashboard_app(fresh_db)) as client:
        page = await client.get("/")
    assert page.status_code == 200
    assert len(page.content) < 200_000, len(page.content)
    rows = re.findall(r'href="/events\?topic=([^"]+)"', page.text)
    assert len(rows) == TOPICS_SHOWN
    assert {"busy.t0", "busy.t1", "busy.t2"} <= set(rows)
    other = topics + 3 - TOPICS_SHOWN
    assert f"{other:,} other topics".replace(",", "\u2009") in page.text
    assert "and 99\u2009983 more topics: their due events wait" in page.text


def _recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Every statement the dashboard's cursors run from now on, with its parameters."""
    statements: list[tuple[str, Any]] = []
    original = psycopg.AsyncCursor.execute

    async def recording(self: Any, query: Any, params: Any = None, **kwargs: Any) -> Any:
        statements.append((str(query), params))
        return await original(self, query, params, **kwargs)

    monkeypatch.setattr(psycopg.AsyncCursor, "execute", recording)
    return statements
