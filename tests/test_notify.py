"""The NOTIFY protocol (conveyor.notify): its payloads, and the SQL that sends them."""

from __future__ import annotations

import time

import psycopg
import pytest
from psycopg import sql

from conveyor import Producer, notify
from conveyor.db.named_queries import queries_for
from conveyor.errors import InvalidInputError
from conveyor.validation import check_topic
from wake_support import listen_for_wakes


def test_the_channels_of_a_schema() -> None:
    assert notify.events_channel("billing") == "billing.events"
    assert notify.results_channel("billing") == "billing.results"
    q = queries_for("billing")
    assert (q.channel, q.results_channel) == ("billing.events", "billing.results")


@pytest.mark.parametrize("due", [None, 1_900_000_000.25, "1900000000.250000"])
def test_a_wake_up_reads_back_as_its_topic_and_due_time(due: float | str | None) -> None:
    payload = notify.wake_payload("email.send", due)
    assert notify.parse_wake(payload) == ("email.send", "" if due is None else str(due))


@pytest.mark.parametrize("word", [notify.PAUSE_NOTIFICATION, notify.LEASES_NOTIFICATION,
                                  notify.DEPENDENCIES_NOTIFICATION, notify.CONTROL_NOTIFICATION,
                                  notify.WAKE_ALL])
def test_the_control_payloads_name_no_topic(word: str) -> None:
    with pytest.raises(InvalidInputError):
        check_topic(word)
    assert notify.DUE_SEPARATOR not in word


def test_the_admin_sends_the_pause_notification_of_the_protocol() -> None:
    from conveyor.admin_core import PAUSE_NOTIFICATION as sent
    assert sent == notify.PAUSE_NOTIFICATION


def test_every_signal_is_one_the_worker_answers() -> None:
    # A signal the worker does not map is ignored: a new one must be wired in.
    from conveyor.router import Router
    from conveyor.worker.worker import Worker
    router = Router()
    router.route("mail.send")(lambda event: None)
    worker = Worker("postgresql://nobody@127.0.0.1:1/none", router)
    sent = {notify.PAUSE_NOTIFICATION, notify.LEASES_NOTIFICATION,
            notify.CONTROL_NOTIFICATION, notify.DEPENDENCIES_NOTIFICATION}
    assert set(worker.due_times._signals) == sent
    assert all(s.startswith(notify.SIGNAL_PREFIX) for s in sent)


def test_writing_dependent_events_sends_the_dependencies_notification() -> None:
    q = queries_for("conveyor")
    assert f"pg_notify('conveyor.events', '{notify.DEPENDENCIES_NOTIFICATION}')" \
        in q["step_edges_add"]


def test_the_admin_sends_the_control_notification_the_worker_hears(fresh_db: str) -> None:
    from conveyor import Admin
    with psycopg.connect(fresh_db, autocommit=True) as listener, \
            psycopg.connect(fresh_db) as conn:
        listener.execute(sql.SQL("LISTEN {}").format(
            sql.Identifier(notify.events_channel("conveyor"))))
        Admin().set_limit(conn, "mail.*", max_running=2)
        conn.rollback()                                       # nothing changed: nothing sent
        Admin().clear_limit(conn, "mail.*")                   # nothing to clear: nothing sent
        Admin().set_limit(conn, "mail.*", max_running=3)
        conn.commit()
        payloads = [n.payload for n in listener.notifies(timeout=20, stop_after=1)]
    assert payloads == [notify.CONTROL_NOTIFICATION]


def test_both_cancel_statements_send_the_leases_notification_the_worker_hears() -> None:
    q = queries_for("conveyor")
    for name in ("event_cancel", "event_cancel_ids"):
        assert f"pg_notify('conveyor.events', '{notify.LEASES_NOTIFICATION}')" in q[name], name


def test_a_result_announcement_is_the_event_id() -> None:
    assert notify.result_payload(42) == "42"


def test_the_insert_statements_send_the_wake_ups_parse_wake_reads(fresh_db: str) -> None:
    producer = Producer()
    with psycopg.connect(fresh_db, autocommit=True) as listener, \
            psycopg.connect(fresh_db) as conn:
        listen_for_wakes(listener)
        producer.enqueue(conn, "mail.now", {})
        producer.enqueue(conn, "mail.later", {}, delay=600)
        conn.commit()
        payloads = [n.payload for n in listener.notifies(timeout=20, stop_after=2)]
    (now_topic, now_due), (later_topic, later_due) = map(notify.parse_wake, payloads)
    assert (now_topic, now_due) == ("mail.now", "")
    assert later_topic == "mail.later"
    assert abs(float(later_due) - (time.time() + 600)) < 60


async def test_the_worker_reads_every_payload_form_notify_writes() -> None:
    # worker/wakeups.py parses payloads itself; this holds it to the protocol.
    from conveyor.worker.wakeups import DueTimes
    heard: list[str] = []
    due = DueTimes(lambda: heard.append("wake"), lambda topic: topic == "mail.send",
                   lambda: 0.0, {notify.PAUSE_NOTIFICATION: lambda: heard.append("pause"),
                                 notify.CONTROL_NOTIFICATION: lambda: heard.append("control")})
    due.notified(notify.wake_payload("mail.send"))
    due.notified(notify.wake_payload("other.topic"))          # not this worker's
    due.notified(notify.WAKE_ALL)
    due.notified(notify.PAUSE_NOTIFICATION)
    due.notified(notify.CONTROL_NOTIFICATION)
    later = round(time.time() + 3600, 3)
    due.notified(notify.wake_payload("mail.send", later))
    try:
        assert heard == ["wake", "wake", "pause", "control"]
        assert due.heap == [later]
    finally:
        due.cancel()
