"""The CLI's log lines: millisecond UTC timestamps, and a handler's event on its own lines."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator

import pytest

from conveyor.cli.logsetup import configure, utc_timestamp
from conveyor.log_context import CURRENT_EVENT
from conveyor.types import Event


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_utc_timestamp_has_milliseconds_and_a_zone() -> None:
    assert utc_timestamp(0.0) == "1970-01-01T00:00:00.000Z"
    assert utc_timestamp(1764592849.1239) == "2025-12-01T12:40:49.123Z"
    assert utc_timestamp(1764592849.9999) == "2025-12-01T12:40:49.999Z"


def test_json_lines_carry_the_running_handlers_event(
        capsys: pytest.CaptureFixture[str], restore_logging: None) -> None:
    configure("info", "json")
    app = logging.getLogger("shop.app")
    app.info("outside")
    token = CURRENT_EVENT.set(Event(id=7, topic="email.send", payload_text="{}", tenant="acme",
                                    attempt=2, max_attempts=5))
    try:
        app.info("inside")
    finally:
        CURRENT_EVENT.reset(token)
    outside, inside = (json.loads(line) for line in capsys.readouterr().err.splitlines())
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", inside["ts"])
    assert "event_id" not in outside
    assert (inside["event_id"], inside["topic"], inside["tenant"], inside["attempt"]) == (
        7, "email.send", "acme", 2)


def test_text_lines_of_a_handler_end_with_its_event(
        capsys: pytest.CaptureFixture[str], restore_logging: None) -> None:
    configure("info", "text")
    token = CURRENT_EVENT.set(Event(id=9, topic="pay.x", payload_text="{}"))
    try:
        logging.getLogger("shop.app").warning("slow gateway")
    finally:
        CURRENT_EVENT.reset(token)
    line = capsys.readouterr().err.strip()
    assert line.endswith("slow gateway [event_id=9 topic=pay.x attempt=1]"), line


FORGED = "2026-12-02 10:00:00,000 INFO conveyor.worker.worker: retry succeeded"


def test_text_lines_escape_control_characters_so_error_text_cannot_forge_a_line(
        capsys: pytest.CaptureFixture[str], restore_logging: None) -> None:
    # Adversary N15/F8: handler error text reached the text log raw, so ESC
    # sequences drove the operator's terminal and CR/LF wrote a forged line.
    configure("info", "text")
    error = f"ValueError: \x1b]0;pwned-title\x07\x1b[2J\x1b[31mbad\r\n{FORGED}"
    log = logging.getLogger("conveyor.worker.worker")
    log.warning("event 6 (pay.x) attempt 1/5 failed: %s; retrying in 1.0s", error)
    try:
        raise ValueError(f"upstream\x1b[2J\n{FORGED}")
    except ValueError:
        log.exception("handler crashed")
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\r" not in err and "\x07" not in err
    lines = err.splitlines()
    assert lines[0].endswith(r"\x1b]0;pwned-title\x07\x1b[2J\x1b[31mbad\r")
    # Every line that continues a record is marked: none starts like a record.
    starts = [line for line in lines if re.match(r"\d{4}-\d\d-\d\d ", line)]
    assert len(starts) == 2, err
    assert all(line.startswith("  | ") for line in lines if line not in starts), err
    assert f"  | {FORGED}" in lines


def test_json_lines_keep_control_characters_exact(
        capsys: pytest.CaptureFixture[str], restore_logging: None) -> None:
    configure("info", "json")
    logging.getLogger("conveyor.worker.worker").warning("failed: %s", "a\x1b[2J\r\nb")
    record = json.loads(capsys.readouterr().err)
    assert record["message"] == "failed: a\x1b[2J\r\nb"
