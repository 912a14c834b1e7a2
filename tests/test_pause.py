"""Admin / AsyncAdmin: pause, resume and paused, in the caller's transaction."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg
import pytest

from conveyor import Admin, AsyncAdmin, InvalidInputError, Pause
from conveyor.db.named_queries import queries_for
from schema_reset import empty_schema

Q = queries_for("conveyor")


@pytest.fixture
def db(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    """``conn`` with the tables emptied inside the rolled-back transaction."""
    empty_schema(conn)
    return conn


def test_pause_returns_the_pause_and_paused_lists_it(db: psycopg.Connection[Any]) -> None:
    admin = Admin()
    pause = admin.pause(db, "email.*", reason="smtp relay down")
    assert (pause.pattern, pause.tenant, pause.reason) == ("email.*", None, "smtp relay down")
    assert isinstance(pause.paused_at, datetime)
    assert admin.paused(db) == [pause]


def test_paused_lists_all_tenants_before_one_tenant_per_pattern(
        db: psycopg.Connection[Any]) -> None:
    admin = Admin()
    admin.pause(db, "sms.send", tenant="acme")
    admin.pause(db, "email.*", tenant="acme")
    admin.pause(db, "email.*")
    assert [(p.pattern, p.tenant) for p in admin.paused(db)] == [
        ("email.*", None), ("email.*", "acme"), ("sms.send", "acme")]


def test_pausing_again_keeps_paused_at_and_takes_a_new_reason(
        db: psycopg.Connection[Any]) -> None:
    admin = Admin()
    first = admin.pause(db, "email.*", reason="first")
    kept = admin.pause(db, "email.*")
    replaced = admin.pause(db, "email.*", reason="second")
    assert (kept.reason, kept.paused_at) == ("first", first.paused_at)
    assert (replaced.reason, replaced.paused_at) == ("second", first.paused_at)
    assert len(admin.paused(db)) == 1


def test_resume_lifts_exactly_the_named_pause(db: psycopg.Connection[Any]) -> None:
    admin = Admin()
    admin.pause(db, "email.*")
    admin.pause(db, "email.*", tenant="acme")
    admin.pause(db, "email.send")
    assert admin.resume(db, "email.*") is True
    assert [(p.pattern, p.tenant) for p in admin.paused(db)] == [
        ("email.*", "acme"), ("email.send", None)]


def test_resume_of_what_is_not_paused_returns_false(db: psycopg.Connection[Any]) -> None:
    admin = Admin()
    admin.pause(db, "email.*", tenant="acme")
    assert admin.resume(db, "email.*") is False
    assert admin.resume(db, "sms.send") is False
    assert len(admin.paused(db)) == 1


def test_pause_in_a_rolled_back_transaction_leaves_nothing(fresh_db: str) -> None:
    admin = Admin()
    with psycopg.connect(fresh_db) as conn:
        admin.pause(conn, "email.*")
        conn.rollback()
        assert admin.paused(conn) == []


def test_pause_notifies_the_workers_only_when_it_commits(fresh_db: str) -> None:
    admin = Admin()
    with psycopg.connect(fresh_db, autocommit=True) as listener, \
            psycopg.connect(fresh_db) as conn:
        listener.execute('LISTEN "conveyor.events"')
        admin.pause(conn, "email.*")
        conn.rollback()
        assert [n.payload for n in listener.notifies(timeout=0.3)] == []
        admin.pause(conn, "email.*")
        conn.commit()
        assert [n.payload for n in listener.notifies(timeout=20, stop_after=1)] == ["!pause"]
        assert admin.resume(conn, "email.*")
        conn.commit()
        assert [n.payload for n in listener.notifies(timeout=20, stop_after=1)] == ["!pause"]


async def test_async_admin_pauses_resumes_and_lists(
        aconn: psycopg.AsyncConnection[Any]) -> None:
    admin = AsyncAdmin()
    await aconn.execute("DELETE FROM conveyor.pauses")
    pause = await admin.pause(aconn, "billing.*", tenant="acme", reason="audit")
    assert isinstance(pause, Pause)
    assert await admin.paused(aconn) == [pause]
    assert await admin.resume(aconn, "billing.*", tenant="acme") is True
    assert await admin.paused(aconn) == []


@pytest.mark.parametrize(("pattern", "message"), [
    ("email.", "malformed topic pattern 'email.'"),
    ("email*", "malformed topic pattern 'email\\*'"),
    ("*.send", "malformed topic pattern '\\*.send'"),
    ("", "malformed topic pattern ''"),
    ("a b", "malformed topic pattern 'a b'"),
    (None, "malformed topic pattern None"),
    ("x" * 101, "malformed topic pattern 'xxx"),
])
def test_bad_pattern_is_refused_naming_it(db: psycopg.Connection[Any], pattern: Any,
                                          message: str) -> None:
    with pytest.raises(InvalidInputError, match=message) as caught:
        Admin().pause(db, pattern)
    assert "\n" not in str(caught.value)
    with pytest.raises(InvalidInputError, match=message):
        Admin().resume(db, pattern)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tenant": "Acme"}, "invalid tenant 'Acme'"),
    ({"tenant": ""}, "invalid tenant ''"),
    ({"reason": "x" * 501}, "reason is 501 characters, the limit is 500"),
    ({"reason": "two\nlines"}, "reason contains control characters"),
    ({"reason": 5}, "reason must be a string, got 5"),
])
def test_bad_tenant_or_reason_is_refused_naming_it(db: psycopg.Connection[Any],
                                                   kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        Admin().pause(db, "email.*", **kwargs)
    assert Admin().paused(db) == []


def test_pause_to_json_names_every_field(db: psycopg.Connection[Any]) -> None:
    pause = Admin().pause(db, "*", reason="freeze")
    assert pause.to_json() == {"pattern": "*", "tenant": None, "reason": "freeze",
                               "paused_at": pause.paused_at.isoformat()}


def test_admin_sends_the_notification_the_workers_listen_for() -> None:
    from conveyor.admin_core import PAUSE_NOTIFICATION as sent
    from conveyor.router import Router
    from conveyor.worker.worker import Worker
    router = Router()
    router.route("mail.send")(lambda event: None)
    worker = Worker("postgresql://nobody@127.0.0.1:1/none", router)
    assert sent in worker.due_times._signals
