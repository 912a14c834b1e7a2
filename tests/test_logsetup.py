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
