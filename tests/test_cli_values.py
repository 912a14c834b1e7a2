"""Durations and counts on the command line: refused for range while parsing.

Before, ``--concurrency 99999999999999`` and ``prune --older-than
99999999999999999999d`` reached PostgreSQL ("conveyor: database error: integer
out of range"), ``--lease-ttl 999999999999d`` started a worker that failed every
claim, and ``--delay 1e400`` or ``--lease-ttl nan`` were refused for the wrong
reason ("must be >= 0"). Every case gets one line naming the value and the range.

The database URL points nowhere: reaching SQL would be an error of its own.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.cli.durations import COUNT_MAX, DURATION_MAX_SECONDS, parse_count, parse_duration
from conveyor.cli.main import main
from conveyor.errors import InvalidInputError

REPO = Path(__file__).resolve().parents[1]
NOWHERE = "postgresql://conveyor@127.0.0.1:1/nowhere?connect_timeout=1"
WORKER = ["worker", "--app", "tests.acceptance.apps:router"]


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    try:
        status = main(["--database-url", NOWHERE, *args])
    except SystemExit as exit_:
        status = int(exit_.code or 0)
    out, err = capsys.readouterr()
    assert out == ""
    assert "Traceback" not in err
    assert "database error" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("conveyor: error: "), err
    return status, lines[0]


@pytest.fixture(autouse=True)
def _repo_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO))  # for --app tests.acceptance.apps:router


@pytest.fixture(autouse=True)
def _worker_must_not_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value that got through would start a worker retrying the unreachable URL forever."""
    from conveyor.worker import Worker

    async def started(self: Worker) -> None:
        raise RuntimeError(f"the worker started with {self.config!r}")

    monkeypatch.setattr(Worker, "run", started)


# ------------------------------------------------------------- while parsing

@pytest.mark.parametrize("args, value", [
    ([*WORKER, "--lease-ttl", "999999999999d"], "'999999999999d'"),
    (["prune", "--older-than", "99999999999999999999d"], "'99999999999999999999d'"),
    (["enqueue", "a.b", "--delay", "1e400"], "'1e400'"),
    (["enqueue", "a.b", "--delay", "inf"], "'inf'"),
    ([*WORKER, "--poll-interval", "36601d"], "'36601d'"),
    ([*WORKER, "--backoff-max", "5300w"], "'5300w'"),
], ids=["lease-ttl", "older-than", "delay-1e400", "delay-inf", "poll-interval", "backoff-max"])
def test_a_duration_past_the_limit_is_refused_naming_it_and_the_range(
    capsys: pytest.CaptureFixture[str], args: list[str], value: str,
) -> None:
    status, line = _run(capsys, *args)
    assert status == 2
    assert f"invalid duration {value}: must be between 0 and 36600d (100 years)" in line


@pytest.mark.parametrize("flag", ["--lease-ttl", "--poll-interval", "--shutdown-timeout"])
def test_nan_is_refused_as_not_a_number(capsys: pytest.CaptureFixture[str], flag: str) -> None:
    status, line = _run(capsys, *WORKER, flag, "nan")
    assert status == 2
    assert f"argument {flag}: invalid duration 'nan': not a number" in line
    assert ">= 0" not in line


def test_a_negative_duration_is_refused_with_the_range(capsys: pytest.CaptureFixture[str]) -> None:
    status, line = _run(capsys, "enqueue", "a.b", "--delay=-5")
    assert status == 2
    assert "invalid duration '-5': must be between 0 and 36600d (100 years)" in line


@pytest.mark.parametrize("args", [
    [*WORKER, "--concurrency", "99999999999999"],
    [*WORKER, "--batch-size", "99999999999999"],
    ["enqueue", "a.b", "--max-attempts", "99999999999999"],
], ids=["concurrency", "batch-size", "max-attempts"])
def test_a_count_past_postgresql_integer_is_refused_while_parsing(
    capsys: pytest.CaptureFixture[str], args: list[str],
) -> None:
    status, line = _run(capsys, *args)
    assert status == 2
    assert "expected an integer between 1 and 2147483647, got '99999999999999'" in line


# ----------------------------------------------- against the field's own range

@pytest.mark.parametrize("args, message", [
    (["--concurrency", "50000"], "expected concurrency to be between 1 and 10000, got 50000"),
    (["--batch-size", "20000"], "expected batch_size to be between 1 and 10000, got 20000"),
    (["--lease-ttl", "30d"], "expected lease_ttl to be between 0.1s and 7d, got 2592000.0"),
    (["--lease-ttl", "50ms"], "expected lease_ttl to be between 0.1s and 7d, got 0.05"),
    (["--poll-interval", "2d"], "expected poll_interval to be between 0.01s and 1d, got 172800.0"),
    (["--retention", "36000d"],
     "expected retention to be between 0s and 3650d, got 3110400000.0"),
], ids=["concurrency", "batch-size", "lease-ttl-long", "lease-ttl-short", "poll-interval",
        "retention"])
def test_a_worker_value_outside_its_field_range_is_refused_before_starting(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str,
) -> None:
    status, line = _run(capsys, *WORKER, *args)
    assert status == 1
    assert line == f"conveyor: error: {message}"


def test_the_largest_values_the_worker_takes_still_parse() -> None:
    assert parse_duration("7d") == 604_800.0
    assert parse_duration("36600d") == DURATION_MAX_SECONDS
    assert parse_count(str(COUNT_MAX)) == COUNT_MAX


@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-inf", "1e400", "99999999999999999999d",
                                  "5300w", "-1", "1" + "0" * 400 + "s"])
def test_parse_duration_refuses_non_finite_and_out_of_range_values(text: str) -> None:
    with pytest.raises(InvalidInputError, match=r"^invalid duration '.*': (not a number|must be)"):
        parse_duration(text)


def test_a_refused_value_is_one_line_from_the_real_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "conveyor.cli.main", "--database-url", NOWHERE,
         "enqueue", "a.b", "--delay", "1e400"],
        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("conveyor: error: argument --delay: invalid duration '1e400': "
                                  "must be between 0 and 36600d (100 years)")
