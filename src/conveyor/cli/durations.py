"""Parsing the command line's numbers: durations (``7d``, ``1h30m``, ``90``) and counts.

Both refuse, naming the text, what no field could take: a duration past 100
years, NaN, infinity, a count past PostgreSQL's ``integer``. Each config
field then checks its own, narrower range (:mod:`conveyor.config`).
"""

from __future__ import annotations

import math
import re

from conveyor.errors import InvalidInputError
from conveyor.validation import DELAY_MAX_SECONDS

_UNITS = {"w": 604800.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_PART_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|w|d|h|m|s)")

# The longest duration any flag takes, the same as the longest delay: durations
# end up in PostgreSQL interval arithmetic on timestamptz and in Python timers
# (threading.TIMEOUT_MAX is about 292 years), so 999999999999d is refused here,
# before any SQL, rather than as "interval out of range" from the database.
DURATION_MAX_SECONDS = DELAY_MAX_SECONDS
_DURATION_RANGE = f"between 0 and {DURATION_MAX_SECONDS / 86400:.0f}d (100 years)"
# PostgreSQL's integer: the widest column a count from the command line reaches.
COUNT_MAX = 2**31 - 1


def parse_duration(text: str) -> float:
    """Seconds in ``text``; refuses anything else with a message naming it."""
    raw = text.strip().lower()
    try:
        value = float(raw)
    except ValueError:
        value = _sum_of_units(text, raw)
    if math.isnan(value):
        raise InvalidInputError(f"invalid duration {text!r}: not a number ({_DURATION_RANGE})")
    if not 0 <= value <= DURATION_MAX_SECONDS:
        raise InvalidInputError(f"invalid duration {text!r}: must be {_DURATION_RANGE}")
    return value


def _sum_of_units(text: str, raw: str) -> float:
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


def parse_count(text: str) -> int:
    """A positive integer that fits PostgreSQL's ``integer``; refuses anything else, naming it."""
    try:
        value = int(text)
    except ValueError:
        raise InvalidInputError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise InvalidInputError(f"expected a positive integer, got {text!r}")
    if value > COUNT_MAX:
        raise InvalidInputError(f"expected an integer between 1 and {COUNT_MAX}, got {text!r}")
    return value
