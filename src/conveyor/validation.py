"""Input checks that run before any SQL. Pure functions, no I/O.

Every refusal raises :class:`~conveyor.errors.InvalidInputError` with a
one-line message that names the offending value.
"""

from __future__ import annotations

import json
import math
import re
import threading
from datetime import datetime
from decimal import Decimal
from json import encoder as _json_encoder
from typing import Any

from conveyor.errors import InvalidInputError, PayloadTooLargeError

# Kept short so a NOTIFY payload (the topic, plus "|<epoch>" for a delayed
# event) stays under 128 bytes: a hint, never a message.
TOPIC_MAX_LENGTH = 100
IDEMPOTENCY_KEY_MAX_LENGTH = 255

# Dot-separated segments of letters, digits, '_' and '-'. No '*': a wildcard is
# a routing pattern, never the topic of an event.
_TOPIC_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9][A-Za-z0-9_-]*)*")
# A tenant becomes a DNS label (the Host header ``<tenant>.<domain>``), so it
# must be one: lowercase letters, digits and inner hyphens, 1-63 characters.
_TENANT_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
# Schema names enter SQL only through psycopg.sql.Identifier, and only after
# matching this deliberately narrow pattern.
_SCHEMA_RE = re.compile(r"(?!pg_)[a-z_][a-z0-9_]{0,39}")  # PostgreSQL reserves pg_*
# C0 and C1 controls, DEL, and the Unicode line and paragraph separators: each
# can break a line where a key is printed (logs, `conveyor show`).
_CONTROL_RE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def show(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters: how an error message names a value."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# Topics seen valid before; a producer uses a handful, so the regex runs once each.
KNOWN_TOPICS: set[str] = set()
KNOWN_TOPICS_MAX = 10_000


def check_topic(topic: object) -> str:
    if type(topic) is str and topic in KNOWN_TOPICS:
        return topic
    if not isinstance(topic, str):
        raise InvalidInputError(f"topic must be a string, got {show(topic)}")
    if not topic:
        raise InvalidInputError("topic must not be empty")
    if len(topic) > TOPIC_MAX_LENGTH:
        raise InvalidInputError(
            f"topic is {len(topic)} characters, the limit is {TOPIC_MAX_LENGTH}: {show(topic)}"
        )
    if not _TOPIC_RE.fullmatch(topic):
        raise InvalidInputError(
            f"malformed topic {show(topic)}: expected dot-separated segments of "
            "letters, digits, '_' and '-' (e.g. 'email.send')"
        )
    if type(topic) is str and len(KNOWN_TOPICS) < KNOWN_TOPICS_MAX:
        KNOWN_TOPICS.add(topic)
    return topic


def check_tenant(tenant: object) -> str | None:
    if tenant is None:
        return None
    if not isinstance(tenant, str) or not _TENANT_RE.fullmatch(tenant):
        raise InvalidInputError(
            f"invalid tenant {show(tenant)}: expected a DNS label "
            "(1-63 lowercase letters, digits or inner hyphens)"
        )
    return tenant


def check_idempotency_key(key: object) -> str | None:
    if key is None:
        return None
    if not isinstance(key, str) or not key:
        raise InvalidInputError(f"idempotency key must be a non-empty string, got {show(key)}")
    if len(key) > IDEMPOTENCY_KEY_MAX_LENGTH:
        raise InvalidInputError(
            f"idempotency key is {len(key)} characters, the limit is "
            f"{IDEMPOTENCY_KEY_MAX_LENGTH}: {show(key)}"
        )
    if _CONTROL_RE.search(key):
        raise InvalidInputError(f"idempotency key contains control characters: {show(key)}")
    if _has_surrogate(key):
        raise InvalidInputError(f"idempotency key is not valid Unicode (lone surrogate): {show(key)}")
    return key


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_schema_name(schema: object) -> str:
    if not isinstance(schema, str) or not _SCHEMA_RE.fullmatch(schema):
        raise InvalidInputError(
            f"invalid schema name {show(schema)}: expected 1-40 characters of lowercase "
            "letters, digits and '_', not starting with a digit or 'pg_'"
        )
    return schema


BIGINT_MAX = 2**63 - 1
# Far enough for any schedule, and well inside what timestamptz arithmetic accepts.
DELAY_MAX_SECONDS = 100 * 366 * 24 * 3600.0


def check_event_id(event_id: object) -> int:
    if isinstance(event_id, str) and re.fullmatch(r"[0-9]{1,19}", event_id.strip()):
        event_id = int(event_id.strip())
    if isinstance(event_id, bool) or not isinstance(event_id, int) or event_id <= 0:
        raise InvalidInputError(f"invalid event id {show(event_id)}: expected a positive integer")
    if event_id > BIGINT_MAX:
        raise InvalidInputError(f"invalid event id {event_id}: out of range")
    return event_id


_DELAY_RANGE = f"0 to {DELAY_MAX_SECONDS:.0f} seconds (100 years)"


def check_delay(delay: object) -> float:
    if isinstance(delay, bool) or not isinstance(delay, int | float):
        raise InvalidInputError(
            f"delay must be a number of seconds from {_DELAY_RANGE}, got {show(delay)}")
    try:
        seconds = float(delay)
    except OverflowError:
        raise InvalidInputError(f"delay must be from {_DELAY_RANGE}, got {show(delay)}") from None
    if math.isnan(seconds):
        raise InvalidInputError(f"delay must be a number from {_DELAY_RANGE}, got {delay!r}")
    if not 0 <= seconds <= DELAY_MAX_SECONDS:
        raise InvalidInputError(f"delay must be from {_DELAY_RANGE}, got {delay!r}")
    return seconds


def check_run_at(run_at: object) -> datetime | None:
    """An absolute due time: a timezone-aware datetime (a naive one names no moment)."""
    if run_at is None:
        return None
    if not isinstance(run_at, datetime):
        raise InvalidInputError(f"run_at must be a timezone-aware datetime, got {show(run_at)}")
    if run_at.tzinfo is None or run_at.utcoffset() is None:
        raise InvalidInputError(
            f"run_at must be timezone-aware (a naive datetime names no moment), got {run_at!r}")
    return run_at


def check_priority(priority: object) -> int:
    if isinstance(priority, bool) or not isinstance(priority, int) or not -32768 <= priority <= 32767:
        raise InvalidInputError(
            f"priority must be an integer from -32768 to 32767, got {show(priority)}"
        )
    return priority


def check_max_attempts(max_attempts: object) -> int:
    if (isinstance(max_attempts, bool) or not isinstance(max_attempts, int)
            or not 1 <= max_attempts <= 1000):
        raise InvalidInputError(
            f"max_attempts must be an integer from 1 to 1000, got {show(max_attempts)}"
        )
    return max_attempts


def _scan(value: Any, limit: int) -> None:
    """Refuse nesting past ``limit`` and strings jsonb cannot store (NUL, lone surrogates)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, str):
            _check_text(item)
        elif isinstance(item, dict):
            if level > limit:
                raise PayloadTooLargeError(f"payload nests deeper than the limit of {limit} levels")
            for key, v in item.items():
                if isinstance(key, str):
                    _check_text(key)
                stack.append((v, level + 1))
        elif isinstance(item, list | tuple):
            if level > limit:
                raise PayloadTooLargeError(f"payload nests deeper than the limit of {limit} levels")
            stack.extend((v, level + 1) for v in item)


def _check_text(text: str) -> None:
    if "\x00" in text:
        raise InvalidInputError(
            f"payload contains a NUL character (\\u0000), which jsonb refuses: {show(text)}")
    if _has_surrogate(text):
        raise InvalidInputError(f"payload contains a lone surrogate, not valid Unicode: {show(text)}")


# Keys sorted: jsonb sorts them anyway, and sorting is what finds colliding
# keys cheaply: a dict mixing str keys with int, float, bool or None keys (the
# only way two keys can become the same JSON string) cannot be sorted, so the
# encoder raises TypeError and _json_key_collision then looks for a real one.
_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"), ensure_ascii=False,
                            sort_keys=True)
_UNSORTED_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"), ensure_ascii=False)
_c_make_encoder = getattr(_json_encoder, "c_make_encoder", None)
_encoders = threading.local()


def _to_json(payload: object) -> str:
    """``_ENCODER.encode(payload)`` without rebuilding the C encoder on every call.

    Each thread keeps its own encoder, because the encoder's dict of objects
    being encoded (its circular-reference check) must not be shared; after any
    error it is rebuilt, since that dict may hold leftovers.
    """
    if _c_make_encoder is None or isinstance(payload, str):
        return _ENCODER.encode(payload)
    encode = getattr(_encoders, "encode", None)
    if encode is None:
        encode = _c_make_encoder({}, _ENCODER.default, _json_encoder.encode_basestring, None,
                                 ":", ",", True, False, False)
        _encoders.encode = encode
    try:
        return "".join(encode(payload, 0))
    except BaseException:
        _encoders.encode = None
        raise


def _json_key(key: object) -> str | None:
    """The JSON text of a dict key, as json stringifies it; None for a key it refuses."""
    if isinstance(key, str):
        return key
    if key is True or key is False or key is None:
        return {True: "true", False: "false", None: "null"}[key]
    if isinstance(key, int):
        return int.__repr__(key)
    if isinstance(key, float):
        return float.__repr__(key)
    return None


def _json_key_collision(payload: object) -> str | None:
    """A message naming two keys of one dict that JSON would merge (``1`` and ``"1"``), if any."""
    stack, seen_ids = [payload], set()
    while stack:
        item = stack.pop()
        if not isinstance(item, dict | list | tuple) or id(item) in seen_ids:
            continue
        seen_ids.add(id(item))
        if not isinstance(item, dict):
            stack.extend(item)
            continue
        names: dict[str, object] = {}
        for key, value in item.items():
            name = _json_key(key)
            if name is not None and name in names:
                return (f"payload has two keys that are both {name!r} in JSON "
                        f"({show(names[name])} and {show(key)}); jsonb would keep one of them")
            if name is not None:
                names[name] = key
            stack.append(value)
    return None


# A float Python prints with a positive exponent (from 1e16 up) and jsonb would
# print back without one, so it would decode as an int; string literals are
# matched too, only to be skipped.
_EXPONENT_FLOAT_RE = re.compile(r'"(?:[^"\\]|\\.)*"|(-?[0-9]+(?:\.[0-9]+)?e\+[0-9]+)')


def _positional(match: re.Match[str]) -> str:
    number = match[1]
    if number is None:
        return match[0]
    # The shortest repr has at most 17 digits, so from e+16 up the number is whole.
    return format(Decimal(number), "f") + ".0"


# An escaped NUL in the JSON text: "\u0000" not itself preceded by an escaping backslash.
_ESCAPED_NUL_RE = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


def _not_json(exc: ValueError) -> InvalidInputError:
    if "Out of range float" in str(exc):
        return InvalidInputError(
            "payload is not JSON: it contains NaN or Infinity (non-finite numbers)")
    return InvalidInputError(f"payload is not JSON-serialisable: {exc}")


def _encode_unsorted(payload: object) -> str:
    """After the sorted encoder's TypeError: colliding keys, mixed keys, or a value json refuses."""
    collision = _json_key_collision(payload)
    if collision is not None:
        raise InvalidInputError(collision)
    try:
        return _UNSORTED_ENCODER.encode(payload)
    except TypeError as exc:
        raise InvalidInputError(f"payload is not JSON-serialisable: {exc}") from None
    except ValueError as exc:
        raise _not_json(exc) from None
    except RecursionError:
        raise PayloadTooLargeError("payload nests too deeply to serialise") from None


def encode_payload(payload: object, *, max_bytes: int, max_depth: int) -> str:
    """Serialise ``payload`` to JSON text, refusing what PostgreSQL or the limits would not take.

    jsonb cannot store U+0000 and no lone surrogate encodes to UTF-8: both are
    refused here rather than fail inside the caller's transaction. The walk
    over the payload that names the offending value runs only when the JSON
    text shows a reason for it, so the common case costs one encode.
    """
    try:
        text = _to_json(payload)
    except TypeError:
        text = _encode_unsorted(payload)
    except ValueError as exc:
        raise _not_json(exc) from None
    except RecursionError:
        raise PayloadTooLargeError("payload nests too deeply to serialise") from None
    if "e+" in text:
        # jsonb would turn 1e+16 into 10000000000000000, an int to every reader:
        # written out with a ".0", the float comes back a float, exactly.
        text = _EXPONENT_FLOAT_RE.sub(_positional, text)
    # Each level of nesting needs a bracket, so few brackets prove a shallow
    # payload (and a text shorter than the limit cannot hold too many).
    suspicious = (len(text) > max_depth and text.count("[") + text.count("{") > max_depth) or (
        "\\u0000" in text and _ESCAPED_NUL_RE.search(text) is not None)
    if text.isascii():  # O(1) in CPython; ASCII text is its own UTF-8
        size = len(text)
    else:
        try:
            size = len(text.encode("utf-8"))
        except UnicodeEncodeError:
            suspicious = True
            size = 0
    if suspicious:
        _scan(payload, max_depth)  # raises, naming the value
    if not size:
        raise InvalidInputError("payload is not valid Unicode (lone surrogate)")
    if size > max_bytes:
        raise PayloadTooLargeError(
            f"payload is {size} bytes of JSON, the limit is {max_bytes} bytes"
        )
    return text


# Flow limits (conveyor.flow's routes, and an operator's overrides).
MAX_RUNNING_MAX = 1_000_000
RATE_MAX = 1_000_000.0
_RATE_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*/\s*(\d*)\s*([smh])\s*$")


def rate_per_second(rate: object) -> float | None:
    """Starts per second from ``"10/s"``, ``"600/m"``, ``"5/10s"``, ``"1000/h"``, or a
    number of starts per second; None unless it is more than 0 and at most RATE_MAX."""
    per_second = 0.0
    if isinstance(rate, int | float) and not isinstance(rate, bool):
        per_second = float(rate)
    elif isinstance(rate, str):
        match = _RATE_RE.match(rate)
        if match is not None:
            count, span, unit = float(match[1]), float(match[2] or 1), _RATE_UNITS[match[3]]
            per_second = count / (span * unit) if span else 0.0
    if not (math.isfinite(per_second) and 0 < per_second <= RATE_MAX):
        return None
    return per_second


# The longest partition of the history (0026), in seconds.
DAY = 86_400


def check_history_span(span: object, shown: str | None = None) -> int:
    """``span`` in whole seconds: a whole number of minutes that divides a day.

    So every day's partitions start at midnight UTC, whatever the span was
    before (0026's CHECK says the same in the database). ``shown``: the value
    as the user wrote it, for the error (default: its seconds).
    """
    if isinstance(span, bool) or not isinstance(span, (int, float)):
        raise InvalidInputError(f"history span must be a number of seconds, got {span!r:.60}")
    seconds = int(span)
    if seconds != span or not 60 <= seconds <= DAY or seconds % 60 or DAY % seconds:
        raise InvalidInputError(
            f"history span must be a whole number of minutes that divides a day (such as "
            f"10m, 15m, 1h, 6h or 1d), got {shown or f'{span:g} seconds'}")
    return seconds
