"""Parsing human durations such as ``7d``, ``12h``, ``1h30m`` or ``90`` (seconds)."""

from __future__ import annotations

import re

from conveyor.errors import InvalidInputError

_UNITS = {"w": 604800.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_PART_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|w|d|h|m|s)")


def parse_duration(text: str) -> float:
    """Seconds in ``text``; refuses anything else with a message naming it."""
    raw = text.strip().lower()
    try:
        value = float(raw)
    except ValueError:
        pass
    else:
        if value >= 0 and value == value and value != float("inf"):
            return value
        raise InvalidInputError(f"invalid duration {text!r}: must be >= 0")
    pos = 0
    total = 0.0
    for match in _PART_RE.finditer(raw):
        if match.start() != pos:
            break
        total += float(match[1]) * _UNITS[match[2]]
        pos = match.end()
    if pos != len(raw) or not raw:
        raise InvalidInputError(
            f"invalid duration {text!r}: expected e.g. '90', '45s', '30m', '12h', '7d' or '1h30m'")
    return total
