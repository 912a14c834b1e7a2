"""Admin / AsyncAdmin: run-time control of flow limits and cron schedules, and the audit log.

Most tests run in the rolled-back transaction of ``conn``; the ones about
commit and rollback use committed connections of their own. The workers'
side (a running worker taking a changed limit, a scheduler a changed
schedule) is tests/worker/test_runtime_control.py.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

import psycopg
import pytest

from conveyor import (
    Admin,
    AsyncAdmin,
    InvalidInputError,
    LimitInfo,
    Router,
    ScheduleNotFoundError,
)
from conveyor.db.named_queries import queries_for
from conveyor.worker.flow import FlowControl
from schema_reset import empty_schema

Q = queries_for("conveyor")


@pytest.fixture
def db(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    """``conn`` with the tables emptied inside the rolled-back transaction."""
    empty_schema(conn)
    return conn


def _declare_limits(conn: psycopg.Connection[Any], **options: Any) -> None:
    """The limits as a worker's start writes them (FlowControl.declare's statement)."""
    router = Router()
    router.add("mail.*", lambda event: None, **options)
    flow = FlowControl(Q, router)
    d = flow.declared
    conn.execute(Q["flow_declare"], {
        "patterns": [x.pattern for x in d], "max_runnings": [x.max_running for x in d],
        "rates": [x.rate for x in d], "bursts": [x.burst for x in d],
        "fair_bys": [x.fair_by for x in d], "fifo_bys": [x.fifo_by for x in d]})


def _declare_schedule(conn: psycopg.Connection[Any], name: str = "nightly",
                      expression: str = "0 3 * * *", tz: str = "UTC") -> None:
    conn.execute(Q["cron_declare"], {"names": [name], "expressions": [expression],
                                     "timezones": [tz], "topics": ["report.build"],
                                     "catch_ups": [300.0], "now": None})


def _effective(conn: psycopg.Connection[Any], pattern: str) -> tuple[Any, ...]:
    """What the workers' flow claim reads under the pattern's lock: max_running, rate, burst."""
    row = conn.execute(Q["flow_lock"], {"pattern": pattern}).fetchone()
    assert row is not None
    return tuple(row[:3])


# ------------------------------------------------------------------ limits

def test_an_override_wins_over_a_worker_declaring_its_routes_again(
        db: psycopg.Connection[Any]) -> None:
    admin = Admin()
    _declare_limits(db, max_running=2)
    limit = admin.set_limit(db, "mail.*", max_running=5, rate="10/s", reason="backlog")
    assert isinstance(limit, LimitInfo)
    assert (limit.max_running, limit.override_max_running, limit.effective_max_running) == (2, 5, 5)
    assert (limit.override_rate, limit.override_burst) == (10.0, 10.0)
    _declare_limits(db, max_running=3)               # a new version of the code starts
    assert _effective(db, "mail.*") == (5, 10.0, 10.0)
    [limit] = admin.limits(db)
    assert (limit.max_running, limit.effective_max_running, limit.declared) == (3, 5, True)


def test_clearing_an_override_brings_the_declared_limit_back(db: psycopg.Connection[Any]) -> None:
    admin = Admin()
    _declare_limits(db, max_running=2, rate="4/s")
    admin.set_limit(db, "mail.*", max_running=9, burst=20)
    assert _effective(db, "mail.*") == (9, 4.0, 20.0)
    assert admin.clear_limit(db, "mail.*", reason="incident over") is True
    assert _effective(db, "mail.*") == (2, 4.0, 4.0)
    assert admin.clear_limit(db, "mail.*") is False    # nothing to clear: no audit row either
    assert [e.kind for e in admin.audit_log(db)] == ["limit.clear", "limit.set"]


def test_setting_one_field_keeps_the_others_overrides(db: psycopg.Connection[Any]) -> None:
    admin = Admin()
    _declare_limits(db, max_running=2)
    admin.set_limit(db, "mail.*", rate=2.5)
    limit = admin.set_limit(db, "mail.*", max_running=4)
    assert (limit.override_max_running, limit.override_rate, limit.override_burst) == (4, 2.5, 2.5)


def test_an_undeclared_pattern_gets_a_limit_of_its_own_until_cleared(
        db: psycopg.Connection[Any]) -> None:
    admin = Admin()
    limit = admin.set_limit(db, "bulk.export", max_running=1)
    assert (limit.declared, limit.max_running, limit.effective_max_running) == (False, None, 1)
    assert db.execute(Q["flow_list"]).fetchall() == [("bulk.export", 1, None, None, None)]
    assert admin.clear_limit(db, "bulk.export") is True
    assert admin.limits(db) == []                    # no route declares it: the row is gone


def test_limits_count_the_running_events_of_each_pattern(db: psycopg.Connection[Any]) -> None:
    admin = Admin()
    admin.set_limit(db, "mail.*", max_running=3)
    db.execute("INSERT INTO conveyor.events (topic, payload, state, lease_owner, "
               "lease_expires_at) VALUES ('mail.send', '{}', 'running', gen_random_uuid(), "
               "now() + interval '1 minute'), ('other', '{}', 'running', gen_random_uuid(), "
               "now() + interval '1 minute')")
    assert [(x.pattern, x.running) for x in admin.limits(db)] == [("mail.*", 1)]


@pytest.mark.parametrize(("options", "named"), [
    ({"max_running": -1}, "-1"),
    ({"max_running": 0}, "0"),
    ({"max_running": True}, "True"),
    ({"max_running": 2_000_000}, "2000000"),
    ({"rate": 0}, "0"),
    ({"rate": math.nan}, "nan"),
    ({"rate": "0/s"}, "'0/s'"),
    ({"rate": "fast"}, "'fast'"),
    ({"burst": 0.5}, "0.5"),
    ({"burst": math.inf}, "inf"),
    ({}, "got none"),
])
def test_a_bad_limit_is_refused_naming_the_value(db: psycopg.Connection[Any],
                                                 options: dict[str, Any], named: str) -> None:
    with pytest.raises(InvalidInputError, match=named):
        Admin().set_limit(db, "mail.*", **options)
    assert Admin().limits(db) == [] and Admin().audit_log(db) == []


@pytest.mark.parametrize(("call", "named"), [
    (lambda a, c: a.set_limit(c, "mail.**", max_running=1), "mail.\\*\\*"),
    (lambda a, c: a.set_limit(c, "mail.*", max_running=1, actor=""), "actor"),
    (lambda a, c: a.set_limit(c, "mail.*", max_running=1, reason="x" * 501), "501"),
    (lambda a, c: a.audit_log(c, kind="limits"), "'limits'"),
    (lambda a, c: a.audit_log(c, limit=0), "limit .* got 0"),
])
def test_bad_arguments_are_refused_naming_them(db: psycopg.Connection[Any], call: Any,
                                               named: str) -> None:
    with pytest.raises(InvalidInputError, match=named):
        call(Admin(), db)


# ------------------------------------------------------------------ schedules

def test_a_schedule_override_outlives_the_declaration_and_clears(
        db: psycopg.Connection[Any]) -> None:
    admin = Admin()
    _declare_schedule(db)
    info = admin.set_schedule(db, "nightly", "  30   2 * * * ", reason="after the backup")
    assert (info.expression, info.expression_override, info.effective_expression) == (
        "0 3 * * *", "30 2 * * *", "30 2 * * *")
    assert info.next_fire_at is not None and (info.next_fire_at.hour, info.next_fire_at.minute) == (2, 30)
    _declare_schedule(db, expression="0 4 * * *")      # a new version of the code starts
    [info] = admin.schedules(db)
    assert (info.expression, info.effective_expression) == ("0 4 * * *", "30 2 * * *")
    info = admin.clear_schedule(db, "nightly")
    assert (info.expression_override, info.effective_expression) == (None, "0 4 * * *")


def test_a_changed_schedule_starts_from_the_change(db: psycopg.Connection[Any]) -> None:
    _declare_schedule(db)
    db.execute("UPDATE conveyor.cron_schedules SET fired_through = now() - interval '1 hour'")
    info = Admin().set_schedule(db, "nightly", "* * * * *")
    now = db.execute("SELECT now()").fetchone()
    assert now is not None and info.fired_through == now[0]   # no slot before it fires


def test_a_disabled_schedule_is_never_overdue_and_enabling_starts_from_now(
        db: psycopg.Connection[Any]) -> None:
    admin = Admin()
    _declare_schedule(db)
    db.execute("UPDATE conveyor.cron_schedules SET next_fire_at = now() - interval '1 hour', "
               "fired_through = now() - interval '2 hours'")
    assert admin.schedules(db)[0].overdue
    info = admin.disable_schedule(db, "nightly", reason="report broken")
    assert (info.enabled, info.overdue, info.next_fire_at) == (False, False, None)
    _declare_schedule(db, expression="0 5 * * *")      # a worker restart does not enable it
    assert admin.schedules(db)[0].enabled is False
    info = admin.enable_schedule(db, "nightly")
    now = db.execute("SELECT now()").fetchone()
    assert now is not None
    assert (info.enabled, info.fired_through) == (True, now[0])
    assert info.next_fire_at is not None and info.next_fire_at.hour == 5


def test_a_schedule_expression_is_read_in_its_zone(db: psycopg.Connection[Any]) -> None:
    _declare_schedule(db, tz="Asia/Kolkata")
    info = Admin().set_schedule(db, "nightly", "0 9 * * *")
    assert info.next_fire_at is not None
    assert (info.next_fire_at.hour, info.next_fire_at.minute) == (3, 30)   # 09:00 IST in UTC


@pytest.mark.parametrize(("expression", "named"), [
    ("61 * * * *", "'61 \\* \\* \\* \\*'"),
    ("every minute", "'every minute'"),
    ("", "''"),
    ("0 0 30 2 *", "'0 0 30 2 \\*'"),
])
def test_an_expression_that_does_not_parse_is_refused_naming_it(
        db: psycopg.Connection[Any], expression: str, named: str) -> None:
    _declare_schedule(db)
    with pytest.raises(InvalidInputError, match=named):
        Admin().set_schedule(db, "nightly", expression)
    assert Admin().audit_log(db) == []


@pytest.mark.parametrize("action", ["set_schedule", "clear_schedule", "disable_schedule",
                                    "enable_schedule"])
def test_an_unknown_schedule_is_refused_naming_it_and_the_known_ones(
        db: psycopg.Connection[Any], action: str) -> None:
    _declare_schedule(db)
    args = ("nope", "* * * * *") if action == "set_schedule" else ("nope",)
    with pytest.raises(ScheduleNotFoundError, match="unknown cron schedule 'nope'; "
                                                    "schedules: 'nightly'"):
        getattr(Admin(), action)(db, *args)


def test_removing_a_schedule_is_audited(db: psycopg.Connection[Any]) -> None:
    admin = Admin()
    _declare_schedule(db)
    assert admin.remove_schedule(db, "nightly", reason="retired", actor="ana") is True
    [entry] = admin.audit_log(db)
    assert (entry.kind, entry.target, entry.actor, entry.reason, entry.new) == (
        "schedule.remove", "nightly", "ana", "retired", None)
    assert entry.old is not None and entry.old["expression"] == "0 3 * * *"


# ------------------------------------------------------------------ the audit log

def test_every_change_is_audited_with_who_when_why_and_the_values(
        db: psycopg.Connection[Any]) -> None:
    admin = Admin()
    _declare_schedule(db)
    admin.pause(db, "email.*", tenant="acme", reason="smtp down", actor="ana")
    admin.resume(db, "email.*", tenant="acme", actor="ana")
    admin.set_limit(db, "sms.send", max_running=2, actor="bo", reason="provider")
    admin.clear_limit(db, "sms.send", actor="bo")
    admin.set_schedule(db, "nightly", "0 1 * * *", actor="cy")
    admin.disable_schedule(db, "nightly", actor="cy")
    admin.enable_schedule(db, "nightly")
    log = admin.audit_log(db)
    assert [(e.kind, e.target, e.actor) for e in log] == [
        ("schedule.enable", "nightly", db.info.user),   # no actor: the database role
        ("schedule.disable", "nightly", "cy"),
        ("schedule.set", "nightly", "cy"),
        ("limit.clear", "sms.send", "bo"),
        ("limit.set", "sms.send", "bo"),
        ("pause.resume", "email.*", "ana"),
        ("pause.set", "email.*", "ana"),
    ]
    now = db.execute("SELECT now()").fetchone()
    assert now is not None and {e.at for e in log} == {now[0]}   # the transaction's time
    pause, limit = log[-1], log[-3]
    assert (pause.reason, pause.old, pause.new and pause.new["tenant"]) == ("smtp down", None,
                                                                             "acme")
    assert (limit.reason, limit.old, limit.new) == (
        "provider", None, {"max_running": 2, "rate": None, "burst": None})
    assert log[2].old == {"expression": "0 3 * * *", "override": None, "enabled": True}
    assert log[2].new == {"expression": "0 1 * * *", "override": "0 1 * * *", "enabled": True}


def test_the_audit_log_filters_by_target_and_kind_and_pages(db: psycopg.Connection[Any]) -> None:
    admin = Admin()
    for n in range(1, 4):
        admin.set_limit(db, "sms.send", max_running=n)
    admin.pause(db, "sms.send")
    admin.set_limit(db, "mail.*", max_running=1)
    assert [e.kind for e in admin.audit_log(db, target="sms.send")] == [
        "pause.set", "limit.set", "limit.set", "limit.set"]
    assert [e.target for e in admin.audit_log(db, kind="limit")] == [
        "mail.*", "sms.send", "sms.send", "sms.send"]
    assert len(admin.audit_log(db, kind="pause.set")) == 1
    first = admin.audit_log(db, target="sms.send", kind="limit.set", limit=2)
    assert [e.new and e.new["max_running"] for e in first] == [3, 2]
    rest = admin.audit_log(db, target="sms.send", kind="limit.set", before=first[-1].id)
    assert [e.new and e.new["max_running"] for e in rest] == [1]


def test_a_rolled_back_change_leaves_no_audit_row(shared_db_url: str) -> None:
    actor = f"rollback-{uuid.uuid4().hex[:8]}"
    pattern = f"t{uuid.uuid4().hex[:8]}.job"
    admin = Admin()
    with psycopg.connect(shared_db_url) as conn:
        admin.set_limit(conn, pattern, max_running=3, actor=actor)
        admin.pause(conn, pattern, actor=actor)
        assert len(admin.audit_log(conn, target=pattern)) == 2   # seen inside the transaction
        conn.rollback()
    with psycopg.connect(shared_db_url, autocommit=True) as other:
        assert admin.audit_log(other, target=pattern) == []
        assert admin.limits(other, pattern=pattern) == []
        # Committed, the change and its row are there together, even on an autocommit
        # connection, where each statement is its own transaction.
        admin.set_limit(other, pattern, max_running=3, actor=actor)
        assert [e.actor for e in admin.audit_log(other, target=pattern)] == [actor]
        assert admin.clear_limit(other, pattern, actor=actor)


async def test_the_async_admin_sets_clears_and_reads_the_log(
        aconn: psycopg.AsyncConnection[Any]) -> None:
    admin = AsyncAdmin()
    pattern = f"a{uuid.uuid4().hex[:8]}.job"
    limit = await admin.set_limit(aconn, pattern, rate="120/m", actor="async")
    assert (limit.override_rate, limit.override_burst) == (2.0, 2.0)
    assert await admin.clear_limit(aconn, pattern, actor="async") is True
    assert [e.kind for e in await admin.audit_log(aconn, target=pattern)] == [
        "limit.clear", "limit.set"]


def test_the_decoders_read_the_columns_their_queries_return(db: psycopg.Connection[Any]) -> None:
    from conveyor.admin_controls_core import AUDIT_COLUMNS, LIMIT_COLUMNS
    from conveyor.db.rows import SCHEDULE_COLUMNS
    for query, params, columns in [
            ("flow_limit_list", {"pattern": None}, LIMIT_COLUMNS),
            ("control_audit_list", {"target": None, "kind": None, "limit": 1, "before": None},
             AUDIT_COLUMNS),
            ("cron_list", None, SCHEDULE_COLUMNS)]:
        cur = db.execute(Q[query], params)
        assert cur.description is not None
        assert tuple(c.name for c in cur.description) == columns, query


def test_enabling_an_enabled_schedule_or_clearing_no_override_keeps_its_cursor(
        db: psycopg.Connection[Any]) -> None:
    _declare_schedule(db)
    row = db.execute("UPDATE conveyor.cron_schedules SET fired_through = now() - interval "
                     "'10 minutes' RETURNING fired_through").fetchone()
    assert row is not None
    assert Admin().enable_schedule(db, "nightly").fired_through == row[0]
    assert Admin().clear_schedule(db, "nightly").fired_through == row[0]
