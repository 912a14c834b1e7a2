"""What the CLI prints: text made safe for a terminal, and exact JSON.

Stored text (errors, tracebacks, payloads, topics, tenants, worker names)
comes from handlers and upstream services, so it may hold terminal escape
sequences, carriage returns or newlines that would retitle or clear the
operator's terminal, or forge a line of output. Every piece of it goes through
:func:`escape` (one line) or :func:`escape_lines` (a traceback: one output line
per stored line, each escaped) before it is printed as text. JSON output is
never escaped beyond JSON's own rules: scripts get the stored value exactly.
"""

from __future__ import annotations

import json
import re
import sys
import unicodedata
from typing import Any

# Printable ASCII needs no look-up; anything else is checked by category.
_SUSPECT = re.compile(r"[^\x20-\x7e]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# Control (Cc), format (Cf: bidi overrides, zero-width), surrogate,
# private-use and unassigned code points, and the Unicode line and paragraph
# separators: none of them belongs on an operator's screen as is.
_ESCAPED_CATEGORIES = {"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"}


def _escape_char(match: re.Match[str]) -> str:
    ch = match.group()
    if ch in _NAMED:
        return _NAMED[ch]
    if unicodedata.category(ch) not in _ESCAPED_CATEGORIES:
        return ch
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 \
        else f"\\U{code:08x}"


def escape(value: object) -> str:
    """``value`` as one line of plain text: ESC reads ``\\x1b``, CR ``\\r``, LF ``\\n``."""
    return _SUSPECT.sub(_escape_char, str(value))


def escape_lines(value: object) -> list[str]:
    """Multi-line text (a traceback) as lines, each escaped; only LF separates them."""
    return [escape(line) for line in str(value).split("\n")]


def say(*parts: object, sep: str = " ") -> None:
    """Print one line of text to stdout; callers escape stored values."""
    print(*parts, sep=sep)


def emit_json(data: Any) -> None:
    """Print ``data`` as one line of JSON (datetimes as ISO text)."""
    print(json.dumps(data, default=_default))


def _default(value: object) -> Any:
    isoformat = getattr(value, "isoformat", None)
    return isoformat() if callable(isoformat) else str(value)


def note(message: str) -> None:
    """One line for the operator on stderr (hints, progress), never mixed with stdout."""
    print(f"conveyor: {escape(message)}", file=sys.stderr)
