"""``conveyor limits``, ``cron`` and ``audit``: run-time control from the command line.

Most run :func:`conveyor.cli.main.main` in-process on a database of their own;
the refusals run the real command, since "one line, no traceback" is about
what a user sees.
"""

from __future__ import annotations

import getpass
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from cli_support import no_conveyor_env, restore_logging  # noqa: F401 - autouse fixtures
from conveyor.cli.main import main
from conveyor.db.named_queries import queries_for

REPO = Path(__file__).resolve().parents[1]
Q = queries_for("conveyor")
Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def cli(fresh_db: str, capsys: pytest.CaptureFixture[str]) -> Run:
    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        try:
            code = main(["--database-url", fresh_db, *args])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        out, err = capsys.readouterr()
        return code, out, err
    return run


def _conveyor(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "conveyor.cli.main", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


def _declare(url: str) -> None:
    """A route's limit and a router's schedule, as a worker's start writes them."""
    with psycopg.connect(url) as conn:
        conn.execute(Q["flow_declare"], {
            "patterns": ["report.render"], "max_runnings": [2], "rates": [None],
            "bursts": [None], "fair_bys": [None], "fifo_bys": [None]})
        conn.execute(Q["cron_declare"], {
            "names": ["nightly"], "expressions": ["0 3 * * *"], "timezones": ["UTC"],
            "topics": ["report.build"], "catch_ups": [300.0], "now": None})


def _audit_rows(url: str) -> list[tuple[str, str, str, str | None]]:
    with psycopg.connect(url) as conn:
        return [tuple(r) for r in conn.execute(  # type: ignore[misc]
            "SELECT actor, kind, target, reason FROM conveyor.control_audit ORDER BY id")]


def test_limits_set_list_and_clear(cli: Run, fresh_db: str) -> None:
    _declare(fresh_db)
    code, out, err = cli("limits", "set", "report.render", "--max-running", "8",
                         "--reason", "month end")
    assert (code, err) == (0, "")
    assert out == ("limit of report.render now: max_running 8, rate - (burst -); "
                   "held by the workers from their next claim\n")
    code, out, _ = cli("limits", "set", "sms.send", "--rate", "120/m", "--actor", "ana")
    assert "rate 2/s (burst 2.0)" in out
    code, out, _ = cli("limits", "list")
    lines = out.splitlines()
    assert code == 0 and lines[0].split() == ["pattern", "max_running", "rate", "running"]
    assert lines[1].split() == ["report.render", "8", "(code", "2)", "-", "0"]
    assert lines[2].split() == ["sms.send", "-", "2/s", "(code", "-)", "0",
                                "[set", "at", "run", "time", "only]"]
    code, out, _ = cli("limits", "list", "--json")
    limits = json.loads(out)["limits"]
    assert [(x["pattern"], x["max_running"], x["effective"]["max_running"], x["declared"])
            for x in limits] == [("report.render", 2, 8, True), ("sms.send", None, None, False)]
    code, out, _ = cli("limits", "clear", "report.render", "--json")
    assert (code, json.loads(out)) == (0, {"pattern": "report.render", "cleared": True})
    code, out, err = cli("limits", "clear", "report.render")
    assert (code, out, err) == (1, "", "conveyor: report.render has no override\n")
    assert _audit_rows(fresh_db) == [
        (getpass.getuser(), "limit.set", "report.render", "month end"),
        ("ana", "limit.set", "sms.send", None),
        (getpass.getuser(), "limit.clear", "report.render", None)]


def test_cron_set_disable_enable_clear_and_remove(cli: Run, fresh_db: str) -> None:
    _declare(fresh_db)
    code, out, err = cli("cron", "set", "nightly", "--schedule", "30 2 * * *",
                         "--reason", "after the backup")
    assert (code, err) == (0, "")
    assert out.startswith("schedule nightly changed; nightly: 30 2 * * * (set at run time; "
                          "declared 0 3 * * *) -> report.build, next ")
    code, out, _ = cli("cron", "disable", "nightly", "--json")
    data = json.loads(out)
    assert (code, data["enabled"], data["expression_override"]) == (0, False, "30 2 * * *")
    code, out, _ = cli("cron", "list")
    assert out.endswith("next -, DISABLED\n")
    code, out, _ = cli("status")
    assert "30 2 * * * (set at run time; declared 0 3 * * *)" in out and "DISABLED" in out
    assert cli("cron", "enable", "nightly")[0] == 0
    code, out, _ = cli("cron", "clear", "nightly")
    assert code == 0 and "nightly: 0 3 * * * -> report.build, next " in out
    assert cli("cron", "remove", "nightly")[:2] == (0, "schedule nightly removed\n")
    assert cli("cron", "remove", "nightly")[0] == 1
    assert [r[1] for r in _audit_rows(fresh_db)] == [
        "schedule.set", "schedule.disable", "schedule.enable", "schedule.clear",
        "schedule.remove"]


def test_pause_and_resume_are_audited_with_the_os_user(cli: Run, fresh_db: str) -> None:
    cli("pause", "email.*", "--reason", "smtp down")
    cli("resume", "email.*", "--reason", "smtp back", "--actor", "ops-bot")
    assert _audit_rows(fresh_db) == [(getpass.getuser(), "pause.set", "email.*", "smtp down"),
                                     ("ops-bot", "pause.resume", "email.*", "smtp back")]


def test_audit_prints_the_changes_newest_first_and_filters(cli: Run, fresh_db: str) -> None:
    _declare(fresh_db)
    cli("limits", "set", "report.render", "--max-running", "3", "--actor", "ana",
        "--reason", "why")
    cli("cron", "disable", "nightly", "--actor", "bo")
    code, out, _ = cli("audit")
    lines = out.splitlines()
    assert code == 0 and len(lines) == 2
    assert lines[0].endswith("  bo  schedule.disable nightly: enabled=True, "
                             "expression=0 3 * * * -> enabled=False, expression=0 3 * * *")
    assert lines[1].endswith("  ana  limit.set report.render (why): none -> max_running=3")
    code, out, _ = cli("audit", "--kind", "limit", "--json")
    entries = json.loads(out)["entries"]
    assert [(e["kind"], e["actor"], e["new"]) for e in entries] == [
        ("limit.set", "ana", {"max_running": 3, "rate": None, "burst": None})]
    code, out, _ = cli("audit", "--pattern", "nope")
    assert (code, out) == (0, "no control changes match\n")
    code, out, _ = cli("audit", "--limit", "1")
    assert len(out.splitlines()) == 1 and "schedule.disable" in out


@pytest.mark.parametrize(("args", "message"), [
    (("limits", "set", "report.render", "--max-running", "-1"),
     "expected max_running to be an int from 1 to 1000000, got -1"),
    (("limits", "set", "report.render", "--rate", "0"), "got 0.0"),
    (("limits", "set", "report.render", "--rate", "nan"), "got nan"),
    (("limits", "set", "report.render", "--rate", "lots"), "got 'lots'"),
    (("limits", "set", "report.render"), "expected max_running, rate or burst to set"),
    (("limits", "set", "a..b", "--max-running", "1"), "malformed topic pattern 'a..b'"),
    (("cron", "set", "nightly", "--schedule", "61 * * * *"),
     "invalid cron expression '61 * * * *'"),
    (("cron", "disable", "weekly"), "unknown cron schedule 'weekly'; schedules: 'nightly'"),
    (("audit", "--limit", "20000"), "expected limit to be an int from 1 to 10000, got 20000"),
])
def test_bad_input_is_refused_in_one_line_naming_the_value(fresh_db: str, args: tuple[str, ...],
                                                           message: str) -> None:
    _declare(fresh_db)
    done = _conveyor("--database-url", fresh_db, *args)
    assert done.returncode == 1, done.stderr
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert _audit_rows(fresh_db) == []


def test_a_value_argparse_cannot_read_is_a_usage_error(cli: Run) -> None:
    code, out, err = cli("limits", "set", "x", "--max-running", "three")
    assert (code, out) == (2, "")
    assert "argument --max-running: invalid int value: 'three'" in err
