"""Workflows (conveyor.canvas): how chain, group and then build a graph, what they
refuse, and the steps read back through Admin and ``conveyor workflow show``."""

from __future__ import annotations

import json
from collections.abc import Callable

import psycopg
import pytest

from cli_support import no_conveyor_env, restore_logging  # noqa: F401 - autouse fixtures
from conveyor import Admin, InvalidInputError, Producer, Router, chain, group, step
from conveyor.canvas import plan
from conveyor.cli.main import main

Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def cli(fresh_db: str, capsys: pytest.CaptureFixture[str]) -> Run:
    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(["--database-url", fresh_db, *args])
        out, err = capsys.readouterr()
        return code, out, err
    return run


def test_a_chain_waits_for_every_last_step_of_the_part_before() -> None:
    a, b, c, d = step("s.a"), step("s.b"), step("s.c"), step("s.d")
    p = plan(chain(a, group(b, c), d))
    assert [s.event.topic for s in p.steps] == ["s.a", "s.b", "s.c", "s.d"]
    assert sorted(p.edges) == [(1, 0), (2, 0), (3, 1), (3, 2)]
    assert p.firsts == (0,)


def test_a_step_used_twice_is_one_step_with_both_places_dependencies() -> None:
    a, b, shared = step("s.a"), step("s.b"), step("s.shared")
    p = plan(group(chain(a, shared), chain(b, shared)))
    assert len(p.steps) == 3
    assert sorted(p.edges) == [(1, 0), (1, 2)]


@pytest.mark.parametrize(("build", "message"), [
    (lambda: group(), "a group needs at least one step"),
    (lambda: chain(step("s.a"), "s.b"), "chain part #1 is str, not a step, chain or group"),
    (lambda: step("s.a", on_failure="retry"),
     "on_failure must be one of park, cancel, ignore, not 'retry'"),
])
def test_a_bad_workflow_is_refused_naming_what_is_wrong(
        build: Callable[[], object], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        build()


def test_a_cycle_is_refused_naming_a_step_on_it() -> None:
    a, b = step("s.a"), step("s.b")
    with pytest.raises(InvalidInputError, match=r"cycle through step\('s.a'\)"):
        plan(chain(a, b, a))


def test_a_step_with_an_idempotency_key_is_refused() -> None:
    from conveyor import NewEvent
    from conveyor.canvas import Step
    with pytest.raises(InvalidInputError, match="take no idempotency key \\('k1'\\)"):
        Step(NewEvent(topic="s.a", idempotency_key="k1"))


def test_a_bad_step_is_refused_by_its_index_and_nothing_is_written(fresh_db: str) -> None:
    with psycopg.connect(fresh_db) as conn:
        with pytest.raises(InvalidInputError, match=r"step #1: .*topic"):
            Producer().enqueue_workflow(conn, chain(step("s.a"), step("")))
        assert conn.execute("SELECT count(*) FROM conveyor.events").fetchone() == (0,)


def test_a_typed_tasks_call_is_a_step_with_its_options() -> None:
    router = Router()

    @router.task("mail.send")
    def send(to: str, *, urgent: bool = False) -> None: ...

    s = send.using(priority=5).step("ada@example.com", urgent=True)
    assert (s.event.topic, s.event.payload, s.event.priority) == (
        "mail.send", {"args": ["ada@example.com"], "kwargs": {"urgent": True}}, 5)
    with pytest.raises(InvalidInputError, match=r"mail\.send"):
        send.step()  # type: ignore[call-arg]


def test_workflow_show_draws_levels_and_sums_up_large_groups(fresh_db: str, cli: Run) -> None:
    first, last = step("s.first"), step("s.last")
    members = [step("s.member", {"i": i}) for i in range(12)]
    with psycopg.connect(fresh_db) as conn:
        ids = Producer().enqueue_workflow(conn, chain(first, group(*members), last))
        conn.commit()
        steps = Admin().workflow(conn, ids[last])
        assert [s.id for s in steps] == list(ids)
        assert steps[-1].depends_on == tuple(ids[m] for m in members)
    code, out, _ = cli("workflow", "show", str(ids[members[3]]))
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"workflow of event {ids[members[3]]}: 14 steps (1 pending, 13 waiting)"
    assert lines[1:] == [
        "level 0:", f"  {ids[first]:>10} pending   s.first",
        "level 1:", f"  {12:>10} x s.member: 12 waiting",
        "level 2:", f"  {ids[last]:>10} waiting   s.last after "
        + ", ".join(str(ids[m]) for m in members[:5]) + ", ... (12)"]
    code, out, _ = cli("workflow", "show", str(ids[first]), "--json")
    assert code == 0 and len(json.loads(out)["steps"]) == 14


def test_workflow_show_of_an_unknown_event_says_so(cli: Run) -> None:
    code, _, err = cli("workflow", "show", "424242")
    assert code == 1 and "event 424242 not found" in err


def test_status_counts_waiting_steps_per_topic(fresh_db: str) -> None:
    with psycopg.connect(fresh_db) as conn:
        Producer().enqueue_workflow(conn, chain(step("s.first"), group(step("s.b"), step("s.b"))))
        conn.commit()
        status = Admin().status(conn)
    assert status.counts["waiting"] == 2 and status.counts["pending"] == 1
    by_topic = {(t.topic, t.state): t.count for t in status.by_topic}
    assert by_topic[("s.b", "waiting")] == 2
