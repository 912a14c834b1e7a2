"""``conveyor events``, and ``retry``/``cancel``/``prune`` on many events, on a real database."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
from pathlib import Path

import pytest

from cli_support import no_conveyor_env, restore_logging
from test_cli import (
    REPO,
    Run,
    _invoke,
    assert_one_line_error,
    child_env,
    cli,
    conveyor,
    enqueue,
    error_db,
    execute,
    row,
)

__all__ = ["cli", "error_db", "no_conveyor_env", "restore_logging"]  # shared fixtures


def _fail(url: str, event_id: int, error: str = "boom") -> None:
    execute(url, "UPDATE conveyor.events SET state = 'failed', attempts = 5, last_error = %s, "
                 "finished_at = now() WHERE id = %s", error, event_id)


def _json(run: Run, *args: str) -> dict[str, object]:
    code, out, err = run(*args, "--json")
    assert code == 0, err
    assert len(out.splitlines()) == 1, out
    result = json.loads(out)
    assert isinstance(result, dict)
    return result


def _ids(result: dict[str, object]) -> list[int]:
    events = result["events"]
    assert isinstance(events, list)
    return [e["id"] for e in events]


# -------------------------------------------------------------------- events

def test_events_lists_newest_first_as_a_table(cli: Run, fresh_db: str) -> None:
    first = enqueue(cli, "email.send", "{}", "--tenant", "acme")
    second = enqueue(cli, "billing.charge")
    _fail(fresh_db, second, "KeyError: 'currency'")
    code, out, err = cli("events")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["id", "state", "attempts", "topic"]
    assert lines[1].split()[:4] == [str(second), "failed", "5/5", "billing.charge"]
    assert lines[1].endswith("  KeyError: 'currency'")
    assert lines[0].index("last error") == lines[1].index("KeyError")    # aligned columns
    assert lines[2].split()[:5] == [str(first), "pending", "0/5", "email.send", "acme"]
    assert err == ""      # one page: no hint


def test_events_filters(cli: Run, fresh_db: str) -> None:
    a = enqueue(cli, "email.send", "{}", "--tenant", "acme")
    b = enqueue(cli, "email.digest")
    c = enqueue(cli, "billing.charge", "{}", "--tenant", "acme")
    _fail(fresh_db, b, "SMTP 550 mailbox unavailable")
    _fail(fresh_db, c, "timeout")
    execute(fresh_db, "UPDATE conveyor.events SET created_at = now() - interval '3 days' "
                      "WHERE id = %s", a)
    assert _ids(_json(cli, "events", "--state", "failed")) == [c, b]
    assert _ids(_json(cli, "events", "--state", "failed", "--state", "pending")) == [c, b, a]
    assert _ids(_json(cli, "events", "--topic", "email.*")) == [b, a]
    assert _ids(_json(cli, "events", "--topic", "email.send")) == [a]
    assert _ids(_json(cli, "events", "--tenant", "acme")) == [c, a]
    assert _ids(_json(cli, "events", "--error", "smtp 550")) == [b]
    assert _ids(_json(cli, "events", "--older-than", "1d")) == [a]
    assert _ids(_json(cli, "events", "--newer-than", "1d")) == [c, b]
    later = enqueue(cli, "email.send", "{}", "--delay", "1h")
    assert _ids(_json(cli, "events", "--state", "scheduled")) == [later]
    assert _ids(_json(cli, "events", "--state", "scheduled", "--state", "failed")) == [later, c, b]


def test_events_payload_filter_and_its_next_page_hint(cli: Run) -> None:
    small = enqueue(cli, "bill.x", '{"amount": 5}')
    big = [enqueue(cli, "bill.x", json.dumps({"amount": 500 + i})) for i in range(3)]
    assert _ids(_json(cli, "events", "--payload", "$.amount > 100")) == big[::-1]
    assert _ids(_json(cli, "events", "--payload", "$.amount < 100")) == [small]
    code, _, err = cli("events", "--payload", "$.amount > 100", "--limit", "2")
    assert code == 0 and "--payload '$.amount > 100'" in err


def test_events_pages_with_after_and_says_how_to_go_on(cli: Run) -> None:
    ids = [enqueue(cli, "a.b") for _ in range(5)]
    page = _json(cli, "events", "--limit", "2")
    assert _ids(page) == [ids[4], ids[3]] and page["next_after"] == ids[3]
    page = _json(cli, "events", "--limit", "2", "--after", str(ids[3]))
    assert _ids(page) == [ids[2], ids[1]]
    page = _json(cli, "events", "--limit", "2", "--after", str(ids[1]))
    assert _ids(page) == [ids[0]] and page["next_after"] is None
    code, out, err = cli("events", "--limit", "2", "--topic", "a.*")
    assert code == 0 and len(out.splitlines()) == 3
    assert f"--after {ids[3]}" in err and "--topic 'a.*'" in err and "--limit 2" in err


def test_events_json_is_exact(cli: Run, fresh_db: str) -> None:
    event_id = enqueue(cli, "a.b", "{}", "--tenant", "acme")
    _fail(fresh_db, event_id, "bad \x1b[2J\r\nthing")
    (event,) = _json(cli, "events")["events"]  # type: ignore[misc]
    assert event["last_error"] == "bad \x1b[2J\r\nthing"
    assert set(event) == {"id", "tenant", "topic", "state", "attempts", "max_attempts",
                          "priority", "run_at", "created_at", "updated_at", "last_error"}


def test_events_text_escapes_stored_errors(cli: Run, fresh_db: str) -> None:
    event_id = enqueue(cli, "a.b")
    _fail(fresh_db, event_id, "\x1b]0;pwned\x07\x1b[2J\rconveyor: retry succeeded\nforged")
    code, out, _ = cli("events")
    assert code == 0
    assert len(out.splitlines()) == 2
    for forbidden in ("\x1b", "\x07", "\r"):
        assert forbidden not in out


@pytest.mark.parametrize(("args", "needle"), [
    (["events", "--state", "lost"], "invalid choice: 'lost'"),
    (["events", "--topic", "Bad Topic"], "topic"),
    (["events", "--limit", "0"], "expected a positive integer"),
    (["events", "--limit", "5000"], "limit"),
    (["events", "--after", "x"], "invalid event id 'x'"),
    (["events", "--older-than", "soon"], "invalid duration 'soon'"),
    (["retry", "--topic", "email.send"], "--failed or --state"),
    (["retry"], "give event ids"),
    (["cancel"], "give event ids"),
    (["retry", "--state", "running"], "'running' events cannot be retried"),
    (["cancel", "1", "x"], "invalid event id 'x'"),
    (["events", "--payload", "$.a =="], "invalid payload path '$.a =='"),
])
def test_bad_listing_or_bulk_arguments_are_one_line(error_db: str, args: list[str],
                                                    needle: str) -> None:
    assert_one_line_error(conveyor("--database-url", error_db, *args), needle)


# --------------------------------------------------------------------- retry

def test_retry_several_ids(cli: Run, fresh_db: str) -> None:
    a, b = enqueue(cli, "a.b"), enqueue(cli, "a.b")
    _fail(fresh_db, a)
    _fail(fresh_db, b)
    code, out, _ = cli("retry", str(a), str(b))
    assert (code, out) == (0, f"event {a} will run again\nevent {b} will run again\n")
    assert row(fresh_db, "SELECT count(*) FROM conveyor.events WHERE state = 'pending'") == (2,)


def test_retry_of_an_unknown_id_among_several_changes_nothing(cli: Run, fresh_db: str) -> None:
    a = enqueue(cli, "a.b")
    _fail(fresh_db, a)
    code, _, err = cli("retry", str(a), "987654321")
    assert code == 1 and "event 987654321 not found" in err
    assert row(fresh_db, "SELECT state FROM conveyor.events WHERE id = %s", a) == ("failed",)


def test_retry_by_filter_with_dry_run_and_json(cli: Run, fresh_db: str) -> None:
    a, b, c = enqueue(cli, "email.send"), enqueue(cli, "email.digest"), enqueue(cli, "b.c")
    for event_id in (a, b, c):
        _fail(fresh_db, event_id)
    result = _json(cli, "retry", "--state", "failed", "--topic", "email.*", "--dry-run")
    assert result == {"ids": [b, a], "count": 2, "dry_run": True}
    assert row(fresh_db, "SELECT count(*) FROM conveyor.events WHERE state = 'failed'") == (3,)
    code, out, _ = cli("retry", "--failed", "--topic", "email.*")
    assert (code, out) == (0, f"retried 2 events: {b}, {a}\n")
    assert row(fresh_db, "SELECT count(*) FROM conveyor.events WHERE state = 'failed'") == (1,)
    assert _json(cli, "retry", "--failed") == {"ids": [c], "count": 1, "dry_run": False}


# -------------------------------------------------------------------- cancel

def test_cancel_several_ids_and_again(cli: Run, fresh_db: str) -> None:
    a, b = enqueue(cli, "a.b"), enqueue(cli, "a.b")
    code, out, _ = cli("cancel", str(a), str(b))
    assert (code, out) == (0, f"event {a} cancelled\nevent {b} cancelled\n")
    assert _json(cli, "cancel", str(a), str(b)) == {"ids": [a, b], "count": 2, "dry_run": False}
    assert row(fresh_db, "SELECT count(*) FROM conveyor.events WHERE state = 'cancelled'") == (2,)


def test_cancel_by_filter_with_dry_run(cli: Run, fresh_db: str) -> None:
    a, b = enqueue(cli, "spam.x", "{}", "--tenant", "acme"), enqueue(cli, "spam.y")
    keep = enqueue(cli, "ham.x")
    code, out, _ = cli("cancel", "--topic", "spam.*", "--dry-run")
    assert (code, out) == (0, f"would cancel 2 events: {b}, {a}\n")
    assert row(fresh_db, "SELECT count(*) FROM conveyor.events WHERE state = 'cancelled'") == (0,)
    assert _json(cli, "cancel", "--topic", "spam.*", "--tenant", "acme") == \
        {"ids": [a], "count": 1, "dry_run": False}
    assert row(fresh_db, "SELECT state FROM conveyor.events WHERE id = %s", keep) == ("pending",)


# --------------------------------------------------------------------- prune

def _finish(url: str, event_id: int, state: str, days_ago: int = 2) -> None:
    execute(url, "UPDATE conveyor.events SET state = %s, finished_at = now() - %s * interval "
                 "'1 day' WHERE id = %s", state, days_ago, event_id)


def test_prune_keeps_failed_events_unless_asked(cli: Run, fresh_db: str) -> None:
    ok, failed, cancelled = (enqueue(cli, "a.b") for _ in range(3))
    _finish(fresh_db, ok, "succeeded")
    _finish(fresh_db, failed, "failed")
    _finish(fresh_db, cancelled, "cancelled")
    assert _json(cli, "prune", "--older-than", "1d", "--dry-run") == \
        {"deleted": 2, "dry_run": True, "states": ["cancelled", "succeeded"], "older_than_s": 86400.0}
    assert row(fresh_db, "SELECT count(*) FROM conveyor.events") == (3,)
    code, out, _ = cli("prune", "--older-than", "1d")
    assert (code, out) == (0, "deleted 2 events\n")
    assert row(fresh_db, "SELECT array_agg(id) FROM conveyor.events") == ([failed],)
    code, out, _ = cli("prune", "--older-than", "1d", "--state", "failed", "--dry-run")
    assert (code, out) == (0, "would delete 1 event\n")
    code, out, _ = cli("prune", "--older-than", "1d", "--state", "failed")
    assert (code, out) == (0, "deleted 1 event\n")


def test_prune_reports_progress_every_few_batches(cli: Run, fresh_db: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import conveyor.admin
    from conveyor.cli import progress

    for _ in range(7):
        _finish(fresh_db, enqueue(cli, "a.b"), "succeeded")
    monkeypatch.setattr(conveyor.admin, "PRUNE_BATCH", 2)
    monkeypatch.setattr(progress, "PROGRESS_EVERY_BATCHES", 2)
    code, out, err = cli("prune", "--older-than", "1d")
    assert (code, out) == (0, "deleted 7 events\n")
    assert err.splitlines() == ["conveyor: prune: 4 events deleted so far"]


# -------------------------------------------------------------------- status

def test_status_shows_scheduled_apart_from_due(cli: Run) -> None:
    enqueue(cli, "billing.charge", "{}", "--delay", "1h")
    enqueue(cli, "email.send")
    code, out, _ = cli("status")
    assert code == 0
    first = out.splitlines()[0]
    assert "pending 1" in first and "scheduled 1" in first
    header = next(line for line in out.splitlines() if line.startswith("topic"))
    assert header.split()[1:3] == ["pending", "scheduled"]
    billing = next(line for line in out.splitlines() if line.startswith("billing.charge"))
    assert billing.split()[1:3] == ["0", "1"]
    # Not yet due: no worker needs to claim it yet.
    assert "pending with no live worker claiming them: email.send" in out
    counts = _json(cli, "status")["counts"]
    assert isinstance(counts, dict) and (counts["pending"], counts["scheduled"]) == (1, 1)


# ---------------------------------------------------------------------- xlsx

def _workbook(path: Path, rows: int) -> None:
    import xlsxwriter

    wb = xlsxwriter.Workbook(str(path))
    ws = wb.add_worksheet()
    ws.write_row(0, 0, ["tipo", "monto"])
    for i in range(rows):
        ws.write_row(i + 1, 0, ["a" if i % 2 else "b", i])
    wb.close()


def test_xlsx_shows_progress_on_a_terminal_only(tmp_path: Path) -> None:
    book = tmp_path / "b.xlsx"
    _workbook(book, 300)
    env = child_env()
    main_fd, tty_fd = pty.openpty()
    try:
        done = subprocess.run([sys.executable, "-m", "conveyor.cli.main", "xlsx", str(book)],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=tty_fd,
                              timeout=60, check=False)
        os.close(tty_fd)
        seen = b""
        while select.select([main_fd], [], [], 0.5)[0]:
            try:
                chunk = os.read(main_fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(main_fd)
    assert done.returncode == 0
    assert json.loads(done.stdout)["rows"] == 300
    assert b"reading b.xlsx" in seen, seen
    plain = conveyor("xlsx", str(book), env=env)          # stderr a pipe: nothing
    assert (plain.returncode, plain.stderr) == (0, "")


def test_every_bulk_command_has_help_with_examples(capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("events", "retry", "cancel", "prune"):
        code, out, _ = _invoke(capsys, [command, "--help"])
        assert code == 0 and "examples:" in out, command


# ---------------------------------------------------------------- reschedule

def test_reschedule_at_a_moment_and_in_a_while(cli: Run, fresh_db: str) -> None:
    event_id = enqueue(cli, "report.build")
    code, out, err = cli("reschedule", str(event_id), "--at", "2031-03-30T09:00:00+02:00")
    assert (code, out, err) == (0, f"event {event_id} is due at 2031-03-30 07:00:00 UTC\n", "")
    assert row(fresh_db, "SELECT run_at = '2031-03-30T07:00:00Z' FROM conveyor.events") == (True,)
    # Two hours from the database's clock while the command ran (a loaded
    # machine may take seconds between the command and this test's reads).
    (before,) = row(fresh_db, "SELECT now()")
    done = _json(cli, "reschedule", str(event_id), "--in", "2h")
    assert done["id"] == event_id and isinstance(done["run_at"], str)
    assert row(fresh_db, "SELECT run_at - interval '2 hours' BETWEEN %s AND now()"
               " FROM conveyor.events", before) == (True,)
    _fail(fresh_db, event_id)
    assert cli("reschedule", str(event_id), "--in", "0s")[0] == 0
    assert row(fresh_db, "SELECT state, max_attempts FROM conveyor.events") == ("pending", 6)


def test_enqueue_at_a_moment(cli: Run, fresh_db: str) -> None:
    event_id = enqueue(cli, "report.build", "{}", "--at", "2031-03-30T07:00:00Z")
    assert row(fresh_db, "SELECT id, run_at = '2031-03-30T07:00:00Z' FROM conveyor.events") == (
        event_id, True)


@pytest.mark.parametrize(("args", "needle"), [
    (["reschedule", "1"], "one of the arguments --at --in is required"),
    (["reschedule", "1", "--at", "2031-03-30T09:00:00"], "has no UTC offset"),
    (["reschedule", "1", "--at", "tomorrow"], "invalid time 'tomorrow'"),
    (["reschedule", "1", "--at", "2031-03-30T09:00Z", "--in", "1h"], "not allowed with argument"),
    (["reschedule", "987654321", "--in", "1h"], "event 987654321 not found"),
    (["enqueue", "a.b", "{}", "--at", "2031-01-01T00:00Z", "--delay", "1h"], "not allowed with argument"),
])
def test_bad_reschedule_arguments_are_one_line(error_db: str, args: list[str], needle: str) -> None:
    assert_one_line_error(conveyor("--database-url", error_db, *args), needle)
