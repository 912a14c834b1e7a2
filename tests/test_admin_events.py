"""Admin.events / AsyncAdmin.events: filters, keyset pagination, the plans behind them.

The filter and pagination tests run on small tables in a rolled-back
transaction; the plan tests on a module database of 200,000 rows where some
topics and tenants are common and some rare, so a filter that lost its index
would show up as a sequential scan.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import psycopg
import pytest

from conveyor import (
    Admin,
    AsyncAdmin,
    AsyncProducer,
    EventFilter,
    EventPage,
    EventState,
    EventSummary,
    InvalidInputError,
    Producer,
)
from conveyor.db.named_queries import queries_for
from query_plans import plan_session, scans
from schema_reset import empty_schema

Q = queries_for("conveyor")
Conn = psycopg.Connection[Any]


@pytest.fixture
def db(conn: Conn) -> Conn:
    """``conn`` with the shared tables emptied inside the rolled-back transaction."""
    empty_schema(conn)
    return conn


def _enqueue(conn: Conn, topic: str = "t.x", *, tenant: str | None = None,
             delay: float = 0) -> int:
    return Producer().enqueue(conn, topic, {"n": 1}, tenant=tenant, delay=delay)


def _set(conn: Conn, event_id: int, **columns: Any) -> None:
    """Moves one event to a state or time a test needs (the worker's own path is
    exercised in test_admin.py; here only the listing is under test)."""
    assignments = ", ".join(f"{name} = %({name})s" for name in columns)
    conn.execute(f"UPDATE conveyor.events SET {assignments} WHERE id = %(id)s".encode(),
                 {**columns, "id": event_id})


def _ids(page: EventPage) -> list[int]:
    return [e.id for e in page.events]


# ------------------------------------------------------------------ listing

def test_events_lists_newest_first_with_every_summary_field(db: Conn) -> None:
    first = _enqueue(db, "a.x", tenant="acme")
    second = _enqueue(db, "b.y")
    _set(db, second, state="failed", attempts=2, last_error="boom", finished_at="now")
    page = Admin().events(db)
    assert _ids(page) == [second, first] and page.next_after is None
    newest = page.events[0]
    assert isinstance(newest, EventSummary)
    assert (newest.topic, newest.tenant, newest.state, newest.attempts, newest.max_attempts,
            newest.last_error) == ("b.y", None, EventState.FAILED, 2, 5, "boom")
    assert page.events[1].tenant == "acme"
    data = page.to_json()
    assert data["next_after"] is None and data["events"][0]["state"] == "failed"
    assert isinstance(data["events"][0]["created_at"], str)


def test_events_of_an_empty_queue_is_an_empty_last_page(db: Conn) -> None:
    assert Admin().events(db) == EventPage(events=[], next_after=None)


def _sample(conn: Conn) -> dict[str, int]:
    ids = {
        "mail_acme": _enqueue(conn, "email.send", tenant="acme"),
        "mail_bulk": _enqueue(conn, "email.bulk"),
        "emailx": _enqueue(conn, "emailx.send"),
        "email": _enqueue(conn, "email"),
        "sms_globex": _enqueue(conn, "sms.send", tenant="globex"),
        "a_b": _enqueue(conn, "a_b.c"),
        "axb": _enqueue(conn, "axb.c"),
        "later": _enqueue(conn, "email.send", delay=3600),
    }
    _set(conn, ids["mail_bulk"], state="failed", last_error="SMTP 554: Rejected",
         finished_at="now")
    _set(conn, ids["sms_globex"], state="cancelled", finished_at="now")
    _set(conn, ids["email"], state="succeeded", finished_at="now",
         created_at="2020-01-01T00:00:00Z")
    return ids


FILTERS: dict[str, tuple[dict[str, Any], set[str]]] = {
    "state": ({"states": ("failed", "cancelled")}, {"mail_bulk", "sms_globex"}),
    "state enum": ({"states": (EventState.SUCCEEDED,)}, {"email"}),
    "topic exact": ({"topic": "email.send"}, {"mail_acme", "later"}),
    "topic prefix": ({"topic": "email.*"}, {"mail_acme", "mail_bulk", "later"}),
    "prefix with underscore": ({"topic": "a_b.*"}, {"a_b"}),
    "every topic": ({"topic": "*"}, {"mail_acme", "mail_bulk", "emailx", "email",
                                     "sms_globex", "a_b", "axb", "later"}),
    "tenant": ({"tenant": "acme"}, {"mail_acme"}),
    "older than": ({"older_than": 86_400}, {"email"}),
    "newer than": ({"newer_than": 86_400}, {"mail_acme", "mail_bulk", "emailx",
                                            "sms_globex", "a_b", "axb", "later"}),
    "error any case": ({"error": "smtp 554"}, {"mail_bulk"}),
    "ids": ({"ids": ()}, set()),            # replaced below: ids are per run
    "state and topic": ({"states": ("pending",), "topic": "email.*"},
                        {"mail_acme", "later"}),
    # "scheduled": pending, not due yet; beside other states it narrows only the pending ones
    "scheduled": ({"states": ("scheduled",)}, {"later"}),
    "scheduled flag": ({"scheduled": True}, {"later"}),
    "scheduled or failed": ({"states": ("failed", "scheduled")}, {"mail_bulk", "later"}),
    "scheduled and pending": ({"states": ("scheduled", "pending")},
                              {"mail_acme", "emailx", "a_b", "axb", "later"}),
    "nothing matches": ({"tenant": "acme", "states": ("failed",)}, set()),
}


@pytest.mark.parametrize("label", list(FILTERS))
def test_each_filter_narrows_to_exactly_its_events(db: Conn, label: str) -> None:
    ids = _sample(db)
    fields, expected = FILTERS[label]
    if label == "ids":
        fields, expected = {"ids": (ids["axb"], ids["email"], 999_999_999)}, {"axb", "email"}
    page = Admin().events(db, EventFilter(**fields))
    by_id = {v: k for k, v in ids.items()}
    assert {by_id[i] for i in _ids(page)} == expected
    assert _ids(page) == sorted(_ids(page), reverse=True)


def test_pages_visit_every_event_exactly_once_while_events_are_added(fresh_db: str) -> None:
    with psycopg.connect(fresh_db, autocommit=True) as conn, \
            psycopg.connect(fresh_db, autocommit=True) as producer:
        existing = {_enqueue(conn, f"p.{i % 3}") for i in range(23)}
        seen: list[int] = []
        page = Admin().events(conn, limit=5)
        pages = 1
        while True:
            seen += _ids(page)
            _enqueue(producer, "p.new")           # committed between two pages
            if page.next_after is None:
                break
            page = Admin().events(conn, after=page.next_after, limit=5)
            pages += 1
    assert len(seen) == len(set(seen)) == len(existing)
    assert set(seen) == existing and pages == math.ceil(len(existing) / 5)


def test_a_full_last_page_says_it_is_the_last(db: Conn) -> None:
    ids = [_enqueue(db) for _ in range(4)]
    first = Admin().events(db, limit=2)
    assert _ids(first) == ids[:1:-1] and first.next_after == ids[2]
    second = Admin().events(db, after=first.next_after, limit=2)
    assert _ids(second) == ids[1::-1] and second.next_after is None


def test_pagination_keeps_the_filter(db: Conn) -> None:
    failed = []
    for i in range(7):
        event_id = _enqueue(db)
        if i % 2 == 0:
            _set(db, event_id, state="failed", finished_at="now")
            failed.append(event_id)
    filt, seen, after = EventFilter(states=("failed",)), [], None
    while True:
        page = Admin().events(db, filt, after=after, limit=3)
        seen += _ids(page)
        if (after := page.next_after) is None:
            break
    assert seen == failed[::-1]


async def test_async_events_pages_like_the_sync_one(aconn: psycopg.AsyncConnection[Any]) -> None:
    await aconn.execute("DELETE FROM conveyor.events")
    ids = [await AsyncProducer().enqueue(aconn, "x.y", tenant="acme") for _ in range(3)]
    await AsyncProducer().enqueue(aconn, "x.y")
    page = await AsyncAdmin().events(aconn, EventFilter(tenant="acme"), limit=2)
    assert _ids(page) == [ids[2], ids[1]] and page.next_after == ids[1]
    rest = await AsyncAdmin().events(aconn, EventFilter(tenant="acme"), after=ids[1], limit=2)
    assert _ids(rest) == [ids[0]] and rest.next_after is None


def test_events_on_a_dict_row_connection(db: Conn) -> None:
    from psycopg.rows import dict_row

    event_id = _enqueue(db)
    db.row_factory = dict_row  # type: ignore[assignment]
    assert _ids(Admin().events(db)) == [event_id]


# ------------------------------------------------------------- bad input

BAD_FILTERS: list[tuple[dict[str, Any], str]] = [
    ({"states": ("done",)}, "unknown state 'done'"),
    ({"states": "failed"}, "expected states to be a tuple"),
    ({"states": (None,)}, "unknown state None"),
    ({"topic": "a b"}, "topic: malformed topic pattern 'a b'"),
    ({"topic": "email.**"}, "topic: malformed topic pattern"),
    ({"topic": 5}, "topic: malformed topic pattern 5"),
    ({"tenant": "Acme"}, "tenant: invalid tenant 'Acme'"),
    ({"older_than": -1}, "expected older_than to be a number of seconds from 0"),
    ({"older_than": float("nan")}, "older_than.*got nan"),
    ({"newer_than": float("inf")}, "newer_than.*got inf"),
    ({"newer_than": 10**400}, "newer_than"),
    ({"newer_than": True}, "newer_than.*got True"),
    ({"older_than": "1h"}, "older_than.*got '1h'"),
    ({"error": "a\x00b"}, "error contains a NUL"),
    ({"error": ""}, "expected error to be a non-empty string"),
    ({"error": "x" * 1001}, "error is 1001 characters"),
    ({"error": "\ud800"}, "lone surrogate"),
    ({"ids": (0,)}, "ids: invalid event id 0"),
    ({"ids": ("12",)}, "invalid event id '12' in ids"),
    ({"ids": (2**63,)}, "out of range"),
    ({"ids": 5}, "expected ids to be a tuple"),
    ({"states": ("sheduled",)}, "unknown state 'sheduled' in states: expected one of .*scheduled"),
    ({"scheduled": "yes"}, "expected scheduled to be True or False, got 'yes'"),
    ({"states": ("failed",), "scheduled": True},
     r"scheduled narrows pending events, but states \('failed',\) has none"),
]


@pytest.mark.parametrize(("fields", "message"), BAD_FILTERS,
                         ids=[m for _, m in BAD_FILTERS])
def test_bad_filter_values_are_refused_naming_the_field_and_value(fields: dict[str, Any],
                                                                   message: str) -> None:
    with pytest.raises(InvalidInputError, match=message) as info:
        EventFilter(**fields)
    assert "\n" not in str(info.value)


def test_filter_normalises_lists_and_repeated_values() -> None:
    filt = EventFilter(states=["failed", "failed", EventState.CANCELLED],  # type: ignore[arg-type]
                       ids=[3, 3, 4], older_than=5)  # type: ignore[arg-type]
    assert filt.states == ("failed", "cancelled") and filt.ids == (3, 4)
    assert filt.older_than == 5.0 and isinstance(filt.older_than, float)
    assert EventFilter().is_empty() and not filt.is_empty()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"limit": 0}, "expected limit to be an integer from 1 to 1000, got 0"),
    ({"limit": 1001}, "got 1001"),
    ({"limit": True}, "got True"),
    ({"after": 0}, "after: invalid event id 0"),
    ({"after": "12"}, "invalid after '12'"),
    ({"after": -5}, "after: invalid event id -5"),
])
def test_events_refuses_bad_limit_and_after_before_sql(conn: Conn, kwargs: dict[str, Any],
                                                       message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        Admin().events(conn, **kwargs)
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


def test_events_refuses_a_filter_that_is_not_an_event_filter(conn: Conn) -> None:
    with pytest.raises(InvalidInputError, match="expected filter to be an EventFilter"):
        Admin().events(conn, {"states": ("failed",)})  # type: ignore[arg-type]


# ------------------------------------------------------- plans at 200 k rows

ROWS = 200_000


def _fill(conn: Conn) -> None:
    conn.execute("SET conveyor.notify = 'off'")
    conn.execute("""
        INSERT INTO conveyor.events (topic, payload, state, attempts, run_at, created_at,
                                     finished_at, tenant, last_error)
        SELECT 'big.' || (g %% 20), '{}',
               CASE WHEN g %% 100 = 3 THEN 'failed' WHEN g %% 1000 = 1 THEN 'cancelled'
                    ELSE 'succeeded' END,
               1, now() - interval '2 days', now() - interval '3 days' + g * interval '1 s',
               now() - interval '1 day', 't' || (g %% 50),
               CASE WHEN g %% 100 = 3 THEN 'SMTP error ' || g END
        FROM generate_series(1, %s) AS g""", (ROWS,))
    # Rare ones, in the middle of the id range: a walk from the newest row
    # would have to read half the table to find them.
    conn.execute("""
        INSERT INTO conveyor.events (topic, payload, tenant, state, attempts, finished_at,
                                     last_error)
        SELECT 'rare.x', '{}', 'solo', 'failed', 1, now(), 'boom'
        FROM generate_series(1, 30)""")
    conn.execute("""
        INSERT INTO conveyor.events (topic, payload, run_at, tenant)
        SELECT 'big.' || (g %% 20), '{}', now() - interval '1 hour', 't' || (g %% 50)
        FROM generate_series(1, %s) AS g""", (5000,))
    conn.execute("""
        INSERT INTO conveyor.events (topic, payload, state, attempts, lease_owner,
                                     lease_expires_at)
        SELECT 'big.3', '{}', 'running', 1, gen_random_uuid(), now() + interval '1 minute'
        FROM generate_series(1, 20)""")


@pytest.fixture(scope="module")
def listing_db(make_db: Callable[..., AbstractContextManager[str]],
               template_db: str) -> Iterator[str]:
    with make_db(prefix="conveyor_list_", template=template_db) as url:
        with psycopg.connect(url, autocommit=True) as conn:
            _fill(conn)
            conn.execute("VACUUM ANALYZE conveyor.events")
        yield url


@pytest.fixture
def big(listing_db: str) -> Iterator[Conn]:
    with plan_session(listing_db) as conn:
        yield conn


# label: (filter, after, the indexes that must serve it, the most buffers a page
# of 51 may read). 300 is under a tenth of the table; a page is dearer only where
# docs/admin.md says so: a state with no index of its own and a small share
# (cancelled: 0.1 % here, so about 51,000 rows walked newest first, or, the
# plan the planner picks about as often, every stopped row fetched through a
# partial index on failed and cancelled: 2,230 rows on up to as many pages), and a
# state with a topic, read through events_failed_idx, which is keyed on topic
# alone, so every failed row of the topic is read and sorted (all 2,000 of the
# failed rows here are big.3's).
PLAN_FILTERS: dict[str, tuple[EventFilter, int | None, set[str], int]] = {
    "no filter": (EventFilter(), None, {"events_pkey"}, 300),
    "after": (EventFilter(), 100_000, {"events_pkey"}, 300),
    "pending": (EventFilter(states=("pending",)), None, set(), 300),
    "running": (EventFilter(states=("running",)), None, set(), 300),
    "succeeded": (EventFilter(states=("succeeded",)), None, set(), 300),
    "failed": (EventFilter(states=("failed",)), None, set(), 300),
    "cancelled": (EventFilter(states=("cancelled",)), None, set(), 2_300),
    "topic exact": (EventFilter(topic="big.7"), None, set(), 300),
    "topic prefix": (EventFilter(topic="big.*"), None, set(), 300),
    "tenant": (EventFilter(tenant="t7"), None, set(), 300),
    "state and topic": (EventFilter(states=("failed",), topic="big.3"), None, set(), 2_200),
    "failed, rare topic": (EventFilter(states=("failed",), topic="rare.x"), None, set(), 300),
    "stopped, rare topic": (EventFilter(states=("failed", "cancelled"), topic="rare.x"), None,
                            {"events_stopped_topic_idx"}, 300),
    "cancelled, rare topic prefix": (EventFilter(states=("cancelled",), topic="rare.*"), None,
                                     {"events_stopped_topic_idx"}, 300),
    "stopped, rare tenant": (EventFilter(states=("failed", "cancelled"), tenant="solo"), None,
                             {"events_stopped_tenant_idx"}, 300),
    "stopped, rare topic after": (EventFilter(states=("failed", "cancelled"), topic="rare.x"),
                                  200_010, {"events_stopped_topic_idx"}, 300),
    "tenant after": (EventFilter(tenant="t7"), 100_000, set(), 300),
    "ids": (EventFilter(ids=(5, 50, 500)), None, {"events_pkey"}, 300),
    "newer than": (EventFilter(newer_than=3600), None, {"events_pkey"}, 300),
}


def _explain(conn: Conn, filt: EventFilter, after: int | None,
             limit: int = 51) -> dict[str, Any]:
    from conveyor.admin_core import _list_params

    row = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + Q["event_list"],
                       _list_params(filt, after, limit)).fetchone()
    assert row is not None
    return dict(row[0][0])


@pytest.mark.parametrize("label", list(PLAN_FILTERS))
def test_listing_plan_reads_an_index_never_the_whole_table(big: Conn, label: str) -> None:
    filt, after, wanted, max_buffers = PLAN_FILTERS[label]
    plan = _explain(big, filt, after)
    nodes = scans(plan["Plan"])
    assert nodes and all(n["Node Type"] != "Seq Scan" for n in nodes), nodes
    used = {n["Index Name"] for n in nodes if "Index Name" in n}
    assert wanted <= used, (used, nodes)
    pages = big.execute("SELECT relpages FROM pg_class"
                        " WHERE oid = 'conveyor.events_live'::regclass").fetchone()
    assert pages is not None and pages[0] > max_buffers
    buffers = plan["Plan"]["Shared Hit Blocks"] + plan["Plan"]["Shared Read Blocks"]
    assert buffers <= max_buffers, (buffers, pages[0], nodes)


def test_rare_topic_and_tenant_read_only_their_rows(big: Conn) -> None:
    stopped = ("failed", "cancelled")
    for filt in (EventFilter(states=stopped, topic="rare.x"),
                 EventFilter(states=stopped, tenant="solo"),
                 EventFilter(states=stopped, topic="rare.*")):
        plan = _explain(big, filt, None)
        rows = sum(n["Actual Rows"] * n["Actual Loops"] for n in scans(plan["Plan"])
                   if n["Node Type"] in ("Index Scan", "Bitmap Heap Scan"))
        assert rows == 30, (filt, scans(plan["Plan"]))
        assert plan["Execution Time"] < 50


def test_listing_finds_the_rare_rows(big: Conn) -> None:
    page = Admin().events(big, EventFilter(tenant="solo", topic="rare.*"), limit=1000)
    assert len(page.events) == 30 and page.next_after is None
    assert {e.state for e in page.events} == {EventState.FAILED}


def test_error_filter_reads_no_more_than_the_other_filters_bring(big: Conn) -> None:
    """The substring is only a filter: with a state it reads that state's rows, newest
    first, until the page is full."""
    plan = _explain(big, EventFilter(states=("failed",), error="smtp error 19"), None, limit=5)
    nodes = scans(plan["Plan"])
    assert all(n["Node Type"] != "Seq Scan" for n in nodes), nodes
    page = Admin().events(big, EventFilter(states=("failed",), error="SMTP ERROR 19"), limit=5)
    assert len(page.events) == 5
    assert all("SMTP error 19" in (e.last_error or "") for e in page.events)


# ------------------------------------------- pages with the history in days

PARKED = 20_000


@pytest.fixture(scope="module")
def history_db(make_db: Callable[..., AbstractContextManager[str]],
               template_db: str) -> Iterator[str]:
    """Since 0025: 20,000 failed events parked in the live partition (the oldest
    ids), then 12,000 successes of two topics in today's day of the history."""
    with make_db(prefix="conveyor_days_", template=template_db) as url:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("SET conveyor.notify = 'off'")
            conn.execute(Q["history_make_days"], {"ahead": 1})
            conn.execute("""
                INSERT INTO conveyor.events (topic, payload, state, attempts, finished_at,
                                             last_error)
                SELECT 'parked.x', '{}', 'failed', 5, now(), 'boom'
                FROM generate_series(1, %s)""", (PARKED,))
            conn.execute("""
                INSERT INTO conveyor.events (topic, payload, tenant, state, attempts,
                                             finished_at, done)
                SELECT CASE WHEN g % 2 = 0 THEN 'done.x' ELSE 'done.y' END, '{}',
                       't' || (g % 3), 'succeeded', 1, now(), true
                FROM generate_series(1, 12000) AS g""")
            conn.execute("VACUUM ANALYZE conveyor.events")
        yield url


def _live_pages_read(conn: Conn) -> tuple[int, int]:
    """Pages of the live partition's heap this transaction has read, and its size."""
    row = conn.execute("SELECT pg_stat_get_xact_blocks_fetched(c.oid), c.relpages"
                       " FROM pg_class AS c"
                       " WHERE c.oid = 'conveyor.events_live'::regclass").fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


@pytest.mark.parametrize("filt", [EventFilter(topic="done.x"), EventFilter(tenant="t1"),
                                  EventFilter(states=("succeeded",), topic="done.*")],
                         ids=["topic", "tenant", "state and prefix"])
def test_a_page_from_the_history_does_not_read_every_parked_failure(
        history_db: str, filt: EventFilter) -> None:
    """A page of the history's events starts with each partition's first match:
    with no bound, the live partition's 20,000 failures, none of which match,
    were all read before the first row (every topic's page at 50 million rows
    paid for it). Read over the newest ids first, they are not reached."""
    with plan_session(history_db) as conn:
        before, pages = _live_pages_read(conn)
        page = Admin().events(conn, filt)
        read = _live_pages_read(conn)[0] - before
        expected = conn.execute(
            "SELECT id FROM conveyor.events_done WHERE (%(topic)s::text IS NULL OR topic LIKE"
            " %(topic)s) AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s)"
            " ORDER BY id DESC LIMIT 50",
            {"topic": filt.topic.replace("*", "%") if filt.topic else None,
             "tenant": filt.tenant}).fetchall()
        assert _ids(page) == [r[0] for r in expected] and page.next_after is not None
        assert pages > 300 and read < 10, (read, pages)
        # The next page goes on from there, and the last one ends at the oldest.
        seen = _ids(page)
        while page.next_after is not None:
            page = Admin().events(conn, filt, after=page.next_after, limit=1000)
            seen += _ids(page)
        assert len(seen) == len(set(seen)) and seen == sorted(seen, reverse=True)
        total = conn.execute(
            "SELECT count(*) FROM conveyor.events_done WHERE (%(topic)s::text IS NULL OR topic"
            " LIKE %(topic)s) AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s)",
            {"topic": filt.topic.replace("*", "%") if filt.topic else None,
             "tenant": filt.tenant}).fetchone()
        assert total is not None and len(seen) == total[0]


@pytest.mark.parametrize(("filt", "reads"), [
    (EventFilter(topic="a.b"), [10_000, 1_000_000, None]),
    (EventFilter(states=("succeeded",), tenant="t"), [10_000, 1_000_000, None]),
    (EventFilter(states=("failed", "pending")), [None]),   # never in the history
    (EventFilter(), [None]),
    (EventFilter(ids=(1, 2)), [None]),
])
def test_a_short_page_reads_wider_spans_only_where_the_history_may_hold_more(
        filt: EventFilter, reads: list[int | None]) -> None:
    from conveyor.admin_core import _list_flow

    flow = _list_flow(Q, filt, None, 51)
    spans = [next(flow)[1]["span"]]
    with pytest.raises(StopIteration) as stop:
        while True:
            spans.append(flow.send([{"id": 7}])[1]["span"])   # a short page each time
    assert spans == reads and stop.value.value == [{"id": 7}]


def test_a_page_past_the_newest_ids_reads_further(history_db: str) -> None:
    """The parked failures are older than the newest 10,000 ids: their page comes
    from a wider read, whole and in order."""
    with plan_session(history_db) as conn:
        page = Admin().events(conn, EventFilter(topic="parked.x"), limit=100)
        newest = conn.execute("SELECT max(id) FROM conveyor.events_live"
                              " WHERE topic = 'parked.x'").fetchone()
        assert newest is not None
        assert _ids(page) == list(range(newest[0], newest[0] - 100, -1))
        assert page.next_after == newest[0] - 99


# --------------------------------------------------- retry and cancel matching

def _states(conn: Conn) -> dict[int, str]:
    return dict(conn.execute("SELECT id, state FROM conveyor.events").fetchall())


def _every_state(conn: Conn, topic: str = "m.x") -> dict[str, int]:
    """One event in each state (and a scheduled pending one), of ``topic``."""
    ids = {name: _enqueue(conn, topic) for name in
           ("due", "running", "succeeded", "failed", "cancelled")}
    ids["scheduled"] = _enqueue(conn, topic, delay=3600)
    _set(conn, ids["running"], state="running", attempts=1,
         lease_owner="00000000-0000-0000-0000-000000000001", lease_expires_at="2100-01-01T00:00:00Z")
    for name in ("succeeded", "failed", "cancelled"):
        _set(conn, ids[name], state=name, attempts=1, finished_at="now")
    return ids


def test_retry_matching_makes_failed_cancelled_and_scheduled_events_due(db: Conn) -> None:
    ids = _every_state(db)
    other = _enqueue(db, "n.x")
    _set(db, other, state="failed", finished_at="now")
    changed = Admin().retry_matching(db, EventFilter(topic="m.*"))
    assert sorted(changed) == sorted([ids["failed"], ids["cancelled"], ids["scheduled"]])
    states = _states(db)
    assert {states[i] for i in changed} == {"pending"} and states[other] == "failed"
    assert (states[ids["running"]], states[ids["succeeded"]]) == ("running", "succeeded")
    due = db.execute("SELECT count(*) FROM conveyor.events WHERE id = ANY(%s)"
                     " AND run_at <= now() AND finished_at IS NULL", (changed,)).fetchone()
    assert due == (3,)


def test_retry_matching_with_dry_run_changes_nothing(db: Conn) -> None:
    ids = _every_state(db)
    before = db.execute("SELECT * FROM conveyor.events ORDER BY id").fetchall()
    would = Admin().retry_matching(db, EventFilter(states=("failed", "cancelled")), dry_run=True)
    assert db.execute("SELECT * FROM conveyor.events ORDER BY id").fetchall() == before
    assert would == [ids["cancelled"], ids["failed"]]           # newest first
    assert Admin().retry_matching(db, EventFilter(states=("failed", "cancelled"))) == would


def test_cancel_matching_cancels_pending_running_and_failed_events(db: Conn) -> None:
    ids = _every_state(db)
    changed = Admin().cancel_matching(db, EventFilter(topic="m.x"))
    assert sorted(changed) == sorted(ids[n] for n in ("due", "running", "failed", "scheduled"))
    states = _states(db)
    assert {states[i] for i in changed} == {"cancelled"}
    assert states[ids["succeeded"]] == "succeeded"
    assert Admin().cancel_matching(db, EventFilter(topic="m.x")) == []      # nothing left


def test_cancel_matching_with_dry_run_changes_nothing(db: Conn) -> None:
    ids = _every_state(db)
    before = db.execute("SELECT * FROM conveyor.events ORDER BY id").fetchall()
    would = Admin().cancel_matching(db, EventFilter(states=("running", "failed")), dry_run=True)
    assert db.execute("SELECT * FROM conveyor.events ORDER BY id").fetchall() == before
    assert sorted(would) == sorted([ids["running"], ids["failed"]])


def test_matching_works_through_several_batches(db: Conn,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from conveyor import admin as admin_module

    monkeypatch.setattr(admin_module, "MATCH_BATCH", 2)
    failed = []
    for _ in range(5):
        failed.append(_enqueue(db, tenant="acme"))
        _set(db, failed[-1], state="failed", finished_at="now")
        _enqueue(db, tenant="acme")                       # pending, due: not retried
    filt = EventFilter(tenant="acme", states=("failed",))
    assert Admin().retry_matching(db, filt, dry_run=True) == failed[::-1]
    assert Admin().retry_matching(db, filt) == failed[::-1]
    assert Admin().cancel_matching(db, EventFilter(tenant="acme")) == sorted(
        _states(db), reverse=True)


@pytest.mark.parametrize("action", ["retry_matching", "cancel_matching"])
@pytest.mark.parametrize("filt", [EventFilter(), None], ids=["empty", "none"])
def test_matching_refuses_an_empty_filter(conn: Conn, action: str,
                                          filt: EventFilter | None) -> None:
    with pytest.raises(InvalidInputError, match="give at least one filter"):
        getattr(Admin(), action)(conn, filt)
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE


@pytest.mark.parametrize(("action", "states", "message"), [
    ("retry_matching", ("succeeded",), "'succeeded' events cannot be retried"),
    ("retry_matching", ("failed", "running"), "'running' events cannot be retried"),
    ("cancel_matching", ("cancelled",), "'cancelled' events cannot be cancelled"),
    ("cancel_matching", ("succeeded", "pending"), "'succeeded' events cannot be cancelled"),
])
def test_matching_refuses_states_it_can_never_change(conn: Conn, action: str,
                                                     states: tuple[str, ...],
                                                     message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        getattr(Admin(), action)(conn, EventFilter(states=states))


def test_retry_matching_notifies_workers_once(fresh_db: str) -> None:
    from psycopg import sql

    with psycopg.connect(fresh_db) as conn:
        for _ in range(3):
            _set(conn, _enqueue(conn), state="failed", finished_at="now")
        conn.commit()
        with psycopg.connect(fresh_db, autocommit=True) as listener:
            listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier("conveyor.events")))
            assert len(Admin().retry_matching(conn, EventFilter(states=("failed",)))) == 3
            conn.commit()
            got = [n.payload for n in listener.notifies(timeout=1)]
            assert got == ["*"]
            Admin().retry_matching(conn, EventFilter(states=("failed",)), dry_run=True)
            conn.commit()
            assert [n.payload for n in listener.notifies(timeout=0.5)] == []


async def test_async_retry_and_cancel_matching(aconn: psycopg.AsyncConnection[Any]) -> None:
    await aconn.execute("DELETE FROM conveyor.events")
    failed = await AsyncProducer().enqueue(aconn, "x.y")
    pending = await AsyncProducer().enqueue(aconn, "x.y")
    await aconn.execute("UPDATE conveyor.events SET state = 'failed', finished_at = now()"
                        " WHERE id = %s", (failed,))
    admin = AsyncAdmin()
    assert await admin.retry_matching(aconn, EventFilter(topic="x.y"), dry_run=True) == [failed]
    assert await admin.retry_matching(aconn, EventFilter(topic="x.y")) == [failed]
    assert await admin.cancel_matching(aconn, EventFilter(ids=(pending,)), dry_run=True) == [
        pending]
    assert await admin.cancel_matching(aconn, EventFilter(topic="x.*")) == [pending, failed]
    with pytest.raises(InvalidInputError, match="give at least one filter"):
        await admin.cancel_matching(aconn, EventFilter())


def test_payload_path_filters_by_a_predicate_and_bulk_actions_follow_it(db: Conn) -> None:
    producer = Producer()
    acme = producer.enqueue(db, "bill.x", {"customer": "acme", "amount": 120})
    big = producer.enqueue(db, "bill.x", {"customer": "globex", "amount": 900, "refund": True})
    producer.enqueue(db, "bill.x", {"customer": "globex", "amount": 5})
    for event_id in (acme, big):
        _set(db, event_id, state="failed", finished_at="now")
    admin = Admin()

    def matching(path: str, **fields: Any) -> list[int]:
        return _ids(admin.events(db, EventFilter(payload=path, **fields)))

    assert matching('$.customer == "acme"') == [acme]
    assert matching("$.amount > 100") == [big, acme]
    assert matching("exists($.refund)") == [big]
    assert matching("$.customer") == []                 # not a predicate: matches nothing
    assert matching("$.amount > 100", states=("pending",)) == []
    assert admin.retry_matching(db, EventFilter(payload="$.amount > 100", states=("failed",))) == [
        big, acme]


def test_cancelling_the_scheduled_events_leaves_the_due_ones(db: Conn) -> None:
    ids = _sample(db)
    admin = Admin()
    assert admin.cancel_matching(db, EventFilter(states=("scheduled",))) == [ids["later"]]
    due = _ids(admin.events(db, EventFilter(states=("pending",))))
    assert sorted(due) == sorted(ids[k] for k in ("mail_acme", "emailx", "a_b", "axb"))


@pytest.mark.parametrize(("path", "message"), [
    ("$.customer ==", "invalid payload path '$.customer ==': syntax error"),
    ("", "expected payload to be a non-empty string, got ''"),
    ("$.a\x00", "payload contains a NUL character"),
])
def test_a_bad_payload_path_is_refused_naming_it(db: Conn, path: str, message: str) -> None:
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        Admin().events(db, EventFilter(payload=path))


COUNTED_FILTERS = [
    {"states": ("failed",)}, {"topic": "email.*"}, {"states": ("failed", "cancelled")},
    {"states": ("scheduled",)}, {"states": ("scheduled", "failed")},
    {"tenant": "acme"}, {"topic": "*"}, {"error": "smtp"}, {"payload": "$.n == 1"},
]


@pytest.mark.parametrize("fields", COUNTED_FILTERS, ids=[str(f) for f in COUNTED_FILTERS])
@pytest.mark.parametrize("action", ["retry", "cancel"])
def test_count_matching_is_what_the_dry_run_lists(db: Conn, fields: dict[str, Any],
                                                  action: str) -> None:
    _sample(db)
    admin = Admin()
    flow = admin.retry_matching if action == "retry" else admin.cancel_matching
    try:
        listed = flow(db, EventFilter(**fields), dry_run=True)
    except InvalidInputError as exc:        # a state the action cannot change: refused alike
        with pytest.raises(InvalidInputError, match=re.escape(str(exc))):
            admin.count_matching(db, EventFilter(**fields), action=action)
        return
    assert admin.count_matching(db, EventFilter(**fields), action=action) == len(listed)


def test_count_matching_refuses_an_empty_filter_and_an_unknown_action(db: Conn) -> None:
    with pytest.raises(InvalidInputError, match="give at least one filter"):
        Admin().count_matching(db, EventFilter(), action="retry")
    with pytest.raises(InvalidInputError, match="unknown bulk action 'delete'"):
        Admin().count_matching(db, EventFilter(states=("failed",)), action="delete")
